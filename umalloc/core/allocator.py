"""The multi-ended page allocator: every end (sub-pool) of one arena, virtual token ids, watermarks.

Policy:

* **Ends form a chain** in the arena, ordered by position: the ``up`` end (band ``[first_page, watermark)``,
  growing from the reserved floor), the ``float`` ends in spec order (band ``[lo, hi)``), the ``down`` end (band
  ``(watermark, top_page]``, growing from the top). Facing ends bound each other by *byte frontiers*, so free
  space between them (the gap) is shared dynamically even when their ``page_bytes`` differ
  (Note [Byte frontiers]).
* **Virtual ids.** Each id-owner end mints virtual pages (lowest free id first; id 0 is reserved and maps to the
  sink on every end, so padded block-table lanes holding token 0 translate to the sink). Bound ends (SWA, a draft
  that shares the target's token positions) bind their own physical page to the owner's virtual page. Token id
  ``t = vpage * page_size + offset``.
* **Placement contract** (Note [Placement order]): an end first drains its holes -- the *lowest* holes of an
  ``up`` or ``float`` end, the *highest* holes of a ``down`` end (it grows toward lower pages) -- then moves its
  frontier into the gap. The pages one call takes on one end are handed out in *ascending* physical order, and
  consecutive fresh virtual pages get consecutive physical pages, so fresh pages come out as ascending
  contiguous runs on every end.
* **Freed frontier pages retreat the band**: freeing the page at a band's moving edge turns it and every hole
  behind it into gap (no bytes move), so the facing end can grow. Pages in the middle become holes.
* **Failures** (shared/STYLE.md §3): out of space returns ``None`` and nothing changes (the whole plan over
  every end is computed before anything is written); misuse raises a typed
  :class:`~umalloc.errors.UmallocValueError` subclass and nothing changes; a broken invariant raises
  :class:`~umalloc.errors.InvariantError` from :meth:`MultiEndedAllocator.check_invariants`.
* **Bookkeeping lives on the host** (numpy masters driven by numba kernels, one kernel per call); when the arena
  is on CUDA each owner's ``v2p`` rows have a device mirror refreshed by one batched scatter per call.
* **Leases** (:mod:`umalloc.core.leases`): a physical page freed while pinned becomes *pending* (not reusable, not
  counted as available) until its last lease ends (F11). Expired leases are reclaimed at the start of every
  allocator call (F12). Compaction (:mod:`umalloc.core.compaction`) never moves a pinned or pending page.

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

Note [Shortfall]
~~~~~~~~~~~~~~~~
When an end cannot place its pages the ladder is: drain its holes, grow into the gap (both inside the one
planning kernel, for every end of the call at once); then -- unless ``compaction="off"`` -- plan room within
the move budget: compact the nearest present neighbour bounding each short end (the end above an up end frees
its low edge, the end below a down end its high edge; a float end as the case may be) and slide a float
neighbour away (Note [Float slide]). That plan is dry-run through the same planner first; only if the
allocation then fits does anything move, and the allocation is planned once more. Otherwise ``None`` with
nothing changed. :attr:`MultiEndedAllocator.last_shortfall` names each short end with its own deficit (F20).
``compaction="eager"`` also compacts the ends a ``free``/``release_end`` touched, right after it. Capacity
queries count holes and reachable gap only: never pending pages, never what compaction might free.

Note [Float slide]
~~~~~~~~~~~~~~~~~~
Compaction packs a band toward its anchor but cannot move a float end's band as a whole, so a float placed
early can wall in its neighbour for good. When an up (down) end falls short and its nearest present neighbour
above (below) is a float end, the ladder shifts the float: its pages at the edge facing the short end move, in
order, into the gap just past its other edge (one batched envelope copy), by just enough pages for the short
end's request. Pinned or pending pages never move (then there is no slide), and the slide counts against the
move budget.

Note [Pending pages]
~~~~~~~~~~~~~~~~~~~~
``free`` and ``release_end`` retire the virtual id at once (tables become TOMBSTONE, the id may be re-minted,
F02); the *physical* page becomes a hole, or ``PAGE_PENDING`` if a lease pins it. A pending page is not in any
table, not drained, not counted as available, and blocks the band from retreating past it. When its last pin
drops the lease table calls back and it becomes a hole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from numba import carray, njit, types
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros
from numba.extending import intrinsic, overload

from umalloc.geometry.arena import Arena
from umalloc.core.compaction import CompactionReport, MovePlan, apply_plan, plan_down, plan_float, plan_up
from umalloc.errors import (
    DoubleFreeError,
    InvalidIdError,
    InvariantError,
    LeaseError,
    NotAllocatedError,
    TombstoneError,
    UmallocValueError,
)
from umalloc.core.leases import Lease, LeaseTable
from umalloc.core.pagestate import PAGE_GAP, PAGE_HOLE, PAGE_LIVE, PAGE_PENDING, PAGE_RESERVED, TOMBSTONE
from umalloc.geometry.spec import ArenaSpec, EndRole, Grow, swa_tail_start

logger = logging.getLogger(__name__)

# ---- meta columns (one int64 row per end; the last group is the same in every row) ------------------------
_LO, _HI, _FIRST, _TOP, _PB, _PS, _GROW, _POFF, _VOFF, _OWNER, _NV = range(11)
_LIVE, _HOLES, _PENDING, _HINT, _PEAK, _ALLOCS, _FREES, _RELEASED, _MOVES = range(11, 20)
_VLIVE, _VHINT, _STAMP, _SPLIT = range(20, 24)
_FLOORB, _ARENAB, _VT, _CHOFF, _ERROFF, _SCROFF, _NE, _HBOFF, _VBOFF, _PSOFF, _PGOFF, _PSHIFT, _NFIELDS = \
    range(24, 37)

_G_UP, _G_DOWN, _G_FLOAT = 0, 1, 2
_GROW_CODE = {Grow.UP: _G_UP, Grow.DOWN: _G_DOWN, Grow.FLOAT: _G_FLOAT}

# ---- virtual page states (owner ends) -----------------------------------------------------------------------
V_NEVER, V_LIVE, V_FREED, V_RESERVED = 0, 1, 2, 3

# ---- kernel result codes (err[0]) --------------------------------------------------------------------------
_OK, _E_SHORT, _E_RANGE, _E_RESERVED, _E_NOTALLOC, _E_DOUBLE, _E_UNBOUND, _E_BOUND = range(8)
_E_LENS, _E_LAST_OFFSET, _E_LAST_NOPREFIX, _E_TAIL_SHARED, _E_TAIL_UNBOUND, _E_TOMB, _E_OUT, _E_IDS, _E_INDEX = \
    range(8, 17)

_SPLIT_ONE = 1_000_000  # float_split is stored in parts per million
_MASK_SLOTS = 64  # cached bind masks per allocator

COMPACTION_MODES = ("eager", "lazy", "off")


# =============================================================================================================
# numba kernels (host bookkeeping). Every kernel validates its whole batch before it writes anything.
#
# Note [Host heaps]
# ~~~~~~~~~~~~~~~~~
# All host masters live in two flat arrays so that a kernel call passes three arrays (numba's dispatch cost
# grows with every array argument): ``h64`` (int64) = [p2v of every end | v2p of every owner group | vstamp |
# chain | err | scratch] and ``h8`` (int8) = [state of every end | vstate of every owner group | bind masks].
# ``meta[e, _POFF]`` indexes both p2v (h64) and state (h8); ``meta[e, _VOFF]`` indexes both v2p (h64) and the
# owner's vstate (h8); vstamp is at ``_VT + _VOFF``. :class:`EndView` exposes the per-end slices (the agreed
# representation).
#
# Note [Heap root]
# ~~~~~~~~~~~~~~~~
# numba's dispatcher unboxes each array argument (about 0.2 us each, more for a tuple of arrays) but an int in
# tens of ns. The hot kernels (``_k_*``) therefore take one int, the address of a small int64 *root* vector:
# ``[meta address, E, h64 address, len, h8 address, len, (pin-count address, len) per end]``, and view the
# masters with ``numba.carray``. The allocator owns every array named there and never reallocates one.
#
# Note [Direct entry]
# ~~~~~~~~~~~~~~~~~~~
# The page-level hot path (Note [Page-level hot path]) and the token-level calls on validated torch tensors
# (passed by address) call the compiled entry point of a kernel for one fixed signature (ints, bools, and 1-D
# int64 numpy arrays of any layout) instead of the numba dispatcher, which spends 150-250 ns per call typing the
# arguments and picking the overload. The entry point does not check types: the
# caller has already checked the dtype and ndim of every array it passes (layout ``A`` indexes by the array's
# own strides, so any 1-D array is read correctly).
#
# Note [Page-level hot path]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``alloc_pages(out=)``, ``free_pages`` and ``release_pages`` call the kernel's direct entry (Note [Direct
# entry]) from the public method when every argument has the one form the entry was compiled for -- an ``int``
# ``num_pages``, 1-D arrays whose dtype *is* the canonical native int64 (``type(x) is np.ndarray``; a writeable
# ``out``), the default owner -- and nothing runs around the kernel: one id owner (``_plain``), no device mirror,
# no debug checks, no eager compaction, and no active lease. With no active lease ``_tick`` has nothing to
# reclaim: a lease past its deadline stays in the active table until ``_tick`` takes it out, so the first call
# after a deadline still sees it and takes the general path (F12). Anything else -- torch ids, other dtypes or
# dtype objects, ``owner=``, a shortfall's retry -- takes the general path, which validates and converts, then
# runs the same kernel through the dispatcher: both paths give the same result and the same typed errors.
# The kernels bound every read and write by the lengths they are given (an ``index`` slot is checked against
# the table before anything changes, and all slots are read before the first write, so ``index`` may overlap
# ``out``).
#
# Note [Zero-copy tensor inputs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Batched id tensors reach the kernels as (address, length) of a validated contiguous CPU int64 tensor, viewed
# in the kernel with ``numba.carray``; this skips ``Tensor.numpy()`` (about 1 us per tensor). The Python wrapper
# keeps the tensor alive for the call. The page-level calls (``alloc_pages(out=)``, ``free_pages``,
# ``release_pages``, and ``free`` / ``release_end``) also take 1-D int64 numpy arrays, which numba unboxes
# itself (``_ids_view``): engines that keep their block table in numpy (vLLM's ``BlockTable``) pass a
# gathered slice of it without a torch wrapper, and a numpy array is validated in three attribute reads where a
# torch tensor needs seven.
# =============================================================================================================
def _ptr_intrinsic(elem: types.Type, doc: str) -> Any:
    """A numba intrinsic ``int -> elem*`` (the address of a validated buffer the caller keeps alive)."""

    @intrinsic
    def ptr(typingctx, addr):  # noqa: ARG001 - numba intrinsic signature
        if not isinstance(addr, types.Integer):
            return None
        sig = types.CPointer(elem)(addr)

        def codegen(context, builder, signature, args):  # noqa: ARG001
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(elem)))

        return sig, codegen

    ptr.__doc__ = doc
    return ptr


_i64_ptr = _ptr_intrinsic(types.int64, "``int -> int64*``")
_i32_ptr = _ptr_intrinsic(types.int32, "``int -> int32*``")
_i8_ptr = _ptr_intrinsic(types.int8, "``int -> int8*``")


@njit(cache=True, inline="always", error_model="numpy")
def _view(addr, n):
    return carray(_i64_ptr(addr), (n,))


def _ids_view(x, n):  # noqa: ARG001 - typed by the overload below
    """Inside a kernel: the int64 ids a caller passed, as an address (``int``, a validated contiguous torch
    tensor) or as a 1-D int64 numpy array (any strides); Note [Zero-copy tensor inputs]."""
    raise NotImplementedError("numba-only")


# not inline="always": numba's IR inlining of this overload miscompiled _k_free (the owner's live-id counter
# stopped moving; tests/test_allocator.py caught it). The call costs nothing measurable.
@overload(_ids_view)
def _ids_view_impl(x, n):
    if isinstance(x, types.Integer):
        return lambda x, n: _view(x, n)
    if isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.int64:
        return lambda x, n: x
    return None


# root vector (Note [Heap root]): addresses and lengths of the host masters
_R_META, _R_E, _R_H64, _R_N64, _R_H8, _R_N8, _R_PINS = range(7)


@njit(cache=True, inline="always", error_model="numpy")
def _heaps(root_a):
    """(meta, h64, h8) viewed from the root vector at address ``root_a`` (Note [Heap root])."""
    root = carray(_i64_ptr(root_a), (_R_PINS,))
    meta = carray(_i64_ptr(root[_R_META]), (root[_R_E], _NFIELDS))
    h64 = carray(_i64_ptr(root[_R_H64]), (root[_R_N64],))
    h8 = carray(_i8_ptr(root[_R_H8]), (root[_R_N8],))
    return meta, h64, h8


@njit(cache=True, inline="always", error_model="numpy")
def _pins_of(root_a, e):
    """End ``e``'s per-page pin counts (int32, owned by the lease table)."""
    root = carray(_i64_ptr(root_a), (_R_PINS + 2 * (e + 1),))
    return carray(_i32_ptr(root[_R_PINS + 2 * e]), (root[_R_PINS + 2 * e + 1],))


@njit(cache=True, error_model="numpy")
def _fail(meta, h64, code, pos, value, extra):
    b = meta[0, _ERROFF]
    h64[b] = code
    h64[b + 1] = pos
    h64[b + 2] = value
    h64[b + 3] = extra
    return code


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


@njit(cache=True, inline="always", error_model="numpy")
def _bset(h64, base, i):
    h64[base + (i >> 6)] |= np.int64(1) << (i & 63)


@njit(cache=True, inline="always", error_model="numpy")
def _bclr(h64, base, i):
    h64[base + (i >> 6)] &= ~(np.int64(1) << (i & 63))


@njit(cache=True, inline="always", error_model="numpy")
def _pop_low(h64, base, start, k, out, out_off):
    """Take the ``k`` lowest set bits ``>= start`` of the bitmap at ``h64[base:]`` (clearing them), write their
    indices ascending to ``out[out_off: out_off + k]``; return one past the last. A word at a time."""
    w = start >> 6
    word = h64[base + w]
    mask = np.int64(-1) << (start & 63)
    keep = word & ~mask  # bits below start are not ours to take
    word &= mask
    last = start - 1
    for j in range(k):
        while word == 0:
            h64[base + w] = keep
            keep = 0
            w += 1
            word = h64[base + w]
        last = (w << 6) + trailing_zeros(word)
        out[out_off + j] = last
        word &= word - 1
    h64[base + w] = keep | word
    return last + 1


