"""Reference-counted pages with a cached-free LRU, for an engine that allocates page by page (vLLM's ``BlockPool``).

A :class:`PageRefs` sits on the one end of an id allocator (one ``up`` end, Note [Exact ids] in
:mod:`umalloc.allocator.facade`) and is the only owner of its pages: each virtual page is *held* (reference count
``> 0``), *cached* (count 0, content kept, in LRU order; the states and LRU links of
:mod:`umalloc.requests.refcounts`, the machinery the request table uses) or *free* in the allocator. The engine keeps
no count of its own: it reads and adjusts the counts here (:attr:`PageRefs.ref_counts`).

Policy:

* **take** (``take(n)``): ``n`` fresh pages, the allocator's ``n`` lowest free ids, each with count 1. When the
  allocator has fewer than ``n`` free ids, the LRU-first cached pages go back to it first, exactly as many as
  missing (so cached pages are evicted only after every free one is used, oldest first); the evicted ids are
  listed (:meth:`PageRefs.evicted`), and the pages handed out with their keep flag set
  (:meth:`PageRefs.taken_kept`) for the engine to drop from its prefix index.
* **ref** (``ref(ids)``): one more reference per entry; a cached page leaves the LRU, a free page is claimed
  from the allocator by id (:meth:`~umalloc.allocator.facade.MultiEndedAllocator.claim_pages`).
* **unref** (``unref(ids)``): one reference less per entry, all or nothing: a count that would drop below 0
  (a double free) raises and changes nothing. A page reaching 0 joins the LRU tail if its *keep flag* is set
  (:attr:`PageRefs.keep_flags`: the engine marks the pages whose content it indexes) or its entry is negative
  (``-id``: keep it this once), and goes back to the allocator otherwise; id 0 (the reserved page) is skipped.
* **Counts are the engine's to read and to raise** on held pages (``ref_counts[i] += 1`` for a copy it keeps);
  a count set to 0 outside :meth:`unref`, or raised on a page that is not held, is what
  :meth:`check_invariants` reports (a leak, or a page held by no one).
* O(1) free count: :attr:`PageRefs.num_free` (allocator) and :attr:`PageRefs.num_cached` are counters.

Note [Fused kernels]
~~~~~~~~~~~~~~~~~~~~
``take`` and ``unref`` are one numba call each: the kernel here calls the allocator's own page kernel
(``k_alloc_pages`` / ``k_free``) on its heap (:meth:`~umalloc.allocator.facade.MultiEndedAllocator.direct_kernel_args`)
and does the bookkeeping in the same call, so no Python runs between the allocator's change and this object's,
and a list of ids crosses into the kernel as one ``array('q')``. When the allocator's public methods would do
more than their kernel (a device mirror, ``debug_checks``, eager compaction, lease work due, or a refused
allocation to retry), the call takes them instead: the holder check the allocator runs from inside them waits
until the bookkeeping is done (:meth:`PageRefs.check_invariants` runs after the call under ``debug_checks``).

Note [One-page calls]
~~~~~~~~~~~~~~~~~~~~~
An engine's decode step and a sliding window's step move one page at a time, where a kernel call's fixed cost
(argument unboxing, ~0.25 us) is most of the work. A call that touches only this object's rows runs in Python on
``memoryview`` s of them instead, with the kernel's exact effect: ``take(1)`` with no free id (the LRU head),
``unref`` of one id whose count stays above 0 or that is cached at 0 (keep flag set), ``ref`` of a list of at
most :data:`SMALL_REF` held or cached ids (0 skipped). Anything that reaches the allocator (a free
id to take or to claim, a page freed to it), lease work due, ``debug_checks`` (take and unref), a bad entry or a
negative entry takes the kernel path.

Note [Spare ids]
~~~~~~~~~~~~~~~~
A ``take(1)`` that reaches the allocator mints :data:`SPARE_BATCH` of its lowest free ids in one kernel call and
keeps them as *spares*: live in the allocator, free here (state ``PAGE_NOT_MANAGED``, counted in ``num_free``), in
a min-heap (a Python list). Takes pop the lowest spares in Python; a longer take puts every spare first and mints
the rest in its kernel call. ``_floor`` bounds every id free in the allocator from below, and every spare is below
it, so the spares are the lowest free ids and the order of ``take`` is unchanged: a page freed below ``_floor``
joins the spares (in Python, or listed by :func:`~umalloc.requests.pagekernels.k_unref_direct` in ``w[W_SPARED]``), one at or above it goes
back to the allocator. Every call that runs the allocator's public methods (a claim, an uncache, lease work due)
first returns the spares to the allocator and resets ``_floor`` to 0. :meth:`PageRefs.check_invariants` checks
the spares (``spares``: live there, free here, below ``_floor`` and below every id free in the allocator).

Not thread-safe: call from the thread that owns the allocator.
"""

