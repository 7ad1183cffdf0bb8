"""SGLang 0.5.23's capacity rules for its unified full + SWA pool, as pure functions of a two-end arena's state.

SGLang prices every allocation of its ``UnifiedSWATokenToKVPoolAllocator`` against the shared byte envelope of one
buffer: the full and SWA sub-pools grow from opposite ends, each page of end ``e`` takes ``page_bytes[e]`` bytes,
and an allocation of ``k`` virtual pages takes ``k`` pages of *both* ends. These functions compute the numbers
SGLang's class reports and gates on (its ``available_size``, ``full_available_size``/``swa_available_size``, the
page-demand check of ``ensure_capacity``) from an :class:`EndState` per end, which
:mod:`umalloc.integrations.sglang.unified` reads from umalloc's :class:`~umalloc.MultiEndedAllocator`.

:class:`EndAccounting` reads that state from umalloc's two end views, counting the pages SGLang would still hold
as holes (Note [Deferred boundary pages]).

Units: pages unless a name says tokens or bytes. Nothing here imports SGLang or torch; every function is O(1).

Why the numbers agree although umalloc retreats a band when its frontier page is freed and SGLang keeps that page
as a hole until its next flush: every rule below depends on ``holes + index room`` and on ``gap + holes * page
bytes``, and a retreat of ``r`` pages moves ``r`` from holes to index room and ``r * page_bytes`` from holes to
gap, so both sums are unchanged (the differential in tests/integrations checks it op by op).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from umalloc import Grow


@dataclass(frozen=True)
class EndState:
    """One end at one instant.

    Attributes:
        page_bytes: bytes of one page. capacity_pages: pages the end can ever hold (``top - first + 1``).
        band_pages: pages between the end's anchor and its frontier (live + holes + pending).
        live_pages: pages holding a live virtual page. hole_pages: free pages inside the band.
    """

    page_bytes: int
    capacity_pages: int
    band_pages: int
    live_pages: int
    hole_pages: int

    @property
    def index_room(self) -> int:
        """Pages the frontier can still advance by in the end's own id space (SGLang's ``num_pages -
        min_page_index - allocated_pages``)."""
        return self.capacity_pages - self.band_pages


def end_available_pages(end: EndState, gap_bytes: int, *, lazy: bool, extra_gap_bytes: int = 0) -> int:
    """Pages ``end`` can take alone: its frontier's room in bytes and index space, plus (lazy) its holes.

    >>> e = EndState(page_bytes=32, capacity_pages=10, band_pages=4, live_pages=3, hole_pages=1)
    >>> end_available_pages(e, 96, lazy=True), end_available_pages(e, 96, lazy=False)
    (4, 3)
    """
    extend = min((gap_bytes + extra_gap_bytes) // end.page_bytes, end.index_room)
    return extend + (end.hole_pages if lazy else 0)


def joint_available_pages(full: EndState, swa: EndState, gap_bytes: int, *, lazy: bool) -> int:
    """Virtual pages an allocation can take on both ends at once (SGLang's joint ``available_size``, in pages).

    Eager (no holes): the gap split at ``page_bytes_full + page_bytes_swa`` a page, capped by both index rooms.
    Lazy: first both ends drain holes, then the end with fewer holes extends into the gap while the other keeps
    draining, then both extend; capped by each end's holes plus index room.

    >>> f = EndState(32, 10, 4, 3, 1); s = EndState(32, 10, 2, 2, 0)
    >>> joint_available_pages(f, s, 128, lazy=False), joint_available_pages(f, s, 128, lazy=True)
    (2, 2)
    """
    e_f, e_s = full.page_bytes, swa.page_bytes
    if not lazy:
        return min(gap_bytes // (e_f + e_s), full.index_room, swa.index_room)
    h_f, h_s = full.hole_pages, swa.hole_pages
    both_drain = min(h_f, h_s)
    e_one, one_max = (e_f, h_s) if h_f <= h_s else (e_s, h_f)
    one_room = one_max - both_drain
    one = min(one_room, gap_bytes // e_one)
    both_extend = (gap_bytes - one * e_one) // (e_f + e_s)
    return min(both_drain + one + both_extend, h_f + full.index_room, h_s + swa.index_room)


def fits_page_demand(full: EndState, swa: EndState, gap_bytes: int, num_full_pages: int, num_swa_pages: int, *,
                     free_virtual_pages: int, virtual_capacity_pages: int, empty_gap_bytes: int,
                     compacted: bool, full_reclaim_pages: int = 0, swa_reclaim_pages: int = 0,
                     empty_pool: bool = False) -> bool:
    """Whether ``num_full_pages`` full and ``num_swa_pages`` SWA pages fit at once (SGLang's
    ``_fits_page_demand``). ``compacted``: as if both ends had no holes (the state after a flush).

    Args:
        free_virtual_pages: virtual page ids the owner can still mint. virtual_capacity_pages: all of them.
        empty_gap_bytes: the gap of the empty arena (what a flush can give back at most).
        full_reclaim_pages / swa_reclaim_pages: live pages of each end priced as freed first (each capped at the
            end's live pages; a freed page becomes a hole, or with ``compacted`` gives its bytes to the gap).
        empty_pool: price against the empty arena (live pages and reclaims ignored; pass ``compacted=True``).
    """
    if min(num_full_pages, num_swa_pages) < 0:
        return False
    if empty_pool:
        full_reclaim = swa_reclaim = full_live = swa_live = 0
    else:
        full_reclaim = min(full.live_pages, max(0, full_reclaim_pages))
        swa_reclaim = min(swa.live_pages, max(0, swa_reclaim_pages))
        full_live, swa_live = full.live_pages - full_reclaim, swa.live_pages - swa_reclaim
    full_cap = min(virtual_capacity_pages, full.capacity_pages)
    swa_cap = min(virtual_capacity_pages, swa.capacity_pages)
    if full_live + num_full_pages > full_cap or swa_live + num_swa_pages > swa_cap:
        return False
    if compacted:
        virtual_room = virtual_capacity_pages - full_live
        full_holes = swa_holes = 0
        full_room = full_cap - full_live
        swa_room = swa_cap - swa_live
        gap = empty_gap_bytes - full_live * full.page_bytes - swa_live * swa.page_bytes
    else:
        virtual_room = free_virtual_pages + full_reclaim
        full_holes, swa_holes = full.hole_pages + full_reclaim, swa.hole_pages + swa_reclaim
        full_room, swa_room = full.index_room, swa.index_room
        gap = gap_bytes
    if num_full_pages > virtual_room or num_full_pages > full_holes + full_room or \
            num_swa_pages > swa_holes + swa_room:
        return False
    full_ext = max(0, num_full_pages - full_holes)
    swa_ext = max(0, num_swa_pages - swa_holes)
    return full_ext * full.page_bytes + swa_ext * swa.page_bytes <= max(0, gap)


class EndAccounting:
    """The full and SWA ends of a unified arena as SGLang's accounting sees them: umalloc's end views plus the
    pages each end retreated that SGLang's lazy pools would still hold as holes (Note [Deferred boundary pages]).

    Args:
        full_view, swa_view: the allocator's end views (``allocator.ends["full"]`` / ``["swa"]``: ``lo``, ``hi``,
            ``page_bytes``, ``live_pages``, ``hole_pages``, ``grow``...), read live. lazy: SGLang's lazy compaction
            (in eager mode nothing is deferred).

    Threading: the scheduler thread. Every method O(1).
    """

    def __init__(self, full_view: Any, swa_view: Any, *, lazy: bool) -> None:
        self.views = (full_view, swa_view)
        self.lazy = lazy
        #: pages per end (full, swa) that SGLang would still count as holes
        self.deferred = [0, 0]

    @staticmethod
    def state_of(view: Any, deferred: int) -> EndState:
        """One end view as an :class:`EndState`, ``deferred`` retreated pages counted as holes in the band."""
        return EndState(page_bytes=view.page_bytes, capacity_pages=view.top_page - view.first_page + 1,
                        band_pages=view.hi - view.lo + deferred, live_pages=view.live_pages,
                        hole_pages=view.hole_pages + deferred)

    def end_states(self) -> tuple[EndState, EndState]:
        """``(full, swa)`` as SGLang's accounting sees them now."""
        d = self.deferred
        return self.state_of(self.views[0], d[0]), self.state_of(self.views[1], d[1])

    def gap_bytes(self) -> int:
        """Bytes between the two bands, less the deferred pages (which SGLang still holds). >= 0."""
        f, s = self.views
        up, down = (f, s) if f.grow is Grow.UP else (s, f)
        gap = down.lo * down.page_bytes - up.hi * up.page_bytes
        return max(0, gap - self.deferred[0] * f.page_bytes - self.deferred[1] * s.page_bytes)

    def reset(self) -> None:
        """After a flush that compacted both ends: nothing is deferred (SGLang's flush absorbs its holes)."""
        self.deferred = [0, 0]

    # Note [Deferred boundary pages]
    # umalloc retreats a band the moment its frontier page is freed (no page moves); SGLang's lazy pools keep
    # such pages as holes until their next flush that may move pages. So that every size the unified class
    # reports and every refusal is SGLang's, ``deferred[e]`` counts the pages end ``e`` retreated that SGLang
    # would still hold as holes: they count as holes inside the band and not as gap. A flush (gate open) absorbs
    # them, as SGLang's does; an allocation drains SGLang's lowest holes first, so they are used last.
    @contextlib.contextmanager
    def tracked(self) -> Iterator[None]:
        """Wrap one umalloc call that allocates or frees: afterwards the deferred counts follow what it did."""
        before = tuple((v.hi - v.lo, v.hole_pages, v.live_pages) for v in self.views)
        try:
            yield
        finally:
            self._account(before)

    def _account(self, before: tuple[tuple[int, int, int], ...]) -> None:
        if not self.lazy:
            return
        for e, view in enumerate(self.views):
            band_b, holes_b, live_b = before[e]
            d = self.deferred[e]
            taken = max(0, view.live_pages - live_b)
            if taken:
                d = min(d, max(0, holes_b + d - taken))
            self.deferred[e] = d + max(0, band_b - (view.hi - view.lo))


__all__ = ["EndAccounting", "EndState", "end_available_pages", "fits_page_demand", "joint_available_pages"]
