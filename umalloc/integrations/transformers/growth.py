"""How a request's pages grow in :class:`~umalloc.integrations.transformers.cache.UmallocPagedCache`: the tokens
each request holds, the pages a growth takes, whether their bytes fit, and the growth itself.

Policy:

* **All or nothing.** A growth takes its ring's pages first, then its full-attention row's, one table call each;
  a table that refuses undoes what the growth took (Note [Sliding ring] in
  :mod:`~umalloc.integrations.transformers.rings`), so a refused request holds what it held before.
* **Checked in bytes first.** Before any table call, the pages a growth takes (a fork's shared partial last page
  copied first counted in) must fit the free bytes: holes of every end, the gap between the ends and cached
  pages. This is necessary whatever the layout; the allocator's compaction turns holes into gap when an
  allocation needs it. The free bytes are memoized until the next allocation or free.
* **One-token decodes are deferred** (Note [Deferred growth]).

Note [Deferred growth]
~~~~~~~~~~~~~~~~~~~~~~
A decode (one token) into the request's own partial last page needs no page on either table, so it cannot fail:
``can_store_request_tokens`` answers ``True`` at once and records the token; the next call that reads or changes
the tables (the IO builder asking for indices, any other growth, a free, a fork, the step hook, the invariant
check) first puts every recorded token into the tables with one ``extend`` per table (:meth:`Growth.flush`). A
page that may be shared is never grown this way: a fork's source and its forks (their partial last page is
shared, copied on the first write) always go through the tables.

Threading: the scheduler's thread only, as the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from umalloc import Arena, InvariantError, MultiEndedAllocator, RequestTable


class Growth:
    """The tokens each request of the cache holds and the growth of its tables (module docstring).

    The cache wires it once and keeps no copy of its state: ``slots`` and ``ring_slots`` are the cache's own
    dicts (request id -> table slot, table slot -> ring slot), which :meth:`grow` fills for a new request.

    Args:
        table: the request table naming the requests (``full``; ``swa`` when every layer slides).
        ring_table: the rings' table beside ``table``; None without sliding layers or when ``table`` holds the
            rings (Note [All sliding] in :mod:`~umalloc.integrations.transformers.rings`).
        alloc, arena: the cache's allocator and arena. owner: ``table``'s end.
        page_size: tokens per page. ring_tokens: a ring's slots (None without sliding layers).
        full_page_bytes: bytes of one full-attention page, its bound draft page included.
        swa_page_bytes: bytes of one ring page (0 without sliding layers).
        cache_freed: whether freed full-attention pages stay cached (count toward the free bytes).
        forget_rows: drops the groups' kept rows of (table slots, ring slots).

    Attributes:
        held: table slot -> tokens it holds (the tables' lengths, kept here: no table call).
        pending: table slot -> tokens granted, not yet in the tables (Note [Deferred growth]).
        forked: slots that may share a partial page (fork sources and forks).
        free_bytes_memo: :meth:`free_bytes` until the next allocation or free (None: to compute); whoever
            allocates or frees sets it to None.
    """

    def __init__(self, table: RequestTable, ring_table: RequestTable | None, alloc: MultiEndedAllocator,
                 arena: Arena, owner: str, page_size: int, ring_tokens: int | None, full_page_bytes: int,
                 swa_page_bytes: int, cache_freed: bool, slots: dict[str, int], ring_slots: dict[int, int],
                 forget_rows: Callable[[list[int], list[int]], None]) -> None:
        self.table, self.ring_table, self.alloc, self.arena, self.owner = table, ring_table, alloc, arena, owner
        self.has_full = owner == "full"
        self.page_size, self.ring_tokens = page_size, ring_tokens
        self.full_page_bytes, self.swa_page_bytes, self.cache_freed = full_page_bytes, swa_page_bytes, cache_freed
        self.slots, self.ring_slots, self.forget_rows = slots, ring_slots, forget_rows
        self.held: dict[int, int] = {}
        self.pending: dict[int, int] = {}
        self.forked: set[int] = set()
        self.free_bytes_memo: int | None = None

    def table_tokens(self, held: int) -> int:
        """Tokens ``table`` holds for a request of ``held`` tokens: all of them, or ``min(held, ring_tokens)`` when
        the table holds the rings (Note [All sliding])."""
        return held if self.has_full or self.ring_tokens is None else min(held, self.ring_tokens)

    def defer(self, slot: int, target: int) -> bool:
        """Record request ``slot``'s growth to ``target`` tokens without a table call when it is one token into
        its own partial last page (Note [Deferred growth]); False, with nothing recorded, otherwise. O(1)."""
        held = self.held[slot]
        if target - held != 1 or not held % self.page_size or slot in self.forked:
            return False
        self.pending[slot] = self.pending.get(slot, 0) + 1
        self.held[slot] = target
        return True

    def flush(self) -> None:
        """Put the deferred growths into the tables: one ``extend`` per table for all of them (Note [Deferred
        growth]). Raises InvariantError if a table refuses one (they need no page, so that is a bug)."""
        if not self.pending:
            return
        items = list(self.pending.items())
        self.pending.clear()
        if not self.has_full:   # the table holds the rings (Note [All sliding])
            items = [(s, self.table_tokens(self.held[s]) - self.table_tokens(self.held[s] - n)) for s, n in items]
            items = [(s, g) for s, g in items if g]
        slots = np.array([s for s, _ in items], np.int64)
        if items and self.table.extend(slots, np.array([n for _, n in items], np.int64)) is None:
            raise InvariantError(f"deferred growth of slots {slots.tolist()} refused by the table")
        if self.ring_table is None or self.ring_tokens is None:
            return
        w = self.ring_tokens
        rings = [(self.ring_slots[s], min(self.held[s], w) - min(self.held[s] - n, w)) for s, n in items]
        rings = [(r, g) for r, g in rings if g]
        if rings and self.ring_table.extend(np.array([r for r, _ in rings], np.int64),
                                            np.array([g for _, g in rings], np.int64)) is None:
            raise InvariantError(f"deferred ring growth of rings {[r for r, _ in rings]} refused by the ring table")

    def fresh_pages(self, num_tokens: int) -> tuple[int, int]:
        """(full pages, ring pages) a request holding nothing takes to grow by ``num_tokens`` (Note [Sliding
        ring])."""
        ps = self.page_size
        pages = -(-num_tokens // ps)
        if self.ring_tokens is None:
            return pages, 0
        return pages if self.has_full else 0, -(-min(num_tokens, self.ring_tokens) // ps)

    def cow_pages(self, slot: int) -> int:
        """1 if request ``slot``'s partial last page may be shared (a fork's source or a fork that has not grown
        through the table since), so its next growth may copy it first; else 0."""
        return int(slot in self.forked and self.held.get(slot, 0) % self.page_size != 0)

    def new_pages(self, known: int | None, held: int, num_tokens: int) -> tuple[int, int]:
        """(full pages, ring pages) a growth of request ``known`` (None: new) from ``held`` by ``num_tokens``
        allocates, counting the copy of a shared partial last page (a fork's). Their bytes fitting in
        :meth:`free_bytes` is what the growth needs: the allocator's compaction turns holes into gap, and a byte
        frontier of each end moves in its own page size (Note [Sliding ring])."""
        if known is None:
            return self.fresh_pages(num_tokens)
        ps, end = self.page_size, held + num_tokens
        full = -(-end // ps) - -(-held // ps) + self.cow_pages(known) if self.has_full else 0
        if self.ring_tokens is None:
            return full, 0
        w = self.ring_tokens
        return full, -(-min(end, w) // ps) - -(-min(held, w) // ps)

    def free_bytes(self) -> int:
        """Bytes allocatable now or after evicting every cached page: holes of every end, the gap between the
        ends, and the cached full-attention pages (only a model without sliding layers caches pages). O(ends), from
        the allocator's end views."""
        ends = self.alloc.ends
        full = ends[self.owner]   # the up end (``swa`` when every layer slides, Note [All sliding])
        total = sum(v.hole_pages * v.page_bytes for v in ends.values())
        edge = full.hi * full.page_bytes   # the gaps up to a draft end floating between full and swa, and past it
        if self.ring_table is not None and "draft" in ends:
            mid = ends["draft"]
            total += max(0, mid.lo * mid.page_bytes - edge)
            edge = max(edge, mid.hi * mid.page_bytes)
        if self.ring_table is not None or "draft" in ends:   # the gap up to the end growing down
            down = ends["swa" if self.ring_table is not None else "draft"]
            total += max(0, down.lo * down.page_bytes - edge)
        else:
            total += self.arena.arena_bytes - edge
        if self.cache_freed:   # only then are pages cached (free_blocks caches nothing otherwise)
            total += int(self.table.capacity()["full"]["reclaimable_pages"]) * full.page_bytes
        return total

    def free_bytes_now(self) -> int:
        """:meth:`free_bytes`, computed once until the next allocation or free clears ``free_bytes_memo``."""
        if self.free_bytes_memo is None:
            self.free_bytes_memo = self.free_bytes()
        return self.free_bytes_memo

    def fits_bytes(self, full_pages: int, swa_pages: int) -> bool:
        """Whether that many pages fit in the free bytes (:meth:`free_bytes_now`): a necessary condition, whatever
        the layout; the allocation itself compacts if holes are in the way."""
        need = full_pages * self.full_page_bytes if full_pages else 0
        if swa_pages:
            need += swa_pages * self.swa_page_bytes
        return need <= self.free_bytes_now()

    def grow(self, request_id: str, known: int | None, held: int, num_tokens: int) -> bool:
        """Grow request ``known`` (None: a new request, ``request_id``) from ``held`` by ``num_tokens`` tokens: its
        ring first, then its full-attention row, one table call each; all or nothing (Note [Sliding ring])."""
        one = np.ones(1, np.int64)
        slot = known
        if slot is None:
            got = self.table.new_requests(1)
            if got is None:
                return False
            slot = int(got[0])
        ring = self.ring_slots.get(slot)
        new_ring = ring is None
        ring_grow = 0
        if self.ring_table is not None and self.ring_tokens is not None:
            if ring is None and known is not None:
                raise InvariantError(f"request {request_id!r} holds tokens but no ring (Note [Sliding ring])")
            ring_grow = min(held + num_tokens, self.ring_tokens) - min(held, self.ring_tokens)
            if ring is None:
                got = self.ring_table.new_requests(1)
                if got is None:
                    self.table.free_requests([slot])
                    return False
                ring = int(got[0])
            if ring_grow and self.ring_table.extend(np.array([ring], np.int64), one * ring_grow) is None:
                if new_ring:
                    self.ring_table.free_requests([ring])
                if known is None:
                    self.table.free_requests([slot])
                return False
        table_grow = self.table_tokens(held + num_tokens) - self.table_tokens(held)
        if table_grow and self.table.extend(np.array([slot], np.int64), one * table_grow) is None:
            if self.ring_table is not None and ring is not None:
                if new_ring:
                    self.ring_table.free_requests([ring])
                elif ring_grow:
                    self.ring_table.truncate(np.array([ring], np.int64), one * min(held, self.ring_tokens or 0))
                    self.forget_rows([], [ring])
            if known is None:
                self.table.free_requests([slot])
            return False
        self.forked.discard(slot)   # its last page is its own now: copied on write, or a fresh page
        self.held[slot] = held + num_tokens
        if known is None:
            self.slots[request_id] = slot
        if ring is not None:
            self.ring_slots[slot] = ring
        return True


__all__ = ["Growth"]
