"""Transfer leases: per-page pin counts with deadlines, and the compaction gate built on them.

Policy:

* A :class:`Lease` pins a set of *physical* pages of one or more ends (every end of the arena may appear:
  F17). Pins are counted per page (``int32`` per end), so overlapping leases compose; a page is pinned while
  its count is positive.
* Compaction never moves a pinned page and never writes into one (:mod:`umalloc.core.compaction` takes the pin
  arrays as input). A page freed while pinned becomes *pending* in the allocator and is handed out again only
  after its count drops to zero: the table reports every such page through ``on_unpinned`` (F11).
* Every terminal path ends a lease: :meth:`Lease.release` (idempotent), leaving a ``with`` block (normally or by
  an exception), :meth:`LeaseTable.release_tagged` (a dead peer), and the deadline: :meth:`LeaseTable.expire`
  reclaims every lease past its deadline, counts it in ``leases_expired`` and logs it (F12, F16).
* Validation happens before any state changes: an unknown end, a page outside the handable range, a bad dtype
  or shape, a bad deadline, or a page the allocator's ``validator`` rejects raises :class:`LeaseError` and
  pins nothing.
* ``version`` increments on every pin, release and expiry, so a holder of cached capacity figures can tell
  that holds changed and recompute them (F17).
* Not thread-safe: call from the thread that owns the allocator (engines release leases from their scheduler
  loop after polling a transfer).

Note [Leases and compaction]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A transfer engine reads or writes pages by *address*. Between the moment the addresses are published to a
peer and the moment every handle of the transfer has ended, the bytes at those addresses must stay the bytes of
that request. So the lease is taken *before* the addresses leave the process, and while it is active:

* compaction treats the page as a wall: it neither moves the page nor uses it as a destination, and the
  watermark cannot retreat past it;
* ``free`` of the page's virtual id retires the id at once but parks the physical page as *pending*: unreachable
  through any table and not reusable;
* when the last pin drops, ``on_unpinned(end, pages)`` lets the allocator turn pending pages into holes and
  recompute capacity.

::

    up-end band [first, wm)        P = pinned, . = hole, L = live
    | L . L P . L L |  -- compaction -->  | L L L P L . . |  -> wm retreats to just above the last L

Holds are *not* a single boolean gate: the coarse :meth:`LeaseTable.moves_blocked` predicate (any page of the
end pinned) exists for engines that want one, but umalloc itself plans around individual pins.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType, TracebackType

import numpy as np

from umalloc.errors import InvariantError, LeaseError

logger = logging.getLogger(__name__)

#: Lease states.
LEASE_ACTIVE = "active"
LEASE_RELEASED = "released"
LEASE_EXPIRED = "expired"

UnpinnedHook = Callable[[str, np.ndarray], None]
PageValidator = Callable[[str, np.ndarray], None]


def _as_page_array(end: str, pages: object, lo: int, hi: int) -> np.ndarray:
    """Validate one end's page list and return it as a sorted, deduplicated, read-only ``int64`` array."""
    if hasattr(pages, "detach") and hasattr(pages, "cpu"):  # a torch tensor on any device
        import torch

        if not isinstance(pages, torch.Tensor):
            raise LeaseError(f"pages[{end!r}]: allowed a 1-D integer torch tensor, numpy array or sequence")
        if pages.layout is not torch.strided or pages.is_meta:  # no dense data to read
            raise LeaseError(f"pages[{end!r}]: layout {pages.layout} on {pages.device}; allowed a dense tensor "
                             f"with data")
        if pages.dtype.is_floating_point or pages.dtype.is_complex or pages.dtype == torch.bool:
            raise LeaseError(f"pages[{end!r}] dtype {pages.dtype}: allowed an integer dtype (int64)")
        arr = pages.detach().cpu().numpy()
    else:
        try:
            arr = np.asarray(pages)
        except Exception as exc:  # noqa: BLE001 - any conversion failure is caller misuse
            raise LeaseError(f"pages[{end!r}]={pages!r}: allowed a 1-D integer array") from exc
        if arr.size == 0 and arr.dtype.kind == "f":  # an empty Python list converts to float64
            arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise LeaseError(f"pages[{end!r}] has shape {arr.shape}: allowed a 1-D array of physical pages")
    if arr.dtype.kind not in "iu":
        raise LeaseError(f"pages[{end!r}] dtype {arr.dtype}: allowed an integer dtype (int64)")
    arr = arr.astype(np.int64, copy=False)
    if arr.size:
        pmin, pmax = int(arr.min()), int(arr.max())
        if pmin < lo or pmax >= hi:
            bad = pmin if pmin < lo else pmax
            raise LeaseError(f"physical page {bad} of end {end!r}: allowed [{lo}, {hi - 1}]")
    out = np.unique(arr)
    out.setflags(write=False)
    return out


