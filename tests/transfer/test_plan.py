"""Transfer plans.

First part: layouts, compatibility, descriptors, bounds and lifecycle on hand-built physical vectors.
Second part: plans built through real allocators (leases, bytes copied end to end by a plain memmove executor
written here, one test per fault class F09, F10, F13, F14, F19, F22, F23). DCP plans: tests/transfer/test_plan_dcp.py.
"""

from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest
import torch

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.errors import (
    DescriptorBoundsError,
    IncompatiblePeerError,
    InvalidIdError,
    LeaseError,
    TombstoneError,
    UmallocValueError,
)
from umalloc.geometry.arena import Arena
from umalloc.geometry.region import Region, RegionGroup, RegionMember
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, KVDtype, LayerSpec
from umalloc.leases.table import LeaseTable
from umalloc.testing import seed_from_env
from umalloc.transfer import (
    IndexVector,
    PeerLayout,
    ReceiverHalf,
    TransferPlan,
    build_plan,
    build_receiver_half,
    build_send_plan,
    check_compatible,
    owned_count,
    source_ranks,
    swa_tail_start,
    vector_rows,
)

# ---- fixtures ------------------------------------------------------------------------------------------------

# 1 KV head x head_dim 8, bf16: K 16 B + V 16 B = 32 B per token; page_size 2 -> 64 B pages.
ONE_LAYER = EndSpec("full", (LayerSpec.mha(1, 8),), page_size=2)
# 2 layers x (K 8 B + V 8 B) per token, page_size 2 -> blocks at 0 (L0 K), 16 (L0 V), 32 (L1 K), 48 (L1 V).
TWO_LAYERS = EndSpec("full", (LayerSpec.mha(1, 4), LayerSpec.mha(1, 4)), page_size=2)


def layout(end: EndSpec = ONE_LAYER, base: int = 1000, arena_bytes: int = 640, **kw) -> PeerLayout:
    spec = ArenaSpec((end,), arena_bytes=arena_bytes)
    return PeerLayout(spec, (Region(base, arena_bytes),), base, **kw)


def vec(src: PeerLayout, dst: PeerLayout, sp=(), dp=(), sr=(), dr=(), name: str = "target",
        end: str = "full") -> IndexVector:
    t = lambda x: torch.tensor(list(x), dtype=torch.int64)  # noqa: E731
    return IndexVector(name, end, end, t(sp), t(dp), src.region_group(end), dst.region_group(end), t(sr), t(dr))


def plan_of(src, dst, v, src_leased, dst_leased, **kw) -> TransferPlan:
    return TransferPlan("req", [v], src_layout=src, dst_layout=dst, src_leased_pages={"full": src_leased},
                        dst_leased_pages={"full": dst_leased}, **kw)


# ---- descriptors ---------------------------------------------------------------------------------------------


def test_two_adjacent_pages_plan_one_descriptor():
    src, dst = layout(base=1000), layout(base=2000)
    p = plan_of(src, dst, vec(src, dst, [3, 4], [7, 8]), [3, 4], [7, 8])
    assert p.descriptors().tolist() == [[1192, 2448, 128]]
    assert p.descriptors().dtype == np.uint64 and p.descriptors().shape == (1, 3)
    assert (p.num_descriptors, p.num_runs, p.total_bytes) == (1, 1, 128)
    assert p.per_layer_descriptor_equivalent == 2 * 1 * 2  # 2 pages x 1 layer x (K, V)


def test_runs_split_where_either_side_jumps():
    src, dst = layout(base=1000), layout(base=2000)
    p = plan_of(src, dst, vec(src, dst, [3, 4, 9, 5], [7, 8, 2, 3]), [3, 4, 5, 9], [2, 3, 7, 8])
    # [3,4]->[7,8] one run; 9->2 alone (src jumps); 5->3 alone (src goes back although dst steps by one)
    assert p.descriptors().tolist() == [[1192, 2448, 128], [1000 + 9 * 64, 2000 + 2 * 64, 64],
                                        [1000 + 5 * 64, 2000 + 3 * 64, 64]]
    assert p.num_runs == 3 and p.total_bytes == 4 * 64


def test_row_descriptors_one_per_layer_block():
    src, dst = layout(TWO_LAYERS, base=1000), layout(TWO_LAYERS, base=2000)
    # token row 1 of page 3 -> token row 1 of page 7
    p = plan_of(src, dst, vec(src, dst, sr=[3 * 2 + 1], dr=[7 * 2 + 1]), [3], [7])
    s0, d0 = 1000 + 3 * 64 + 8, 2000 + 7 * 64 + 8
    assert p.descriptors().tolist() == [[s0 + off, d0 + off, 8] for off in (0, 16, 32, 48)]
    assert p.per_layer_descriptor_equivalent == 4 and p.num_runs == 1


def test_row_runs_coalesce_inside_a_page_never_across():
    src, dst = layout(TWO_LAYERS, base=1000), layout(TWO_LAYERS, base=2000)
    p = plan_of(src, dst, vec(src, dst, sr=[6, 7], dr=[14, 15]), [3], [7])  # rows 0,1 of page 3 -> page 7
    assert p.descriptors().tolist() == [[1000 + 192 + off, 2000 + 448 + off, 16] for off in (0, 16, 32, 48)]
    # rows 7, 8 are consecutive token ids but sit in pages 3 and 4: two runs
    p = plan_of(src, dst, vec(src, dst, sr=[7, 8], dr=[15, 16]), [3, 4], [7, 8])
    expect = [[1000 + 192 + 8 + off, 2000 + 448 + 8 + off, 8] for off in (0, 16, 32, 48)]
    expect += [[1000 + 256 + off, 2000 + 512 + off, 8] for off in (0, 16, 32, 48)]
    assert p.descriptors().tolist() == expect and p.num_runs == 2


def test_mla_page_counts_one_block_per_layer():
    mla = EndSpec("full", (LayerSpec.mla(4, 4),) * 3, page_size=2)  # 16 B per token per layer
    src, dst = layout(mla, base=0, arena_bytes=1024), layout(mla, base=4096, arena_bytes=1024)
    p = plan_of(src, dst, vec(src, dst, [2, 3, 4], [5, 6, 7]), [2, 3, 4], [5, 6, 7])
    pb = 2 * 3 * 16
    assert p.descriptors().tolist() == [[2 * pb, 4096 + 5 * pb, 3 * pb]]
    assert p.per_layer_descriptor_equivalent == 3 * 3  # 3 pages x 3 layers x 1 (latent)


def test_descriptors_by_vector_and_order():
    two = ArenaSpec((ONE_LAYER, EndSpec("draft", (LayerSpec.mha(1, 4),), page_size=4, grow=Grow.DOWN,
                                         role=EndRole.DRAFT)), arena_bytes=1024)
    src = PeerLayout(two, (Region(0, 1024),), 0)
    dst = PeerLayout(two, (Region(8192, 1024),), 8192)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    vt = IndexVector("target", "full", "full", t([1]), t([2]), src.region_group("full"), dst.region_group("full"))
    vd = IndexVector("draft", "draft", "draft", t([10]), t([12]), src.region_group("draft"),
                     dst.region_group("draft"))
    p = TransferPlan("r", [vt, vd], src_layout=src, dst_layout=dst,
                     src_leased_pages={"full": [1], "draft": [10]}, dst_leased_pages={"full": [2], "draft": [12]})
    by = p.descriptors_by_vector()
    assert list(by) == ["target", "draft"]
    assert by["target"].tolist() == [[64, 8192 + 128, 64]]
    assert by["draft"].tolist() == [[10 * 64, 8192 + 12 * 64, 64]]  # draft page_bytes = 4 tokens x 16 B
    assert p.descriptors().tolist() == by["target"].tolist() + by["draft"].tolist()
    assert not p.descriptors().flags.writeable


