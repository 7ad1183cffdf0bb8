"""MultiEndedAllocator: exact placement orders, token semantics, failures that change nothing, capacity over shared
gaps, floats, leases/pending pages, observability.

Every expected page sequence below is worked out by hand from the geometry in the comment above it (page
bytes, first/top pages, Note [Placement order] of umalloc.allocator.facade).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_helpers import T, draft_end, full_end, pages, swa_end

from umalloc.allocator.facade import V_FREED, V_LIVE, MultiEndedAllocator, snapshots_equal
from umalloc.errors import (
    DoubleFreeError,
    InvalidIdError,
    InvariantError,
    LeaseError,
    NotAllocatedError,
    TombstoneError,
    UmallocValueError,
)
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import Grow
from umalloc.pool.kernels.layout import M_HBOFF, M_PB, M_VOFF
from umalloc.pool.pagestate import PAGE_GAP, PAGE_HOLE, PAGE_LIVE, PAGE_PENDING, PAGE_RESERVED, TOMBSTONE
from umalloc.testing import writable_end_tables as W


# ---- placement orders ------------------------------------------------------------------------------------------
def test_fresh_pages_are_ascending_runs_on_both_ends(full_swa) -> None:
    alloc = full_swa()
    vp = alloc.alloc_pages(3)
    assert vp.tolist() == [1, 2, 3]
    assert pages(alloc, vp, "full") == [1, 2, 3]        # up end: [hi, hi + 3)
    assert pages(alloc, vp, "swa") == [7, 8, 9]         # down end: [lo - 3, lo), handed out ascending
    vp2 = alloc.alloc_pages(1)
    assert vp2.tolist() == [4] and pages(alloc, vp2, "full") == [4] and pages(alloc, vp2, "swa") == [6]
    assert alloc.band("full") == (1, 5) and alloc.band("swa") == (6, 10)
    assert alloc.watermark("full") == 5 and alloc.watermark("swa") == 5
    assert alloc.num_contiguous_runs(torch.cat([vp, vp2]), "full") == 1
    assert alloc.num_contiguous_runs(torch.cat([vp, vp2]), "swa") == 2     # 7 8 9 | 6


def test_up_end_drains_lowest_holes_down_end_highest_holes(full_swa) -> None:
    alloc = full_swa()
    vp = alloc.alloc_pages(4)                 # full 1 2 3 4, swa 6 7 8 9 (v1 -> 6 ... v4 -> 9)
    assert pages(alloc, vp, "swa") == [6, 7, 8, 9]
    alloc.free(T(2 * 2, 3 * 2))               # vpages 2, 3: full holes {2, 3}; swa holes {7, 8}
    assert alloc.stats()["full"].hole_pages == 2 and alloc.stats()["swa"].hole_pages == 2
    v = alloc.alloc_pages(1)
    assert v.tolist() == [2]                                  # lowest free virtual id
    assert pages(alloc, v, "full") == [2]                     # lowest hole of the up end
    assert pages(alloc, v, "swa") == [8]                      # highest hole of the down end
    v = alloc.alloc_pages(1)
    assert v.tolist() == [3] and pages(alloc, v, "full") == [3] and pages(alloc, v, "swa") == [7]


def test_holes_first_then_fresh_band_all_ascending(full_swa) -> None:
    alloc = full_swa()
    alloc.alloc_pages(4)                       # full 1..4, swa 6..9
    alloc.free(T(1 * 2, 3 * 2))                # vpages 1, 3: full holes {1, 3}; swa page 6 is the edge -> trimmed,
    assert alloc.band("swa") == (7, 10)        # page 8 a hole
    assert alloc.ends["swa"].state[6] == PAGE_GAP and alloc.ends["swa"].state[8] == PAGE_HOLE
    v = alloc.alloc_pages(2)
    assert v.tolist() == [1, 3]
    assert pages(alloc, v, "full") == [1, 3]                  # two holes, ascending
    assert pages(alloc, v, "swa") == [6, 8]                   # fresh page 6 (lo 7 -> 6) then hole 8: ascending


def test_freeing_the_frontier_retreats_the_band_over_trailing_holes(full_swa) -> None:
    alloc = full_swa()
    vp = alloc.alloc_pages(4)                 # full 1..4
    alloc.free(T(2 * 2, 3 * 2))               # full holes 2, 3 (page 4 still live)
    assert alloc.band("full") == (1, 5)
    alloc.free(T(4 * 2))                      # page 4 at the edge: 4, 3, 2 become gap
    assert alloc.band("full") == (1, 2)
    assert alloc.ends["full"].state[1:6].tolist() == [PAGE_LIVE, PAGE_GAP, PAGE_GAP, PAGE_GAP, PAGE_GAP]
    assert alloc.stats()["full"].hole_pages == 0
    alloc.free(vp[:1] * 2)
    assert alloc.band("full") == (1, 1) and alloc.band("swa") == (10, 10)


# ---- byte frontiers ---------------------------------------------------------------------------------------------
def test_byte_frontiers_with_different_page_bytes(checked_allocator) -> None:
    # full: 32 B pages, slots 0..9; swa: 16 B pages, first 2 (floor 32 B), slots 0..19; 320 B arena
    alloc = checked_allocator((full_end(), swa_end(head_dim=2)), 320)
    assert alloc.num_vpages() == 10 and alloc.ends["swa"].num_page_slots == 20
    vp = alloc.alloc_pages(3)
    assert pages(alloc, vp, "full") == [1, 2, 3]              # bytes [32, 128)
    assert pages(alloc, vp, "swa") == [17, 18, 19]            # bytes [272, 320)
    # full may grow while its pages stay below byte 272: 272 // 32 = 8 -> 4 more pages (4..7)
    assert alloc.available_pages("full") == 4
    # swa may grow down to ceil(128 / 16) = page 8: 17 - 8 = 9 more pages
    assert alloc.available_pages("swa") == 9
    assert alloc.available_tokens("swa") == 18
    assert alloc.can_alloc({"full": 4}) and alloc.can_alloc({"swa": 9})
    # jointly: full to page 8 (byte 256) leaves swa ceil(256/16) = 16 .. 16: one page
    assert alloc.shortfall_pages({"full": 4, "swa": 4}) == {"swa": 3}
    assert not alloc.can_alloc({"full": 4, "swa": 4})
    snap = alloc.snapshot()
    assert alloc.alloc_pages(4) is None
    assert alloc.last_shortfall == {"swa": 3}
    assert snapshots_equal(snap, alloc.snapshot())
    v = alloc.alloc_pages(2)                  # full 4, 5 (bytes < 192); swa 15, 16 (bytes >= 240)
    assert pages(alloc, v, "full") == [4, 5] and pages(alloc, v, "swa") == [15, 16]
    st = alloc.stats()
    assert st["full"].band_hi * 32 <= st["swa"].band_lo * 16


# ---- alloc_extend / alloc_decode --------------------------------------------------------------------------------
def test_alloc_extend_fills_partial_pages_then_fresh_pages(checked_allocator) -> None:
    alloc = checked_allocator((full_end(ps=4), swa_end(ps=4)), 64 * 20)   # page_size 4 (64 B pages), pages 1..19
    t = alloc.alloc_extend(T(0, 0, 0), T(5, 4, 1), T(-1, -1, -1))
    # request 0: tokens 0..4 -> vpages 1, 2; request 1: 0..3 -> vpage 3; request 2: token 0 -> vpage 4
    assert t.tolist() == [4, 5, 6, 7, 8, 12, 13, 14, 15, 16]
    # request 0 continues at position 5 from last_loc 8 (offset 0 of vpage 2) to 10 tokens: 9 10 11 | 20 21
    # request 2 continues from 16 with 2 tokens: 17 18; request 1 (full page) gets vpage 6 for token 4
    t2 = alloc.alloc_extend(T(5, 1, 4), T(10, 3, 5), T(8, 16, 15))
    assert t2.tolist() == [9, 10, 11, 20, 21, 17, 18, 24]
    assert alloc.stats()["full"].live_pages == 6
    assert alloc.translate(T(20, 24), "full").tolist() == [20, 24]   # vpages 5, 6 -> physical 5, 6
    # empty extend and zero-length batch
    assert alloc.alloc_extend(T(3), T(3), T(18)).tolist() == []
    assert alloc.alloc_extend(T(), T(), T()).tolist() == []


def test_alloc_extend_out_buffer(full_swa) -> None:
    alloc = full_swa()
    out = torch.full((3,), -7, dtype=torch.int64)
    res = alloc.alloc_extend(T(0), T(3), T(-1), out=out)
    assert res is out and out.tolist() == [2, 3, 4]
    with pytest.raises(InvalidIdError, match="allowed exactly 2"):
        alloc.alloc_extend(T(3), T(5), T(4), out=torch.empty(3, dtype=torch.int64))


def test_alloc_decode_new_page_only_on_boundaries(full_swa) -> None:
    alloc = full_swa()
    assert alloc.alloc_decode(T(1, 1), T(-1, -1)).tolist() == [2, 4]
    assert alloc.alloc_decode(T(2, 2), T(2, 4)).tolist() == [3, 5]
    out = torch.empty(2, dtype=torch.int64)
    assert alloc.alloc_decode(T(3, 3), T(3, 5), out=out) is out
    assert out.tolist() == [6, 8]                               # vpages 3, 4 (positions 2 start pages)
    assert alloc.stats()["full"].live_pages == 4 and alloc.stats()["swa"].live_pages == 4


def test_decode_and_extend_refuse_bad_last_loc(full_swa) -> None:
    alloc = full_swa()
    t = alloc.alloc_extend(T(0), T(3), T(-1))                   # tokens 2 3 4
    with pytest.raises(InvalidIdError, match="page offset"):
        alloc.alloc_decode(T(4), T(3))                          # position 2 is token 4, not 3
    with pytest.raises(InvalidIdError, match="no prefix"):
        alloc.alloc_extend(T(0), T(2), T(4))
    with pytest.raises(InvalidIdError, match="prefix_len=3, seq_len=2"):
        alloc.alloc_extend(T(3), T(2), T(4))
    with pytest.raises(InvalidIdError, match="seq_len >= 1"):
        alloc.alloc_decode(T(0), T(-1))
    with pytest.raises(InvalidIdError, match="another request"):
        alloc.alloc_decode(T(4, 4), T(int(t[2]), int(t[2])))   # the same partial page extended twice
    with pytest.raises(NotAllocatedError):
        alloc.alloc_decode(T(2), T(10))                         # vpage 5: never allocated


# ---- failures change nothing --------------------------------------------------------------------------------------
def _populated(full_swa) -> MultiEndedAllocator:
    alloc = full_swa()
    alloc.alloc_extend(T(0, 0), T(3, 2), T(-1, -1))            # vpages 1 2 | 3 ; tokens 2 3 4 | 6 7
    alloc.alloc_pages(1, bind=[])                               # vpage 4 on full only
    alloc.free(T(6))                                            # vpage 3 freed (a hole on full)
    return alloc


MISUSE = [
    ("double free", lambda a: a.free(T(6)), DoubleFreeError),
    ("never allocated", lambda a: a.free(T(12)), NotAllocatedError),
    ("out of range", lambda a: a.free(T(20)), InvalidIdError),
    ("negative", lambda a: a.free(T(-1)), InvalidIdError),
    ("sink page", lambda a: a.free(T(1)), InvalidIdError),
    ("bad page in a good batch", lambda a: a.free(T(2, 3, 12)), NotAllocatedError),
    ("float dtype", lambda a: a.free(torch.tensor([2.0])), InvalidIdError),
    ("int32 never allocated", lambda a: a.free(torch.tensor([12], dtype=torch.int32)), NotAllocatedError),
    ("2-D", lambda a: a.free(torch.tensor([[2]])), InvalidIdError),
    ("a list", lambda a: a.free([2]), InvalidIdError),
    ("unbind on the owner", lambda a: a.unbind_end("full", T(2)), UmallocValueError),
    ("unbind unknown end", lambda a: a.unbind_end("nope", T(2)), UmallocValueError),
    ("unbind unbound (strict)", lambda a: a.unbind_end("swa", T(8)), NotAllocatedError),
    ("unbind freed", lambda a: a.unbind_end("swa", T(6)), DoubleFreeError),
    ("bind already bound", lambda a: a.bind_end("swa", T(2)), InvalidIdError),
    ("bind on the owner", lambda a: a.bind_end("full", T(8)), UmallocValueError),
    ("extend shape mismatch", lambda a: a.alloc_extend(T(0), T(1, 1), T(-1)), InvalidIdError),
    ("decode offset", lambda a: a.alloc_decode(T(4), T(3)), InvalidIdError),
    ("tail unbound on swa", lambda a: a.alloc_decode(T(2), T(8)), NotAllocatedError),
    ("bind names the owner", lambda a: a.alloc_pages(1, bind=["full"]), UmallocValueError),
    ("bind as a str", lambda a: a.alloc_pages(1, bind="swa"), UmallocValueError),
    ("negative num_pages", lambda a: a.alloc_pages(-1), UmallocValueError),
    ("owner is bound", lambda a: a.alloc_pages(1, owner="swa"), UmallocValueError),
    ("translate out of range", lambda a: a.translate(T(20), "full", strict=False), InvalidIdError),
    ("translate tombstone", lambda a: a.translate(T(8), "swa"), TombstoneError),
    ("lease a hole", lambda a: a.lease({"full": T(3)}), LeaseError),
    ("lease the sink", lambda a: a.lease({"full": T(0)}), LeaseError),
    ("out wrong dtype", lambda a: a.alloc_decode(T(1), T(-1), out=torch.empty(1)), InvalidIdError),
]


@pytest.mark.parametrize("case,call,exc", MISUSE, ids=[m[0] for m in MISUSE])
def test_misuse_raises_typed_error_and_changes_nothing(full_swa, case, call, exc) -> None:
    alloc = _populated(full_swa)
    before = alloc.snapshot()
    with pytest.raises(exc):
        call(alloc)
    assert snapshots_equal(before, alloc.snapshot()), case
    alloc.check_invariants()


def test_out_of_space_returns_none_and_changes_nothing(full_swa) -> None:
    alloc = full_swa()
    alloc.alloc_extend(T(0), T(7), T(-1))                       # 4 pages on each end: 8 of 9 used
    before = alloc.snapshot()
    assert alloc.alloc_extend(T(0), T(1), T(-1)) is None        # needs a page on full and on swa: 1 left
    assert alloc.alloc_decode(T(1), T(-1)) is None
    assert alloc.alloc_pages(1) is None
    assert alloc.last_shortfall == {"swa": 1}
    assert snapshots_equal(before, alloc.snapshot())
    v = alloc.alloc_pages(1, bind=[])                           # the owner alone fits
    assert pages(alloc, v, "full") == [5]


# ---- unbind_end / bind_end -------------------------------------------------------------------------------------
def test_unbind_end_tombstones_only_the_bound_end(full_swa) -> None:
    alloc = full_swa()
    t = alloc.alloc_extend(T(0), T(6), T(-1))                   # vpages 1 2 3: swa 7 8 9
    alloc.unbind_end("swa", t[:3])                             # tokens 2 3 4: vpages 1, 2
    assert pages(alloc, T(1, 2, 3), "swa") == [0, 0, 9]
    assert pages(alloc, T(1, 2, 3), "full") == [1, 2, 3]
    assert alloc.band("swa") == (9, 10)                         # 7 and 8 were the frontier: retreated
    with pytest.raises(TombstoneError):
        alloc.translate(t[:1], "swa")
    assert alloc.translate(t[:1], "swa", strict=False).tolist() == [0]   # the sink
    alloc.unbind_end("swa", t, strict=False)                   # skips the unbound ones, releases vpage 3
    assert alloc.stats()["swa"].live_pages == 0 and alloc.stats()["swa"].pages_unbound == 3
    alloc.free(t)
    assert alloc.stats()["full"].pages_freed == 3 and alloc.stats()["swa"].pages_freed == 0


def test_bind_end_binds_the_window_tail(full_swa) -> None:
    alloc = full_swa()
    t = alloc.alloc_extend(T(0), T(8), T(-1), bind=[])          # vpages 1..4 on full only
    assert alloc.stats()["swa"].live_pages == 0
    assert alloc.bind_end("swa", t[4:])                         # tokens of vpages 3, 4 -> swa 8, 9
    assert pages(alloc, T(1, 2, 3, 4), "swa") == [0, 0, 8, 9]
    assert alloc.bind_end("swa", T())                           # nothing to do
    # decode continues on a bound tail
    assert alloc.alloc_decode(T(9), T(int(t[-1]))).tolist() == [10]
    assert pages(alloc, T(5), "swa") == [7]


def test_bind_end_out_of_space_returns_false(full_swa) -> None:
    alloc = full_swa()
    alloc.alloc_pages(6, bind=[])                               # full 1..6; swa may use 7..9
    t = (alloc.alloc_pages(1, bind=[]) * 2)                     # full 7: swa 8..9 left
    assert pages(alloc, t // 2, "full") == [7]
    before = alloc.snapshot()
    assert not alloc.bind_end("swa", T(2, 4, 6))
    assert snapshots_equal(before, alloc.snapshot())
    assert alloc.bind_end("swa", T(2, 4))


# ---- translation --------------------------------------------------------------------------------------------
def test_translate_tokens_and_pages_and_padding(full_swa) -> None:
    alloc = full_swa()
    t = alloc.alloc_extend(T(0), T(3), T(-1))
    assert alloc.translate(t, "full").tolist() == [2, 3, 4]
    assert alloc.translate(t, "swa").tolist() == [16, 17, 18]   # swa pages 8, 9
    assert alloc.translate(T(0, 1), "swa").tolist() == [0, 1]   # padding lanes hit the sink
    out = torch.empty(3, dtype=torch.int64)
    assert alloc.translate(t, "swa", out=out) is out and out.tolist() == [16, 17, 18]
    assert alloc.translate_pages(T(1, 2), "swa").tolist() == [8, 9]
    with pytest.raises(TombstoneError):
        alloc.translate_pages(T(3), "full")
    assert alloc.translate_pages(T(3), "full", strict=False).tolist() == [0]
    with pytest.raises(InvalidIdError):
        alloc.translate_pages(T(10), "full", strict=False)
    assert alloc.v2p("swa").tolist() == [0, 8, 9] + [TOMBSTONE] * 7
    assert alloc.p2v("swa").tolist()[8:] == [1, 2]
    assert alloc.num_contiguous_runs(T(), "full") == 0


def test_sequence_and_dtype_errors_name_the_allowed_values(full_swa) -> None:
    alloc = full_swa()
    with pytest.raises(InvalidIdError, match="integer dtype"):
        alloc.translate(torch.tensor([1.0]), "full")
    with pytest.raises(UmallocValueError, match=r"allowed one of \['full', 'swa'\]"):
        alloc.available_pages("draft")


def test_non_contiguous_inputs_are_accepted(full_swa) -> None:
    alloc = full_swa()
    t = alloc.alloc_extend(T(0), T(6), T(-1))
    alloc.free(t[::2])                                          # tokens 2, 4, 6: all three pages
    assert alloc.stats()["full"].live_pages == 0


# ---- two owners ----------------------------------------------------------------------------------------------
def test_two_id_owners_need_an_explicit_owner(checked_allocator) -> None:
    # draft with page_size 4 is its own id owner (grows down)
    alloc = checked_allocator((full_end(), draft_end(ps=4, head_dim=2, grow=Grow.DOWN, owner=None)), 640)
    with pytest.raises(UmallocValueError, match="ambiguous"):
        alloc.alloc_pages(1)
    a = alloc.alloc_pages(2, owner="full")
    b = alloc.alloc_pages(1, owner="draft")
    assert a.tolist() == [1, 2] and b.tolist() == [1]
    assert pages(alloc, a, "full") == [1, 2]
    assert pages(alloc, b, "draft") == [19]                     # 32 B pages, top 19
    alloc.free(b * 4, owner="draft")
    with pytest.raises(DoubleFreeError):
        alloc.free(b * 4, owner="draft")
    assert alloc.stats()["full"].live_pages == 2


# ---- the float end --------------------------------------------------------------------------------------------
def test_float_end_is_placed_at_the_split_then_grows_up_then_down(float3) -> None:
    alloc = float3()
    vp = alloc.alloc_pages(2)
    # up/down first: full 1, 2 (bytes < 96); swa 18, 19 (bytes >= 576). draft: gap bytes [96, 576), split 0.5
    # -> byte 336 -> page ceil(336 / 16) = 21: band [21, 23)
    assert pages(alloc, vp, "full") == [1, 2]
    assert pages(alloc, vp, "swa") == [18, 19]
    assert pages(alloc, vp, "draft") == [21, 22]
    v = alloc.alloc_pages(1)                                    # draft grows hi upward: 23
    assert pages(alloc, v, "full") == [3] and pages(alloc, v, "swa") == [17] and pages(alloc, v, "draft") == [23]
    # full may only grow below the draft's first byte (21 * 16 = 336): pages 4..9
    assert alloc.available_pages("full") == 10 - 4
    # push swa down onto the draft's top (24 * 16 = 384 = page 12 of swa); full takes 4..8
    filler = alloc.alloc_pages(5, bind=["swa"])
    assert pages(alloc, filler, "swa") == [12, 13, 14, 15, 16] and pages(alloc, filler, "full") == [4, 5, 6, 7, 8]
    v = alloc.alloc_pages(1, bind=["draft"])                    # full 9 (bytes < 320); draft cannot grow up:
    assert pages(alloc, v, "full") == [9] and pages(alloc, v, "draft") == [20]   # lo 21 -> 20 (byte 320)
    assert alloc.available_pages("full") == 0 and alloc.available_pages("draft") == 0
    assert alloc.alloc_pages(1, bind=["draft"]) is None and alloc.last_shortfall == {"full": 1, "draft": 1}
    alloc.check_invariants()


def test_empty_float_end_is_replaced_by_its_next_allocation(float3) -> None:
    alloc = float3()
    vp = alloc.alloc_pages(2)
    alloc.free(vp * 2)
    assert alloc.band("draft")[0] == alloc.band("draft")[1]     # empty again
    big = alloc.alloc_pages(8, bind=[])                         # full 1..8 (bytes < 288)
    assert pages(alloc, big, "full")[-1] == 8
    v = alloc.alloc_pages(1, bind=["draft"])
    # full takes page 9 first (bytes < 320); gap [320, 640): split at byte 480 -> draft page 30
    assert pages(alloc, v, "full") == [9] and pages(alloc, v, "draft") == [30]


def test_float_split_is_configurable_and_validated(float3) -> None:
    alloc = float3(float_split={"draft": 0.0})
    v = alloc.alloc_pages(1)                                    # full 1, swa 19; gap [64, 608): draft page 4
    assert pages(alloc, v, "draft") == [4]
    with pytest.raises(UmallocValueError):
        float3(float_split={"full": 0.5})
    with pytest.raises(UmallocValueError):
        float3(float_split=1.5)


@pytest.mark.parametrize("draft_sliding", ["swa", "draft"])
def test_default_preset_gemma_with_a_float_end(draft_sliding: str) -> None:
    from umalloc.geometry.presets import DEFAULT_PRESET, preset_arena_spec

    # page_size 16, 64 MiB arena. "swa": 1 MiB full, 5.3 MiB swa (floating), 64 KiB draft pages (down);
    # "draft": 1 MiB full, 5 MiB swa (down), 416 KiB draft pages (floating)
    spec = preset_arena_spec(DEFAULT_PRESET, 64 << 20, draft_sliding=draft_sliding)
    alloc = MultiEndedAllocator(Arena(spec), debug_checks=True)
    floating = "swa" if draft_sliding == "swa" else "draft"
    assert {e.name: e.grow for e in spec.ends} == {"full": Grow.UP, "swa": Grow.DOWN, "draft": Grow.DOWN,
                                                    floating: Grow.FLOAT}
    t = alloc.alloc_extend(T(0, 0), T(40, 17), T(-1, -1))
    assert t is not None and t.numel() == 57
    for end in ("full", "swa", "draft"):
        assert alloc.num_contiguous_runs(torch.unique(t // 16), end) == 1
    alloc.unbind_end("swa", t[:16])
    alloc.free(t)
    assert all(s.live_pages == 0 for s in alloc.stats().values())


# ---- leases and pending pages -----------------------------------------------------------------------------------
def test_pinned_freed_pages_stay_pending_until_the_lease_is_released(full_swa) -> None:
    now = [0.0]
    alloc = full_swa(clock=lambda: now[0])
    vp = alloc.alloc_pages(3)                                   # full 1 2 3, swa 7 8 9
    lease = alloc.lease({"full": T(2), "swa": T(8)}, tag="xfer")
    assert alloc.leases_active() == 1 and alloc.moves_blocked("full") and alloc.moves_blocked("swa")
    alloc.free(vp[1:2] * 2)                                     # vpage 2: full 2, swa 8 pinned -> pending
    st = alloc.stats()
    assert st["full"].pending_pages == 1 and st["swa"].pending_pages == 1
    assert st["full"].hole_pages == 0 and st["full"].free_pages == 3   # only the gap 4..6 is usable
    assert alloc.ends["full"].state[2] == PAGE_PENDING
    v = alloc.alloc_pages(1)                                    # vpage 2 again, on fresh pages
    assert v.tolist() == [2] and pages(alloc, v, "full") == [4] and pages(alloc, v, "swa") == [6]
    lease.release()
    assert alloc.ends["full"].state[2] == PAGE_HOLE and alloc.ends["swa"].state[8] == PAGE_HOLE
    assert pages(alloc, v, "full") == [4]                       # the re-minted id kept its own page
    w = alloc.alloc_pages(1)
    assert pages(alloc, w, "full") == [2] and pages(alloc, w, "swa") == [8]
    assert lease.release() is False


def test_expired_leases_are_reclaimed_on_the_next_call_and_counted(full_swa) -> None:
    now = [0.0]
    alloc = full_swa(clock=lambda: now[0])
    vp = alloc.alloc_pages(2)
    alloc.lease({"full": alloc.translate_pages(vp, "full")}, deadline_s=5.0, tag="dead-peer")
    alloc.free(vp * 2)
    assert alloc.stats()["full"].pending_pages == 2
    now[0] = 6.0
    st = alloc.stats()                                          # any allocator call reclaims
    assert st["full"].pending_pages == 0 and st["full"].leases_expired == 1 and st["swa"].leases_expired == 0
    assert alloc.leases_active() == 0 and alloc.band("full") == (1, 1)


# ---- observability ------------------------------------------------------------------------------------------
def _reachable_gap_by_hand(snap: dict, name: str, floor: int) -> int:
    """Brute force from the snapshot: pages of end ``name`` outside its band that overlap no other band and not
    the floor, walked from its moving edge(s); an empty float end: the longest run of such pages."""
    ends = snap["ends"]
    me = ends[name]
    pb, first, top = me["page_bytes"], me["first_page"], me["top_page"]
    taken = [(0, floor)] + [(e["band"][0] * e["page_bytes"], e["band"][1] * e["page_bytes"])
                            for other, e in ends.items() if other != name and e["band"][1] > e["band"][0]]

    def free_page(p: int) -> bool:
        return first <= p <= top and all(not (p * pb < b and (p + 1) * pb > a) for a, b in taken)

    lo, hi = me["band"]
    n = 0
    if me["grow"] == "float" and hi == lo:
        run = 0
        for p in range(first, top + 1):
            run = run + 1 if free_page(p) else 0
            n = max(n, run)
        return n
    if me["grow"] in ("up", "float"):
        p = hi
        while free_page(p):
            n, p = n + 1, p + 1
    if me["grow"] in ("down", "float"):
        p = lo - 1
        while free_page(p):
            n, p = n + 1, p - 1
    return n


def test_stats_are_recomputed_from_the_snapshot(float3) -> None:
    rng = np.random.default_rng(7)
    alloc = float3()
    live: list[int] = []
    for _ in range(60):
        if live and rng.random() < 0.4:
            k = int(rng.integers(1, len(live) + 1))
            pick = [live.pop(int(rng.integers(0, len(live)))) for _ in range(k)]
            alloc.free(T(*pick) * 2)
        else:
            v = alloc.alloc_pages(int(rng.integers(1, 4)), bind=[b for b in ("swa", "draft") if rng.random() < .7])
            if v is not None:
                live += v.tolist()
        snap = alloc.snapshot()
        st = alloc.stats()
        for name, e in snap["ends"].items():
            s = st[name]
            state = e["state"]
            pb = e["page_bytes"]
            assert s.live_pages == int((state == PAGE_LIVE).sum())
            assert s.hole_pages == int((state == PAGE_HOLE).sum())
            assert s.pending_pages == int((state == PAGE_PENDING).sum())
            assert s.gap_pages == int((state == PAGE_GAP).sum())
            assert s.reserved_pages == int((state == PAGE_RESERVED).sum())
            assert s.live_bytes == s.live_pages * pb and s.hole_bytes == s.hole_pages * pb
            assert (s.band_lo, s.band_hi) == e["band"]
            assert s.reachable_gap_pages == _reachable_gap_by_hand(snap, name, 32), name
            assert s.free_pages == s.hole_pages + s.reachable_gap_pages == alloc.available_pages(name)
            assert s.pages_allocated - s.pages_freed - s.pages_unbound == s.live_pages
        assert snap["owners"]["full"]["live"] == len(live) == int((snap["owners"]["full"]["vstate"] == V_LIVE).sum())


def test_stats_schema_is_fixed(full_swa) -> None:
    st = full_swa().stats()
    assert list(st) == ["full", "swa"]
    keys = list(st["full"].to_dict())
    assert keys == list(st["swa"].to_dict())
    for k in ("live_pages", "hole_pages", "pending_pages", "free_pages", "live_bytes", "free_bytes",
              "pending_bytes", "hole_bytes", "peak_live_pages", "pages_allocated", "pages_freed", "pages_moved",
              "leases_active", "leases_expired", "pinned_pages"):
        assert k in keys


def test_peak_and_counters(full_swa) -> None:
    alloc = full_swa()
    v = alloc.alloc_pages(4)
    alloc.free(v[:3] * 2)
    alloc.alloc_pages(1)
    s = alloc.stats()["full"]
    assert (s.peak_live_pages, s.pages_allocated, s.pages_freed, s.live_pages) == (4, 5, 3, 2)
    assert s.peak_live_bytes == 4 * 32


CORRUPTIONS = [
    ("p2v-live", lambda a: W(a, "full")[0].__setitem__(5, 3)),
    ("tables-inverse", lambda a: W(a, "full")[2].__setitem__(2, 1)),
    ("counts", lambda a: a._heap.meta.__setitem__((0, 12), 5)),
    ("state-codes", lambda a: W(a, "full")[1].__setitem__(2, PAGE_GAP)),
    ("state-codes", lambda a: W(a, "swa")[1].__setitem__(3, PAGE_HOLE)),
    ("sink", lambda a: W(a, "swa")[2].__setitem__(0, 4)),
    ("owner-live", lambda a: a._heap.h8.__setitem__(a._heap.meta[0, M_VOFF] + 1, V_FREED)),
    ("bitmaps", lambda a: a._heap.h64.__setitem__(a._heap.meta[0, M_HBOFF], 1 << 5)),
    ("bands-disjoint", lambda a: a._heap.meta.__setitem__((0, M_PB), 100)),   # full's frontier now past swa's
]


@pytest.mark.parametrize("invariant,corrupt", CORRUPTIONS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CORRUPTIONS)])
def test_check_invariants_names_the_broken_invariant(full_swa, invariant, corrupt) -> None:
    alloc = full_swa(debug_checks=False)
    alloc.alloc_pages(3)                                        # full 1 2 3, swa 7 8 9
    alloc.check_invariants()
    corrupt(alloc)
    with pytest.raises(InvariantError, match=rf"\[{invariant}\]"):
        alloc.check_invariants()


def test_v2p_mirror_is_refreshed_by_every_call(full_swa) -> None:
    alloc = full_swa(mirror_device="cpu")                      # a CPU mirror exercises the device-refresh path
    t = alloc.alloc_extend(T(0), T(5), T(-1))
    assert alloc.v2p("swa").tolist()[:4] == [0, 7, 8, 9]
    alloc.unbind_end("swa", t[:2])
    alloc.free(t[4:])
    assert alloc.v2p("swa").tolist()[:4] == [0, -1, 8, -1]
    assert alloc.v2p("full").tolist()[:4] == [0, 1, 2, -1]
    alloc.check_invariants()                                    # includes [device-mirror]
    alloc._after_call.mirrors[0][1, 2] = 5
    with pytest.raises(InvariantError, match="device-mirror"):
        alloc.check_invariants()


def test_swa_tail_start_validates() -> None:
    f = MultiEndedAllocator.swa_tail_start
    assert f(0, 4, 0, 2) == 0 and f(9, 4, 0, 2) == 4 and f(9, 4, 7, 2) == 6
    for bad in ((-1, 4, 0, 2), (4, 0, 0, 2), (4, 4, 5, 2), (4, 4, 0, 0), (4.0, 4, 0, 2)):
        with pytest.raises(UmallocValueError):
            f(*bad)


def test_vstate_records_freed_ids(full_swa) -> None:
    alloc = full_swa()
    v = alloc.alloc_pages(2)
    alloc.free(v[:1] * 2)
    vs = alloc.snapshot()["owners"]["full"]["vstate"]
    assert vs[1] == V_FREED and vs[2] == V_LIVE


# ---- hostile lengths and argument types (review: each failed before its fix) -----------------------------------
@pytest.mark.parametrize("seq", [
    (2**62, 2**62, 2**62, 2**62 + 4),   # page_size 2: page and token sums wrap int64 to small positive counts
    (2**63 - 1, 2**63 - 1),             # sums wrap negative
    (2**62,),                           # no wrap: just far more pages than the id space
])
@pytest.mark.parametrize("with_out", [False, True])
def test_extend_lengths_whose_sums_overflow_fall_short_and_change_nothing(full_swa, seq, with_out) -> None:
    # Before the fix the wrapped counts passed the plan and the output loop wrote far past its buffer (segfault).
    alloc = full_swa()
    t = alloc.alloc_extend(T(0), T(3), T(-1))                      # some live state to compare against
    before = alloc.snapshot()
    out = torch.empty(4, dtype=torch.int64) if with_out else None
    B = len(seq)
    assert alloc.alloc_extend(torch.zeros(B, dtype=torch.int64), T(*seq), torch.full((B,), -1), out=out) is None
    assert "full" in alloc.last_shortfall                          # the owner's 7 free ids can never hold them
    assert snapshots_equal(before, alloc.snapshot())
    assert alloc.translate(t, "full").tolist() == [2, 3, 4]


def test_alloc_pages_beyond_any_memory_is_a_shortfall_not_a_crash(full_swa) -> None:
    alloc = full_swa()
    before = alloc.snapshot()
    assert alloc.alloc_pages(2**62) is None                        # used to raise numpy's "array is too big"
    assert alloc.last_shortfall == {"full": 2**62 - 9}             # 9 free virtual ids (1..9)
    assert snapshots_equal(before, alloc.snapshot())


def test_unhashable_end_and_non_tensor_out_raise_typed_errors(full_swa) -> None:
    alloc = full_swa()
    t = alloc.alloc_extend(T(0), T(2), T(-1))
    before = alloc.snapshot()
    with pytest.raises(UmallocValueError):                         # used to be a bare TypeError
        alloc.unbind_end(["swa"], t)
    with pytest.raises(InvalidIdError):                            # used to be an AttributeError
        alloc.translate(t, "full", out=[0, 0])
    with pytest.raises(InvalidIdError):
        alloc.translate_pages(T(1), "full", out=(0,))
    assert snapshots_equal(before, alloc.snapshot())


def test_sink_page_is_refused_as_reserved_not_as_never_allocated(full_swa) -> None:
    alloc = full_swa()                                             # page_size 2: tokens 0, 1 lie in vpage 0
    alloc.alloc_pages(1)
    before = alloc.snapshot()
    for call in (lambda: alloc.free(T(0)), lambda: alloc.free(T(1)), lambda: alloc.unbind_end("swa", T(1)),
                 lambda: alloc.alloc_decode(T(2), T(0)), lambda: alloc.alloc_extend(T(1), T(3), T(0))):
        with pytest.raises(InvalidIdError, match="reserved, the sink") as info:
            call()
        assert type(info.value) is InvalidIdError                  # not NotAllocatedError: page 0 is special
    assert snapshots_equal(before, alloc.snapshot())


def test_extend_refuses_a_partial_tail_page_twice_in_a_batch_or_unbound_on_a_bind_end(full_swa) -> None:
    alloc = full_swa()
    t = alloc.alloc_extend(T(0), T(3), T(-1))                      # tokens 2 3 | 4 (vpage 2 half full)
    before = alloc.snapshot()
    with pytest.raises(InvalidIdError, match="another request"):   # two requests extending tokens 5 of vpage 2
        alloc.alloc_extend(T(3, 3), T(4, 4), T(int(t[2]), int(t[2])))
    assert snapshots_equal(before, alloc.snapshot())
    alloc.unbind_end("swa", t[2:])                                # vpage 2 unbound on swa, live on full
    before = alloc.snapshot()
    with pytest.raises(NotAllocatedError, match="not bound on end 'swa'"):
        alloc.alloc_extend(T(3), T(4), T(4))                      # token 5 would need vpage 2 on swa too
    with pytest.raises(NotAllocatedError, match="not bound on end 'swa'"):
        alloc.alloc_decode(T(4), T(4))
    assert snapshots_equal(before, alloc.snapshot())
    assert alloc.alloc_extend(T(3), T(4), T(4), bind=[]).tolist() == [5]   # the owner alone may fill it


# ---- page-level calls (vLLM-style page tables): alloc_pages(out=), free_pages, unbind_pages ---------------------
@pytest.fixture(params=[False, True], ids=["hot-path", "checked-path"])
def page_alloc(checked_allocator, request) -> MultiEndedAllocator:
    """full + swa as :func:`full_swa` but 416 B: pages 1..12, room for 6 virtual pages bound on both ends.
    Without debug checks the numpy calls take the page-level hot path (Note [Page-level hot path]), with them
    the general one: every test below must hold on both."""
    alloc = checked_allocator((full_end(), swa_end()), 416, debug_checks=request.param)
    assert alloc._plain is not request.param
    return alloc


def test_alloc_pages_into_numpy_and_torch_out(page_alloc) -> None:
    alloc = page_alloc
    out = np.full(3, -7, dtype=np.int64)
    assert alloc.alloc_pages(3, out=out) is out and out.tolist() == [1, 2, 3]
    assert pages(alloc, T(1, 2, 3), "full") == [1, 2, 3] and pages(alloc, T(1, 2, 3), "swa") == [10, 11, 12]
    t = torch.full((2,), -7, dtype=torch.int64)
    assert alloc.alloc_pages(2, out=t) is t and t.tolist() == [4, 5]
    assert pages(alloc, t, "full") == [4, 5] and pages(alloc, t, "swa") == [8, 9]   # swa: [lo - 2, lo)
    assert alloc.alloc_pages(0, out=np.empty(0, np.int64)).size == 0
    # out of space into a numpy out (one virtual page is left: 2 pages): None, nothing changed, out untouched
    snap = alloc.snapshot()
    big = np.full(2, -7, dtype=np.int64)
    assert alloc.alloc_pages(2, out=big) is None and (big == -7).all()
    assert snapshots_equal(snap, alloc.snapshot()) and alloc.last_shortfall


@pytest.mark.parametrize("bad", [np.zeros(2, np.int32), np.zeros((2, 1), np.int64), np.zeros(3, np.int64),
                                 torch.zeros(2, dtype=torch.int32), [0, 0]],
                         ids=["np-int32", "np-2d", "np-wrong-length", "torch-int32", "list"])
def test_alloc_pages_refuses_a_bad_out(page_alloc, bad) -> None:
    snap = page_alloc.snapshot()
    with pytest.raises(InvalidIdError):
        page_alloc.alloc_pages(2, out=bad)
    assert snapshots_equal(snap, page_alloc.snapshot())


def test_alloc_pages_refuses_a_read_only_numpy_out(page_alloc) -> None:
    out = np.zeros(2, np.int64)
    out.flags.writeable = False
    with pytest.raises(InvalidIdError, match="writeable"):
        page_alloc.alloc_pages(2, out=out)
    assert page_alloc.stats()["full"].live_pages == 0


def test_free_pages_equals_free_of_tokens(checked_allocator, page_alloc) -> None:
    """The same frees by page ids (numpy, strided numpy, torch) and by tokens give identical snapshots."""
    by_tokens = checked_allocator((full_end(), swa_end()), 416, debug_checks=False)
    alloc = page_alloc
    vp = alloc.alloc_pages(6)
    assert by_tokens.alloc_pages(6).tolist() == vp.tolist() == [1, 2, 3, 4, 5, 6]
    wide = np.array([2, 0, 5, 0, 2, 0], np.int64)               # a strided view: pages 2, 5, 2 (2 twice: merges)
    alloc.free_pages(wide[::2])
    by_tokens.free(T(2 * 2, 5 * 2 + 1, 2 * 2 + 1))
    # by hand: full pages 1..6 held vpages 1..6; freeing 2 and 5 leaves holes at 2 and 5 below the frontier 7
    st = alloc.stats()["full"]
    assert (st.live_pages, st.hole_pages, alloc.watermark("full")) == (4, 2, 7)
    assert pages(alloc, T(1, 3, 4, 6), "full") == [1, 3, 4, 6] and pages(alloc, T(2, 5), "full") == [0, 0]
    assert snapshots_equal(alloc.snapshot(), by_tokens.snapshot())
    alloc.free_pages(T(1, 6))
    by_tokens.free(np.array([1 * 2, 6 * 2], np.int64))          # free also takes numpy tokens
    assert snapshots_equal(alloc.snapshot(), by_tokens.snapshot())
    # live 3 4; 1 2 are holes below them, 5 6 retreated into the gap (the frontier moved back to 5)
    st = alloc.stats()["full"]
    assert (st.live_pages, st.hole_pages, alloc.watermark("full")) == (2, 2, 5)
    alloc.check_invariants()


@pytest.mark.parametrize("ids, err", [
    (np.array([3], np.int64), DoubleFreeError),       # freed just before
    (np.array([7], np.int64), NotAllocatedError),     # never allocated
    (np.array([0], np.int64), InvalidIdError),        # the sink page
    (np.array([13], np.int64), InvalidIdError),       # out of range: virtual pages are [0, 13)
    (np.array([-1], np.int64), InvalidIdError),
    (np.array([1, 2, 99], np.int64), InvalidIdError),  # a bad id late in the batch: nothing at all is freed
    (np.array([1.0]), InvalidIdError),                # dtype (int32 and narrower are accepted)
    (np.array([[1]], np.int64), InvalidIdError),      # shape
])
def test_free_pages_misuse_is_typed_and_changes_nothing(page_alloc, ids, err) -> None:
    alloc = page_alloc
    alloc.alloc_pages(3)
    alloc.free_pages(np.array([3], np.int64))
    snap = alloc.snapshot()
    with pytest.raises(err):
        alloc.free_pages(ids)
    assert snapshots_equal(snap, alloc.snapshot())


def test_unbind_pages_tombstones_only_the_bound_end(page_alloc) -> None:
    alloc = page_alloc
    vp = alloc.alloc_pages(3)                                   # full 1 2 3, swa 10 11 12
    alloc.unbind_pages("swa", np.array([1, 2, 1], np.int64))   # duplicates merge
    assert pages(alloc, vp, "swa") == [0, 0, 12] and pages(alloc, vp, "full") == [1, 2, 3]
    snap = alloc.snapshot()
    with pytest.raises(NotAllocatedError, match="not bound"):  # strict: page 1 is already unbound
        alloc.unbind_pages("swa", np.array([3, 1], np.int64))
    assert snapshots_equal(snap, alloc.snapshot())
    alloc.unbind_pages("swa", np.array([3, 1], np.int64), strict=False)
    assert pages(alloc, vp, "swa") == [0, 0, 0] and alloc.stats()["swa"].live_pages == 0
    with pytest.raises(UmallocValueError, match="id-owner"):
        alloc.unbind_pages("full", np.array([1], np.int64))
    with pytest.raises(UmallocValueError):
        alloc.unbind_pages("nope", np.array([1], np.int64))
    assert alloc.stats()["full"].live_pages == 3


def test_page_level_calls_respect_leases(page_alloc) -> None:
    """A lease turns the numpy calls onto the general path: a leased page freed by page id goes pending and is
    not handed out again until the lease is released (F11)."""
    alloc = page_alloc
    vp = alloc.alloc_pages(2)                                   # full 1 2
    lease = alloc.lease({"full": alloc.translate_pages(vp[:1], "full")})
    alloc.free_pages(vp.numpy())
    st = alloc.stats()["full"]
    assert st.pending_pages == 1 and st.live_pages == 0
    out = np.zeros(1, np.int64)
    alloc.alloc_pages(1, out=out)
    assert pages(alloc, torch.from_numpy(out), "full") != [1]   # page 1 is pending, not reused
    lease.release()
    assert alloc.stats()["full"].pending_pages == 0


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_page_calls_through_a_block_table_index(page_alloc, lib) -> None:
    """index=: alloc_pages writes straight into a req_to_page table, free_pages / unbind_pages gather from it.
    Expected slots and pages by hand: two requests of 2 and 1 pages in rows 0 and 1 of a 2 x 4 table."""
    alloc = page_alloc
    arr = (lambda *xs: np.array(xs, np.int64)) if lib == "numpy" else T
    table = np.full(8, -1, np.int64) if lib == "numpy" else torch.full((8,), -1, dtype=torch.int64)
    assert alloc.alloc_pages(3, out=table, index=arr(0, 1, 4)) is table
    assert table.tolist() == [1, 2, -1, -1, 3, -1, -1, -1]
    alloc.unbind_pages("swa", table, index=arr(0, 0))           # row 0's first page left the window
    assert pages(alloc, T(1, 2, 3), "swa") == [0, 11, 12] and pages(alloc, T(1, 2, 3), "full") == [1, 2, 3]
    alloc.free_pages(table, index=arr(0, 1))                     # request 0 finishes
    assert alloc.stats()["full"].live_pages == 1 and alloc.stats()["swa"].live_pages == 1
    assert alloc.alloc_pages(1, out=table, index=arr(2)).tolist()[2] == 1    # the lowest free id again
    alloc.check_invariants()


@pytest.mark.parametrize("call", ["alloc", "free", "unbind"])
def test_block_table_index_out_of_range_changes_nothing(page_alloc, call) -> None:
    alloc = page_alloc
    table = np.zeros(4, np.int64)
    alloc.alloc_pages(2, out=table, index=np.array([0, 1], np.int64))
    snap, before = alloc.snapshot(), table.copy()
    bad = np.array([1, 4], np.int64)                             # slot 4 is past the 4-slot table
    with pytest.raises(InvalidIdError, match=r"index\[1\] = 4 is outside the block table: allowed \[0, 4\)"):
        if call == "alloc":
            alloc.alloc_pages(2, out=table, index=bad)
        elif call == "free":
            alloc.free_pages(table, index=bad)
        else:
            alloc.unbind_pages("swa", table, index=bad)
    assert snapshots_equal(snap, alloc.snapshot()) and np.array_equal(table, before)
    with pytest.raises(InvalidIdError, match="exactly num_pages"):
        alloc.alloc_pages(2, out=table, index=np.array([2], np.int64))
    with pytest.raises(InvalidIdError, match="without out"):
        alloc.alloc_pages(1, index=np.array([2], np.int64))
    with pytest.raises(InvalidIdError):
        alloc.free_pages(table, index=np.array([-1], np.int64))
    assert snapshots_equal(snap, alloc.snapshot())


def test_per_call_methods_match_the_class_methods_and_a_subclass_override_wins() -> None:
    """Note [Composed services]: the per-call methods bound at construction give what the class's own methods
    give, and a subclass's override of one is the method its instances run."""
    from umalloc.testing import small_allocator, tiny_spec

    bound, direct = small_allocator(), small_allocator()
    for alloc, call in ((bound, lambda a, name: getattr(a, name)),
                        (direct, lambda a, name: getattr(MultiEndedAllocator, name).__get__(a))):
        vp = call(alloc, "alloc_pages")(3)
        call(alloc, "unbind_pages")("swa", vp[:1])
        call(alloc, "free_pages")(vp[2:])
    assert snapshots_equal(bound.snapshot(), direct.snapshot())
    assert bound.translate_pages(torch.tensor([1, 2]), "swa", strict=False).tolist() == [0, 8]   # swa 7..9 down

    freed: list[list[int]] = []

    class Recording(MultiEndedAllocator):
        def free_pages(self, vpages, *, owner=None, index=None):  # type: ignore[no-untyped-def]
            freed.append([int(v) for v in vpages])
            super().free_pages(vpages, owner=owner, index=index)

    alloc = Recording(Arena(tiny_spec()))
    vp = alloc.alloc_pages(2)
    alloc.free_pages(vp)
    assert freed == [[1, 2]] and alloc.stats()["full"].live_pages == 0


def test_the_renamed_unbind_calls_have_no_old_names() -> None:
    """``unbind_end`` / ``unbind_pages`` are the only names (``release`` is a lease's verb); the names before them
    (listed in CHANGELOG.md) are gone, not aliased."""
    from umalloc.testing import small_allocator

    alloc = small_allocator()
    assert hasattr(alloc, "unbind_end") and hasattr(alloc, "unbind_pages")
    assert not hasattr(alloc, "release_end") and not hasattr(alloc, "release_pages")
