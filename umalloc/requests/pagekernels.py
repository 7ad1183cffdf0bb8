"""The numba kernels of :class:`~umalloc.requests.pagerefs.PageRefs` and the state block they share.

The state of a ``PageRefs`` is one int64 array ``w`` of :data:`W_ROWS` rows by ``num_vpages`` (one call argument,
Note [Fused kernels] in :mod:`umalloc.requests.pagerefs`); the kernels here change it, and the fused ones call the
allocator's own page kernels (``k_alloc_pages`` / ``k_free``) in the same call. The policy they implement and the
paths that run in Python instead (Note [One-page calls], Note [Spare ids]) are in :mod:`umalloc.requests.pagerefs`.

Not thread-safe: the caller owns ``w`` and the allocator's heap.
"""

from __future__ import annotations

from array import array

from numba import njit, typeof, types

from umalloc.pool.kernels.codes import OK
from umalloc.pool.kernels.ops import k_alloc_pages, k_free
from umalloc.requests.refcounts import (
    LRU_NEXT,
    LRU_PREV,
    PAGE_CACHED,
    PAGE_HELD,
    PAGE_NOT_MANAGED,
    _lru_push,
    _lru_unlink,
)

# ---- the state: one int64 block ``w`` [W_ROWS, num_vpages], one call argument (Note [Fused kernels]) ----------
#: rows of ``w``: the LRU links (rows LRU_PREV, LRU_NEXT: :mod:`umalloc.requests.refcounts`' layout), then the
#: reference counts, page states, keep flags, take's output, take's kept pages, pages to free, pages to claim
W_REF, W_STATE, W_KEEP, W_OUT, W_KEPT, W_FREED, W_CLAIM, W_SPARED = range(2, 10)
W_ROWS = 10
#: kernel results: the allocator refused (take: retry on the public path; unref: pages freed behind this object)
R_ALLOC_REFUSED = -1
#: :func:`k_take_direct`: ``n`` outside ``[0, free + cached]``
R_TAKE_RANGE = -2


# ---- kernels (numba; every one validates its whole batch before it writes). ``ids`` arguments are 1-D int64
# numpy arrays or ``array('q')`` buffers (indexed only, never sliced), ``n`` of them read ----------------------------
@njit(cache=True)
def k_hold(w, m, n):
    """Hold ``w[W_OUT, :m]`` (fresh from the allocator) once each, then take ``n - m`` pages off the LRU head
    into ``w[W_OUT, m:n]`` held once each (the caller checked there are enough). The pages handed out whose keep
    flag is set go to ``w[W_KEPT]`` in order; returns how many."""
    ref, state, keep, out, kept = w[W_REF], w[W_STATE], w[W_KEEP], w[W_OUT], w[W_KEPT]
    for i in range(m):
        v = out[i]
        ref[v] = 1
        state[v] = PAGE_HELD
    for i in range(m, n):
        v = w[LRU_NEXT, 0]
        _lru_unlink(w, v)
        ref[v] = 1
        state[v] = PAGE_HELD
        out[i] = v
    c = 0
    for i in range(n):
        v = out[i]
        if keep[v]:
            kept[c] = v
            c += 1
    return c


@njit(cache=True)
def k_take_direct(root, owner, mask, w, n, free, cached, s):
    """:func:`k_hold` after minting ``min(n, free) - s`` pages into ``w[W_OUT, s:]`` with the allocator's own
    kernel (one call for the whole take; ``w[W_OUT, :s]``: the spares, Note [Spare ids], counted in ``free``).
    :data:`R_TAKE_RANGE` for ``n`` outside ``[s, free + cached]``, :data:`R_ALLOC_REFUSED` if the allocator
    refuses (no physical page): nothing changed on either."""
    if n < s or n > free + cached:
        return R_TAKE_RANGE
    m = n if n <= free else free
    out = w[W_OUT]
    if m > s and k_alloc_pages(root, owner, mask, m - s, out[s:], m - s, out[:0], -1) != OK:
        return R_ALLOC_REFUSED
    return k_hold(w, m, n)


@njit(cache=True)
def k_mint(root, owner, mask, w, k):
    """``k`` pages minted into ``w[W_CLAIM, :k]`` with the allocator's own kernel (the spares, Note [Spare
    ids]); :data:`R_ALLOC_REFUSED` if it refuses (nothing changed), else 0."""
    out = w[W_CLAIM]
    if k_alloc_pages(root, owner, mask, k, out, k, out[:0], -1) != OK:
        return R_ALLOC_REFUSED
    return 0


@njit(cache=True)
def k_ref(w, ids, n):
    """One reference more per nonzero entry of ``ids[:n]``. If an entry is a free page, nothing changes: the
    free pages (distinct, in first-seen order) go to ``w[W_CLAIM]`` and minus their number is returned. Else the
    number of pages revived from the cache; -2**62 + i if entry ``i`` is out of range."""
    ref, state, claim = w[W_REF], w[W_STATE], w[W_CLAIM]
    nv = ref.shape[0]
    m = 0
    for i in range(n):
        v = ids[i]
        if v == 0:
            continue
        if v < 0 or v >= nv:
            for j in range(m):
                state[claim[j]] = PAGE_NOT_MANAGED
            return -(1 << 62) + i
        if state[v] == PAGE_NOT_MANAGED:
            state[v] = 3   # marked while listing: a repeat is listed once
            claim[m] = v
            m += 1
    if m:
        for j in range(m):
            state[claim[j]] = PAGE_NOT_MANAGED
        return -m
    revived = 0
    for i in range(n):
        v = ids[i]
        if v == 0:
            continue
        if state[v] == PAGE_CACHED:
            _lru_unlink(w, v)
            state[v] = PAGE_HELD
            revived += 1
        ref[v] += 1
    return revived


