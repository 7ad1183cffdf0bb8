"""The CUDA arena, the device mirror refresh, compaction's device copies and NIXL VRAM (all skip without CUDA).

* The arena is one plain device allocation (``cudaMalloc`` through torch, never managed memory), per-layer views
  lie inside it.
* :func:`umalloc.pool.mirror.refresh` enqueues without a host synchronisation.
* Compaction on a CUDA arena moves exactly the bytes a CPU arena moves under the same calls (eager and lazy),
  and eager and lazy give the same live set and bytes on the device.
* NIXL registers the CUDA arena as VRAM; a transfer between two arenas on the one GPU and VRAM->DRAM, bytes
  verified (two agents in one process; UCX picks cuda_ipc / cuda_copy).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.backends import backend_available, get_backend
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, LayerSpec
from umalloc.pool.mirror import refresh
from umalloc.testing import seed_from_env, tiny_spec

SEED = seed_from_env(1616)
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PS = 2


def spec(arena_bytes: int = 32 * 20) -> ArenaSpec:
    full = EndSpec("full", (LayerSpec.mha(1, 4), LayerSpec.mha(1, 4)), page_size=PS)
    swa = EndSpec("swa", (LayerSpec.mha(1, 2, window_tokens=4),), page_size=PS, grow=Grow.DOWN, owner="full",
                  role=EndRole.SWA)
    return ArenaSpec((full, swa), arena_bytes=arena_bytes)


def test_cuda_arena_is_one_plain_device_allocation_with_views_inside():
    arena = Arena(spec(), device="cuda")
    assert arena.data.is_cuda and arena.data.dtype == torch.uint8 and arena.data.numel() == arena.arena_bytes
    lo, hi = arena.base_ptr, arena.base_ptr + arena.arena_bytes
    for layer in range(2):
        k, v = arena.kv_views("full", layer)
        for t in (k, v):
            assert t.is_cuda and lo <= t.data_ptr() < hi
            last = t.data_ptr() + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) \
                * t.element_size() + t.element_size()
            assert last <= hi
    try:
        import cupy
    except ImportError:
        pytest.skip("cupy absent: memory type not checked")
    attrs = cupy.cuda.runtime.pointerGetAttributes(arena.base_ptr)
    assert attrs.type == cupy.cuda.runtime.memoryTypeDevice  # not managed (3), not host


def test_mirror_refresh_enqueues_without_host_synchronisation():
    host = np.arange(3 * 50, dtype=np.int64).reshape(3, 50)
    mirror = torch.zeros((3, 50), dtype=torch.int64, device="cuda")
    vids = np.array([4, 9, 49, 0], np.int64)
    refresh(mirror, host, vids[:1])  # first pinned block allocated outside the check
    torch.cuda.synchronize()
    ptr = mirror.data_ptr()
    torch.cuda.set_sync_debug_mode("error")
    try:
        refresh(mirror, host, vids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = mirror.cpu().numpy()
    assert mirror.data_ptr() == ptr
    want = np.zeros((3, 50), np.int64)
    want[:, vids] = host[:, vids]
    assert np.array_equal(got, want)


def test_mirror_refresh_is_ordered_on_a_side_stream():
    alloc = MultiEndedAllocator(Arena(tiny_spec(), device="cuda"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        vp = alloc.alloc_pages(3)
        snap = alloc.v2p("full").clone()  # enqueued on s after the scatter: sees the new entries
    s.synchronize()
    assert snap.cpu()[vp].tolist() == alloc.translate_pages(vp, "full").tolist()


def _write(alloc: MultiEndedAllocator, vpages: np.ndarray, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """Fresh bytes into every end's page of ``vpages`` that is bound (same bytes returned for a twin)."""
    datas = {}
    for end in alloc.spec.end_names:
        v2p = alloc.v2p(end).cpu().numpy()
        bound = vpages[v2p[vpages] >= 0]
        if not bound.size:
            continue
        env = alloc.arena.envelopes(end)
        datas[end] = (torch.from_numpy(bound), torch.from_numpy(rng.integers(0, 256, (bound.size, env.shape[1]),
                                                                            dtype=np.uint8)))
    return datas


def _apply(alloc: MultiEndedAllocator, datas) -> None:
    for end, (bound, data) in datas.items():
        env = alloc.arena.envelopes(end)
        phys = alloc.translate_pages(bound, end)
        env[phys.to(env.device)] = data.to(env.device)


def _read(alloc: MultiEndedAllocator) -> dict[tuple[str, int], bytes]:
    out = {}
    for end in alloc.spec.end_names:
        v2p = alloc.v2p(end).cpu().numpy()
        env = alloc.arena.envelopes(end).cpu()
        for v in np.flatnonzero(v2p >= 0).tolist():
            if v:
                out[(end, v)] = bytes(env[int(v2p[v])].numpy())
    return out


