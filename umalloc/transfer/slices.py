"""Slice descriptors: token rows of one side into another side of other TP, page size or envelope layout.

Policy:

* Two layouts that differ in TP rank or size, page size or head groups (Note [Head-group-outer envelope] in
  :mod:`umalloc.geometry.spec`) are mapped row by row: for one pair of ends a *piece table* lists, per layer
  block and head slice the two ranks share (:mod:`umalloc.transfer.heads`), the byte offset in a page, the row
  stride and the length on each side. It is computed once per (layout pair, end) and cached.
* A vector's descriptors are ``token pairs x pieces``: token pair ``i`` (physical token ids ``page *
  page_size + row``, each in its own side's page size: F14) and piece ``j`` give one run, addressed as
  ``base + page * page_bytes + offset_j + row * stride_j``. Runs contiguous on both sides are merged (sorted by
  source address), so what merges is what the layouts allow: a head-group-outer page sends one run per (page,
  head group), a page-major one a run per (token, layer block, head slice) under a TP ratio, whole layer blocks
  under a page-size ratio, whole envelopes where nothing differs.
* Nothing here checks bounds: :func:`umalloc.transfer.descriptors.vector_descriptors` checks the ids before and
  every merged descriptor after (regions, handable pages, leased pages), as for every plan.
* Cost: O(pairs * pieces) numpy work plus one sort of that many addresses; pieces are a few per layer.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from umalloc.geometry.spec import EndSpec, LayerKind, PageBlock
from umalloc.transfer.heads import HeadMap, head_map, sent_heads
from umalloc.transfer.layout import EndGeometry, PeerLayout, check_compatible
from umalloc.transfer.rows import is_dcp_sharded

_NO_DESCRIPTORS = np.zeros((0, 3), dtype=np.uint64)
_NO_DESCRIPTORS.setflags(write=False)


class Pieces(NamedTuple):
    """Piece table of one end pair (read-only int64 ``(J,)`` arrays): piece ``j`` of a token row starts
    ``src_off[j] + row * src_stride[j]`` bytes into a source page (``dst_*`` likewise) and is ``nbytes[j]`` long."""

    src_off: np.ndarray
    src_stride: np.ndarray
    dst_off: np.ndarray
    dst_stride: np.ndarray
    nbytes: np.ndarray

    @property
    def count(self) -> int:
        return int(self.nbytes.shape[0])


def _block_of(end: EndSpec) -> dict[tuple[int, int, str], PageBlock]:
    return {(b.group, b.layer, b.kv): b for b in end.blocks}


def _pieces(src: EndSpec, src_tp: tuple[int, int], dst: EndSpec, dst_tp: tuple[int, int]) -> Pieces:
    (q, p), (r, d) = src_tp, dst_tp
    s_blocks, d_blocks = _block_of(src), _block_of(dst)
    rows: list[tuple[int, int, int, int, int]] = []
    for i, (ls, ld) in enumerate(zip(src.layers, dst.layers, strict=True)):
        hm = head_map(ls, p, ld, d)
        if not isinstance(hm, HeadMap):
            raise ValueError(hm)  # layouts not checked compatible: the caller's bug
        lo, hi = sent_heads(hm, q, r)
        if hi <= lo:
            continue
        if ls.kind is LayerKind.MLA:
            sb, db = s_blocks[(0, i, "k")], d_blocks[(0, i, "k")]
            rows.append((sb.offset_bytes, sb.row_bytes, db.offset_bytes, db.row_bytes, sb.row_bytes))
            continue
        s_lo = (q // hm.src_rep) * hm.src_heads  # first head slot of each rank
        d_lo = (r // hm.dst_rep) * hm.dst_heads
        gs, gd = hm.src_heads // src.head_groups, hm.dst_heads // dst.head_groups
        for kv, dim in (("k", ls.head_dim_k), ("v", ls.head_dim_v)):
            head_bytes = dim * ls.dtype.itemsize
            a = lo
            while a < hi:
                s_local, d_local = a - s_lo, a - d_lo
                gsi, gdi = s_local // gs, d_local // gd
                b = min(hi, s_lo + (gsi + 1) * gs, d_lo + (gdi + 1) * gd)
                sb, db = s_blocks[(gsi, i, kv)], d_blocks[(gdi, i, kv)]
                rows.append((sb.offset_bytes + (s_local - gsi * gs) * head_bytes, sb.row_bytes,
                             db.offset_bytes + (d_local - gdi * gd) * head_bytes, db.row_bytes,
                             (b - a) * head_bytes))
                a = b
    arr = np.array(rows, dtype=np.int64).reshape(-1, 5)
    cols = [np.ascontiguousarray(arr[:, k]) for k in range(5)]
    for c in cols:
        c.setflags(write=False)
    return Pieces(*cols)


#: pair_pieces cache: (src digest, src end, dst digest, dst end) -> Pieces.
_PIECES: dict[tuple[str, str, str, str], Pieces] = {}


def pair_pieces(src_layout: PeerLayout, src_end: str, dst_layout: PeerLayout, dst_end: str) -> Pieces:
    """The piece table of ``src_end`` on ``src_layout`` (its TP rank) into ``dst_end`` on ``dst_layout``.

    Pieces follow the layer blocks in order; within a block they are the head slices the two ranks share, cut
    at both sides' head-group boundaries. An empty table means this source rank sends nothing of that end to
    that destination rank. Cached per layout digests and ends; O(layers * groups) on a miss.

    Raises:
        ValueError: layouts whose layers are not one model's (not checked compatible).
        SpecError: an unknown end.
    """
    key = (src_layout.digest, src_end, dst_layout.digest, dst_end)
    got = _PIECES.get(key)
    if got is None:
        got = _pieces(src_layout.end(src_end), (src_layout.tp_rank, src_layout.tp_size), dst_layout.end(dst_end),
                      (dst_layout.tp_rank, dst_layout.tp_size))
        if len(_PIECES) >= 4096:
            _PIECES.clear()
        _PIECES[key] = got
    return got


def same_slices(src_layout: PeerLayout, dst_layout: PeerLayout, src_geom: EndGeometry, dst_geom: EndGeometry
                ) -> bool:
    """True if pages of two ends map whole page to whole page (same TP rank and size, the same page bytes and
    blocks): the envelope path of :mod:`umalloc.transfer.descriptors` applies. O(1) after the first call."""
    return src_layout.tp_size == dst_layout.tp_size and src_layout.tp_rank == dst_layout.tp_rank and \
        src_geom.same_bytes(dst_geom)


def sends_to(src_layout: PeerLayout, dst_layout: PeerLayout) -> bool:
    """True iff a plan from the source rank of ``src_layout`` (its TP and DCP ranks) to the destination rank of
    ``dst_layout`` can carry bytes: some end shares KV heads (or a replicated head or MLA latent has this source
    as its sender, Note [TP heads] in :mod:`umalloc.transfer.heads`) and, under DCP, this source owns positions
    of that destination's rows (or sends its unsharded vectors, Note [DCP rows]). Route plans with it: every
    destination rank gets each byte from exactly one source rank.

    Raises:
        IncompatiblePeerError: layouts no plan can map (:func:`~umalloc.transfer.layout.check_compatible`, cached
            per pair of digests), every difference listed.
        UmallocValueError: an argument that is not a ``PeerLayout``.

    >>> from umalloc.geometry.region import Region
    >>> from umalloc.geometry.spec import ArenaSpec, LayerSpec
    >>> def lay(heads, tp, rank):
    ...     spec = ArenaSpec((EndSpec("full", (LayerSpec.mha(heads, 8),), page_size=2),), arena_bytes=4096)
    ...     return PeerLayout(spec, (Region(1 << 20, 4096),), 1 << 20, tp_rank=rank, tp_size=tp)
    >>> [[sends_to(lay(4, 2, q), lay(2, 4, r)) for r in range(4)] for q in range(2)]      # P2 -> D4
    [[True, True, False, False], [False, False, True, True]]
    """
    check_compatible(src_layout, dst_layout)
    p, q = src_layout.dcp_size, src_layout.dcp_rank
    d, r = dst_layout.dcp_size, dst_layout.dcp_rank
    for e in src_layout.ends:
        if pair_pieces(src_layout, e.name, dst_layout, e.name).count == 0:
            continue
        if not is_dcp_sharded(e):
            if r % p == q:
                return True
        elif p == d:
            if q == r:
                return True
        elif (r - q) % math.gcd(p, d) == 0:  # some position x has x % d == r and x % p == q
            return True
    return False


def slice_descriptors(src_tok: np.ndarray, dst_tok: np.ndarray, pieces: Pieces, src_layout: PeerLayout,
                      src_end: str, dst_layout: PeerLayout, dst_end: str, *, merge: bool = True
                      ) -> tuple[np.ndarray, int]:
    """Merged descriptors of token pairs through a piece table.

    Args:
        src_tok, dst_tok: int64 ``(n,)`` physical token ids (``page * page_size + row``) in each side's own page
            size, non-negative and inside each end's pages (checked by the caller before this arithmetic).
        pieces: :func:`pair_pieces` of the two ends.
        src_layout, src_end, dst_layout, dst_end: the two sides (base addresses, page sizes and bytes).
        merge: ``False`` returns the ``n * J`` unmerged runs (token-major), the per-token slice design a
            benchmark compares against.

    Returns:
        ``(descriptors, unmerged)``: read-only uint64 ``(N, 3)`` ``(src_addr, dst_addr, nbytes)`` sorted by source
        address, and ``n * J``, the descriptors one per (token, piece) would be (a per-token head-slice design,
        as SGLang's ``send_kvcache_slice`` posts).

    Complexity: O(n J log(n J)).
    """
    n, j = src_tok.shape[0], pieces.count
    if n == 0 or j == 0:
        return _NO_DESCRIPTORS, 0
    s_ps, d_ps = src_layout.end(src_end).page_size, dst_layout.end(dst_end).page_size
    s_pb, d_pb = src_layout.geometry(src_end).page_bytes, dst_layout.geometry(dst_end).page_bytes
    s_base = np.uint64(src_layout.region_member(src_end).base_addr)
    d_base = np.uint64(dst_layout.region_member(dst_end).base_addr)
    st, dt = src_tok.astype(np.uint64), dst_tok.astype(np.uint64)
    s_row = (st % np.uint64(s_ps))[:, None]
    d_row = (dt % np.uint64(d_ps))[:, None]
    s_addr = (s_base + (st // np.uint64(s_ps)) * np.uint64(s_pb))[:, None] + pieces.src_off.astype(np.uint64)[None, :] \
        + s_row * pieces.src_stride.astype(np.uint64)[None, :]
    d_addr = (d_base + (dt // np.uint64(d_ps)) * np.uint64(d_pb))[:, None] + pieces.dst_off.astype(np.uint64)[None, :] \
        + d_row * pieces.dst_stride.astype(np.uint64)[None, :]
    s_addr, d_addr = s_addr.reshape(-1), d_addr.reshape(-1)
    nbytes = np.broadcast_to(pieces.nbytes.astype(np.uint64)[None, :], (n, j)).reshape(-1)
    if not merge:
        out = np.stack([s_addr, d_addr, nbytes], axis=1)
        out.setflags(write=False)
        return out, n * j
    order = np.argsort(s_addr, kind="stable")
    s_addr, d_addr, nbytes = s_addr[order], d_addr[order], nbytes[order]
    start = np.ones(s_addr.shape[0], dtype=bool)
    start[1:] = (s_addr[1:] != s_addr[:-1] + nbytes[:-1]) | (d_addr[1:] != d_addr[:-1] + nbytes[:-1])
    first = np.flatnonzero(start)
    out = np.empty((first.shape[0], 3), dtype=np.uint64)
    out[:, 0] = s_addr[first]
    out[:, 1] = d_addr[first]
    out[:, 2] = np.add.reduceat(nbytes, first)
    out.setflags(write=False)
    return out, n * j


__all__ = ["Pieces", "pair_pieces", "same_slices", "sends_to", "slice_descriptors"]