@njit(cache=True)
def k_unref(w, ids, n):
    """One reference less per nonzero entry of ``ids[:n]`` (``-v``: page ``v``, cached at 0 whatever its keep
    flag). All or nothing: on an entry out of range or a count that would drop below 0 nothing changes and
    ``-(code + 4 * position)`` is returned (code 1: range, 2: double free). Else ``freed_count + cached_count *
    2**32``: a page reaching 0 joins the LRU tail if its entry is negative or its keep flag is set, and is listed
    in ``w[W_FREED]`` otherwise."""
    ref, state, keep, freed = w[W_REF], w[W_STATE], w[W_KEEP], w[W_FREED]
    nv = ref.shape[0]
    bad = -1
    code = 0
    for i in range(n):
        v = ids[i]
        if v < 0:
            v = -v
        if v == 0:
            continue
        if v >= nv:
            bad, code = i, 1
            break
        ref[v] -= 1
        if ref[v] < 0:
            bad, code = i, 2
            ref[v] += 1
            break
    if bad >= 0:
        for i in range(bad):
            v = abs(ids[i])
            if v:
                ref[v] += 1
        return -(code + 4 * bad) - 4   # below R_ALLOC_REFUSED and R_TAKE_RANGE
    nf = 0
    nc = 0
    for i in range(n):
        v = ids[i]
        cache = v < 0
        if cache:
            v = -v
        if v == 0 or ref[v] != 0 or state[v] != PAGE_HELD:
            continue
        if cache or keep[v]:
            state[v] = PAGE_CACHED
            _lru_push(w, v)
            nc += 1
        else:
            state[v] = PAGE_NOT_MANAGED
            freed[nf] = v
            nf += 1
    return nf + (nc << 32)


@njit(cache=True)
def k_unref_direct(root, owner, w, ids, n, floor):
    """:func:`k_unref`, then the freed pages at or above ``floor`` back to the allocator with its own kernel
    (one call for the whole free) and those below it listed as spares in ``w[W_SPARED, 1:]``, their number in
    ``w[W_SPARED, 0]`` (Note [Spare ids]); :data:`R_ALLOC_REFUSED` if the allocator refuses them (an owner-live
    invariant broken behind this object)."""
    r = k_unref(w, ids, n)
    nf = r & 0xFFFFFFFF
    spared = w[W_SPARED]
    spared[0] = 0
    if r > 0 and nf:
        freed = w[W_FREED]
        k = 0
        s = 0
        for i in range(nf):
            v = freed[i]
            if v < floor:
                s += 1
                spared[s] = v
            else:
                freed[k] = v
                k += 1
        spared[0] = s
        if k and k_free(root, owner, freed[:k], k, True, freed[:0], -1) < 0:   # an array's length is its count
            return R_ALLOC_REFUSED
    return r


@njit(cache=True)
def k_uncache(w, ids):
    """The cached pages among ``ids`` leave the LRU and are listed in ``w[W_FREED]`` (state -> free); returns
    how many."""
    state, freed = w[W_STATE], w[W_FREED]
    c = 0
    for i in range(ids.shape[0]):
        v = ids[i]
        if 0 < v < state.shape[0] and state[v] == PAGE_CACHED:
            _lru_unlink(w, v)
            state[v] = PAGE_NOT_MANAGED
            freed[c] = v
            c += 1
    return c


@njit(cache=True)
def k_cache_first(w, ids):
    """The cached pages among ``ids`` move to the LRU head, in ``ids``' order (the first is evicted first);
    returns how many moved."""
    state = w[W_STATE]
    c = 0
    for i in range(ids.shape[0] - 1, -1, -1):
        v = ids[i]
        if 0 < v < state.shape[0] and state[v] == PAGE_CACHED:
            _lru_unlink(w, v)
            head = w[LRU_NEXT, 0]
            w[LRU_PREV, head] = v
            w[LRU_NEXT, v] = head
            w[LRU_PREV, v] = 0
            w[LRU_NEXT, 0] = v
            c += 1
    return c


class Entries:
    """Compiled entry points of the hot kernels for the arguments :class:`PageRefs` passes (no per-call typing):
    ids as ``array('q')`` (a list's conversion) or as int64 numpy arrays, indexed by ``type(ids) is array``."""

    def __init__(self) -> None:
        i, w = types.int64, types.Array(types.int64, 2, "C")
        kinds = (types.Array(types.int64, 1, "A"), typeof(array("q")))
        self.hold = k_hold.compile((w, i, i))
        self.take_direct = k_take_direct.compile((i, i, i, w, i, i, i, i))
        self.mint = k_mint.compile((i, i, i, w, i))
        self.ref = tuple(k_ref.compile((w, t, i)) for t in kinds)
        self.unref = tuple(k_unref.compile((w, t, i)) for t in kinds)
        self.unref_direct = tuple(k_unref_direct.compile((i, i, w, t, i, i)) for t in kinds)


_compiled: list[Entries] = []


def entries() -> Entries:
    if not _compiled:
        _compiled.append(Entries())
    return _compiled[0]


__all__ = ["R_ALLOC_REFUSED", "R_TAKE_RANGE", "W_CLAIM", "W_FREED", "W_KEEP", "W_KEPT", "W_OUT", "W_REF", "W_ROWS",
           "W_SPARED", "W_STATE", "Entries", "entries", "k_cache_first", "k_hold", "k_mint", "k_ref", "k_take_direct",
           "k_uncache", "k_unref", "k_unref_direct"]
