"""Device mirrors of the ``v2p`` tables: one 2-D int64 tensor per owner group on the arena's CUDA device.

Policy:

* The host masters (:mod:`umalloc.core.heap`) are the truth; a mirror is a copy the device translation reads, so
  no allocator call waits on the GPU. After every call the allocator refreshes the columns of the virtual pages
  that call touched with one host->device copy and one column scatter (:func:`refresh`).
* A mirror is allocated once and only ever written in place, so its address (and every row view handed out by
  the allocator's ``v2p``) is fixed for its lifetime: a CUDA graph captured over it reads the live table.
* :func:`translate_on_device` is the device translation of ids that live on the mirror's device: validated first
  (range, tombstones in strict mode), so a refused call writes nothing into ``out``.

Note [Mirror stream ordering]
    :func:`refresh` enqueues its copy and its scatter on the *caller's current stream* of the mirror's device
    and returns without waiting: the staging block is pinned host memory that torch's caching host allocator
    keeps until the copy has run (the copy records an event on it), so the host never waits on the GPU.
    No translate ever reads a half-updated mirror, by stream order rather than timing:

    * work enqueued on that stream before the allocator call (an earlier graph replay, a translate) runs to
      completion before the copy starts, so it reads the whole old table;
    * work enqueued on that stream after the call starts after the scatter has finished, so it reads the whole
      new table -- a replay needs no synchronisation in between;
    * work on *another* stream is ordered only by the caller (``stream.wait_stream`` / events), as for any
      tensor torch writes; the allocator never synchronises streams for it.

    The host masters change at the call itself, so a host translation after the call already sees the new
    table; device readers see it in stream order.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from umalloc.core.ids import ReadOnlyTable
from umalloc.errors import InvalidIdError, TombstoneError


def make_mirrors(host2d: Mapping[int, np.ndarray], device: torch.device) -> dict[int, torch.Tensor]:
    """Per owner, a copy of its ``(rows, num_vpages)`` v2p block on ``device``."""
    return {o: torch.from_numpy(block).to(device, copy=True) for o, block in host2d.items()}


def refresh(mirror: torch.Tensor, host: np.ndarray, vids: np.ndarray) -> None:
    """Copy the columns ``vids`` of the host block ``host`` into ``mirror``: one host->device copy of ``[vids; v2p
    rows at vids]`` and one column scatter, both on the current stream, no host wait on a CUDA mirror (Note
    [Mirror stream ordering]). O(rows * len(vids))."""
    if vids.size == 0:
        return
    cuda = mirror.device.type == "cuda"
    staged = torch.empty((host.shape[0] + 1, vids.size), dtype=torch.int64, pin_memory=cuda)
    packed = staged.numpy()
    packed[0] = vids
    packed[1:] = host[:, vids]
    dev = staged.to(mirror.device, non_blocking=cuda)
    mirror.index_copy_(1, dev[0], dev[1:])


def translate_on_device(row: torch.Tensor, ids: torch.Tensor, page_size: int, lim: int, strict: bool,
                        out: torch.Tensor | None, end: str, where: str) -> torch.Tensor:
    """Physical ids of one end for ``ids`` (virtual tokens; pages with ``page_size = 1``) against its mirror row
    ``row``: ``row[t // ps] * ps + t % ps``; ``lim``: one past the largest id. All checks before ``out`` is
    written. Raises InvalidIdError (dtype, shape, range, a bad ``out``), TombstoneError (strict, unbound)."""
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 1:
        raise InvalidIdError(f"{where}: dtype {ids.dtype}, shape {tuple(ids.shape)}; allowed 1-D torch.int64 "
                             f"(or int32)")
    if out is not None and (not isinstance(out, torch.Tensor) or isinstance(out, ReadOnlyTable)
                            or out.dtype is not torch.int64 or out.shape != ids.shape or out.device != ids.device):
        raise InvalidIdError(f"{where}: out must be a caller-owned int64 tensor of shape {tuple(ids.shape)} on "
                             f"{ids.device}")
    ids = ids.to(torch.int64)
    if ids.numel() and bool(((ids < 0) | (ids >= lim)).any()):
        raise InvalidIdError(f"{where}: an id is out of range for end {end!r}: allowed [0, {lim})")
    vp = ids if page_size == 1 else torch.div(ids, page_size, rounding_mode="floor")
    phys = row[vp]
    if strict:
        if phys.numel() and bool((phys < 0).any()):
            raise TombstoneError(f"{where}: an id is tombstoned (unbound) on end {end!r}; strict=False maps it to "
                                 f"the sink")
    else:
        phys = phys.clamp_min(0)
    res = phys if page_size == 1 else phys * page_size + (ids - vp * page_size)
    if out is not None:
        out.copy_(res)
        return out
    return res


__all__ = ["make_mirrors", "refresh", "translate_on_device"]
