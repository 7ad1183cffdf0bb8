"""The allocator's lease service: the lease table of one arena and the per-call lease work.

* Pins live in the heap's pin arrays, lent to the :class:`~umalloc.leases.table.LeaseTable` (Note [Leases and
  compaction] there); the table reports pages whose last pin dropped, and :class:`LeaseService` turns the
  pending ones into holes (:meth:`umalloc.pool.heap.Heap.unpend`).
* Every allocator call first delivers the pages unpinned on other threads (leases released there), then reclaims leases
  past their deadline or puts them in doubt (:meth:`LeaseService.tick`, F12, F24, F26); the page-level hot path
  skips it only while the table's ``work_view`` (:attr:`LeaseService.work`) is empty (Note [Page-level hot path]
  in :mod:`umalloc.allocator.facade`, Note [Lease threading]).
* Threading (Note [Lease threading] in :mod:`umalloc.leases.table`): the allocator runs on one owner thread;
  :meth:`LeaseService.lease` and every :class:`~umalloc.leases.table.Lease` method may be called from any thread;
  compaction holds the table's lock, so a lease taken on another thread never races a move.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch

from umalloc.allocator.ends import EndIndex
from umalloc.errors import LeaseError
from umalloc.leases.table import LEASE_EXPIRED, Lease, LeaseTable
from umalloc.pool.heap import Heap
from umalloc.pool.pagestate import PAGE_LIVE


class LeaseService:
    """The lease table of one allocator and the lease work each allocator call does first.

    Args:
        heap: the allocator's heap (its pin arrays are lent to the table).
        ends: the allocator's end index.
        clock: monotonic clock in seconds for lease deadlines.

    Attributes:
        table: the :class:`~umalloc.leases.table.LeaseTable`. work: its ``work_view`` (truthy while an active
        lease or pages unpinned on another thread wait: O(1)). expired_by_end: leases reclaimed per end index.
        paused: while True (inside :meth:`pausing`: a trial runs) :meth:`tick` does nothing.
    """

    __slots__ = ("_ends", "_heap", "expired_by_end", "paused", "table", "work")

    def __init__(self, heap: Heap, ends: EndIndex, clock: Callable[[], float]) -> None:
        self._heap = heap
        self._ends = ends
        names = ends.names
        self.table = LeaseTable({n: heap.slots[i] for i, n in enumerate(names)}, clock=clock,
                                on_unpinned=self._on_unpinned,
                                first_pages={n: heap.first_page(i) for i, n in enumerate(names)},
                                validator=self._validate_pages,
                                pins=dict(zip(names, heap.pins, strict=True)))
        self.work: Mapping[int, object] = self.table.work_view
        self.expired_by_end = [0] * len(names)
        self.paused = False

    @contextlib.contextmanager
    def pausing(self) -> Iterator[None]:
        """:meth:`tick` does nothing inside the ``with`` block (Note [Trials] in :mod:`umalloc.allocator.facade`).
        O(1)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def tick(self) -> None:
        """Deliver pages unpinned on other threads, then reclaim leases past their deadline (F12) or put them in
        doubt (F24); their pending pages become holes. Nothing while :attr:`paused` (Note [Trials] in
        :mod:`umalloc.allocator.facade`: a rollback must not undo a reclaim the lease table keeps)."""
        if self.paused:
            return
        table = self.table
        if table.unpinned_waiting:
            table.drain()
        for lease in table.expire():
            if lease.state != LEASE_EXPIRED:
                continue  # in doubt: nothing reclaimed
            for name, pages in lease.pages.items():
                if pages.size:
                    self.expired_by_end[self._ends.index[name]] += 1

    def lease(self, pages: Mapping[str, torch.Tensor], *, deadline_s: float | None = None, tag: str = "") -> Lease:
        """:meth:`umalloc.allocator.facade.MultiEndedAllocator.lease`. Any thread."""
        if self.work and threading.get_ident() == self.table.owner_thread:
            self.tick()
        return self.table.pin(pages, deadline_s=deadline_s, tag=tag)

    def leases_active(self) -> int:
        """Active leases over all ends (after reclaiming expired ones)."""
        if self.work:
            self.tick()
        return len(self.table)

    def moves_blocked(self, end: str) -> bool:
        """True while any page of ``end`` is pinned. Raises UmallocValueError for an unknown end."""
        self._ends.end(end)
        if self.work:
            self.tick()
        return self.table.moves_blocked(end)

    def _validate_pages(self, end: str, pages: np.ndarray) -> None:
        _, state, _ = self._heap.end_tables(self._ends.index[end])
        bad = pages[state[pages] != PAGE_LIVE]
        if bad.size:
            raise LeaseError(f"lease: pages {bad[:8].tolist()} of end {end!r} are not live; allowed live pages")

    def _on_unpinned(self, end: str, pages: np.ndarray) -> None:
        # pending pages whose last pin dropped become holes (or gap at a band edge); eager compaction runs on the
        # next free, lazy compaction on the next shortfall
        self._heap.unpend(self._ends.index[end], pages)


__all__ = ["LeaseService"]
