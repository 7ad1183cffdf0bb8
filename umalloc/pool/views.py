"""Typed, read-only views of the pool's ends and the invariants of its host arrays.

* :class:`EndView` exposes one end's tables as *read-only* numpy views of the heap (writes raise
  ``ValueError: assignment destination is read-only``) and its band, watermark and counters as properties, so
  no code outside the pool reads ``meta``'s columns.
* :func:`check_heap` checks every invariant of a heap and names the first broken one.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from umalloc.errors import InvariantError
from umalloc.geometry.spec import ArenaSpec, Grow
from umalloc.pool.heap import Heap
from umalloc.pool.kernels.bitmap import unpack_bits
from umalloc.pool.kernels.layout import (
    G_DOWN,
    G_FLOAT,
    G_UP,
    M_ALLOCS,
    M_FIRST,
    M_FREES,
    M_GROW,
    M_HBOFF,
    M_HI,
    M_HINT,
    M_HOLES,
    M_LIVE,
    M_LO,
    M_MOVES,
    M_NV,
    M_OWNER,
    M_PB,
    M_PEAK,
    M_PENDING,
    M_TOP,
    M_UNBOUND,
    M_VBOFF,
    M_VHINT,
    M_VLIVE,
    M_VOFF,
    V_FREED,
    V_LIVE,
    V_NEVER,
    V_RESERVED,
)
from umalloc.pool.kernels.placement import reach_pages
from umalloc.pool.pagestate import PAGE_GAP, PAGE_HOLE, PAGE_LIVE, PAGE_PENDING, PAGE_RESERVED, TOMBSTONE


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (``a`` itself stays writable)."""
    v = a.view()
    v.setflags(write=False)
    return v


class EndView:
    """The agreed representation of one end, for engines and tests: read-only views into the pool's host
    masters (numpy refuses writes through them; mutate only through the allocator).

    Attributes:
        name, index, spec, owner (id-owner end name), grow (:class:`~umalloc.geometry.spec.Grow`), page_size, page_bytes,
        first_page, top_page, num_page_slots.
        p2v: ``int64`` ``(num_page_slots,)``: virtual page bound to each physical page, TOMBSTONE if none.
        state: ``int8`` ``(num_page_slots,)``: :mod:`umalloc.pool.pagestate` codes.
        v2p: ``int64`` ``(num_vpages(owner),)``: physical page of each of the owner's virtual pages.
    """

    __slots__ = ("_h64", "_meta", "first_page", "grow", "index", "name", "num_page_slots", "owner", "p2v",
                 "page_bytes", "page_size", "spec", "state", "top_page", "v2p")

    def __init__(self, heap: Heap, spec: ArenaSpec, index: int) -> None:
        es = spec.ends[index]
        self._meta = heap.meta
        self._h64 = heap.h64
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
        return int(self._meta[self.index, M_LO])

    @property
    def hi(self) -> int:
        """One past the last page of the band."""
        return int(self._meta[self.index, M_HI])

    @property
    def watermark(self) -> int:
        """``hi`` for an up (or float) end: band ``[first_page, watermark)``; ``lo - 1`` for a down end: band
        ``(watermark, top_page]``."""
        return self.lo - 1 if self.grow is Grow.DOWN else self.hi

    @property
    def live_pages(self) -> int:
        return int(self._meta[self.index, M_LIVE])

    @property
    def hole_pages(self) -> int:
        return int(self._meta[self.index, M_HOLES])

    @property
    def pending_pages(self) -> int:
        return int(self._meta[self.index, M_PENDING])

    @property
    def peak_live_pages(self) -> int:
        return int(self._meta[self.index, M_PEAK])

    @property
    def pages_allocated(self) -> int:
        return int(self._meta[self.index, M_ALLOCS])

    @property
    def pages_freed(self) -> int:
        return int(self._meta[self.index, M_FREES])

    @property
    def pages_unbound(self) -> int:
        return int(self._meta[self.index, M_UNBOUND])

    @property
    def pages_moved(self) -> int:
        return int(self._meta[self.index, M_MOVES])

    @property
    def reachable_gap_pages(self) -> int:
        """Gap pages this end can grow into now, between its neighbours' byte frontiers. O(chain)."""
        return int(reach_pages(self._meta, self._h64, self.index))

    def __repr__(self) -> str:
        return (f"EndView({self.name!r}, grow={self.grow.value}, band=[{self.lo}, {self.hi}), "
                f"live={self.live_pages}, holes={self.hole_pages}, pending={self.pending_pages})")