# ---- bounds --------------------------------------------------------------------------------------------------


def test_bounds_unleased_destination_page_refused():
    src, dst = layout(base=1000), layout(base=2000)
    with pytest.raises(DescriptorBoundsError, match="not all leased"):
        plan_of(src, dst, vec(src, dst, [3, 4], [7, 8]), [3, 4], [7])  # page 8 not leased


def test_bounds_unleased_source_page_refused():
    src, dst = layout(base=1000), layout(base=2000)
    with pytest.raises(DescriptorBoundsError, match="src descriptor 0"):
        plan_of(src, dst, vec(src, dst, [3, 4], [7, 8]), [3], [7, 8])


def test_bounds_sink_and_floor_refused_even_if_leased():
    src, dst = layout(base=1000), layout(base=2000)
    with pytest.raises(DescriptorBoundsError, match="handable range"):
        plan_of(src, dst, vec(src, dst, [0], [3]), [0], [3])
    with pytest.raises(DescriptorBoundsError, match="handable range"):
        plan_of(src, dst, vec(src, dst, sr=[1], dr=[7]), [0], [3])  # a row inside the sink page


def test_bounds_page_past_arena_refused():
    src, dst = layout(base=1000), layout(base=2000)  # 640 B arena, 64 B pages: top page 9
    with pytest.raises(DescriptorBoundsError, match="outside"):
        plan_of(src, dst, vec(src, dst, [3], [10]), [3], [10])
    with pytest.raises(DescriptorBoundsError):
        plan_of(src, dst, vec(src, dst, [3], [1 << 40]), [3], [])


def test_bounds_ids_that_would_wrap_uint64_addresses_refused():
    """A corrupted id far past the end's pages whose address would wrap modulo 2**64 back onto a leased page
    (64 B pages: page 3 + 2**58 lands on page 3) is refused before any address is computed."""
    src, dst = layout(base=1000), layout(base=2000)
    wraps_to_page_3 = 2 * (3 + (1 << 58))  # row 0 of page 3 + 2**58, page_size 2
    with pytest.raises(DescriptorBoundsError, match=f"src row id {wraps_to_page_3} .*last page 9"):
        plan_of(src, dst, vec(src, dst, sr=[wraps_to_page_3], dr=[14]), [3], [7])
    with pytest.raises(DescriptorBoundsError, match=f"dst row id {wraps_to_page_3} "):
        plan_of(src, dst, vec(src, dst, sr=[6], dr=[wraps_to_page_3]), [3], [3])
    with pytest.raises(DescriptorBoundsError, match=f"src page id {3 + (1 << 58)} "):
        plan_of(src, dst, vec(src, dst, [3 + (1 << 58)], [7]), [3], [7])
    with pytest.raises(DescriptorBoundsError, match="row id 9223372036854775807 "):
        plan_of(src, dst, vec(src, dst, sr=[(1 << 63) - 1], dr=[14]), [3], [7])


def test_layout_past_the_64_bit_address_space_refused():
    with pytest.raises(UmallocValueError, match="past the 64-bit address space"):
        layout(base=(1 << 64) - 100)  # the 640 B arena would end past 2**64
    layout(base=(1 << 64) - 640)  # ends exactly at 2**64: fine


def test_layout_from_dict_refuses_non_int_fields():
    """A peer's numbers are taken exactly: a float, string or bool is malformed, never truncated."""
    good = layout(base=1000).to_dict()
    for path, value in ((("arena_base_ptr",), 1000.7), (("arena_base_ptr",), "1000"), (("tp_size",), True),
                        (("ends", 0, "layers", 0, "window_tokens"), 2.5), (("ends", 0, "page_size"), 2.0)):
        d = json.loads(json.dumps(good))
        holder = d
        for key in path[:-1]:
            holder = holder[key]
        holder[path[-1]] = value
        with pytest.raises(UmallocValueError, match="malformed PeerLayout dict: .*expected an int"):
            PeerLayout.from_dict(d)
    assert PeerLayout.from_dict(json.loads(json.dumps(good))) == layout(base=1000)


def test_bounds_group_outside_registered_regions_refused():
    src, dst = layout(base=1000), layout(base=2000)
    lying = RegionGroup((RegionMember(Region(50_000, 640), 64),))  # a member the peer never registered
    v = IndexVector("target", "full", "full", torch.tensor([3]), torch.tensor([7]), src.region_group("full"), lying)
    with pytest.raises(DescriptorBoundsError, match="not a registered region"):
        plan_of(src, dst, v, [3], [7])
    wrong_item = RegionGroup((RegionMember(Region(2000, 640), 32),))
    v = IndexVector("target", "full", "full", torch.tensor([3]), torch.tensor([7]), src.region_group("full"),
                    wrong_item)
    with pytest.raises(DescriptorBoundsError, match="steps 32 B"):
        plan_of(src, dst, v, [3], [7])


def test_bounds_check_is_all_or_nothing():
    """One bad page among many: the plan is not created at all (no descriptor escapes)."""
    src, dst = layout(base=1000), layout(base=2000)
    made = []
    with pytest.raises(DescriptorBoundsError):
        made.append(plan_of(src, dst, vec(src, dst, [1, 2, 3, 4], [5, 6, 7, 9]), [1, 2, 3, 4], [5, 6, 7]))
    assert made == []


def test_index_vector_rejects_bad_ids():
    src, dst = layout(), layout(base=5000)
    with pytest.raises(InvalidIdError, match="pair by position"):
        vec(src, dst, [1, 2], [3])
    with pytest.raises(InvalidIdError, match="negative"):
        vec(src, dst, [-1], [3])
    with pytest.raises(InvalidIdError, match="int64"):
        IndexVector("t", "full", "full", torch.tensor([1], dtype=torch.int32), torch.tensor([2]),
                    src.region_group("full"), dst.region_group("full"))


# ---- layouts and compatibility ------------------------------------------------------------------------------


def _three_end_spec(**over) -> ArenaSpec:
    full = over.get("full", (LayerSpec.mha(2, 4), LayerSpec.mha(2, 4)))
    swa_w = over.get("swa_w", 4)
    draft_ps = over.get("draft_ps", 4)
    ends = [EndSpec("full", full, 2),
            EndSpec("swa", (LayerSpec.mha(2, 4, window_tokens=swa_w),), 2, Grow.DOWN, "full", EndRole.SWA),
            EndSpec("draft", (LayerSpec.mha(1, 4),), draft_ps, Grow.FLOAT, None, EndRole.DRAFT)]
    if over.get("state"):
        ends.append(EndSpec("state", (LayerSpec.mha(1, 4),), 1, Grow.FLOAT, None, EndRole.STATE))
    return ArenaSpec(tuple(ends), arena_bytes=4096)


