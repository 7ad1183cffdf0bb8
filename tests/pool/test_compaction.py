"""Compaction planner: exact move orders, a brute-force reference on hypothesis bands, and apply_plan on a
real arena (standalone, without the allocator)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from compaction_helpers import (
    PAGE_SIZE,
    ByteModel,
    FakeClock,
    assert_no_ghost_pages,
    seed_from_env,
    three_ends,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.errors import InvariantError, UmallocValueError
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndSpec, Grow, KVDtype, LayerSpec
from umalloc.pool.compaction import (
    UP,
    CompactionReport,
    MovePlan,
    apply_plan,
    copy_moves,
    plan_down,
    plan_float,
    plan_up,
)
from umalloc.pool.pagestate import PAGE_GAP, PAGE_HOLE, PAGE_LIVE, PAGE_PENDING, PAGE_RESERVED, TOMBSTONE
from umalloc.translators.cpu import pages_to_runs

R, G, H, L, P = PAGE_RESERVED, PAGE_GAP, PAGE_HOLE, PAGE_LIVE, PAGE_PENDING


def arr(*states: int) -> np.ndarray:
    return np.array(states, dtype=np.int8)


def no_pins(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.int32)


# ---- exact orders (computed by hand) -----------------------------------------------------------------------
def test_up_exact_order_highest_sources_into_lowest_holes_order_preserving() -> None:
    #            0  1  2  3  4  5  6  7  8  9
    state = arr(R, L, H, L, H, H, L, L, L, G)
    plan = plan_up(state, no_pins(10), 1, 9)
    # walk: (8, 2), (7, 4), (6, 5); pairs returned ascending: 6->2, 7->4, 8->5
    assert plan.src_pages.tolist() == [6, 7, 8]
    assert plan.dst_pages.tolist() == [2, 4, 5]
    assert plan.new_watermark == 6
    assert plan.src_pages.dtype == np.int64 and plan.dst_pages.dtype == np.int64
    src, dst, wm = plan  # unpacks as the agreed 3-tuple
    assert wm == 6


def test_up_budget_moves_the_highest_first_and_retreats_partially() -> None:
    state = arr(R, L, H, L, H, H, L, L, L, G)
    plan = plan_up(state, no_pins(10), 1, 9, budget_pages=2)
    assert plan.src_pages.tolist() == [7, 8]  # the two highest
    assert plan.dst_pages.tolist() == [2, 4]  # the two lowest holes
    assert plan.new_watermark == 7  # page 6 still live
    plan0 = plan_up(state, no_pins(10), 1, 9, budget_pages=0)
    assert plan0.num_moves == 0 and plan0.new_watermark == 9


def test_up_free_retreat_past_trailing_holes_without_moves() -> None:
    state = arr(R, L, L, H, H, G)
    plan = plan_up(state, no_pins(6), 1, 5, budget_pages=0)
    assert plan.num_moves == 0 and plan.new_watermark == 3


def test_up_walls_docstring_example() -> None:
    # module docstring: page 3 live and pinned; 5->6 would move away from the anchor
    #            0  1  2  3  4  5  6  7  8  9
    state = arr(R, L, H, L, H, L, H, L, L, G)
    pins = no_pins(10)
    pins[3] = 1
    plan = plan_up(state, pins, 1, 9)
    assert plan.src_pages.tolist() == [7, 8]
    assert plan.dst_pages.tolist() == [2, 4]
    assert plan.new_watermark == 6
    assert plan.skipped_pinned == 1


def test_up_pages_below_the_highest_wall_never_move() -> None:
    #            0  1  2  3  4  5  6
    state = arr(R, H, L, H, L, P, G)  # pending page 5 is the wall: nothing above it to move
    plan = plan_up(state, no_pins(7), 1, 6)
    assert plan.num_moves == 0
    assert plan.new_watermark == 6
    assert plan.skipped_pinned == 1


def test_up_pinned_hole_is_neither_destination_nor_retreated_past() -> None:
    #            0  1  2  3  4  5  6
    state = arr(R, L, H, H, L, H, G)
    pins = no_pins(7)
    pins[2] = 2
    plan = plan_up(state, pins, 1, 6)
    assert plan.src_pages.tolist() == [4]
    assert plan.dst_pages.tolist() == [3]
    assert plan.new_watermark == 4  # page 3 now live; trailing 4, 5 holes


def test_down_exact_order_lowest_source_into_highest_hole() -> None:
    #            0  1  2  3  4  5  6  7  8  9
    state = arr(R, G, G, L, L, H, L, H, H, L)  # band (2, 9]
    plan = plan_down(state, no_pins(10), 9, 2)
    # walk sources lowest first 3, 4, 6, 9; holes highest first 8, 7, 5: takes (3, 8), (4, 7), stops at (6, 5)
    assert plan.src_pages.tolist() == [3, 4]
    assert plan.dst_pages.tolist() == [7, 8]  # order-preserving: 3->7, 4->8
    assert plan.new_watermark == 5  # band (5, 9]: 6 7 8 9 live
    _, _, wm = plan
    assert wm == 5


def test_down_with_wall_and_budget() -> None:
    #            0  1  2  3  4  5  6  7  8  9
    state = arr(R, G, L, L, H, L, H, H, H, L)  # band (1, 9]
    pins = no_pins(10)
    pins[5] = 1  # wall at 5: only 2, 3 may move
    plan = plan_down(state, pins, 9, 1, budget_pages=1)
    assert plan.src_pages.tolist() == [2]
    assert plan.dst_pages.tolist() == [8]
    assert plan.new_watermark == 2
    full = plan_down(state, pins, 9, 1)
    assert full.src_pages.tolist() == [2, 3]
    assert full.dst_pages.tolist() == [7, 8]
    assert full.new_watermark == 4  # lowest occupied is the pinned page 5


def test_down_empty_band_and_all_holes() -> None:
    state = arr(R, G, G, G)
    assert plan_down(state, no_pins(4), 3, 3).new_watermark == 3
    state = arr(R, G, H, H)
    plan = plan_down(state, no_pins(4), 3, 1)
    assert plan.num_moves == 0 and plan.new_watermark == 3


def test_float_both_edges() -> None:
    #            0  1  2  3  4  5  6  7  8
    state = arr(R, G, L, H, L, H, L, G, G)  # band [2, 7)
    high = plan_float(state, no_pins(9), 2, 7, free_edge="high")
    assert (high.src_pages.tolist(), high.dst_pages.tolist(), high.new_lo, high.new_hi) == ([6], [3], 2, 5)
    low = plan_float(state, no_pins(9), 2, 7, free_edge="low")
    assert (low.src_pages.tolist(), low.dst_pages.tolist(), low.new_lo, low.new_hi) == ([2], [5], 4, 7)
    s, d, lo, hi = low
    assert (lo, hi) == (4, 7)
    with pytest.raises(UmallocValueError, match="free_edge"):
        plan_float(state, no_pins(9), 2, 7, free_edge="left")


def test_bad_inputs_raise_typed_errors() -> None:
    state = arr(R, L, H, G)
    with pytest.raises(UmallocValueError, match="watermark"):
        plan_up(state, no_pins(4), 1, 5)
    with pytest.raises(UmallocValueError, match="budget_pages"):
        plan_up(state, no_pins(4), 1, 3, budget_pages=-1)
    with pytest.raises(UmallocValueError, match="state"):
        plan_up(state.astype(np.int64), no_pins(4), 1, 3)
    with pytest.raises(UmallocValueError, match="pins"):
        plan_up(state, no_pins(3), 1, 3)
    with pytest.raises(InvariantError, match="inside the band"):
        plan_up(state, no_pins(4), 1, 4)  # gap page 3 inside [1, 4)
    with pytest.raises(InvariantError, match="inside the band"):
        plan_down(arr(R, L, G, L), no_pins(4), 3, 0)


# ---- brute-force reference on hypothesis-generated bands ----------------------------------------------------
def reference_up(state: np.ndarray, pins: np.ndarray, first: int, wm: int, budget: int | None):
    """Step-by-step simulation, one move at a time, written independently of the planner."""
    s = state.copy()
    walls = [p for p in range(first, wm) if s[p] == P or pins[p] > 0]
    last_wall = max(walls) if walls else first - 1
    src, dst = [], []
    while budget is None or len(src) < budget:
        sources = [p for p in range(wm - 1, last_wall, -1) if s[p] == L and pins[p] == 0]
        holes = [p for p in range(first, wm) if s[p] == H and pins[p] == 0]
        if not sources or not holes or holes[0] >= sources[0]:
            break
        s[holes[0]], s[sources[0]] = L, H
        src.append(sources[0])
        dst.append(holes[0])
    new_wm = wm
    while new_wm > first and s[new_wm - 1] == H and pins[new_wm - 1] == 0:
        new_wm -= 1
    return sorted(src), sorted(dst), new_wm  # the documented order-preserving pairing


cell = st.sampled_from([(H, 0), (H, 0), (L, 0), (L, 0), (L, 1), (P, 1), (P, 0), (H, 1), (L, 2)])


@st.composite
def up_bands(draw):
    first = draw(st.integers(1, 3))
    band = draw(st.lists(cell, max_size=40))
    tail = draw(st.integers(0, 3))
    states = [R] * first + [c[0] for c in band] + [G] * tail
    pins = [0] * first + [c[1] for c in band] + [0] * tail
    budget = draw(st.one_of(st.none(), st.integers(0, 6)))
    return np.array(states, np.int8), np.array(pins, np.int32), first, first + len(band), budget


@settings(max_examples=200, deadline=None)
@given(up_bands())
def test_plan_up_matches_brute_force(case) -> None:
    state, pins, first, wm, budget = case
    plan = plan_up(state, pins, first, wm, budget)
    src, dst, new_wm = reference_up(state, pins, first, wm, budget)
    assert plan.src_pages.tolist() == src
    assert plan.dst_pages.tolist() == dst
    assert plan.new_watermark == new_wm
    # never touches a pinned or pending page
    assert not (pins[plan.src_pages] > 0).any() and not (pins[plan.dst_pages] > 0).any()
    assert (state[plan.src_pages] == L).all() and (state[plan.dst_pages] == H).all()
    if budget is None:  # optimal: the highest wall or the occupied count, whichever is higher
        occupied = sum(1 for p in range(first, wm) if not (state[p] == H and pins[p] == 0))
        walls = [p for p in range(first, wm) if state[p] == P or pins[p] > 0]
        assert new_wm == max(first + occupied, (max(walls) + 1) if walls else first)


@settings(max_examples=200, deadline=None)
@given(up_bands())
def test_plan_down_is_the_mirror_of_plan_up(case) -> None:
    state, pins, first, wm, budget = case
    # mirror the array behind a sink page: page p <-> n - p; an up band [first, wm) becomes the down band
    # (n - wm, n - first]
    n = state.size
    m_state = np.concatenate([[R], state[::-1]]).astype(np.int8)
    m_pins = np.concatenate([[0], pins[::-1]]).astype(np.int32)
    src, dst, new_wm = reference_up(state, pins, first, wm, budget)
    plan = plan_down(m_state, m_pins, n - first, n - wm, budget)
    assert plan.src_pages.tolist() == sorted(n - p for p in src)
    assert plan.dst_pages.tolist() == sorted(n - p for p in dst)
    assert plan.new_watermark == n - new_wm


# ---- apply_plan on a real arena -------------------------------------------------------------------------------
#: one end, 8 B/token (bf16 K+V), 16 B pages
ONE_END = (EndSpec("full", (LayerSpec.mha(1, 2),), page_size=2),)


def test_apply_plan_moves_bytes_and_tables_keeps_virtual_ids(make_arena) -> None:
    arena = make_arena(ONE_END, 16 * 10)
    pb = arena.page_bytes("full")
    #            0  1  2  3  4  5  6  7  8  9
    state = arr(R, L, H, L, H, L, L, G, G, G)
    p2v = np.full(10, TOMBSTONE, np.int64)
    v2p = np.full(10, TOMBSTONE, np.int64)
    for vp, pp in [(4, 1), (7, 3), (2, 5), (9, 6)]:
        p2v[pp], v2p[vp] = vp, pp
        arena.envelope("full", pp).fill_(100 + vp)
    plan = plan_up(state, no_pins(10), 1, 7)
    assert plan.src_pages.tolist() == [5, 6] and plan.dst_pages.tolist() == [2, 4]
    moved = apply_plan(arena, "full", plan, state=state, p2v=p2v, v2p=v2p, pins=no_pins(10))
    assert moved == 2 * pb
    assert v2p[[4, 7, 2, 9]].tolist() == [1, 3, 2, 4]  # vpage 2 moved 5->2, vpage 9 moved 6->4
    assert p2v[:7].tolist() == [-1, 4, 2, 7, 9, -1, -1]
    assert state.tolist() == [R, L, L, L, L, G, G, G, G, G]
    for vp in (4, 7, 2, 9):
        assert torch.all(arena.envelope("full", int(v2p[vp])) == 100 + vp)
    report = CompactionReport.from_plan("full", plan, pb)
    assert (report.pages_moved, report.bytes_moved, report.flushes, report.retreated_pages) == (2, 2 * pb, 1, 2)
    assert report.watermarks == {"full": 5}


def test_apply_plan_refuses_a_stale_plan_and_changes_nothing(make_arena) -> None:
    arena = make_arena(ONE_END, 16 * 8)
    state = arr(R, L, H, L, G, G, G, G)
    p2v = np.array([-1, 0, -1, 1, -1, -1, -1, -1], np.int64)
    v2p = np.array([1, 3, -1, -1, -1, -1, -1, -1], np.int64)
    plan = plan_up(state, no_pins(8), 1, 4)
    state[2] = L  # the table changed after planning
    p2v[2] = 2
    v2p[2] = 2
    arena.envelope("full", 3).fill_(7)
    before = (state.copy(), p2v.copy(), v2p.copy(), arena.data.clone())
    with pytest.raises(InvariantError, match="not a hole"):
        apply_plan(arena, "full", plan, state=state, p2v=p2v, v2p=v2p)
    assert np.array_equal(state, before[0]) and np.array_equal(p2v, before[1])
    assert np.array_equal(v2p, before[2]) and torch.equal(arena.data, before[3])
    pins = no_pins(8)
    pins[3] = 1
    state[2], p2v[2], v2p[2] = H, -1, -1
    with pytest.raises(InvariantError, match="pinned"):
        apply_plan(arena, "full", plan, state=state, p2v=p2v, v2p=v2p, pins=pins)


def test_apply_down_plan_on_a_down_end() -> None:
    up = EndSpec("full", (LayerSpec.mha(1, 2),), page_size=2)
    down = EndSpec("draft", (LayerSpec.mha(1, 2),), page_size=2, grow=Grow.DOWN, owner="full")
    arena = Arena(ArenaSpec((up, down), arena_bytes=16 * 8))
    #            0  1  2  3  4  5  6  7
    state = arr(R, G, G, L, H, L, H, L)  # band (2, 7]
    p2v = np.array([-1, -1, -1, 0, -1, 1, -1, 2], np.int64)
    v2p = np.array([3, 5, 7, -1, -1, -1, -1, -1], np.int64)
    for vp in range(3):
        arena.envelope("draft", int(v2p[vp])).fill_(50 + vp)
    plan = plan_down(state, no_pins(8), 7, 2)
    # sources lowest first 3, 5, 7; holes highest first 6, 4: 3->6, then 5->4 would move away from the top
    assert plan.src_pages.tolist() == [3] and plan.dst_pages.tolist() == [6]
    assert plan.new_watermark == 4
    apply_plan(arena, "draft", plan, state=state, p2v=p2v, v2p=v2p)
    assert v2p[:3].tolist() == [6, 5, 7]
    assert state.tolist() == [R, G, G, G, G, L, L, L]
    for vp in range(3):
        assert torch.all(arena.envelope("draft", int(v2p[vp])) == 50 + vp)


def test_report_addition_accumulates() -> None:
    a = CompactionReport(pages_moved=2, bytes_moved=32, pages_skipped_pinned=1, flushes=1,
                         watermarks={"full": 4}, moved_by_end={"full": 2})
    b = CompactionReport(pages_moved=3, bytes_moved=48, flushes=1, watermarks={"full": 3, "swa": 9},
                         moved_by_end={"full": 1, "swa": 2})
    c = a + b
    assert (c.pages_moved, c.bytes_moved, c.pages_skipped_pinned, c.flushes) == (5, 80, 1, 2)
    assert c.watermarks == {"full": 3, "swa": 9}
    assert c.moved_by_end == {"full": 3, "swa": 2}
    assert sum([a, b], CompactionReport()).pages_moved == 5


def test_order_preserving_pairing_keeps_a_contiguous_block_contiguous() -> None:
    #            0  1  2  3  4  5  6  7  8
    state = arr(R, H, H, H, L, L, L, G, G)
    plan = plan_up(state, no_pins(9), 1, 7)
    assert plan.src_pages.tolist() == [4, 5, 6] and plan.dst_pages.tolist() == [1, 2, 3]
    assert pages_to_runs(plan.src_pages, plan.dst_pages).tolist() == [[4, 1, 3]]


@pytest.mark.parametrize("path", ["serial", "torch-runs", "chunks"])
@pytest.mark.parametrize("num_pages, page_floats", [(6, 4), (300, 64), (40, 1 << 14)])
def test_copy_moves_matches_a_cloned_reference(num_pages: int, page_floats: int, path: str,
                                               monkeypatch) -> None:
    """Every CPU copy path (one thread: memcpy per coalesced run; two threads: torch's copy per run, or byte
    ranges over numba's threads, 64 KiB pages split across ranges) moves exactly the reference's rows."""
    import umalloc.pool.compaction as compaction

    monkeypatch.setattr(compaction, "PARALLEL_COPY_MIN_BYTES", 1 << 62 if path == "serial" else 0)
    monkeypatch.setattr(compaction, "MAX_TORCH_RUNS", 1 << 62 if path == "torch-runs" else 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _copy_moves_against_reference(num_pages, page_floats)
    finally:
        torch.set_num_threads(threads)


def _copy_moves_against_reference(num_pages: int, page_floats: int) -> None:
    end = EndSpec("full", (LayerSpec.mha(1, page_floats // 2, dtype=KVDtype.FP32),), page_size=1)
    arena = Arena(ArenaSpec((end,), arena_bytes=end.page_bytes * (2 * num_pages + 1)))
    arena.data.copy_(torch.randint(0, 256, arena.data.shape, dtype=torch.uint8))
    rng = np.random.default_rng(7)
    perm = rng.permutation(np.arange(1, 2 * num_pages + 1))
    src, dst = np.sort(perm[:num_pages]), np.sort(perm[num_pages:])
    before = arena.envelopes("full").clone()
    moved = copy_moves(arena, "full", src, dst)
    assert moved == num_pages * end.page_bytes
    expect = before.clone()
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        expect[d] = before[s]
    assert torch.equal(arena.envelopes("full"), expect)


@pytest.mark.parametrize("parallel", [False, True])
def test_copy_moves_refuses_a_page_outside_the_end_and_copies_nothing(parallel: bool, monkeypatch) -> None:
    import umalloc.pool.compaction as compaction

    monkeypatch.setattr(compaction, "PARALLEL_COPY_MIN_BYTES", 0 if parallel else 1 << 62)
    end = EndSpec("full", (LayerSpec.mha(1, 2, dtype=KVDtype.FP32),), page_size=1)
    arena = Arena(ArenaSpec((end,), arena_bytes=end.page_bytes * 8))
    arena.data.copy_(torch.randint(0, 256, arena.data.shape, dtype=torch.uint8))
    before = arena.data.clone()
    rows = arena.envelopes("full").shape[0]
    for src, dst in (([1, 2], [3, rows]), ([-1, 2], [3, 4]), ([1, rows + 5], [3, 4])):
        with pytest.raises(InvariantError, match="outside"):
            copy_moves(arena, "full", np.array(src, np.int64), np.array(dst, np.int64))
        assert torch.equal(arena.data, before)


def test_apply_plan_refuses_pages_outside_the_tables_and_changes_nothing() -> None:
    end = EndSpec("full", (LayerSpec.mha(1, 2, dtype=KVDtype.FP32),), page_size=1)
    arena = Arena(ArenaSpec((end,), arena_bytes=end.page_bytes * 6))
    state = arr(R, H, L, L, G, G)
    p2v = np.array([TOMBSTONE, TOMBSTONE, 0, 1, TOMBSTONE, TOMBSTONE], np.int64)
    v2p = np.array([2, 3], np.int64)
    good = plan_up(state, no_pins(6), 1, 4)
    copies = (state.copy(), p2v.copy(), v2p.copy())
    bad_page = MovePlan(UP, np.array([9], np.int64), np.array([1], np.int64), good.old_lo, good.old_hi,
                        good.new_lo, good.new_hi, 0)
    bad_band = MovePlan(UP, good.src_pages, good.dst_pages, good.old_lo, 60, good.new_lo, good.new_hi, 0)
    p2v_bad = p2v.copy()
    p2v_bad[3] = 7                                            # a virtual page past v2p
    for plan, p2v_arg in ((bad_page, p2v), (bad_band, p2v), (good, p2v_bad)):
        snap = p2v_arg.copy()
        with pytest.raises(InvariantError):
            apply_plan(arena, "full", plan, state=state, p2v=p2v_arg, v2p=v2p)
        assert (state == copies[0]).all() and (p2v_arg == snap).all() and (v2p == copies[2]).all()


_THREADS_SCRIPT = r"""
import sys
import numba, numpy as np, torch
torch.set_num_threads(int(sys.argv[1]))  # 1: what umalloc replay does around its token loop
from umalloc.pool.compaction import apply_plan, plan_up
from umalloc.pool.pagestate import PAGE_HOLE, PAGE_LIVE, PAGE_RESERVED, TOMBSTONE
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndSpec, KVDtype, LayerSpec
from umalloc.translators import cpu
end = EndSpec("full", (LayerSpec.mha(1, 4096, dtype=KVDtype.FP32),), page_size=1)   # 32 KiB pages
n = 1024                                                                        # 32 MiB moved
arena = Arena(ArenaSpec((end,), arena_bytes=end.page_bytes * (2 * n + 1)))
state = np.full(2 * n + 1, PAGE_LIVE, np.int8); state[0] = PAGE_RESERVED; state[1:n + 1] = PAGE_HOLE
p2v = np.full(2 * n + 1, TOMBSTONE, np.int64); p2v[n + 1:] = np.arange(n)
v2p = np.arange(n + 1, 2 * n + 1, dtype=np.int64)
plan = plan_up(state, np.zeros(2 * n + 1, np.int32), 1, 2 * n + 1)
moved = apply_plan(arena, "full", plan, state=state, p2v=p2v, v2p=v2p)
torch_after_compaction = torch.get_num_threads()
cpu.PARALLEL_MIN_ITEMS = 0                                                      # every translator kernel parallel
ids = torch.arange(1 << 16)
cpu.virtual_to_physical_pages(ids, ids.flip(0)); cpu.pages_to_runs(ids, ids); cpu.tokens_to_pages(ids, 4)
torch_after = torch.get_num_threads()  # before numba.get_num_threads(), which starts numba's pool itself
print(moved, torch_after_compaction, torch_after, numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS)
"""


@pytest.mark.parametrize("torch_threads", [1, 2])
def test_compaction_and_translators_keep_the_callers_threading(torch_threads: int) -> None:
    """Note [Compaction copies and threads]: a 32 MiB compaction (serial with 1 torch thread, parallel with 2)
    and parallel translator kernels leave torch's and numba's thread counts as the caller set them. A fresh
    interpreter: numba's thread pool starts (and used to reset torch's count) on its first use in a process."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_NUM_THREADS="2")
    res = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, str(torch_threads)], capture_output=True,
                         text=True, env=env, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(1024 * 32 * 1024), str(torch_threads), str(torch_threads), "True"]


