"""The allocator's space service: capacity, the shortfall ladder's execution and compaction.

* Capacity queries (:meth:`SpaceService.available_pages`, :meth:`~SpaceService.can_alloc`,
  :meth:`~SpaceService.shortfall_pages`) run the same band planner an allocation runs; they count holes and
  reachable gap only, never pending pages, never what compaction might free.
* A placement kernel that falls short comes back through :meth:`SpaceService.retry`: misuse raises, a shortfall
  applies the plan :func:`umalloc.pool.ladder.plan_shortfall` computes (Note [Shortfall] there), then runs the
  kernel once more. Plans execute through :func:`umalloc.pool.compaction.apply_plan` on the heap's writable views.
* The service owns the compaction policy (``compaction_mode``, ``move_budget_pages``, ``eager``) and the last
  shortfall record; a trial (Note [Trials] in :mod:`umalloc.allocator.facade`) switches the policy off while it
  runs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from umalloc.allocator.calls import AfterCall, KernelEntry
from umalloc.allocator.ends import EndIndex
from umalloc.allocator.leasing import LeaseService
from umalloc.errors import UmallocValueError
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec
from umalloc.ids import count_arg
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
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class SpaceService:
    """Capacity and compaction of one allocator's ends (owner thread; compaction holds the lease table's lock).

    Args:
        heap, arena, spec: the allocator's heap, arena and geometry.
        ends, entry, leasing, after_call: the allocator's end index, kernel entry, lease service and after-call
            work.
        compaction: ``"lazy"``, ``"eager"`` or ``"off"`` (validated by the facade).
        move_budget_pages: most pages one lazy compaction may move per call (``None``: unbounded).

    Attributes:
        compaction_mode, move_budget_pages: the policy. eager: ``compaction_mode == "eager"`` (off inside
        :meth:`compaction_off`). last_shortfall: end name -> pages lacking in the last allocation that fell short (F20).
    """

    __slots__ = ("_after_call", "_arena", "_ends", "_entry", "_heap", "_leasing", "_lock", "_spec",
                 "compaction_mode", "eager", "last_shortfall", "move_budget_pages")

    def __init__(self, heap: Heap, arena: Arena, spec: ArenaSpec, ends: EndIndex, entry: KernelEntry,
                 leasing: LeaseService, after_call: AfterCall, *, compaction: str,
                 move_budget_pages: int | None) -> None:
        self._heap = heap
        self._arena = arena
        self._spec = spec
        self._ends = ends
        self._entry = entry
        self._leasing = leasing
        self._lock = leasing.table.lock
        self._after_call = after_call
        self.compaction_mode = compaction
        self.eager = compaction == "eager"
        self.move_budget_pages = move_budget_pages
        self.last_shortfall: dict[str, int] = {}


    @contextlib.contextmanager
    def compaction_off(self, off: bool = True) -> Iterator[None]:
        """Inside the ``with`` block compaction is off (no byte moves) when ``off``; the policy is back on
        leaving it (Note [Trials] in :mod:`umalloc.allocator.facade`). O(1)."""
        mode, eager = self.compaction_mode, self.eager
        if off:
            self.compaction_mode, self.eager = "off", False
        try:
            yield
        finally:
            self.compaction_mode, self.eager = mode, eager
    def _short(self) -> dict[str, int]:
        """The per-end deficits of the last shortfall (F20), kept in :attr:`last_shortfall`."""
        names, err = self._ends.names, self._entry.err
        self.last_shortfall = {names[e]: int(err[4 + e]) for e in range(len(names)) if err[4 + e] > 0}
        logger.debug("allocation fell short: %s", self.last_shortfall)
        return self.last_shortfall

    def retry(self, kernel: Callable[..., Any], args: tuple[Any, ...], mask: int, where: str) -> Any:
        """The slow path of a placement kernel that did not return OK (the hot path tests that inline): misuse
        raises (nothing changed); a shortfall runs the ladder (Note [Shortfall]) and the kernel once more.
        Returns the kernel's result, or None if the pages still do not fit (nothing changed)."""
        err = self._entry.err
        if err[0] == E_IDS:  # the owner's virtual id space is exhausted: no ladder can help
            self._short()
            return None
        if err[0] != E_SHORT:
            self._entry.raise_error(where)
        if not self._retry_after_shortfall(int(err[2]), mask):
            return None
        res = kernel(*args)
        if err[0] != OK:
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
        heap = self._heap
        E = len(self._ends.names)
        states = [heap.end_tables(e)[1] for e in range(E)]
        planned = plan_shortfall(heap.meta, heap.chain.tolist(), heap.h8[mask: mask + E],
                                 {self._ends.index[n] for n in deficits}, k, states, heap.pins,
                                 self.move_budget_pages, self._spec.floor_bytes, self._spec.arena_bytes)
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
        return plan_end(self._heap.meta, e, self._heap.end_tables(e)[1], self._heap.pins[e], budget, free_edge)

    def _apply_plan(self, e: int, plan: MovePlan) -> CompactionReport:
        """Execute a plan of end ``e``: one batched envelope copy, tables, band, counters, bitmaps, mirror."""
        name = self._ends.names[e]
        p2v, state, v2p = self._heap.end_tables(e)
        apply_plan(self._arena, name, plan, state=state, p2v=p2v, v2p=v2p, pins=self._heap.pins[e])
        self._heap.after_moves(e, plan.new_lo, plan.new_hi, plan.num_moves)
        if plan.num_moves:
            self._after_call.refresh(self._heap.owner_of(e), p2v[plan.dst_pages])
        if plan.num_moves:
            logger.debug("compaction of %r moved %d page(s); band [%d, %d)", name, plan.num_moves,
                         plan.new_lo, plan.new_hi)
        return CompactionReport.from_plan(name, plan, self._heap.page_bytes(e))

    @_under_lease_lock
    def after_free(self, touched_ends: Sequence[int]) -> None:
        """Eager compaction (``compaction="eager"``): after a free/unbind/unpin touched ``touched_ends``,
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
        e = self._ends.end(end)
        if self._leasing.work:
            self._leasing.tick()
        return self._heap.free_pages(e)

    def available_tokens(self, end: str) -> int:
        """:meth:`available_pages` times ``page_size``."""
        return self.available_pages(end) * self._heap.page_size(self._ends.end(end))

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
        if self._leasing.work:
            self._leasing.tick()
        E = len(self._ends.names)
        need = np.zeros(E, np.int64)
        for name, k in num_pages_by_end.items():
            e = self._ends.end(name)
            need[e] = max(0, count_arg(k, f"num_pages_by_end[{name!r}]") - self._heap.hole_pages(e))
        nlo, nhi, deficit = np.empty(E, np.int64), np.empty(E, np.int64), np.empty(E, np.int64)
        self._heap.plan_bands(need, nlo, nhi, deficit)
        return {self._ends.names[e]: int(deficit[e]) for e in range(E) if deficit[e] > 0}

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
        if self._leasing.work:
            self._leasing.tick()
        ends = [self._ends.end(end)] if end is not None else self._heap.chain.tolist()
        report = CompactionReport()
        for e in ends:
            plan = self._plan_end(e, budget_pages, "high")
            if plan.num_moves or plan.retreated_pages:
                report = report + self._apply_plan(e, plan)
            else:
                report = report + CompactionReport.from_plan(self._ends.names[e], plan, self._heap.page_bytes(e))
        self._after_call.checks()
        return report



__all__ = ["SpaceService"]
