"""Placement kernels (numba): band planning over byte frontiers, taking pages, unbinding, trimming, recounting.

These work on the heap's arrays as views (``meta``, ``h64``, ``h8``, a pin array); the entry points that take
the root address are in :mod:`umalloc.pool.kernels.ops`.

Note [Byte frontiers]
~~~~~~~~~~~~~~~~~~~~~
Physical page ``p`` of an end with ``page_bytes = pb`` occupies bytes ``[p * pb, (p + 1) * pb)``. The
``up`` end occupies bytes below ``hi_up * pb_up``; a float end bytes ``[lo_f * pb_f, hi_f * pb_f)``; the ``down``
end bytes from ``lo_down * pb_down`` (``lo_down = watermark + 1``). An end grows only while its new band stays
inside the bytes left between its chain neighbours' frontiers. An *empty* float end occupies nothing and does
not bound its neighbours::

    byte 0                                                                               arena_bytes
    | floor | up: 1 .. hi_up-1 |  gap  | float: lo_f .. hi_f-1 |  gap  | down: lo_down .. top |
            ^ first_page*pb    ^ hi_up*pb_up                   ^ hi_f*pb_f       ^ lo_down*pb_down

Note [Float policy]
~~~~~~~~~~~~~~~~~~~
A float end that is empty (no live or pending page) is placed when it next allocates: its band starts at the
byte ``below + float_split * (above - below)`` of the gap between the frontiers of its present neighbours (the
start is moved down if the pages would not fit above it). A present float end drains its holes in ascending
order, then grows ``hi`` upward as far as the end above allows, then ``lo`` downward. Within one call the
``up`` and ``down`` ends are planned first and the float ends after them, in chain order. When the last page of
a float end is freed it becomes empty again and is re-placed by its next allocation.

Note [Placement order]
~~~~~~~~~~~~~~~~~~~~~~
For ``k`` pages on one end: take ``h = min(k, holes)`` holes in drain order (ascending for ``up``/``float``,
descending for ``down``), then ``k - h`` pages of fresh band (``up``: ``[hi, hi + k - h)``; ``down``:
``[lo - (k - h), lo)``; ``float``: above ``hi`` first, then below ``lo``). The ``k`` pages are handed out sorted
ascending; the ``j``-th fresh virtual page of the call gets the ``j``-th page on every end it binds.
Virtual pages are minted lowest free id first.

"""

from __future__ import annotations

from numba import njit

from umalloc.pool.kernels.bitmap import _bclr, _bset, _pop_high, _pop_low
from umalloc.pool.kernels.codes import E_SHORT, _fail
from umalloc.pool.kernels.layout import (
    G_DOWN,
    G_FLOAT,
    G_UP,
    M_ALLOCS,
    M_ARENAB,
    M_CHOFF,
    M_ERROFF,
    M_FIRST,
    M_FLOORB,
    M_GROW,
    M_HBOFF,
    M_HI,
    M_HINT,
    M_HOLES,
    M_LIVE,
    M_LO,
    M_NE,
    M_PB,
    M_PEAK,
    M_PENDING,
    M_PGOFF,
    M_POFF,
    M_PSOFF,
    M_SCROFF,
    M_SPLIT,
    M_TOP,
    M_VBOFF,
    M_VHINT,
    M_VLIVE,
    M_VOFF,
    SPLIT_ONE,
    V_LIVE,
)
from umalloc.pool.pagestate import PAGE_GAP, PAGE_HOLE, PAGE_LIVE, PAGE_PENDING, TOMBSTONE


@njit(cache=True, inline="always", error_model="numpy")
def _plan_scratch(meta, h64):
    """Four int64 scratch rows of length E in the heap (need, deficit, new_lo, new_hi): no allocation."""
    E = meta.shape[0]
    b = meta[0, M_PSOFF]
    return h64[b: b + E], h64[b + E: b + 2 * E], h64[b + 2 * E: b + 3 * E], h64[b + 3 * E: b + 4 * E]


@njit(cache=True, inline="always", error_model="numpy")
def _page_scratch(meta, h64, k):
    b = meta[0, M_PGOFF]
    return h64[b: b + k]


@njit(cache=True, inline="always", error_model="numpy")
def _chain(meta, h64):
    c = meta[0, M_CHOFF]
    return h64[c: c + meta[0, M_NE]]



