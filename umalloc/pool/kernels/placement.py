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
    _ALLOCS,
    _ARENAB,
    _CHOFF,
    _ERROFF,
    _FIRST,
    _FLOORB,
    _G_DOWN,
    _G_FLOAT,
    _G_UP,
    _GROW,
    _HBOFF,
    _HI,
    _HINT,
    _HOLES,
    _LIVE,
    _LO,
    _NE,
    _PB,
    _PEAK,
    _PENDING,
    _PGOFF,
    _POFF,
    _PSOFF,
    _SCROFF,
    _SPLIT,
    _TOP,
    _VBOFF,
    _VHINT,
    _VLIVE,
    _VOFF,
    SPLIT_ONE,
    V_LIVE,
)
from umalloc.pool.pagestate import PAGE_GAP, PAGE_HOLE, PAGE_LIVE, PAGE_PENDING, TOMBSTONE


@njit(cache=True, inline="always", error_model="numpy")
def _plan_scratch(meta, h64):
    """Four int64 scratch rows of length E in the heap (need, deficit, new_lo, new_hi): no allocation."""
    E = meta.shape[0]
    b = meta[0, _PSOFF]
    return h64[b: b + E], h64[b + E: b + 2 * E], h64[b + 2 * E: b + 3 * E], h64[b + 3 * E: b + 4 * E]


@njit(cache=True, inline="always", error_model="numpy")
def _page_scratch(meta, h64, k):
    b = meta[0, _PGOFF]
    return h64[b: b + k]


@njit(cache=True, inline="always", error_model="numpy")
def _chain(meta, h64):
    c = meta[0, _CHOFF]
    return h64[c: c + meta[0, _NE]]



@njit(cache=True, error_model="numpy")
def _below_bytes(meta, chain, pos, new_lo, new_hi):
    """Byte frontier of the nearest present end below chain position ``pos`` (the floor if none)."""
    for j in range(pos - 1, -1, -1):
        e = chain[j]
        if meta[e, _GROW] != _G_FLOAT or new_lo[e] < new_hi[e]:
            return new_hi[e] * meta[e, _PB]
    return meta[chain[pos], _FLOORB]


@njit(cache=True, error_model="numpy")
def _above_bytes(meta, chain, pos, new_lo, new_hi):
    """Byte frontier of the nearest present end above chain position ``pos`` (the arena's end if none)."""
    for j in range(pos + 1, chain.shape[0]):
        e = chain[j]
        if meta[e, _GROW] != _G_FLOAT or new_lo[e] < new_hi[e]:
            return new_lo[e] * meta[e, _PB]
    return meta[chain[pos], _ARENAB]


