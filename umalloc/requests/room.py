"""Room for a request table's extend on its allocator, all or nothing (F29): the steps of Note [Room].

A :class:`Room` belongs to one :class:`~umalloc.requests.table.RequestTable` (which plans the extend and applies it
once room is made); it calls the allocator's public API only, and its allocator trials (Note [Trials] in
:mod:`umalloc.allocator.facade`) roll back every step that does not end in a fit.

Note [Room]
~~~~~~~~~~~
An extend first plans (validates, counts its ``k`` fresh pages, lists the window pages it unbinds) without
changing anything, then makes room on the allocator in the cheapest way that is sure to be all or nothing:

1. ``k`` pages fit on every end now (``shortfall_pages``): unbind the window pages, take the pages;
1b. else, if they fit once the window pages are unbound (each bound end then needs ``k`` minus the pages its
   window unbinds: an unbound page becomes a hole or gap of that end, when no lease pins it), the same: a
   decode past the window that crosses a page boundary on a full arena unbinds one page and takes one, with
   no trial;
2. else, in an allocator trial (Note [Trials] in :mod:`umalloc.allocator.facade`): unbind the window pages, take
   the pages with the allocator's compaction; kept if they fit, rolled back otherwise;
3. else, with cached pages: the fewest LRU-first cached pages whose eviction makes the extend fit. Those pages
   are evicted (``on_evict`` first, pages still allocated), then the extend is planned again and runs. If even the
   whole cache does not make it fit, nothing is evicted: an SWA shortfall that freed full pages cannot cover calls
   no ``on_evict`` (F29). How many:

   a. *the owner alone is short* (no window page to unbind, no lease active; the common case of a full-attention
      prefix cache): steps 1 and 2 are one call of the allocator's own ``alloc_pages`` (itself all or nothing, its
      compaction ladder included; no trial), and the count is the owner's shortfall without compaction, ``d``,
      read from ``shortfall_pages`` after that call refused (which changed nothing). A cached page is bound on
      the owner only and no lease pins it, so freeing it gives the owner exactly one page (a hole, or gap at its
      band's edge) and takes nothing from a bound end:
      ``d`` evictions make the extend fit and ``d - 1`` do not (without compaction; compaction alone already
      failed). If fewer than ``d`` pages are cached, step 3b decides (compaction may make up the rest). O(d +
      ends): no state is copied, the LRU list is walked ``d`` links;
   b. otherwise (a bound end short as well, window pages to unbind first, leases): found by rolled back trials
      (first without compaction, then with it; a binary search, as feasibility only grows with each evicted
      page). O(slots + virtual pages) per trial, ``O(log cached)`` trials.

Room on every end is needed at once: each fresh page is bound on the owner and on every bound end (the engine
writes every new token's KV on every end during its forward pass; the window then unbinds what it left at the
start of the next extend). :meth:`~umalloc.requests.table.RequestTable.can_extend` runs the same steps and rolls every one back.

Note [Chunked prefill]
~~~~~~~~~~~~~~~~~~~~~~
One extend of ``n`` tokens binds ``ceil(n / page_size)`` fresh pages on a windowed end, so a prompt that fits by
decode (a window's worth of pages at a time) may not fit in one extend. An engine prefills it in chunks, one
extend and one forward pass per chunk, each of at most :meth:`~umalloc.requests.table.RequestTable.max_extend_tokens` tokens: the window
unbinds at the start of each chunk's extend, so a windowed end holds at most the window plus one chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.errors import InvariantError
from umalloc.requests.refcounts import k_lru_walk


class Room:
    """Makes room for planned extends of one table (Note [Room]). Not thread-safe (the table's thread).

    Args:
        alloc: the table's allocator. owner: its id-owner end; owner_arg: the ``owner=`` its calls pass.
        bound_ends: the owner's bound ends, in the table's order (window unbinds are listed per end).
        pagebuf: the table's ``int64 (num_vpages,)`` buffer the fresh pages are written into.
        cached_pages: the table's LRU-ordered cached pages (a callable: the list changes).
    """

    def __init__(self, alloc: MultiEndedAllocator, owner: str, owner_arg: str | None, bound_ends: tuple[str, ...],
                 pagebuf: np.ndarray, cached_pages: Callable[[], torch.Tensor], lru: np.ndarray) -> None:
        self.alloc, self.owner, self.owner_arg, self.bound_ends = alloc, owner, owner_arg, bound_ends
        self.pagebuf, self.cached_pages, self.lru = pagebuf, cached_pages, lru
        self._none = np.zeros(0, np.int64)
        self._need_all = {owner: 0, **{b: 0 for b in bound_ends}}

    def shortfall(self, k: int) -> dict[str, int]:
        """Per end, the pages ``k`` fresh pages on every end would lack now, without unbind, eviction or
        compaction (``{}``: they fit). O(ends)."""
        if k == 0:
            return {}
        need = self._need_all
        for end in need:
            need[end] = k
        return self.alloc.shortfall_pages(need)

    def plain(self, unbinds: list[np.ndarray]) -> bool:
        """No window page to unbind and no lease active: the case of steps 2 and 3a without a trial (Note
        [Room])."""
        return not any(p.size for p in unbinds) and not self.alloc.leases_active()

    def owner_deficit(self, short: dict[str, int]) -> int:
        """Step 3a of Note [Room]: the owner's deficit when it alone is short in ``short``; 0 otherwise."""
        return short[self.owner] if len(short) == 1 and self.owner in short else 0

    def cached_at_least(self, n: int) -> bool:
        """True if ``n`` or more pages are cached. O(n) (the LRU list walked ``n`` links)."""
        return int(k_lru_walk(self.lru, self._none, n)) >= n

    def place(self, k: int, unbinds: list[np.ndarray]) -> bool:
        """On the allocator only: unbind the window pages ``unbinds`` (per bound end), then take ``k`` fresh pages
        into ``pagebuf[:k]``. False if they do not fit (the unbinds stay: callers run this in a trial)."""
        for end, pages in zip(self.bound_ends, unbinds, strict=True):
            if pages.size:
                self.alloc.unbind_pages(end, pages)
        return k == 0 or self.alloc.alloc_pages(k, out=self.pagebuf[:k], owner=self.owner_arg) is not None

    def fits_after_unbind(self, k: int, unbinds: list[np.ndarray]) -> bool:
        """True if ``k`` fresh pages fit on every end, without eviction or compaction, once the window pages
        ``unbinds`` are unbound (step 1b of Note [Room]); False whenever a lease is active (a pinned page
        unbound becomes pending, not free). O(ends)."""
        if k == 0 or not any(p.size for p in unbinds) or self.alloc.leases_active():
            return False
        need = {self.owner: k}
        for end, pages in zip(self.bound_ends, unbinds, strict=True):
            need[end] = max(0, k - int(pages.size))
        return not self.alloc.shortfall_pages(need)

    def _keep(self, unbinds: list[np.ndarray], evicted: np.ndarray) -> dict[str, np.ndarray]:
        """Physical pages whose bytes a trial with compaction must keep: the window pages and cached pages it
        frees (Note [Trials] in :mod:`umalloc.allocator.facade`)."""
        keep: dict[str, np.ndarray] = {}
        for end, pages in ((self.owner, evicted), *zip(self.bound_ends, unbinds, strict=True)):
            if pages.size:
                keep[end] = np.asarray(self.alloc.translate_pages(torch.from_numpy(pages), end), dtype=np.int64)
        return keep

    def trial_fits(self, k: int, unbinds: list[np.ndarray], evicted: np.ndarray, compaction: bool,
                   commit: bool) -> bool:
        """Run "free ``evicted`` (cached pages, no ``on_evict``), unbind the window pages, take ``k`` pages" in an
        allocator trial; keep it only if ``commit`` and it fits (Note [Room])."""
        keep = self._keep(unbinds, evicted) if compaction else None
        with self.alloc.trial(compaction=compaction, keep_bytes=keep) as trial:
            if evicted.size:
                self.alloc.free_pages(evicted, owner=self.owner_arg)
            ok = self.place(k, unbinds)
            if ok and commit:
                trial.commit()
        return ok

    def evictions_needed(self, k: int, unbinds: list[np.ndarray]) -> int | None:
        """The fewest cached pages, LRU first, whose eviction lets the planned extend fit (``None``: not even the
        whole cache does). Trials without compaction first, then with it (Note [Room]). O(log cached) trials."""
        lru = self.cached_pages().numpy()
        if not lru.size:
            return None
        for compaction in (False, True):
            if not self.trial_fits(k, unbinds, lru, compaction, False):
                continue
            lo, hi = 1, lru.size     # fits with hi pages evicted; find the least
            while lo < hi:
                mid = (lo + hi) // 2
                if self.trial_fits(k, unbinds, lru[:mid], compaction, False):
                    hi = mid
                else:
                    lo = mid + 1
            return hi
        return None

    def make(self, k: int, unbinds: list[np.ndarray]) -> bool | int:
        """Make room for a planned extend (Note [Room]): True once the window pages are unbound and
        ``pagebuf[:k]`` holds ``k`` fresh pages; an int ``n > 0`` if it fits only once the ``n`` least recently used
        cached pages are evicted (nothing done yet); False if it cannot fit (nothing changed)."""
        if k >= self.pagebuf.shape[0]:   # more than the owner's whole id space: nothing can help
            return False
        if self.plain(unbinds):
            # steps 1 and 2 are the allocator's own alloc_pages (all or nothing, its compaction ladder included)
            if k == 0 or self.alloc.alloc_pages(k, out=self.pagebuf[:k], owner=self.owner_arg) is not None:
                return True
            d = self.owner_deficit(self.shortfall(k))   # the refused call changed nothing
            if d and self.cached_at_least(d):          # 3a
                return d
            n = self.evictions_needed(k, unbinds)        # 3b
            return False if n is None else n
        short = self.shortfall(k)
        if not short or self.fits_after_unbind(k, unbinds):   # steps 1, 1b (the window unbinds only add room)
            if not self.place(k, unbinds):
                raise InvariantError("extend: the allocator refused pages its planner said fit")
            return True
        if self.trial_fits(k, unbinds, self._none, True, True):
            return True
        n = self.evictions_needed(k, unbinds)
        return False if n is None else n

    def capacity(self, cached: int) -> dict[str, dict[str, int]]:
        """:meth:`~umalloc.requests.table.RequestTable.capacity` given the table's ``cached`` page count. O(ends)."""
        out = {}
        for end in (self.owner, *self.bound_ends):
            free = self.alloc.available_pages(end)
            rec = cached if end == self.owner else 0
            out[end] = {"free_pages": free, "reclaimable_pages": rec, "available_pages": free + rec}
        return out

    def fits(self, k: int, unbinds: list[np.ndarray]) -> bool:
        """Whether :meth:`make` would make room (with the evictions it would make); changes nothing."""
        if k >= self.pagebuf.shape[0]:
            return False
        short = self.shortfall(k)
        if not short or self.fits_after_unbind(k, unbinds):
            return True
        d = self.owner_deficit(short) if self.plain(unbinds) else 0
        if d and self.cached_at_least(d):   # step 3a: d evictions make it fit
            return True
        if self.trial_fits(k, unbinds, self._none, True, False):
            return True
        lru = self.cached_pages().numpy()
        return bool(lru.size) and any(self.trial_fits(k, unbinds, lru, c, False) for c in (False, True))


def largest(fits: Callable[[int], bool], hi: int) -> int:
    """The largest ``n`` in ``[0, hi]`` with ``fits(n)`` (``fits`` monotone, ``fits(0)`` assumed). O(log hi) calls."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


__all__ = ["Room", "largest"]
