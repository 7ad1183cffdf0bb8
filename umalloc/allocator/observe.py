"""Observability of the allocator core: the stats schema, read-only end views, snapshot equality, invariants.

* :class:`EndStats` is the fixed schema :meth:`MultiEndedAllocator.stats` returns per end.
* :class:`EndView` exposes one end's tables as *read-only* numpy views of the heap (writes raise
  ``ValueError: assignment destination is read-only``); the allocator's own code writes through the heap.
* :func:`snapshots_equal` compares two snapshots; :func:`check_invariants` checks every invariant of a heap
  and names the first broken one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from umalloc.errors import InvariantError
from umalloc.geometry.spec import ArenaSpec, Grow
from umalloc.leases.table import LeaseTable
from umalloc.pool.heap import Heap
from umalloc.pool.kernels.bitmap import _unpack_bits
from umalloc.pool.kernels.layout import (
    _ALLOCS,
    _FIRST,
    _FREES,
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
    _MOVES,
    _NV,
    _OWNER,
    _PB,
    _PEAK,
    _PENDING,
    _PS,
    _RELEASED,
    _TOP,
    _VBOFF,
    _VHINT,
    _VLIVE,
    _VOFF,
    V_FREED,
    V_LIVE,
    V_NEVER,
    V_RESERVED,
)
from umalloc.pool.kernels.placement import _reach
from umalloc.pool.pagestate import PAGE_GAP, PAGE_HOLE, PAGE_LIVE, PAGE_PENDING, PAGE_RESERVED, TOMBSTONE


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (``a`` itself stays writable)."""
    v = a.view()
    v.setflags(write=False)
    return v


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
        in_doubt_pages: pages of this end pinned by in-doubt leases (F24: an engine may still touch them; they
            are counted in ``pinned_pages`` too, never as free or leaked); leases_in_doubt: in-doubt leases
            naming this end.
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
    in_doubt_pages: int = 0
    leases_in_doubt: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)



class EndView:
    """The agreed representation of one end, for engines and tests: read-only views into the allocator's host
    masters (numpy refuses writes through them; mutate only through the allocator).

    Attributes:
        name, index, spec, owner (id-owner end name), grow (:class:`~umalloc.geometry.spec.Grow`), page_size, page_bytes,
        first_page, top_page, num_page_slots.
        p2v: ``int64`` ``(num_page_slots,)``: virtual page bound to each physical page, TOMBSTONE if none.
        state: ``int8`` ``(num_page_slots,)``: :mod:`umalloc.pool.pagestate` codes.
        v2p: ``int64`` ``(num_vpages(owner),)``: physical page of each of the owner's virtual pages.
    """

    __slots__ = ("_meta", "first_page", "grow", "index", "name", "num_page_slots", "owner", "p2v",
                 "page_bytes", "page_size", "spec", "state", "top_page", "v2p")

    def __init__(self, heap: Heap, spec: ArenaSpec, index: int) -> None:
        es = spec.ends[index]
        self._meta = heap.meta
        self.index = index
        self.name = es.name
        self.spec = es
        self.owner = spec.owner_of(es.name)
        self.grow = es.grow
        self.page_size = es.page_size
        self.page_bytes = es.page_bytes
        self.first_page = spec.first_page(es.name)
        self.top_page = spec.top_page(es.name)
        self.num_page_slots = self.top_page + 1
        self.p2v, self.state, self.v2p = (_read_only(a) for a in heap.end_tables(index))

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



def check_invariants(heap: Heap, spec: ArenaSpec, views: Mapping[str, EndView],
                 mirrors: Mapping[int, torch.Tensor], leases: LeaseTable) -> None:
    """Check every invariant of one allocator's heap (the facade's ``check_invariants``) in O(slots + virtual pages); raise :class:`InvariantError` naming the first
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

    """
    for i, name in enumerate(heap.names):
        _check_end(heap, views, i, name)
    prev_name, prev_hi = "floor", spec.floor_bytes
    for e in heap.chain.tolist():
        m = heap.meta[e]
        if m[_GROW] == _G_FLOAT and m[_LO] == m[_HI]:
            continue
        lo_b, hi_b = int(m[_LO] * m[_PB]), int(m[_HI] * m[_PB])
        if lo_b < prev_hi:
            raise InvariantError(f"[bands-disjoint] end {heap.names[e]!r} starts at byte {lo_b}, below the "
                                 f"frontier {prev_hi} of {prev_name!r}")
        if hi_b > spec.arena_bytes:
            raise InvariantError(f"[bands-disjoint] end {heap.names[e]!r} ends past the arena")
        prev_name, prev_hi = heap.names[e], hi_b
    for o, mirror in mirrors.items():
        if not torch.equal(mirror.cpu(), torch.from_numpy(heap.host2d[o])):
            raise InvariantError(f"[device-mirror] v2p mirror of owner {heap.names[o]!r} differs from host")
    leases.check_invariants()