@njit(cache=True, inline="always", error_model="numpy")
def _pop_high(h64, base, start, k, out, out_off):
    """Take the ``k`` highest set bits ``<= start`` (clearing them), write their indices ascending to
    ``out[out_off: out_off + k]``; return one below the lowest taken."""
    w = start >> 6
    b0 = start & 63
    word = h64[base + w]
    mask = np.int64(-1) if b0 == 63 else (np.int64(1) << (b0 + 1)) - 1
    keep = word & ~mask  # bits above start are not ours to take
    word &= mask
    last = start + 1
    t = out_off + k - 1
    for _ in range(k):
        while word == 0:
            h64[base + w] = keep
            keep = 0
            w -= 1
            word = h64[base + w]
        b = 63 - leading_zeros(word)
        last = (w << 6) + b
        out[t] = last
        t -= 1
        word &= ~(np.int64(1) << b)
    h64[base + w] = keep | word
    return last - 1


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
                    target = below + (above - below) * meta[e, _SPLIT] // _SPLIT_ONE
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
        _fail(meta, h64, _E_SHORT, 0, k, 0)
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
    sidx = meta[0, _VT] + meta[owner, _VOFF] + vp
    if h64[sidx] == stamp:
        _fail(meta, h64, _E_TAIL_SHARED, i, ll, 0)
        return False
    h64[sidx] = stamp
    for b in range(meta.shape[0]):
        if h8[mask + b] and b != owner and h64[meta[b, _VOFF] + vp] < 0:
            _fail(meta, h64, _E_TAIL_UNBOUND, i, ll, b)
            return False
    return True


@njit(cache=True, error_model="numpy")
def _k_alloc_pages(root, owner, mask, k, vids_a, n_vids, idx_a, n_idx):
    """Mint ``k`` virtual pages into ``vids_a`` (``n_vids`` long; with ``n_idx >= 0`` page ``j`` goes to
    ``vids[idx[j]]``, a scatter into a block table, every index checked first) per Note [Placement order].
    More pages than the owner has free virtual ids can never fit (no compaction helps): _E_IDS with the owner's
    deficit, nothing changed."""
    meta, h64, h8 = _heaps(root)
    use_idx = n_idx >= 0
    idx = _ids_view(idx_a, n_idx if use_idx else 0)
    if use_idx:
        for j in range(k):
            if idx[j] < 0 or idx[j] >= n_vids:
                return _fail(meta, h64, _E_INDEX, j, idx[j], n_vids)
    free_ids = meta[owner, _NV] - 1 - meta[owner, _VLIVE]
    if k > free_ids:
        b = meta[0, _ERROFF] + 4
        for e in range(meta.shape[0]):
            h64[b + e] = 0
        h64[b + owner] = k - free_ids
        return _fail(meta, h64, _E_IDS, 0, k, 0)
    vids = _ids_view(vids_a, n_vids)
    _, _, nlo, nhi = _plan_scratch(meta, h64)
    if not _plan_k(meta, h64, h8, mask, k, nlo, nhi):
        return _E_SHORT
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
    h64[meta[0, _ERROFF]] = _OK
    return _OK


@njit(cache=True, error_model="numpy")
def _k_extend(root, owner, mask, pre_a, seq_a, last_a, B, out_a, n_out):
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
    ps = meta[owner, _PS]
    voff = meta[owner, _VOFF]
    lim = meta[owner, _NV] * ps
    shift = meta[owner, _PSHIFT]
    meta[owner, _STAMP] += 1
    stamp = meta[owner, _STAMP]
    empty = np.empty(0, np.int64)
    free_ids = meta[owner, _NV] - 1 - meta[owner, _VLIVE]
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
    eb = meta[0, _ERROFF]
    h64[eb] = _OK
    h64[eb + 1] = k
    return res


@njit(cache=True, error_model="numpy")
def _k_decode(root, owner, mask, seq_a, last_a, B, out_a):
    """SGLang-style decode: one token per request at position ``seq - 1``, written to ``out_a``."""
    meta, h64, h8 = _heaps(root)
    seq = _view(seq_a, B)
    last = _view(last_a, B)
    ps = meta[owner, _PS]
    voff = meta[owner, _VOFF]
    lim = meta[owner, _NV] * ps
    shift = meta[owner, _PSHIFT]
    meta[owner, _STAMP] += 1
    stamp = meta[owner, _STAMP]
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
            return h64[meta[0, _ERROFF]]
    scr = meta[0, _SCROFF]
    if k > 0:
        _, _, nlo, nhi = _plan_scratch(meta, h64)
        if not _plan_k(meta, h64, h8, mask, k, nlo, nhi):
            return _E_SHORT
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
    eb = meta[0, _ERROFF]
    h64[eb] = _OK
    h64[eb + 1] = k
    return _OK


@njit(cache=True, error_model="numpy")
def _unique_vpages(meta, h64, h8, owner, toks, bound_end, strict_bound, want_unbound, pages, idx, use_idx):
    """Validate ``toks`` (live virtual tokens of ``owner``; virtual pages if ``pages``) -- or, with ``use_idx``,
    the entries ``toks[idx[i]]`` (a gather from a block table, every ``idx[i]`` in range) -- and collect their
    unique pages into the scratch area (first-occurrence order). With ``bound_end >= 0`` also check each page's
    binding on that end: ``want_unbound`` -> it must be unbound (else _E_BOUND); else it must be bound
    (_E_UNBOUND if ``strict_bound``, skipped otherwise). Returns the count, or -1 (err filled)."""
    voff = meta[owner, _VOFF]
    ps = 1 if pages else meta[owner, _PS]
    lim = meta[owner, _NV] * ps
    shift = 0 if pages else meta[owner, _PSHIFT]
    st = meta[0, _VT] + voff
    scr = meta[0, _SCROFF]
    meta[owner, _STAMP] += 1
    stamp = meta[owner, _STAMP]
    bvoff = meta[bound_end, _VOFF] if bound_end >= 0 else 0
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
def _k_free(root, owner, toks_a, n_tok, pages, idx_a, n_idx):
    """Free the unique virtual pages of the tokens on the owner and every bound end still bound. Returns the
    number of unique pages (ids in the scratch area), or -1 on misuse (nothing changed)."""
    meta, h64, h8 = _heaps(root)
    toks = _ids_view(toks_a, n_tok)
    idx = _ids_view(idx_a, max(n_idx, 0))
    n = _unique_vpages(meta, h64, h8, owner, toks, -1, False, False, pages, idx, n_idx >= 0)
    if n < 0:
        return -1
    scr = meta[0, _SCROFF]
    for b in range(meta.shape[0]):
        if meta[b, _OWNER] == owner:
            meta[b, _FREES] += _unbind(meta, h64, h8, _pins_of(root, b), b, scr, n)
    voff = meta[owner, _VOFF]
    vb = meta[owner, _VBOFF]
    hint = meta[owner, _VHINT]
    for j in range(n):
        v = h64[scr + j]
        h8[voff + v] = V_FREED
        _bset(h64, vb, v)
        if v < hint:
            hint = v
    meta[owner, _VHINT] = hint
    meta[owner, _VLIVE] -= n
    h64[meta[0, _ERROFF]] = _OK
    return n


@njit(cache=True, error_model="numpy")
def _k_release(root, b, toks_a, n_tok, strict, pages, idx_a, n_idx):
    """Unbind bound end ``b`` from the unique virtual pages of the tokens (the owner stays live)."""
    meta, h64, h8 = _heaps(root)
    toks = _ids_view(toks_a, n_tok)
    idx = _ids_view(idx_a, max(n_idx, 0))
    n = _unique_vpages(meta, h64, h8, meta[b, _OWNER], toks, b, strict, False, pages, idx, n_idx >= 0)
    if n < 0:
        return -1
    meta[b, _RELEASED] += _unbind(meta, h64, h8, _pins_of(root, b), b, meta[0, _SCROFF], n)
    h64[meta[0, _ERROFF]] = _OK
    return n


@njit(cache=True, error_model="numpy")
def _k_bind(root, b, mask, toks_a, n_tok):
    """Bind fresh pages of bound end ``b`` (``mask`` selects it alone) to the unique live, unbound virtual
    pages of the tokens, in first-occurrence order."""
    meta, h64, h8 = _heaps(root)
    toks = _view(toks_a, n_tok)
    n = _unique_vpages(meta, h64, h8, meta[b, _OWNER], toks, b, True, True, False, toks, False)
    if n < 0:
        return -1
    if n > 0:
        _, _, nlo, nhi = _plan_scratch(meta, h64)
        if not _plan_k(meta, h64, h8, mask, n, nlo, nhi):
            return -1
        pages = _page_scratch(meta, h64, n)
        _take(meta, h64, h8, b, n, nlo[b], nhi[b], pages)
        poff = meta[b, _POFF]
        bvoff = meta[b, _VOFF]
        scr = meta[0, _SCROFF]
        for j in range(n):
            v = h64[scr + j]
            h64[poff + pages[j]] = v
            h64[bvoff + v] = pages[j]
    h64[meta[0, _ERROFF]] = _OK
    return n


@njit(cache=True, error_model="numpy")
def _k_translate(root, e, toks_a, n, out_a, strict, pages):
    """Virtual tokens (``pages``: virtual pages) of ``e``'s owner -> physical ids of end ``e``."""
    meta, h64, _ = _heaps(root)
    toks = _view(toks_a, n)
    out = _view(out_a, n)
    o = meta[e, _OWNER]
    ps = 1 if pages else meta[e, _PS]
    shift = 0 if pages else meta[e, _PSHIFT]
    lim = meta[o, _NV] * ps
    voff = meta[e, _VOFF]
    if shift >= 0:  # power-of-two page size: shifts and masks
        msk = ps - 1
        for i in range(n):
            t = toks[i]
            if t < 0 or t >= lim:
                return _fail(meta, h64, _E_RANGE, i, t, e)
            p = h64[voff + (t >> shift)]
            if p < 0:
                if strict:
                    return _fail(meta, h64, _E_TOMB, i, t, e)
                p = 0
            out[i] = (p << shift) + (t & msk)
    else:
        for i in range(n):
            t = toks[i]
            if t < 0 or t >= lim:
                return _fail(meta, h64, _E_RANGE, i, t, e)
            vp = t // ps
            p = h64[voff + vp]
            if p < 0:
                if strict:
                    return _fail(meta, h64, _E_TOMB, i, t, e)
                p = 0
            out[i] = p * ps + (t - vp * ps)
    h64[meta[0, _ERROFF]] = _OK
    return _OK


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


class _Entries:
    """Compiled entry points of the hot kernels for the exact argument types the page-level hot path passes
    (Note [Direct entry])."""

    def __init__(self) -> None:
        i, b, ids = types.int64, types.boolean, types.Array(types.int64, 1, "A")
        self.free = _k_free.compile((i, i, ids, i, b, ids, i))
        self.release = _k_release.compile((i, i, ids, i, b, b, ids, i))
        self.alloc_pages = _k_alloc_pages.compile((i, i, i, i, ids, i, ids, i))
        # the token-level calls pass validated torch tensors by address: every argument an int (or a bool)
        self.decode = _k_decode.compile((i,) * 7)
        self.extend = _k_extend.compile((i,) * 9)
        self.free_addr = _k_free.compile((i, i, i, i, b, i, i))
        self.release_addr = _k_release.compile((i, i, i, i, b, b, i, i))


_entries: _Entries | None = None


def _hot_entries() -> _Entries:
    """The process-wide :class:`_Entries`, compiled (or loaded from numba's cache) on first use."""
    global _entries
    if _entries is None:
        _entries = _Entries()
    return _entries


# =============================================================================================================
# public value types
# =============================================================================================================
@dataclass(frozen=True)
class EndStats:
    """Fixed-schema statistics of one end (PyTorch-allocator style: current, peak, cumulative).

    Pages are in the end's own page units, bytes are ``pages * page_bytes``.

    Attributes:
        name, role, grow, owner: identity (``owner`` is the id-owner end's name, itself for an owner).
        page_size (tokens), page_bytes, first_page, top_page, num_page_slots: geometry.
        band_lo, band_hi: the band ``[band_lo, band_hi)`` in physical pages; watermark: ``band_hi`` for an up
            end, ``band_lo - 1`` for a down end, ``band_hi`` for a float end.
        live_pages, hole_pages, pending_pages, gap_pages, reserved_pages: page-state counts (they sum to
            ``num_page_slots``); gap pages may lie under another end's band.
        reachable_gap_pages: gap pages this end could grow into now (byte frontiers of its neighbours).
        free_pages: ``hole_pages + reachable_gap_pages`` (= :meth:`MultiEndedAllocator.available_pages`).
        live_bytes, hole_bytes, pending_bytes, free_bytes: the same in bytes.
        peak_live_pages, peak_live_bytes: high-water mark of live pages.
        pages_allocated, pages_freed, pages_released, pages_moved, bytes_moved: cumulative counters
            (freed by :meth:`~MultiEndedAllocator.free`, released by :meth:`~MultiEndedAllocator.release_end`,
            moved by compaction).
        pinned_pages: pages of this end pinned by leases now; leases_active: active leases naming this end;
            leases_expired: leases naming this end reclaimed at their deadline.
    """

    name: str
    role: str
    grow: str
    owner: str
    page_size: int
    page_bytes: int
    first_page: int
    top_page: int
    num_page_slots: int
    band_lo: int
    band_hi: int
    watermark: int
    live_pages: int
    hole_pages: int
    pending_pages: int
    gap_pages: int
    reserved_pages: int
    reachable_gap_pages: int
    free_pages: int
    live_bytes: int
    hole_bytes: int
    pending_bytes: int
    free_bytes: int
    peak_live_pages: int
    peak_live_bytes: int
    pages_allocated: int
    pages_freed: int
    pages_released: int
    pages_moved: int
    bytes_moved: int
    pinned_pages: int
    leases_active: int
    leases_expired: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EndView:
    """The agreed internal representation of one end, for :mod:`umalloc.core.compaction` / :mod:`umalloc.core.leases`
    and tests (views into the allocator's host masters: read them, mutate only through the allocator).

    Attributes:
        name, index, spec, owner (id-owner end name), grow (:class:`~umalloc.geometry.spec.Grow`), page_size, page_bytes,
        first_page, top_page, num_page_slots.
        p2v: ``int64`` ``(num_page_slots,)``: virtual page bound to each physical page, TOMBSTONE if none.
        state: ``int8`` ``(num_page_slots,)``: :mod:`umalloc.core.pagestate` codes.
        v2p: ``int64`` ``(num_vpages(owner),)``: physical page of each of the owner's virtual pages.
    """

    __slots__ = ("_meta", "first_page", "grow", "index", "name", "num_page_slots", "owner", "p2v",
                 "page_bytes", "page_size", "spec", "state", "top_page", "v2p")

    def __init__(self, alloc: MultiEndedAllocator, index: int) -> None:
        spec = alloc.spec.ends[index]
        self._meta = alloc._meta
        self.index = index
        self.name = spec.name
        self.spec = spec
        self.owner = alloc.spec.owner_of(spec.name)
        self.grow = spec.grow
        self.page_size = spec.page_size
        self.page_bytes = spec.page_bytes
        self.first_page = alloc.spec.first_page(spec.name)
        self.top_page = alloc.spec.top_page(spec.name)
        self.num_page_slots = self.top_page + 1
        m = self._meta[index]
        poff, voff, nv = int(m[_POFF]), int(m[_VOFF]), int(m[_NV])
        self.p2v = alloc._h64[poff: poff + self.num_page_slots]
        self.state = alloc._h8[poff: poff + self.num_page_slots]
        self.v2p = alloc._h64[voff: voff + nv]

    @property
    def lo(self) -> int:
        """First page of the band."""
        return int(self._meta[self.index, _LO])

    @property
    def hi(self) -> int:
        """One past the last page of the band."""
        return int(self._meta[self.index, _HI])

    @property
    def watermark(self) -> int:
        """``hi`` for an up (or float) end: band ``[first_page, watermark)``; ``lo - 1`` for a down end: band
        ``(watermark, top_page]``."""
        return self.lo - 1 if self.grow is Grow.DOWN else self.hi

    @property
    def live_pages(self) -> int:
        return int(self._meta[self.index, _LIVE])

    @property
    def hole_pages(self) -> int:
        return int(self._meta[self.index, _HOLES])

    @property
    def pending_pages(self) -> int:
        return int(self._meta[self.index, _PENDING])

    def __repr__(self) -> str:
        return (f"EndView({self.name!r}, grow={self.grow.value}, band=[{self.lo}, {self.hi}), "
                f"live={self.live_pages}, holes={self.hole_pages}, pending={self.pending_pages})")


