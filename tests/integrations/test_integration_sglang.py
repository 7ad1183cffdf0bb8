"""umalloc.integrations.sglang against SGLang 0.5.23's own allocator classes (skips without SGLang; runs in the peer
venv of scripts/peer_suite_sglang.sh). The differential runs print ``N sequences identical, 0 differ`` per class
and page size (see tests/integrations/sglang_differential.py for the equivalence checked after every op)."""

from __future__ import annotations

import collections
import os
import sys

import pytest

pytest.importorskip("sglang")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peer"))

import sglang_cpu_shims  # noqa: E402

sglang_cpu_shims.prepare()  # before any SGLang allocator module is imported

import torch  # noqa: E402
from sglang_differential import (  # noqa: E402
    CLASS_PAGE_SIZES,
    Differ,
    PagedScenario,
    Side,
    describe,
    run_class,
)

import umalloc.integrations.sglang as um_sglang  # noqa: E402
from umalloc.errors import DoubleFreeError, InvalidIdError, NotAllocatedError  # noqa: E402

SEQUENCES = int(os.environ.get("UMALLOC_SGLANG_SEQUENCES", "30"))
OPS = int(os.environ.get("UMALLOC_SGLANG_OPS", "50"))
SEED = int(os.environ.get("UMALLOC_SEED", "25"))

CASES = [(kind, ps) for kind, sizes in CLASS_PAGE_SIZES.items() for ps in sizes]


@pytest.mark.parametrize(("kind", "page_size"), CASES, ids=[f"{k}-ps{p}" for k, p in CASES])
def test_differential(kind: str, page_size: int) -> None:
    print(f"\nseed={SEED} (override with UMALLOC_SEED)")
    stats: collections.Counter[str] = collections.Counter()
    same, diffs = run_class(kind, page_size, SEQUENCES, OPS, SEED, stats)
    print(f"{kind} page_size={page_size}: {same} sequences identical, {len(diffs)} differ ({describe(stats)})")
    assert not diffs, diffs[:3]
    assert same == SEQUENCES
    assert stats["refused"] > 0 and stats["allocs"] > stats["refused"]  # both outcomes exercised
    assert stats["free groups"] > 0
    if kind == "swa":
        assert stats["swa pages evicted"] > 0


class _OnePageMore(PagedScenario):
    """umalloc's pool one page larger than SGLang's: the comparison must notice."""

    def build(self) -> tuple[Side, Side]:
        sides = super().build()
        size = (self.num_pages + 1) * self.page_size
        sides[1].alloc = um_sglang.UmallocPagedTokenToKVPoolAllocator(size, self.page_size, torch.bfloat16, "cpu",
                                                                       None, self.need_sort)
        return sides


def test_differential_notices_a_capacity_difference() -> None:
    with pytest.raises(Differ, match="available_size"):
        _OnePageMore(7, 16, 20).run()


def test_install_rebinds_the_configurator_names() -> None:
    import sglang.srt.mem_cache.kv_cache_configurator as conf

    stock = {name: getattr(conf, name) for name in um_sglang.PATCHED_NAMES}
    try:
        bound = um_sglang.install()
        build = conf.KVCacheConfigurator._build_token_to_kv_pool_allocator
        for name, cls in bound.items():
            assert getattr(conf, name) is cls
            assert cls.__name__ == um_sglang.PATCHED_NAMES[name]
            assert name in build.__code__.co_names  # the constructor path names it ...
            assert build.__globals__[name] is cls  # ... and resolves it to the umalloc class
        assert set(bound) == set(um_sglang.PATCHED_NAMES)
        assert um_sglang.install() == bound  # idempotent
    finally:
        for name, cls in stock.items():
            setattr(conf, name, cls)


def test_untested_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(um_sglang, "sglang_version", lambda: "0.5.22")
    with pytest.raises(um_sglang.UnsupportedSGLangVersion, match="SGLang 0.5.22") as info:
        um_sglang.install()
    assert info.value.version == "0.5.22"


def test_installed_version_is_the_tested_one() -> None:
    import sglang

    assert um_sglang.check_version() == sglang.__version__ == "0.5.23"


# ---- behavioural differences (each listed in the README's SGLang section) ---------------------------------------
def _pair(page_size: int, num_pages: int = 4) -> tuple[object, object]:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    args = (num_pages * page_size, page_size, torch.bfloat16, "cpu", None, False)
    return PagedTokenToKVPoolAllocator(*args), um_sglang.UmallocPagedTokenToKVPoolAllocator(*args)


def test_double_free_sglang_accepts_umalloc_refuses() -> None:
    sg, um = _pair(4)
    a, b = sg.alloc(4), um.alloc(4)
    sg.free(a)
    sg.free(a)  # SGLang: the page is on its free list twice
    assert sg.available_size() == 5 * 4 > sg.size
    um.free(b)
    with pytest.raises(DoubleFreeError):
        um.free(b)
    assert um.available_size() == 4 * 4  # nothing changed
    um.check_invariants()