class Lease:
    """A pin on physical pages of one or more ends; created by :meth:`LeaseTable.pin` (or
    ``MultiEndedAllocator.lease``).

    Attributes:
        id: unique lease number (``int``, ascending in creation order).
        tag: caller's label (request id, peer name, ...).
        pages: ``dict[end, np.ndarray]``; per end a sorted, unique, read-only ``int64`` array of physical pages.
        deadline: absolute deadline on the table's clock (seconds), or ``None`` (held until released).

    A lease is a context manager: leaving the ``with`` block releases it, also when an exception escapes (F16).
    :meth:`release` is idempotent and harmless after expiry.

    >>> table = LeaseTable({"full": 8})
    >>> with table.pin({"full": [3, 1, 3]}, deadline_s=None, tag="req7") as lease:
    ...     lease.pages["full"].tolist(), lease.state, int(table.pin_count("full")[3])
    ([1, 3], 'active', 1)
    >>> lease.state, int(table.pin_count("full")[3])
    ('released', 0)
    >>> lease.release()  # harmless
    False
    """

    __slots__ = ("_state", "_table", "deadline", "id", "pages", "tag")

    def __init__(self, table: LeaseTable, lease_id: int, pages: dict[str, np.ndarray], deadline: float | None,
                 tag: str) -> None:
        self._table = table
        self.id = lease_id
        self.pages = pages
        self.deadline = deadline
        self.tag = tag
        self._state = LEASE_ACTIVE

    @property
    def state(self) -> str:
        """``"active"``, ``"released"`` or ``"expired"`` (reclaimed at its deadline)."""
        return self._state

    @property
    def active(self) -> bool:
        return self._state == LEASE_ACTIVE

    @property
    def expired(self) -> bool:
        """True once the deadline has passed on the table's clock, even before :meth:`LeaseTable.expire`
        reclaimed it; always True after reclaim, False after an orderly release."""
        if self._state == LEASE_EXPIRED:
            return True
        if self._state != LEASE_ACTIVE or self.deadline is None:
            return False
        return self._table.clock() >= self.deadline

    @property
    def num_pages(self) -> int:
        """Pages pinned by this lease, summed over ends."""
        return sum(int(p.size) for p in self.pages.values())

    def release(self) -> bool:
        """End the lease: unpin its pages. Returns True if this call ended it, False if it had already ended
        (released or expired) — calling twice is harmless. O(pages of the lease)."""
        return self._table._end(self, LEASE_RELEASED)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def __repr__(self) -> str:
        ends = {e: int(p.size) for e, p in self.pages.items()}
        return f"Lease(id={self.id}, tag={self.tag!r}, state={self._state}, pages={ends}, deadline={self.deadline})"


