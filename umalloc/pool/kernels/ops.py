"""Kernel entry points (numba): allocation, extend/decode, free/unbind, bind, translation; their compiled entries.

Each ``k_*`` kernel takes the heap root address (Note [Heap root] in :mod:`umalloc.pool.kernels.raw`), validates
its whole batch first and writes nothing on misuse (the error record, :mod:`umalloc.pool.kernels.codes`).

Note [Direct entry]
~~~~~~~~~~~~~~~~~~~
The page-level hot path and the token-level calls (translation too) on validated torch tensors (passed by
address) call the compiled entry point of a kernel for one fixed signature (ints, bools, and 1-D int64 numpy
arrays of any layout) instead of the numba dispatcher, which spends 150-250 ns per call typing the arguments and picking the
overload. The entry point does not check types: the caller has already checked the dtype and ndim of every
array it passes (layout ``A`` indexes by the array's own strides, so any 1-D array is read correctly). In debug
mode (``UMALLOC_DEBUG=1`` when the allocator is built) :func:`hot_entries` returns :class:`CheckedEntries`,
which checks every argument against the entry's signature (ints are ints, arrays are 1-D int64 numpy arrays of
at least the length passed with them, addresses were lent with enough bytes, the root is a live heap's, end
indices lie in ``[0, E)``) before the call, and raises :class:`~umalloc.errors.InvalidIdError` on a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit, types

from umalloc.errors import InvalidIdError
from umalloc.pool.kernels.bitmap import _bclr, _bset
from umalloc.pool.kernels.codes import (
    _E_BOUND,
    _E_DOUBLE,
    _E_INDEX,
    _E_LAST_NOPREFIX,
    _E_LAST_OFFSET,
    _E_LENS,
    _E_NOTALLOC,
    _E_OUT,
    _E_RANGE,
    _E_RESERVED,
    _E_TAIL_SHARED,
    _E_TAIL_UNBOUND,
    _E_UNBOUND,
    E_IDS,
    E_SHORT,
    OK,
    _fail,
)
from umalloc.pool.kernels.layout import (
    M_ALLOCS,
    M_ERROFF,
    M_FIRST,
    M_FREES,
    M_HBOFF,
    M_HI,
    M_HINT,
    M_HOLES,
    M_LIVE,
    M_NV,
    M_OWNER,
    M_PEAK,
    M_POFF,
    M_PS,
    M_PSHIFT,
    M_SCROFF,
    M_STAMP,
    M_TOP,
    M_UNBOUND,
    M_VBOFF,
    M_VHINT,
    M_VLIVE,
    M_VOFF,
    M_VT,
    V_FREED,
    V_LIVE,
    V_NEVER,
)
from umalloc.pool.kernels.placement import (
    _mint_bind,
    _page_scratch,
    _plan_k,
    _plan_scratch,
    _take,
    _to_hole,
    _unbind,
)
from umalloc.pool.kernels.raw import _heaps, _ids_view, _pins_of, _view, check_lent, forget_lent
from umalloc.pool.pagestate import PAGE_GAP, PAGE_HOLE, PAGE_LIVE
from umalloc.translators.cpu import v2p_run


@njit(cache=True, inline="always", error_model="numpy")
def _vpage_of(h8, voff, ps, lim, t, shift):
    """The live virtual page of token ``t`` of an owner (``voff``, ``ps``, ``lim = nv * ps``; ``shift`` =
    log2(ps) for a power of two, else -1), or minus an error code (range, reserved page 0, never allocated,
    already free)."""
    if t < 0 or t >= lim:
        return -_E_RANGE
    vp = t >> shift if shift >= 0 else t // ps
    if vp == 0:
        return -_E_RESERVED
    s = h8[voff + vp]
    if s != V_LIVE:
        return -_E_DOUBLE if s == V_FREED else -_E_NOTALLOC
    return vp


@njit(cache=True, inline="always", error_model="numpy")
def _check_tail(meta, h64, h8, owner, mask, stamp, vp, i, ll):
    """A partial tail page extended by request ``i``: not extended twice in one batch, bound on every end of
    the bind mask. Returns False (err filled) on misuse."""
    sidx = meta[0, M_VT] + meta[owner, M_VOFF] + vp
    if h64[sidx] == stamp:
        _fail(meta, h64, _E_TAIL_SHARED, i, ll, 0)
        return False
    h64[sidx] = stamp
    for b in range(meta.shape[0]):
        if h8[mask + b] and b != owner and h64[meta[b, M_VOFF] + vp] < 0:
            _fail(meta, h64, _E_TAIL_UNBOUND, i, ll, b)
            return False
    return True


@njit(cache=True, error_model="numpy")
def k_alloc_pages(root, owner, mask, k, vids_a, n_vids, idx_a, n_idx):
    """Mint ``k`` virtual pages into ``vids_a`` (``n_vids`` long; with ``n_idx >= 0`` page ``j`` goes to
    ``vids[idx[j]]``, a scatter into a block table, every index checked first) per Note [Placement order].
    More pages than the owner has free virtual ids can never fit (no compaction helps): E_IDS with the owner's
    deficit, nothing changed."""
    meta, h64, h8 = _heaps(root)
    use_idx = n_idx >= 0
    idx = _ids_view(idx_a, n_idx if use_idx else 0)
    if use_idx:
        for j in range(k):
            if idx[j] < 0 or idx[j] >= n_vids:
                return _fail(meta, h64, _E_INDEX, j, idx[j], n_vids)
    free_ids = meta[owner, M_NV] - 1 - meta[owner, M_VLIVE]
    if k > free_ids:
        b = meta[0, M_ERROFF] + 4
        for e in range(meta.shape[0]):
            h64[b + e] = 0
        h64[b + owner] = k - free_ids
        return _fail(meta, h64, E_IDS, 0, k, 0)
    vids = _ids_view(vids_a, n_vids)
    _, _, nlo, nhi = _plan_scratch(meta, h64)
    if not _plan_k(meta, h64, h8, mask, k, nlo, nhi):
        return E_SHORT
    scr = _mint_bind(meta, h64, h8, owner, mask, k, nlo, nhi)
    if use_idx:
        # every slot is read before the first write: ``index`` may overlap the table (even be it), and a slot
        # overwritten by a page id must not steer a later write outside the table (Note [Page-level hot path])
        slot = _page_scratch(meta, h64, k)
        for j in range(k):
            slot[j] = idx[j]
        for j in range(k):
            vids[slot[j]] = h64[scr + j]
    else:
        for j in range(k):
            vids[j] = h64[scr + j]
    h64[meta[0, M_ERROFF]] = OK
    return OK


#: :func:`k_claim` results: 0 ok, else (code, position) packed as ``code + 8 * position``
CLAIM_RANGE, CLAIM_LIVE, CLAIM_PAGE = 1, 2, 3


@njit(cache=True, error_model="numpy")
def k_claim(root, e, vids):
    """Mint exactly the virtual pages ``vids`` of the one-end owner ``e`` and bind each to the physical page of
    the same number (Note [Exact ids] in :mod:`umalloc.allocator.facade`). Validates the whole batch first:
    returns 0, or ``code + 8 * position`` of the first bad entry (out of range, not a free virtual page or
    repeated, physical page not free) with nothing changed."""
    meta, h64, h8 = _heaps(root)
    n = vids.shape[0]
    voff = meta[e, M_VOFF]
    poff = meta[e, M_POFF]
    nv = meta[e, M_NV]
    bad = 0
    marked = 0
    for j in range(n):
        v = vids[j]
        if v < 1 or v >= nv or v < meta[e, M_FIRST] or v > meta[e, M_TOP]:
            bad = CLAIM_RANGE + 8 * j
            break
        s = h8[voff + v]
        if s != V_NEVER and s != V_FREED:
            bad = CLAIM_LIVE + 8 * j
            break
        ps = h8[poff + v]
        if ps != PAGE_HOLE and ps != PAGE_GAP:
            bad = CLAIM_PAGE + 8 * j
            break
        h8[voff + v] = s + 16   # marked: a repeat in the batch is "not free"; the state is restored below
        marked += 1
    for j in range(marked):
        v = vids[j]
        h8[voff + v] -= 16
    if bad:
        return bad
    vb = meta[e, M_VBOFF]
    hb = meta[e, M_HBOFF]
    for j in range(n):
        v = vids[j]
        h8[voff + v] = V_LIVE
        _bclr(h64, vb, v)
        hi = meta[e, M_HI]
        if v >= hi:   # fresh band: the pages between the band's edge and v become holes
            for p in range(hi, v):
                _to_hole(meta, h64, h8, e, p)
            meta[e, M_HI] = v + 1
        else:         # a hole
            _bclr(h64, hb, v)
            meta[e, M_HOLES] -= 1
        h8[poff + v] = PAGE_LIVE
        h64[poff + v] = v
        h64[voff + v] = v
        meta[e, M_LIVE] += 1
        meta[e, M_ALLOCS] += 1
    if meta[e, M_HOLES] == 0:
        meta[e, M_HINT] = meta[e, M_HI]
    if meta[e, M_LIVE] > meta[e, M_PEAK]:
        meta[e, M_PEAK] = meta[e, M_LIVE]
    meta[e, M_VLIVE] += n
    return 0


@njit(cache=True, error_model="numpy")
def k_extend(root, owner, mask, pre_a, seq_a, last_a, B, out_a, n_out):
    """SGLang-style extend. Writes the virtual token ids to ``out_a`` (``n_out`` long) or, if ``out_a == 0``,
    returns a new array of them; err[0] holds the result code, err[1] the number of fresh pages.

    Note [Extend overflow]: ``seq_lens`` are caller data, so the page and token sums could wrap int64 (huge
    lengths whose sum wraps to a small count would pass the plan and the output loop would write far past the
    buffer). A request needing more fresh pages than the owner has free virtual ids can never fit (the owner's
    physical capacity is at most its id space), so the count saturates at ``free_ids + 1``: a shortfall."""
    meta, h64, h8 = _heaps(root)
    pre = _view(pre_a, B)
    seq = _view(seq_a, B)
    last = _view(last_a, B)
    ps = meta[owner, M_PS]
    voff = meta[owner, M_VOFF]
    lim = meta[owner, M_NV] * ps
    shift = meta[owner, M_PSHIFT]
    meta[owner, M_STAMP] += 1
    stamp = meta[owner, M_STAMP]
    empty = np.empty(0, np.int64)
    free_ids = meta[owner, M_NV] - 1 - meta[owner, M_VLIVE]
    k = 0
    ntok = 0
    over = False  # more fresh pages than free virtual ids: can never fit (Note [Extend overflow])
    for i in range(B):
        P = pre[i]
        L = seq[i]
        if P < 0 or L < P:
            _fail(meta, h64, _E_LENS, i, P, L)
            return empty
        ll = last[i]
        if P == 0:
            if ll != -1:
                _fail(meta, h64, _E_LAST_NOPREFIX, i, ll, 0)
                return empty
        else:
            vp = _vpage_of(h8, voff, ps, lim, ll, shift)
            if vp < 0:
                _fail(meta, h64, -vp, i, ll, owner)
                return empty
            if ll % ps != (P - 1) % ps:
                _fail(meta, h64, _E_LAST_OFFSET, i, ll, P)
                return empty
            if P % ps != 0 and L > P and not _check_tail(meta, h64, h8, owner, mask, stamp, vp, i, ll):
                return empty
        d = -(-L // ps) - (-(-P // ps))
        if over or d > free_ids - k:
            over = True
            k = free_ids + 1  # saturate: the plan below reports the shortfall; sums never overflow int64
        else:
            k += d
            ntok += L - P
    if out_a != 0 and not over and ntok != n_out:
        _fail(meta, h64, _E_OUT, 0, n_out, ntok)
        return empty
    _, _, nlo, nhi = _plan_scratch(meta, h64)
    if not _plan_k(meta, h64, h8, mask, k, nlo, nhi):
        return empty
    scr = _mint_bind(meta, h64, h8, owner, mask, k, nlo, nhi)
    if out_a != 0:
        out = _view(out_a, ntok)
        res = empty
    else:
        res = np.empty(ntok, np.int64)
        out = res
    o = 0
    j = scr
    for i in range(B):
        P = pre[i]
        L = seq[i]
        cp = -(-P // ps) * ps
        n_tail = min(L, cp) - P  # the partial tail page: tokens last + 1, last + 2, ...
        if n_tail > 0:
            base = last[i] + 1
            for q in range(n_tail):
                out[o + q] = base + q
            o += n_tail
        t = max(P, cp)
        while t < L:  # fresh pages, page aligned
            cnt = min(L - t, ps)
            vb = h64[j] * ps
            for q in range(cnt):
                out[o + q] = vb + q
            o += cnt
            t += cnt
            j += 1
    eb = meta[0, M_ERROFF]
    h64[eb] = OK
    h64[eb + 1] = k
    return res


@njit(cache=True, error_model="numpy")
def k_decode(root, owner, mask, seq_a, last_a, B, out_a):
    """SGLang-style decode: one token per request at position ``seq - 1``, written to ``out_a``."""
    meta, h64, h8 = _heaps(root)
    seq = _view(seq_a, B)
    last = _view(last_a, B)
    ps = meta[owner, M_PS]
    voff = meta[owner, M_VOFF]
    lim = meta[owner, M_NV] * ps
    shift = meta[owner, M_PSHIFT]
    meta[owner, M_STAMP] += 1
    stamp = meta[owner, M_STAMP]
    k = 0
    for i in range(B):
        L = seq[i]
        if L < 1:
            return _fail(meta, h64, _E_LENS, i, L - 1, L)
        ll = last[i]
        if L == 1:
            if ll != -1:
                return _fail(meta, h64, _E_LAST_NOPREFIX, i, ll, 0)
            k += 1
            continue
        vp = _vpage_of(h8, voff, ps, lim, ll, shift)
        if vp < 0:
            return _fail(meta, h64, -vp, i, ll, owner)
        if ll % ps != (L - 2) % ps:
            return _fail(meta, h64, _E_LAST_OFFSET, i, ll, L - 1)
        if (L - 1) % ps == 0:
            k += 1
        elif not _check_tail(meta, h64, h8, owner, mask, stamp, vp, i, ll):
            return h64[meta[0, M_ERROFF]]
    scr = meta[0, M_SCROFF]
    if k > 0:
        _, _, nlo, nhi = _plan_scratch(meta, h64)
        if not _plan_k(meta, h64, h8, mask, k, nlo, nhi):
            return E_SHORT
        scr = _mint_bind(meta, h64, h8, owner, mask, k, nlo, nhi)
    out = _view(out_a, B)
    j = scr
    for i in range(B):
        L = seq[i]
        if (L - 1) % ps == 0:
            out[i] = h64[j] * ps
            j += 1
        else:
            out[i] = last[i] + 1
    eb = meta[0, M_ERROFF]
    h64[eb] = OK
    h64[eb + 1] = k
    return OK


@njit(cache=True, error_model="numpy")
def _unique_vpages(meta, h64, h8, owner, toks, bound_end, strict_bound, want_unbound, pages, idx, use_idx):
    """Validate ``toks`` (live virtual tokens of ``owner``; virtual pages if ``pages``) -- or, with ``use_idx``,
    the entries ``toks[idx[i]]`` (a gather from a block table, every ``idx[i]`` in range) -- and collect their
    unique pages into the scratch area (first-occurrence order). With ``bound_end >= 0`` also check each page's
    binding on that end: ``want_unbound`` -> it must be unbound (else _E_BOUND); else it must be bound
    (_E_UNBOUND if ``strict_bound``, skipped otherwise). Returns the count, or -1 (err filled)."""
    voff = meta[owner, M_VOFF]
    ps = 1 if pages else meta[owner, M_PS]
    lim = meta[owner, M_NV] * ps
    shift = 0 if pages else meta[owner, M_PSHIFT]
    st = meta[0, M_VT] + voff
    scr = meta[0, M_SCROFF]
    meta[owner, M_STAMP] += 1
    stamp = meta[owner, M_STAMP]
    bvoff = meta[bound_end, M_VOFF] if bound_end >= 0 else 0
    n = 0
    n_tab = toks.shape[0]
    for i in range(idx.shape[0] if use_idx else n_tab):
        if use_idx:
            j = idx[i]
            if j < 0 or j >= n_tab:
                _fail(meta, h64, _E_INDEX, i, j, n_tab)
                return -1
            t = toks[j]
        else:
            t = toks[i]
        vp = _vpage_of(h8, voff, ps, lim, t, shift)
        if vp < 0:
            _fail(meta, h64, -vp, i, t, owner)
            return -1
        if h64[st + vp] == stamp:
            continue
        h64[st + vp] = stamp
        if bound_end >= 0:
            bound = h64[bvoff + vp] >= 0
            if want_unbound and bound:
                _fail(meta, h64, _E_BOUND, i, t, bound_end)
                return -1
            if not want_unbound and not bound:
                if strict_bound:
                    _fail(meta, h64, _E_UNBOUND, i, t, bound_end)
                    return -1
                continue
        h64[scr + n] = vp
        n += 1
    return n


@njit(cache=True, error_model="numpy")
def k_free(root, owner, toks_a, n_tok, pages, idx_a, n_idx):
    """Free the unique virtual pages of the tokens on the owner and every bound end still bound. Returns the
    number of unique pages (ids in the scratch area), or -1 on misuse (nothing changed)."""
    meta, h64, h8 = _heaps(root)
    toks = _ids_view(toks_a, n_tok)
    idx = _ids_view(idx_a, max(n_idx, 0))
    n = _unique_vpages(meta, h64, h8, owner, toks, -1, False, False, pages, idx, n_idx >= 0)
    if n < 0:
        return -1
    scr = meta[0, M_SCROFF]
    for b in range(meta.shape[0]):
        if meta[b, M_OWNER] == owner:
            meta[b, M_FREES] += _unbind(meta, h64, h8, _pins_of(root, b), b, scr, n)
    voff = meta[owner, M_VOFF]
    vb = meta[owner, M_VBOFF]
    hint = meta[owner, M_VHINT]
    for j in range(n):
        v = h64[scr + j]
        h8[voff + v] = V_FREED
        _bset(h64, vb, v)
        if v < hint:
            hint = v
    meta[owner, M_VHINT] = hint
    meta[owner, M_VLIVE] -= n
    h64[meta[0, M_ERROFF]] = OK
    return n


@njit(cache=True, error_model="numpy")
def k_unbind(root, b, toks_a, n_tok, strict, pages, idx_a, n_idx):
    """Unbind bound end ``b`` from the unique virtual pages of the tokens (the owner stays live)."""
    meta, h64, h8 = _heaps(root)
    toks = _ids_view(toks_a, n_tok)
    idx = _ids_view(idx_a, max(n_idx, 0))
    n = _unique_vpages(meta, h64, h8, meta[b, M_OWNER], toks, b, strict, False, pages, idx, n_idx >= 0)
    if n < 0:
        return -1
    meta[b, M_UNBOUND] += _unbind(meta, h64, h8, _pins_of(root, b), b, meta[0, M_SCROFF], n)
    h64[meta[0, M_ERROFF]] = OK
    return n


@njit(cache=True, error_model="numpy")
def k_bind(root, b, mask, toks_a, n_tok):
    """Bind fresh pages of bound end ``b`` (``mask`` selects it alone) to the unique live, unbound virtual
    pages of the tokens, in first-occurrence order."""
    meta, h64, h8 = _heaps(root)
    toks = _view(toks_a, n_tok)
    n = _unique_vpages(meta, h64, h8, meta[b, M_OWNER], toks, b, True, True, False, toks, False)
    if n < 0:
        return -1
    if n > 0:
        _, _, nlo, nhi = _plan_scratch(meta, h64)
        if not _plan_k(meta, h64, h8, mask, n, nlo, nhi):
            return -1
        pages = _page_scratch(meta, h64, n)
        _take(meta, h64, h8, b, n, nlo[b], nhi[b], pages)
        poff = meta[b, M_POFF]
        bvoff = meta[b, M_VOFF]
        scr = meta[0, M_SCROFF]
        for j in range(n):
            v = h64[scr + j]
            h64[poff + pages[j]] = v
            h64[bvoff + v] = pages[j]
    h64[meta[0, M_ERROFF]] = OK
    return n


@njit(cache=True, error_model="numpy")
def k_translate(root, e, ids_a, n, ps, strict, out_a):
    """Translate ``n`` int64 ids at ``ids_a`` (virtual tokens for ``ps`` = the end's page size, virtual pages
    for ``ps`` = 1) on end ``e``'s host v2p master into ``n`` int64s at ``out_a``, with the translators' one loop
    (:func:`umalloc.translators.cpu.v2p_run`; its return code, ``out`` untouched unless 0). Writes no heap
    state. O(n)."""
    meta, h64, _ = _heaps(root)
    off = meta[e, M_VOFF]
    tab = h64[off: off + meta[meta[e, M_OWNER], M_NV]]
    return v2p_run(_view(ids_a, n), tab, ps, np.iinfo(np.int64).max, strict, _view(out_a, n))


class Entries:
    """Compiled entry points of the hot kernels for the exact argument types the hot paths pass (Note [Direct
    entry]). Attribute names: ``free``/``unbind``/``alloc_pages`` take numpy id arrays, ``*_addr``,
    ``decode`` and ``extend`` take addresses."""

    def __init__(self) -> None:
        i, b, ids = types.int64, types.boolean, types.Array(types.int64, 1, "A")
        self.free = k_free.compile((i, i, ids, i, b, ids, i))
        self.unbind = k_unbind.compile((i, i, ids, i, b, b, ids, i))
        self.alloc_pages = k_alloc_pages.compile((i, i, i, i, ids, i, ids, i))
        # the token-level calls pass validated torch tensors by address: every argument an int (or a bool)
        self.decode = k_decode.compile((i,) * 7)
        self.extend = k_extend.compile((i,) * 9)
        self.free_addr = k_free.compile((i, i, i, i, b, i, i))
        self.unbind_addr = k_unbind.compile((i, i, i, i, b, b, i, i))
        self.translate_addr = k_translate.compile((i, i, i, i, i, b, i))


# Per entry: the role of each argument, for CheckedEntries. "root": a live heap root; "end": an end index;
# "int": an int; "bool": a bool; ("ids", n): a 1-D int64 numpy array with at least args[n] elements (n < 0 in
# args[n] means "unread"); ("addr", n): an address lent with room for args[n] int64s (0 means "none").
_ROLES: dict[str, tuple[Any, ...]] = {
    "free": ("root", "end", ("ids", 3), "int", "bool", ("ids", 6), "int"),
    "unbind": ("root", "end", ("ids", 3), "int", "bool", "bool", ("ids", 7), "int"),
    "alloc_pages": ("root", "end", "int", "int", ("ids", 5), "int", ("ids", 7), "int"),
    "decode": ("root", "end", "int", ("addr", 5), ("addr", 5), "int", ("addr", 5)),
    "extend": ("root", "end", "int", ("addr", 6), ("addr", 6), ("addr", 6), "int", ("addr", 8), "int"),
    "free_addr": ("root", "end", ("addr", 3), "int", "bool", ("addr", 6), "int"),
    "unbind_addr": ("root", "end", ("addr", 3), "int", "bool", "bool", ("addr", 7), "int"),
    "translate_addr": ("root", "end", ("addr", 3), "int", "int", "bool", ("addr", 3)),
}

#: live heap roots (address -> number of ends), registered by :class:`umalloc.pool.heap.Heap`
live_roots: dict[int, int] = {}


def _check_args(name: str, args: tuple[Any, ...]) -> None:
    roles = _ROLES[name]
    if len(args) != len(roles):
        raise InvalidIdError(f"{name}: {len(args)} arguments; allowed {len(roles)}")
    n_ends = live_roots.get(args[0], 0) if type(args[0]) is int else 0
    for pos, (role, a) in enumerate(zip(roles, args, strict=True)):
        where = f"{name} argument {pos}"
        if role == "root":
            if not n_ends:
                raise InvalidIdError(f"{where}: {a!r} is not the root of a live heap")
        elif role == "end":
            if type(a) is not int or not 0 <= a < n_ends:
                raise InvalidIdError(f"{where}: end index {a!r}; allowed an int in [0, {n_ends})")
        elif role == "int":
            if type(a) is not int or not -(1 << 63) <= a < (1 << 63):
                raise InvalidIdError(f"{where}: {a!r}; allowed an int64")
        elif role == "bool":
            if type(a) is not bool:
                raise InvalidIdError(f"{where}: {a!r}; allowed a bool")
        elif role[0] == "ids":
            n = args[role[1]]
            if type(a) is not np.ndarray or a.dtype != np.int64 or a.ndim != 1:
                desc = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                raise InvalidIdError(f"{where}: {desc}; allowed a 1-D int64 numpy array")
            if type(n) is not int or n > a.shape[0]:
                raise InvalidIdError(f"{where}: {n!r} elements of an array of {a.shape[0]}; allowed at most "
                                     f"{a.shape[0]}")
        else:  # an address
            n = args[role[1]]
            if a != 0 or name == "extend" and pos < 7:
                check_lent(where, a, max(int(n), 0) if type(n) is int else n)


class CheckedEntries:
    """:class:`Entries` with every argument checked first (Note [Direct entry]; debug mode)."""

    free: Callable[..., Any]
    unbind: Callable[..., Any]
    alloc_pages: Callable[..., Any]
    decode: Callable[..., Any]
    extend: Callable[..., Any]
    free_addr: Callable[..., Any]
    unbind_addr: Callable[..., Any]
    translate_addr: Callable[..., Any]

    def __init__(self, entries: Entries) -> None:
        for name in _ROLES:
            setattr(self, name, self._wrap(name, getattr(entries, name)))

    @staticmethod
    def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def checked(*args: Any) -> Any:
            try:
                _check_args(name, args)
                return fn(*args)
            finally:
                forget_lent()

        checked.__name__ = name
        return checked


_entries: Entries | None = None


def hot_entries(debug: bool = False) -> Entries | CheckedEntries:
    """The process-wide :class:`Entries`, compiled (or loaded from numba's cache) on first use; wrapped in
    :class:`CheckedEntries` when ``debug``."""
    global _entries
    if _entries is None:
        _entries = Entries()
    return CheckedEntries(_entries) if debug else _entries