@njit(cache=True, error_model="numpy")
def _plan(meta, chain, need, new_lo, new_hi, deficit):
    """Plan band growth: ``need[e]`` pages of fresh band per end (beyond its holes). Fills ``new_lo/new_hi``
    and ``deficit``; returns the total deficit (0: feasible). Up/down ends are planned first, then the float
    ends in chain order (Note [Float policy]). A short end still takes what it can, so the ends planned after
    it see the tightest frontiers and report their own deficits (F20)."""
    for e in range(meta.shape[0]):
        new_lo[e] = meta[e, _LO]
        new_hi[e] = meta[e, _HI]
        deficit[e] = 0
    short = 0
    n = chain.shape[0]
    for phase in range(2):
        for pos in range(n):
            e = chain[pos]
            k = need[e]
            if k <= 0:
                continue
            g = meta[e, _GROW]
            if (phase == 0) == (g == _G_FLOAT):
                continue
            pb = meta[e, _PB]
            below = _below_bytes(meta, chain, pos, new_lo, new_hi)
            above = _above_bytes(meta, chain, pos, new_lo, new_hi)
            lowp = max(meta[e, _FIRST], -(-below // pb))
            highp = min(meta[e, _TOP] + 1, above // pb)
            if g == _G_UP:
                take = min(k, max(0, highp - new_hi[e]))
                new_hi[e] += take
                deficit[e] = k - take
            elif g == _G_DOWN:
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
                    target = below + (above - below) * meta[e, _SPLIT] // SPLIT_ONE
                    s = -(-target // pb)
                    s = max(s, lowp)
                    s = min(s, highp - take)
                    new_lo[e] = s
                    new_hi[e] = s + take
                deficit[e] = k - take
            short += deficit[e]
    return short


@njit(cache=True, error_model="numpy")
def _reach(meta, h64, e):
    """Pages of fresh band end ``e`` could grow into now (nothing else growing)."""
    chain = _chain(meta, h64)
    pos = 0
    for j in range(chain.shape[0]):
        if chain[j] == e:
            pos = j
    lo_a = meta[:, _LO].copy()
    hi_a = meta[:, _HI].copy()
    pb = meta[e, _PB]
    below = _below_bytes(meta, chain, pos, lo_a, hi_a)
    above = _above_bytes(meta, chain, pos, lo_a, hi_a)
    lowp = max(meta[e, _FIRST], -(-below // pb))
    highp = min(meta[e, _TOP] + 1, above // pb)
    g = meta[e, _GROW]
    if g == _G_UP:
        return max(0, highp - hi_a[e])
    if g == _G_DOWN:
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
        need[e] = max(0, k - meta[e, _HOLES]) if h8[mask + e] else 0
    if _plan(meta, _chain(meta, h64), need, nlo, nhi, deficit) > 0:
        b = meta[0, _ERROFF] + 4
        for e in range(E):
            h64[b + e] = deficit[e]
        _fail(meta, h64, E_SHORT, 0, k, 0)
        return False
    return True


@njit(cache=True, error_model="numpy")
def _take(meta, h64, h8, e, k, nlo, nhi, pages):
    """Take ``k`` pages on end ``e`` per Note [Placement order] into ``pages[:k]`` (ascending), mark them live
    and move the band to ``[nlo, nhi)`` (already planned). p2v is written by the caller."""
    off = meta[e, _POFF]
    g = meta[e, _GROW]
    lo = meta[e, _LO]
    hi = meta[e, _HI]
    h = min(k, meta[e, _HOLES])
    j = 0
    if g == _G_FLOAT and lo == hi:  # placing an empty float: all fresh
        for p in range(nlo, nhi):
            pages[j] = p
            j += 1
    else:
        for p in range(nlo, lo):  # fresh pages below lo (down end, float growing down) come first
            pages[j] = p
            j += 1
        if h > 0:  # holes from the bitmap, starting at the drain hint
            if g == _G_DOWN:  # the highest holes, written ascending
                meta[e, _HINT] = _pop_high(h64, meta[e, _HBOFF], meta[e, _HINT], h, pages, j)
            else:
                meta[e, _HINT] = _pop_low(h64, meta[e, _HBOFF], meta[e, _HINT], h, pages, j)
            j += h
            meta[e, _HOLES] -= h
        for p in range(hi, nhi):
            pages[j] = p
            j += 1
    for i in range(k):
        h8[off + pages[i]] = PAGE_LIVE
    meta[e, _LO] = nlo
    meta[e, _HI] = nhi
    if meta[e, _HOLES] == 0:
        meta[e, _HINT] = nlo - 1 if g == _G_DOWN else nhi
    meta[e, _LIVE] += k
    meta[e, _ALLOCS] += k
    if meta[e, _LIVE] > meta[e, _PEAK]:
        meta[e, _PEAK] = meta[e, _LIVE]


@njit(cache=True, error_model="numpy")
def _mint_bind(meta, h64, h8, owner, mask, k, nlo, nhi):
    """Mint ``k`` virtual pages of ``owner`` (lowest free id first) into the scratch area and bind a fresh
    page of every end of ``mask`` to each (Note [Placement order]). Returns the scratch offset of the ids."""
    voff = meta[owner, _VOFF]
    scr = meta[0, _SCROFF]
    if k > 0:
        meta[owner, _VHINT] = _pop_low(h64, meta[owner, _VBOFF], meta[owner, _VHINT], k, h64, scr)
    for j in range(k):
        h8[voff + h64[scr + j]] = V_LIVE
    meta[owner, _VLIVE] += k
    pages = _page_scratch(meta, h64, k)
    for e in range(meta.shape[0]):
        if not h8[mask + e]:
            continue
        _take(meta, h64, h8, e, k, nlo[e], nhi[e], pages)
        poff = meta[e, _POFF]
        evoff = meta[e, _VOFF]
        for j in range(k):
            p = pages[j]
            vid = h64[scr + j]
            h64[poff + p] = vid
            h64[evoff + vid] = p
    return scr


@njit(cache=True, error_model="numpy")
def _trim(meta, h64, h8, e):
    """Retreat the moving edge(s) of end ``e``'s band over trailing holes (they become gap)."""
    off = meta[e, _POFF]
    hb = meta[e, _HBOFF]
    g = meta[e, _GROW]
    lo = meta[e, _LO]
    hi = meta[e, _HI]
    removed = 0
    if g != _G_DOWN:
        while hi > lo and h8[off + hi - 1] == PAGE_HOLE:
            hi -= 1
            h8[off + hi] = PAGE_GAP
            _bclr(h64, hb, hi)
            removed += 1
    if g != _G_UP:
        while lo < hi and h8[off + lo] == PAGE_HOLE:
            h8[off + lo] = PAGE_GAP
            _bclr(h64, hb, lo)
            lo += 1
            removed += 1
    if removed:
        meta[e, _LO] = lo
        meta[e, _HI] = hi
        meta[e, _HOLES] -= removed
    if meta[e, _HOLES] == 0:
        meta[e, _HINT] = lo - 1 if g == _G_DOWN else hi
    elif g == _G_FLOAT and meta[e, _HINT] < lo:
        meta[e, _HINT] = lo


@njit(cache=True, error_model="numpy")
def _to_hole(meta, h64, h8, e, p):
    h8[meta[e, _POFF] + p] = PAGE_HOLE
    _bset(h64, meta[e, _HBOFF], p)
    meta[e, _HOLES] += 1
    if meta[e, _GROW] == _G_DOWN:
        if p > meta[e, _HINT]:
            meta[e, _HINT] = p
    elif p < meta[e, _HINT]:
        meta[e, _HINT] = p


@njit(cache=True, error_model="numpy")
def _unbind(meta, h64, h8, pin, b, scr, n):
    """Unbind end ``b`` from the ``n`` virtual pages at ``h64[scr:]`` where bound (holes, or pending where
    pinned), then trim its band; returns the pages unbound."""
    off = meta[b, _POFF]
    voff = meta[b, _VOFF]
    down = meta[b, _GROW] == _G_DOWN
    hb = meta[b, _HBOFF]
    hint = meta[b, _HINT]
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
        meta[b, _HOLES] += holes
        meta[b, _PENDING] += pend
        meta[b, _HINT] = hint
        meta[b, _LIVE] -= freed
        _trim(meta, h64, h8, b)
    return freed



@njit(cache=True, error_model="numpy")
def _k_unpend(meta, h64, h8, e, pages):
    """Pending pages of end ``e`` among ``pages`` whose last pin dropped become holes; returns how many."""
    off = meta[e, _POFF]
    n = 0
    for i in range(pages.shape[0]):
        p = pages[i]
        if h8[off + p] != PAGE_PENDING:
            continue
        meta[e, _PENDING] -= 1
        _to_hole(meta, h64, h8, e, p)
        n += 1
    if n:
        _trim(meta, h64, h8, e)
    return n


@njit(cache=True, error_model="numpy")
def _k_recount(meta, h64, h8, e):
    """Recompute end ``e``'s live/hole/pending counters and drain hint from its states (after compaction
    rewrote them), and re-trim its band."""
    off = meta[e, _POFF]
    hb = meta[e, _HBOFF]
    lo = meta[e, _LO]
    hi = meta[e, _HI]
    for w in range((meta[e, _TOP] + 64) >> 6):
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
    meta[e, _LIVE] = live
    meta[e, _HOLES] = holes
    meta[e, _PENDING] = pend
    if holes:
        meta[e, _HINT] = last_hole if meta[e, _GROW] == _G_DOWN else first_hole
    _trim(meta, h64, h8, e)