def test_compaction_on_the_device_moves_what_the_host_arena_moves_eager_equals_lazy():
    rng = np.random.default_rng(SEED)
    allocs = {(dev, mode): MultiEndedAllocator(Arena(spec(), device=dev), compaction=mode, debug_checks=True)
              for dev in ("cpu", "cuda") for mode in ("eager", "lazy")}
    held: list[int] = []  # request sizes (in tokens) by position; requests are freed by position
    reqs = {k: [] for k in allocs}
    for step in range(300):
        if held and rng.random() < 0.45:
            j = int(rng.integers(len(held)))
            held.pop(j)
            for k, a in allocs.items():
                a.free(reqs[k].pop(j))
        else:
            n = int(rng.integers(1, 7))
            outs = {k: a.alloc_extend(torch.tensor([0]), torch.tensor([n]), torch.tensor([-1]))
                    for k, a in allocs.items()}
            assert len({o is None for o in outs.values()}) == 1, f"step {step}: modes disagree on space"
            if outs[("cpu", "eager")] is None:
                continue
            held.append(n)
            first = next(iter(outs.values()))
            vps = np.unique(first.numpy() // PS)
            datas = _write(allocs[("cpu", "eager")], vps, rng)
            for k, a in allocs.items():
                assert torch.equal(outs[k], first), f"step {step}: virtual ids differ"
                reqs[k].append(outs[k])
                _apply(a, datas)
        for mode in ("eager", "lazy"):
            host, dev = allocs[("cpu", mode)], allocs[("cuda", mode)]
            for end in host.spec.end_names:
                assert torch.equal(host.v2p(end), dev.v2p(end).cpu()), f"step {step} {mode} {end}: tables differ"
            assert torch.equal(host.arena.data, dev.arena.data.cpu()), f"step {step} {mode}: arena bytes differ"
        assert _read(allocs[("cuda", "eager")]) == _read(allocs[("cuda", "lazy")]), f"step {step}: eager != lazy"
    moved = sum(s.pages_moved for s in allocs[("cuda", "eager")].stats().values())
    assert moved > 0, "eager compaction never moved a page: the trace lost its point"


# ==== NIXL VRAM =================================================================================================


def _nixl_or_skip() -> None:
    ok, why = backend_available("nixl")
    if not ok:
        pytest.skip(f"nixl: {why}")


def _gen(n: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


@pytest.mark.parametrize("dst_device", ["cuda", "cpu"], ids=["vram-to-vram", "vram-to-dram"])
def test_nixl_writes_between_a_cuda_arena_and_another_arena(dst_device):
    _nixl_or_skip()
    n = 8 << 20
    src_arena = Arena(ArenaSpec(spec().ends, arena_bytes=n), device="cuda")
    dst_arena = Arena(ArenaSpec(spec().ends, arena_bytes=n), device=dst_device)
    src_arena.data.copy_(_gen(n, SEED, "cuda"))
    dst_arena.data.copy_(_gen(n, SEED + 1, dst_device))
    src_reg, dst_reg = src_arena.region(), dst_arena.region()
    assert src_reg.mem_kind == "VRAM" and src_reg.device.startswith("cuda")
    assert dst_reg.mem_kind == ("VRAM" if dst_device == "cuda" else "DRAM")
    a, b = get_backend("nixl"), get_backend("nixl")
    try:
        a.register([src_reg])
        b.register([dst_reg])
        peer = a.connect(b.metadata())
        rng = np.random.default_rng(SEED)
        k = 64
        sizes = rng.integers(1, 64 << 10, k)
        src_off = rng.integers(0, n - (64 << 10), k)
        dst_off = np.sort(rng.choice(np.arange(0, n - (64 << 10), 64 << 10), k, replace=False))
        d = np.stack([src_reg.base_ptr + src_off, dst_reg.base_ptr + dst_off, sizes], 1).astype(np.uint64)
        want = dst_arena.data.cpu().clone()
        src_host = src_arena.data.cpu()
        for (so, do, sz) in zip(src_off.tolist(), dst_off.tolist(), sizes.tolist(), strict=True):
            want[do:do + sz] = src_host[so:so + sz]
        torch.cuda.synchronize()  # the source bytes are on the device before the engine reads them
        h = a.write_descriptors(d, peer)
        a.wait(h, 30.0)
        assert h.state == "done"
        a.forget(h)
        assert torch.equal(dst_arena.data.cpu(), want)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("here_device", ["cuda", "cpu"], ids=["vram-to-vram", "vram-to-dram"])
def test_nixl_second_process_writes_its_vram_into_this_process(here_device):
    """Two processes on the one GPU: the child's VRAM buffer is WRITten into this process's CUDA arena (UCX
    cuda_ipc or whatever the installed NIXL offers) or into a DRAM arena (retraction's VRAM->DRAM); the expected
    bytes are an independent re-creation of the child's seeded buffer."""
    _nixl_or_skip()
    from umalloc.backends.worker import BackendWorker, pattern_fill

    n = 4 << 20
    w = BackendWorker("nixl")
    b = get_backend("nixl")
    try:
        w.wait_ready(60.0)
        w_base = w.run("gpu_worker:vram_buffer", n, SEED + 5)
        arena = Arena(ArenaSpec(spec().ends, arena_bytes=n), device=here_device)
        arena.data.copy_(_gen(n, SEED + 6, here_device))
        reg = arena.region()
        b.register([reg])
        peer = w.call("connect", b.metadata(), progress=b.progress)
        half = n // 2
        d = np.array([[w_base, reg.base_ptr + half, half], [w_base + half, reg.base_ptr, half // 2]], np.uint64)
        w.call("write", d, peer, 30.0, timeout_s=35.0, progress=b.progress)
        src = torch.empty(n, dtype=torch.uint8)
        pattern_fill(src, SEED + 5)
        want = _gen(n, SEED + 6, "cpu")
        want[half:] = src[:half]
        want[:half // 2] = src[half:half + half // 2]
        assert torch.equal(arena.data.cpu(), want)
        assert w.run("gpu_worker:vram_digest") == bytes(src.numpy().tobytes())  # the source is untouched
        w.call("reset_backend")
        w.run("gpu_worker:drop_vram")
    finally:
        b.close()
        w.close()