# =============================================================================================================
# against the allocator: compaction through MultiEndedAllocator
# =============================================================================================================


def extend(alloc: MultiEndedAllocator, seq_len: int, bind=None) -> torch.Tensor | None:
    return alloc.alloc_extend(torch.tensor([0]), torch.tensor([seq_len]), torch.tensor([-1]), bind=bind)


def vpages_of(tokens: torch.Tensor) -> np.ndarray:
    return np.unique(tokens.numpy() // PAGE_SIZE)


def live_sets(alloc: MultiEndedAllocator) -> dict[str, list[int]]:
    return {e: np.flatnonzero(alloc.v2p(e).numpy()[1:] != TOMBSTONE).tolist() for e in alloc.spec.end_names}


def test_lazy_equals_eager_on_a_random_trace(three_end_allocator) -> None:
    seed = seed_from_env(11)
    rng = np.random.default_rng(seed)
    allocs = [three_end_allocator(arena_bytes=32 * 20, compaction=mode, debug_checks=True)
              for mode in ("eager", "lazy")]
    models = [ByteModel(a) for a in allocs]
    reqs: list[list[torch.Tensor]] = [[], []]
    eager_moved = 0
    for step in range(400):
        op = rng.random()
        if op < 0.5 or not reqs[0]:
            n = int(rng.integers(1, 8))
            bind = None if rng.random() < 0.7 else ["swa"]
            outs = [extend(a, n, bind) for a in allocs]
            assert (outs[0] is None) == (outs[1] is None), f"step {step}: one mode ran out of space"
            if outs[0] is not None:
                assert torch.equal(outs[0], outs[1]), f"step {step}: virtual ids differ"
                for i in range(2):
                    models[i].write(vpages_of(outs[i]))
                    reqs[i].append(outs[i])
        elif op < 0.85:
            j = int(rng.integers(len(reqs[0])))
            for i in range(2):
                t = reqs[i].pop(j)
                allocs[i].free(t)
                models[i].forget(vpages_of(t))
        else:  # SWA pages leave the window
            j = int(rng.integers(len(reqs[0])))
            t = reqs[0][j]
            cut = allocs[0].swa_tail_start(int(t.numel()), 4, 0, PAGE_SIZE)
            vps = vpages_of(t[:cut])
            bound = vps[allocs[0].v2p("swa").numpy()[vps] != TOMBSTONE]
            if bound.size:
                for i in range(2):
                    allocs[i].unbind_end("swa", torch.from_numpy(bound * PAGE_SIZE))
                    models[i].forget(bound, ["swa"])
        assert live_sets(allocs[0]) == live_sets(allocs[1]), f"step {step}: live sets differ"
        assert models[0].pages.keys() == models[1].pages.keys()
        for key, data in models[0].pages.items():
            assert torch.equal(data, models[1].pages[key])
        for m in models:
            m.check()  # bytes read back through each allocator's own tables
    eager_moved = sum(s.pages_moved for s in allocs[0].stats().values())
    assert eager_moved > 0, "eager compaction never moved a page: the trace lost its point"
    lazy_moved = sum(s.pages_moved for s in allocs[1].stats().values())
    assert lazy_moved <= eager_moved


def test_churn_3000_steps_move_budget_2_ends_with_no_ghost_page(three_end_allocator) -> None:
    seed = seed_from_env(3)
    rng = np.random.default_rng(seed)
    clock = FakeClock()
    alloc = three_end_allocator(arena_bytes=32 * 16, compaction="lazy", move_budget_pages=2, clock=clock)
    model = ByteModel(alloc)
    reqs: list[torch.Tensor] = []
    leases: list[tuple[object, dict[str, np.ndarray], dict[str, torch.Tensor]]] = []
    nones = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.4:
            t = extend(alloc, int(rng.integers(1, 6)))
            if t is None:
                nones += 1
            else:
                model.write(vpages_of(t))
                reqs.append(t)
        elif op < 0.65 and reqs:
            t = reqs.pop(int(rng.integers(len(reqs))))
            alloc.free(t)
            model.forget(vpages_of(t))
        elif op < 0.75 and reqs:
            t = reqs[int(rng.integers(len(reqs)))]
            end = str(rng.choice(["full", "draft", "swa"]))
            vps = vpages_of(t)
            phys = alloc.v2p(end).numpy()[vps]
            phys = phys[phys != TOMBSTONE]
            if phys.size:
                deadline = None if rng.random() < 0.5 else float(rng.integers(1, 5))
                lease = alloc.lease({end: torch.from_numpy(phys)}, deadline_s=deadline, tag=f"s{step}")
                env = alloc.arena.envelopes(end)
                leases.append((lease, {end: phys}, {end: env[torch.from_numpy(phys)].clone()}))
        elif op < 0.85 and leases:
            leases.pop(int(rng.integers(len(leases))))[0].release()
        elif op < 0.9:
            clock.now += 1.0
        else:
            report = alloc.compact(budget_pages=2)
            assert report.pages_moved <= 2 * 3
        # pinned pages: bytes and addresses unchanged while the lease is active
        for lease, phys, data in leases:
            if lease.state != "active":
                continue
            for end, p in phys.items():
                assert torch.equal(alloc.arena.envelopes(end)[torch.from_numpy(p)], data[end]), f"step {step}"
        alloc.check_invariants()
        assert_no_ghost_pages(alloc)
        if step % 10 == 0:
            model.check()
    model.check()
    assert nones > 0, "the pool never filled up: the churn lost its point"
    for lease, _, _ in leases:
        lease.release()
    for t in reqs:
        alloc.free(t)
    alloc.compact()
    alloc.check_invariants()
    for end, s in alloc.stats().items():
        assert (s.live_pages, s.hole_pages, s.pending_pages, s.pinned_pages) == (0, 0, 0, 0), (end, s)
        assert s.gap_pages + s.reserved_pages == s.num_page_slots
    assert alloc.leases_active() == 0


def test_in_flight_transfer_pages_stay_put_until_release(two_end_allocator) -> None:
    alloc = two_end_allocator(arena_bytes=32 * 16, compaction="lazy", debug_checks=True)
    model = ByteModel(alloc)
    a, b, c = extend(alloc, 6), extend(alloc, 6), extend(alloc, 4)  # full pages 1-3, 4-6, 7-8
    for t in (a, b, c):
        model.write(vpages_of(t))
    c_vp = vpages_of(c)
    c_phys = {e: alloc.translate_pages(torch.from_numpy(c_vp), e) for e in ("full", "swa")}
    assert c_phys["full"].tolist() == [7, 8]
    c_bytes = {e: alloc.arena.envelopes(e)[c_phys[e]].clone() for e in c_phys}
    c_addr = {e: [alloc.arena.page_address(e, int(p)) for p in c_phys[e]] for e in c_phys}

    def c_unchanged() -> None:
        for e in c_phys:
            assert torch.equal(alloc.arena.envelopes(e)[c_phys[e]], c_bytes[e])
            assert [alloc.arena.page_address(e, int(p)) for p in c_phys[e]] == c_addr[e]

    lease = alloc.lease(c_phys, tag="xfer-c")
    alloc.free(a)  # holes 1-3 below b and c
    model.forget(vpages_of(a))
    report = alloc.compact()
    # c is a wall at the far edge of full; b sits below it: nothing on full may move
    assert report.moved_by_end.get("full", 0) == 0
    assert report.pages_skipped_pinned >= 2
    assert alloc.translate_pages(torch.from_numpy(c_vp), "full").tolist() == [7, 8]
    c_unchanged()
    d = extend(alloc, 4)  # reallocate around: takes holes 1, 2
    model.write(vpages_of(d))
    assert alloc.translate_pages(torch.from_numpy(vpages_of(d)), "full").tolist() == [1, 2]
    alloc.free(c)  # the transfer may still read c: its pages go pending, never reused
    model.forget(c_vp)
    assert alloc.stats()["full"].pending_pages == 2 and alloc.stats()["swa"].pending_pages == 2
    fillers = []
    while (t := extend(alloc, 2)) is not None:
        fillers.append(t)
        model.write(vpages_of(t))
        for e in c_phys:
            assert not np.isin(alloc.translate_pages(torch.from_numpy(vpages_of(t)), e).numpy(),
                               c_phys[e].numpy()).any(), "a pending page was handed out"
    alloc.compact()
    c_unchanged()
    model.check()
    lease.release()  # transfer done: pending pages become holes, compaction proceeds
    for t in fillers[: len(fillers) // 2]:
        alloc.free(t)
        model.forget(vpages_of(t))
    report = alloc.compact()
    assert report.pages_moved > 0
    s = alloc.stats()
    assert s["full"].hole_pages == 0 and s["full"].watermark == 1 + s["full"].live_pages
    assert s["swa"].hole_pages == 0 and s["swa"].watermark == s["swa"].top_page - s["swa"].live_pages
    model.check()
    assert_no_ghost_pages(alloc)


def test_F17_a_lease_reaches_every_end_and_every_move_path(three_end_allocator) -> None:
    for mode in ("eager", "lazy"):
        alloc = three_end_allocator(arena_bytes=32 * 24, compaction=mode, debug_checks=True)
        model = ByteModel(alloc)
        reqs = [extend(alloc, 4) for _ in range(5)]
        for t in reqs:
            model.write(vpages_of(t))
        pinned = reqs[3]  # near the far edge of every end
        vp = vpages_of(pinned)
        phys = {e: alloc.translate_pages(torch.from_numpy(vp), e) for e in alloc.spec.end_names}
        data = {e: alloc.arena.envelopes(e)[p].clone() for e, p in phys.items()}
        lease = alloc.lease(phys, tag="all-ends")
        live = reqs[4]  # the farthest request stays live and pinned on every end
        live_phys = {e: alloc.translate_pages(torch.from_numpy(vpages_of(live)), e) for e in alloc.spec.end_names}
        live_lease = alloc.lease(live_phys, tag="live-all-ends")
        assert all(alloc.moves_blocked(e) for e in alloc.spec.end_names)
        avail0 = {e: alloc.available_pages(e) for e in alloc.spec.end_names}
        alloc.free(pinned)  # eager: compaction on free; must honour the pins on every end
        model.forget(vp)
        alloc.free(reqs[0])
        model.forget(vpages_of(reqs[0]))
        alloc.compact()  # explicit path
        refill = extend(alloc, 12)  # lazy path: shortfall ladder may compact
        if refill is not None:
            model.write(vpages_of(refill))
        for e, p in phys.items():
            assert torch.equal(alloc.arena.envelopes(e)[p], data[e]), f"{mode}: pinned {e} page moved/overwritten"
            assert (alloc.ends[e].state[p.numpy()] == PAGE_PENDING).all(), f"{mode}: {e} pages not pending"
            assert alloc.stats()[e].pending_pages == 2
            assert torch.equal(alloc.translate_pages(torch.from_numpy(vpages_of(live)), e), live_phys[e]), \
                f"{mode}: a live pinned {e} page moved"
        model.check()
        if refill is not None:
            alloc.free(refill)
            model.forget(vpages_of(refill))
        avail1 = {e: alloc.available_pages(e) for e in alloc.spec.end_names}
        lease.release()
        # capacity recomputed when holds change: each end gains exactly its pending pages
        avail2 = {e: alloc.available_pages(e) for e in alloc.spec.end_names}
        for e in alloc.spec.end_names:
            assert alloc.stats()[e].pending_pages == 0
            # each end gains at least its own 2 pending pages (a float end may gain more: a neighbour that
            # retreats widens its reachable gap); a stale cached figure would show no gain
            assert avail2[e] - avail1[e] >= 2, (mode, e, avail0[e], avail1[e], avail2[e])
        if mode == "lazy":  # no compaction on unpin: the up end gains exactly its pending pages
            assert avail2["full"] - avail1["full"] == 2
        live_lease.release()
        alloc.compact()
        model.check()
        assert_no_ghost_pages(alloc)
        # the regained space is usable: fill every end, data intact
        while (t := extend(alloc, 2)) is not None:
            model.write(vpages_of(t))
        assert all(alloc.stats()[e].hole_pages == 0 for e in alloc.spec.end_names)
        model.check()
        alloc.check_invariants()


# ---- hypothesis state machine: alloc / free / lease / release / expire / compact -----------------------------
class LeaseCompactionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.alloc = MultiEndedAllocator(Arena(ArenaSpec(three_ends(), arena_bytes=32 * 12)), compaction="lazy",
                                         move_budget_pages=1, clock=self.clock)  # hypothesis: no fixtures
        self.model = ByteModel(self.alloc)
        self.reqs: list[torch.Tensor] = []
        self.leases: list[tuple[object, dict[str, np.ndarray], dict[str, torch.Tensor]]] = []

    @rule(n=st.integers(1, 6), bind_all=st.booleans())
    def alloc_extend(self, n, bind_all) -> None:
        t = extend(self.alloc, n, None if bind_all else ["swa"])
        if t is not None:
            self.model.write(vpages_of(t))
            self.reqs.append(t)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data) -> None:
        t = self.reqs.pop(data.draw(st.integers(0, len(self.reqs) - 1)))
        self.alloc.free(t)
        self.model.forget(vpages_of(t))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), deadline=st.one_of(st.none(), st.sampled_from([1.0, 2.0])))
    def lease(self, data, deadline) -> None:
        t = self.reqs[data.draw(st.integers(0, len(self.reqs) - 1))]
        pages, saved = {}, {}
        for end in data.draw(st.lists(st.sampled_from(["full", "draft", "swa"]), min_size=1, unique=True)):
            p = self.alloc.v2p(end).numpy()[vpages_of(t)]
            p = p[p != TOMBSTONE]
            if p.size:
                pages[end] = p
                saved[end] = self.alloc.arena.envelopes(end)[torch.from_numpy(p)].clone()
        if pages:
            lease = self.alloc.lease({e: torch.from_numpy(p) for e, p in pages.items()}, deadline_s=deadline)
            self.leases.append((lease, pages, saved))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release_lease(self, data) -> None:
        lease = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))[0]
        lease.release()
        lease.release()  # harmless

    @rule()
    def advance_clock(self) -> None:
        self.clock.now += 1.0
        self.alloc.leases_active()  # an allocator call: reclaims what is due
        for lease, _, _ in self.leases:
            assert lease.state != "active" or lease.deadline is None or lease.deadline > self.clock.now

    @rule(budget=st.one_of(st.none(), st.integers(0, 3)))
    def compact(self, budget) -> None:
        self.alloc.compact(budget_pages=budget)

    @invariant()
    def consistent(self) -> None:
        self.alloc.check_invariants()
        assert_no_ghost_pages(self.alloc)
        self.model.check()
        for lease, pages, saved in self.leases:
            if lease.state != "active":
                continue
            for end, p in pages.items():
                pins = self.alloc.lease_table.pin_count(end)
                assert (pins[p] > 0).all()
                assert torch.equal(self.alloc.arena.envelopes(end)[torch.from_numpy(p)], saved[end])


TestLeaseCompactionMachine = LeaseCompactionMachine.TestCase
TestLeaseCompactionMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