def test_check_compatible_lists_every_difference():
    # TP 1 -> 2 and page size 4 -> 2 are mapped (heads split by rank, ids expand: issue "hetero TP/page
    # sizes"); what no plan can map is listed, every line
    local = PeerLayout(_three_end_spec(), (Region(0, 4096),), 0)
    remote = PeerLayout(_three_end_spec(full=(LayerSpec.mha(1, 4), LayerSpec.mha(2, 4, dtype=KVDtype.FP16),
                                              LayerSpec.mha(2, 4)), swa_w=8, draft_ps=3, state=True),
                        (Region(1 << 30, 4096),), 1 << 30, tp_rank=1, tp_size=2)
    with pytest.raises(IncompatiblePeerError) as ei:
        check_compatible(local, remote)
    replicated = "local 2 x TP 1, remote 2 x TP 2: a replicated side must hold one head per rank"
    expect = {
        "end 'state' (role state): missing on local",
        "end 'full': layer count local 2 != remote 3",
        # layer 0: 2 heads x TP 1 == 1 head x TP 2 (one model's 2 heads split by rank): no difference
        "end 'full' layer 1: dtype local bf16 != remote fp16",
        f"end 'full' layer 1: num_kv_heads: {replicated}",
        "end 'swa' layer 0: window_tokens local 4 != remote 8",
        f"end 'swa' layer 0: num_kv_heads: {replicated}",
        "end 'draft': page_size local 4, remote 3: neither divides the other (ids expand by a whole ratio, F14)",
    }
    assert set(ei.value.differences) == expect and len(ei.value.differences) == len(expect)
    for line in expect:
        assert line in str(ei.value)
    with pytest.raises(IncompatiblePeerError) as ei:  # symmetric: the missing end is named from either side
        check_compatible(remote, local)
    assert "end 'state' (role state): missing on remote" in ei.value.differences


def test_check_compatible_ignores_local_placement_and_dcp():
    a = _three_end_spec()
    moved = ArenaSpec(tuple(a.ends), arena_bytes=8192)  # bigger arena, other base, other DCP: still compatible
    check_compatible(PeerLayout(a, (Region(0, 4096),), 0),
                     PeerLayout(moved, (Region(1 << 20, 8192),), 1 << 20, dcp_rank=3, dcp_size=8))


def test_layout_roundtrip_is_json_safe():
    lay = PeerLayout(_three_end_spec(state=True), (Region(4096, 8192, "cpu"),), 8192, tp_rank=1, tp_size=2,
                     dcp_rank=2, dcp_size=4)
    wire = json.loads(json.dumps(lay.to_dict()))
    back = PeerLayout.from_dict(wire)
    assert back == lay and back.digest == lay.digest
    end = wire["ends"][0]
    assert (end["name"], end["entry_bytes"], end["page_bytes"], end["first_page"]) == ("full", 64, 128, 1)
    assert end["layers"][0] == {"kind": "mha", "num_kv_heads": 2, "head_dim_k": 4, "head_dim_v": 4,
                                "latent_dim": 0, "window_tokens": None, "dtype": "bf16"}


def test_layout_from_lying_metadata_refused():
    lay = layout(base=1000)
    d = lay.to_dict()
    d["ends"][0]["page_bytes"] = 128  # claims bigger pages than its layers give
    with pytest.raises(UmallocValueError, match="declares"):
        PeerLayout.from_dict(d)
    d = lay.to_dict()
    d["regions"][0]["nbytes"] = 320  # registered region shorter than the arena it claims
    with pytest.raises(UmallocValueError, match="no region contains the arena"):
        PeerLayout.from_dict(d)
    with pytest.raises(UmallocValueError, match="malformed"):
        PeerLayout.from_dict({"format": lay.to_dict()["format"]})  # current format, no fields
    with pytest.raises(UmallocValueError, match="tp_rank"):
        layout(tp_rank=2, tp_size=2)


def test_bound_draft_refused_under_dcp():
    spec = ArenaSpec((EndSpec("full", (LayerSpec.mha(1, 4),), 2),
                      EndSpec("draft", (LayerSpec.mha(1, 4),), 2, Grow.DOWN, "full", EndRole.DRAFT)),
                     arena_bytes=1024)
    PeerLayout(spec, (Region(0, 1024),), 0)  # fine without DCP
    with pytest.raises(UmallocValueError, match="own id owner"):
        PeerLayout(spec, (Region(0, 1024),), 0, dcp_rank=0, dcp_size=2)


def test_receiver_half_roundtrip_and_validation():
    from umalloc.transfer import HalfVector

    pages = np.array([5, 6], dtype=np.int64)
    half = ReceiverHalf("r9", "abc", 7, 3, 1, 0, {"target": HalfVector("target", "full", "rows", 3, 7, pages)})
    wire = json.loads(json.dumps(half.to_dict()))
    back = ReceiverHalf.from_dict(wire)
    assert back.to_dict() == half.to_dict() and back.leased_pages()["full"].tolist() == [5, 6]
    wire["vectors"]["target"]["pages"] = [5, -1]
    with pytest.raises(InvalidIdError):
        ReceiverHalf.from_dict(wire)
    with pytest.raises(UmallocValueError, match="prefix_tokens"):
        ReceiverHalf("r", "abc", 3, 4, 1, 0, {})


# ---- lifecycle with real leases ------------------------------------------------------------------------------


def _leased_plan(table: LeaseTable, deadline_s=None) -> TransferPlan:
    src, dst = layout(base=1000), layout(base=2000)
    s = table.pin({"src": [3, 4]}, deadline_s=deadline_s, tag="src")
    d = table.pin({"dst": [7, 8]}, deadline_s=deadline_s, tag="dst")
    return plan_of(src, dst, vec(src, dst, [3, 4], [7, 8]), [3, 4], [7, 8], src_lease=s, dst_lease=d)


@pytest.mark.parametrize("how", ["complete", "fail", "abort"])
def test_plan_releases_both_leases_once(how):
    table = LeaseTable({"src": 10, "dst": 10})
    plan = _leased_plan(table)
    assert len(table) == 2 and plan.state == "pending"
    assert plan.src_lease.active and plan.dst_lease.active
    err = RuntimeError("boom")
    assert (getattr(plan, how)(err) if how == "fail" else getattr(plan, how)()) is True
    assert plan.state == {"complete": "done", "fail": "failed", "abort": "aborted"}[how]
    assert len(table) == 0 and table.pins_current("src") == 0 and table.pins_current("dst") == 0
    assert plan.error is (err if how == "fail" else None)
    assert plan.complete() is False and plan.abort() is False and plan.fail() is False  # idempotent
    assert table.leases_released == 2
    table.check_invariants()
    with pytest.raises(UmallocValueError, match="released"):
        plan.descriptors()


def test_plan_context_manager_fails_on_exception():
    table = LeaseTable({"src": 10, "dst": 10})
    with pytest.raises(KeyError):
        with _leased_plan(table) as plan:
            assert len(table) == 2
            raise KeyError("peer died")
    assert plan.state == "failed" and isinstance(plan.error, KeyError) and len(table) == 0
    with _leased_plan(table) as plan:
        plan.descriptors()
    assert plan.state == "done" and len(table) == 0


def test_plan_refuses_to_post_after_a_lease_expired():
    now = [0.0]
    table = LeaseTable({"src": 10, "dst": 10}, clock=lambda: now[0])
    plan = _leased_plan(table, deadline_s=1.0)
    assert plan.descriptors().shape == (1, 3)
    now[0] = 2.0
    table.expire()
    with pytest.raises(LeaseError, match="expired"):
        plan.descriptors()
    assert plan.abort() is True and plan.state == "aborted"


# ---- row arithmetic (brute force in the test) ---------------------------------------------------------------


def test_owned_count_brute_force():
    for d in range(1, 6):
        for r in range(d):
            for x in range(0, 20):
                assert owned_count(x, d, r) == sum(1 for p in range(x) if p % d == r)


