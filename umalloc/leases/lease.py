"""One transfer lease: the handle :meth:`umalloc.leases.table.LeaseTable.pin` returns, and the lease states.

* A :class:`Lease` names its pages and deadline and reports its state; every state change (release, engine
  holds, settle) is its table's (:class:`~umalloc.leases.table.LeaseTable`, which owns the pin counts and the
  lock), so a lease is a small handle safe to use from any thread (Note [Lease threading] there).
* States (Note [Lease states] in :mod:`umalloc.leases.table`): :data:`LEASE_ACTIVE` -> :data:`LEASE_RELEASED` |
  :data:`LEASE_EXPIRED` | :data:`LEASE_IN_DOUBT` -> :data:`LEASE_SETTLED`.
"""

from __future__ import annotations

from types import TracebackType
from typing import Protocol

import numpy as np

#: Lease states (Note [Lease states]).
LEASE_ACTIVE = "active"
LEASE_RELEASED = "released"
LEASE_EXPIRED = "expired"
LEASE_IN_DOUBT = "in_doubt"
LEASE_SETTLED = "settled"


class _Table(Protocol):
    """What a lease calls on its table (:class:`~umalloc.leases.table.LeaseTable`; this module does not import it,
    the table imports this one)."""

    def now(self) -> float: ...
    def _release(self, lease: Lease, how: str) -> bool: ...
    def _hold(self, lease: Lease) -> int: ...
    def _unhold(self, lease: Lease, generation: int) -> bool: ...
    def _settle(self, lease: Lease, generation: int | None) -> bool: ...


class Lease:
    """A pin on physical pages of one or more ends; created by :meth:`LeaseTable.pin` (or
    ``MultiEndedAllocator.lease``).

    Attributes:
        id: unique lease number (``int``, ascending in creation order).
        generation: the generation it was issued under (``int``, unique within its table, F27); an ``unhold_engine`` or
            settle quoting another one is refused.
        tag: caller's label (request id, peer name, ...).
        pages: ``dict[end, np.ndarray]``; per end a sorted, unique, read-only ``int64`` array of physical pages.
        deadline: absolute deadline on the table's clock (seconds), or ``None`` (held until released).

    A lease is a context manager: leaving the ``with`` block releases it, also when an exception escapes (F16).
    :meth:`release` is idempotent and harmless after expiry. Every method may be called from any thread
    (Note [Lease threading]).

    >>> from umalloc.leases.table import LeaseTable
    >>> table = LeaseTable({"full": 8})
    >>> with table.pin({"full": [3, 1, 3]}, deadline_s=None, tag="req7") as lease:
    ...     lease.pages["full"].tolist(), lease.state, int(table.pin_count("full")[3])
    ([1, 3], 'active', 1)
    >>> lease.state, int(table.pin_count("full")[3])
    ('released', 0)
    >>> lease.release()  # harmless
    False
    """

    __slots__ = ("_holds", "_state", "_table", "deadline", "generation", "id", "pages", "tag")

    def __init__(self, table: _Table, lease_id: int, generation: int, pages: dict[str, np.ndarray],
                 deadline: float | None, tag: str) -> None:
        self._table = table
        self.id = lease_id
        self.generation = generation
        self.pages = pages
        self.deadline = deadline
        self.tag = tag
        self._state = LEASE_ACTIVE
        self._holds = 0

    @property
    def state(self) -> str:
        """``"active"``, ``"released"``, ``"expired"`` (reclaimed at its deadline), ``"in_doubt"`` (released or past
        its deadline while an engine may hold a part: pages still pinned) or ``"settled"`` (in doubt, then let go)."""
        return self._state

    @property
    def active(self) -> bool:
        return self._state == LEASE_ACTIVE

    @property
    def in_doubt(self) -> bool:
        return self._state == LEASE_IN_DOUBT

    @property
    def engine_holds(self) -> int:
        """Engine holds outstanding (parts an engine may still read or write, Note [Lease states])."""
        return self._holds

    @property
    def expired(self) -> bool:
        """True once the deadline has passed on the table's clock, even before :meth:`LeaseTable.expire`
        reclaimed it; always True after reclaim, False after an orderly :meth:`release`."""
        if self._state == LEASE_EXPIRED:
            return True
        if self._state != LEASE_ACTIVE or self.deadline is None:
            return False
        return self._table.now() >= self.deadline

    @property
    def num_pages(self) -> int:
        """Pages pinned by this lease, summed over ends."""
        return sum(int(p.size) for p in self.pages.values())

    def release(self) -> bool:
        """Release the lease. Returns True if this call released it, False if it was no longer active (released,
        expired, in doubt or settled) — calling twice is harmless. With an engine hold outstanding the lease goes
        ``in_doubt`` instead of unpinning (F24): its pages stay pinned until the engine lets go. O(pages)."""
        return self._table._release(self, LEASE_RELEASED)

    def hold_engine(self) -> int:
        """Record that a part of this lease's transfer was handed to an engine (or its pages published to a
        peer); returns the generation to quote to :meth:`unhold_engine`. O(1).

        Raises:
            LeaseError: the lease is not active (its pages may be reused: nothing may be posted, F11).
        """
        return self._table._hold(self)

    def unhold_engine(self, generation: int) -> bool:
        """The engine reported a part terminal: let go of one hold. An in-doubt lease whose last hold goes
        settles (unpins). Returns True if the lease settled. O(pages) when it settles, else O(1).

        Raises:
            StaleLeaseError: ``generation`` is not this lease's, or no hold is outstanding.
        """
        return self._table._unhold(self, generation)

    def settle(self, generation: int | None = None) -> bool:
        """Settle an in-doubt lease on a *confirmed* termination of every part: the engine confirmed a cancellation, or
        it released its registrations (backend ``close``/``reset``), or the peer process is gone. Unpins. Returns
        True if this call settled it, False if it had settled already.

        Raises:
            StaleLeaseError: a ``generation`` other than this lease's, or the lease is active, released or
                expired (nothing to settle).
        """
        return self._table._settle(self, generation)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def __repr__(self) -> str:
        ends = {e: int(p.size) for e, p in self.pages.items()}
        return (f"Lease(id={self.id}, gen={self.generation}, tag={self.tag!r}, state={self._state}, pages={ends}, "
                f"deadline={self.deadline})")


__all__ = ["LEASE_ACTIVE", "LEASE_EXPIRED", "LEASE_IN_DOUBT", "LEASE_RELEASED", "LEASE_SETTLED", "Lease"]