# =============================================================================================================
# input validation helpers (hot path: keep them cheap)
# =============================================================================================================
_I64 = torch.int64
_Tensor = torch.Tensor


def _ids(t: object, name: str) -> torch.Tensor:
    """Validate a 1-D ``torch.int64`` id tensor; return a contiguous CPU tensor (itself when it already is one:
    the kernels read it in place, Note [Zero-copy tensor inputs]). The first test is the hot path's."""
    if type(t) is _Tensor and t.dtype is _I64 and t.dim() == 1 and t.is_cpu and t.is_contiguous():
        return t
    if not isinstance(t, torch.Tensor):
        raise InvalidIdError(f"{name}: got {type(t).__name__}; allowed a 1-D torch.int64 tensor")
    if t.dtype is not _I64:
        raise InvalidIdError(f"{name}: dtype {t.dtype}; allowed torch.int64")
    if t.dim() != 1:
        raise InvalidIdError(f"{name}: shape {tuple(t.shape)}; allowed a 1-D tensor")
    if t.layout is not torch.strided or t.is_meta:  # no dense data to read (copying one raises untyped)
        raise InvalidIdError(f"{name}: layout {t.layout} on {t.device}; allowed a dense (strided) tensor with data")
    if not t.is_cpu or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    return t


def _out(out: object, n: int | None, name: str = "out") -> torch.Tensor:
    """Validate a preallocated output: contiguous CPU ``torch.int64`` of shape ``(n,)`` (any length if ``n`` is
    None: the kernel checks it)."""
    if type(out) is _Tensor and out.dtype is _I64 and out.dim() == 1 and out.is_cpu and out.is_contiguous() \
            and (n is None or out.numel() == n):
        return out
    if isinstance(out, torch.Tensor) and out.dtype is _I64 and out.dim() == 1 and out.is_cpu \
            and out.is_contiguous() and (n is None or out.numel() == n):
        return out
    desc = (f"{out.dtype}, shape {tuple(out.shape)}, {out.device}" if isinstance(out, torch.Tensor)
            else type(out).__name__)
    shape = "(n,)" if n is None else f"({n},)"
    raise InvalidIdError(f"{name}: {desc}; allowed a contiguous CPU torch.int64 tensor of shape {shape}")


_NP_I64 = np.dtype(np.int64)
_I64_END = 1 << 63  # the first count an int64 kernel argument cannot hold


def _id_arg(t: object, name: str) -> tuple[Any, Any, int]:
    """Validate 1-D int64 ids given as a torch tensor or a numpy array; return ``(keepalive, kernel argument,
    length)``: a contiguous CPU tensor goes by address, a numpy array as itself (Note [Zero-copy tensor
    inputs]). Anything else gets :func:`_ids`' typed errors and conversions."""
    tt = type(t)
    if tt is _Tensor:
        if t.dtype is _I64 and t.dim() == 1 and t.is_cpu and t.is_contiguous():  # type: ignore[attr-defined]
            return t, t.data_ptr(), t.numel()  # type: ignore[attr-defined]
    elif tt is np.ndarray:
        if t.dtype is _NP_I64 and t.ndim == 1:  # type: ignore[attr-defined]
            return t, t, t.shape[0]  # type: ignore[attr-defined]
        if t.ndim == 1 and t.dtype == _NP_I64:  # type: ignore[attr-defined]
            # native int64 under another dtype object (unpickled, np.longlong): the kernels get the canonical one
            v = t.view(_NP_I64)  # type: ignore[attr-defined]
            return v, v, v.shape[0]
        if t.ndim != 1 or t.dtype.kind not in "iu":  # type: ignore[attr-defined]
            raise InvalidIdError(f"{name}: numpy {t.dtype}, shape {t.shape}; allowed a 1-D int64 "  # type: ignore
                                 f"array")
        raise InvalidIdError(f"{name}: numpy dtype {t.dtype.str}; allowed native int64")  # type: ignore[attr-defined]
    c = _ids(t, name)
    return c, c.data_ptr(), c.numel()


def _hot_index(table: np.ndarray, index: object) -> tuple[Any, int]:
    """The ``(index array, length)`` a page-level hot-path gather passes its kernel: ``(table, -1)`` (a dummy,
    unread) without ``index``, ``(None, 0)`` when ``index`` is not a 1-D native numpy int64 array (the general
    path then validates it). Note [Page-level hot path]."""
    if index is None:
        return table, -1
    if type(index) is np.ndarray and index.dtype is _NP_I64 and index.ndim == 1:
        return index, index.shape[0]
    return None, 0


def _out_arg(out: object, n: int | None) -> tuple[Any, Any, int]:
    """Validate a preallocated page output: a writeable 1-D native int64 numpy array or a contiguous CPU
    ``torch.int64`` tensor (as :func:`_out`) of ``n`` elements, or of any length for ``n = None`` (a block table
    written through ``index=``); return ``(out, kernel argument, length)``."""
    if type(out) is np.ndarray:
        if out.dtype == _NP_I64 and out.ndim == 1 and (n is None or out.shape[0] == n) and out.flags.writeable:
            return out, out.view(_NP_I64), out.shape[0]
        allowed = "(the block table index= points into)" if n is None else f"of shape ({n},)"
        raise InvalidIdError(f"out: numpy {out.dtype.str}, shape {out.shape}, writeable={out.flags.writeable}; "
                             f"allowed a writeable 1-D native int64 array {allowed}")
    res = _out(out, n)
    return res, res.data_ptr(), res.numel()


def _pack_bits(bits: np.ndarray) -> np.ndarray:
    """Bool array (length a multiple of 64) -> int64 words, bit ``i`` of word ``w`` = element ``64 w + i``."""
    return np.packbits(bits, bitorder="little").view("<i8").astype(np.int64)


def _unpack_bits(words: np.ndarray, n: int) -> np.ndarray:
    return np.unpackbits(words.astype("<i8").view(np.uint8), bitorder="little")[:n].astype(bool)