@njit(cache=True, error_model="numpy")
def _below_bytes(meta, chain, pos, new_lo, new_hi):
    """Byte frontier of the nearest present end below chain position ``pos`` (the floor if none)."""
    for j in range(pos - 1, -1, -1):
        e = chain[j]
        if meta[e, M_GROW] != G_FLOAT or new_lo[e] < new_hi[e]:
            return new_hi[e] * meta[e, M_PB]
    return meta[chain[pos], M_FLOORB]


@njit(cache=True, error_model="numpy")
def _above_bytes(meta, chain, pos, new_lo, new_hi):
    """Byte frontier of the nearest present end above chain position ``pos`` (the arena's end if none)."""
    for j in range(pos + 1, chain.shape[0]):
        e = chain[j]
        if meta[e, M_GROW] != G_FLOAT or new_lo[e] < new_hi[e]:
            return new_lo[e] * meta[e, M_PB]
    return meta[chain[pos], M_ARENAB]


@njit(cache=True, error_model="numpy")
def plan_band_growth(meta, chain, need, new_lo, new_hi, deficit):
    """Plan band growth: ``need[e]`` pages of fresh band per end (beyond its holes). Fills ``new_lo/new_hi``
    and ``deficit``; returns the total deficit (0: feasible). Up/down ends are planned first, then the float
    ends in chain order (Note [Float policy]). A short end still takes what it can, so the ends planned after
    it see the tightest frontiers and report their own deficits (F20)."""
    for e in range(meta.shape[0]):
        new_lo[e] = meta[e, M_LO]
        new_hi[e] = meta[e, M_HI]
        deficit[e] = 0
    short = 0
    n = chain.shape[0]
    for phase in range(2):
        for pos in range(n):
            e = chain[pos]
            k = need[e]
            if k <= 0:
                continue
            g = meta[e, M_GROW]
            if (phase == 0) == (g == G_FLOAT):
                continue
            pb = meta[e, M_PB]
            below = _below_bytes(meta, chain, pos, new_lo, new_hi)
            above = _above_bytes(meta, chain, pos, new_lo, new_hi)
            lowp = max(meta[e, M_FIRST], -(-below // pb))
            highp = min(meta[e, M_TOP] + 1, above // pb)
            if g == G_UP:
                take = min(k, max(0, highp - new_hi[e]))
                new_hi[e] += take
                deficit[e] = k - take
            elif g == G_DOWN:
                take = min(k, max(0, new_lo[e] - lowp))
                new_lo[e] -= take
                deficit[e] = k - take
            elif new_lo[e] < new_hi[e]:
                up = min(k, max(0, highp - new_hi[e]))
                rest = k - up
                dn = min(rest, max(0, new_lo[e] - lowp))
                new_hi[e] += up
                new_lo[e] -= dn
                deficit[e] = rest - dn
            else:
                take = min(k, max(0, highp - lowp))
                if take > 0:
                    target = below + (above - below) * meta[e, M_SPLIT] // SPLIT_ONE
                    s = -(-target // pb)
                    s = max(s, lowp)
                    s = min(s, highp - take)
                    new_lo[e] = s
                    new_hi[e] = s + take
                deficit[e] = k - take
            short += deficit[e]
    return short


@njit(cache=True, error_model="numpy")
def reach_pages(meta, h64, e):
    """Pages of fresh band end ``e`` could grow into now (nothing else growing)."""
    chain = _chain(meta, h64)
    pos = 0
    for j in range(chain.shape[0]):
        if chain[j] == e:
            pos = j
    lo_a = meta[:, M_LO].copy()
    hi_a = meta[:, M_HI].copy()
    pb = meta[e, M_PB]
    below = _below_bytes(meta, chain, pos, lo_a, hi_a)
    above = _above_bytes(meta, chain, pos, lo_a, hi_a)
    lowp = max(meta[e, M_FIRST], -(-below // pb))
    highp = min(meta[e, M_TOP] + 1, above // pb)
    g = meta[e, M_GROW]
    if g == G_UP:
        return max(0, highp - hi_a[e])
    if g == G_DOWN:
        return max(0, lo_a[e] - lowp)
    if lo_a[e] < hi_a[e]:
        return max(0, highp - hi_a[e]) + max(0, lo_a[e] - lowp)
    return max(0, highp - lowp)


@njit(cache=True, error_model="numpy")
def _plan_k(meta, h64, h8, mask, k, nlo, nhi):
    """Plan ``k`` pages on every end of bind mask ``mask``; on a shortfall write the per-end deficits to err
    and return False."""
    E = meta.shape[0]
    need, deficit, _, _ = _plan_scratch(meta, h64)
    for e in range(E):
        need[e] = max(0, k - meta[e, M_HOLES]) if h8[mask + e] else 0
    if plan_band_growth(meta, _chain(meta, h64), need, nlo, nhi, deficit) > 0:
        b = meta[0, M_ERROFF] + 4
        for e in range(E):
            h64[b + e] = deficit[e]
        _fail(meta, h64, E_SHORT, 0, k, 0)
        return False
    return True


@njit(cache=True, error_model="numpy")
def _take(meta, h64, h8, e, k, nlo, nhi, pages):
    """Take ``k`` pages on end ``e`` per Note [Placement order] into ``pages[:k]`` (ascending), mark them live
    and move the band to ``[nlo, nhi)`` (already planned). p2v is written by the caller."""
    off = meta[e, M_POFF]
    g = meta[e, M_GROW]
    lo = meta[e, M_LO]
    hi = meta[e, M_HI]
    h = min(k, meta[e, M_HOLES])
    j = 0
    if g == G_FLOAT and lo == hi:  # placing an empty float: all fresh
        for p in range(nlo, nhi):
            pages[j] = p
            j += 1
    else:
        for p in range(nlo, lo):  # fresh pages below lo (down end, float growing down) come first
            pages[j] = p
            j += 1
        if h > 0:  # holes from the bitmap, starting at the drain hint
            if g == G_DOWN:  # the highest holes, written ascending
                meta[e, M_HINT] = _pop_high(h64, meta[e, M_HBOFF], meta[e, M_HINT], h, pages, j)
            else:
                meta[e, M_HINT] = _pop_low(h64, meta[e, M_HBOFF], meta[e, M_HINT], h, pages, j)
            j += h
            meta[e, M_HOLES] -= h
        for p in range(hi, nhi):
            pages[j] = p
            j += 1
    for i in range(k):
        h8[off + pages[i]] = PAGE_LIVE
    meta[e, M_LO] = nlo
    meta[e, M_HI] = nhi
    if meta[e, M_HOLES] == 0:
        meta[e, M_HINT] = nlo - 1 if g == G_DOWN else nhi
    meta[e, M_LIVE] += k
    meta[e, M_ALLOCS] += k
    if meta[e, M_LIVE] > meta[e, M_PEAK]:
        meta[e, M_PEAK] = meta[e, M_LIVE]


@njit(cache=True, error_model="numpy")
def _mint_bind(meta, h64, h8, owner, mask, k, nlo, nhi):
    """Mint ``k`` virtual pages of ``owner`` (lowest free id first) into the scratch area and bind a fresh
    page of every end of ``mask`` to each (Note [Placement order]). Returns the scratch offset of the ids."""
    voff = meta[owner, M_VOFF]
    scr = meta[0, M_SCROFF]
    if k > 0:
        meta[owner, M_VHINT] = _pop_low(h64, meta[owner, M_VBOFF], meta[owner, M_VHINT], k, h64, scr)
    for j in range(k):
        h8[voff + h64[scr + j]] = V_LIVE
    meta[owner, M_VLIVE] += k
    pages = _page_scratch(meta, h64, k)
    for e in range(meta.shape[0]):
        if not h8[mask + e]:
            continue
        _take(meta, h64, h8, e, k, nlo[e], nhi[e], pages)
        poff = meta[e, M_POFF]
        evoff = meta[e, M_VOFF]
        for j in range(k):
            p = pages[j]
            vid = h64[scr + j]
            h64[poff + p] = vid
            h64[evoff + vid] = p
    return scr


@njit(cache=True, error_model="numpy")
def _trim(meta, h64, h8, e):
    """Retreat the moving edge(s) of end ``e``'s band over trailing holes (they become gap)."""
    off = meta[e, M_POFF]
    hb = meta[e, M_HBOFF]
    g = meta[e, M_GROW]
    lo = meta[e, M_LO]
    hi = meta[e, M_HI]
    removed = 0
    if g != G_DOWN:
        while hi > lo and h8[off + hi - 1] == PAGE_HOLE:
            hi -= 1
            h8[off + hi] = PAGE_GAP
            _bclr(h64, hb, hi)
            removed += 1
    if g != G_UP:
        while lo < hi and h8[off + lo] == PAGE_HOLE:
            h8[off + lo] = PAGE_GAP
            _bclr(h64, hb, lo)
            lo += 1
            removed += 1
    if removed:
        meta[e, M_LO] = lo
        meta[e, M_HI] = hi
        meta[e, M_HOLES] -= removed
    if meta[e, M_HOLES] == 0:
        meta[e, M_HINT] = lo - 1 if g == G_DOWN else hi
    elif g == G_FLOAT and meta[e, M_HINT] < lo:
        meta[e, M_HINT] = lo


@njit(cache=True, error_model="numpy")
def _to_hole(meta, h64, h8, e, p):
    h8[meta[e, M_POFF] + p] = PAGE_HOLE
    _bset(h64, meta[e, M_HBOFF], p)
    meta[e, M_HOLES] += 1
    if meta[e, M_GROW] == G_DOWN:
        if p > meta[e, M_HINT]:
            meta[e, M_HINT] = p
    elif p < meta[e, M_HINT]:
        meta[e, M_HINT] = p


@njit(cache=True, error_model="numpy")
def _unbind(meta, h64, h8, pin, b, scr, n):
    """Unbind end ``b`` from the ``n`` virtual pages at ``h64[scr:]`` where bound (holes, or pending where
    pinned), then trim its band; returns the pages unbound."""
    off = meta[b, M_POFF]
    voff = meta[b, M_VOFF]
    down = meta[b, M_GROW] == G_DOWN
    hb = meta[b, M_HBOFF]
    hint = meta[b, M_HINT]
    holes = 0
    pend = 0
    for j in range(n):
        v = h64[scr + j]
        p = h64[voff + v]
        if p < 0:
            continue
        h64[voff + v] = TOMBSTONE
        h64[off + p] = TOMBSTONE
        if pin[p] > 0:
            h8[off + p] = PAGE_PENDING
            pend += 1
        else:
            h8[off + p] = PAGE_HOLE
            _bset(h64, hb, p)
            holes += 1
            if down:
                if p > hint:
                    hint = p
            elif p < hint:
                hint = p
    freed = holes + pend
    if freed:
        meta[b, M_HOLES] += holes
        meta[b, M_PENDING] += pend
        meta[b, M_HINT] = hint
        meta[b, M_LIVE] -= freed
        _trim(meta, h64, h8, b)
    return freed



@njit(cache=True, error_model="numpy")
def k_unpend(meta, h64, h8, e, pages):
    """Pending pages of end ``e`` among ``pages`` whose last pin dropped become holes; returns how many."""
    off = meta[e, M_POFF]
    n = 0
    for i in range(pages.shape[0]):
        p = pages[i]
        if h8[off + p] != PAGE_PENDING:
            continue
        meta[e, M_PENDING] -= 1
        _to_hole(meta, h64, h8, e, p)
        n += 1
    if n:
        _trim(meta, h64, h8, e)
    return n


@njit(cache=True, error_model="numpy")
def k_recount(meta, h64, h8, e):
    """Recompute end ``e``'s live/hole/pending counters and drain hint from its states (after compaction
    rewrote them), and re-trim its band."""
    off = meta[e, M_POFF]
    hb = meta[e, M_HBOFF]
    lo = meta[e, M_LO]
    hi = meta[e, M_HI]
    for w in range((meta[e, M_TOP] + 64) >> 6):
        h64[hb + w] = 0
    live = 0
    holes = 0
    pend = 0
    first_hole = -1
    last_hole = -1
    for p in range(lo, hi):
        s = h8[off + p]
        if s == PAGE_LIVE:
            live += 1
        elif s == PAGE_HOLE:
            _bset(h64, hb, p)
            holes += 1
            if first_hole < 0:
                first_hole = p
            last_hole = p
        elif s == PAGE_PENDING:
            pend += 1
    meta[e, M_LIVE] = live
    meta[e, M_HOLES] = holes
    meta[e, M_PENDING] = pend
    if holes:
        meta[e, M_HINT] = last_hole if meta[e, M_GROW] == G_DOWN else first_hole
    _trim(meta, h64, h8, e)

