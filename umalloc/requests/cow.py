"""Copy-on-write of a request table's pages: whole-envelope copies ``old -> new`` on every end it covers.

* One envelope holds every layer of a page (the arena's page-major layout), so copying a page is copying its
  envelope; pairs are virtual pages, translated on each end through the allocator's ``v2p`` and copied only
  where both pages are bound there (Note [Copy-on-write] in :mod:`umalloc.requests.table`).
* On a CPU arena the envelopes are numpy views (one fancy-index copy per end); on CUDA one ``index_copy_`` per
  end on the caller's current stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from umalloc.allocator.facade import MultiEndedAllocator


class EnvelopeCopier:
    """Page copies on the ends ``ends`` of ``alloc``'s arena (owner thread).

    Args:
        alloc: the allocator. ends: the table's ends (its owner, then its bound ends).
    """

    __slots__ = ("_alloc", "_envelopes")

    def __init__(self, alloc: MultiEndedAllocator, ends: Sequence[str]) -> None:
        self._alloc = alloc
        on_cpu = alloc.arena.device.type == "cpu"
        self._envelopes: dict[str, np.ndarray | torch.Tensor] = {
            end: alloc.arena.envelopes(end).numpy() if on_cpu else alloc.arena.envelopes(end) for end in ends}

    def copy(self, pairs: np.ndarray) -> None:
        """Copy virtual page ``pairs[0, i]``'s envelope onto ``pairs[1, i]``'s on every end where both are bound.
        ``pairs``: ``int64 (2, n)``. O(n * page_bytes) per end."""
        for end, env in self._envelopes.items():
            phys = self._alloc.ends[end].v2p[pairs]
            both = (phys[0] > 0) & (phys[1] > 0)
            src, dst = phys[0][both], phys[1][both]
            if isinstance(env, np.ndarray):
                env[dst] = env[src]
            elif src.size:
                env.index_copy_(0, torch.from_numpy(dst).to(env.device), env.index_select(
                    0, torch.from_numpy(src).to(env.device)))


__all__ = ["EnvelopeCopier"]
