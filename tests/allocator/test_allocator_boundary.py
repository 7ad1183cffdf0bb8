"""The allocator's API boundary: read-only tables, the fenced unsafe layer (debug-mode direct-entry checks, heap
ownership, no copies), one allocator per arena, bool-only ``strict``, int32 / numpy ids, typed errors for huge
counts, meta/sparse tensors, iterators, and state (and ``out``) unchanged after every refusal."""

from __future__ import annotations

import copy
import gc
import pickle

import numpy as np
import pytest
import torch

from umalloc.allocator.facade import MultiEndedAllocator, snapshots_equal
from umalloc.errors import (
    ArenaInUseError,
    HeapCopyError,
    InvalidIdError,
    LeaseError,
    TombstoneError,
    UmallocValueError,
)
from umalloc.geometry.arena import Arena
from umalloc.leases.table import LeaseTable
from umalloc.pool.kernels import raw
from umalloc.pool.kernels.ops import hot_entries
from umalloc.pool.pagestate import TOMBSTONE
from umalloc.testing import FakeClock, small_allocator, tiny_spec


def T(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def with_request():
    """small_allocator (page_size 2) holding one 4-token request: virtual pages 1, 2 -> full 1, 2 / swa 8, 9."""
    alloc = small_allocator()
    toks = alloc.alloc_extend(T(0), T(4), T(-1))
    assert toks.tolist() == [2, 3, 4, 5]
    return alloc, toks


# ---- read-only tables ---------------------------------------------------------------------------------------
def test_translate_into_a_table_is_refused_and_tables_stay_intact() -> None:
    alloc, toks = with_request()
    snap = alloc.snapshot()
    with pytest.raises(InvalidIdError, match="read-only"):
        alloc.translate(toks[:2], "full", out=alloc.v2p("full")[:2])
    with pytest.raises(InvalidIdError, match="read-only"):
        alloc.alloc_pages(2, out=alloc.p2v("swa")[:2])
    assert snapshots_equal(snap, alloc.snapshot())
    alloc.check_invariants()
    assert alloc.v2p("full").tolist()[:4] == [0, 1, 2, TOMBSTONE]


@pytest.mark.parametrize("write", [
    lambda t: t.__setitem__(1, 7),
    lambda t: t.copy_(torch.zeros_like(t)),
    lambda t: t.fill_(3),
    lambda t: t[1:3].zero_(),
    lambda t: torch.add(t, 1, out=t),
], ids=["setitem", "copy_", "fill_", "slice-zero_", "out="])
def test_v2p_and_p2v_refuse_writes(write) -> None:
    alloc, _ = with_request()
    for table in (alloc.v2p("swa"), alloc.p2v("full")):
        with pytest.raises(InvalidIdError, match="read-only"):
            write(table)
    alloc.check_invariants()
    assert alloc.v2p("swa").tolist()[:3] == [0, 8, 9] and alloc.p2v("full").tolist()[:3] == [TOMBSTONE, 1, 2]


def test_tables_read_and_clone_like_tensors() -> None:
    alloc, _ = with_request()
    v = alloc.v2p("swa")
    assert v[1].item() == 8 and (v[1:3] + 1).tolist() == [9, 10]
    with pytest.raises(ValueError):
        v.numpy()[1] = 3                                      # numpy's own read-only refusal
    c = v.clone()
    c[1] = 3                                                  # a clone is the caller's
    assert c[1].item() == 3 and alloc.v2p("swa")[1].item() == 8
    alloc.free(T(2))
    assert v[1].item() == TOMBSTONE                           # a view: it follows the allocator


def test_end_view_arrays_are_read_only() -> None:
    alloc, _ = with_request()
    view = alloc.ends["full"]
    for arr in (view.p2v, view.state, view.v2p):
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[1] = 0
    with pytest.raises(TypeError):
        alloc.ends["full"] = view                              # the mapping itself is read-only
    alloc.check_invariants()


def test_refused_translate_leaves_out_untouched() -> None:
    alloc, toks = with_request()
    alloc.unbind_end("swa", toks[2:3])                       # virtual page 2 unbound on swa
    out = torch.full((4,), -7, dtype=torch.int64)
    with pytest.raises(TombstoneError):
        alloc.translate(toks, "swa", out=out)                 # the bad id is the third: nothing written before it
    assert out.tolist() == [-7] * 4
    np_out = np.full(4, -7, np.int64)
    with pytest.raises(InvalidIdError):
        alloc.translate(np.array([2, 3, 99, 4]), "full", out=np_out)
    assert np_out.tolist() == [-7] * 4


# ---- the unsafe layer -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [np.zeros((2, 2), np.int64), np.zeros(4, np.float64), np.zeros(4, np.int32),
                                 [1, 2]], ids=["2-D", "float64", "int32", "list"])
