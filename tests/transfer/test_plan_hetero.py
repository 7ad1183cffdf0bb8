"""Plans between sides of different TP, page size and envelope layout (head groups).

Hand-computed descriptor lists for one page of each layout and ratio; byte-exact transfers between every pair of
ranks, checked against a pattern computed from (end, layer, K|V, global head, position, element) alone, never
from the plan code; incompatible pairs refused with every difference listed.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
import torch

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.backends import backend_available, get_backend
from umalloc.errors import IncompatiblePeerError
from umalloc.geometry.arena import Arena
from umalloc.geometry.region import Region
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, LayerSpec, swa_tail_start
from umalloc.transfer import PeerLayout, build_plan, check_compatible
from umalloc.transfer.heads import global_heads
from umalloc.transfer.rows import owned_count, vector_rows
from umalloc.transfer.slices import sends_to

HEADS = 4  # the model's KV heads per layer (target and SWA); the drafter has 1 (replicated under TP)
DIM = 4  # elements per head, bf16: 8 B
WINDOW = 6
SEED = 20261201


def layers(tp: int, *, window: int | None = None, total: int = HEADS, n: int = 1) -> tuple[LayerSpec, ...]:
    return (LayerSpec.mha(max(1, total // tp), DIM, window_tokens=window),) * n


def spec(tp: int, page_size: int, head_groups: int = 1, *, draft: bool = True) -> ArenaSpec:
    ends = [EndSpec("full", layers(tp, n=2), page_size, head_groups=head_groups),
            EndSpec("swa", layers(tp, window=WINDOW), page_size, Grow.DOWN, "full", EndRole.SWA,
                    head_groups=head_groups)]
    if draft:
        ends.append(EndSpec("draft", layers(tp, total=1), 4, Grow.FLOAT, None, EndRole.DRAFT))
    return ArenaSpec(tuple(ends), arena_bytes=1 << 16)


def pattern(end_index: int, layer: int, kv: int, heads: np.ndarray, positions: np.ndarray) -> torch.Tensor:
    """int16 ``(len(positions), len(heads), DIM)``: a value of (end, layer, K|V, global head, position, element)."""
    e = np.arange(DIM, dtype=np.int64)
    v = (((end_index * 7919 + layer * 613 + kv * 101) + heads[None, :, None] * 37 + positions[:, None, None] * 131
          + e[None, None, :]) * 2654435761) % 65521 - 32760
    return torch.from_numpy(v.astype(np.int16))


class Rank:
    """One rank's arena, allocator and one request of ``L`` tokens (its virtual ids per id owner)."""

    def __init__(self, spec_: ArenaSpec, tp_rank: int, tp_size: int, L: int, *, seed: int, prefix: int = 0,
                 receiver: bool = False, dcp: tuple[int, int] = (1, 0)) -> None:
        self.arena = Arena(spec_)
        g = torch.Generator().manual_seed(seed)
        self.arena.data.copy_(torch.randint(0, 256, (spec_.arena_bytes,), dtype=torch.uint8, generator=g))
        self.alloc = MultiEndedAllocator(self.arena, debug_checks=True)
        self.tp_rank, self.tp_size, self.L = tp_rank, tp_size, L
        self.dcp_size, self.dcp_rank = dcp
        self.layout = PeerLayout.from_arena(self.arena, tp_rank=tp_rank, tp_size=tp_size, dcp_size=dcp[0],
                                            dcp_rank=dcp[1])
        noise = self._extend("full", 3)  # other requests first: ids and pages are not 1, 2, 3 ...
        self.vt = {"full": self._extend("full", owned_count(L, *dcp), bind=[])}  # its local rows (DCP)
        self.alloc.free(noise, owner="full")
        swa_from = vector_rows(spec_.end("swa"), L, prefix, dcp_size=dcp[0], dcp_rank=dcp[1])[0] if receiver else 0
        assert self.alloc.bind_end("swa", self.vt["full"][swa_from:])
        if "draft" in spec_.end_names:
            self.vt["draft"] = self._extend("draft", L)
        self.prefix = prefix

    def _extend(self, owner: str, n: int, bind=None) -> torch.Tensor:
        t = self.alloc.alloc_extend(torch.tensor([0]), torch.tensor([n]), torch.tensor([-1]), owner=owner,
                                    bind=bind)
        assert t is not None
        return t

    def heads(self, end: str) -> np.ndarray:
        layer = self.arena.spec.end(end).layers[0]
        total = 1 if end == "draft" else HEADS
        lo, hi = global_heads(self.tp_rank, self.tp_size, layer.num_kv_heads, total)
        return np.arange(lo, hi, dtype=np.int64)

    def _rows(self, end: str, positions: np.ndarray):
        e = self.arena.spec.end(end)
        owner = self.arena.spec.owner_of(end)
        local = positions // self.dcp_size if end != "draft" else positions  # Note [DCP rows]
        tok = self.alloc.translate(self.vt[owner][torch.from_numpy(local)], end).numpy()
        return tok // e.page_size, tok % e.page_size

    def each_view(self, end: str, positions: np.ndarray, data: torch.Tensor | None = None):
        """Yield ``(end index, layer, kv, view rows (n, heads, DIM))`` read through kv_group_views."""
        spec_ = self.arena.spec
        arena = self.arena
        if data is not None:  # the same geometry over another buffer
            arena = Arena.__new__(Arena)
            arena.__dict__.update(self.arena.__dict__)
            arena.data = data
        pages, rows = self._rows(end, positions)
        e = spec_.end(end)
        hpg = e.layers[0].num_kv_heads // e.head_groups
        h = np.arange(e.layers[0].num_kv_heads)
        for layer in range(len(e.layers)):
            for kv, view in enumerate(arena.kv_group_views(end, layer)):
                idx = (pages[:, None], (h // hpg)[None, :], rows[:, None], (h % hpg)[None, :])
                yield spec_.ends.index(e), layer, kv, view, tuple(torch.from_numpy(np.asarray(i)) for i in idx)

    def fill(self) -> None:
        for end in self.arena.spec.end_names:
            positions = np.arange(self.L, dtype=np.int64)
            for ei, layer, kv, view, idx in self.each_view(end, positions):
                view[idx] = pattern(ei, layer, kv, self.heads(end), positions).view(view.dtype)

    def expected_positions(self, end: str) -> np.ndarray:
        lo = self.prefix
        if end == "swa":
            lo = max(lo, self.L - WINDOW)
        x = np.arange(lo, self.L, dtype=np.int64)
        return x if end == "draft" else x[x % self.dcp_size == self.dcp_rank]

    def assert_received(self, before: torch.Tensor, *, whole_pages: set[str]) -> None:
        """Every row that must arrive holds the pattern; no other byte of the arena changed (``whole_pages``:
        no byte outside the pages holding them for the ``whole_pages`` ends: the envelope path copies whole
        pages, Note [Boundary page])."""
        mask = torch.zeros(self.arena.spec.arena_bytes, dtype=torch.uint8)
        for end in self.arena.spec.end_names:
            positions = self.expected_positions(end)
            for ei, layer, kv, view, idx in self.each_view(end, positions):
                got = view[idx].view(torch.int16)
                want = pattern(ei, layer, kv, self.heads(end), positions)
                assert torch.equal(got, want), f"rank {self.tp_rank}: end {end} layer {layer} kv {kv} differs"
            for _ei, _layer, _kv, view, idx in self.each_view(end, positions, mask):
                view[idx] = 1.0  # bf16 0x3f80: both bytes non-zero
            if self.dcp_size == 1 or end == "draft":  # rows past L of the last page: valid on neither side
                last_page, last_row = self._rows(end, np.array([self.L - 1]))
                for _ei, _layer, _kv, view, _idx in self.each_view(end, np.array([self.L - 1]), mask):
                    view[int(last_page[0]), :, int(last_row[0]) + 1:] = 1.0
            if end in whole_pages:  # rows from the first row that travels; whole pages after a boundary page
                ps = self.arena.spec.end(end).page_size
                assert self.dcp_size == 1
                row_lo = swa_tail_start(self.L, WINDOW, self.prefix, ps) if end == "swa" else self.prefix
                rows_ = np.arange(row_lo, self.L, dtype=np.int64)
                for _ei, _layer, _kv, view, idx in self.each_view(end, rows_, mask):
                    view[idx] = 1.0
                pb = self.arena.spec.end(end).page_bytes
                pages, _ = self._rows(end, rows_[rows_ >= -(-row_lo // ps) * ps])
                for p in np.unique(pages).tolist():
                    mask[p * pb:(p + 1) * pb] = 1
        changed = self.arena.data != before
        assert not (changed & (mask == 0)).any(), f"rank {self.tp_rank}: bytes outside the expected rows changed"


def execute(plan) -> None:
    for src, dst, n in plan.descriptors().tolist():
        ctypes.memmove(dst, src, n)


def run_pairs(src_ranks: list[Rank], dst_ranks: list[Rank]) -> dict[tuple[int, int], int]:
    """Plan and execute every (source, destination) pair :func:`sends_to` routes; returns descriptors per pair."""
    counts = {}
    for d in dst_ranks:
        before = d.arena.data.clone()
        for s in src_ranks:
            if not sends_to(s.layout, d.layout):
                continue
            dst_vt = {"full": d.vt["full"]}
            if "draft" in d.vt:
                dst_vt["draft"] = d.vt["draft"]
            plan = build_plan(f"r{s.tp_rank}-{d.tp_rank}", s.alloc, s.vt, d.alloc, dst_vt,
                              prefix_tokens=d.prefix, seq_len_tokens=d.L, src_layout=s.layout,
                              dst_layout=d.layout)
            execute(plan)
            counts[(s.tp_rank, d.tp_rank)] = counts.get((s.tp_rank, d.tp_rank), 0) + plan.num_descriptors
            plan.complete()
        d.assert_received(before, whole_pages={e.name for e in d.arena.spec.ends if all(
            s.arena.spec.end(e.name) == e and s.tp_size == d.tp_size and d.dcp_size == 1 for s in src_ranks)})
        for r in (*src_ranks, d):
            r.alloc.check_invariants()
            assert r.alloc.leases_active() == 0
    return counts


def ranks(tp: int, page_size: int, head_groups: int, L: int, *, seed: int, prefix: int = 0,
          receiver: bool = False, dcp: int = 1) -> list[Rank]:
    out = []
    for r in range(tp):
        for c in range(dcp):
            out.append(Rank(spec(tp, page_size, head_groups), r, tp, L, seed=seed + 10 * r + c, prefix=prefix,
                            receiver=receiver, dcp=(dcp, c)))
    if not receiver:
        for x in out:
            x.fill()
    return out


CASES = [  # (prefill TP, page size, head groups) -> (decode TP, page size, head groups)
    ((1, 4, 1), (2, 4, 1)), ((2, 4, 1), (1, 4, 1)), ((2, 4, 1), (2, 4, 1)), ((2, 4, 1), (4, 4, 1)),
    ((4, 4, 1), (2, 4, 1)), ((1, 2, 1), (1, 4, 1)), ((1, 4, 1), (1, 2, 1)), ((1, 4, 2), (2, 4, 1)),
    ((2, 4, 1), (1, 4, 2)), ((1, 4, 4), (4, 8, 1)), ((2, 2, 2), (1, 4, 4)), ((1, 4, 1), (1, 4, 2)),
]


@pytest.mark.parametrize("prefix", [0, 3])
@pytest.mark.parametrize(("src", "dst"), CASES, ids=[f"P{a}x{b}g{c}-D{x}x{y}g{z}" for (a, b, c), (x, y, z) in CASES])
def test_every_rank_gets_exactly_its_heads(src, dst, prefix):
    L = 13  # three pages and a partial one at page size 4
    s_ranks = ranks(*src, L, seed=SEED)
    d_ranks = ranks(*dst, L, seed=SEED + 100, prefix=prefix, receiver=True)
    counts = run_pairs(s_ranks, d_ranks)
    # every destination rank is fed, by as many source ranks as hold its heads
    p, d = src[0], dst[0]
    for r in range(d):
        senders = sorted(q for q, rr in counts if rr == r)
        assert senders == (list(range(r * p // d, (r + 1) * p // d)) if p > d else [r * p // d]), senders


@pytest.mark.parametrize("prefix", [0, 5])
@pytest.mark.parametrize(("src", "dst"), [((1, 4, 1), (2, 4, 1)), ((2, 4, 1), (1, 8, 2)), ((1, 4, 2), (2, 2, 1))])
def test_tp_and_page_ratios_under_decode_dcp(src, dst, prefix):
    # decode DCP 2 on top: each (TP rank, DCP rank) gets its heads of the positions it owns, draft by logical rows
    L = 15
    s_ranks = ranks(*src, L, seed=SEED)
    d_ranks = ranks(*dst, L, seed=SEED + 100, prefix=prefix, receiver=True, dcp=2)
    run_pairs(s_ranks, d_ranks)


def _one_page_layouts(src_tp, dst_tp, src_ps, dst_ps, src_g, dst_g, *, dst_rank):
    heads = 2

    def lay(tp, ps, g, rank, base):
        end = EndSpec("full", (LayerSpec.mha(heads // tp, DIM),), ps, head_groups=g)
        return PeerLayout(ArenaSpec((end,), arena_bytes=4096), (Region(base, 4096),), base, tp_rank=rank,
                          tp_size=tp)

    return lay(src_tp, src_ps, src_g, 0, 1 << 20), lay(dst_tp, dst_ps, dst_g, dst_rank, 1 << 30)


def _descriptors(src_lay, dst_lay, src_tok, dst_tok):
    from umalloc.transfer.slices import pair_pieces, slice_descriptors
    pieces = pair_pieces(src_lay, "full", dst_lay, "full")
    desc, _ = slice_descriptors(np.array(src_tok), np.array(dst_tok), pieces, src_lay, "full", dst_lay, "full")
    return desc.tolist()


def test_hand_computed_page_major_tp_split():
    # 2 heads x 4 dims x 2 B: source page (TP 1, page size 2) = K rows of 16 B at 0 (t0) and 16 (t1), V at 32;
    # 64 B pages. Destination rank 1 of TP 2 holds head 1: K rows of 8 B at 0, 8; V at 16; 32 B pages.
    s, d = _one_page_layouts(1, 2, 2, 2, 1, 1, dst_rank=1)
    S, D = (1 << 20) + 3 * 64, (1 << 30) + 5 * 32  # source page 3, destination page 5
    assert _descriptors(s, d, [6, 7], [10, 11]) == [
        [S + 8, D + 0, 8], [S + 24, D + 8, 8], [S + 40, D + 16, 8], [S + 56, D + 24, 8]]


def test_hand_computed_head_group_outer_tp_split():
    # the same with 2 head groups on the source: group 1 = [K(t0, t1; h1) | V(t0, t1; h1)] = bytes 32..64
    s, d = _one_page_layouts(1, 2, 2, 2, 2, 1, dst_rank=1)
    S, D = (1 << 20) + 3 * 64, (1 << 30) + 5 * 32
    assert _descriptors(s, d, [6, 7], [10, 11]) == [[S + 32, D, 32]]


def test_hand_computed_tp_gather():
    # TP 2 -> 1: source rank 0 (head 0, K rows 8 B, 32 B pages) into the destination's head 0 slots
    s, d = _one_page_layouts(2, 1, 2, 2, 1, 1, dst_rank=0)
    S, D = (1 << 20) + 3 * 32, (1 << 30) + 5 * 64
    assert _descriptors(s, d, [6, 7], [10, 11]) == [
        [S + 0, D + 0, 8], [S + 8, D + 16, 8], [S + 16, D + 32, 8], [S + 24, D + 48, 8]]
    # with 2 head groups on the destination, head 0's K and V rows are one run
    s, d = _one_page_layouts(2, 1, 2, 2, 1, 2, dst_rank=0)
    assert _descriptors(s, d, [6, 7], [10, 11]) == [[S, D, 32]]


def test_hand_computed_page_size_ratio():
    # equal TP (1), page size 2 -> 4: source pages 3 and 4 (64 B: K 32 B, V 32 B) fill destination page 5
    # (128 B: K rows 0-3 at 0, V at 64). One run per (source page, layer block); K then V of page 3 are adjacent
    # at the source but not at the destination.
    s, d = _one_page_layouts(1, 1, 2, 4, 1, 1, dst_rank=0)
    S, D = (1 << 20), (1 << 30) + 5 * 128
    assert _descriptors(s, d, [6, 7, 8, 9], [20, 21, 22, 23]) == [
        [S + 3 * 64, D, 32], [S + 3 * 64 + 32, D + 64, 32], [S + 4 * 64, D + 32, 32], [S + 4 * 64 + 32, D + 96, 32]]


def test_mla_latent_sent_by_one_source_rank():
    def lay(tp, rank, base):
        end = EndSpec("full", (LayerSpec.mla(8, 4),), 2)
        return PeerLayout(ArenaSpec((end,), arena_bytes=4096), (Region(base, 4096),), base, tp_rank=rank,
                          tp_size=tp)

    src = [lay(2, q, 1 << 20) for q in range(2)]
    dst = [lay(4, r, 1 << 30) for r in range(4)]
    assert [[sends_to(s, d) for d in dst] for s in src] == [[True, False, True, False], [False, True, False, True]]
    assert [sends_to(s, lay(1, 0, 1 << 30)) for s in src] == [True, False]


def test_incompatible_pairs_listed_at_connect():
    def lay(tp, ps, layers_, base=1 << 20):
        end = EndSpec("full", layers_, ps)
        return PeerLayout(ArenaSpec((end,), arena_bytes=1 << 17), (Region(base, 1 << 17),), base, tp_size=tp)

    with pytest.raises(IncompatiblePeerError) as e:  # TP 2 -> 3 and page size 16 -> 24 together
        check_compatible(lay(2, 16, (LayerSpec.mha(3, 4),)), lay(3, 24, (LayerSpec.mha(2, 4),)))
    assert e.value.differences == [
        "tp_size: local 2, remote 3: neither divides the other (a rank of one side must hold whole slices of the "
        "other's heads)",
        "end 'full': page_size local 16, remote 24: neither divides the other (ids expand by a whole ratio, F14)"]
    with pytest.raises(IncompatiblePeerError) as e:  # MLA latent dims differ
        check_compatible(lay(1, 16, (LayerSpec.mla(512, 64),)), lay(2, 16, (LayerSpec.mla(256, 64),)))
    assert e.value.differences == ["end 'full' layer 0: latent_dim local 576 != remote 320"]
    # mapped: TP 2 -> 4 with heads halving, page size 16 -> 32
    check_compatible(lay(2, 16, (LayerSpec.mha(4, 4),)), lay(4, 32, (LayerSpec.mha(2, 4),)))


# ==== real engines ==============================================================================================

ENGINES = ["local", "nixl", "mooncake"]


def _engine(name: str, layout: PeerLayout, arena: Arena):
    ok, why = backend_available(name)
    if not ok:
        pytest.skip(f"{name}: {why}")
    b = get_backend(name, layout=layout)
    b.register(arena.regions())
    return b


@pytest.mark.parametrize("name", ENGINES)
def test_tp_split_over_a_real_engine(name):
    # TP 1 -> 2 and a head-group-outer prefill page: each decode rank's backend is a peer of the prefill's; the
    # plans go through submit / wait like any plan, and every rank's bytes are checked against the pattern
    L = 13
    (src,) = ranks(1, 4, 2, L, seed=SEED)
    dsts = ranks(2, 4, 1, L, seed=SEED + 100, receiver=True)
    sender = _engine(name, src.layout, src.arena)
    receivers = [_engine(name, d.layout, d.arena) for d in dsts]
    try:
        for d, rb in zip(dsts, receivers, strict=True):
            before = d.arena.data.clone()
            peer = sender.connect(rb.metadata())
            plan = build_plan(f"e{d.tp_rank}", src.alloc, src.vt, d.alloc, {"full": d.vt["full"],
                              "draft": d.vt["draft"]}, seq_len_tokens=L, src_layout=src.layout, dst_layout=d.layout)
            h = sender.submit(plan, peer)
            deadline = time.monotonic() + 60.0
            while sender.poll(h) == "pending" and time.monotonic() < deadline:  # wait() would fail it at its timeout
                rb.progress()
                time.sleep(0.001)
            assert sender.poll(h) == "done" and plan.state == "done"
            sender.forget(h)
            d.assert_received(before, whole_pages=set())  # every end is a slice plan (TP differs)
            assert src.alloc.leases_active() == 0 and d.alloc.leases_active() == 0
    finally:
        for b in (sender, *receivers):
            b.close()


@pytest.mark.parametrize("name", ENGINES)
def test_unmappable_peer_refused_at_connect_with_every_difference(name):
    def side(tp, page_size, heads):
        end = EndSpec("full", (LayerSpec.mha(heads, DIM),), page_size)
        arena = Arena(ArenaSpec((end,), arena_bytes=1 << 16))
        return arena, PeerLayout.from_arena(arena, tp_size=tp)

    a_arena, a_lay = side(2, 16, 3)
    b_arena, b_lay = side(3, 24, 2)
    a, b = _engine(name, a_lay, a_arena), _engine(name, b_lay, b_arena)
    try:
        with pytest.raises(IncompatiblePeerError) as e:
            a.connect(b.metadata())
        assert e.value.differences == [
            "tp_size: local 2, remote 3: neither divides the other (a rank of one side must hold whole slices "
            "of the other's heads)",
            "end 'full': page_size local 16, remote 24: neither divides the other (ids expand by a whole ratio, "
            "F14)"]
        assert a.peers() == []
    finally:
        a.close()
        b.close()


# ==== what a peer or a caller may get wrong =====================================================================


def test_a_malformed_half_from_a_peer_is_refused_and_nothing_is_leased():
    from umalloc.errors import UmallocValueError
    from umalloc.transfer import build_receiver_half, build_send_plan

    L = 13
    (src,) = ranks(2, 4, 1, L, seed=SEED)[:1]
    (dst,) = ranks(1, 4, 1, L, seed=SEED + 100, receiver=True, prefix=3)
    half = build_receiver_half("m", dst.alloc, {"full": dst.vt["full"], "draft": dst.vt["draft"]},
                               seq_len_tokens=L, prefix_tokens=3, layout=dst.layout)
    good = half.to_dict()
    wrong_kind = json_copy(good)
    wrong_kind["vectors"]["target"]["kind"] = "slots"  # would skip the row check and copy from row 0
    twice = json_copy(good)
    pages = twice["vectors"]["target"]["pages"]
    pages[1] = pages[0]  # one destination page twice: another page's rows would never arrive
    for bad, why in ((wrong_kind, "kind 'slots'"), (twice, "named twice")):
        with pytest.raises(UmallocValueError, match=why):
            build_send_plan("m", src.alloc, src.vt, bad, dst.layout, src_layout=src.layout, seq_len_tokens=L)
        assert src.alloc.leases_active() == 0
    half.abort()


def json_copy(d: dict) -> dict:
    import json

    return json.loads(json.dumps(d))


def test_head_helpers_refuse_what_is_not_a_size():
    from umalloc.errors import UmallocValueError
    from umalloc.transfer.heads import head_map, held_heads, tp_difference

    for bad in (0, -2, 2.0, True):
        with pytest.raises(UmallocValueError):
            tp_difference(bad, 4)
        with pytest.raises(UmallocValueError):
            head_map(LayerSpec.mha(2, 4), bad, LayerSpec.mha(2, 4), 2)
    with pytest.raises(UmallocValueError):
        held_heads(-1, 2)
    with pytest.raises(UmallocValueError):
        held_heads(0, 2, rep=0)


def test_sends_to_refuses_an_unmappable_pair():
    s = PeerLayout.from_arena(Arena(spec(2, 4)), tp_size=2)
    d = PeerLayout.from_arena(Arena(spec(3, 4)), tp_size=3)  # 4 heads do not split by 3 either
    with pytest.raises(IncompatiblePeerError, match="neither divides"):
        sends_to(s, d)


def test_preset_tp_size_must_be_an_int():
    from umalloc.errors import SpecError
    from umalloc.geometry.presets import preset_ends

    for bad in (True, 0, 2.0):
        with pytest.raises(SpecError, match="tp_size"):
            preset_ends("gemma-3-12b-draft", tp_size=bad)


def test_head_group_outer_sends_one_run_per_page_and_group_also_for_a_partial_last_page():
    # P1 (2 head groups) -> D2: decode rank r takes group r of each source page; L = 7 at page size 4 is one full
    # page and one partial page, and the partial one is still one run (its rows past L are valid on neither side)
    L = 7
    (src,) = ranks(1, 4, 2, L, seed=SEED)
    for d in ranks(2, 4, 1, L, seed=SEED + 100, receiver=True):
        plan = build_plan("g", src.alloc, src.vt, d.alloc, {"full": d.vt["full"], "draft": d.vt["draft"]},
                          seq_len_tokens=L, src_layout=src.layout, dst_layout=d.layout)
        assert plan.stats_by_vector["target"].descriptors == 2  # one per page (2 layers, K and V, in one group)
        plan.abort()