from __future__ import annotations

from array import array
from heapq import heappop, heappush

import numpy as np

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.errors import DoubleFreeError, InvalidIdError, InvariantError, UmallocValueError
from umalloc.ids import id_batch
from umalloc.pool.pagestate import TOMBSTONE
from umalloc.requests.pagekernels import (
    R_ALLOC_REFUSED,
    R_TAKE_RANGE,
    W_CLAIM,
    W_FREED,
    W_KEEP,
    W_KEPT,
    W_OUT,
    W_REF,
    W_ROWS,
    W_SPARED,
    W_STATE,
    entries,
    k_cache_first,
    k_uncache,
)
from umalloc.requests.refcounts import LRU_NEXT, LRU_PREV, PAGE_CACHED, PAGE_HELD, PAGE_NOT_MANAGED

#: ids one ``take(1)`` mints from the allocator as spares (Note [Spare ids])
SPARE_BATCH = 32
#: the longest list :meth:`PageRefs.ref` handles in Python (Note [One-page calls]; at 4 the kernel is faster)
SMALL_REF = 1


# ---- the owner -------------------------------------------------------------------------------------------------
class PageRefs:
    """The holders of every page of an id allocator's one end (module docstring).

    Args:
        alloc: an id allocator (one ``up`` end, the only end of its arena) with no live page.

    Attributes:
        alloc: the allocator (its pages are freed and allocated through this object only).
        ref_counts: ``memoryview`` (int64 items) of length ``num_vpages``: the reference count of every page;
            index it for a Python ``int`` (O(1), no numpy scalar). Writable for an engine that takes an extra
            reference on a held page; :meth:`check_invariants` reports any other write.
        keep_flags: ``memoryview`` (int64 items, 0 or 1) of length ``num_vpages``: 1 if the page's content is
            worth keeping (the engine indexes it by content: a vLLM block with a hash). The engine sets and
            clears it; :meth:`unref` caches a page reaching 0 whose flag is set, :meth:`take` lists the pages
            it hands out whose flag is set (:meth:`taken_kept`).
        num_free / num_cached: pages free in the allocator / cached. O(1) attributes.
        num_taken_kept: how many pages the last :meth:`take` handed out with their keep flag set.

    Raises:
        UmallocValueError: ``alloc`` is not an id allocator, or has live pages.

    Complexity: O(num_vpages) memory (``W_ROWS`` int64 per page).

    >>> from umalloc.integrations.vllm import id_allocator
    >>> refs = PageRefs(id_allocator(6))               # pages 1..5
    >>> a = refs.take(3).tolist(); a                    # count 1 each
    [1, 2, 3]
    >>> refs.keep_flags[1] = 1                          # page 1's content is worth keeping
    >>> refs.unref([1, 2])                              # 1 cached, 2 free again
    >>> refs.num_free, refs.num_cached, refs.take(4).tolist(), refs.evicted().tolist(), refs.taken_kept().tolist()
    (3, 1, [2, 4, 5, 1], [1], [1])
    """

    def __init__(self, alloc: MultiEndedAllocator) -> None:
        if not isinstance(alloc, MultiEndedAllocator):
            raise UmallocValueError(f"alloc={alloc!r}: allowed a MultiEndedAllocator")
        ends = list(alloc.ends)
        if len(ends) != 1 or alloc.spec.ends[0].grow.value != "up":
            raise UmallocValueError(f"alloc: allowed an id allocator (one 'up' end, the arena's only one); got "
                                    f"ends {ends}")
        self.end = ends[0]
        if (live := alloc.stats()[self.end].live_pages):
            raise UmallocValueError(f"alloc: {live} live pages allocated outside; allowed an allocator with none")
        self.alloc = alloc
        nv = alloc.num_vpages()
        w = self._w = np.zeros((W_ROWS, nv), np.int64)
        self._lru, self._ref, self._state, self._keep = w[:2], w[W_REF], w[W_STATE], w[W_KEEP]
        self._out, self._kept = w[W_OUT].data, w[W_KEPT].data   # take's results, read as memoryviews
        self._m = self._n = 0                     # the last take: pages fresh from the allocator, all pages
        self.num_taken_kept = 0
        hot = self._hot = entries()
        self._take_k = hot.take_direct
        self._ref_a, self._ref_q = hot.ref
        self._unref_a, self._unref_q = hot.unref_direct
        self.ref_counts: memoryview = self._ref.data
        self.keep_flags: memoryview = self._keep.data
        # Note [One-page calls]: the rows as memoryviews (a Python int per read, no numpy scalar)
        self._prev, self._next, self._state_mv = w[LRU_PREV].data, w[LRU_NEXT].data, w[W_STATE].data
        self._out_mv, self._nv = w[W_OUT].data, nv
        self._revived = 0                         # what the last short ref revived
        self._spares: list[int] = []              # Note [Spare ids]: a min-heap of ids live in the allocator
        self._floor = 0                           # every id free in the allocator is >= this, every spare below
        self._spared = w[W_SPARED].data
        self._mint = hot.mint
        self.num_free = alloc.available_pages(self.end)
        self.num_cached = 0
        # Note [Fused kernels]: one kernel call per take / unref, the allocator's kernel inside ours; root 0:
        # the allocator's calls do more than their kernel, take its public methods
        direct = alloc.direct_kernel_args()
        self._root, self._owner, self._mask, self._lease_work = direct if direct is not None else (0, 0, 0, {1: 1})
        self._busy = False                        # inside a call that runs the allocator's public methods
        alloc.attach_holder_check(self._check_as_holder)

    # ---- the engine's calls ------------------------------------------------------------------------------------
    def take(self, n: int) -> memoryview:
        """``n`` pages held once each (module docstring): the allocator's free ids ascending, then as many
        cached pages as missing, LRU first (:meth:`evicted`; they stay live in the allocator, so taking them
        is a state change here only). Returns a ``memoryview`` of ``n`` int64 page ids over a buffer this
        object reuses (valid until the next ``take``). Raises UmallocValueError for ``n`` not an int in
        ``[0, num_free + num_cached]`` (nothing changes). O(n) in one kernel call (Note [Fused kernels])."""
        if type(n) is not int:
            raise UmallocValueError(f"take: {n!r} pages; allowed an int >= 0")
        sp = self._spares
        if sp and 0 < n <= len(sp) and not self._lease_work:   # Note [Spare ids]
            return self._take_spares(n)
        free = self.num_free
        if n == 1 and not self._lease_work:
            if free:
                if self._mint_spares():
                    return self._take_spares(1)
            elif self.num_cached:   # Note [One-page calls]
                self._take_lru_head()
                return self._out[:1]
        c = R_ALLOC_REFUSED
        s = len(sp) if n > 0 else 0
        if not self._lease_work:
            if s:   # n > s here
                if n > free + self.num_cached:
                    raise UmallocValueError(f"take: {n} pages; allowed an int in [0, {free + self.num_cached}] "
                                            f"(free {free} + cached {self.num_cached})")
                out = self._out_mv
                for i in range(s):   # the heap popped: ascending
                    out[i] = heappop(sp)
            c = self._take_k(self._root, self._owner, self._mask, self._w, n, free, self.num_cached, s)
            if c < 0 and s:   # nothing changed: the spares back, then the public path returns them
                self._spares = list(self._w[W_OUT, :s].tolist())
        if c < 0:
            return self._take_public(n, c)
        m = n if n <= free else free
        self._m = m
        self._n = n
        self.num_free = free - m
        self.num_cached -= n - m
        self.num_taken_kept = c
        return self._out[:n]

    def take_one(self) -> int:
        """:meth:`take` of one page, its id as an int: the same effect (:meth:`taken_kept`, :meth:`evicted`) and
        the same error (UmallocValueError, nothing changed, with no page to take). O(1) in Python but for one
        kernel call per :data:`SPARE_BATCH` takes (Note [Spare ids], Note [One-page calls])."""
        if not self._lease_work:
            if self._spares:
                return self._take_spare()
            if not self.num_free and self.num_cached:
                return self._take_lru_head()
        return self.take(1)[0]

    def _take_spare(self) -> int:
        """``take(1)`` of the lowest spare (Note [Spare ids]): its id."""
        v = heappop(self._spares)
        self.ref_counts[v] = 1
        self._state_mv[v] = PAGE_HELD
        self._out_mv[0] = v
        if self.keep_flags[v]:
            self._kept[0] = v
            self.num_taken_kept = 1
        else:
            self.num_taken_kept = 0
        self._m = self._n = 1
        self.num_free -= 1
        return v

    def _mint_spares(self) -> bool:
        """Mint up to :data:`SPARE_BATCH` of the allocator's lowest free ids as spares (Note [Spare ids]);
        ``False`` if the allocator refuses (nothing changed)."""
        k = min(SPARE_BATCH, self.num_free)
        if self._mint(self._root, self._owner, self._mask, self._w, k) < 0:
            return False
        sp = self._spares = self._w[W_CLAIM, :k].tolist()   # ascending: a min-heap
        self._floor = max(self._floor, sp[-1] + 1)
        return True

    def _take_spares(self, n: int) -> memoryview:
        """``take(n)`` of the ``n`` lowest spares (Note [Spare ids]): :func:`~umalloc.requests.pagekernels.k_hold`'s effect in Python."""
        sp, out, counts, state, keep, kept = \
            self._spares, self._out_mv, self.ref_counts, self._state_mv, self.keep_flags, self._kept
        c = 0
        for i in range(n):
            v = heappop(sp)
            out[i] = v
            counts[v] = 1
            state[v] = PAGE_HELD
            if keep[v]:
                kept[c] = v
                c += 1
        self.num_taken_kept = c
        self._m = self._n = n
        self.num_free -= n
        return self._out[:n]

    def _return_spares(self) -> None:
        """Every spare back to the allocator through its public ``free_pages``; ``_floor`` reset (Note [Spare
        ids]). Before any call that runs the allocator's public methods."""
        self._floor = 0
        if not self._spares:
            return
        q = np.array(self._spares, np.int64)
        self._spares = []
        self._busy = True
        try:
            self.alloc.free_pages(q)
        finally:
            self._busy = False

    def _take_lru_head(self) -> int:
        """``take(1)`` of the LRU head with no free id left (Note [One-page calls]): :func:`~umalloc.requests.pagekernels.k_hold`'s effect;
        its id."""
        nxt = self._next
        v = nxt[0]
        q = nxt[v]   # the head's predecessor is the sentinel 0
        nxt[0] = q
        self._prev[q] = 0
        nxt[v] = 0
        self.ref_counts[v] = 1
        self._state_mv[v] = PAGE_HELD
        self._out_mv[0] = v
        if self.keep_flags[v]:
            self._kept[0] = v
            self.num_taken_kept = 1
        else:
            self.num_taken_kept = 0
        self._m = 0
        self._n = 1
        self.num_cached -= 1
        return v

    def _take_public(self, n: int, c: int) -> memoryview:
        """:meth:`take` through the allocator's public ``alloc_pages`` (its checks, lease ticks, retries)."""
        free = self.num_free
        if c == R_TAKE_RANGE or n < 0 or n > free + self.num_cached:
            raise UmallocValueError(f"take: {n} pages; allowed an int in [0, {free + self.num_cached}] (free "
                                    f"{free} + cached {self.num_cached})")
        self._return_spares()
        m = n if n <= free else free
        self._busy = True
        try:
            got = self.alloc.alloc_pages(m, out=self._w[W_OUT, :m]) if m else True
        finally:
            self._busy = False
        if got is None:
            raise InvariantError(f"free-count: the allocator refused {m} pages counted as free")
        self.num_taken_kept = self._hot.hold(self._w, m, n)
        self._m = m
        self._n = n
        self.num_free = free - m
        self.num_cached -= n - m
        self._after_public()
        return self._out[:n]

    def evicted(self) -> memoryview:
        """The cached pages the last :meth:`take` evicted, LRU first (int64 ``memoryview`` of its result; empty
        if none)."""
        return self._out[self._m: self._n]

    def taken_kept(self) -> memoryview:
        """The pages the last :meth:`take` handed out with their keep flag set, in its order (the evicted pages
        and any page flagged while free; an int64 ``memoryview`` of a reused buffer)."""
        return self._kept[: self.num_taken_kept]

    def ref(self, ids: np.ndarray | list[int]) -> int:
        """One reference more per entry of ``ids`` (``int64 (n,)`` numpy or a list of ints; 0 entries skipped);
        cached pages leave the LRU, free pages are claimed by id from the allocator. Returns the pages revived
        from the cache. Raises InvalidIdError for an id out of range or not an int (nothing changes). O(n)."""
        if type(ids) is list:
            if len(ids) == 1 and type(v := ids[0]) is int and 0 < v < self._nv:   # Note [One-page calls]
                state = self._state_mv
                s = state[v]
                if s == PAGE_CACHED:
                    prev, nxt = self._prev, self._next
                    p, q = prev[v], nxt[v]
                    nxt[p] = q
                    prev[q] = p
                    prev[v] = nxt[v] = 0
                    state[v] = PAGE_HELD
                    self.ref_counts[v] += 1
                    self.num_cached -= 1
                    return 1
                if s == PAGE_HELD:
                    self.ref_counts[v] += 1
                    return 0
            elif len(ids) <= SMALL_REF and self._ref_small(ids):
                return self._revived
            try:
                q: np.ndarray | array[int] = array("q", ids)
            except (TypeError, OverflowError) as e:
                raise InvalidIdError(f"ref: {e}; allowed a list of int64 ints") from None
            n, k = len(q), self._ref_q
        else:
            q = id_batch(ids, "ids")
            n, k = q.shape[0], self._ref_a
        r = k(self._w, q, n)
        if r >= 0:
            self.num_cached -= r
            return r
        if r <= -(1 << 61):
            i = r + (1 << 62)
            raise InvalidIdError(f"ref: ids[{i}]={int(q[i])}; allowed [0, {self._ref.shape[0]})")
        claim = self._w[W_CLAIM, :-r].copy()
        self._return_spares()   # a claimed page may be a spare
        self._busy = True
        try:
            self.alloc.claim_pages(claim)
        finally:
            self._busy = False
        self._state[claim] = PAGE_HELD   # count 0 for a moment: the retry below raises it
        self.num_free += r
        r = k(self._w, q, n)
        self.num_cached -= r
        self._after_public()
        return r

    def _ref_small(self, ids: list[int]) -> bool:
        """:meth:`ref` of a short list of held or cached pages (id 0 skipped) in Python (Note [One-page calls]):
        ``False`` (nothing changed) if an entry is not one, else ``True`` with the revived count in
        ``_revived``."""
        state, nv = self._state_mv, self._nv
        for v in ids:
            if type(v) is not int or not 0 <= v < nv or (v and state[v] == PAGE_NOT_MANAGED):
                return False
        counts, prev, nxt = self.ref_counts, self._prev, self._next
        revived = 0
        for v in ids:
            if not v:
                continue
            if state[v] == PAGE_CACHED:
                p, q = prev[v], nxt[v]
                nxt[p] = q
                prev[q] = p
                prev[v] = nxt[v] = 0
                state[v] = PAGE_HELD
                revived += 1
            counts[v] += 1
        self.num_cached -= revived
        self._revived = revived
        return True

    def unref(self, ids: np.ndarray | list[int]) -> None:
        """One reference less per entry of ``ids`` (``int64 (n,)`` numpy or a list of ints; 0 skipped): a page
        reaching 0 is cached (LRU tail) if its keep flag is set or its entry is ``-v``, and goes back to the
        allocator otherwise. Raises DoubleFreeError (a count would drop below 0) or InvalidIdError (out of
        range, not an int); nothing changes on any. O(n) in one kernel call (Note [Fused kernels])."""
        if type(ids) is not list or self._lease_work:
            self._unref_kernel(ids)
            return
        if len(ids) == 1:   # Note [One-page calls]
            self.unref_one(ids[0])
            return
        try:
            q = array("q", ids)
        except (TypeError, OverflowError) as e:
            raise InvalidIdError(f"unref: {e}; allowed a list of int64 ints") from None
        r = self._unref_q(self._root, self._owner, self._w, q, len(q), self._floor)
        if r < 0:
            self._unref_refused(r, q)
        self.num_free += r & 0xFFFFFFFF
        self.num_cached += r >> 32
        if self._spared[0]:
            self._push_spared()

    def _unref_kernel(self, ids: np.ndarray | list[int]) -> None:
        """:meth:`unref` in one kernel call (or the allocator's public path with lease work due)."""
        if type(ids) is list:
            try:
                q: np.ndarray | array[int] = array("q", ids)
            except (TypeError, OverflowError) as e:
                raise InvalidIdError(f"unref: {e}; allowed a list of int64 ints") from None
            n, k = len(q), self._unref_q
        else:
            q = id_batch(ids, "ids")
            n, k = q.shape[0], self._unref_a
        if self._lease_work:
            r = self._unref_public(q, n)
        else:
            r = k(self._root, self._owner, self._w, q, n, self._floor)
            if r >= 0:
                self.num_free += r & 0xFFFFFFFF
                self.num_cached += r >> 32
                if self._spared[0]:
                    self._push_spared()
                return
        if r < 0:
            self._unref_refused(r, q)

    def _push_spared(self) -> None:
        """The pages the last kernel unref listed as spares (``w[W_SPARED]``) join them (Note [Spare ids])."""
        spared, sp = self._spared, self._spares
        for i in range(1, spared[0] + 1):
            heappush(sp, spared[i])

    def _unref_refused(self, r: int, q: np.ndarray | array[int]) -> None:
        """Raise the error of a refused kernel unref (``r`` < 0: nothing changed)."""
        if r == R_ALLOC_REFUSED:
            raise InvariantError("owner-live: the allocator refused pages held here (freed behind this object)")
        code, i = (-r - 4) % 4, (-r - 4) // 4
        if code == 2:
            raise DoubleFreeError(f"unref: ids[{i}]: page {abs(int(q[i]))} has no reference left (a double "
                                  f"free); nothing changed")
        raise InvalidIdError(f"unref: ids[{i}]={int(q[i])}; allowed |id| < {self._ref.shape[0]}")

    def unref_one(self, v: int) -> None:
        """``unref([v])``: the same effect and errors. In Python (Note [One-page calls], Note [Spare ids]) when
        page ``v`` stays held, is cached at 0 or joins the spares; else one kernel call. A held page's count is
        positive (the ``held`` invariant), so a count above 1 is lowered with no state read. O(1)."""
        if type(v) is int and 0 < v < self._nv and not self._lease_work:
            counts = self.ref_counts
            c = counts[v]
            if c > 1:
                counts[v] = c - 1
                return
            state = self._state_mv
            if c == 1 and state[v] == PAGE_HELD:
                if self.keep_flags[v]:   # cached at 0: the LRU tail
                    counts[v] = 0
                    state[v] = PAGE_CACHED
                    prev, nxt = self._prev, self._next
                    tail = prev[0]
                    nxt[tail] = v
                    prev[v] = tail
                    nxt[v] = 0
                    prev[0] = v
                    self.num_cached += 1
                    return
                if v < self._floor:   # Note [Spare ids]: freed below the floor, a spare
                    counts[v] = 0
                    state[v] = PAGE_NOT_MANAGED
                    heappush(self._spares, v)
                    self.num_free += 1
                    return
        elif v == 0 and type(v) is int and not self._lease_work:   # the reserved page: skipped
            return
        self._unref_kernel([v])

    def _unref_public(self, q: np.ndarray | array[int], n: int) -> int:
        """:meth:`unref` with the allocator's public ``free_pages``; the kernel's result (negative: nothing
        changed)."""
        r = int(self._hot.unref[type(q) is array](self._w, q, n))
        if r < 0:
            return r
        self._return_spares()
        if (nf := r & 0xFFFFFFFF):
            self._busy = True
            try:
                self.alloc.free_pages(self._w[W_FREED, :nf])
            finally:
                self._busy = False
        self.num_free += nf
        self.num_cached += r >> 32
        self._after_public()
        return r

    def uncache(self, ids: object) -> int:
        """The cached pages among ``ids`` go back to the allocator (content dropped); others are untouched.
        Returns how many. O(n)."""
        c = int(k_uncache(self._w, id_batch(ids, "ids")))
        if c:
            self._return_spares()
            self._busy = True
            try:
                self.alloc.free_pages(self._w[W_FREED, :c])
            finally:
                self._busy = False
            self.num_cached -= c
            self.num_free += c
            self._after_public()
        return c

    def cache_first(self, ids: object) -> int:
        """The cached pages among ``ids`` (``int64 (n,)`` numpy or a list of ints) move to the LRU head in
        ``ids``' order, so they are the next evicted, the first entry first; other pages are untouched. Returns
        how many moved. O(n)."""
        return int(k_cache_first(self._w, id_batch(ids, "ids")))

    def uncache_all(self) -> int:
        """Every cached page back to the allocator (LRU order). Returns how many. O(cached)."""
        return self.uncache(self.cached())

    def _after_public(self) -> None:
        """After a call that ran the allocator's public methods: with ``debug_checks``, the holder check the
        allocator skipped while this object's bookkeeping was half done (:meth:`_check_as_holder`)."""
        if self.alloc.debug_checks:
            self.check_invariants(allocator=False)

    # ---- reading -------------------------------------------------------------------------------------------------
    def state(self, page: int) -> int:
        """``PAGE_HELD``, ``PAGE_CACHED`` or ``PAGE_NOT_MANAGED`` (free) of one page. O(1)."""
        return int(self._state[page])

    def is_cached(self, page: int) -> bool:
        return int(self._state[page]) == PAGE_CACHED

    def free_ids(self) -> np.ndarray:
        """``int64`` pages free in the allocator, ascending (the order :meth:`take` hands them out). O(pages)."""
        free = np.flatnonzero(self._state == PAGE_NOT_MANAGED)
        return free[free != 0].astype(np.int64)

    def cached(self) -> np.ndarray:
        """``int64`` cached pages in LRU order (the next evicted first). O(cached)."""
        out = np.empty(self.num_cached, np.int64)
        lru, v = self._lru, int(self._lru[LRU_NEXT, 0])
        for i in range(self.num_cached):
            out[i] = v
            v = int(lru[LRU_NEXT, v])
        return out

    def next_cached(self, page: int) -> int:
        """The cached page after ``page`` in LRU order (``page`` 0: the first), 0 at the end. O(1)."""
        return int(self._lru[LRU_NEXT, page])

    # ---- checks ----------------------------------------------------------------------------------------------------
    def _check_as_holder(self) -> None:
        if not self._busy:   # mid-call (the allocator changed, this object not yet): checked after the call
            self.check_invariants(allocator=False)

    def check_invariants(self, *, allocator: bool = True) -> None:
        """Raise :class:`~umalloc.errors.InvariantError` naming the first broken invariant (the allocator's
        first, unless ``allocator=False``): ``held`` (a page is held iff its count is positive: a held page
        with count 0 is a leak, a count on a cached or free page was raised behind this object), ``cached`` (the
        LRU links are the cached pages exactly), ``owner-live`` (a page is live in the allocator iff it is held
        or cached: a free page live there was allocated behind this object, a held one freed behind it),
        ``spares`` (Note [Spare ids]), ``counts`` (``num_free`` / ``num_cached`` equal the states). O(pages)."""
        if allocator:
            self.alloc.check_invariants()   # runs this check too (attach_holder_check)
            return
        ref, st = self._ref, self._state
        bad = np.flatnonzero((st[1:] == PAGE_HELD) != (ref[1:] > 0))   # page 0 is reserved: nobody's
        if bad.size:
            v = int(bad[0]) + 1
            raise InvariantError(f"[held] page refs: page {v} has state {int(st[v])} and count {int(ref[v])} (a "
                                 f"held page with no count is leaked; a count outside a held page was set behind "
                                 f"the pool)")
        cached = np.flatnonzero(st == PAGE_CACHED)
        walk: list[int] = []
        v = int(self._lru[LRU_NEXT, 0])
        while v and len(walk) <= st.shape[0]:
            walk.append(v)
            if int(self._lru[LRU_PREV, int(self._lru[LRU_NEXT, v])]) != v:
                raise InvariantError(f"[cached] page refs: LRU links broken after page {v}")
            v = int(self._lru[LRU_NEXT, v])
        if sorted(walk) != cached.tolist():
            raise InvariantError(f"[cached] page refs: the LRU list {walk[:8]} differs from the cached pages "
                                 f"{cached[:8].tolist()}")
        live = self.alloc.v2p(self.end).numpy() != TOMBSTONE
        live[0] = False
        sp = np.array(self._spares, np.int64)
        lowest_free = np.flatnonzero(~live[1:] & (st[1:] == PAGE_NOT_MANAGED))
        if sp.size or self._floor:   # Note [Spare ids]: live in the allocator, free here, the lowest free ids
            if np.unique(sp).size != sp.size or not live[sp].all() or (st[sp] != PAGE_NOT_MANAGED).any() \
                    or (sp.size and int(sp.max()) >= self._floor) \
                    or (lowest_free.size and lowest_free[0] + 1 < self._floor):
                raise InvariantError(f"[spares] page refs: spares {sorted(self._spares)[:8]} (floor {self._floor})"
                                     f" must be distinct, live in the allocator, free here, below the floor, and "
                                     f"the floor at or below every id free in the allocator")
            live[sp] = False
        managed = st != PAGE_NOT_MANAGED
        wrong = np.flatnonzero(live != managed)
        if wrong.size:
            v = int(wrong[0])
            raise InvariantError(f"[owner-live] page refs: page {v} is {'live' if live[v] else 'free'} in the "
                                 f"allocator but {'free' if not managed[v] else 'held or cached'} here "
                                 f"({'allocated behind this object' if live[v] else 'freed behind it'})")
        n_free = int(np.count_nonzero(~managed[1:]))
        if self.num_free != n_free or self.num_cached != cached.size \
                or self.alloc.available_pages(self.end) + sp.size != n_free:
            raise InvariantError(f"[counts] page refs: num_free {self.num_free} / num_cached {self.num_cached}; "
                                 f"the states say {n_free} / {cached.size}, the allocator "
                                 f"{self.alloc.available_pages(self.end)} free")


__all__ = ["PAGE_CACHED", "PAGE_HELD", "PAGE_NOT_MANAGED", "PageRefs"]