def test_debug_mode_checks_direct_entry_arguments(monkeypatch, bad) -> None:
    monkeypatch.setenv("UMALLOC_DEBUG", "1")
    alloc, _ = with_request()
    snap = alloc.snapshot()
    with pytest.raises(InvalidIdError, match="argument 2"):
        alloc._entry.hot.free(alloc._entry.root_a, 0, bad, 4, True, np.zeros(0, np.int64), -1)
    with pytest.raises(InvalidIdError, match="not the root of a live heap"):
        alloc._entry.hot.free(12345, 0, np.ones(1, np.int64), 1, True, np.zeros(0, np.int64), -1)
    with pytest.raises(InvalidIdError, match="end index"):
        alloc._entry.hot.free(alloc._entry.root_a, 7, np.ones(1, np.int64), 1, True, np.zeros(0, np.int64), -1)
    with pytest.raises(InvalidIdError, match="lent"):                  # an address nobody lent, or too short
        alloc._entry.hot.free_addr(alloc._entry.root_a, 0, T(2).data_ptr(), 1, False, 0, -1)
    assert snapshots_equal(snap, alloc.snapshot())


def test_debug_mode_runs_the_same_calls(monkeypatch) -> None:
    monkeypatch.setenv("UMALLOC_DEBUG", "1")
    alloc = small_allocator()
    assert type(alloc._entry.hot) is not type(hot_entries())
    toks = alloc.alloc_extend(T(0), T(3), T(-1))
    assert toks.tolist() == [2, 3, 4]
    assert alloc.alloc_decode(T(4), T(4)).tolist() == [5]
    assert alloc.translate(toks, "swa").tolist() == [16, 17, 18] and not raw._lent   # one call: ascending 8, 9
    assert alloc.alloc_pages(1, bind=[]).tolist() == [3] and alloc.bind_end("swa", T(6))
    alloc.free(T(6))
    vp = np.empty(2, np.int64)
    assert alloc.alloc_pages(2, out=vp).tolist() == [3, 4]     # virtual page 3 was freed just before
    alloc.unbind_pages("swa", vp[:1])
    alloc.free_pages(vp)
    alloc.free(toks)
    assert alloc.stats()["full"].live_pages == 0
    alloc.check_invariants()


def test_heap_owns_the_pins_and_refuses_copies() -> None:
    alloc, _ = with_request()
    heap = alloc._heap
    lease = alloc.lease({"full": T(1)})
    assert heap.pins[0][1] == 1 and alloc.lease_table.pin_count("full")[1] == 1   # one array, lent
    lease.release()
    for f in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(HeapCopyError):
            f(heap)
        with pytest.raises(HeapCopyError):
            f(alloc)
    with pytest.raises(HeapCopyError):
        heap.h64 = np.zeros(3, np.int64)
    alloc.check_invariants()


def test_one_allocator_per_arena() -> None:
    arena = Arena(tiny_spec())
    first = MultiEndedAllocator(arena)
    assert first.alloc_pages(1).tolist() == [1]
    with pytest.raises(ArenaInUseError):
        MultiEndedAllocator(arena)
    assert first.alloc_pages(1).tolist() == [2]               # the first one is untouched
    del first
    gc.collect()
    assert MultiEndedAllocator(arena).alloc_pages(1).tolist() == [1]   # a collected allocator frees the arena


