"""Transfer leases: per-page pin counts with deadlines, the in-doubt rule, and the compaction gate built on them.

Policy:

* A :class:`Lease` pins a set of *physical* pages of one or more ends (every end of the arena may appear:
  F17). Pins are counted per page (``int32`` per end), so overlapping leases compose; a page is pinned while
  its count is positive.
* Compaction never moves a pinned page and never writes into one (:mod:`umalloc.pool.compaction` takes the pin
  arrays as input). A page freed while pinned becomes *pending* in the allocator and is handed out again only
  after its count drops to zero: the table reports every such page through ``on_unpinned`` (F11).
* States (Note [Lease states]): ``active`` -> ``released`` | ``expired`` (its deadline passed while no engine
  held a part: reclaimed at once) | ``in_doubt`` -> ``settled``. A lease goes in doubt when its deadline passes,
  or it is released (a plan failed or aborted), while an engine may still hold a part of its transfer
  (:meth:`Lease.hold_engine`): its pages stay pinned and pending, counted in ``in_doubt_pages``, never free and
  never leaked (F24). It settles only when every engine hold is let go (the engine's terminal report) or on
  :meth:`Lease.settle` (a confirmed cancellation, or the backend's ``close``/``reset`` after the engine released
  its registrations).
* Generations (F27): every lease carries a ``generation`` unique within its table; :meth:`LeaseTable.lookup`,
  :meth:`Lease.unhold_engine` and :meth:`Lease.settle` take it and refuse a stale one with
  :class:`~umalloc.errors.StaleLeaseError`, so a late engine report never touches the pages' new owner.
* Every terminal path takes a lease out of ``active``: :meth:`Lease.release` (idempotent), leaving a ``with`` block (normally or by
  an exception), :meth:`LeaseTable.release_tagged` (a dead peer), and the deadline: :meth:`LeaseTable.expire`
  reclaims (or puts in doubt) every lease past its deadline, counts it and logs it (F12, F16).
* Validation happens before any state changes: an unknown end, a page outside the handable range, a bad dtype
  or shape, a bad deadline, or a page the allocator's ``validator`` rejects raises :class:`LeaseError` and
  pins nothing.
* ``version`` increments on every pin, release and expiry, so a holder of cached capacity figures can tell
  that holds changed and recompute them (F17).

Note [Lease threading]
~~~~~~~~~~~~~~~~~~~~~~
Completions arrive on engine threads (a Mooncake sender, a NIXL poller, an asyncio loop), F26. The model:

* One **owner thread** (the one that built the table, or the last to call :meth:`LeaseTable.claim_thread`) runs
  the allocator. Every other method of the table and of :class:`Lease` may be called from any thread: each takes
  the table's ``lock`` (a re-entrant lock held only for the pin-count update, O(pages of the lease)).
* Pages whose last pin drops on the owner thread are reported through ``on_unpinned`` at once.
  Dropped on another thread they go onto a completion queue instead, and the owner's next allocator call drains
  it (:meth:`LeaseTable.drain`), so the allocator's own state is only ever written by its owner thread. Before
  delivery each queued page is re-checked under the lock: one pinned again since is not reported.
* :attr:`LeaseTable.work_view` is non-empty while any lease is active or the queue holds pages: the allocator's
  lock-free hot path tests its truthiness (one dict read) and skips the lease work otherwise.
* :meth:`LeaseTable.pin` takes the lock too, and the allocator holds it while it plans and applies compaction,
  so a lease taken on another thread never races a move. A thread other than the owner translates virtual
  pages and leases the physical ones under ``lock`` (``with table.lock: pages = translate(...); lease(...)``),
  so no compaction moves them in between. Leasing a page on one thread while freeing the same page on another
  is the caller's race (each lease names pages its caller owns).

Note [Lease states]
~~~~~~~~~~~~~~~~~~~
::

    pin ─> active ─┬─ release(), no engine hold ───────────────> released
                   ├─ deadline, no engine hold ────────────────> expired    (reclaimed at once, F12)
                   └─ deadline or release() with an engine hold ─> in_doubt ─┬─ last engine hold let go ─> settled
                                                                             └─ settle() (confirmed) ────> settled

An *engine hold* is taken by a backend when it hands a part of the lease's transfer to an engine, and let go
when the engine reports that part terminal (completed or failed); a receiver takes one when it publishes its
pages to a peer and lets it go on the sender's terminal report. A timeout never proves memory reusable: only a
terminal report, a confirmed cancellation or the engine's release of its registrations does (F24). What each
engine offers: ``local`` copies synchronously (never in doubt); NIXL reports terminal through
``check_xfer_state`` and can cancel a posted request by releasing its handle where the agent accepts it;
Mooncake's classic engine cannot cancel a posted transfer, so only its per-descriptor terminal status
(COMPLETED/FAILED) or ``close`` settles.

Note [Leases and compaction]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A transfer engine reads or writes pages by *address*. Between the moment the addresses are published to a
peer and the moment every handle of the transfer has finished, the bytes at those addresses must stay the bytes of
that request. So the lease is taken *before* the addresses leave the process, and while it is active (or in
doubt):

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
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

import numpy as np
from numba import njit

from umalloc.errors import InvariantError, LeaseError, StaleLeaseError
from umalloc.ids import host_ids
from umalloc.leases.lease import (
    LEASE_ACTIVE,
    LEASE_EXPIRED,
    LEASE_IN_DOUBT,
    LEASE_RELEASED,
    LEASE_SETTLED,
    Lease,
)

logger = logging.getLogger(__name__)

UnpinnedHook = Callable[[str, np.ndarray], None]
PageValidator = Callable[[str, np.ndarray], None]
_DRAIN = -1  # work_view key present while the completion queue holds pages
MAX_PAGE_SLOTS = 1 << 32  # most page slots per end a table allocates its own pin counts for

#: Lease generations, unique in the process (a token from another table or an earlier table is stale).
_GENERATIONS = itertools.count(1)


def _as_page_array(end: str, pages: object, lo: int, hi: int) -> np.ndarray:
    """Validate one end's page list and return it as a sorted, deduplicated, read-only ``int64`` array."""
    arr = np.ascontiguousarray(host_ids(pages, f"pages[{end!r}]", lists=True, error=LeaseError))
    bad, ascending = _scan_pages(arr, lo, hi)
    if bad >= 0:
        raise LeaseError(f"physical page {int(arr[bad])} of end {end!r}: allowed [{lo}, {hi - 1}]")
    # plans pass pages already sorted and unique: one compiled pass and a copy instead of np.unique's sort
    out = np.array(arr) if ascending else np.unique(arr)
    out.setflags(write=False)
    return out