# =============================================================================================================
# the allocator
# =============================================================================================================
class MultiEndedAllocator:
    """Hands out pages of every end of one :class:`~umalloc.geometry.arena.Arena` under virtual token ids.

    Args:
        arena: the arena whose ends this allocator manages (one allocator per arena).
        compaction: ``"lazy"`` (default: compact only when an allocation falls short), ``"eager"`` (compact
            after every free) or ``"off"``. Compaction is :mod:`umalloc.core.compaction`'s (Note [Shortfall]).
        move_budget_pages: most pages one lazy compaction may move per call (``None``: unbounded).
        clock: monotonic clock in seconds for lease deadlines (tests pass a fake one).
        debug_checks: run :meth:`check_invariants` after every mutating call (O(slots) each: tests only).
        float_split: where an empty float end is placed in its gap (Note [Float policy]): one fraction in
            ``[0, 1]`` for every float end, or a mapping end name -> fraction (default 0.5).
        mirror_device: device of the ``v2p`` mirrors (default: the arena's device when it is CUDA, else no
            mirror: :meth:`v2p` then aliases the host masters). A CPU mirror exercises the refresh path in tests.

    Internal representation (the agreed one, see :class:`EndView` and Note [Host heaps]): per end, host ``p2v``
    (int64) and ``state`` (int8, :mod:`umalloc.core.pagestate`) of length ``num_page_slots(end)`` and ``v2p`` (int64)
    of length ``num_vpages(owner)``; per owner a virtual-page state array (``V_NEVER/V_LIVE/V_FREED/
    V_RESERVED``); pin counts live in the :class:`~umalloc.core.leases.LeaseTable`.

    Not thread-safe: call from the thread that owns the scheduler.

    >>> alloc = _doctest_allocator()          # full (up, owner) + swa (down, bound), 10 slots each, page_size 2
    >>> alloc.alloc_pages(3).tolist()          # virtual pages 1, 2, 3
    [1, 2, 3]
    >>> alloc.translate_pages(torch.tensor([1, 2, 3]), "full").tolist(), alloc.translate_pages(
    ...     torch.tensor([1, 2, 3]), "swa").tolist()
    ([1, 2, 3], [7, 8, 9])
    """

    def __init__(self, arena: Arena, *, compaction: str = "lazy", move_budget_pages: int | None = None,
                 clock: Callable[[], float] = time.monotonic, debug_checks: bool = False,
                 float_split: float | Mapping[str, float] = 0.5,
                 mirror_device: str | torch.device | None = None) -> None:
        if not isinstance(arena, Arena):
            raise UmallocValueError(f"arena={arena!r}: allowed an umalloc.geometry.arena.Arena")
        if compaction not in COMPACTION_MODES:
            raise UmallocValueError(f"compaction={compaction!r}: allowed one of {COMPACTION_MODES}")
        if move_budget_pages is not None and (isinstance(move_budget_pages, bool)
                                              or not isinstance(move_budget_pages, int) or move_budget_pages < 0):
            raise UmallocValueError(f"move_budget_pages={move_budget_pages!r}: allowed None or an int >= 0")
        self.arena = arena
        self.spec: ArenaSpec = arena.spec
        self.compaction_mode = compaction
        self.move_budget_pages = move_budget_pages
        self.debug_checks = bool(debug_checks)
        self.last_shortfall: dict[str, int] = {}
        spec = self.spec
        ends = spec.ends
        E = len(ends)
        self._names: tuple[str, ...] = tuple(e.name for e in ends)
        self._index: dict[str, int] = {n: i for i, n in enumerate(self._names)}
        splits = self._float_splits(float_split)

        # ---- heap layout (Note [Host heaps])
        slots = [spec.num_page_slots(e.name) for e in ends]
        poff = [0]
        for n in slots:
            poff.append(poff[-1] + n)
        PT = poff[-1]
        owners = [i for i, e in enumerate(ends) if e.is_owner]
        self._owners: tuple[int, ...] = tuple(owners)
        # group[o] = ends bound to owner o, owner first: their v2p rows are contiguous (one 2-D block)
        self._group: dict[int, tuple[int, ...]] = {
            o: (o, *[i for i, e in enumerate(ends) if e.owner == ends[o].name]) for o in owners}
        voff = [0] * E
        nv = [0] * E
        cursor = PT
        self._group_off: dict[int, tuple[int, int]] = {}
        for o in owners:
            n_o = slots[o]
            self._group_off[o] = (cursor, len(self._group[o]))
            for row, b in enumerate(self._group[o]):
                voff[b] = cursor + row * n_o
                nv[b] = n_o
            cursor += len(self._group[o]) * n_o
        VT = cursor - PT
        CH = PT + 2 * VT
        ERR = CH + E
        SCR = ERR + 4 + E
        PS = SCR + max(max(nv), 1)              # plan scratch: need, deficit, new_lo, new_hi
        PG = PS + 4 * E                         # page scratch: the pages one end takes in one call
        HB = PG + max(max(slots), 1)
        hboff = [0] * E
        cur = HB
        for i in range(E):
            hboff[i] = cur
            cur += (slots[i] + 63) >> 6
        vboff = [0] * E
        for o in owners:
            vboff[o] = cur
            cur += (slots[o] + 63) >> 6
        h64 = np.full(cur, TOMBSTONE, np.int64)
        h64[PT + VT: CH] = 0  # vstamp
        h64[ERR: SCR] = 0
        h64[HB:] = 0  # hole bitmaps (none yet), free-virtual-id bitmaps (set below)
        MASK = PT + VT
        h8 = np.zeros(MASK + _MASK_SLOTS * E, np.int8)
        h8[:PT] = PAGE_GAP
        meta = np.zeros((E, _NFIELDS), np.int64)
        for i, e in enumerate(ends):
            first, top = spec.first_page(e.name), spec.top_page(e.name)
            m = meta[i]
            m[_FIRST], m[_TOP], m[_PB], m[_PS] = first, top, e.page_bytes, e.page_size
            m[_GROW] = _GROW_CODE[e.grow]
            m[_POFF], m[_VOFF], m[_NV] = poff[i], voff[i], nv[i]
            m[_OWNER] = self._index[spec.owner_of(e.name)]
            m[_SPLIT] = splits.get(e.name, _SPLIT_ONE // 2)
            m[_FLOORB], m[_ARENAB] = spec.floor_bytes, spec.arena_bytes
            m[_VT], m[_CHOFF], m[_ERROFF], m[_SCROFF], m[_NE] = VT, CH, ERR, SCR, E
            m[_HBOFF], m[_VBOFF] = hboff[i], vboff[i]
            m[_PSOFF], m[_PGOFF] = PS, PG
            m[_PSHIFT] = e.page_size.bit_length() - 1 if e.page_size & (e.page_size - 1) == 0 else -1
            if e.grow is Grow.DOWN:
                m[_LO] = m[_HI] = top + 1
                m[_HINT] = top
            else:
                m[_LO] = m[_HI] = first
                m[_HINT] = first
            h8[poff[i]: poff[i] + first] = PAGE_RESERVED
            h64[voff[i]] = 0  # virtual page 0 -> the sink on every end
        for o in owners:
            h8[voff[o]] = V_RESERVED  # virtual page 0 is never minted
            meta[o, _VHINT] = 1
            free_ids = np.zeros(((slots[o] + 63) >> 6) * 64, bool)
            free_ids[1: slots[o]] = True
            h64[vboff[o]: vboff[o] + ((slots[o] + 63) >> 6)] = _pack_bits(free_ids)
        up = [i for i, e in enumerate(ends) if e.grow is Grow.UP]
        fl = [i for i, e in enumerate(ends) if e.grow is Grow.FLOAT]
        dn = [i for i, e in enumerate(ends) if e.grow is Grow.DOWN]
        h64[CH: CH + E] = up + fl + dn
        self._meta = meta
        self._h64 = h64
        self._h8 = h8
        self._chain = h64[CH: CH + E]
        self._err = h64[ERR: SCR]
        self._scratch = h64[SCR:]
        self._mask_base = MASK
        self._masks: dict[tuple[int, tuple[str, ...] | None], int] = {}
        self._default_owner = owners[0] if len(owners) == 1 else -1
        self._default_mask = self._bind_mask(owners[0], None) if len(owners) == 1 else -1
        self.ends: dict[str, EndView] = {n: EndView(self, i) for i, n in enumerate(self._names)}

        # ---- leases
        self._leases = LeaseTable({n: slots[i] for i, n in enumerate(self._names)}, clock=clock,
                                  on_unpinned=self._on_unpinned,
                                  first_pages={n: int(meta[i, _FIRST]) for i, n in enumerate(self._names)},
                                  validator=self._validate_lease_pages)
        self._pins = tuple(self._leases.pin_count(n) for n in self._names)
        # Note [Heap root]: the hot kernels take one int; every array it names is owned by self (or the lease
        # table self holds) and is never reallocated
        root = np.zeros(_R_PINS + 2 * E, np.int64)
        root[[_R_META, _R_E, _R_H64, _R_N64, _R_H8, _R_N8]] = (meta.ctypes.data, E, h64.ctypes.data, h64.size,
                                                                h8.ctypes.data, h8.size)
        for i, pins in enumerate(self._pins):
            if pins.dtype != np.int32 or not pins.flags.c_contiguous or pins.size != slots[i]:
                raise InvariantError(f"pin counts of end {self._names[i]!r}: {pins.dtype} x {pins.size}; "
                                     f"allowed contiguous int32 x {slots[i]}")
            root[_R_PINS + 2 * i: _R_PINS + 2 * i + 2] = (pins.ctypes.data, pins.size)
        self._root = root
        self._root_a = int(root.ctypes.data)
        self._active_leases = self._leases.active_view  # O(1) truthiness: the hot path's "any lease?" test
        self._expired_by_end = [0] * E

        # ---- device mirrors of v2p (one 2-D block per owner group) when the arena lives on CUDA
        self._device = arena.device if mirror_device is None else torch.device(mirror_device)
        self._mirror: dict[int, torch.Tensor] = {}
        self._host2d: dict[int, np.ndarray] = {}
        for o in owners:
            start, rows = self._group_off[o]
            self._host2d[o] = h64[start: start + rows * slots[o]].reshape(rows, slots[o])
        if self._device.type == "cuda" or mirror_device is not None:
            for o in owners:
                self._mirror[o] = torch.from_numpy(self._host2d[o]).to(self._device, copy=True)
        self._sync = bool(self._mirror) or self.debug_checks
        self._eager = compaction == "eager"
        # Note [Page-level hot path]: alloc_pages / free_pages / release_pages with numpy ids, the default owner
        # and nothing to do after the kernel (no device mirror, no debug checks, no eager compaction, no lease)
        # run the kernel straight from the public method; anything else takes the general path
        self._plain = not self._sync and not self._eager and len(owners) == 1
        self._hot = _hot_entries()
        self._bound: dict[str, int] = {n: i for i, n in enumerate(self._names) if int(meta[i, _OWNER]) != i}
        if self.debug_checks:
            self.check_invariants()

    # ------------------------------------------------------------------------------------------------------
    # construction helpers
    # ------------------------------------------------------------------------------------------------------
    def _float_splits(self, float_split: float | Mapping[str, float]) -> dict[str, int]:
        floats = [e.name for e in self.spec.ends if e.grow is Grow.FLOAT]
        items = float_split.items() if isinstance(float_split, Mapping) else [(n, float_split) for n in floats]
        out = {}
        for name, frac in items:
            if name not in floats:
                raise UmallocValueError(f"float_split names {name!r}: allowed one of the float ends {floats}")
            if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
                raise UmallocValueError(f"float_split[{name!r}]={frac!r}: allowed a number in [0, 1]")
            out[name] = int(round(frac * _SPLIT_ONE))
        return out

    # ------------------------------------------------------------------------------------------------------
    # ends and id spaces
    # ------------------------------------------------------------------------------------------------------
    def _end_index(self, end: str) -> int:
        try:
            return self._index[end]
        except (KeyError, TypeError):
            raise UmallocValueError(f"end {end!r}: allowed one of {list(self._names)}") from None

    def _owner_index(self, owner: str | None) -> int:
        if owner is None:
            if self._default_owner < 0:
                raise UmallocValueError(
                    f"owner=None is ambiguous: this arena has id-owner ends "
                    f"{[self._names[o] for o in self._owners]}; pass owner=")
            return self._default_owner
        o = self._end_index(owner)
        if self._meta[o, _OWNER] != o:
            raise UmallocValueError(f"owner={owner!r} is bound to {self.owner_of(owner)!r}; allowed an id-owner "
                                    f"end: {[self._names[i] for i in self._owners]}")
        return o

    def _bind_mask(self, o: int, bind: Sequence[str] | None, *, only: int = -1) -> int:
        """Offset in ``h8`` of the bind mask of owner ``o``: the owner plus ``bind`` (None: all bound ends);
        ``only >= 0``: that end alone."""
        key: tuple[int, Any] = (o, ("#only", only) if only >= 0 else (None if bind is None else tuple(bind)))
        off = self._masks.get(key)
        if off is not None:
            return off
        E = len(self._names)
        mask = np.zeros(E, np.int8)
        if only >= 0:
            mask[only] = 1
        else:
            group = self._group[o]
            mask[o] = 1
            if bind is None:
                mask[list(group)] = 1
            else:
                if isinstance(bind, str):
                    raise UmallocValueError(f"bind={bind!r}: allowed a sequence of end names, not a str")
                for name in bind:
                    b = self._end_index(name)
                    if b == o or b not in group:
                        raise UmallocValueError(f"bind names {name!r}: allowed the bound ends of "
                                                f"{self._names[o]!r}: {[self._names[i] for i in group[1:]]}")
                    mask[b] = 1
        slot = len(self._masks)
        if slot >= _MASK_SLOTS:  # an unusual number of distinct bind sets: recycle the cache
            self._masks.clear()
            slot = 0
            if self._default_owner >= 0:
                self._masks[(self._default_owner, None)] = self._mask_base
                slot = 1
                self._h8[self._mask_base: self._mask_base + E] = 0
                self._h8[self._mask_base + np.array(self._group[self._default_owner])] = 1
        off = self._mask_base + slot * E
        self._h8[off: off + E] = mask
        self._masks[key] = off
        return off

    def owner_of(self, end: str) -> str:
        """Name of the id-owner end whose virtual ids ``end`` uses (``end`` itself for an owner).

        >>> _doctest_allocator().owner_of("swa")
        'full'
        """
        return self._names[int(self._meta[self._end_index(end), _OWNER])]

    def num_vpages(self, owner: str | None = None) -> int:
        """Size of the owner's virtual page id space (``num_page_slots(owner)``; id 0 is reserved).

        >>> _doctest_allocator().num_vpages()
        10
        """
        return int(self._meta[self._owner_index(owner), _NV])

    def bound_ends(self, owner: str | None = None) -> tuple[str, ...]:
        """Names of the ends bound to ``owner`` (excluding the owner)."""
        return tuple(self._names[b] for b in self._group[self._owner_index(owner)][1:])

    def band(self, end: str) -> tuple[int, int]:
        """The band ``[lo, hi)`` of ``end`` in its physical pages. O(1)."""
        e = self._end_index(end)
        return int(self._meta[e, _LO]), int(self._meta[e, _HI])

    def watermark(self, end: str) -> int:
        """``hi`` of an up/float end's band; ``lo - 1`` of a down end's (band ``(watermark, top]``). O(1)."""
        return self.ends[self._names[self._end_index(end)]].watermark

    def v2p(self, end: str) -> torch.Tensor:
        """``int64`` tensor ``(num_vpages(owner),)`` on the arena's device: physical page of each virtual page
        of ``end``'s owner, TOMBSTONE (-1) where unbound; entry 0 is the sink (0).

        On CPU this aliases the host master (zero-copy): treat it as read-only. On CUDA it is the device mirror,
        refreshed by every allocator call.
        """
        e = self._end_index(end)
        o = int(self._meta[e, _OWNER])
        row = self._group[o].index(e)
        if self._mirror:
            return self._mirror[o][row]
        return torch.from_numpy(self._host2d[o][row])

    def p2v(self, end: str) -> torch.Tensor:
        """``int64`` CPU tensor ``(num_page_slots(end),)``: virtual page bound to each physical page, TOMBSTONE
        where none. Aliases the host master (read-only)."""
        return torch.from_numpy(self.ends[self._names[self._end_index(end)]].p2v)

    # ------------------------------------------------------------------------------------------------------
    # per-call plumbing
    # ------------------------------------------------------------------------------------------------------
    def _tick(self) -> None:
        """Reclaim leases past their deadline (F12); the unpinned-hook turns their pending pages into holes."""
        expired = self._leases.expire()
        for lease in expired:
            for name, pages in lease.pages.items():
                if pages.size:
                    self._expired_by_end[self._index[name]] += 1

    def _raise(self, where: str, *, pages: bool = False) -> None:
        """Raise the typed error the last kernel left in err (ids are virtual pages if ``pages``)."""
        code, pos, value, extra = (int(x) for x in self._err[:4])
        name = self._names[extra] if 0 <= extra < len(self._names) else "?"
        if code == _E_RANGE:
            raise InvalidIdError(f"{where}: id {value} at position {pos} is out of range for end {name!r}: "
                                 f"allowed [0, {self._limit(extra, pages)})")
        what = f"virtual page {value}" if pages else f"token {value}"
        in_page = "is a virtual page" if pages else "is in a virtual page"
        if code == _E_RESERVED:
            raise InvalidIdError(f"{where}: {what} at position {pos} lies in virtual page 0 (reserved, the "
                                 f"sink); allowed live virtual pages >= 1")
        if code == _E_NOTALLOC:
            raise NotAllocatedError(f"{where}: {what} at position {pos} {in_page} of {name!r} "
                                    f"that was never allocated")
        if code == _E_DOUBLE:
            raise DoubleFreeError(f"{where}: {what} at position {pos} {in_page} of {name!r} "
                                  f"that is already free")
        if code == _E_UNBOUND:
            raise NotAllocatedError(f"{where}: {what} at position {pos} is not bound on end {name!r} "
                                    f"(already released, or never bound); strict=False skips such pages")
        if code == _E_BOUND:
            raise InvalidIdError(f"{where}: {what} at position {pos} is already bound on end {name!r}; "
                                 f"allowed only live pages unbound on that end")
        if code == _E_LENS:
            raise InvalidIdError(f"{where}: request {pos} has prefix_len={value}, seq_len={extra}; allowed "
                                 f"0 <= prefix_len <= seq_len (seq_len >= 1 for decode)")
        if code == _E_LAST_NOPREFIX:
            raise InvalidIdError(f"{where}: request {pos} has no prefix but last_loc={value}; allowed -1")
        if code == _E_LAST_OFFSET:
            raise InvalidIdError(f"{where}: request {pos}: last_loc={value} is not at the page offset of token "
                                 f"position {extra - 1} (page arithmetic uses absolute positions, F07)")
        if code == _E_TAIL_SHARED:
            raise InvalidIdError(f"{where}: request {pos} extends the partial page of last_loc={value}, which "
                                 f"another request of the batch extends too")
        if code == _E_TAIL_UNBOUND:
            raise NotAllocatedError(f"{where}: request {pos}: the partial tail page of last_loc={value} is not "
                                    f"bound on end {name!r}, which this call binds")
        if code == _E_TOMB:
            raise TombstoneError(f"{where}: id {value} at position {pos} is tombstoned (unbound) on end "
                                 f"{name!r}; strict=False maps it to the sink")
        if code == _E_INDEX:
            raise InvalidIdError(f"{where}: index[{pos}] = {value} is outside the block table: allowed "
                                 f"[0, {extra})")
        if code == _E_OUT:
            raise InvalidIdError(f"{where}: out has {value} elements; allowed exactly {extra} (the new tokens)")
        raise InvariantError(f"{where}: unknown kernel result code {code}")

    def _limit(self, e: int, pages: bool = False) -> int:
        o = int(self._meta[e, _OWNER])
        return int(self._meta[o, _NV] * (1 if pages else self._meta[o, _PS]))

    def _after(self, o: int, n_scratch: int) -> None:
        """After a mutating call: refresh owner ``o``'s ``v2p`` mirror for the ``n_scratch`` virtual pages the
        kernel left in the scratch area; debug checks."""
        if self._mirror and n_scratch:
            self._refresh_mirror(o, self._scratch[:n_scratch])
        if self.debug_checks:
            self.check_invariants()

    def _refresh_mirror(self, o: int, vids: np.ndarray) -> None:
        """One host->device copy of ``[vids; v2p rows at vids]`` and one column scatter into the mirror."""
        if not self._mirror or vids.size == 0:
            return
        host = self._host2d[o]
        packed = np.empty((host.shape[0] + 1, vids.size), np.int64)
        packed[0] = vids
        packed[1:] = host[:, vids]
        dev = torch.from_numpy(packed).to(self._device)
        self._mirror[o].index_copy_(1, dev[0], dev[1:])

    def _short(self) -> dict[str, int]:
        """The per-end deficits of the last shortfall (F20), kept in :attr:`last_shortfall`."""
        E = len(self._names)
        self.last_shortfall = {self._names[e]: int(self._err[4 + e]) for e in range(E) if self._err[4 + e] > 0}
        logger.debug("allocation fell short: %s", self.last_shortfall)
        return self.last_shortfall

    def _retry(self, kernel: Callable[..., Any], args: tuple[Any, ...], mask: int, where: str) -> Any:
        """The slow path of a placement kernel that did not return OK (the hot path tests that inline): misuse
        raises (nothing changed); a shortfall runs the ladder (Note [Shortfall]) and the kernel once more.
        Returns the kernel's result, or None if the pages still do not fit (nothing changed)."""
        if self._err[0] == _E_IDS:  # the owner's virtual id space is exhausted: no ladder can help
            self._short()
            return None
        if self._err[0] != _E_SHORT:
            self._raise(where)
        if not self._retry_after_shortfall(int(self._err[2]), mask):
            return None
        res = kernel(*args)
        if self._err[0] != _OK:
            self._short()
            return None
        return res

    def _retry_after_shortfall(self, k: int, mask: int) -> bool:
        """Note [Shortfall]: holes are drained and the gap grown inside the kernels; when that is not enough,
        record each end's deficit and -- unless compaction is off -- make room within the move budget:

        1. compact the nearest present neighbour that bounds each short end's growth (the end above an up end
           frees its low edge, the end below a down end its high edge);
        2. if that neighbour is a float end, slide its band away from the short end (Note [Float slide]).

        The whole ladder is planned first and dry-run through the same planner as the allocation of ``k``
        pages on the ends of bind mask ``mask``; if it would still not fit, nothing moves and the caller
        returns ``None``. True if pages moved and the caller should plan once more."""
        deficits = self._short()
        if self.compaction_mode == "off" or not deficits:
            return False
        plans = self._neighbour_plans(deficits)
        E = len(self._names)
        meta2 = self._meta.copy()
        states: dict[int, np.ndarray] = {}
        for e, plan in plans.items():
            meta2[e, _LO], meta2[e, _HI] = plan.new_lo, plan.new_hi
            states[e] = self._state_after(e, plan)
            meta2[e, _HOLES] = int(np.count_nonzero(states[e][plan.new_lo: plan.new_hi] == PAGE_HOLE))
        slides = self._slides(deficits, k, meta2, states)
        if not plans and not slides:
            return False
        need = np.zeros(E, np.int64)
        for e in range(E):
            if self._h8[mask + e]:
                need[e] = max(0, k - int(meta2[e, _HOLES]))
        nlo, nhi, deficit = np.empty(E, np.int64), np.empty(E, np.int64), np.empty(E, np.int64)
        if _plan(meta2, self._chain, need, nlo, nhi, deficit) > 0:
            return False  # compaction within the budget would not make it fit: move nothing
        for e, plan in plans.items():
            self._apply_plan(e, plan)
        for f, shift in slides.items():
            self._apply_slide(f, shift)
        return True

    def _slides(self, deficits: Mapping[str, int], k: int, meta2: np.ndarray,
                states: dict[int, np.ndarray]) -> dict[int, int]:
        """Note [Float slide]: for each short up (down) end whose nearest present neighbour above (below) is a
        float end, the pages that float must shift up (down, negative) so the short end's ``k`` pages fit below
        (above) it. Updates ``meta2`` (bands) for the dry run. A slide is skipped if it would move a pinned or
        pending page, leave the arena, or exceed the move budget."""
        chain = self._chain.tolist()
        out: dict[int, int] = {}
        budget = self.move_budget_pages
        for pos, x in enumerate(chain):
            name = self._names[x]
            g = int(self._meta[x, _GROW])
            if name not in deficits or g == _G_FLOAT:
                continue
            step = 1 if g == _G_UP else -1
            f = -1
            j = pos + step
            while 0 <= j < len(chain):
                n = chain[j]
                if self._meta[n, _GROW] != _G_FLOAT or meta2[n, _LO] < meta2[n, _HI]:
                    f = n
                    break
                j += step
            if f < 0 or self._meta[f, _GROW] != _G_FLOAT or f in out:
                continue
            need_x = max(0, k - int(meta2[x, _HOLES]))
            pbx, pbf = int(meta2[x, _PB]), int(meta2[f, _PB])
            lo, hi = int(meta2[f, _LO]), int(meta2[f, _HI])
            if g == _G_UP:
                m = -(-(int(meta2[x, _HI]) + need_x) * pbx // pbf) - lo
                src = np.arange(lo, lo + m)
                dst_lo, dst_hi = hi, hi + m
            else:
                m = hi - (int(meta2[x, _LO]) - need_x) * pbx // pbf
                src = np.arange(hi - m, hi)
                dst_lo, dst_hi = lo - m, lo
            if m <= 0 or m > hi - lo or (budget is not None and m > budget):
                continue
            if dst_lo < int(self._meta[f, _FIRST]) or dst_hi > int(self._meta[f, _TOP]) + 1:
                continue
            # the destination must lie in the gap before the next present end on the float's far side
            fpos = chain.index(f)
            far = range(fpos + 1, len(chain)) if g == _G_UP else range(fpos - 1, -1, -1)
            bound = self.spec.arena_bytes if g == _G_UP else self.spec.floor_bytes
            for jj in far:
                nn = chain[jj]
                if self._meta[nn, _GROW] != _G_FLOAT or meta2[nn, _LO] < meta2[nn, _HI]:
                    bound = int(meta2[nn, _LO] * meta2[nn, _PB]) if g == _G_UP else int(meta2[nn, _HI] * meta2[nn, _PB])
                    break
            if (g == _G_UP and dst_hi * pbf > bound) or (g == _G_DOWN and dst_lo * pbf < bound):
                continue
            st = states.get(f, self.ends[self._names[f]].state)
            if not ((st[src] == PAGE_LIVE).all() and (self._pins[f][src] == 0).all()
                    and (st[dst_lo:dst_hi] == PAGE_GAP).all()):
                continue
            out[f] = m * step
            meta2[f, _LO], meta2[f, _HI] = lo + m * step, hi + m * step
        return out

    def _state_after(self, e: int, plan: MovePlan) -> np.ndarray:
        """End ``e``'s page states after ``plan`` (simulated on a copy)."""
        st = self.ends[self._names[e]].state.copy()
        if plan.num_moves:
            st[plan.src_pages] = PAGE_HOLE
            st[plan.dst_pages] = PAGE_LIVE
        st[plan.old_lo: plan.new_lo] = PAGE_GAP
        st[plan.new_hi: plan.old_hi] = PAGE_GAP
        return st

    def _apply_slide(self, f: int, shift: int) -> None:
        """Shift float end ``f``'s band by ``shift`` pages (Note [Float slide]): its ``|shift|`` pages at the
        edge facing the short end move, in order, to the gap just past its other edge (one batched copy)."""
        name = self._names[f]
        v = self.ends[name]
        lo, hi = int(self._meta[f, _LO]), int(self._meta[f, _HI])
        m = abs(shift)
        if shift > 0:
            src, dst = np.arange(lo, lo + m, dtype=np.int64), np.arange(hi, hi + m, dtype=np.int64)
            wide = (lo, hi + m)
        else:
            src, dst = np.arange(hi - m, hi, dtype=np.int64), np.arange(lo - m, lo, dtype=np.int64)
            wide = (lo - m, hi)
        v.state[dst] = PAGE_HOLE  # the band first widens over the destination gap pages, as holes
        plan = MovePlan("float", src, dst, wide[0], wide[1], lo + shift, hi + shift, 0)
        self._meta[f, _LO], self._meta[f, _HI] = wide
        self._apply_plan(f, plan)

    def _neighbour_plans(self, deficits: Mapping[str, int]) -> dict[int, MovePlan]:
        """Compaction plans (pure) for the nearest present ends that bound each short end's growth: the end
        above an up (or float) end frees its low edge, the end below a down (or float) end its high edge. One
        plan per end (the first short end in chain order decides a float's direction)."""
        chain = self._chain.tolist()
        plans: dict[int, MovePlan] = {}
        budget = self.move_budget_pages
        short = {self._index[n] for n in deficits}
        for pos, x in enumerate(chain):
            if x not in short:
                continue
            g = int(self._meta[x, _GROW])
            dirs = []
            if g != _G_DOWN:
                dirs.append((range(pos + 1, len(chain)), "low"))     # neighbour above: free its low edge
            if g != _G_UP:
                dirs.append((range(pos - 1, -1, -1), "high"))        # neighbour below: free its high edge
            for rng, edge in dirs:
                for j in rng:
                    n = chain[j]
                    if self._meta[n, _GROW] == _G_FLOAT and self._meta[n, _LO] == self._meta[n, _HI]:
                        continue  # an empty float bounds nothing
                    if n not in plans:
                        plan = self._plan_end(n, budget, edge)
                        if plan.num_moves or plan.retreated_pages:
                            plans[n] = plan
                    break
        return plans

    def _plan_end(self, e: int, budget: int | None, free_edge: str = "high") -> MovePlan:
        """The compaction plan of end ``e`` (pure). A float end frees ``free_edge``."""
        v = self.ends[self._names[e]]
        g = int(self._meta[e, _GROW])
        pins = self._pins[e]
        if g == _G_UP:
            return plan_up(v.state, pins, v.first_page, v.hi, budget)
        if g == _G_DOWN:
            return plan_down(v.state, pins, v.top_page, v.lo - 1, budget)
        return plan_float(v.state, pins, v.lo, v.hi, free_edge=free_edge, budget_pages=budget)

    def _apply_plan(self, e: int, plan: MovePlan) -> CompactionReport:
        """Execute a plan of end ``e``: one batched envelope copy, tables, band, counters, bitmaps, mirror."""
        name = self._names[e]
        v = self.ends[name]
        apply_plan(self.arena, name, plan, state=v.state, p2v=v.p2v, v2p=v.v2p, pins=self._pins[e])
        self._meta[e, _LO], self._meta[e, _HI] = plan.new_lo, plan.new_hi
        _k_recount(self._meta, self._h64, self._h8, e)
        self._meta[e, _MOVES] += plan.num_moves
        if self._mirror and plan.num_moves:
            self._refresh_mirror(int(self._meta[e, _OWNER]), v.p2v[plan.dst_pages])
        if plan.num_moves:
            logger.debug("compaction of %r moved %d page(s); band [%d, %d)", name, plan.num_moves,
                         plan.new_lo, plan.new_hi)
        return CompactionReport.from_plan(name, plan, v.page_bytes)

    def _after_free(self, touched_ends: Sequence[int]) -> None:
        """Eager compaction (``compaction="eager"``): after a free/release/unpin touched ``touched_ends``,
        compact each of them within the move budget (a float end toward its low edge)."""
        for e in touched_ends:
            plan = self._plan_end(e, self.move_budget_pages, "high")
            if plan.num_moves or plan.retreated_pages:
                self._apply_plan(e, plan)

    # ------------------------------------------------------------------------------------------------------
    # allocation
    # ------------------------------------------------------------------------------------------------------
    def _resolve(self, owner: str | None, bind: Sequence[str] | None) -> tuple[int, int]:
        if owner is None and bind is None and self._default_owner >= 0:
            return self._default_owner, self._default_mask
        o = self._owner_index(owner)
        return o, self._bind_mask(o, bind)

    def alloc_pages(self, num_pages: int, *, owner: str | None = None,
                    bind: Sequence[str] | None = None, out: torch.Tensor | np.ndarray | None = None,
                    index: torch.Tensor | np.ndarray | None = None) -> torch.Tensor | np.ndarray | None:
        """Mint ``num_pages`` fresh virtual pages and bind a physical page of the owner and of each bound end
        (the page-level call of an engine that keeps a per-request page table, as vLLM's
        ``BlockPool.get_new_blocks`` does).

        Args:
            num_pages: pages to allocate (an ``int`` or numpy integer in ``[0, 2**63)``; not a ``bool``).
            owner: id-owner end (``None``: the only one; ambiguous -> error).
            bind: bound ends to bind too (default: every bound end of the owner; ``[]``: the owner only).
            out: optional preallocated output of ``num_pages`` int64s: a contiguous CPU ``torch.int64`` tensor or
                a writeable 1-D native ``int64`` numpy array (any strides). With ``index``: the flat block table
                to write into (any length).
            index: optional ``int64 (num_pages,)`` slots of ``out`` (a 1-D torch tensor or numpy array): page
                ``j`` is written to ``out[index[j]]`` -- straight into a ``req_to_page`` block table, no scatter by
                the caller. Every slot is checked to lie in ``[0, len(out))`` before anything changes, and all are
                read before the first write (``index`` may overlap ``out``); slots should be distinct (a repeated
                slot keeps the last page written to it).

        Returns:
            the virtual pages (ascending, lowest free ids first): a new ``int64`` CPU tensor ``(num_pages,)``, or
            ``out`` itself if given (with ``index``: the whole table, pages at the slots), or ``None`` if any end
            lacks space or the owner lacks free virtual ids (nothing changed, ``out`` untouched;
            :attr:`last_shortfall` holds each end's deficit).

        Raises:
            UmallocValueError: bad ``num_pages``, owner or bind names. InvalidIdError: a wrong ``out`` or
            ``index`` (type, dtype, shape, device, a read-only numpy ``out``, ``index`` without ``out``, an
            ``index`` length other than ``num_pages``, a slot outside ``out``). Nothing changes on any error.

        Complexity: O(num_pages + holes scanned) in one numba kernel; pages per Note [Placement order].

        >>> alloc = _doctest_allocator()
        >>> alloc.alloc_pages(2, bind=[]).tolist(), alloc.stats()["swa"].live_pages
        ([1, 2], 0)
        >>> alloc.alloc_pages(100) is None, alloc.last_shortfall
        (True, {'full': 93})
        """
        if type(out) is np.ndarray and type(num_pages) is int and owner is None and bind is None and self._plain \
                and not self._active_leases and out.dtype is _NP_I64 and out.ndim == 1 and out.flags.writeable:
            # the hot path, Note [Page-level hot path]: out holds the pages, or with index is the table
            idx: Any = None
            if index is None:
                if out.shape[0] == num_pages:
                    idx, n_idx, n_out = out, -1, num_pages
            elif type(index) is np.ndarray and index.dtype is _NP_I64 and index.ndim == 1 \
                    and index.shape[0] == num_pages:
                idx, n_idx, n_out = index, num_pages, out.shape[0]
            if idx is not None:
                args = (self._root_a, self._default_owner, self._default_mask, num_pages, out, n_out, idx, n_idx)
                if self._hot.alloc_pages(*args) != _OK and self._retry(
                        _k_alloc_pages, args, self._default_mask, "alloc_pages") is None:
                    return None
                return out
        if type(num_pages) is not int:
            if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)):
                raise UmallocValueError(f"num_pages={num_pages!r}: allowed an int in [0, 2**63)")
            num_pages = int(num_pages)
        if not 0 <= num_pages < _I64_END:  # the kernels take an int64: a larger count must not reach them
            raise UmallocValueError(f"num_pages={num_pages!r}: allowed an int in [0, 2**63)")
        if owner is None and bind is None and self._default_owner >= 0:  # the hot path: no call
            o, mask = self._default_owner, self._default_mask
        else:
            o, mask = self._resolve(owner, bind)
        k = num_pages
        keep_idx, idx_arg, n_idx = None, 0, -1
        if index is not None:
            if out is None:
                raise InvalidIdError("alloc_pages: index given without out; allowed index only with out (the "
                                     "block table it indexes)")
            keep_idx, idx_arg, n_idx = _id_arg(index, "index")
            if n_idx != k:
                raise InvalidIdError(f"alloc_pages: index has {n_idx} slots; allowed exactly num_pages={k}")
            res, arg, n_out = _out_arg(out, None)
        elif out is None:
            # more pages than the owner has free virtual ids is refused by the kernel before anything is
            # written, so a huge num_pages must not size the output either
            free_ids = int(self._meta[o, _NV]) - 1 - int(self._meta[o, _VLIVE])
            res = torch.empty(min(k, free_ids + 1), dtype=_I64)
            arg, n_out = res.data_ptr(), k
        else:
            res, arg, n_out = _out_arg(out, k)
        if self._active_leases:
            self._tick()
        args = (self._root_a, o, mask, k, arg, n_out, idx_arg, n_idx)
        if _k_alloc_pages(*args) != _OK and self._retry(_k_alloc_pages, args, mask, "alloc_pages") is None:
            return None
        del keep_idx
        if self._sync:
            self._after(o, k)
        return res

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor, *,
                     owner: str | None = None, bind: Sequence[str] | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Allocate the tokens ``[prefix_len, seq_len)`` of each request (SGLang ``alloc_extend`` semantics).

        Each request first fills its partial last page (tokens ``last_loc + 1, ...``), then gets
        ``ceil(seq_len / page_size) - ceil(prefix_len / page_size)`` fresh virtual pages, in request order, each
        bound on the owner and the ``bind`` ends (default all bound ends).

        Args:
            prefix_lens: ``int64 (B,)`` tokens each request already holds.
            seq_lens: ``int64 (B,)`` tokens after the extend (``>= prefix_lens``).
            last_loc: ``int64 (B,)`` virtual token id of each request's last prefix token (position
                ``prefix_len - 1``), or ``-1`` where ``prefix_len == 0``.
            out: optional preallocated contiguous CPU ``int64`` output of shape ``(sum(seq_lens - prefix_lens),)``.

        Returns:
            ``int64`` CPU tensor ``(sum(seq_lens - prefix_lens),)`` of virtual token ids, request by request (``out``
            if given), or ``None`` if any end lacks space (nothing changed).

        Raises:
            InvalidIdError: bad dtype/shape, ``prefix_len > seq_len``, ``last_loc`` out of range, in page 0, at the
                wrong page offset, a partial tail page extended twice in one batch, or a wrong-sized ``out``.
            NotAllocatedError / DoubleFreeError: ``last_loc`` not live; a partial tail page unbound on a ``bind``
                end.

        Complexity: O(B + new tokens) in one numba kernel.

        >>> alloc = _doctest_allocator()            # page_size 2
        >>> t = alloc.alloc_extend(torch.tensor([0, 0]), torch.tensor([3, 1]), torch.tensor([-1, -1]))
        >>> t.tolist()                               # request 0: pages 1, 2; request 1: page 3
        [2, 3, 4, 6]
        >>> alloc.alloc_extend(torch.tensor([3]), torch.tensor([5]), torch.tensor([4])).tolist()
        [5, 8]
        """
        if owner is None and bind is None and self._default_owner >= 0:  # the hot path: no call
            o, mask = self._default_owner, self._default_mask
        else:
            o, mask = self._resolve(owner, bind)
        prefix_lens = _ids(prefix_lens, "prefix_lens")
        seq_lens = _ids(seq_lens, "seq_lens")
        last_loc = _ids(last_loc, "last_loc")
        B = prefix_lens.numel()
        if seq_lens.numel() != B or last_loc.numel() != B:
            raise InvalidIdError(f"alloc_extend: shapes prefix_lens ({B},), seq_lens ({seq_lens.numel()},), "
                                 f"last_loc ({last_loc.numel()},); allowed three equal (B,) shapes")
        if out is None:
            out_a = n_out = 0
        else:
            out = _out(out, None)
            out_a, n_out = out.data_ptr(), out.numel()
        if self._active_leases:
            self._tick()
        args = (self._root_a, o, mask, prefix_lens.data_ptr(), seq_lens.data_ptr(),
                last_loc.data_ptr(), B, out_a, n_out)
        res = self._hot.extend(*args)
        if self._err[0] != _OK:
            res = self._retry(_k_extend, args, mask, "alloc_extend")
            if res is None:
                return None
        if self._sync:
            self._after(o, int(self._err[1]))
        return torch.from_numpy(res) if out is None else out

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor, *, owner: str | None = None,
                     bind: Sequence[str] | None = None, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Allocate one token per request at position ``seq_len - 1`` (SGLang ``alloc_decode`` semantics): a
        fresh virtual page only where that position starts a page, else ``last_loc + 1``.

        Args:
            seq_lens: ``int64 (B,)`` lengths *after* adding the new token (``>= 1``).
            last_loc: ``int64 (B,)`` virtual token id of position ``seq_len - 2`` (``-1`` where ``seq_len == 1``).
            out: optional preallocated contiguous CPU ``int64 (B,)`` output.

        Returns:
            ``int64`` CPU tensor ``(B,)`` of virtual token ids (``out`` if given), or ``None`` if any end lacks
            space (nothing changed).

        Raises: as :meth:`alloc_extend`.

        >>> alloc = _doctest_allocator()            # page_size 2
        >>> alloc.alloc_decode(torch.tensor([1, 1]), torch.tensor([-1, -1])).tolist()   # new pages 1, 2
        [2, 4]
        >>> alloc.alloc_decode(torch.tensor([2, 2]), torch.tensor([2, 4])).tolist()     # same pages
        [3, 5]
        >>> alloc.alloc_decode(torch.tensor([3]), torch.tensor([3])).tolist()           # position 2: page 3
        [6]
        >>> alloc.alloc_decode(torch.tensor([2]), torch.tensor([3]))
        Traceback (most recent call last):
        ...
        umalloc.errors.InvalidIdError: alloc_decode: request 0: last_loc=3 is not at the page offset of token position 0 (page arithmetic uses absolute positions, F07)
        """
        if owner is None and bind is None and self._default_owner >= 0:  # the hot path: no call
            o, mask = self._default_owner, self._default_mask
        else:
            o, mask = self._resolve(owner, bind)
        seq_lens = _ids(seq_lens, "seq_lens")
        last_loc = _ids(last_loc, "last_loc")
        B = seq_lens.numel()
        if last_loc.numel() != B:
            raise InvalidIdError(f"alloc_decode: shapes seq_lens ({B},), last_loc ({last_loc.numel()},); allowed "
                                 f"two equal (B,) shapes")
        res = torch.empty(B, dtype=_I64) if out is None else _out(out, B)
        if self._active_leases:
            self._tick()
        args = (self._root_a, o, mask, seq_lens.data_ptr(), last_loc.data_ptr(), B,
                res.data_ptr())
        if self._hot.decode(*args) != _OK and self._retry(_k_decode, args, mask, "alloc_decode") is None:
            return None
        if self._sync:
            self._after(o, int(self._err[1]))
        return res

    def bind_end(self, end: str, vtokens: torch.Tensor) -> bool:
        """Bind fresh physical pages of bound ``end`` to the live virtual pages of ``vtokens``, which must be
        unbound on it (e.g. the SWA window tail of a request whose earlier pages were allocated with
        ``bind=[]``). Pages are taken per Note [Placement order] and assigned in first-occurrence order.

        Returns:
            True, or False if ``end`` lacks space (nothing changed).

        Raises:
            UmallocValueError: ``end`` unknown or an id owner. InvalidIdError: bad ids, page 0, or a page already
            bound on ``end``. NotAllocatedError / DoubleFreeError: a page that is not live. Nothing changes.

        >>> alloc = _doctest_allocator()
        >>> vp = alloc.alloc_pages(2, bind=[])
        >>> alloc.bind_end("swa", vp * 2), alloc.translate_pages(vp, "swa").tolist()
        (True, [8, 9])
        """
        b = self._bound_index(end, "bind_end")
        toks = _ids(vtokens, "vtokens")
        o = int(self._meta[b, _OWNER])
        mask = self._bind_mask(o, None, only=b)
        if self._active_leases:
            self._tick()
        args = (self._root_a, b, mask, toks.data_ptr(), toks.numel())
        n = _k_bind(*args)
        if n < 0:
            n = self._retry(_k_bind, args, mask, "bind_end")
            if n is None:
                return False
        if self._sync:
            self._after(o, n)
        return True

    def _bound_index(self, end: str, where: str) -> int:
        b = self._end_index(end)
        if self._meta[b, _OWNER] == b:
            raise UmallocValueError(f"{where}: end {end!r} is an id-owner end; allowed a bound end: "
                                    f"{[n for n in self._names if self.owner_of(n) != n]}")
        return b

    # ------------------------------------------------------------------------------------------------------
    # free / release
    # ------------------------------------------------------------------------------------------------------
    def free(self, vtokens: torch.Tensor | np.ndarray, *, owner: str | None = None) -> None:
        """Free the unique virtual pages containing ``vtokens`` on the owner and on every bound end where they
        are still bound (page granularity: one token frees its whole page, duplicates merge; F01/F06/F07).

        Physical pages pinned by a lease become pending (Note [Pending pages]); the virtual ids are free at once.

        Args:
            vtokens: ``int64 (n,)`` virtual token ids of the owner: a 1-D ``torch.int64`` tensor (read in place
                if contiguous on the CPU, else copied there), or a 1-D native ``int64`` numpy array of any strides
                (Note [Zero-copy tensor inputs]).

        Raises:
            InvalidIdError: bad dtype/shape, id out of range, or in virtual page 0. DoubleFreeError: a page already
            free. NotAllocatedError: a page never allocated. Nothing changes on any error.

        Complexity: O(n + pages freed) in one numba kernel.

        >>> alloc = _doctest_allocator()
        >>> t = alloc.alloc_extend(torch.tensor([0]), torch.tensor([4]), torch.tensor([-1]))
        >>> alloc.free(t[:1]); alloc.stats()["full"].hole_pages      # token 2 frees page 1 (a hole)
        1
        >>> alloc.free(t[:1])
        Traceback (most recent call last):
        ...
        umalloc.errors.DoubleFreeError: free: token 2 at position 0 is in a virtual page of 'full' that is already free
        """
        self._free(vtokens, owner, False, "free")

    def free_pages(self, vpages: torch.Tensor | np.ndarray, *, owner: str | None = None,
                   index: torch.Tensor | np.ndarray | None = None) -> None:
        """:meth:`free` for virtual *page* ids (an engine with a per-request page table, vLLM style): the same
        checks, errors and effects, with ``vpages`` instead of tokens (``token = vpage * page_size + offset``).

        Args:
            vpages: ``int64 (n,)`` live virtual pages of the owner (duplicates merge), in the forms :meth:`free`
                takes. With ``index``: the flat block table holding them (any length).
            owner: id-owner end (``None``: the only one; ambiguous -> error).
            index: optional ``int64 (m,)`` slots of ``vpages`` to free, same forms (a gather from a
                ``req_to_page`` block table, no gather by the caller).

        Raises:
            as :meth:`free`; also InvalidIdError for a bad ``index`` (type, dtype, shape) or a slot outside
            ``[0, len(vpages))``. Nothing changes on any error.

        Complexity: O(n, or m with ``index``, + pages freed) in one numba kernel.

        >>> alloc = _doctest_allocator()
        >>> vp = alloc.alloc_pages(3)
        >>> alloc.free_pages(vp[1:]); alloc.stats()["full"].live_pages
        1
        >>> alloc.free_pages(vp[1:2])
        Traceback (most recent call last):
        ...
        umalloc.errors.DoubleFreeError: free_pages: virtual page 2 at position 0 is a virtual page of 'full' that is already free
        """
        if type(vpages) is np.ndarray and owner is None and self._plain and not self._active_leases \
                and vpages.dtype is _NP_I64 and vpages.ndim == 1:  # the hot path, Note [Page-level hot path]
            idx, n_idx = _hot_index(vpages, index)
            if idx is not None:
                if self._hot.free(self._root_a, self._default_owner, vpages, vpages.shape[0], True, idx, n_idx) < 0:
                    self._raise("free_pages", pages=True)
                return
        self._free(vpages, owner, True, "free_pages", index)

    def _free(self, ids: torch.Tensor | np.ndarray, owner: str | None, pages: bool, where: str,
              index: torch.Tensor | np.ndarray | None = None) -> None:
        if owner is None and self._default_owner >= 0:
            o = self._default_owner
        else:
            o = self._owner_index(owner)
        keep, arg, n_ids = _id_arg(ids, "vpages" if pages else "vtokens")
        keep_idx, idx_arg, n_idx = (None, 0, -1) if index is None else _id_arg(index, "index")
        if self._active_leases:
            self._tick()
        if type(arg) is int and type(idx_arg) is int:  # torch ids by address: Note [Direct entry]
            n = self._hot.free_addr(self._root_a, o, arg, n_ids, pages, idx_arg, n_idx)
        else:
            n = _k_free(self._root_a, o, arg, n_ids, pages, idx_arg, n_idx)
        del keep, keep_idx
        if n < 0:
            self._raise(where, pages=pages)
        if n and self._eager:
            self._after_free(self._group[o])
        if self._sync:
            self._after(o, n)

    def release_end(self, end: str, vtokens: torch.Tensor | np.ndarray, *, strict: bool = True) -> None:
        """Tombstone bound ``end`` only, for the unique virtual pages of ``vtokens`` (SWA pages that left the
        window: use :meth:`swa_tail_start` for the frontier, F18). The virtual ids and the other ends stay live.

        Args:
            end: a bound end (SWA, or a draft bound to the owner).
            vtokens: ``int64 (n,)`` live virtual token ids of the owner, in the forms :meth:`free` takes.
            strict: a page already unbound on ``end`` raises (default); ``strict=False`` skips it.

        Raises:
            UmallocValueError: unknown end or an id-owner end. InvalidIdError: bad ids or page 0.
            NotAllocatedError: a page not live, or (strict) not bound on ``end``. DoubleFreeError: a page already
            freed. Nothing changes on any error.

        >>> alloc = _doctest_allocator()
        >>> vp = alloc.alloc_pages(2)
        >>> alloc.release_end("swa", vp[:1] * 2)
        >>> alloc.translate_pages(vp, "swa", strict=False).tolist(), alloc.translate_pages(vp, "full").tolist()
        ([0, 9], [1, 2])
        """
        self._release(end, vtokens, strict, False, "release_end")

    def release_pages(self, end: str, vpages: torch.Tensor | np.ndarray, *, strict: bool = True,
                      index: torch.Tensor | np.ndarray | None = None) -> None:
        """:meth:`release_end` for virtual *page* ids (vLLM-style page tables): tombstone bound ``end`` only for
        ``vpages`` (or, with ``index``, for ``vpages[index]``: a gather from the block table, as
        :meth:`free_pages`); the same checks, errors and effects.

        Args:
            end: a bound end (SWA, or a draft bound to the owner).
            vpages: ``int64 (n,)`` live virtual pages of the owner (duplicates merge), in the forms :meth:`free`
                takes. With ``index``: the flat block table holding them (any length).
            strict: a page already unbound on ``end`` raises (default); ``strict=False`` skips it.
            index: optional ``int64 (m,)`` slots of ``vpages`` to release, same forms.

        Raises:
            as :meth:`release_end`; also InvalidIdError for a bad ``index`` (type, dtype, shape) or a slot outside
            ``[0, len(vpages))``. Nothing changes on any error.

        Complexity: O(n, or m with ``index``, + pages released) in one numba kernel.

        >>> alloc = _doctest_allocator()
        >>> vp = alloc.alloc_pages(2)
        >>> alloc.release_pages("swa", vp[:1])
        >>> alloc.translate_pages(vp, "swa", strict=False).tolist()
        [0, 9]
        """
        if type(vpages) is np.ndarray and self._plain and not self._active_leases and vpages.dtype is _NP_I64 \
                and vpages.ndim == 1 and type(end) is str:  # the hot path, Note [Page-level hot path]
            b = self._bound.get(end, -1)
            idx, n_idx = _hot_index(vpages, index)
            if b >= 0 and idx is not None:
                if self._hot.release(self._root_a, b, vpages, vpages.shape[0], strict is not False, True, idx,
                                     n_idx) < 0:
                    self._raise("release_pages", pages=True)
                return
        self._release(end, vpages, strict, True, "release_pages", index)

    def _release(self, end: str, ids: torch.Tensor | np.ndarray, strict: bool, pages: bool, where: str,
                 index: torch.Tensor | np.ndarray | None = None) -> None:
        b = self._bound.get(end, -1) if type(end) is str else -1
        if b < 0:
            b = self._bound_index(end, where)
        keep, arg, n_ids = _id_arg(ids, "vpages" if pages else "vtokens")
        keep_idx, idx_arg, n_idx = (None, 0, -1) if index is None else _id_arg(index, "index")
        if self._active_leases:
            self._tick()
        if type(arg) is int and type(idx_arg) is int:  # torch ids by address: Note [Direct entry]
            n = self._hot.release_addr(self._root_a, b, arg, n_ids, strict is not False, pages, idx_arg, n_idx)
        else:
            n = _k_release(self._root_a, b, arg, n_ids, strict is not False, pages, idx_arg, n_idx)
        del keep, keep_idx
        if n < 0:
            self._raise(where, pages=pages)
        if n and self._eager:
            self._after_free((b,))
        if self._sync:
            self._after(int(self._meta[b, _OWNER]), n)

    @staticmethod
    def swa_tail_start(seq_len: int, window: int, prefix_len: int, page_size: int) -> int:
        """First token whose SWA page must exist: ``floor_to_page(max(prefix_len, seq_len - window))``.

        The one function prefill (what to send) and decode (what to keep: pages wholly before it may be released)
        use, so both work in the same units (tokens floored to the page) also when ``page_size > window``
        (F18/F19).

        Raises:
            UmallocValueError: negative lengths, ``window < 1``, ``page_size < 1`` or ``prefix_len > seq_len``.

        >>> MultiEndedAllocator.swa_tail_start(100, 32, 0, 16)     # window [68, 100): pages from token 64
        64
        >>> MultiEndedAllocator.swa_tail_start(10, 3, 0, 16)       # page_size > window: keep page 0
        0
        >>> MultiEndedAllocator.swa_tail_start(100, 32, 90, 16)    # the receiver holds 90 tokens already
        80
        """
        return swa_tail_start(seq_len, window, prefix_len, page_size)

    # ------------------------------------------------------------------------------------------------------
    # translation
    # ------------------------------------------------------------------------------------------------------
    def translate(self, vtokens: torch.Tensor, end: str, *, strict: bool = True,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Physical token ids of ``end`` for virtual token ids: ``v2p[end][t // ps] * ps + t % ps``.

        Args:
            vtokens: ``int64 (n,)`` virtual token ids of ``end``'s owner. CPU ids are translated on the host
                masters; ids on the arena's CUDA device are translated there against the device mirror.
            strict: a tombstoned (unbound) page raises :class:`TombstoneError`; ``False`` maps it to the sink
                (page 0). Virtual page 0 (padding) always maps to the sink.
            out: optional preallocated ``int64 (n,)`` output on the ids' device (CUDA-graph-stable pointers).

        Raises:
            InvalidIdError: bad dtype/shape or an id outside the owner's id space (in every mode, F15).
            TombstoneError: strict mode and an unbound page.

        >>> alloc = _doctest_allocator()
        >>> t = alloc.alloc_extend(torch.tensor([0]), torch.tensor([3]), torch.tensor([-1]))
        >>> alloc.translate(t, "full").tolist(), alloc.translate(t, "swa").tolist()
        ([2, 3, 4], [16, 17, 18])
        """
        return self._translate(vtokens, end, strict, out, pages=False)

    def translate_pages(self, vpages: torch.Tensor, end: str, *, strict: bool = True,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """Physical pages of ``end`` for virtual pages (``int64 (n,)``); modes and errors as :meth:`translate`.

        >>> alloc = _doctest_allocator()
        >>> alloc.translate_pages(alloc.alloc_pages(2), "swa").tolist()
        [8, 9]
        """
        return self._translate(vpages, end, strict, out, pages=True)

    def _translate(self, ids: torch.Tensor, end: str, strict: bool, out: torch.Tensor | None, *,
                   pages: bool) -> torch.Tensor:
        e = self._end_index(end)
        where = "translate_pages" if pages else "translate"
        if isinstance(ids, torch.Tensor) and ids.is_cuda and self._mirror:
            return self._translate_device(ids, e, strict, out, pages=pages)
        toks = _ids(ids, "vpages" if pages else "vtokens")
        n = toks.numel()
        if out is not None and not isinstance(out, torch.Tensor):
            _out(out, n)  # raises: out must be a tensor
        res = torch.empty(n, dtype=_I64) if out is None or out.is_cuda else _out(out, n)
        if out is not None and out.is_cuda:
            _out(out.cpu(), n)
        _k_translate(self._root_a, e, toks.data_ptr(), n, res.data_ptr(), bool(strict), bool(pages))
        if self._err[0] != _OK:
            self._raise(where)
        if out is not None and out.is_cuda:
            out.copy_(res)
            return out
        return res

    def _translate_device(self, ids: torch.Tensor, e: int, strict: bool, out: torch.Tensor | None, *,
                          pages: bool) -> torch.Tensor:
        if ids.dtype is not _I64 or ids.dim() != 1:
            raise InvalidIdError(f"translate: dtype {ids.dtype}, shape {tuple(ids.shape)}; allowed 1-D torch.int64")
        o = int(self._meta[e, _OWNER])
        ps = 1 if pages else int(self._meta[e, _PS])
        row = self._mirror[o][self._group[o].index(e)]
        lim = int(self._meta[o, _NV]) * ps
        if ids.numel() and bool(((ids < 0) | (ids >= lim)).any()):
            raise InvalidIdError(f"translate: an id is out of range for end {self._names[e]!r}: allowed [0, {lim})")
        vp = ids if pages else torch.div(ids, ps, rounding_mode="floor")
        phys = row[vp]
        if strict:
            if phys.numel() and bool((phys < 0).any()):
                raise TombstoneError(f"translate: an id is tombstoned (unbound) on end {self._names[e]!r}; "
                                     f"strict=False maps it to the sink")
        else:
            phys = phys.clamp_min(0)
        res = phys if pages else phys * ps + (ids - vp * ps)
        if out is not None:
            out.copy_(res)
            return out
        return res

    def num_contiguous_runs(self, vpages: torch.Tensor, end: str) -> int:
        """How many runs of consecutive ascending physical pages ``vpages`` (in the given order) forms on ``end``
        (the descriptor count of a transfer of these pages, per region pair). 0 for an empty input.

        Raises: as :meth:`translate_pages` (strict).

        >>> alloc = _doctest_allocator()
        >>> vp = alloc.alloc_pages(4)
        >>> alloc.num_contiguous_runs(vp, "full"), alloc.num_contiguous_runs(vp.flip(0), "full")
        (1, 4)
        """
        phys = self.translate_pages(vpages, end).numpy()
        if phys.size == 0:
            return 0
        return int(1 + np.count_nonzero(phys[1:] != phys[:-1] + 1))

    # ------------------------------------------------------------------------------------------------------
    # capacity
    # ------------------------------------------------------------------------------------------------------
    def available_pages(self, end: str) -> int:
        """Pages ``end`` can allocate now: its holes plus the gap it can reach between its neighbours' byte
        frontiers. Pending (leased, freed) pages are not counted. Ends sharing a gap each count all of it, so use
        :meth:`can_alloc` for several ends at once. O(ends).

        >>> alloc = _doctest_allocator()
        >>> alloc.available_pages("full"), alloc.available_tokens("swa")
        (9, 18)
        """
        e = self._end_index(end)
        if self._active_leases:
            self._tick()
        return int(self._meta[e, _HOLES]) + int(_reach(self._meta, self._h64, e))

    def available_tokens(self, end: str) -> int:
        """:meth:`available_pages` times ``page_size``."""
        return self.available_pages(end) * int(self._meta[self._end_index(end), _PS])

    def can_alloc(self, num_pages_by_end: Mapping[str, int]) -> bool:
        """True if every named end can take its page count *at the same time* (the joint plan over the shared
        gaps, exactly as an allocation would place them). O(ends).

        >>> alloc = _doctest_allocator()
        >>> alloc.can_alloc({"full": 5, "swa": 4}), alloc.can_alloc({"full": 5, "swa": 5})
        (True, False)
        """
        return not self.shortfall_pages(num_pages_by_end)

    def shortfall_pages(self, num_pages_by_end: Mapping[str, int]) -> dict[str, int]:
        """Per end, the pages it would lack if every named end allocated its count now (ends that fit are
        omitted; an empty dict means everything fits). Each end is driven by its own deficit (F20). O(ends).

        >>> _doctest_allocator().shortfall_pages({"full": 6, "swa": 6})
        {'swa': 3}
        """
        if not isinstance(num_pages_by_end, Mapping):
            raise UmallocValueError(f"num_pages_by_end={num_pages_by_end!r}: allowed a mapping end -> pages")
        if self._active_leases:
            self._tick()
        E = len(self._names)
        need = np.zeros(E, np.int64)
        for name, k in num_pages_by_end.items():
            e = self._end_index(name)
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
                raise UmallocValueError(f"num_pages_by_end[{name!r}]={k!r}: allowed an int >= 0")
            need[e] = max(0, int(k) - int(self._meta[e, _HOLES]))
        nlo, nhi, deficit = np.empty(E, np.int64), np.empty(E, np.int64), np.empty(E, np.int64)
        _plan(self._meta, self._chain, need, nlo, nhi, deficit)
        return {self._names[e]: int(deficit[e]) for e in range(E) if deficit[e] > 0}

    # ------------------------------------------------------------------------------------------------------
    # compaction and retraction (issue 5: umalloc.core.compaction, umalloc.core.retraction)
    # ------------------------------------------------------------------------------------------------------
    def compact(self, end: str | None = None, *, budget_pages: int | None = None) -> CompactionReport:
        """Compact ``end`` (default: every end, in chain order): move the live pages at the far edge of its band
        into its holes nearest the anchor (:mod:`umalloc.core.compaction`'s survivor walk), one batched envelope copy
        per end, then retreat the band past trailing holes. Virtual ids never change; pinned and pending pages
        are walls (never moved, never written, never retreated past). A float end compacts toward its low edge.

        Args:
            end: an end name, or ``None`` for all.
            budget_pages: most pages moved per end (``None``: unlimited; 0: only retreat).

        Returns:
            :class:`~umalloc.core.compaction.CompactionReport` summed over the ends.

        Raises:
            UmallocValueError: unknown end or a bad budget.

        Complexity: O(band) planning + O(moved pages * page_bytes) bytes per end.

        >>> alloc = _doctest_allocator()
        >>> vp = alloc.alloc_pages(3)                       # full 1 2 3
        >>> alloc.free(vp[:1] * 2)                          # page 1 becomes a hole
        >>> r = alloc.compact("full"); r.pages_moved, alloc.translate_pages(vp[1:], "full").tolist()
        (1, [2, 1])
        """
        if budget_pages is not None and (isinstance(budget_pages, bool) or not isinstance(budget_pages, int)
                                         or budget_pages < 0):
            raise UmallocValueError(f"budget_pages={budget_pages!r}: allowed None or an int >= 0")
        if self._active_leases:
            self._tick()
        ends = [self._end_index(end)] if end is not None else self._chain.tolist()
        report = CompactionReport()
        for e in ends:
            plan = self._plan_end(e, budget_pages, "high")
            if plan.num_moves or plan.retreated_pages:
                report = report + self._apply_plan(e, plan)
            else:
                report = report + CompactionReport.from_plan(self._names[e], plan, int(self._meta[e, _PB]))
        if self.debug_checks:
            self.check_invariants()
        return report

    def retract(self, vtokens: torch.Tensor, *, owner: str | None = None) -> Any:
        """Copy a request's pages of every end (owner and every bound end) to host memory, then free them;
        see :func:`umalloc.core.retraction.retract` (returns a ``RetractedKV``)."""
        from umalloc.core.retraction import retract

        return retract(self, vtokens, owner=owner)

    def restore(self, retracted: Any) -> torch.Tensor | None:
        """Re-allocate a retracted request (virtual ids re-minted) and write its bytes back; ``None`` (nothing
        changed) if an end lacks space. See :func:`umalloc.core.retraction.restore`."""
        from umalloc.core.retraction import restore

        return restore(self, retracted)

    # ------------------------------------------------------------------------------------------------------
    # leases
    # ------------------------------------------------------------------------------------------------------
    def lease(self, pages: Mapping[str, torch.Tensor], *, deadline_s: float | None = None, tag: str = "") -> Lease:
        """Pin *physical* pages of any ends (Note [Leases and compaction] in :mod:`umalloc.core.leases`): they are not
        moved, and if freed they stay pending (not reusable) until the lease ends.

        Args:
            pages: end name -> ``int64`` physical pages (live pages of that end).
            deadline_s: seconds until the next allocator call reclaims the lease; ``None``: until released.
            tag: label for logs and ``lease_table.release_tagged``.

        Returns:
            the active :class:`~umalloc.core.leases.Lease` (context manager; ``release()`` idempotent).

        Raises:
            LeaseError: unknown end, bad pages, or a page that is not live. Nothing changes.

        >>> alloc = _doctest_allocator()
        >>> vp = alloc.alloc_pages(2)
        >>> with alloc.lease({"full": alloc.translate_pages(vp, "full")}, tag="xfer") as lease:
        ...     alloc.free(vp * 2); alloc.stats()["full"].pending_pages
        2
        >>> alloc.stats()["full"].pending_pages, alloc.available_pages("full")
        (0, 9)
        """
        if self._active_leases:
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
        """The :class:`~umalloc.core.leases.LeaseTable` holding this arena's pins."""
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
        _k_unpend(self._meta, self._h64, self._h8, e, np.ascontiguousarray(pages, dtype=np.int64))

    # ------------------------------------------------------------------------------------------------------
    # observability
    # ------------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, EndStats]:
        """Fixed-schema :class:`EndStats` per end name. O(ends + active leases).

        >>> alloc = _doctest_allocator()
        >>> _ = alloc.alloc_pages(3)
        >>> s = alloc.stats()["swa"]
        >>> s.live_pages, s.live_bytes, s.band_lo, s.watermark, s.free_pages
        (3, 96, 7, 6, 3)
        """
        if self._active_leases:
            self._tick()
        leases_by_end = [0] * len(self._names)
        for lease in self._leases.active():
            for name, arr in lease.pages.items():
                if arr.size:
                    leases_by_end[self._index[name]] += 1
        out = {}
        for i, name in enumerate(self._names):
            m = self._meta[i]
            es = self.spec.ends[i]
            pb = int(m[_PB])
            live, holes, pend = int(m[_LIVE]), int(m[_HOLES]), int(m[_PENDING])
            first, top = int(m[_FIRST]), int(m[_TOP])
            slots = top + 1
            reach = int(_reach(self._meta, self._h64, i))
            lo, hi = int(m[_LO]), int(m[_HI])
            out[name] = EndStats(
                name=name, role=es.role.value, grow=es.grow.value, owner=self._names[int(m[_OWNER])],
                page_size=int(m[_PS]), page_bytes=pb, first_page=first, top_page=top, num_page_slots=slots,
                band_lo=lo, band_hi=hi, watermark=lo - 1 if es.grow is Grow.DOWN else hi,
                live_pages=live, hole_pages=holes, pending_pages=pend,
                gap_pages=slots - first - live - holes - pend, reserved_pages=first,
                reachable_gap_pages=reach, free_pages=holes + reach,
                live_bytes=live * pb, hole_bytes=holes * pb, pending_bytes=pend * pb, free_bytes=(holes + reach) * pb,
                peak_live_pages=int(m[_PEAK]), peak_live_bytes=int(m[_PEAK]) * pb,
                pages_allocated=int(m[_ALLOCS]), pages_freed=int(m[_FREES]), pages_released=int(m[_RELEASED]),
                pages_moved=int(m[_MOVES]), bytes_moved=int(m[_MOVES]) * pb,
                pinned_pages=self._leases.pins_current(name), leases_active=leases_by_end[i],
                leases_expired=self._expired_by_end[i],
            )
        return out

    def snapshot(self) -> dict[str, Any]:
        """Every page's state and every table, as copies (numpy arrays), plus bands and counters.

        Schema: ``{"ends": {name: {"state", "p2v", "v2p", "pins": arrays; "band": (lo, hi), "watermark",
        "grow", "owner", "page_bytes", "page_size", "first_page", "top_page", "counters": dict}}, "owners":
        {name: {"vstate": array (V_NEVER=0, V_LIVE=1, V_FREED=2, V_RESERVED=3), "live": int}}, "leases": [...]}``.
        Two snapshots compare equal (:func:`snapshots_equal`) iff nothing observable changed. O(slots).
        """
        ends = {}
        for i, name in enumerate(self._names):
            v = self.ends[name]
            m = self._meta[i]
            ends[name] = {
                "state": v.state.copy(), "p2v": v.p2v.copy(), "v2p": v.v2p.copy(),
                "pins": np.array(self._pins[i]), "band": (int(m[_LO]), int(m[_HI])), "watermark": v.watermark,
                "grow": v.grow.value, "owner": v.owner, "page_bytes": v.page_bytes, "page_size": v.page_size,
                "first_page": v.first_page, "top_page": v.top_page,
                "counters": {"live": int(m[_LIVE]), "holes": int(m[_HOLES]), "pending": int(m[_PENDING]),
                             "peak": int(m[_PEAK]), "allocated": int(m[_ALLOCS]), "freed": int(m[_FREES]),
                             "released": int(m[_RELEASED]), "moved": int(m[_MOVES])},
            }
        owners = {}
        for o in self._owners:
            m = self._meta[o]
            owners[self._names[o]] = {"vstate": self._h8[m[_VOFF]: m[_VOFF] + m[_NV]].copy(),
                                      "live": int(m[_VLIVE])}
        leases = [{"id": lease.id, "tag": lease.tag, "deadline": lease.deadline,
                   "pages": {k: v.copy() for k, v in lease.pages.items()}} for lease in self._leases.active()]
        return {"ends": ends, "owners": owners, "leases": leases}

    def check_invariants(self) -> None:
        """Check every invariant in O(slots + virtual pages); raise :class:`InvariantError` naming the first
        broken one:

        * ``state-codes``: reserved below ``first_page``; band pages hole/live/pending; other pages gap;
        * ``counts``: live/hole/pending counters equal the state counts (so live + holes + pending + gap +
          reserved = slots);
        * ``band-edges``: a band's moving edge is not a hole (freed frontier pages retreat the band);
        * ``hole-hint``: no hole lies before the drain hint (and no free virtual id before the minting hint);
        * ``p2v-live``: ``p2v != TOMBSTONE`` exactly on live pages; ``tables-inverse``: ``v2p[p2v[p]] == p`` on
          live pages and ``p2v[v2p[v]] == v`` on bound virtual pages (so no physical page is live twice);
        * ``sink``: virtual page 0 maps to physical page 0 on every end; page 0 is never live or handed out;
        * ``owner-live``: a bound end is bound only on virtual pages live on the owner; the owner's virtual page
          states agree with its ``v2p``;
        * ``bands-disjoint``: facing bands do not overlap in bytes and stay inside ``[floor, arena)``;
        * ``pending-pinned``: pending pages are pinned; pinned pages are live or pending;
        * ``bitmaps``: the hole and free-virtual-id bitmaps equal the page states;
        * ``device-mirror``: the CUDA mirror of every ``v2p`` equals the host master.

        >>> alloc = _doctest_allocator(); _ = alloc.alloc_pages(2); alloc.check_invariants()
        """
        for i, name in enumerate(self._names):
            self._check_end(i, name)
        prev_name, prev_hi = "floor", self.spec.floor_bytes
        for e in self._chain.tolist():
            m = self._meta[e]
            if m[_GROW] == _G_FLOAT and m[_LO] == m[_HI]:
                continue
            lo_b, hi_b = int(m[_LO] * m[_PB]), int(m[_HI] * m[_PB])
            if lo_b < prev_hi:
                raise InvariantError(f"[bands-disjoint] end {self._names[e]!r} starts at byte {lo_b}, below the "
                                     f"frontier {prev_hi} of {prev_name!r}")
            if hi_b > self.spec.arena_bytes:
                raise InvariantError(f"[bands-disjoint] end {self._names[e]!r} ends past the arena")
            prev_name, prev_hi = self._names[e], hi_b
        for o, mirror in self._mirror.items():
            if not torch.equal(mirror.cpu(), torch.from_numpy(self._host2d[o])):
                raise InvariantError(f"[device-mirror] v2p mirror of owner {self._names[o]!r} differs from host")
        self._leases.check_invariants()

    def _check_end(self, i: int, name: str) -> None:
        m = self._meta[i]
        v = self.ends[name]
        st, p2v, v2p = v.state, v.p2v, v.v2p
        first, top, lo, hi = int(m[_FIRST]), int(m[_TOP]), int(m[_LO]), int(m[_HI])
        g = int(m[_GROW])

        def bad(inv: str, msg: str) -> InvariantError:
            return InvariantError(f"[{inv}] end {name!r}: {msg}")

        if not (first <= lo <= hi <= top + 1):
            raise bad("bands-disjoint", f"band [{lo}, {hi}) outside [{first}, {top + 1}]")
        if g == _G_UP and lo != first:
            raise bad("state-codes", f"up band starts at {lo}, not first_page {first}")
        if g == _G_DOWN and hi != top + 1:
            raise bad("state-codes", f"down band ends at {hi}, not top_page + 1 = {top + 1}")
        if np.any(st[:first] != PAGE_RESERVED):
            raise bad("state-codes", "a page below first_page is not reserved")
        band = st[lo:hi]
        if np.any((band != PAGE_HOLE) & (band != PAGE_LIVE) & (band != PAGE_PENDING)):
            raise bad("state-codes", "a page inside the band is gap or reserved")
        if np.any(st[first:lo] != PAGE_GAP) or np.any(st[hi:] != PAGE_GAP):
            raise bad("state-codes", "a page outside the band is not gap")
        live = int(np.count_nonzero(band == PAGE_LIVE))
        holes = int(np.count_nonzero(band == PAGE_HOLE))
        pend = int(np.count_nonzero(band == PAGE_PENDING))
        if (live, holes, pend) != (int(m[_LIVE]), int(m[_HOLES]), int(m[_PENDING])):
            raise bad("counts", f"counters live/holes/pending = {int(m[_LIVE])}/{int(m[_HOLES])}/"
                                f"{int(m[_PENDING])}, states say {live}/{holes}/{pend}")
        if hi > lo:
            if g != _G_DOWN and st[hi - 1] == PAGE_HOLE:
                raise bad("band-edges", f"top edge page {hi - 1} is a hole")
            if g != _G_UP and st[lo] == PAGE_HOLE:
                raise bad("band-edges", f"bottom edge page {lo} is a hole")
        if holes:
            hole_idx = np.flatnonzero(st == PAGE_HOLE)
            hint = int(m[_HINT])
            if (g == _G_DOWN and hole_idx.max() > hint) or (g != _G_DOWN and hole_idx.min() < hint):
                raise bad("hole-hint", f"drain hint {hint} skips holes {hole_idx[:8].tolist()}")
        nw = (top + 64) >> 6
        hb = int(m[_HBOFF])
        if not np.array_equal(_unpack_bits(self._h64[hb: hb + nw], top + 1), st == PAGE_HOLE):
            raise bad("bitmaps", "the hole bitmap differs from the hole states")
        is_live = st == PAGE_LIVE
        if np.any((p2v != TOMBSTONE) != is_live):
            where = np.flatnonzero((p2v != TOMBSTONE) != is_live)[:8].tolist()
            raise bad("p2v-live", f"p2v set exactly where pages are not live, at {where}")
        if st[0] != PAGE_RESERVED:
            raise bad("sink", "page 0 is not reserved")
        if v2p[0] != 0:
            raise bad("sink", f"virtual page 0 maps to {int(v2p[0])}, not the sink")
        lp = np.flatnonzero(is_live)
        vp = p2v[lp]
        if vp.size and (vp.min() < 1 or vp.max() >= v2p.shape[0] or np.any(v2p[vp] != lp)):
            raise bad("tables-inverse", "v2p[p2v[p]] != p on a live page")
        bound = np.flatnonzero(v2p != TOMBSTONE)
        bound = bound[bound != 0]
        pp = v2p[bound]
        if pp.size and (pp.min() < first or pp.max() > top or np.any(p2v[pp] != bound)):
            raise bad("tables-inverse", "p2v[v2p[v]] != v on a bound virtual page")
        o = int(m[_OWNER])
        ovs = self._h8[self._meta[o, _VOFF]: self._meta[o, _VOFF] + self._meta[o, _NV]]
        if np.any(ovs[bound] != V_LIVE):
            raise bad("owner-live", f"bound on virtual pages not live on owner {self._names[o]!r}")
        if o == i:
            if ovs[0] != V_RESERVED:
                raise bad("sink", "virtual page 0 is not reserved")
            owner_live = v2p[1:] != TOMBSTONE
            if np.any(owner_live != (ovs[1:] == V_LIVE)):
                raise bad("owner-live", "virtual page states disagree with the owner's v2p")
            if int(np.count_nonzero(owner_live)) != int(m[_VLIVE]):
                raise bad("counts", "live virtual page counter is off")
            vb, nvw = int(m[_VBOFF]), (int(m[_NV]) + 63) >> 6
            if not np.array_equal(_unpack_bits(self._h64[vb: vb + nvw], int(m[_NV])),
                                  (ovs == V_NEVER) | (ovs == V_FREED)):
                raise bad("bitmaps", "the free-virtual-id bitmap differs from the virtual page states")
            free_v = np.flatnonzero(ovs[1:] != V_LIVE)
            if free_v.size and free_v.min() + 1 < int(m[_VHINT]):
                raise bad("hole-hint", "the minting hint skips a free virtual page")
        pins = self._pins[i]
        if np.any((st == PAGE_PENDING) & (pins <= 0)):
            raise bad("pending-pinned", "a pending page has no pin")
        if np.any((pins > 0) & (st != PAGE_LIVE) & (st != PAGE_PENDING)):
            raise bad("pending-pinned", "a pinned page is neither live nor pending")

    def __repr__(self) -> str:
        ends = ", ".join(repr(v) for v in self.ends.values())
        return f"MultiEndedAllocator({ends})"


def snapshots_equal(a: Any, b: Any) -> bool:
    """Deep equality of two :meth:`MultiEndedAllocator.snapshot` results (numpy arrays compared by value)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, Mapping):
        return a.keys() == b.keys() and all(snapshots_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(snapshots_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    return a == b


def _doctest_allocator(**kwargs: Any) -> MultiEndedAllocator:
    """A tiny allocator for the doctests: ``full`` (up, id owner) and ``swa`` (down, bound), both with
    ``page_size = 2`` and 32 B pages, in a 320 B arena: 10 page slots each (page 0 the sink, pages 1..9 usable)."""
    from umalloc.geometry.spec import EndSpec, LayerSpec

    full = EndSpec("full", (LayerSpec.mha(1, 4),), page_size=2)
    swa = EndSpec("swa", (LayerSpec.mha(1, 4, window_tokens=4),), page_size=2, grow=Grow.DOWN, owner="full",
                  role=EndRole.SWA)
    return MultiEndedAllocator(Arena(ArenaSpec((full, swa), arena_bytes=320)), **kwargs)


__all__ = ["COMPACTION_MODES", "V_FREED", "V_LIVE", "V_NEVER", "V_RESERVED", "EndStats", "EndView",
           "MultiEndedAllocator", "snapshots_equal"]
