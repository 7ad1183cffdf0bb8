"""The allocator's lease calls (a part of :class:`~umalloc.allocator.facade.MultiEndedAllocator`).

* Pins live in the heap's pin arrays, lent to the :class:`~umalloc.leases.table.LeaseTable` (Note [Leases and
  compaction] there); the table reports pages whose last pin dropped through ``_on_unpinned``, which turns the
  pending ones into holes.
* Every allocator call first delivers the pages that leases ended on other threads unpinned, then reclaims leases
  past their deadline or puts them in doubt (:meth:`LeasePart._tick`, F12, F24, F26); the page-level hot path
  skips it only while the table's ``work_view`` is empty (Note [Page-level hot path], Note [Lease threading]).
* Threading (Note [Lease threading] in :mod:`umalloc.leases.table`): the allocator runs on one owner thread;
  ``lease`` and every :class:`~umalloc.leases.table.Lease` method may be called from any thread; compaction holds
  the table's lock, so a lease taken on another thread never races a move.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from umalloc.errors import LeaseError
from umalloc.leases.table import LEASE_EXPIRED, Lease, LeaseTable
from umalloc.pool.pagestate import PAGE_LIVE


class LeasePart:
    """Lease methods of the allocator facade (the attributes below are set by its constructor)."""

    ends: Mapping[str, Any]
    _leases: LeaseTable
    _active_leases: Mapping[int, Lease]
    _expired_by_end: list[int]
    _trial_depth: int
    _index: dict[str, int]
    _heap: Any
    _end_index: Callable[[str], int]

    def _tick(self) -> None:
        """Deliver pages unpinned on other threads, then reclaim leases past their deadline (F12) or put them in
        doubt (F24); the unpinned-hook turns their pending pages into holes. Nothing while a trial runs (Note
        [Trials] in :mod:`umalloc.allocator.facade`: a rollback must not undo a reclaim the lease table keeps)."""
        if self._trial_depth:
            return
        table = self._leases
        if table._queue:
            table.drain()
        expired = table.expire()
        for lease in expired:
            if lease.state != LEASE_EXPIRED:
                continue  # in doubt: nothing reclaimed
            for name, pages in lease.pages.items():
                if pages.size:
                    self._expired_by_end[self._index[name]] += 1

    def lease(self, pages: Mapping[str, torch.Tensor], *, deadline_s: float | None = None, tag: str = "") -> Lease:
        """Pin *physical* pages of any ends (Note [Leases and compaction] in :mod:`umalloc.leases.table`): they are not
        moved, and if freed they stay pending (not reusable) until the lease ends.

        Args:
            pages: end name -> ``int64`` physical pages (live pages of that end).
            deadline_s: seconds until the next allocator call reclaims the lease (or puts it in doubt when an
                engine holds a part of its transfer, F24); ``None``: until released.
            tag: label for logs and ``lease_table.release_tagged``.

        Returns:
            the active :class:`~umalloc.leases.table.Lease` (context manager; ``release()`` idempotent).

        Raises:
            LeaseError: unknown end, bad pages, or a page that is not live. Nothing changes.

        Threading: may be called from any thread (it waits while the owner thread compacts).

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()
        >>> vp = alloc.alloc_pages(2)
        >>> with alloc.lease({"full": alloc.translate_pages(vp, "full")}, tag="xfer") as lease:
        ...     alloc.free(vp * 2); alloc.stats()["full"].pending_pages
        2
        >>> alloc.stats()["full"].pending_pages, alloc.available_pages("full")
        (0, 9)
        """
        if self._active_leases and threading.get_ident() == self._leases._owner:
            self._tick()
        return self._leases.pin(pages, deadline_s=deadline_s, tag=tag)

    def leases_active(self) -> int:
        """Active leases over all ends (after reclaiming expired ones)."""
        if self._active_leases:
            self._tick()
        return len(self._leases)

    def moves_blocked(self, end: str) -> bool:
        """Coarse gate: True while any page of ``end`` is pinned (umalloc's compaction plans around single pins)."""
        self._end_index(end)
        if self._active_leases:
            self._tick()
        return self._leases.moves_blocked(end)

    @property
    def lease_table(self) -> LeaseTable:
        """The :class:`~umalloc.leases.table.LeaseTable` holding this arena's pins."""
        return self._leases

    def _validate_lease_pages(self, end: str, pages: np.ndarray) -> None:
        view = self.ends[end]
        bad = pages[view.state[pages] != PAGE_LIVE]
        if bad.size:
            raise LeaseError(f"lease: pages {bad[:8].tolist()} of end {end!r} are not live; allowed live pages")

    def _on_unpinned(self, end: str, pages: np.ndarray) -> None:
        e = self._index[end]
        # pending pages whose last pin dropped become holes (or gap at a band edge); eager compaction runs on the
        # next free, lazy compaction on the next shortfall
        self._heap.unpend(e, pages)


__all__ = ["LeasePart"]
