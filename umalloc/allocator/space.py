"""Capacity, the shortfall ladder's execution and compaction (a part of
:class:`~umalloc.allocator.facade.MultiEndedAllocator`).

* Capacity queries (:meth:`SpacePart.available_pages`, :meth:`~SpacePart.can_alloc`,
  :meth:`~SpacePart.shortfall_pages`) run the same band planner an allocation runs; they count holes and reachable
  gap only, never pending pages, never what compaction might free.
* A placement kernel that falls short comes back through :meth:`SpacePart._retry`: misuse raises, a shortfall
  applies the plan :func:`umalloc.pool.ladder.plan_shortfall` computes (Note [Shortfall] there), then runs the
  kernel once more. Plans execute through :func:`umalloc.pool.compaction.apply_plan` on the heap's writable views.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import numpy as np
import torch

from umalloc.allocator.ids import count_arg
from umalloc.errors import UmallocValueError
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, swa_tail_start
from umalloc.pool.compaction import CompactionReport, MovePlan, apply_plan
from umalloc.pool.heap import Heap
from umalloc.pool.kernels.codes import E_IDS, E_SHORT, OK
from umalloc.pool.ladder import plan_end, plan_shortfall, slide_plan
from umalloc.pool.pagestate import PAGE_HOLE

logger = logging.getLogger("umalloc.allocator.facade")


def _under_lease_lock(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``method`` holding the lease table's (reentrant) lock (Note [Lease threading]): a lease taken on
    another thread waits until the move plan is applied, so it never pins a page that is being moved."""
    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._leases.lock:
            return method(self, *args, **kwargs)

    return locked