class LeaseTable:
    """Per-end pin counts and the registry of active leases.

    Args:
        page_slots: per end name, the size of its physical id space (``ArenaSpec.num_page_slots(end)``).
        clock: monotonic clock in seconds (tests pass a fake clock).
        on_unpinned: called as ``on_unpinned(end, pages)`` once per end per :meth:`Lease.release`,
            :meth:`expire` or :meth:`release_tagged` call, with the sorted ``int64`` array of that end's pages
            whose pin count dropped to 0 (only ends with at least one such page; ends in ``page_slots`` order).
            Called after every count and counter is updated.
        first_pages: per end, the lowest page a lease may name (``ArenaSpec.first_page``); default 0. Use it to
            keep the sink (page 0) out of every lease (F05).
        validator: called as ``validator(end, pages)`` for every end of a lease after the range checks and
            before anything changes; raise :class:`LeaseError` to refuse (the allocator refuses pages that
            are not live).
        pins: per end, a zeroed contiguous ``int32 (page_slots[end],)`` array the table counts pins in (lent by
            its owner: the allocator's heap owns them, so its kernels read them in place); default: the table
            allocates its own. The table never rebinds them.

    Counters: ``leases_taken``, ``leases_released``, ``leases_expired``, ``pages_expired``; per end
    :meth:`pins_current` (distinct pinned pages). ``version`` increments on every change of holds.

    >>> now = [0.0]
    >>> table = LeaseTable({"full": 8, "swa": 16}, clock=lambda: now[0])
    >>> lease = table.pin({"full": [1, 2], "swa": [9]}, deadline_s=5.0, tag="xfer")
    >>> table.any_pinned("swa"), table.pins_current("full"), len(table)
    (True, 2, 1)
    >>> now[0] = 6.0
    >>> [l.id for l in table.expire()], lease.state, table.leases_expired, table.any_pinned("swa")
    ([0], 'expired', 1, False)
    """

    def __init__(self, page_slots: Mapping[str, int], *, clock: Callable[[], float] = time.monotonic,
                 on_unpinned: UnpinnedHook | None = None, first_pages: Mapping[str, int] | None = None,
                 validator: PageValidator | None = None, pins: Mapping[str, np.ndarray] | None = None) -> None:
        if not isinstance(page_slots, Mapping) or not page_slots:
            raise LeaseError(f"page_slots={page_slots!r}: allowed a non-empty mapping end -> num_page_slots")
        self._slots: dict[str, int] = {}
        for end, n in page_slots.items():
            if not isinstance(end, str) or isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise LeaseError(f"page_slots[{end!r}]={n!r}: allowed an int >= 1 per end name")
            self._slots[end] = int(n)
        self._lo: dict[str, int] = {e: 0 for e in self._slots}
        if not callable(clock):
            raise LeaseError(f"clock={clock!r}: allowed a callable returning monotonic seconds")
        if first_pages is not None and not isinstance(first_pages, Mapping):
            raise LeaseError(f"first_pages={first_pages!r}: allowed a mapping end -> first page")
        for end, lo in (first_pages or {}).items():
            if end not in self._slots:
                raise LeaseError(f"first_pages names end {end!r}: allowed one of {sorted(self._slots)}")
            if isinstance(lo, bool) or not isinstance(lo, (int, np.integer)):
                raise LeaseError(f"first_pages[{end!r}]={lo!r}: allowed an int in [0, {self._slots[end] - 1}]")
            if not 0 <= int(lo) < self._slots[end]:
                raise LeaseError(f"first_pages[{end!r}]={lo}: allowed [0, {self._slots[end] - 1}]")
            self._lo[end] = int(lo)
        self.clock = clock
        self.on_unpinned = on_unpinned
        self.validator = validator
        if pins is None:
            pins = {e: np.zeros(n, dtype=np.int32) for e, n in self._slots.items()}
        if not isinstance(pins, Mapping) or set(pins) != set(self._slots):
            raise LeaseError(f"pins: allowed a mapping with exactly the ends {sorted(self._slots)}")
        for end, arr in pins.items():
            if not (isinstance(arr, np.ndarray) and arr.dtype == np.int32 and arr.shape == (self._slots[end],)
                    and arr.flags.c_contiguous and arr.flags.writeable and not arr.any()):
                raise LeaseError(f"pins[{end!r}]: allowed a zeroed writeable contiguous int32 array of shape "
                                 f"({self._slots[end]},)")
        self._pins: dict[str, np.ndarray] = {e: pins[e] for e in self._slots}
        self._pinned_pages: dict[str, int] = {e: 0 for e in self._slots}
        self._active: dict[int, Lease] = {}
        self._active_view = MappingProxyType(self._active)
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, lease id); stale entries skipped
        self._ids = itertools.count()
        self.leases_taken = 0
        self.leases_released = 0
        self.leases_expired = 0
        self.pages_expired = 0
        self.version = 0

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def ends(self) -> tuple[str, ...]:
        return tuple(self._slots)

    def _check_end(self, end: str) -> None:
        if end not in self._slots:
            raise LeaseError(f"end {end!r}: allowed one of {sorted(self._slots)}")

    def pin_count(self, end: str) -> np.ndarray:
        """Read-only ``int32`` view of shape ``(num_page_slots(end),)``: active leases pinning each page. O(1)."""
        self._check_end(end)
        view = self._pins[end].view()
        view.setflags(write=False)
        return view

    def pins_current(self, end: str) -> int:
        """Distinct pages of ``end`` pinned now. O(1)."""
        self._check_end(end)
        return self._pinned_pages[end]

    def any_pinned(self, end: str) -> bool:
        """True if any page of ``end`` is pinned. O(1)."""
        return self.pins_current(end) > 0

    def moves_blocked(self, end: str) -> bool:
        """Coarse gate for engines that want one: True while any page of ``end`` is pinned. umalloc's own
        compaction plans around individual pins instead (Note [Leases and compaction]). O(1)."""
        return self.any_pinned(end)

    def is_pinned(self, end: str, pages: np.ndarray) -> np.ndarray:
        """Boolean mask, same shape as ``pages`` (int64 physical pages, unchecked): pinned or not."""
        self._check_end(end)
        return self._pins[end][pages] > 0

    def active(self) -> list[Lease]:
        """Active leases in creation order (a new list)."""
        return list(self._active.values())

    def __len__(self) -> int:
        return len(self._active)

    @property
    def active_view(self) -> Mapping[int, Lease]:
        """Live read-only view of the active leases by id (the table's own registry, not a copy). Its truthiness
        is the O(1) "any lease active?" test (a lease past its deadline counts until :meth:`expire` reclaims it);
        a caller may keep the view: the allocator's hot paths test it before every call's expiry sweep.

        >>> table = LeaseTable({"full": 4})
        >>> view = table.active_view
        >>> bool(view), table.pin({"full": [1]}, deadline_s=None).id in view, bool(view)
        (False, True, True)
        """
        return self._active_view

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._active.values()))

    def next_deadline(self) -> float | None:
        """Earliest deadline among active leases, or None. Amortized O(1)."""
        self._drop_stale_deadlines()
        return self._deadlines[0][0] if self._deadlines else None

    # ---- pin / release / expire ------------------------------------------------------------------------------
    def pin(self, pages: Mapping[str, object], *, deadline_s: float | None, tag: str = "") -> Lease:
        """Pin physical pages of any ends; returns the active :class:`Lease`.

        Args:
            pages: end name -> 1-D integer array-like (torch tensor on any device, numpy array or sequence)
                of physical pages in ``[first_pages[end], page_slots[end])``. Duplicates within one end are
                pinned once. Ends may be omitted or empty.
            deadline_s: seconds from now (table clock) after which :meth:`expire` reclaims the lease; ``None``
                holds it until released. Must be finite and > 0.
            tag: label (request id, peer name) for logs and :meth:`release_tagged`.

        Raises:
            LeaseError: unknown end, bad dtype/shape, page out of range, bad deadline or tag, or a page the
                validator refuses. Nothing changes.

        Complexity: O(pages log pages) (deduplication).
        """
        if not isinstance(pages, Mapping):
            raise LeaseError(f"pages={type(pages).__name__}: allowed a mapping end -> physical pages")
        if not isinstance(tag, str):
            raise LeaseError(f"tag={tag!r}: allowed a str")
        if deadline_s is not None:
            if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float, np.floating)) \
                    or not math.isfinite(deadline_s) or deadline_s <= 0:
                raise LeaseError(f"deadline_s={deadline_s!r}: allowed None or a finite number of seconds > 0")
        checked: dict[str, np.ndarray] = {}
        for end, arr in pages.items():
            if end not in self._slots:
                raise LeaseError(f"lease names end {end!r}: allowed one of {sorted(self._slots)}")
            checked[end] = _as_page_array(end, arr, self._lo[end], self._slots[end])
        if self.validator is not None:
            for end, arr in checked.items():
                if arr.size:
                    self.validator(end, arr)
        # ---- nothing has changed up to here
        deadline = None if deadline_s is None else self.clock() + float(deadline_s)
        lease = Lease(self, next(self._ids), checked, deadline, tag)
        for end, arr in checked.items():
            if arr.size:
                pins = self._pins[end]
                self._pinned_pages[end] += int(np.count_nonzero(pins[arr] == 0))
                pins[arr] += 1  # arr is unique, so plain fancy-index add is exact
        self._active[lease.id] = lease
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, lease.id))
        self.leases_taken += 1
        self.version += 1
        return lease

    def _unpin(self, lease: Lease, into: dict[str, list[np.ndarray]]) -> None:
        for end, arr in lease.pages.items():
            if arr.size:
                pins = self._pins[end]
                pins[arr] -= 1
                freed = arr[pins[arr] == 0]
                if freed.size:
                    self._pinned_pages[end] -= int(freed.size)
                    into.setdefault(end, []).append(freed)

    def _notify(self, unpinned: dict[str, list[np.ndarray]]) -> None:
        if self.on_unpinned is None:
            return
        for end in self._slots:  # table end order: deterministic
            chunks = unpinned.get(end)
            if not chunks:
                continue
            pages = chunks[0] if len(chunks) == 1 else np.unique(np.concatenate(chunks))
            self.on_unpinned(end, pages)

    def _end(self, lease: Lease, how: str) -> bool:
        if lease._table is not self:
            raise LeaseError(f"lease {lease.id} belongs to another table")
        if lease._state != LEASE_ACTIVE:
            return False
        unpinned: dict[str, list[np.ndarray]] = {}
        self._unpin(lease, unpinned)
        del self._active[lease.id]
        lease._state = how
        if how == LEASE_RELEASED:
            self.leases_released += 1
        self.version += 1
        self._notify(unpinned)
        return True

    def _drop_stale_deadlines(self) -> None:
        heap = self._deadlines
        while heap and heap[0][1] not in self._active:
            heapq.heappop(heap)

    def expire(self, now: float | None = None) -> list[Lease]:
        """Reclaim every active lease whose deadline is ``<= now`` (default: the clock). Each is counted in
        ``leases_expired`` / ``pages_expired`` and logged at WARNING. Returns them (deadline order).
        O(1) when nothing is due, else O(pages of the expired leases + k log leases)."""
        if now is None:
            self._drop_stale_deadlines()
            if not self._deadlines:
                return []
            now = self.clock()
        heap = self._deadlines
        out: list[Lease] = []
        unpinned: dict[str, list[np.ndarray]] = {}
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self._active.pop(lease_id, None)
            if lease is None:
                continue  # released earlier
            self._unpin(lease, unpinned)
            lease._state = LEASE_EXPIRED
            self.leases_expired += 1
            self.pages_expired += lease.num_pages
            logger.warning("lease %d (tag %r) expired %.3fs past its deadline; reclaimed %d page(s) on %s",
                           lease.id, lease.tag, now - (lease.deadline or now), lease.num_pages,
                           sorted(e for e, p in lease.pages.items() if p.size))
            out.append(lease)
        if out:
            self.version += 1
            self._notify(unpinned)
        return out

    def release_tagged(self, tag: str) -> int:
        """Release every active lease carrying ``tag`` (a peer died, a request was aborted). Returns how many.
        Counted as releases. O(leases + their pages)."""
        victims = [lease for lease in self._active.values() if lease.tag == tag]
        if not victims:
            return 0
        unpinned: dict[str, list[np.ndarray]] = {}
        for lease in victims:
            self._unpin(lease, unpinned)
            del self._active[lease.id]
            lease._state = LEASE_RELEASED
            self.leases_released += 1
        self.version += 1
        self._notify(unpinned)
        return len(victims)

    # ---- invariants ----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Pin counts equal the sum over active leases; distinct-pinned counters match; counters balance;
        every active lease with a deadline sits in the deadline heap. O(slots + pins). Raises
        :class:`InvariantError` naming the invariant."""
        for end, pins in self._pins.items():
            expect = np.zeros_like(pins)
            for lease in self._active.values():
                arr = lease.pages.get(end)
                if arr is not None and arr.size:
                    expect[arr] += 1
            if not np.array_equal(expect, pins):
                bad = np.flatnonzero(expect != pins)[:8].tolist()
                raise InvariantError(f"pin counts of end {end!r} differ from the active leases at pages {bad}")
            if int(np.count_nonzero(pins)) != self._pinned_pages[end]:
                raise InvariantError(f"pins_current({end!r})={self._pinned_pages[end]} but "
                                     f"{int(np.count_nonzero(pins))} pages are pinned")
        for lease in self._active.values():
            if lease._state != LEASE_ACTIVE:
                raise InvariantError(f"lease {lease.id} is registered but {lease._state}")
        if self.leases_taken != len(self._active) + self.leases_released + self.leases_expired:
            raise InvariantError("leases taken != active + released + expired")
        in_heap = {lid for _, lid in self._deadlines}
        for lease in self._active.values():
            if lease.deadline is not None and lease.id not in in_heap:
                raise InvariantError(f"active lease {lease.id} has a deadline but is missing from the heap")

    def stats(self) -> dict[str, object]:
        """Counters as a plain dict (fixed keys)."""
        return {
            "leases_active": len(self._active),
            "leases_taken": self.leases_taken,
            "leases_released": self.leases_released,
            "leases_expired": self.leases_expired,
            "pages_expired": self.pages_expired,
            "pins_current": dict(self._pinned_pages),
        }


__all__ = ["LEASE_ACTIVE", "LEASE_EXPIRED", "LEASE_RELEASED", "Lease", "LeaseTable"]