# ---- argument validation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("strict", [0, 1, "no", None, "True"])
def test_strict_is_a_bool(strict) -> None:
    alloc, toks = with_request()
    snap = alloc.snapshot()
    for call in (lambda: alloc.translate(toks, "swa", strict=strict),
                 lambda: alloc.translate_pages(T(1), "swa", strict=strict),
                 lambda: alloc.unbind_end("swa", toks[:1], strict=strict),
                 lambda: alloc.unbind_pages("swa", np.array([1]), strict=strict)):
        with pytest.raises(UmallocValueError, match="strict"):
            call()
    assert snapshots_equal(snap, alloc.snapshot())
    assert alloc.translate(toks, "swa", strict=np.bool_(True)).tolist() == [16, 17, 18, 19]


def test_translate_pages_takes_numpy_and_int32() -> None:
    alloc, _ = with_request()
    assert alloc.translate_pages(np.array([1, 2]), "swa").tolist() == [8, 9]
    res = alloc.translate_pages(np.array([2, 1], np.int32), "full")
    assert isinstance(res, np.ndarray) and res.dtype == np.int64 and res.tolist() == [2, 1]
    strided = np.array([1, 0, 2, 0])[::2]
    assert alloc.translate_pages(strided, "swa").tolist() == [8, 9]
    out = np.zeros(4, np.int64)[::2]
    assert alloc.translate_pages(np.array([1, 2]), "swa", out=out) is out and out.tolist() == [8, 9]
    assert alloc.translate(torch.tensor([3, 4], dtype=torch.int32), "swa").tolist() == [17, 18]


def test_int32_block_tables_free_and_release_like_int64() -> None:
    alloc = small_allocator()
    table = np.zeros(6, np.int32)
    vp = alloc.alloc_pages(3)
    table[[4, 1, 2]] = vp.numpy()                              # a vLLM-style int32 block table
    alloc.unbind_pages("swa", table, index=np.array([1], np.int32))
    assert alloc.translate_pages(T(1, 2, 3), "swa", strict=False).tolist() == [7, 0, 9]   # table[1] = 2
    alloc.free_pages(torch.from_numpy(table), index=torch.tensor([4, 2], dtype=torch.int32))
    assert alloc.stats()["full"].live_pages == 1
    alloc.free(torch.tensor([2 * 2], dtype=torch.int16))      # a token of virtual page 2
    assert alloc.stats()["full"].live_pages == 0
    with pytest.raises(InvalidIdError, match="does not fit int64"):
        alloc.free_pages(np.array([1 << 63], np.uint64))
    alloc.check_invariants()


@pytest.mark.parametrize("count", [2**63, 2**70, -1, 1.0, True, "3"])
def test_huge_or_wrong_counts_are_typed(count) -> None:
    alloc, _ = with_request()
    snap = alloc.snapshot()
    for call in (lambda: alloc.can_alloc({"full": count}), lambda: alloc.shortfall_pages({"swa": count}),
                 lambda: alloc.alloc_pages(count)):
        with pytest.raises(UmallocValueError, match=r"allowed an int in \[0, 2\*\*63\)"):
            call()
    assert snapshots_equal(snap, alloc.snapshot())


@pytest.mark.parametrize("make", [lambda: torch.tensor([2], device="meta"), lambda: torch.tensor([2]).to_sparse()],
                         ids=["meta", "sparse"])
def test_meta_and_sparse_tensors_are_typed(make) -> None:
    alloc, _ = with_request()
    snap = alloc.snapshot()
    with pytest.raises(LeaseError):
        alloc.lease({"full": make()})
    for call in (lambda: alloc.retract(make()), lambda: alloc.translate(make(), "full"),
                 lambda: alloc.translate_pages(make(), "full"), lambda: alloc.free(make()),
                 lambda: alloc.unbind_pages("swa", make())):
        with pytest.raises(InvalidIdError):
            call()
    assert snapshots_equal(snap, alloc.snapshot())


def test_bind_iterator_binds_and_does_not_poison_the_cache() -> None:
    alloc = small_allocator()
    a = alloc.alloc_pages(1, bind=iter(["swa"]))
    b = alloc.alloc_pages(1, bind=["swa"])
    c = alloc.alloc_pages(1, bind=(n for n in ["swa"]))
    assert alloc.translate_pages(torch.cat([a, b, c]), "swa").tolist() == [9, 8, 7]   # swa grows down from 9
    assert alloc.alloc_pages(1, bind=iter([])).tolist() == [4]
    assert alloc.translate_pages(T(4), "swa", strict=False).tolist() == [0]
    for bad in (3, "swa", [3]):
        with pytest.raises(UmallocValueError, match="bind"):
            alloc.alloc_pages(1, bind=bad)
    alloc.check_invariants()