def test_free_of_slot_zero_or_unallocated_is_refused() -> None:
    _, um = _pair(4)
    with pytest.raises(InvalidIdError):
        um.free(torch.tensor([0]))
    with pytest.raises(NotAllocatedError):
        um.free(torch.tensor([4]))
    assert um.available_size() == 16


def test_double_free_inside_a_group_is_refused_at_group_end() -> None:
    _, um = _pair(4)
    t = um.alloc(8)
    um.free(t[:4])
    um.free_group_begin()
    um.free(t)
    with pytest.raises(DoubleFreeError):
        um.free_group_end()
    assert um.available_size() == 12  # the group's frees dropped together: page 2 still live
    um.free(t[4:])
    assert um.available_size() == 16


def test_extend_with_a_stale_last_loc_is_refused() -> None:
    sg, um = _pair(4)
    t = um.alloc_extend(*(torch.tensor([0]),) * 2, *(torch.tensor([2]),) * 2, torch.tensor([-1]), 2)
    um.free(t)
    with pytest.raises(InvalidIdError, match="already free"):
        um.alloc_extend(*(torch.tensor([2]),) * 2, *(torch.tensor([3]),) * 2, t[-1:], 1)
    assert um.available_size() == 16
    del sg


def test_cpu_copy_round_trip_through_a_real_sglang_kv_pool() -> None:
    """get_cpu_copy/load_cpu_copy go to SGLang's MHATokenToKVPool at the slots umalloc handed out."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.test.unified_allocator_fixtures import setup_allocator_context

    setup_allocator_context()
    kv = MHATokenToKVPool(64, 4, torch.float16, 1, 8, 2, "cpu", False)
    alloc = um_sglang.UmallocPagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu", kv, False)
    slots = alloc.alloc(8)
    want = [torch.arange(8, dtype=torch.float16)[:, None, None].expand(8, 1, 8) + layer for layer in range(2)]
    for layer in range(2):
        kv.k_buffer[layer][slots] = want[layer]
        kv.v_buffer[layer][slots] = -want[layer]
    host = alloc.get_cpu_copy(slots)
    alloc.free(slots)
    for layer in range(2):
        kv.k_buffer[layer].zero_()
        kv.v_buffer[layer].zero_()
    again = alloc.alloc_extend(*(torch.tensor([0]),) * 2, *(torch.tensor([8]),) * 2, torch.tensor([-1]), 8)
    assert again.tolist() == list(range(4, 12))  # lowest free pages 1, 2
    alloc.load_cpu_copy(host, again)
    for layer in range(2):
        assert torch.equal(kv.k_buffer[layer][again], want[layer])
        assert torch.equal(kv.v_buffer[layer][again], -want[layer])


@pytest.mark.parametrize(("page_size", "hybrid_swa", "want"), [
    (1, False, "UmallocTokenToKVPoolAllocator"),
    (16, False, "UmallocPagedTokenToKVPoolAllocator"),
    (16, True, "UmallocSWATokenToKVPoolAllocator"),
])
def test_sglang_constructor_path_builds_the_umalloc_class(page_size: int, hybrid_swa: bool, want: str) -> None:
    """KVCacheConfigurator._build_token_to_kv_pool_allocator, SGLang's own code, after install()."""
    import sglang.srt.mem_cache.kv_cache_configurator as conf
    from sglang.srt.runtime_context import publish, reset_context
    from sglang.srt.server_args import ServerArgs
    from sglang_differential import fake_swa_kv

    stock = {name: getattr(conf, name) for name in um_sglang.PATCHED_NAMES}
    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu", page_size=page_size), role="tokenizer")
    try:
        um_sglang.install()
        c = object.__new__(conf.KVCacheConfigurator)  # only the attributes the allocator branch reads
        for name, value in dict(is_hybrid_swa=hybrid_swa, kv_cache_dtype=torch.float16, device="cpu",
                                kv_shard_size=1, page_size=page_size, hybrid_gdn_config=None,
                                is_draft_worker=False).items():
            setattr(c, name, value)
        sizes = conf._PoolSizes(max_total_num_tokens=1024, max_running_requests=4,
                                full_max_total_num_tokens=1024 if hybrid_swa else None,
                                swa_max_total_num_tokens=512 if hybrid_swa else None, c4_max_total_num_tokens=0,
                                c128_max_total_num_tokens=0, c4_state_pool_size=0, c128_state_pool_size=0,
                                c4_state_dtype=None, c128_state_dtype=None)
        alloc = c._build_token_to_kv_pool_allocator(sizes=sizes, token_to_kv_pool=fake_swa_kv(),
                                                    is_dsv4_model=False, req_to_token_pool=None,
                                                    token_to_kv_pool_allocator=None)
        assert type(alloc).__name__ == want
        assert alloc.page_size == page_size
        assert alloc.available_size() == (512 if hybrid_swa else 1024)
    finally:
        for name, cls in stock.items():
            setattr(conf, name, cls)
        reset_context()