def test_swa_tail_start_formula():
    for L in range(0, 20):
        for W in range(1, 10):
            for P in range(0, L + 1):
                for ps in (1, 2, 3, 4):
                    assert swa_tail_start(L, W, P, ps) == (max(P, L - W, 0) // ps) * ps


def test_vector_rows_brute_force():
    """Rows received = owned positions >= P (full); for a sliding end, the whole pages of the rank's window tail
    starting at the page of its first row >= max(P, L - W), clipped at the rows below P."""
    full = EndSpec("full", (LayerSpec.mha(1, 4),), 2)
    for ps in (1, 2, 3):
        for W in (1, 3, 5):
            swa = EndSpec("swa", (LayerSpec.mha(1, 4, window_tokens=W),), ps, owner="full", role=EndRole.SWA)
            fullp = EndSpec("full", full.layers, ps)
            for d in (1, 2, 3):
                for r in range(d):
                    for L in range(0, 13):
                        for P in range(0, L + 1):
                            owned = [x for x in range(L) if x % d == r]
                            prow = sum(1 for x in owned if x < P)
                            assert vector_rows(fullp, L, P, dcp_size=d, dcp_rank=r) == (prow, len(owned))
                            first_in = [i for i, x in enumerate(owned) if x >= max(P, L - W)]
                            lo, hi = vector_rows(swa, L, P, dcp_size=d, dcp_rank=r)
                            assert hi == len(owned)
                            if not first_in:
                                assert lo == hi
                                continue
                            page_start = (first_in[0] // ps) * ps
                            assert lo == max(prow, page_start), (ps, W, d, r, L, P)


def test_source_ranks_cover_every_row_once():
    for p in range(1, 7):
        for d in range(1, 7):
            for r in range(d):
                got = source_ranks(r, d, p)
                mine = [x for x in range(60) if x % d == r]
                covered = [x for q in got["sharded"] for x in range(60) if x % d == r and x % p == q]
                assert sorted(covered) == mine  # each of the receiver's positions from exactly one source rank
                assert got["replicated"] == [r % p]


# =============================================================================================================
# plans through real allocators
# =============================================================================================================

SEED = seed_from_env(1234)

MHA2 = LayerSpec.mha(1, 2)  # K 4 B + V 4 B per token (bf16)
SWA_W = 3


DRAFT_LAYERS = (LayerSpec.mha(1, 4),)


def tiny_spec(draft_layers=DRAFT_LAYERS, *, state: bool = False, draft: bool = True) -> ArenaSpec:
    """full: 2 layers x 8 B = 16 B/token, page_size 2 -> 32 B pages (up, id owner).
    swa: 1 sliding layer (window 3) x 8 B, page_size 2 -> 16 B pages (down, bound to full).
    draft: its own id owner, page_size 4; default 1 layer x (K 8 B + V 8 B) = 16 B/token -> 64 B pages (float).
    state: its own id owner, page_size 2, 8 B/token -> 16 B pages (float)."""
    ends = [EndSpec("full", (MHA2, MHA2), 2),
            EndSpec("swa", (LayerSpec.mha(1, 2, window_tokens=SWA_W),), 2, Grow.DOWN, "full", EndRole.SWA)]
    if draft:
        ends.append(EndSpec("draft", tuple(draft_layers), 4, Grow.FLOAT, None, EndRole.DRAFT))
    if state:
        ends.append(EndSpec("state", (MHA2,), 2, Grow.FLOAT, None, EndRole.STATE))
    return ArenaSpec(tuple(ends), arena_bytes=4096)


def extend(alloc, owner: str, seq_len: int, *, prefix: torch.Tensor | None = None, bind=None) -> torch.Tensor:
    """Virtual token ids of a request of ``seq_len`` tokens (continuing ``prefix`` if given)."""
    pre = 0 if prefix is None else prefix.numel()
    last = -1 if prefix is None else int(prefix[-1])
    t = alloc.alloc_extend(torch.tensor([pre]), torch.tensor([seq_len]), torch.tensor([last]), owner=owner,
                           bind=bind)
    assert t is not None
    return t if prefix is None else torch.cat([prefix, t])


def execute(plan) -> None:
    """The test's own executor: one memmove per descriptor."""
    for src, dst, n in plan.descriptors().tolist():
        ctypes.memmove(dst, src, n)


def rows(alloc, data: torch.Tensor, end: str, vt: torch.Tensor, positions) -> list[list[int]]:
    """Bytes (as int16 lists) of every layer's K and V row of each position, read through the arena's views."""
    arena = Arena.__new__(Arena)
    arena.__dict__.update(alloc.arena.__dict__)
    arena.data = data
    ps = alloc.spec.end(end).page_size
    out = []
    phys = alloc.translate(vt[list(positions)], end).tolist() if len(positions) else []
    for tok in phys:
        row = []
        for layer in range(len(alloc.spec.end(end).layers)):
            k, v = arena.kv_views(end, layer)
            row += k[tok // ps, tok % ps].view(torch.int16).flatten().tolist()
            row += v[tok // ps, tok % ps].view(torch.int16).flatten().tolist()
        out.append(row)
    return out


def request_bytes_mask(alloc, bound: dict[str, torch.Tensor]) -> torch.Tensor:
    """Bool mask over arena bytes: the pages of each end holding the given virtual tokens."""
    mask = torch.zeros(alloc.spec.arena_bytes, dtype=torch.bool)
    for end, vt in bound.items():
        ps, pb = alloc.spec.end(end).page_size, alloc.spec.end(end).page_bytes
        pages = alloc.translate_pages(torch.unique(torch.div(vt, ps, rounding_mode="floor")), end)
        for p in pages.tolist():
            mask[p * pb:(p + 1) * pb] = True
    return mask


class Pair:
    """A prefill (source) and a decode (destination) allocator holding one request of L tokens."""

    def __init__(self, make_allocator, spec_src, spec_dst=None, *, L=11, P=0, draft_lookahead=0, dst_swa_tail_only=True,
                 src_release_swa=True, state=False):
        spec_dst = spec_src if spec_dst is None else spec_dst
        self.src = make_allocator(spec_src, fill_seed=SEED, debug_checks=True)
        self.dst = make_allocator(spec_dst, fill_seed=SEED + 1, debug_checks=True)
        self.L, self.P = L, P
        # other requests first, so ids and pages are not the trivial 1, 2, 3 ... on either side
        extend(self.src, "full", 3)
        noise = extend(self.dst, "full", 5)
        self.vt_src = {"full": extend(self.src, "full", L)}
        if src_release_swa:  # prefill drops SWA pages wholly before its tail (swa_tail_start with prefix 0)
            tail = MultiEndedAllocator.swa_tail_start(L, SWA_W, 0, 2)
            if tail:
                self.src.unbind_end("swa", self.vt_src["full"][:tail])
        pre = extend(self.dst, "full", P, bind=[]) if P else None
        self.vt_dst = {"full": extend(self.dst, "full", L, prefix=pre, bind=[])}
        self.dst.free(noise, owner="full")
        dst_tail = MultiEndedAllocator.swa_tail_start(L, SWA_W, P, 2) if dst_swa_tail_only else 0
        assert self.dst.bind_end("swa", self.vt_dst["full"][dst_tail:])
        self.dst_swa_from = dst_tail
        if "draft" in spec_src.end_names:
            self.vt_src["draft"] = extend(self.src, "draft", L)
        if "draft" in spec_dst.end_names:
            self.vt_dst["draft"] = extend(self.dst, "draft", L + draft_lookahead)
        if state:
            for alloc, vts in ((self.src, self.vt_src), (self.dst, self.vt_dst)):
                extend(alloc, "state", 2)  # another request's slot
                vts["state"] = extend(alloc, "state", 2)
        self.before = self.dst.arena.data.clone()

    def dst_bound(self) -> dict[str, torch.Tensor]:
        out = {"full": self.vt_dst["full"][: self.L], "swa": self.vt_dst["full"][self.dst_swa_from: self.L]}
        if "draft" in self.vt_dst:
            out["draft"] = self.vt_dst["draft"][: self.L]
        if "state" in self.vt_dst:
            out["state"] = self.vt_dst["state"]
        return out

    def assert_arrived(self, end: str, positions) -> None:
        owner = self.src.spec.owner_of(end)
        got = rows(self.dst, self.dst.arena.data, end, self.vt_dst[owner], positions)
        want = rows(self.src, self.src.arena.data, end, self.vt_src[owner], positions)
        assert got == want, f"end {end!r}: destination rows differ from the source"

    def assert_untouched(self, end: str, positions) -> None:
        owner = self.dst.spec.owner_of(end)
        got = rows(self.dst, self.dst.arena.data, end, self.vt_dst[owner], positions)
        was = rows(self.dst, self.before, end, self.vt_dst[owner], positions)
        assert got == was, f"end {end!r}: valid destination rows were overwritten (F23)"

    def assert_nothing_else_written(self) -> None:
        mask = request_bytes_mask(self.dst, self.dst_bound())
        assert torch.equal(self.dst.arena.data[~mask], self.before[~mask])


def test_target_draft_swa_copied_byte_for_byte(make_allocator):
    pr = Pair(make_allocator, tiny_spec())
    plan = build_plan("r1", pr.src, pr.vt_src, pr.dst, pr.vt_dst)
    assert list(plan.vectors) == ["target", "draft", "swa_tail"]
    # by hand: target ceil(11/2) = 6 pages x 32 B; draft ceil(11/4) = 3 pages x 64 B; swa tail from
    # floor_to_page(11 - 3) = 8: tokens 8..10 = 2 pages x 16 B
    assert {n: v.num_pages for n, v in plan.vectors.items()} == {"target": 6, "draft": 3, "swa_tail": 2}
    assert {n: s.bytes for n, s in plan.stats_by_vector.items()} == {"target": 192, "draft": 192, "swa_tail": 32}
    assert plan.total_bytes == 416
    assert plan.per_layer_descriptor_equivalent == 6 * 2 * 2 + 3 * 1 * 2 + 2 * 1 * 2
    assert plan.num_descriptors == plan.num_runs == sum(s.descriptors for s in plan.stats_by_vector.values())
    # leases: held on both sides during the plan's life, exactly on the pages the vectors name
    assert pr.src.leases_active() == 1 and pr.dst.leases_active() == 1
    assert plan.dst_lease.pages["draft"].tolist() == sorted(
        pr.dst.translate_pages(torch.div(pr.vt_dst["draft"][::4], 4, rounding_mode="floor"), "draft").tolist())
    assert plan.src_lease.pages["swa"].tolist() == sorted(
        pr.src.translate_pages(torch.div(pr.vt_src["full"][8::2], 2, rounding_mode="floor"), "swa").tolist())
    execute(plan)
    pr.assert_arrived("full", range(11))
    pr.assert_arrived("draft", range(11))
    pr.assert_arrived("swa", range(8, 11))
    pr.assert_nothing_else_written()
    assert plan.complete() is True
    assert pr.src.leases_active() == 0 and pr.dst.leases_active() == 0
    pr.src.check_invariants()
    pr.dst.check_invariants()


def test_F23_prefix_sends_only_the_rest_and_clips_mid_page(make_allocator):
    """The receiver holds 5 tokens: token 4 sits in page 2 with token 5, so page 2 travels as rows 5 only."""
    pr = Pair(make_allocator, tiny_spec(), L=11, P=5)
    plan = build_plan("r2", pr.src, pr.vt_src, pr.dst, pr.vt_dst, prefix_tokens=5)
    by = {n: s.bytes for n, s in plan.stats_by_vector.items()}
    # target: row 5 (2 layers x K/V x 4 B = 16 B) + whole pages of tokens 6..11 (3 x 32 B)
    # draft (page_size 4): rows 5, 6, 7 of page 1 (K and V, 3 x 8 B each = 48 B) + page 2 (64 B)
    # swa: tail floor_to_page(max(5, 8)) = 8 -> 2 whole pages x 16 B
    assert by == {"target": 16 + 96, "draft": 48 + 64, "swa_tail": 32}
    assert plan.vectors["target"].num_rows == 1 and plan.vectors["draft"].num_rows == 3
    execute(plan)
    pr.assert_arrived("full", range(5, 11))
    pr.assert_arrived("draft", range(5, 11))
    pr.assert_arrived("swa", range(8, 11))
    pr.assert_untouched("full", range(0, 5))
    pr.assert_untouched("draft", range(0, 5))
    pr.assert_nothing_else_written()
    plan.complete()


def test_F23_prefix_inside_the_window_clips_the_swa_tail(make_allocator):
    pr = Pair(make_allocator, tiny_spec(), L=11, P=9)
    plan = build_plan("r3", pr.src, pr.vt_src, pr.dst, pr.vt_dst, prefix_tokens=9)
    # swa tail starts at floor_to_page(max(9, 8)) = 8, and row 8 is valid on the receiver: rows 9, 10 only
    v = plan.vectors["swa_tail"]
    assert (v.num_rows, v.num_pages) == (1, 1)
    execute(plan)
    pr.assert_arrived("swa", range(9, 11))
    pr.assert_untouched("swa", [8])
    pr.assert_untouched("full", range(9))
    pr.assert_nothing_else_written()
    plan.complete()


def test_F23_sender_refuses_a_half_that_would_overwrite_valid_tokens(make_allocator):
    pr = Pair(make_allocator, tiny_spec(), L=11, P=5)
    half = build_receiver_half("r4", pr.dst, pr.vt_dst, prefix_tokens=5)
    d = half.to_dict()
    d["vectors"]["target"]["row_lo"] = 4  # would resend token 4, which the receiver holds
    with pytest.raises(UmallocValueError, match="shared geometry"):
        build_send_plan("r4", pr.src, pr.vt_src, d, PeerLayout.from_arena(pr.dst.arena))
    assert pr.src.leases_active() == 0
    half.abort()
    assert pr.dst.leases_active() == 0


def test_split_form_over_json_agrees_with_the_receiver(make_allocator):
    pr = Pair(make_allocator, tiny_spec(state=True), L=9, P=3, state=True)
    half = build_receiver_half("r5", pr.dst, pr.vt_dst, prefix_tokens=3, seq_len_tokens=9)
    dst_layout_wire = json.dumps(PeerLayout.from_arena(pr.dst.arena).to_dict())
    half_wire = json.dumps(half.to_dict())
    assert "vt" not in half_wire
    plan = build_send_plan("r5", pr.src, pr.vt_src, json.loads(half_wire),
                           PeerLayout.from_dict(json.loads(dst_layout_wire)))
    assert plan.dst_lease is None and plan.src_lease.active and half.lease.active
    assert list(plan.vectors) == ["target", "draft", "swa_tail", "state"]
    assert plan.vectors["state"].num_pages == 1
    execute(plan)
    pr.assert_arrived("full", range(3, 9))
    pr.assert_arrived("draft", range(3, 9))
    pr.assert_arrived("swa", range(6, 9))   # window 3: tokens 6..8; tail page starts at 6
    pr.assert_arrived("state", range(2))
    pr.assert_untouched("full", range(3))
    pr.assert_nothing_else_written()
    plan.complete()
    assert pr.src.leases_active() == 0 and pr.dst.leases_active() == 1  # the receiver's own lease
    half.complete()
    assert pr.dst.leases_active() == 0


def test_state_travels_even_when_every_token_is_held(make_allocator):
    pr = Pair(make_allocator, tiny_spec(state=True), L=6, P=6, state=True)
    plan = build_plan("r6", pr.src, pr.vt_src, pr.dst, pr.vt_dst, prefix_tokens=6, seq_len_tokens=6)
    assert [n for n, v in plan.vectors.items() if not v.empty] == ["state"]
    execute(plan)
    pr.assert_arrived("state", range(2))
    pr.assert_untouched("full", range(6))
    plan.complete()


@pytest.mark.parametrize("how", ["fail", "context", "abort"])
def test_leases_released_on_failure_paths(make_allocator, how):
    pr = Pair(make_allocator, tiny_spec())
    plan = build_plan("r7", pr.src, pr.vt_src, pr.dst, pr.vt_dst, deadline_s=60.0)
    assert pr.src.leases_active() == 1 and pr.dst.leases_active() == 1
    if how == "fail":
        plan.fail(RuntimeError("peer closed"))
    elif how == "abort":
        plan.abort()
    else:
        with pytest.raises(RuntimeError):
            with plan:
                raise RuntimeError("transfer error")
    assert plan.state == {"fail": "failed", "context": "failed", "abort": "aborted"}[how]
    assert pr.src.leases_active() == 0 and pr.dst.leases_active() == 0
    assert pr.src.lease_table.leases_released == 1 and pr.dst.lease_table.leases_released == 1


def test_a_failed_build_holds_no_lease(make_allocator):
    pr = Pair(make_allocator, tiny_spec(), src_release_swa=False)
    pr.src.unbind_end("swa", pr.vt_src["full"][8:10])  # the source lost a tail page: strict translation fails
    with pytest.raises(TombstoneError):
        build_plan("r8", pr.src, pr.vt_src, pr.dst, pr.vt_dst)
    assert pr.src.leases_active() == 0 and pr.dst.leases_active() == 0


def test_freed_source_pages_stay_pending_while_the_plan_holds_them(make_allocator):
    pr = Pair(make_allocator, tiny_spec())
    plan = build_plan("r9", pr.src, pr.vt_src, pr.dst, pr.vt_dst)
    pr.src.free(pr.vt_src["full"], owner="full")  # the prefill finished the request while the transfer is in flight
    assert pr.src.stats()["full"].pending_pages == 6
    execute(plan)  # the bytes under the lease are still the request's
    pr.assert_nothing_else_written()
    plan.complete()
    assert pr.src.stats()["full"].pending_pages == 0
    pr.src.check_invariants()


def test_draft_all_sliding_sends_its_tail_mixed_sends_everything(make_allocator):
    sliding = (LayerSpec.mha(1, 4, window_tokens=5),) * 2
    pr = Pair(make_allocator, tiny_spec(sliding))
    plan = build_plan("s", pr.src, pr.vt_src, pr.dst, pr.vt_dst)
    # every layer slides (window 5): tail from floor_to_page(11 - 5 = 6) with page_size 4 -> token 4: pages 1, 2
    assert plan.vectors["draft"].num_pages == 2
    execute(plan)
    pr.assert_arrived("draft", range(4, 11))
    plan.complete()
    mixed = (LayerSpec.mha(1, 4, window_tokens=5), LayerSpec.mha(1, 4))
    pr = Pair(make_allocator, tiny_spec(mixed))
    plan = build_plan("m", pr.src, pr.vt_src, pr.dst, pr.vt_dst)
    assert plan.vectors["draft"].num_pages == 3  # a full layer: every token travels
    execute(plan)
    pr.assert_arrived("draft", range(11))
    plan.complete()


def test_incompatible_peers_refused_before_any_lease(make_allocator):
    spec_b = tiny_spec((LayerSpec.mha(2, 4),))  # draft with 2 KV heads
    pr = Pair(make_allocator, tiny_spec(), spec_b)
    with pytest.raises(IncompatiblePeerError) as ei:
        build_plan("x", pr.src, pr.vt_src, pr.dst, pr.vt_dst)
    assert set(ei.value.differences) == {  # entry/page bytes derive from the heads (a TP ratio scales them)
        "end 'draft' layer 0: num_kv_heads local 1 != remote 2",
    }
    assert pr.src.leases_active() == 0 and pr.dst.leases_active() == 0


# ---- fault classes ------------------------------------------------------------------------------------------


def test_F09_lookahead_pages_stay_outside_the_plan(make_allocator):
    """The decode reserved k = 3 draft lookahead slots (tokens 11..13: one more draft page); the plan fills
    tokens [0, 11) only, and a destination index pointing into the reserved-but-unleased page is refused."""
    pr = Pair(make_allocator, tiny_spec(), draft_lookahead=3)
    plan = build_plan("f9", pr.src, pr.vt_src, pr.dst, pr.vt_dst, seq_len_tokens=11)
    look = int(pr.dst.translate_pages(torch.div(pr.vt_dst["draft"][12:13], 4, rounding_mode="floor"), "draft")[0])
    assert look not in plan.dst_lease.pages["draft"].tolist()
    pb = 64
    lo, hi = pr.dst.arena.base_ptr + look * pb, pr.dst.arena.base_ptr + (look + 1) * pb
    d = plan.descriptors()
    assert not np.any((d[:, 1] < hi) & (d[:, 1] + d[:, 2] > lo))
    plan.complete()
    half = build_receiver_half("f9b", pr.dst, pr.vt_dst, seq_len_tokens=11)
    wire = half.to_dict()
    wire["vectors"]["draft"]["pages"][-1] = look  # a draft index outside the reserved, leased pages
    with pytest.raises(DescriptorBoundsError, match="not all leased"):
        build_send_plan("f9b", pr.src, pr.vt_src, wire, PeerLayout.from_arena(pr.dst.arena))
    assert pr.src.leases_active() == 0
    half.abort()


def test_F10_every_vector_travels_draft_by_its_own_ids(make_allocator):
    pr = Pair(make_allocator, tiny_spec())
    with pytest.raises(UmallocValueError, match="F10"):
        build_plan("f10", pr.src, {"full": pr.vt_src["full"]}, pr.dst, pr.vt_dst)
    assert pr.src.leases_active() == 0 and pr.dst.leases_active() == 0
    plan = build_plan("f10", pr.src, pr.vt_src, pr.dst, pr.vt_dst)
    draft_vpages = torch.div(pr.vt_dst["draft"][::4], 4, rounding_mode="floor")
    assert plan.vectors["draft"].dst_pages.tolist() == pr.dst.translate_pages(draft_vpages, "draft").tolist()
    assert set(plan.descriptors_by_vector()) == {"target", "draft", "swa_tail"}
    plan.complete()
    no_draft = Pair(make_allocator, tiny_spec(), tiny_spec(draft=False))
    with pytest.raises(IncompatiblePeerError) as ei:
        build_plan("f10b", no_draft.src, no_draft.vt_src, no_draft.dst, no_draft.vt_dst)
    assert ei.value.differences == ["end 'draft' (role draft): missing on remote"]


def test_F13_only_physical_ids_on_the_wire(make_allocator):
    pr = Pair(make_allocator, tiny_spec())
    half = build_receiver_half("f13", pr.dst, pr.vt_dst)
    wire = half.to_dict()
    # physical ids read straight from the receiver's v2p tables (independent of the plan)
    v2p_full, v2p_swa = pr.dst.v2p("full").cpu(), pr.dst.v2p("swa").cpu()
    v2p_draft = pr.dst.v2p("draft").cpu()
    vp_full = torch.div(pr.vt_dst["full"][::2], 2, rounding_mode="floor")
    vp_draft = torch.div(pr.vt_dst["draft"][::4], 4, rounding_mode="floor")
    assert wire["vectors"]["target"]["pages"] == v2p_full[vp_full].tolist()
    assert wire["vectors"]["swa_tail"]["pages"] == v2p_swa[vp_full[4:]].tolist()
    assert wire["vectors"]["draft"]["pages"] == v2p_draft[vp_draft].tolist()
    assert wire["vectors"]["draft"]["pages"] != vp_draft.tolist()  # the virtual ids would be wrong here
    plan = build_send_plan("f13", pr.src, pr.vt_src, wire, PeerLayout.from_arena(pr.dst.arena))
    base = pr.dst.arena.base_ptr
    swa_desc = plan.descriptors_by_vector()["swa_tail"]
    firsts = sorted(int(a - base) // 16 for a in swa_desc[:, 1])
    assert set(firsts) <= set(v2p_swa[vp_full[4:]].tolist())
    plan.complete()
    half.complete()


def test_F14_draft_page_size_scales_ids_and_bytes(make_allocator):
    """Target page_size 2, draft page_size 4: the draft vector is derived from the token range on 4-token pages
    (3 pages for 11 tokens, 64 B each), never from the target's 6 page ids."""
    pr = Pair(make_allocator, tiny_spec(), L=11, P=5)
    plan = build_plan("f14", pr.src, pr.vt_src, pr.dst, pr.vt_dst, prefix_tokens=5)
    v = plan.vectors["draft"]
    dp = pr.dst.translate_pages(torch.div(pr.vt_dst["draft"][::4], 4, rounding_mode="floor"), "draft").tolist()
    assert v.dst_pages.tolist() == dp[2:]                        # whole page: tokens 8..11
    assert v.dst_rows.tolist() == [dp[1] * 4 + r for r in (1, 2, 3)]  # tokens 5, 6, 7 of page 1
    d = plan.descriptors_by_vector()["draft"]
    assert sorted(d[:, 2].tolist()) == [24, 24, 64]  # 3 rows x 8 B for K and for V; one 64 B page
    execute(plan)
    pr.assert_arrived("draft", range(5, 11))
    pr.assert_untouched("draft", range(5))
    plan.complete()


def test_F19_swa_priced_by_its_window_tail(make_allocator):
    for L, P, want_pages in ((11, 0, 2), (8, 0, 2), (3, 0, 2), (2, 0, 1), (13, 0, 2), (12, 11, 1), (12, 9, 2)):
        pr = Pair(make_allocator, tiny_spec(), L=L, P=P)
        plan = build_plan("f19", pr.src, pr.vt_src, pr.dst, pr.vt_dst, prefix_tokens=P)
        # [floor_to_page(max(P, L - 3)), L) on 2-token pages, by hand
        first = (max(P, L - SWA_W, 0) // 2) * 2
        pages = -(-L // 2) - first // 2
        assert pages == want_pages
        v = plan.vectors["swa_tail"]
        assert v.num_pages + (1 if v.num_rows else 0) == pages, (L, P)
        assert plan.vectors["target"].num_pages + (1 if plan.vectors["target"].num_rows else 0) == \
            -(-L // 2) - P // 2
        execute(plan)
        pr.assert_arrived("swa", range(max(P, L - SWA_W), L))
        pr.assert_nothing_else_written()
        plan.complete()


def test_F22_geometry_checked_at_connect_and_halves_bound_to_it(make_allocator):
    pr = Pair(make_allocator, tiny_spec())
    half = build_receiver_half("f22", pr.dst, pr.vt_dst)
    other = PeerLayout.from_arena(pr.src.arena)  # a layout the half was not built on (other base address)
    with pytest.raises(UmallocValueError, match="reconnect"):
        build_send_plan("f22", pr.src, pr.vt_src, half, other)
    assert pr.src.leases_active() == 0
    half.abort()
    # page size 2 -> 4 is mapped (ids expand by the ratio, F14); 2 -> 3 is not
    pages_differ = ArenaSpec(tuple(EndSpec(e.name, e.layers, 3 if e.name in ("full", "swa") else e.page_size,
                                           e.grow, e.owner, e.role) for e in tiny_spec().ends), arena_bytes=4096)
    local = PeerLayout.from_arena(pr.src.arena)
    remote = PeerLayout(pages_differ, (Region(1 << 20, 4096),), 1 << 20)
    with pytest.raises(IncompatiblePeerError) as ei:
        check_compatible(local, remote)
    why = "neither divides the other (ids expand by a whole ratio, F14)"
    assert set(ei.value.differences) == {f"end 'full': page_size local 2, remote 3: {why}",
                                         f"end 'swa': page_size local 2, remote 3: {why}"}


def test_token_ids_that_do_not_fill_pages_in_order_are_refused(make_allocator):
    pr = Pair(make_allocator, tiny_spec())
    bad = dict(pr.vt_dst)
    bad["full"] = pr.vt_dst["full"].clone()
    bad["full"][3] = pr.vt_dst["full"][7]  # row 3 claims a token of another page
    with pytest.raises(InvalidIdError, match="row 3"):
        build_plan("bad", pr.src, pr.vt_src, pr.dst, bad)
    shifted = dict(pr.vt_src)
    shifted["draft"] = pr.vt_src["draft"] + 1  # offsets no longer match the rows
    with pytest.raises(InvalidIdError, match="offset"):
        build_plan("bad", pr.src, shifted, pr.dst, pr.vt_dst)
    assert pr.src.leases_active() == 0 and pr.dst.leases_active() == 0


# ---- validation at the API boundary: typed errors, nothing changed -------------------------------------------


def _state(*allocs):
    return [(a.snapshot(), a.leases_active()) for a in allocs]


def _assert_unchanged(before, *allocs):
    from umalloc.allocator.facade import snapshots_equal

    after = _state(*allocs)
    for (snap_a, leases_a), (snap_b, leases_b) in zip(before, after, strict=True):
        assert snapshots_equal(snap_a, snap_b) and leases_a == leases_b == 0


def test_build_plan_refuses_a_virtual_page_named_twice(make_allocator):
    pr = Pair(make_allocator, tiny_spec(), L=8)
    vt = pr.vt_dst["full"].clone()
    vt[6:8] = vt[2:4]  # local page 3 names local page 1's virtual page: two descriptors would write one page
    before = _state(pr.src, pr.dst)
    with pytest.raises(InvalidIdError, match=f"virtual page {int(vt[2]) // 2} is named twice"):
        build_plan("dup", pr.src, pr.vt_src, pr.dst, {**pr.vt_dst, "full": vt})
    _assert_unchanged(before, pr.src, pr.dst)
    src_vt = pr.vt_src["full"].clone()
    src_vt[6:8] = src_vt[2:4]
    with pytest.raises(InvalidIdError, match="named twice"):
        build_plan("dup", pr.src, {**pr.vt_src, "full": src_vt}, pr.dst, pr.vt_dst)
    _assert_unchanged(before, pr.src, pr.dst)


def test_receiver_half_from_dict_refuses_float_and_oversized_page_ids(make_allocator):
    pr = Pair(make_allocator, tiny_spec(), L=8)
    half = build_receiver_half("h", pr.dst, pr.vt_dst)
    wire = json.loads(json.dumps(half.to_dict()))
    pages = wire["vectors"]["target"]["pages"]
    for bad in (1.5, float(pages[0]), True, "3", 1 << 63):
        broken = json.loads(json.dumps(wire))
        broken["vectors"]["target"]["pages"] = [bad] + pages[1:]
        with pytest.raises(UmallocValueError):
            ReceiverHalf.from_dict(broken)
        broken = json.loads(json.dumps(wire))
        broken["leased"]["full"] = [bad] + broken["leased"]["full"][1:]
        with pytest.raises(UmallocValueError):
            ReceiverHalf.from_dict(broken)
    assert ReceiverHalf.from_dict(wire).vectors["target"].pages.tolist() == pages  # the int form still loads
    half.abort()


def test_meta_and_sparse_id_tensors_are_refused_typed(make_allocator):
    pr = Pair(make_allocator, tiny_spec(), L=8)
    before = _state(pr.src, pr.dst)
    meta = torch.empty(8, dtype=torch.int64, device="meta")
    sparse = pr.vt_dst["full"].to_sparse()
    for bad in (meta, sparse):
        with pytest.raises(InvalidIdError, match="allowed a strided CPU or CUDA tensor"):
            build_plan("m", pr.src, pr.vt_src, pr.dst, {**pr.vt_dst, "full": bad})
        with pytest.raises(InvalidIdError, match="allowed a strided CPU or CUDA tensor"):
            build_plan("m", pr.src, {**pr.vt_src, "full": bad}, pr.dst, pr.vt_dst)
    with pytest.raises(InvalidIdError):
        IndexVector("t", "full", "full", meta, meta, layout().region_group("full"), layout().region_group("full"))
    _assert_unchanged(before, pr.src, pr.dst)


def test_int32_id_tensors_are_accepted_like_int64(make_allocator):
    pr = Pair(make_allocator, tiny_spec(), L=11, P=3)
    want = build_plan("a", pr.src, pr.vt_src, pr.dst, pr.vt_dst, prefix_tokens=3)
    expect = want.descriptors().copy()
    want.abort()
    i32 = lambda d: {k: v.to(torch.int32) for k, v in d.items()}  # noqa: E731
    got = build_plan("a", pr.src, i32(pr.vt_src), pr.dst, i32(pr.vt_dst), prefix_tokens=3)
    assert np.array_equal(got.descriptors(), expect)
    got.abort()
    np32 = {k: v.numpy().astype(np.int32) for k, v in pr.vt_dst.items()}
    got = build_plan("a", pr.src, pr.vt_src, pr.dst, np32, prefix_tokens=3)
    assert np.array_equal(got.descriptors(), expect)
    got.abort()
    before = _state(pr.src, pr.dst)
    for bad in (pr.vt_dst["full"].to(torch.int16), pr.vt_dst["full"].double(), pr.vt_dst["full"].numpy().astype(np.uint64)):
        with pytest.raises(InvalidIdError, match="allowed"):
            build_plan("a", pr.src, pr.vt_src, pr.dst, {**pr.vt_dst, "full": bad})
    _assert_unchanged(before, pr.src, pr.dst)


def test_physical_ids_that_do_not_fit_int64_are_refused():
    src, dst = layout(), layout(base=5000)
    too_big = np.array([(1 << 63) + 5], dtype=np.uint64)
    with pytest.raises(InvalidIdError, match=r"allowed \[0, 9223372036854775807\]"):
        IndexVector("t", "full", "full", too_big, too_big, src.region_group("full"),
                    dst.region_group("full"))
    with pytest.raises(InvalidIdError, match=r"allowed \[0, 9223372036854775807\]"):
        IndexVector("t", "full", "full", [1 << 63], [3], src.region_group("full"), dst.region_group("full"))
    ok = IndexVector("t", "full", "full", np.array([3], dtype=np.uint64), np.array([7], dtype=np.int32),
                     src.region_group("full"), dst.region_group("full"))
    assert ok.src_pages.dtype == ok.dst_pages.dtype == np.int64 and ok.dst_pages.tolist() == [7]


def test_ranges_named_in_messages_are_the_ranges_allowed():
    import re

    end = tiny_spec().end("full")

    def bounds_of(call) -> tuple[int, int]:
        with pytest.raises(UmallocValueError) as e:
            call()
        lo, hi = re.findall(r"\[(-?\d+), (-?\d+)\]", str(e.value))[-1]  # the allowed range is named last
        return int(lo), int(hi)

    # DCP rank: named [0, d - 1]; both ends are accepted, one past either is refused
    lo, hi = bounds_of(lambda: source_ranks(9, 4, 2))
    assert (lo, hi) == (0, 3)
    source_ranks(lo, 4, 2), source_ranks(hi, 4, 2)
    # prefix: named [0, L]
    lo, hi = bounds_of(lambda: vector_rows(end, 7, 9))
    assert (lo, hi) == (0, 7)
    vector_rows(end, 7, lo), vector_rows(end, 7, hi)
    with pytest.raises(UmallocValueError):
        vector_rows(end, 7, hi + 1)
    # TP rank: named [0, tp_size - 1]
    lo, hi = bounds_of(lambda: layout(tp_rank=2, tp_size=2))
    assert (lo, hi) == (0, 1)
    layout(tp_rank=hi, tp_size=2)
    # a descriptor's pages: named [first, top], the handable range of the end
    src, dst = layout(), layout(base=5000)
    lo, hi = bounds_of(lambda: plan_of(src, dst, vec(src, dst, [0], [3]), [0], [3]))
    assert (lo, hi) == (src.geometry("full").first_page, src.geometry("full").top_page)
    for p in (lo, hi):
        plan_of(src, dst, vec(src, dst, [p], [3]), [p], [3])


def test_checked_layouts_skip_the_recheck_and_must_match(make_allocator):
    from umalloc.transfer import CheckedLayouts, compatible_layouts

    pr = Pair(make_allocator, tiny_spec(), L=9, P=3)
    sl, dl = PeerLayout.from_arena(pr.src.arena), PeerLayout.from_arena(pr.dst.arena)
    checked = compatible_layouts(sl, dl)
    assert isinstance(checked, CheckedLayouts) and checked.covers(sl, dl) and not checked.covers(dl, sl)
    plain = build_plan("c", pr.src, pr.vt_src, pr.dst, pr.vt_dst, prefix_tokens=3)
    expect = plain.descriptors().copy()
    plain.abort()
    plan = build_plan("c", pr.src, pr.vt_src, pr.dst, pr.vt_dst, prefix_tokens=3, checked=checked)
    assert np.array_equal(plan.descriptors(), expect)
    plan.abort()
    before = _state(pr.src, pr.dst)
    with pytest.raises(UmallocValueError, match="not \\(src_layout, dst_layout\\)"):
        build_plan("c", pr.src, pr.vt_src, pr.dst, pr.vt_dst, checked=compatible_layouts(dl, sl))
    with pytest.raises(UmallocValueError, match="allowed a CheckedLayouts"):
        build_plan("c", pr.src, pr.vt_src, pr.dst, pr.vt_dst, checked=(sl, dl))
    _assert_unchanged(before, pr.src, pr.dst)
    other = layout(base=1 << 20)
    with pytest.raises(IncompatiblePeerError):
        compatible_layouts(sl, other)


def test_transfer_plan_is_plan_like(make_allocator):
    from umalloc.transfer import PlanLike

    pr = Pair(make_allocator, tiny_spec(), L=8)
    plan = build_plan("p", pr.src, pr.vt_src, pr.dst, pr.vt_dst)
    assert isinstance(plan, PlanLike)
    members = {"state", "vectors", "num_descriptors", "total_bytes", "src_lease", "dst_lease", "descriptors",
               "complete", "fail", "abort"}
    declared = set(PlanLike.__annotations__) | {n for n in vars(PlanLike) if not n.startswith("_")}
    assert declared == members and members <= set(dir(plan))
    assert not isinstance(object(), PlanLike)
    plan.abort()
