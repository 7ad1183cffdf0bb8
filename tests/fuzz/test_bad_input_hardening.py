"""Classes of bad input to the arena, the allocator, leases, translators and the plan builders
get a typed :class:`~umalloc.errors.UmallocError` and change nothing (allocator snapshots compared before/after)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from umalloc.allocator.facade import MultiEndedAllocator, snapshots_equal
from umalloc.errors import UmallocError
from umalloc.geometry.arena import Arena
from umalloc.leases.table import LeaseTable
from umalloc.testing import small_allocator, tiny_spec
from umalloc.transfer.build import build_plan, build_receiver_half, build_send_plan
from umalloc.transfer.rows import vector_rows
from umalloc.translators import get_translator

_ARENA_CALLS = {
    "end": lambda ar, n: ar.end(n), "page_bytes": lambda ar, n: ar.page_bytes(n),
    "first_page": lambda ar, n: ar.first_page(n), "top_page": lambda ar, n: ar.top_page(n),
    "envelopes": lambda ar, n: ar.envelopes(n), "region_member": lambda ar, n: ar.region_member(n),
    "page_offset_bytes": lambda ar, n: ar.page_offset_bytes(n, 1), "page_address": lambda ar, n: ar.page_address(n, 1),
    "envelope": lambda ar, n: ar.envelope(n, 1), "kv_views": lambda ar, n: ar.kv_views(n, 0),
    "kv_group_views": lambda ar, n: ar.kv_group_views(n, 0),
    "copy_pages": lambda ar, n: ar.copy_pages(n, torch.tensor([1]), torch.tensor([2])),
}


@pytest.mark.parametrize("name", [["full"], {"full": 1}, None, 3, b"full"])
@pytest.mark.parametrize("call", sorted(_ARENA_CALLS))
def test_every_arena_method_taking_an_end_name_refuses_a_non_name_typed(call, name) -> None:
    """A list (unhashable), a dict, None, an int or bytes where an end name is expected."""
    ar = Arena(tiny_spec())
    before = ar.data.clone()
    with pytest.raises(UmallocError):
        _ARENA_CALLS[call](ar, name)
    assert torch.equal(before, ar.data)


def test_lease_table_bad_input_is_typed_and_changes_nothing() -> None:
    """``expire("soon")`` / expire(nan), a 2**40-page table (refused before allocating pins),
    is_pinned out of range (both signs), a clock that returns a string, a list for an end name."""
    table = LeaseTable({"full": 4})
    lease = table.pin({"full": [1]}, deadline_s=None)
    for call in (lambda: table.expire("soon"), lambda: table.expire(float("nan")),
                 lambda: LeaseTable({"full": 2**40}), lambda: table.is_pinned("full", np.array([100])),
                 lambda: table.is_pinned("full", np.array([-1])), lambda: table.is_pinned(["full"], np.array([1])),
                 lambda: table.pin({("full",): [1]}, deadline_s=None), lambda: table.is_pinned("full", np.array([0.5]))):
        with pytest.raises(UmallocError):
            call()
    assert len(table) == 1 and table.is_pinned("full", np.array([1, 2])).tolist() == [True, False]
    lease.release()
    alloc = MultiEndedAllocator(Arena(tiny_spec()), clock=lambda: "noon")
    vp = alloc.alloc_pages(1)
    before = alloc.snapshot()
    with pytest.raises(UmallocError, match="clock"):
        alloc.lease({"full": alloc.translate_pages(vp, "full")}, deadline_s=1.0)
    assert snapshots_equal(before, alloc.snapshot())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without CUDA")
def test_cuda_and_pinned_memory_without_a_gpu_are_refused_typed() -> None:
    """Arena(device="cuda"), mirror_device="cuda" / "bogus" / 3, pin_memory=True without a GPU."""
    for call in (lambda: Arena(tiny_spec(), device="cuda"), lambda: Arena(tiny_spec(), pin_memory=True),
                 lambda: Arena(tiny_spec(), pin_memory="yes"),
                 lambda: MultiEndedAllocator(Arena(tiny_spec()), mirror_device="cuda"),
                 lambda: MultiEndedAllocator(Arena(tiny_spec()), mirror_device="bogus"),
                 lambda: MultiEndedAllocator(Arena(tiny_spec()), mirror_device=3.5)):
        with pytest.raises(UmallocError):
            call()


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_an_expanded_out_is_refused_and_left_unwritten(impl) -> None:
    """A stride-0 (expanded) ``out=`` of the translators: InvalidIdError, nothing written."""
    tr = get_translator(impl=impl)
    v2p = torch.tensor([0, 3, 4, 5], dtype=torch.int64)
    base = torch.full((1,), 7, dtype=torch.int64)
    out = base.expand(3)
    for call in (lambda: tr.virtual_to_physical_pages(torch.tensor([1, 2, 1]), v2p, out=out),
                 lambda: tr.virtual_to_physical(torch.tensor([1, 2, 3]), v2p, 1, out=out),
                 lambda: tr.virtual_to_physical_pages(np.array([1, 2, 1]), v2p.numpy(),
                                                       out=np.lib.stride_tricks.as_strided(np.zeros(1, np.int64),
                                                                                           (3,), (0,)))):
        with pytest.raises(UmallocError, match="stride-0"):
            call()
    assert base.tolist() == [7]


def test_plan_builders_refuse_what_is_not_an_allocator_or_an_end_spec() -> None:
    """``build_plan(object(), ...)`` and friends, vector_rows(None, ...): typed, no lease held."""
    alloc = small_allocator()
    vt = alloc.alloc_pages(2) * 2
    before = alloc.snapshot()
    for call in (lambda: build_plan("r", object(), vt, alloc, vt), lambda: build_plan("r", alloc, vt, None, vt),
                 lambda: build_receiver_half("r", "alloc", vt), lambda: build_send_plan("r", 5, vt, {}, None),
                 lambda: vector_rows(None, 4), lambda: vector_rows("full", 4)):
        with pytest.raises(UmallocError):
            call()
    assert snapshots_equal(before, alloc.snapshot()) and alloc.leases_active() == 0


def test_a_plan_whose_destination_descriptors_overlap_is_refused() -> None:
    """A hand-made TransferPlan writing two source pages into one destination page (its pages
    leased on both sides, inside the regions) is refused with DescriptorBoundsError: no plan, nothing posted."""
    from umalloc.errors import DescriptorBoundsError
    from umalloc.transfer import PeerLayout
    from umalloc.transfer.plan import IndexVector, TransferPlan

    src, dst = small_allocator(), small_allocator()
    vs, vd = src.alloc_pages(2), dst.alloc_pages(2)
    ps, pd = src.translate_pages(vs, "full").numpy(), dst.translate_pages(vd, "full").numpy()
    sl, dl = PeerLayout.from_arena(src.arena), PeerLayout.from_arena(dst.arena)
    group_s, group_d = sl.region_group("full"), dl.region_group("full")
    ok = IndexVector("target", "full", "full", ps, pd, group_s, group_d)
    TransferPlan("ok", [ok], src_layout=sl, dst_layout=dl, src_leased_pages={"full": ps},
                 dst_leased_pages={"full": pd})
    twice = IndexVector("target", "full", "full", ps, np.array([pd[0], pd[0]]), group_s, group_d)
    with pytest.raises(DescriptorBoundsError, match="overlapping destination"):
        TransferPlan("bad", [twice], src_layout=sl, dst_layout=dl, src_leased_pages={"full": ps},
                     dst_leased_pages={"full": pd})


@pytest.mark.parametrize("args", [(3, 2**63, 0), (2**63, 1, 0), (3, 2**64, 1), (-1, 1, 0)])
def test_counts_beyond_int64_are_refused_by_the_dcp_helpers(args) -> None:
    """A count no id call accepts (2**63 and above, negative) is refused, never computed with."""
    from umalloc.transfer.rows import owned_count

    with pytest.raises(UmallocError, match=r"allowed an int in \[[01], 2\*\*63\)"):
        owned_count(*args)
    assert owned_count(2**63 - 1, 2**63 - 1, 0) == 1  # the largest counts allowed: one position each


@pytest.mark.parametrize("pages", [torch.zeros(2, dtype=torch.int64, device="meta"), torch.tensor([0.5]),
                                   torch.tensor([[1]]), np.array([True]), "1", [1.5]])
def test_is_pinned_validates_pages_as_every_id_argument(pages) -> None:
    table = LeaseTable({"full": 8})
    with pytest.raises(UmallocError, match="is_pinned: pages"):
        table.is_pinned("full", pages)
    assert table.is_pinned("full", torch.tensor([1, 2], dtype=torch.int16)).tolist() == [False, False]
