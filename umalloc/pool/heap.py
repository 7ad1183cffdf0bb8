"""The heap: every host array the allocator's kernels read or write, and the root vector naming them.

Policy:

* **One owner.** A :class:`Heap` allocates ``meta``, ``h64``, ``h8``, the per-end pin counts and the root
  vector once, in its constructor, and never rebinds, resizes or frees them while it lives (its attributes
  cannot be reassigned). The kernels reach them only through the root address
  (:mod:`umalloc.pool.kernels.raw` states the rules).
* **Pins are lent.** The pin counts (``int32`` per end) belong to the heap; the
  :class:`~umalloc.leases.table.LeaseTable` receives them at construction and counts in them.
* **No copies.** ``copy.copy``, ``copy.deepcopy`` and ``pickle`` raise :class:`~umalloc.errors.HeapCopyError`:
  a copy would carry the root of another object's memory.
* **Views.** :meth:`Heap.end_tables` returns writable views for the allocator's own code (compaction writes
  through them); everything handed to callers is read-only or a copy (:mod:`umalloc.allocator.observe`).

Note [Host heaps]
~~~~~~~~~~~~~~~~~
All host masters live in two flat arrays so that a kernel call passes few arguments (numba's dispatch cost
grows with every array argument): ``h64`` (int64) = [p2v of every end | v2p of every owner group | vstamp |
chain | err | scratch | plan scratch | page scratch | hole bitmaps | free-id bitmaps] and ``h8`` (int8) =
[state of every end | vstate of every owner group | bind masks]. ``meta[e, M_POFF]`` indexes both p2v (h64) and
state (h8); ``meta[e, M_VOFF]`` indexes both v2p (h64) and the owner's vstate (h8); vstamp is at
``M_VT + M_VOFF``. The v2p rows of one owner group (the owner first, then its bound ends) are contiguous: one 2-D
block per owner (:attr:`Heap.host2d`), which the device mirror copies.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import numpy as np

from umalloc.errors import ArenaInUseError, HeapCopyError, UmallocValueError
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, Grow
from umalloc.pool.kernels.bitmap import pack_bits
from umalloc.pool.kernels.layout import (
    G_DOWN,
    G_FLOAT,
    G_UP,
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
    M_LO,
    M_MOVES,
    M_NE,
    M_NFIELDS,
    M_NV,
    M_OWNER,
    M_PB,
    M_PGOFF,
    M_POFF,
    M_PS,
    M_PSHIFT,
    M_PSOFF,
    M_SCROFF,
    M_SPLIT,
    M_TOP,
    M_VBOFF,
    M_VHINT,
    M_VLIVE,
    M_VOFF,
    M_VT,
    MASK_SLOTS,
    SPLIT_ONE,
    V_RESERVED,
)
from umalloc.pool.kernels.ops import live_roots
from umalloc.pool.kernels.placement import k_recount, k_unpend, plan_band_growth, reach_pages
from umalloc.pool.kernels.raw import build_root, root_address
from umalloc.pool.pagestate import PAGE_GAP, PAGE_RESERVED, TOMBSTONE

_GROW_CODE = {Grow.UP: G_UP, Grow.DOWN: G_DOWN, Grow.FLOAT: G_FLOAT}


class Heap:
    """The host arrays of one allocator (Note [Host heaps]) and their root (Note [Heap root] in
    :mod:`umalloc.pool.kernels.raw`).

    Args:
        spec: the arena's geometry.
        splits: per float end name, ``float_split`` in parts per million (missing: one half).

    Attributes (all fixed at construction):
        meta: ``int64 (E, M_NFIELDS)``; h64: ``int64``; h8: ``int8`` (Note [Host heaps]).
        pins: per end an ``int32 (num_page_slots,)`` pin-count array (lent to the lease table).
        root: the ``int64`` root vector; root_a: its address (what kernels take).
        names, index: end names in spec order and name -> index; owners: id-owner indices; group: owner ->
        (owner, bound ends...); host2d: owner -> the ``int64 (rows, num_vpages)`` v2p block (a view of h64).
        chain: the ends in chain order (a view of h64); err: the kernels' error record (a view);
        scratch: the scratch area (a view); mask_base: offset of the bind-mask area in ``h8``.

    Construction is O(slots); nothing else allocates. Not thread-safe (the allocator's thread owns it).
    """

    __slots__ = ("_frozen", "_mask_cache", "chain", "err", "group", "h64", "h8", "host2d", "index", "mask_base", "meta",
                 "names", "owners", "pins", "root", "root_a", "scratch", "slots", "__weakref__")

    meta: np.ndarray
    h64: np.ndarray
    h8: np.ndarray
    pins: tuple[np.ndarray, ...]
    root: np.ndarray
    root_a: int
    names: tuple[str, ...]
    index: dict[str, int]
    owners: tuple[int, ...]
    group: dict[int, tuple[int, ...]]
    host2d: dict[int, np.ndarray]
    chain: np.ndarray
    err: np.ndarray
    scratch: np.ndarray
    mask_base: int
    slots: tuple[int, ...]
    _mask_cache: dict[tuple[int, Any], int]

    def __init__(self, spec: ArenaSpec, splits: Mapping[str, int]) -> None:
        ends = spec.ends
        E = len(ends)
        names = tuple(e.name for e in ends)
        index = {n: i for i, n in enumerate(names)}
        slots = [spec.num_page_slots(e.name) for e in ends]
        poff = [0]
        for n in slots:
            poff.append(poff[-1] + n)
        PT = poff[-1]
        owners = [i for i, e in enumerate(ends) if e.is_owner]
        group = {o: (o, *[i for i, e in enumerate(ends) if e.owner == ends[o].name]) for o in owners}
        voff = [0] * E
        nv = [0] * E
        cursor = PT
        group_off: dict[int, tuple[int, int]] = {}
        for o in owners:
            n_o = slots[o]
            group_off[o] = (cursor, len(group[o]))
            for row, b in enumerate(group[o]):
                voff[b] = cursor + row * n_o
                nv[b] = n_o
            cursor += len(group[o]) * n_o
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
        h8 = np.zeros(MASK + MASK_SLOTS * E, np.int8)
        h8[:PT] = PAGE_GAP
        meta = np.zeros((E, M_NFIELDS), np.int64)
        for i, e in enumerate(ends):
            first, top = spec.first_page(e.name), spec.top_page(e.name)
            m = meta[i]
            m[M_FIRST], m[M_TOP], m[M_PB], m[M_PS] = first, top, e.page_bytes, e.page_size
            m[M_GROW] = _GROW_CODE[e.grow]
            m[M_POFF], m[M_VOFF], m[M_NV] = poff[i], voff[i], nv[i]
            m[M_OWNER] = index[spec.owner_of(e.name)]
            m[M_SPLIT] = splits.get(e.name, SPLIT_ONE // 2)
            m[M_FLOORB], m[M_ARENAB] = spec.floor_bytes, spec.arena_bytes
            m[M_VT], m[M_CHOFF], m[M_ERROFF], m[M_SCROFF], m[M_NE] = VT, CH, ERR, SCR, E
            m[M_HBOFF], m[M_VBOFF] = hboff[i], vboff[i]
            m[M_PSOFF], m[M_PGOFF] = PS, PG
            m[M_PSHIFT] = e.page_size.bit_length() - 1 if e.page_size & (e.page_size - 1) == 0 else -1
            if e.grow is Grow.DOWN:
                m[M_LO] = m[M_HI] = top + 1
                m[M_HINT] = top
            else:
                m[M_LO] = m[M_HI] = first
                m[M_HINT] = first
            h8[poff[i]: poff[i] + first] = PAGE_RESERVED
            h64[voff[i]] = 0  # virtual page 0 -> the sink on every end
        for o in owners:
            h8[voff[o]] = V_RESERVED  # virtual page 0 is never minted
            meta[o, M_VHINT] = 1
            free_ids = np.zeros(((slots[o] + 63) >> 6) * 64, bool)
            free_ids[1: slots[o]] = True
            h64[vboff[o]: vboff[o] + ((slots[o] + 63) >> 6)] = pack_bits(free_ids)
        up = [i for i, e in enumerate(ends) if e.grow is Grow.UP]
        fl = [i for i, e in enumerate(ends) if e.grow is Grow.FLOAT]
        dn = [i for i, e in enumerate(ends) if e.grow is Grow.DOWN]
        h64[CH: CH + E] = up + fl + dn
        pins = tuple(np.zeros(n, np.int32) for n in slots)
        root = build_root(meta, h64, h8, pins)
        host2d = {}
        for o in owners:
            start, rows = group_off[o]
            host2d[o] = h64[start: start + rows * slots[o]].reshape(rows, slots[o])
        init = object.__setattr__
        for k, v in (("meta", meta), ("h64", h64), ("h8", h8), ("pins", pins), ("root", root),
                     ("root_a", root_address(root)), ("names", names), ("index", index),
                     ("owners", tuple(owners)), ("group", group), ("host2d", host2d), ("chain", h64[CH: CH + E]),
                     ("err", h64[ERR: SCR]), ("scratch", h64[SCR:]), ("mask_base", MASK), ("slots", tuple(slots)),
                     ("_mask_cache", {}), ("_frozen", True)):
            init(self, k, v)
        live_roots[self.root_a] = E

    def __del__(self) -> None:
        root_a = getattr(self, "root_a", None)
        if root_a is not None and live_roots.get(root_a) is not None:
            del live_roots[root_a]

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise HeapCopyError(f"Heap.{name}: a heap's arrays are fixed at construction (the kernels hold their "
                            f"addresses); allowed: write into them, never rebind them")

    def __delattr__(self, name: str) -> NoReturn:
        self.__setattr__(name, None)

    def _refuse(self, *_: Any) -> NoReturn:
        raise HeapCopyError("a Heap (and the allocator owning it) cannot be copied, deep-copied or pickled: it "
                            "owns raw addresses; allowed: build a new allocator on a new Arena")

    __copy__ = _refuse
    __deepcopy__ = _refuse
    __reduce_ex__ = _refuse
    __reduce__ = _refuse
    __getstate__ = _refuse

    def bind_mask(self, o: int, bind: Iterable[str] | None, *, only: int = -1) -> int:
        """Offset in ``h8`` of the bind mask of owner ``o``: the owner plus ``bind`` (end names; None: all bound
        ends; any iterable, read once); ``only >= 0``: that end alone. Masks are cached (``MASK_SLOTS`` slots in
        ``h8``; the default owner's full mask keeps slot 0). Raises UmallocValueError for a str, a non-iterable,
        non-str names or an end that is not bound to ``o``. O(1) on a hit, O(E) on a miss."""
        if bind is not None and only < 0:
            if isinstance(bind, (str, bytes)) or not isinstance(bind, Iterable):
                raise UmallocValueError(f"bind={bind!r}: allowed a sequence of end names (not a str) or None")
            bind = tuple(bind)  # an iterator is read once, here: the cache key and the mask see the same names
            if not all(isinstance(name, str) for name in bind):
                raise UmallocValueError(f"bind={bind!r}: allowed end names (str)")
        key: tuple[int, Any] = (o, ("#only", only) if only >= 0 else bind)
        off = self._mask_cache.get(key)
        if off is not None:
            return off
        E = len(self.names)
        mask = np.zeros(E, np.int8)
        if only >= 0:
            mask[only] = 1
        else:
            group = self.group[o]
            mask[o] = 1
            if bind is None:
                mask[list(group)] = 1
            else:
                for name in bind:
                    b = self.index.get(name, -1)
                    if b == o or b not in group:
                        raise UmallocValueError(f"bind names {name!r}: allowed the bound ends of "
                                                f"{self.names[o]!r}: {[self.names[i] for i in group[1:]]}")
                    mask[b] = 1
        default = self.owners[0] if len(self.owners) == 1 else -1
        slot = len(self._mask_cache)
        if slot >= MASK_SLOTS:  # an unusual number of distinct bind sets: recycle the cache
            self._mask_cache.clear()
            slot = 0
            if default >= 0:
                self._mask_cache[(default, None)] = self.mask_base
                slot = 1
                self.h8[self.mask_base: self.mask_base + E] = 0
                self.h8[self.mask_base + np.array(self.group[default])] = 1
        off = self.mask_base + slot * E
        self.h8[off: off + E] = mask
        self._mask_cache[key] = off
        return off

    def end_tables(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Writable ``(p2v, state, v2p)`` views of end ``e`` (the allocator's own code only). O(1)."""
        m = self.meta[e]
        poff, voff, nv, n = int(m[M_POFF]), int(m[M_VOFF]), int(m[M_NV]), int(m[M_TOP]) + 1
        return self.h64[poff: poff + n], self.h8[poff: poff + n], self.h64[voff: voff + nv]

    def vstate(self, o: int) -> np.ndarray:
        """Writable ``int8 (num_vpages,)`` virtual page states of owner ``o``. O(1)."""
        voff, nv = int(self.meta[o, M_VOFF]), int(self.meta[o, M_NV])
        return self.h8[voff: voff + nv]

    def owner_of(self, e: int) -> int:
        """Index of end ``e``'s id owner."""
        return int(self.meta[e, M_OWNER])

    # ---- typed accessors: the column layout of ``meta`` stays inside the pool -----------------------------
    def page_size(self, e: int) -> int:
        """Tokens per page of end ``e``. O(1)."""
        return int(self.meta[e, M_PS])

    def page_bytes(self, e: int) -> int:
        """Bytes per page of end ``e``. O(1)."""
        return int(self.meta[e, M_PB])

    def first_page(self, e: int) -> int:
        """Lowest page of end ``e`` above the reserved floor. O(1)."""
        return int(self.meta[e, M_FIRST])

    def num_vpages(self, o: int) -> int:
        """Size of owner ``o``'s virtual page id space (id 0 reserved). O(1)."""
        return int(self.meta[o, M_NV])

    def live_vpages(self, o: int) -> int:
        """Live virtual pages of owner ``o``. O(1)."""
        return int(self.meta[o, M_VLIVE])

    def band(self, e: int) -> tuple[int, int]:
        """The band ``[lo, hi)`` of end ``e`` in its physical pages. O(1)."""
        return int(self.meta[e, M_LO]), int(self.meta[e, M_HI])

    def hole_pages(self, e: int) -> int:
        """Holes inside end ``e``'s band. O(1)."""
        return int(self.meta[e, M_HOLES])

    def free_pages(self, e: int) -> int:
        """Pages end ``e`` can take now: its holes plus the gap it can reach. O(chain)."""
        return int(self.meta[e, M_HOLES]) + int(reach_pages(self.meta, self.h64, e))

    def plan_bands(self, need: np.ndarray, new_lo: np.ndarray, new_hi: np.ndarray, deficit: np.ndarray) -> None:
        """Plan every end's band for ``need`` fresh pages per end (``int64 (E,)``): writes the bands it would
        take into ``new_lo``/``new_hi`` and each end's shortfall into ``deficit`` (all ``int64 (E,)``); changes
        nothing in the heap. O(E)."""
        plan_band_growth(self.meta, self.chain, need, new_lo, new_hi, deficit)

    def set_band(self, e: int, lo: int, hi: int) -> None:
        """Set end ``e``'s band to ``[lo, hi)`` (the caller moved the pages: compaction, the float slide)."""
        self.meta[e, M_LO], self.meta[e, M_HI] = lo, hi

    def after_moves(self, e: int, lo: int, hi: int, num_moves: int) -> None:
        """After compaction moved ``num_moves`` pages of end ``e`` and its band became ``[lo, hi)``: set the
        band, recount holes/gap and the hole bitmap, count the moves. O(band)."""
        self.meta[e, M_LO], self.meta[e, M_HI] = lo, hi
        k_recount(self.meta, self.h64, self.h8, e)
        self.meta[e, M_MOVES] += num_moves

    def unpend(self, e: int, pages: np.ndarray) -> None:
        """Pending pages of end ``e`` whose last pin dropped become holes (or gap at a band edge). O(pages)."""
        k_unpend(self.meta, self.h64, self.h8, e, np.ascontiguousarray(pages, dtype=np.int64))

    def save(self) -> HeapSave:
        """A copy of every table the kernels write (``meta``, ``h64``, the page and virtual-page states of
        ``h8``; not the bind masks, which are a cache keyed by their arguments, nor the pins, which the lease
        table owns): what :meth:`restore` writes back. O(slots + virtual pages).

        >>> from umalloc.testing import tiny_spec
        >>> heap = Heap(tiny_spec(), {})
        >>> saved = heap.save(); heap.set_band(0, 1, 4); heap.band(0)
        (1, 4)
        >>> heap.restore(saved); heap.band(0)
        (1, 1)
        """
        mb = self.mask_base
        return HeapSave(self, self.meta.copy(), self.h64.copy(), self.h8[:mb].copy())

    def restore(self, saved: HeapSave) -> None:
        """Write ``saved`` (this heap's :meth:`save`) back into the arrays in place (their addresses, which the
        kernels hold, stay). O(slots + virtual pages).

        Raises:
            UmallocValueError: ``saved`` is not a save of this heap (nothing changes).
        """
        if not isinstance(saved, HeapSave) or saved.heap is not self:
            raise UmallocValueError(f"Heap.restore: {saved!r} is not a save of this heap; allowed: what this "
                                    f"heap's save() returned")
        self.meta[:] = saved.meta
        self.h64[:] = saved.h64
        self.h8[: self.mask_base] = saved.h8


class HeapSave:
    """What :meth:`Heap.save` copied: the heap it came from and copies of its ``meta``, ``h64`` and the state
    part of ``h8`` (read by :meth:`Heap.restore` only)."""

    __slots__ = ("h64", "h8", "heap", "meta")

    def __init__(self, heap: Heap, meta: np.ndarray, h64: np.ndarray, h8: np.ndarray) -> None:
        self.heap, self.meta, self.h64, self.h8 = heap, meta, h64, h8


# one allocator per arena (two would hand out the same pages): id(arena) -> (weakref to the arena, to its allocator)
_arena_claims: dict[int, tuple[weakref.ref[Arena], weakref.ref[object]]] = {}


def claim_arena(arena: Arena, alloc: object) -> None:
    """Record ``alloc`` as ``arena``'s allocator, or raise :class:`ArenaInUseError` if a live one is. O(1)."""
    held = _arena_claims.get(id(arena))
    if held is not None and held[0]() is arena and held[1]() is not None:
        raise ArenaInUseError(f"arena {arena!r} already has a live MultiEndedAllocator; allowed one allocator per "
                              f"arena (two would hand out the same pages): build a new Arena")
    key = id(arena)

    def drop(_: object, key: int = key) -> None:
        cur = _arena_claims.get(key)
        if cur is not None and (cur[1]() is None or cur[0]() is None):
            del _arena_claims[key]

    _arena_claims[key] = (weakref.ref(arena, drop), weakref.ref(alloc, drop))


__all__ = ["Heap", "HeapSave", "claim_arena"]