class SpacePart:
    """Capacity and compaction methods of the allocator facade (the attributes below are set by its constructor)."""

    arena: Arena
    spec: ArenaSpec
    compaction_mode: str
    move_budget_pages: int | None
    debug_checks: bool
    last_shortfall: dict[str, int]
    ends: Mapping[str, Any]
    _heap: Heap
    _meta: np.ndarray
    _h64: np.ndarray
    _h8: np.ndarray
    _err: np.ndarray
    _chain: np.ndarray
    _pins: tuple[np.ndarray, ...]
    _names: tuple[str, ...]
    _index: dict[str, int]
    _mirror: dict[int, torch.Tensor]
    _active_leases: Mapping[int, Any]
    _end_index: Callable[[str], int]
    _raise: Callable[..., NoReturn]
    _tick: Callable[[], None]
    _refresh_mirror: Callable[[int, np.ndarray], None]
    check_invariants: Callable[[], None]

    def _short(self) -> dict[str, int]:
        """The per-end deficits of the last shortfall (F20), kept in :attr:`last_shortfall`."""
        E = len(self._names)
        self.last_shortfall = {self._names[e]: int(self._err[4 + e]) for e in range(E) if self._err[4 + e] > 0}
        logger.debug("allocation fell short: %s", self.last_shortfall)
        return self.last_shortfall

    def _retry(self, kernel: Callable[..., Any], args: tuple[Any, ...], mask: int, where: str) -> Any:
        """The slow path of a placement kernel that did not return OK (the hot path tests that inline): misuse
        raises (nothing changed); a shortfall runs the ladder (Note [Shortfall]) and the kernel once more.
        Returns the kernel's result, or None if the pages still do not fit (nothing changed)."""
        if self._err[0] == E_IDS:  # the owner's virtual id space is exhausted: no ladder can help
            self._short()
            return None
        if self._err[0] != E_SHORT:
            self._raise(where)
        if not self._retry_after_shortfall(int(self._err[2]), mask):
            return None
        res = kernel(*args)
        if self._err[0] != OK:
            self._short()
            return None
        return res

    @_under_lease_lock
    def _retry_after_shortfall(self, k: int, mask: int) -> bool:
        """Note [Shortfall] (:mod:`umalloc.pool.ladder`): record each end's deficit and -- unless compaction is
        off -- apply the ladder's plan (neighbour compaction, float slides) if its dry run says ``k`` pages on
        the ends of bind mask ``mask`` then fit. True if pages moved and the caller should plan once more."""
        deficits = self._short()
        if self.compaction_mode == "off" or not deficits:
            return False
        E = len(self._names)
        states = [self._heap.end_tables(e)[1] for e in range(E)]
        planned = plan_shortfall(self._meta, self._chain.tolist(), self._h8[mask: mask + E],
                                 {self._index[n] for n in deficits}, k, states, self._pins, self.move_budget_pages,
                                 self.spec.floor_bytes, self.spec.arena_bytes)
        if planned is None:
            return False
        plans, slides = planned
        for e, plan in plans.items():
            self._apply_plan(e, plan)
        for f, shift in slides.items():
            self._apply_slide(f, shift)
        return True

    def _apply_slide(self, f: int, shift: int) -> None:
        """Shift float end ``f``'s band by ``shift`` pages (Note [Float slide] in :mod:`umalloc.pool.ladder`)."""
        plan, wide_lo, wide_hi = slide_plan(*self._heap.band(f), shift)
        self._heap.end_tables(f)[1][plan.dst_pages] = PAGE_HOLE  # the band first widens over the gap, as holes
        self._heap.set_band(f, wide_lo, wide_hi)
        self._apply_plan(f, plan)

    def _plan_end(self, e: int, budget: int | None, free_edge: str = "high") -> MovePlan:
        """The compaction plan of end ``e`` (pure, :func:`umalloc.pool.ladder.plan_end`)."""
        return plan_end(self._meta, e, self._heap.end_tables(e)[1], self._pins[e], budget, free_edge)

    def _apply_plan(self, e: int, plan: MovePlan) -> CompactionReport:
        """Execute a plan of end ``e``: one batched envelope copy, tables, band, counters, bitmaps, mirror."""
        name = self._names[e]
        v = self.ends[name]
        p2v, state, v2p = self._heap.end_tables(e)
        apply_plan(self.arena, name, plan, state=state, p2v=p2v, v2p=v2p, pins=self._pins[e])
        self._heap.after_moves(e, plan.new_lo, plan.new_hi, plan.num_moves)
        if self._mirror and plan.num_moves:
            self._refresh_mirror(self._heap.owner_of(e), v.p2v[plan.dst_pages])
        if plan.num_moves:
            logger.debug("compaction of %r moved %d page(s); band [%d, %d)", name, plan.num_moves,
                         plan.new_lo, plan.new_hi)
        return CompactionReport.from_plan(name, plan, v.page_bytes)

    @_under_lease_lock
    def _after_free(self, touched_ends: Sequence[int]) -> None:
        """Eager compaction (``compaction="eager"``): after a free/release/unpin touched ``touched_ends``,
        compact each of them within the move budget (a float end toward its low edge)."""
        for e in touched_ends:
            plan = self._plan_end(e, self.move_budget_pages, "high")
            if plan.num_moves or plan.retreated_pages:
                self._apply_plan(e, plan)

    def available_pages(self, end: str) -> int:
        """Pages ``end`` can allocate now: its holes plus the gap it can reach between its neighbours' byte
        frontiers. Pending (leased, freed) pages are not counted. Ends sharing a gap each count all of it, so use
        :meth:`can_alloc` for several ends at once. O(ends).

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()
        >>> alloc.available_pages("full"), alloc.available_tokens("swa")
        (9, 18)
        """
        e = self._end_index(end)
        if self._active_leases:
            self._tick()
        return self._heap.free_pages(e)

    def available_tokens(self, end: str) -> int:
        """:meth:`available_pages` times ``page_size``."""
        return self.available_pages(end) * self._heap.page_size(self._end_index(end))

    def can_alloc(self, num_pages_by_end: Mapping[str, int]) -> bool:
        """True if every named end can take its page count *at the same time* (the joint plan over the shared
        gaps, exactly as an allocation would place them). O(ends).

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()
        >>> alloc.can_alloc({"full": 5, "swa": 4}), alloc.can_alloc({"full": 5, "swa": 5})
        (True, False)
        """
        return not self.shortfall_pages(num_pages_by_end)

    def shortfall_pages(self, num_pages_by_end: Mapping[str, int]) -> dict[str, int]:
        """Per end, the pages it would lack if every named end allocated its count now (ends that fit are
        omitted; an empty dict means everything fits). Each end is driven by its own deficit (F20). O(ends).

        >>> from umalloc.testing import small_allocator
        >>> small_allocator().shortfall_pages({"full": 6, "swa": 6})
        {'swa': 3}
        """
        if not isinstance(num_pages_by_end, Mapping):
            raise UmallocValueError(f"num_pages_by_end={num_pages_by_end!r}: allowed a mapping end -> pages")
        if self._active_leases:
            self._tick()
        E = len(self._names)
        need = np.zeros(E, np.int64)
        for name, k in num_pages_by_end.items():
            e = self._end_index(name)
            need[e] = max(0, count_arg(k, f"num_pages_by_end[{name!r}]") - self._heap.hole_pages(e))
        nlo, nhi, deficit = np.empty(E, np.int64), np.empty(E, np.int64), np.empty(E, np.int64)
        self._heap.plan_bands(need, nlo, nhi, deficit)
        return {self._names[e]: int(deficit[e]) for e in range(E) if deficit[e] > 0}

    @staticmethod
    def swa_tail_start(seq_len: int, window: int, prefix_len: int, page_size: int) -> int:
        """First token whose SWA page must exist: ``floor_to_page(max(prefix_len, seq_len - window))``.

        The one function prefill (what to send) and decode (what to keep: pages wholly before it may be released)
        use, so both work in the same units (tokens floored to the page) also when ``page_size > window``
        (F18/F19).

        Raises:
            UmallocValueError: negative lengths, ``window < 1``, ``page_size < 1`` or ``prefix_len > seq_len``.

        >>> from umalloc.allocator.facade import MultiEndedAllocator
        >>> MultiEndedAllocator.swa_tail_start(100, 32, 0, 16)     # window [68, 100): pages from token 64
        64
        >>> MultiEndedAllocator.swa_tail_start(10, 3, 0, 16)       # page_size > window: keep page 0
        0
        >>> MultiEndedAllocator.swa_tail_start(100, 32, 90, 16)    # the receiver holds 90 tokens already
        80
        """
        return swa_tail_start(seq_len, window, prefix_len, page_size)

    @_under_lease_lock
    def compact(self, end: str | None = None, *, budget_pages: int | None = None) -> CompactionReport:
        """Compact ``end`` (default: every end, in chain order): move the live pages at the far edge of its band
        into its holes nearest the anchor (:mod:`umalloc.pool.compaction`'s survivor walk), one batched envelope copy
        per end, then retreat the band past trailing holes. Virtual ids never change; pinned and pending pages
        are walls (never moved, never written, never retreated past). A float end compacts toward its low edge.

        Args:
            end: an end name, or ``None`` for all.
            budget_pages: most pages moved per end (``None``: unlimited; 0: only retreat).

        Returns:
            :class:`~umalloc.pool.compaction.CompactionReport` summed over the ends.

        Raises:
            UmallocValueError: unknown end or a bad budget.

        Complexity: O(band) planning + O(moved pages * page_bytes) bytes per end.

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()
        >>> vp = alloc.alloc_pages(3)                       # full 1 2 3
        >>> alloc.free(vp[:1] * 2)                          # page 1 becomes a hole
        >>> r = alloc.compact("full"); r.pages_moved, alloc.translate_pages(vp[1:], "full").tolist()
        (1, [2, 1])
        """
        if budget_pages is not None and (isinstance(budget_pages, bool) or not isinstance(budget_pages, int)
                                         or not 0 <= budget_pages < 1 << 63):
            raise UmallocValueError(f"budget_pages={budget_pages!r}: allowed None or an int in [0, 2**63)")
        if self._active_leases:
            self._tick()
        ends = [self._end_index(end)] if end is not None else self._chain.tolist()
        report = CompactionReport()
        for e in ends:
            plan = self._plan_end(e, budget_pages, "high")
            if plan.num_moves or plan.retreated_pages:
                report = report + self._apply_plan(e, plan)
            else:
                report = report + CompactionReport.from_plan(self._names[e], plan, self._heap.page_bytes(e))
        if self.debug_checks:
            self.check_invariants()
        return report



__all__ = ["SpacePart"]
