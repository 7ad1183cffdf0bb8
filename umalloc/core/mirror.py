"""Device mirrors of the ``v2p`` tables: one 2-D int64 tensor per owner group on the arena's CUDA device.

Policy:

* The host masters (:mod:`umalloc.core.heap`) are the truth; a mirror is a copy the device translation reads, so
  no allocator call waits on the GPU. After every call the allocator refreshes the columns of the virtual pages
  that call touched with one host->device copy and one column scatter (:func:`refresh`).
* Ids on the mirror's device are translated there by :mod:`umalloc.translators.cuda` with a mirror row as the
  table (:mod:`umalloc.core.translation`).
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
    rows at vids]`` and one column scatter. O(rows * len(vids))."""
    if vids.size == 0:
        return
    packed = np.empty((host.shape[0] + 1, vids.size), np.int64)
    packed[0] = vids
    packed[1:] = host[:, vids]
    dev = torch.from_numpy(packed).to(mirror.device)
    mirror.index_copy_(1, dev[0], dev[1:])


__all__ = ["make_mirrors", "refresh"]