def check_heap(heap: Heap, spec: ArenaSpec, views: Mapping[str, EndView],
               mirrors: Mapping[int, torch.Tensor]) -> None:
    """Check every invariant of one heap in O(slots + virtual pages); raise :class:`InvariantError` naming the
    first broken one:

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
        if m[M_GROW] == G_FLOAT and m[M_LO] == m[M_HI]:
            continue
        lo_b, hi_b = int(m[M_LO] * m[M_PB]), int(m[M_HI] * m[M_PB])
        if lo_b < prev_hi:
            raise InvariantError(f"[bands-disjoint] end {heap.names[e]!r} starts at byte {lo_b}, below the "
                                 f"frontier {prev_hi} of {prev_name!r}")
        if hi_b > spec.arena_bytes:
            raise InvariantError(f"[bands-disjoint] end {heap.names[e]!r} ends past the arena")
        prev_name, prev_hi = heap.names[e], hi_b
    for o, mirror in mirrors.items():
        if not torch.equal(mirror.cpu(), torch.from_numpy(heap.host2d[o])):
            raise InvariantError(f"[device-mirror] v2p mirror of owner {heap.names[o]!r} differs from host")

def _check_end(heap: Heap, views: Mapping[str, EndView], i: int, name: str) -> None:
    m = heap.meta[i]
    v = views[name]
    st, p2v, v2p = v.state, v.p2v, v.v2p
    first, top, lo, hi = int(m[M_FIRST]), int(m[M_TOP]), int(m[M_LO]), int(m[M_HI])
    g = int(m[M_GROW])

    def bad(inv: str, msg: str) -> InvariantError:
        return InvariantError(f"[{inv}] end {name!r}: {msg}")

    if not (first <= lo <= hi <= top + 1):
        raise bad("bands-disjoint", f"band [{lo}, {hi}) outside [{first}, {top + 1}]")
    if g == G_UP and lo != first:
        raise bad("state-codes", f"up band starts at {lo}, not first_page {first}")
    if g == G_DOWN and hi != top + 1:
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
    if (live, holes, pend) != (int(m[M_LIVE]), int(m[M_HOLES]), int(m[M_PENDING])):
        raise bad("counts", f"counters live/holes/pending = {int(m[M_LIVE])}/{int(m[M_HOLES])}/"
                            f"{int(m[M_PENDING])}, states say {live}/{holes}/{pend}")
    if hi > lo:
        if g != G_DOWN and st[hi - 1] == PAGE_HOLE:
            raise bad("band-edges", f"top edge page {hi - 1} is a hole")
        if g != G_UP and st[lo] == PAGE_HOLE:
            raise bad("band-edges", f"bottom edge page {lo} is a hole")
    if holes:
        hole_idx = np.flatnonzero(st == PAGE_HOLE)
        hint = int(m[M_HINT])
        if (g == G_DOWN and hole_idx.max() > hint) or (g != G_DOWN and hole_idx.min() < hint):
            raise bad("hole-hint", f"drain hint {hint} skips holes {hole_idx[:8].tolist()}")
    nw = (top + 64) >> 6
    hb = int(m[M_HBOFF])
    if not np.array_equal(unpack_bits(heap.h64[hb: hb + nw], top + 1), st == PAGE_HOLE):
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
    o = int(m[M_OWNER])
    ovs = heap.h8[heap.meta[o, M_VOFF]: heap.meta[o, M_VOFF] + heap.meta[o, M_NV]]
    if np.any(ovs[bound] != V_LIVE):
        raise bad("owner-live", f"bound on virtual pages not live on owner {heap.names[o]!r}")
    if o == i:
        if ovs[0] != V_RESERVED:
            raise bad("sink", "virtual page 0 is not reserved")
        owner_live = v2p[1:] != TOMBSTONE
        if np.any(owner_live != (ovs[1:] == V_LIVE)):
            raise bad("owner-live", "virtual page states disagree with the owner's v2p")
        if int(np.count_nonzero(owner_live)) != int(m[M_VLIVE]):
            raise bad("counts", "live virtual page counter is off")
        vb, nvw = int(m[M_VBOFF]), (int(m[M_NV]) + 63) >> 6
        if not np.array_equal(unpack_bits(heap.h64[vb: vb + nvw], int(m[M_NV])),
                              (ovs == V_NEVER) | (ovs == V_FREED)):
            raise bad("bitmaps", "the free-virtual-id bitmap differs from the virtual page states")
        free_v = np.flatnonzero(ovs[1:] != V_LIVE)
        if free_v.size and free_v.min() + 1 < int(m[M_VHINT]):
            raise bad("hole-hint", "the minting hint skips a free virtual page")
    pins = heap.pins[i]
    if np.any((st == PAGE_PENDING) & (pins <= 0)):
        raise bad("pending-pinned", "a pending page has no pin")
    if np.any((pins > 0) & (st != PAGE_LIVE) & (st != PAGE_PENDING)):
        raise bad("pending-pinned", "a pinned page is neither live nor pending")


__all__ = ["EndView", "check_heap"]