@njit(cache=True, nogil=True)
def _scan_pages(arr: np.ndarray, lo: int, hi: int) -> tuple[int, bool]:
    """One pass over a page list: ``(index of the first page outside [lo, hi) or -1, strictly ascending)``."""
    asc = True
    for i in range(arr.shape[0]):
        p = arr[i]
        if p < lo or p >= hi:
            return i, asc
        if i and p <= arr[i - 1]:
            asc = False
    return -1, asc


@njit(cache=True, nogil=True)
def _pin_add(pins: np.ndarray, pages: np.ndarray) -> int:
    """Add one pin to each of ``pages`` (unique); returns how many were unpinned before."""
    fresh = 0
    for i in range(pages.shape[0]):
        p = pages[i]
        if pins[p] == 0:
            fresh += 1
        pins[p] += 1
    return fresh


@njit(cache=True, nogil=True)
def _pin_drop(pins: np.ndarray, pages: np.ndarray, freed: np.ndarray) -> int:
    """Drop one pin from each of ``pages`` (unique); the pages whose count reached zero go to ``freed`` (in
    order); returns their count."""
    n = 0
    for i in range(pages.shape[0]):
        p = pages[i]
        pins[p] -= 1
        if pins[p] == 0:
            freed[n] = p
            n += 1
    return n


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

    Counters: ``leases_taken``, ``leases_released``, ``leases_expired``, ``pages_expired``, ``leases_in_doubt``
    (leases that went in doubt, ever), ``leases_settled``; per end :meth:`pins_current` (distinct pinned pages)
    and :meth:`in_doubt_pages`. ``version`` increments on every change of holds. Threading: Note [Lease
    threading] (``on_unpinned`` runs on the owner thread only).

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
            if pins is None and n > MAX_PAGE_SLOTS:
                raise LeaseError(f"page_slots[{end!r}]={n}: allowed at most 2**32 page slots per end")
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
        self._doubt: dict[int, Lease] = {}
        self._work: dict[int, object] = {}  # active lease ids, plus _DRAIN while the queue holds pages
        self._work_view = MappingProxyType(self._work)
        self._queue: list[tuple[str, np.ndarray]] = []  # (end, pages) unpinned on another thread
        self.lock = threading.RLock()
        self._owner = threading.get_ident()
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, lease id); stale entries skipped
        self._ids = itertools.count()
        self.leases_taken = 0
        self.leases_released = 0
        self.leases_expired = 0
        self.pages_expired = 0
        self.leases_in_doubt = 0
        self.leases_settled = 0
        self.version = 0

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def ends(self) -> tuple[str, ...]:
        return tuple(self._slots)

    def _check_end(self, end: str) -> None:
        if not isinstance(end, str) or end not in self._slots:
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
        """Boolean mask, same shape as ``pages`` (1-D integer physical pages in ``[0, page_slots)``: a torch tensor,
        numpy array or list of ints, validated as every id argument): pinned or not.

        Raises: LeaseError for an unknown end, bad ids (dtype, rank, a meta or sparse tensor) or a page outside the
        end's slots."""
        self._check_end(end)
        p = host_ids(pages, "is_pinned: pages", lists=True, error=LeaseError)  # as every id argument
        n = self._slots[end]
        if p.size and (int(p.min()) < 0 or int(p.max()) >= n):
            raise LeaseError(f"is_pinned: a page outside [0, {n}) of end {end!r}")
        return self._pins[end][p] > 0

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

    @property
    def work_view(self) -> Mapping[int, object]:
        """Live read-only view that is non-empty while a lease is active or pages unpinned on another thread wait
        for :meth:`drain`: the allocator's hot paths test its truthiness (Note [Lease threading]). O(1)."""
        return self._work_view

    def in_doubt(self) -> list[Lease]:
        """In-doubt leases in creation order (a new list)."""
        with self.lock:
            return list(self._doubt.values())

    def in_doubt_pages(self, end: str) -> int:
        """Distinct pages of ``end`` pinned by in-doubt leases (F24). O(pages of in-doubt leases)."""
        self._check_end(end)
        with self.lock:
            parts = [lease.pages[end] for lease in self._doubt.values() if end in lease.pages]
        return int(np.unique(np.concatenate(parts)).size) if parts else 0

    def lookup(self, lease_id: int, generation: int) -> Lease:
        """The live (active or in-doubt) lease with this id *and* generation, e.g. quoted by a peer's terminal
        report or a completion thread (F27). O(1).

        Raises:
            StaleLeaseError: no live lease has this id and generation (it was released, expired or settled; its pages may have a new owner).
        """
        for nm, v in (("lease_id", lease_id), ("generation", generation)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise LeaseError(f"lookup: {nm}={v!r}; allowed an int")
        with self.lock:
            lease = self._active.get(lease_id) or self._doubt.get(lease_id)
        if lease is None or lease.generation != generation:
            raise StaleLeaseError(f"lease {lease_id} generation {generation}: no live lease of this table has it "
                                  "(released, expired or settled; its pages may belong to a new owner)")
        return lease

    @property
    def owner_thread(self) -> int:
        """Thread id of the owner thread (:meth:`claim_thread`). O(1)."""
        return self._owner

    @property
    def unpinned_waiting(self) -> bool:
        """True while pages unpinned on another thread wait for :meth:`drain`. O(1)."""
        return bool(self._queue)

    def claim_thread(self) -> None:
        """Make the calling thread the owner: pages unpinned on it are reported at once, on others queued for
        :meth:`drain` (Note [Lease threading]). O(1)."""
        self._owner = threading.get_ident()

    def drain(self) -> int:
        """Report (``on_unpinned``) the pages unpinned on other threads since the last call that are still
        unpinned; the owner thread calls it (the allocator does at the start of every call). Returns how many
        (end, pages) batches were queued. O(queued pages)."""
        with self.lock:
            queued, self._queue = self._queue, []
            self._work.pop(_DRAIN, None)
            if not queued or self.on_unpinned is None:
                return len(queued)
            by_end: dict[str, list[np.ndarray]] = {}
            for end, pages in queued:
                by_end.setdefault(end, []).append(pages)
            for end in self._slots:
                chunks = by_end.get(end)
                if not chunks:
                    continue
                pages = chunks[0] if len(chunks) == 1 else np.unique(np.concatenate(chunks))
                pages = pages[self._pins[end][pages] == 0]  # pinned again since: not reported
                if pages.size:
                    self.on_unpinned(end, pages)
        return len(queued)

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
            if not isinstance(end, str) or end not in self._slots:
                raise LeaseError(f"lease names end {end!r}: allowed one of {sorted(self._slots)}")
            checked[end] = _as_page_array(end, arr, self._lo[end], self._slots[end])
        deadline = None if deadline_s is None else self.now() + float(deadline_s)
        with self.lock:  # the allocator holds it while it compacts (Note [Lease threading])
            if self.validator is not None:
                for end, arr in checked.items():
                    if arr.size:
                        self.validator(end, arr)
            # ---- nothing has changed up to here
            lease = Lease(self, next(self._ids), next(_GENERATIONS), checked, deadline, tag)
            for end, arr in checked.items():
                if arr.size:
                    self._pinned_pages[end] += _pin_add(self._pins[end], arr)  # arr is unique
            self._active[lease.id] = lease
            self._work[lease.id] = lease
            if deadline is not None:
                heapq.heappush(self._deadlines, (deadline, lease.id))
            self.leases_taken += 1
            self.version += 1
        return lease

    def _unpin(self, lease: Lease, into: dict[str, list[np.ndarray]]) -> None:
        for end, arr in lease.pages.items():
            if arr.size:
                freed = np.empty_like(arr)
                n = _pin_drop(self._pins[end], arr, freed)
                if n:
                    self._pinned_pages[end] -= n
                    into.setdefault(end, []).append(freed[:n])

    def _notify(self, unpinned: dict[str, list[np.ndarray]]) -> None:
        """Report unpinned pages: at once on the owner thread, else queued for :meth:`drain` (lock held)."""
        if self.on_unpinned is None or not unpinned:
            return
        if threading.get_ident() != self._owner:
            for end, end_chunks in unpinned.items():
                self._queue.extend((end, c) for c in end_chunks)
            self._work[_DRAIN] = None
            return
        for end in self._slots:  # table end order: deterministic
            chunks = unpinned.get(end)
            if not chunks:
                continue
            pages = chunks[0] if len(chunks) == 1 else np.unique(np.concatenate(chunks))
            self.on_unpinned(end, pages)

    def _check_mine(self, lease: Lease) -> None:
        if lease._table is not self:
            raise LeaseError(f"lease {lease.id} belongs to another table")

    def _to_doubt(self, lease: Lease, why: str) -> None:
        """active -> in_doubt (lock held): pins stay (F24)."""
        del self._active[lease.id]
        self._work.pop(lease.id, None)
        self._doubt[lease.id] = lease
        lease._state = LEASE_IN_DOUBT
        self.leases_in_doubt += 1
        self.version += 1
        logger.warning("lease %d (tag %r) in doubt: %s while %d engine hold(s) are outstanding; its %d page(s) "
                       "stay pinned until the engine lets go", lease.id, lease.tag, why, lease._holds,
                       lease.num_pages)

    def _release(self, lease: Lease, how: str) -> bool:
        self._check_mine(lease)
        with self.lock:
            if lease._state != LEASE_ACTIVE:
                return False
            if lease._holds:
                self._to_doubt(lease, "released")
                return True
            unpinned: dict[str, list[np.ndarray]] = {}
            self._unpin(lease, unpinned)
            del self._active[lease.id]
            self._work.pop(lease.id, None)
            lease._state = how
            if how == LEASE_RELEASED:
                self.leases_released += 1
            self.version += 1
            self._notify(unpinned)
        return True

    def _hold(self, lease: Lease) -> int:
        self._check_mine(lease)
        with self.lock:
            if lease._state != LEASE_ACTIVE:
                raise LeaseError(f"lease {lease.id} is {lease._state}: its pages may be reused, nothing may be "
                                 "handed to an engine (F11)")
            lease._holds += 1
        return lease.generation

    def _settle_now(self, lease: Lease) -> None:
        unpinned: dict[str, list[np.ndarray]] = {}
        self._unpin(lease, unpinned)
        del self._doubt[lease.id]
        lease._state = LEASE_SETTLED
        lease._holds = 0
        self.leases_settled += 1
        self.version += 1
        self._notify(unpinned)

    def _unhold(self, lease: Lease, generation: int) -> bool:
        self._check_mine(lease)
        with self.lock:
            if generation != lease.generation or lease._holds <= 0:
                raise StaleLeaseError(f"lease {lease.id}: engine report for generation {generation} (lease "
                                      f"generation {lease.generation}, {lease._holds} hold(s), {lease._state})")
            lease._holds -= 1
            if lease._holds == 0 and lease._state == LEASE_IN_DOUBT:
                self._settle_now(lease)
                return True
        return False

    def _settle(self, lease: Lease, generation: int | None) -> bool:
        self._check_mine(lease)
        with self.lock:
            if generation is not None and generation != lease.generation:
                raise StaleLeaseError(f"lease {lease.id}: settle for generation {generation}, lease generation "
                                      f"{lease.generation}")
            if lease._state == LEASE_SETTLED:
                return False
            if lease._state != LEASE_IN_DOUBT:
                raise StaleLeaseError(f"lease {lease.id} is {lease._state}: only an in-doubt lease settles")
            self._settle_now(lease)
        return True

    def _drop_stale_deadlines(self) -> None:
        heap = self._deadlines
        while heap and heap[0][1] not in self._active:
            heapq.heappop(heap)

    def now(self) -> float:
        """The clock's reading as a float; a clock that returns anything but a finite real number raises
        :class:`~umalloc.errors.LeaseError`. O(1)."""
        t = self.clock()
        if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)) or not math.isfinite(t):
            raise LeaseError(f"clock() returned {t!r}; allowed a finite number of seconds")
        return float(t)

    def expire(self, now: float | None = None) -> list[Lease]:
        """Expire every active lease whose deadline is ``<= now`` (default: the clock): reclaimed at once (``expired``,
        counted in ``leases_expired`` / ``pages_expired``) when no engine holds a part of it, else ``in_doubt``
        (pins kept, F24). Each is logged at WARNING. Returns them (deadline order). O(1) when nothing is due,
        else O(pages of the expired leases + k log leases)."""
        if now is None:
            with self.lock:
                self._drop_stale_deadlines()
                if not self._deadlines:
                    return []
            now = self.now()
        elif isinstance(now, bool) or not isinstance(now, (int, float, np.integer, np.floating)) or not math.isfinite(now):
            raise LeaseError(f"expire: now={now!r}; allowed None or a finite number of seconds")
        heap = self._deadlines
        out: list[Lease] = []
        unpinned: dict[str, list[np.ndarray]] = {}
        with self.lock:
            while heap and heap[0][0] <= now:
                _, lease_id = heapq.heappop(heap)
                lease = self._active.get(lease_id)
                if lease is None:
                    continue  # released earlier
                if lease._holds:
                    self._to_doubt(lease, f"deadline passed {now - (lease.deadline or now):.3f}s ago")
                    out.append(lease)
                    continue
                del self._active[lease_id]
                self._work.pop(lease_id, None)
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
        """Release every active lease carrying ``tag`` (a peer died, a request was aborted); one with an engine
        hold goes in doubt instead (F24). Returns how many. O(leases + their pages)."""
        if not isinstance(tag, str):
            raise LeaseError(f"release_tagged: tag={tag!r}; allowed a str")
        with self.lock:
            victims = [lease for lease in self._active.values() if lease.tag == tag]
            for lease in victims:
                self._release(lease, LEASE_RELEASED)
        return len(victims)

    # ---- invariants ----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Pin counts equal the sum over active and in-doubt leases; distinct-pinned counters match; counters balance;
        every active lease with a deadline sits in the deadline heap. O(slots + pins). Raises
        :class:`InvariantError` naming the invariant."""
        with self.lock:
            self._check_invariants()

    def _check_invariants(self) -> None:
        held = (*self._active.values(), *self._doubt.values())
        for end, pins in self._pins.items():
            expect = np.zeros_like(pins)
            for lease in held:
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
            if lease._state != LEASE_ACTIVE or lease.id not in self._work:
                raise InvariantError(f"lease {lease.id} is registered but {lease._state}")
        for lease in self._doubt.values():
            if lease._state != LEASE_IN_DOUBT or lease._holds < 0:
                raise InvariantError(f"lease {lease.id} is in the in-doubt table but {lease._state}")
        if set(self._work) - {_DRAIN} != set(self._active) or (_DRAIN in self._work) != bool(self._queue):
            raise InvariantError("work view differs from the active leases and the completion queue")
        if self.leases_taken != len(self._active) + self.leases_released + self.leases_expired + \
                self.leases_in_doubt:
            raise InvariantError("leases taken != active + released + expired + in doubt")
        if self.leases_in_doubt != len(self._doubt) + self.leases_settled:
            raise InvariantError("leases in doubt != in doubt now + settled")
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
            "leases_in_doubt_now": len(self._doubt),
            "leases_in_doubt": self.leases_in_doubt,
            "leases_settled": self.leases_settled,
            "in_doubt_pages": {e: self.in_doubt_pages(e) for e in self._slots},
        }


__all__ = ["LEASE_ACTIVE", "LEASE_EXPIRED", "LEASE_IN_DOUBT", "LEASE_RELEASED", "LEASE_SETTLED", "Lease",
           "LeaseTable"]
