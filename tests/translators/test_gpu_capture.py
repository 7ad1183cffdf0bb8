"""Graph-capturable translation (:mod:`umalloc.translators.capture`).

The CPU half pins Note [Capturable arithmetic] (the torch formulation) against a brute-force loop and the
reference translator, bad-id routing and flag bits included; it runs everywhere. The CUDA half (skipped without
a GPU / cupy) checks the one-kernel cupy path bit for bit against that formulation, under CUDA-graph capture and
replay after the tables changed, and against the allocator's live device mirror.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.errors import InvalidIdError, TombstoneError, UmallocValueError
from umalloc.geometry.arena import Arena
from umalloc.testing import seed_from_env, small_allocator, tiny_spec
from umalloc.translators import capture as cap
from umalloc.translators import reference as ref

SEED = seed_from_env(16)
HAS_CUDA = torch.cuda.is_available()
CUPY_REASON = cap.cupy_unavailable_reason()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
needs_cupy = pytest.mark.skipif(CUPY_REASON is not None, reason=f"cupy kernel: {CUPY_REASON}")


def brute(ids: list[int], v2p: list[int], ps: int, strict: bool, id_max: int, sink: int = 0) -> tuple[list[int], int]:
    """Plain-Python oracle of the capturable contract: results and flag bits."""
    limit = len(v2p) * ps
    pmax = (id_max - (ps - 1)) // ps
    res, bits = [], 0
    for t in ids:
        if not 0 <= t < limit:
            res.append(sink * ps)
            bits |= cap.BAD_RANGE
            continue
        page, off = divmod(t, ps)
        p = v2p[page]
        if p > pmax:
            bits |= cap.BAD_OVERFLOW
            p = sink
        elif p < 0:
            if strict:
                bits |= cap.BAD_TOMBSTONE
            p = sink
        res.append(p * ps + off)
    return res, bits


def random_case(rng: np.random.Generator, ps: int, bad: bool) -> tuple[list[int], list[int]]:
    nv = int(rng.integers(1, 40))
    v2p = rng.integers(0, 500, nv)
    v2p[rng.random(nv) < 0.25] = -1
    n = int(rng.integers(0, 200))
    ids = rng.integers(0, nv * ps, n)
    if bad and n:
        k = rng.random(n) < 0.1
        ids[k] = rng.choice([-1, -7, nv * ps, nv * ps + 3, 1 << 40], int(k.sum()))
    return ids.tolist(), v2p.tolist()


# ==== CPU: the formulation the kernel follows ===================================================================


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("ps", [1, 2, 16])
@pytest.mark.parametrize("strict", [False, True])
def test_torch_arithmetic_matches_the_oracle_with_bad_ids(dtype, ps, strict):
    rng = np.random.default_rng(SEED + ps)
    id_max = (1 << 63) - 1 if dtype == torch.int64 else (1 << 31) - 1
    for _ in range(60):
        ids, v2p = random_case(rng, ps, bad=True)
        if dtype == torch.int32:
            ids = [t if -(1 << 31) <= t < (1 << 31) else -3 for t in ids]
        flag = cap.ErrorFlag("cpu")
        sink = int(rng.choice([0, 0, 3, 1000]))
        out = torch.full((len(ids),), 12345, dtype=dtype)  # poisoned: every lane must be written
        cap.virtual_to_physical(torch.tensor(ids, dtype=dtype), torch.tensor(v2p), ps, out=out, flag=flag,
                                strict=strict, impl="torch", sink_page=sink)
        want, bits = brute(ids, v2p, ps, strict, id_max, sink)
        assert out.tolist() == want
        assert flag.value() == bits


@pytest.mark.parametrize("ps", [1, 4])
def test_good_ids_equal_the_reference_translator(ps):
    rng = np.random.default_rng(SEED)
    for _ in range(40):
        ids, v2p = random_case(rng, ps, bad=False)
        tab = torch.tensor(v2p)
        vt = torch.tensor(ids, dtype=torch.int64)
        flag = cap.ErrorFlag("cpu")
        out = torch.empty_like(vt)
        cap.virtual_to_physical(vt, tab, ps, out=out, flag=flag, strict=False, impl="torch")
        assert torch.equal(out, ref.virtual_to_physical(vt, tab, ps, strict=False))
        assert flag.value() == 0
        # strict: the flag is set exactly when the strict reference raises
        out2 = torch.empty_like(vt)
        cap.virtual_to_physical(vt, tab, ps, out=out2, flag=flag, strict=True, impl="torch")
        try:
            ref.virtual_to_physical(vt, tab, ps, strict=True)
            raised = False
        except TombstoneError:
            raised = True
        assert flag.value() == (cap.BAD_TOMBSTONE if raised else 0)
        assert torch.equal(out2, out)  # routing is the sink in both modes


def test_entry_overflow_for_int32_ids_routes_to_the_sink_and_flags():
    flag = cap.ErrorFlag("cpu")
    tab = torch.tensor([0, 1 << 29, 3])
    out = torch.empty(3, dtype=torch.int32)
    cap.virtual_to_physical(torch.tensor([5, 9, 2], dtype=torch.int32), tab, 4, out=out, flag=flag,
                            impl="torch")
    assert out.tolist() == [1, 13, 2]  # 2**29 * 4 overflows int32: page 0, offset kept
    assert flag.value() == cap.BAD_OVERFLOW
    with pytest.raises(InvalidIdError, match="overflow"):
        flag.check()
    assert flag.value() == 0  # check() reset it


def test_flag_accumulates_until_checked_and_names_each_kind():
    flag = cap.ErrorFlag("cpu")
    tab = torch.tensor([0, -1, 2])
    out = torch.empty(1, dtype=torch.int64)
    cap.virtual_to_physical_pages(torch.tensor([1]), tab, out=out, flag=flag, strict=True, impl="torch")
    assert out.tolist() == [0]
    with pytest.raises(TombstoneError, match="tombstoned"):
        flag.check(reset=False)
    cap.virtual_to_physical_pages(torch.tensor([3]), tab, out=out, flag=flag, impl="torch")
    assert flag.value() == cap.BAD_TOMBSTONE | cap.BAD_RANGE
    with pytest.raises(InvalidIdError, match="out of range.*tombstoned"):
        flag.check()
    flag.check()  # clean now: nothing raised
    cap.virtual_to_physical_pages(torch.tensor([1]), tab, out=out, flag=flag, strict=False, impl="torch")
    assert flag.value() == 0 and out.tolist() == [0]


def test_kernel_source_is_the_template_for_both_dtypes_with_every_constant_substituted():
    src = cap._source()
    assert "umalloc_v2p_graph_i64(" in src and "umalloc_v2p_graph_i32(" in src
    assert "const long long* ids" in src and "const int* ids" in src
    for leftover in ("ID_T", "NAME", "BAD_RANGE_V", "BAD_TOMBSTONE_V", "BAD_OVERFLOW_V"):
        assert leftover not in src
    assert f"inb ? 0 : {cap.BAD_RANGE}" in src and "? sink : p" in src


def test_empty_table_and_empty_ids():
    flag = cap.ErrorFlag("cpu")
    out = torch.full((2,), 9, dtype=torch.int64)
    cap.virtual_to_physical(torch.tensor([0, 5]), torch.empty(0, dtype=torch.int64), 2, out=out, flag=flag,
                            impl="torch")
    assert out.tolist() == [0, 0] and flag.value() == cap.BAD_RANGE
    empty = torch.empty(0, dtype=torch.int64)
    flag.reset()
    assert cap.virtual_to_physical(empty, torch.tensor([0, 1]), 2, out=torch.empty(0, dtype=torch.int64),
                                   flag=flag, impl="torch").numel() == 0
    assert flag.value() == 0


def test_argument_errors_are_typed_and_enqueue_nothing():
    flag = cap.ErrorFlag("cpu")
    ids, tab = torch.tensor([1]), torch.tensor([0, 1])
    out = torch.full((1,), 7, dtype=torch.int64)
    cases = [
        (UmallocValueError, dict(out=None, flag=flag)),
        (UmallocValueError, dict(out=out, flag=torch.zeros(1, dtype=torch.int32))),
        (UmallocValueError, dict(out=out, flag=flag, impl="triton")),
        (UmallocValueError, dict(out=out, flag=flag, strict=1)),
        (InvalidIdError, dict(out=torch.empty(1, dtype=torch.int32), flag=flag)),
        (InvalidIdError, dict(out=torch.empty(2, dtype=torch.int64), flag=flag)),
        (UmallocValueError, dict(out=out, flag=flag, sink_page=-1)),
        (UmallocValueError, dict(out=out, flag=flag, sink_page=True)),
        (UmallocValueError, dict(out=out, flag=flag, sink_page=1 << 63)),
    ]
    if CUPY_REASON is not None or not HAS_CUDA:
        cases.append((UmallocValueError, dict(out=out, flag=flag, impl="cupy")))
    for err, kw in cases:
        with pytest.raises(err):
            cap.virtual_to_physical(ids, tab, 1, **kw)
        assert out.tolist() == [7] and flag.value() == 0, kw
    with pytest.raises(InvalidIdError):
        cap.virtual_to_physical(ids.to(torch.float32), tab, 1, out=out, flag=flag)


def test_reads_the_allocators_live_mirror_through_one_fixed_view():
    """The view taken once (as a graph would hold it) follows every later allocator call (CPU mirror)."""
    alloc = small_allocator(mirror_device="cpu")
    view = alloc.v2p("full")
    ptr = view.data_ptr()
    flag = cap.ErrorFlag("cpu")
    out = torch.empty(4, dtype=torch.int64)
    vp = alloc.alloc_pages(4)
    cap.virtual_to_physical_pages(vp, view, out=out, flag=flag, impl="torch")
    assert torch.equal(out, alloc.translate_pages(vp, "full")) and flag.value() == 0
    alloc.free_pages(vp[:2])  # freed virtual pages are tombstones now: routed to the sink, flagged (strict)
    cap.virtual_to_physical_pages(vp, view, out=out, flag=flag, impl="torch")
    assert out.tolist()[:2] == [0, 0] and out.tolist()[2:] == alloc.translate_pages(vp[2:], "full").tolist()
    assert flag.value() == cap.BAD_TOMBSTONE
    flag.reset()
    vp2 = alloc.alloc_pages(2)
    ids = torch.cat([vp[2:], vp2])
    cap.virtual_to_physical_pages(ids, view, out=out, flag=flag, impl="torch")
    assert view.data_ptr() == ptr
    assert torch.equal(out, alloc.translate_pages(ids, "full")) and flag.value() == 0


# ==== CUDA: the one-kernel path ==================================================================================


@needs_cupy
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("ps", [1, 16])
def test_cupy_kernel_equals_the_torch_formulation_bit_for_bit(dtype, ps):
    rng = np.random.default_rng(SEED + 7)
    for strict in (False, True):
        for _ in range(20):
            ids, v2p = random_case(rng, ps, bad=True)
            if dtype == torch.int32:
                ids = [t if -(1 << 31) <= t < (1 << 31) else -3 for t in ids]
            vt = torch.tensor(ids, dtype=dtype, device="cuda")
            tab = torch.tensor(v2p, device="cuda")
            sink = int(rng.choice([0, 5]))
            outs, bits = [], []
            for impl in ("cupy", "torch"):
                flag = cap.ErrorFlag("cuda")
                out = torch.full_like(vt, 777)
                cap.virtual_to_physical(vt, tab, ps, out=out, flag=flag, strict=strict, impl=impl, sink_page=sink)
                outs.append(out.cpu())
                bits.append(flag.value())
            assert torch.equal(outs[0], outs[1]) and bits[0] == bits[1]
            id_max = (1 << 63) - 1 if dtype == torch.int64 else (1 << 31) - 1
            want, wbits = brute(ids, v2p, ps, strict, id_max, sink)
            assert outs[0].tolist() == want and bits[0] == wbits


@needs_cupy
def test_large_input_grid_stride_covers_every_lane():
    n = (65535 * 4 * 256) + 12345  # more lanes than one grid: the stride loop must reach them all
    tab = torch.arange(1, 1 << 16, device="cuda", dtype=torch.int64)
    vt = torch.randint(0, tab.numel() * 4, (n,), device="cuda", generator=torch.Generator("cuda").manual_seed(SEED))
    out = torch.full_like(vt, -5)
    flag = cap.ErrorFlag("cuda")
    cap.virtual_to_physical(vt, tab, 4, out=out, flag=flag, impl="cupy")
    want = tab[vt // 4] * 4 + vt % 4
    assert torch.equal(out, want) and flag.value() == 0


@needs_cupy
@pytest.mark.parametrize("impl", ["cupy", "torch"])
def test_graph_replay_sees_table_changes_and_sets_the_flag(impl):
    ps = 16
    tab = torch.tensor([0, 5, 6, -1, 9], device="cuda")
    vt = torch.tensor([16, 17, 40, 3], device="cuda")
    out = torch.empty_like(vt)
    flag = cap.ErrorFlag("cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (kernel compile) outside the capture
        cap.virtual_to_physical(vt, tab, ps, out=out, flag=flag, strict=True, impl=impl)
    torch.cuda.current_stream().wait_stream(s)
    flag.reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cap.virtual_to_physical(vt, tab, ps, out=out, flag=flag, strict=True, impl=impl)
    ptr = out.data_ptr()
    g.replay()
    assert out.tolist() == [80, 81, 6 * 16 + 8, 3] and flag.value() == 0
    tab.copy_(torch.tensor([0, 7, -1, 2, 9], device="cuda"))  # the tables change in place between replays
    vt.copy_(torch.tensor([16, 40, 55, 10**6], device="cuda"))
    g.replay()
    assert out.data_ptr() == ptr
    assert out.tolist() == [112, 8, 2 * 16 + 7, 0]
    assert flag.value() == cap.BAD_TOMBSTONE | cap.BAD_RANGE
    with pytest.raises(InvalidIdError):
        flag.check()
    g.replay()  # the flag reset is seen by the next replay
    assert flag.value() == cap.BAD_TOMBSTONE | cap.BAD_RANGE


@needs_cupy
def test_cupy_launch_does_not_synchronise_or_allocate():
    tab = torch.arange(1000, device="cuda")
    vt = torch.arange(4000, device="cuda") % 1000
    out = torch.empty_like(vt)
    flag = cap.ErrorFlag("cuda")
    cap.virtual_to_physical_pages(vt, tab, out=out, flag=flag, impl="cupy")  # compile
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            cap.virtual_to_physical_pages(vt, tab, out=out, flag=flag, impl="cupy")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    assert torch.equal(out, vt) and flag.value() == 0


@needs_cupy
def test_graph_over_the_allocators_device_mirror_follows_allocator_calls_without_sync():
    """Stream ordering, not sleeps: the mirror scatter of each allocator call is enqueued on the current stream
    before the replay, so the replay reads the whole new table (no synchronize between call and replay)."""
    alloc = MultiEndedAllocator(Arena(tiny_spec(), device="cuda"))
    ps = alloc.spec.end("full").page_size
    view_full, view_swa = alloc.v2p("full"), alloc.v2p("swa")
    n = 8
    vt = torch.zeros(n, dtype=torch.int64, device="cuda")
    out_full, out_swa = torch.empty_like(vt), torch.empty_like(vt)
    flag = cap.ErrorFlag("cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cap.virtual_to_physical(vt, view_full, ps, out=out_full, flag=flag, strict=False)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cap.virtual_to_physical(vt, view_full, ps, out=out_full, flag=flag, strict=False)
        cap.virtual_to_physical(vt, view_swa, ps, out=out_swa, flag=flag, strict=False)
    rng = np.random.default_rng(SEED)
    held: list[torch.Tensor] = []
    for step in range(60):
        if held and rng.random() < 0.4:
            alloc.free(held.pop(int(rng.integers(len(held)))))
        else:
            t = alloc.alloc_extend(torch.tensor([0]), torch.tensor([int(rng.integers(1, 6))]), torch.tensor([-1]))
            if t is not None:
                held.append(t)
        pool = torch.cat(held) if held else torch.zeros(1, dtype=torch.int64)
        pick = pool[torch.from_numpy(rng.integers(0, pool.numel(), n))]
        vt.copy_(pick.to("cuda"))  # on the current stream, after the allocator's scatter
        g.replay()
        want_full = alloc.translate(pick, "full", strict=False)
        want_swa = alloc.translate(pick, "swa", strict=False)
        assert out_full.cpu().tolist() == want_full.tolist(), step
        assert out_swa.cpu().tolist() == want_swa.tolist(), step
    assert flag.value() == 0