def _check_end(heap: Heap, views: Mapping[str, EndView], i: int, name: str) -> None:
    m = heap.meta[i]
    v = views[name]
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
    if not np.array_equal(_unpack_bits(heap.h64[hb: hb + nw], top + 1), st == PAGE_HOLE):
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
    ovs = heap.h8[heap.meta[o, _VOFF]: heap.meta[o, _VOFF] + heap.meta[o, _NV]]
    if np.any(ovs[bound] != V_LIVE):
        raise bad("owner-live", f"bound on virtual pages not live on owner {heap.names[o]!r}")
    if o == i:
        if ovs[0] != V_RESERVED:
            raise bad("sink", "virtual page 0 is not reserved")
        owner_live = v2p[1:] != TOMBSTONE
        if np.any(owner_live != (ovs[1:] == V_LIVE)):
            raise bad("owner-live", "virtual page states disagree with the owner's v2p")
        if int(np.count_nonzero(owner_live)) != int(m[_VLIVE]):
            raise bad("counts", "live virtual page counter is off")
        vb, nvw = int(m[_VBOFF]), (int(m[_NV]) + 63) >> 6
        if not np.array_equal(_unpack_bits(heap.h64[vb: vb + nvw], int(m[_NV])),
                              (ovs == V_NEVER) | (ovs == V_FREED)):
            raise bad("bitmaps", "the free-virtual-id bitmap differs from the virtual page states")
        free_v = np.flatnonzero(ovs[1:] != V_LIVE)
        if free_v.size and free_v.min() + 1 < int(m[_VHINT]):
            raise bad("hole-hint", "the minting hint skips a free virtual page")
    pins = heap.pins[i]
    if np.any((st == PAGE_PENDING) & (pins <= 0)):
        raise bad("pending-pinned", "a pending page has no pin")
    if np.any((pins > 0) & (st != PAGE_LIVE) & (st != PAGE_PENDING)):
        raise bad("pending-pinned", "a pinned page is neither live nor pending")


def end_stats(heap: Heap, spec: ArenaSpec, leases: LeaseTable, expired_by_end: Sequence[int]) -> dict[str, EndStats]:
    """The :class:`EndStats` of every end (``MultiEndedAllocator.stats``). O(ends + active leases)."""
    leases_by_end = [0] * len(heap.names)
    for lease in leases.active():
        for name, arr in lease.pages.items():
            if arr.size:
                leases_by_end[heap.index[name]] += 1
    doubt_by_end = [0] * len(heap.names)
    for lease in leases.in_doubt():
        for name, arr in lease.pages.items():
            if arr.size:
                doubt_by_end[heap.index[name]] += 1
    out = {}
    for i, name in enumerate(heap.names):
        m = heap.meta[i]
        es = spec.ends[i]
        pb = int(m[_PB])
        live, holes, pend = int(m[_LIVE]), int(m[_HOLES]), int(m[_PENDING])
        first, top = int(m[_FIRST]), int(m[_TOP])
        slots = top + 1
        reach = int(_reach(heap.meta, heap.h64, i))
        lo, hi = int(m[_LO]), int(m[_HI])
        out[name] = EndStats(
            name=name, role=es.role.value, grow=es.grow.value, owner=heap.names[int(m[_OWNER])],
            page_size=int(m[_PS]), page_bytes=pb, first_page=first, top_page=top, num_page_slots=slots,
            band_lo=lo, band_hi=hi, watermark=lo - 1 if es.grow is Grow.DOWN else hi,
            live_pages=live, hole_pages=holes, pending_pages=pend,
            gap_pages=slots - first - live - holes - pend, reserved_pages=first,
            reachable_gap_pages=reach, free_pages=holes + reach,
            live_bytes=live * pb, hole_bytes=holes * pb, pending_bytes=pend * pb, free_bytes=(holes + reach) * pb,
            peak_live_pages=int(m[_PEAK]), peak_live_bytes=int(m[_PEAK]) * pb,
            pages_allocated=int(m[_ALLOCS]), pages_freed=int(m[_FREES]), pages_released=int(m[_RELEASED]),
            pages_moved=int(m[_MOVES]), bytes_moved=int(m[_MOVES]) * pb,
            pinned_pages=leases.pins_current(name), leases_active=leases_by_end[i],
            leases_expired=expired_by_end[i], in_doubt_pages=leases.in_doubt_pages(name),
            leases_in_doubt=doubt_by_end[i],
        )
    return out


def snapshot(heap: Heap, views: Mapping[str, EndView], leases: LeaseTable) -> dict[str, Any]:
    """Every page's state and every table as copies (``MultiEndedAllocator.snapshot`` states the schema)."""
    ends = {}
    for i, name in enumerate(heap.names):
        v = views[name]
        m = heap.meta[i]
        ends[name] = {
            "state": v.state.copy(), "p2v": v.p2v.copy(), "v2p": v.v2p.copy(),
            "pins": np.array(heap.pins[i]), "band": (int(m[_LO]), int(m[_HI])), "watermark": v.watermark,
            "grow": v.grow.value, "owner": v.owner, "page_bytes": v.page_bytes, "page_size": v.page_size,
            "first_page": v.first_page, "top_page": v.top_page,
            "counters": {"live": int(m[_LIVE]), "holes": int(m[_HOLES]), "pending": int(m[_PENDING]),
                         "peak": int(m[_PEAK]), "allocated": int(m[_ALLOCS]), "freed": int(m[_FREES]),
                         "released": int(m[_RELEASED]), "moved": int(m[_MOVES])},
        }
    owners = {}
    for o in heap.owners:
        m = heap.meta[o]
        owners[heap.names[o]] = {"vstate": heap.h8[m[_VOFF]: m[_VOFF] + m[_NV]].copy(),
                                  "live": int(m[_VLIVE])}
    held = [{"id": lease.id, "tag": lease.tag, "deadline": lease.deadline, "state": lease.state,
             "generation": lease.generation, "pages": {k: v.copy() for k, v in lease.pages.items()}}
            for lease in (*leases.active(), *leases.in_doubt())]
    return {"ends": ends, "owners": owners, "leases": held}


__all__ = ["EndStats", "EndView", "check_invariants", "end_stats", "snapshot", "snapshots_equal"]
