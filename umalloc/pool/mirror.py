"""Device mirrors of the ``v2p`` tables: one 2-D int64 tensor per owner group on the arena's CUDA device.

Policy:

* The host masters (:mod:`umalloc.pool.heap`) are the truth; a mirror is a copy the device translation reads, so
  no allocator call waits on the GPU. After every call the allocator refreshes the columns of the virtual pages
  that call touched with one host->device copy and one column scatter (:func:`refresh`).
* Ids on the mirror's device are translated there by :mod:`umalloc.translators.cuda` with a mirror row as the
  table (:mod:`umalloc.allocator.translation`).
* A mirror is allocated once and only ever written in place, so its address (and every row view handed out by
  the allocator's ``v2p``) is fixed for its lifetime: a CUDA graph captured over it reads the live table.

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


__all__ = ["make_mirrors", "refresh"]