@pytest.mark.parametrize("first", [1.5, 1.0, True, "1", None])
def test_lease_table_first_pages_must_be_ints(first) -> None:
    with pytest.raises(LeaseError, match="first_pages"):
        LeaseTable({"full": 8}, first_pages={"full": first})
    assert LeaseTable({"full": 8}, first_pages={"full": np.int64(1)}).pin({"full": [1]}, deadline_s=None).id == 0


def test_clock_must_be_callable_at_construction() -> None:
    with pytest.raises(UmallocValueError, match="clock"):
        small_allocator(clock="x")
    with pytest.raises(LeaseError, match="clock"):
        LeaseTable({"full": 8}, clock=3.0)
    clock = FakeClock()
    alloc = small_allocator(clock=clock)
    lease = alloc.lease({"full": alloc.translate_pages(alloc.alloc_pages(1), "full")}, deadline_s=1.0)
    clock.now = 2.0
    assert alloc.leases_active() == 0 and lease.state == "expired"


def test_lease_table_lent_pins_are_checked() -> None:
    with pytest.raises(LeaseError, match="pins"):
        LeaseTable({"full": 8}, pins={"full": np.zeros(8, np.int64)})
    with pytest.raises(LeaseError, match="pins"):
        LeaseTable({"full": 8}, pins={"full": np.ones(8, np.int32)})
    pins = np.zeros(8, np.int32)
    table = LeaseTable({"full": 8}, pins={"full": pins})
    table.pin({"full": [2, 3]}, deadline_s=None)
    assert pins.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]


def test_error_ranges_are_the_ranges_checked() -> None:
    alloc, _ = with_request()                                 # 10 virtual pages, page_size 2: tokens [0, 20)
    with pytest.raises(InvalidIdError, match=r"allowed \[0, 20\)"):
        alloc.translate(T(20), "swa")
    alloc.translate(T(19), "swa", strict=False)               # the last id of the range is accepted
    with pytest.raises(InvalidIdError, match=r"allowed \[0, 10\)"):
        alloc.free_pages(np.array([10]))
    with pytest.raises(InvalidIdError, match=r"allowed \[0, 4\)"):
        alloc.free_pages(np.zeros(4, np.int64), index=np.array([4]))


def test_core_imports_form_no_cycle_not_even_inside_functions() -> None:
    """Every import in the allocation layers (pool, leases, allocator, requests; module level, inside functions,
    under TYPE_CHECKING) points one way."""
    from import_graph import ROOT, assert_acyclic, import_graph

    layers = ("pool", "leases", "allocator", "requests")
    graph = import_graph(layers)
    assert_acyclic(graph)
    paths = [p for layer in layers for p in (ROOT / layer).rglob("*.py")]
    assert "umalloc.allocator.facade" not in graph["umalloc.allocator.retraction"]
    # raw addresses come from kernels/raw only (compaction reads one buffer address for an alignment test and
    # passes none to a kernel)
    for path in paths:
        if path.name in ("raw.py", "compaction.py"):
            continue
        text = path.read_text()
        hits = [w for w in (".data_ptr(", ".ctypes.", "carray(", "@intrinsic", "inttoptr(") if w in text]
        assert not hits, f"{path.name} reaches raw addresses itself: {hits}"


def test_tables_cannot_be_written_through_numpy_or_dlpack() -> None:
    from umalloc.testing import small_allocator

    alloc = small_allocator()
    alloc.alloc_pages(3)
    table = alloc.v2p("full")
    view = np.asarray(table)
    with pytest.raises(ValueError, match="read-only"):
        view[1] = 7
    with pytest.raises(InvalidIdError, match="read-only"):
        torch.from_dlpack(table)
    assert alloc.v2p("full")[1:4].tolist() == [1, 2, 3]
    alloc.check_invariants()
