"""umalloc.integrations.sglang against SGLang 0.5.23's own allocator classes (skips without SGLang; runs in the peer
venv of scripts/peer_suite_sglang.sh). The differential runs print ``N sequences identical, 0 differ`` per class
and page size (see tests/integrations/sglang_differential.py for the equivalence checked after every op)."""

from __future__ import annotations

import collections
import os
import sys
from typing import Any

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
from umalloc.errors import DoubleFreeError, InvalidIdError, NotAllocatedError, UmallocValueError  # noqa: E402

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
    if kind in ("swa", "unified"):
        assert stats["swa pages evicted"] > 0
    if kind == "unified":  # both compaction modes, flushes that move pages, the gate closed under refusals
        assert 0 < stats["lazy"] < SEQUENCES
        assert stats["flushes"] > 0 and stats["pages moved (umalloc)"] > 0
        assert stats["refused, gate closed"] > 0
        # the scheduler's pricing: plans that fit now, need eviction, or cannot fit; capped decode lengths
        assert stats["plans evicting"] > 0 and stats["plans refused"] > 0 and stats["max_new_tokens capped"] > 0


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


def _stock_names() -> list[tuple[object, str, object]]:
    import sglang.srt.mem_cache.allocator.unified_hybrid_swa as uhs
    import sglang.srt.mem_cache.kv_cache_configurator as conf

    return [(conf, n, getattr(conf, n)) for n in um_sglang.PATCHED_NAMES] + \
        [(uhs, n, getattr(uhs, n)) for n in um_sglang.PATCHED_UNIFIED_NAMES]


def _restore(stock: list[tuple[object, str, object]]) -> None:
    for module, name, cls in stock:
        setattr(module, name, cls)


def test_install_rebinds_the_configurator_names() -> None:
    import sglang.srt.mem_cache.kv_cache_configurator as conf
    import sglang.srt.mem_cache.unified_memory_pool as ump

    stock = _stock_names()
    try:
        bound = um_sglang.install()
        build = conf.KVCacheConfigurator._build_token_to_kv_pool_allocator
        for name in um_sglang.PATCHED_NAMES:
            cls = bound[name]
            assert getattr(conf, name) is cls
            assert cls.__name__ == um_sglang.PATCHED_NAMES[name]
            assert name in build.__code__.co_names  # the constructor path names it ...
            assert build.__globals__[name] is cls  # ... and resolves it to the umalloc class
        # SGLang's unified factory imports its class from unified_hybrid_swa when it runs
        factory = ump.init_unified_swa_pools.__code__
        assert "UnifiedSWATokenToKVPoolAllocator" in factory.co_names + factory.co_varnames
        assert bound["UnifiedSWATokenToKVPoolAllocator"].__name__ == "UmallocUnifiedSWATokenToKVPoolAllocator"
        assert set(bound) == set(um_sglang.PATCHED_NAMES) | set(um_sglang.PATCHED_UNIFIED_NAMES)
        assert um_sglang.install() == bound  # idempotent
    finally:
        _restore(stock)


def test_uninstall_and_installed_give_sglang_its_names_back() -> None:
    import sglang.srt.mem_cache.allocator.unified_hybrid_swa as uni
    import sglang.srt.mem_cache.kv_cache_configurator as conf

    stock = _stock_names()
    try:
        um_sglang.uninstall()   # whatever an earlier test left installed
        before = {name: getattr(conf, name) for name in um_sglang.PATCHED_NAMES}
        unified = uni.UnifiedSWATokenToKVPoolAllocator
        with um_sglang.installed() as bound:
            assert all(getattr(conf, name) is bound[name] for name in um_sglang.PATCHED_NAMES)
            assert uni.UnifiedSWATokenToKVPoolAllocator is bound["UnifiedSWATokenToKVPoolAllocator"]
        assert {name: getattr(conf, name) for name in um_sglang.PATCHED_NAMES} == before
        assert uni.UnifiedSWATokenToKVPoolAllocator is unified
        um_sglang.uninstall()   # a second time: no-op
        assert {name: getattr(conf, name) for name in um_sglang.PATCHED_NAMES} == before
    finally:
        _restore(stock)


def test_untested_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(um_sglang, "sglang_version", lambda: "0.5.22")
    with pytest.raises(um_sglang.UnsupportedSGLangVersion, match="SGLang 0.5.22") as info:
        um_sglang.install()
    assert info.value.version == "0.5.22"
    from umalloc.integrations.versions import EngineVersionError
    assert isinstance(info.value, EngineVersionError) and info.value.supported == um_sglang.SUPPORTED_VERSIONS


def test_installed_version_is_the_tested_one() -> None:
    import sglang

    assert um_sglang.check_version() == sglang.__version__ == "0.5.23"


# ---- behavioural differences (each listed in docs/engines.md, "SGLang") ------------------------------------------
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

    stock = _stock_names()
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
        _restore(stock)
        reset_context()


# ---- the unified class: SGLang's shipped fixtures, the move gate ------------------------------------------------
@pytest.mark.parametrize(("page_size", "lazy"), [(1, False), (1, True), (16, False), (16, True)])
def test_sglang_fixture_cache_runs_on_umalloc(page_size: int, lazy: bool) -> None:
    """SGLang's ``build_swa_cache`` fixture (real ``UnifiedSWAKVPool`` CPU buffers, ``UnifiedRadixCache`` inserts of
    96 pages, then an eviction through the tree's components) on SGLang's class and, after install(), on
    umalloc's: the same sizes before and after."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.test import unified_allocator_fixtures as fx
    from sglang_unified_differential import prepare_unified_context

    prepare_unified_context()
    fx.setup_allocator_context()  # an earlier test may have reset SGLang's runtime context
    stock = _stock_names()
    seen = []
    try:
        for install in (False, True):
            if install:
                um_sglang.install()
            alloc, cache = fx.build_swa_cache(occupancy=96, lazy=lazy, page_size=page_size)
            row = [type(alloc).__name__, alloc.available_size(), alloc.full_available_size(),
                   alloc.swa_available_size(), cache.full_evictable_size(), cache.swa_evictable_size()]
            cache.evict(EvictParams(num_tokens=10 * page_size, swa_num_tokens=10 * page_size))
            row += [alloc.available_size(), alloc.full_available_size(), alloc.swa_available_size()]
            seen.append(row)
    finally:
        _restore(stock)
    assert seen[0][0] == "UnifiedSWATokenToKVPoolAllocator"
    assert seen[1][0] == "UmallocUnifiedSWATokenToKVPoolAllocator"
    assert seen[1][1:] == seen[0][1:]
    assert seen[0][7] > seen[0][1]  # the eviction freed pages


TREE_OPS = int(os.environ.get("UMALLOC_SGLANG_TREE_OPS", "40"))


def _tree_sequence(alloc: object, cache: object, seed: int, page_size: int, n_ops: int) -> list[object]:
    """One seeded sequence of the scheduler calls that take a radix cache, on one side; the record of every result
    and, after each op, the sizes of the allocator and the tree. Both sides draw the same ops from ``seed``."""
    import random
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    rng, ps, a, c = random.Random(seed), page_size, cast_any(alloc), cast_any(cache)
    cap, out, next_key = 110 * ps, [], 10_000_000

    def demand() -> int:
        return max(0, a.available_size() + rng.randint(-4, 40) * ps) if rng.random() < 0.7 else rng.randint(0, cap)

    for _ in range(n_ops):
        op = rng.choice(["evict", "evict", "prealloc_fits", "reclaim_for_prealloc", "budget", "budget", "insert",
                         "insert"])
        if op == "evict":
            n, m = demand(), (demand() if rng.random() < 0.7 else None)
            out.append((op, n, m, a.evict_to_free_tokens(c, n, swa_num_tokens=m)))
        elif op == "prealloc_fits":
            f, w, budget = demand(), demand(), rng.randint(0, cap)
            swa_budget = rng.choice([None, rng.randint(0, cap)])
            out.append((op, f, w, a.prealloc_fits(c, f, w, full_budget_tokens=budget, swa_budget_tokens=swa_budget)))
        elif op == "reclaim_for_prealloc":  # the message is each class's own prose: None-ness is compared
            f, w = demand(), demand()
            out.append((op, f, w, a.reclaim_for_prealloc(c, f, w) is None))
        elif op == "budget":
            b = a.create_prefill_budget(c, num_mixed_decode_tokens=rng.randint(0, 4) * ps)
            ext, new = rng.randint(1, 200) * ps, rng.randint(0, 30) * ps
            chunk = rng.choice([None, rng.randint(1, 40) * ps])
            out.append((op, type(b).__name__, b.has_capacity(), b.remaining_total, b.remaining_swa,
                        b.check_prefill(extend_input_len=ext, total_tokens=ext + new, max_new_tokens=new,
                                        input_tokens=ext, swa_host_hit_length=0, chunk_limit=chunk),
                        b.prepare_load_back(full_tokens=ext, extend_input_len=ext, max_new_tokens=new,
                                            swa_host_hit_length=0, chunk_limit=chunk)))
        else:  # new pages into the tree (evictable), as the fixture inserts
            k = rng.randint(1, 6)
            slots = a.alloc(k * ps)
            out.append((op, k, slots is None))
            for i in range(k if slots is not None else 0):
                key = RadixKey(array("q", range(next_key, next_key + ps)))
                c.insert(InsertParams(key=key, value=slots[i * ps:(i + 1) * ps]))
                next_key += 1000
        out.append(("sizes", a.available_size(), a.full_available_size(), a.swa_available_size(),
                    c.full_evictable_size(), c.swa_evictable_size()))
    return out


def cast_any(x: object) -> Any:
    return x


@pytest.mark.parametrize(("page_size", "lazy"), [(1, False), (1, True), (16, False), (16, True)])
def test_scheduler_calls_with_a_radix_cache_match_sglang(page_size: int, lazy: bool) -> None:
    """``evict_to_free_tokens``, ``prealloc_fits``, ``reclaim_for_prealloc`` and ``create_prefill_budget`` (its
    ``check_prefill``/``prepare_load_back``) on SGLang's ``build_swa_cache`` fixture (a real ``UnifiedRadixCache``
    holding 96 of 100 pages) with SGLang's class and, after install(), umalloc's: one seeded sequence, new pages
    inserted into the tree between the calls; every result and, after every op, the allocator's sizes and the
    tree's evictable sizes must be equal."""
    from sglang.test import unified_allocator_fixtures as fx
    from sglang_unified_differential import prepare_unified_context

    prepare_unified_context()
    fx.setup_allocator_context()
    seed = SEED * 1_000_003 + page_size * 2 + lazy
    print(f"\nseed={seed} (from UMALLOC_SEED)")
    stock = _stock_names()
    records, names = [], []
    try:
        for install in (False, True):
            if install:
                um_sglang.install()
            alloc, cache = fx.build_swa_cache(occupancy=96, lazy=lazy, page_size=page_size)
            names.append(type(alloc).__name__)
            records.append(_tree_sequence(alloc, cache, seed, page_size, TREE_OPS))
    finally:
        _restore(stock)
    assert names == ["UnifiedSWATokenToKVPoolAllocator", "UmallocUnifiedSWATokenToKVPoolAllocator"]
    for i, (a, b) in enumerate(zip(*records, strict=True)):
        assert a == b, f"op {i}: SGLang {a} vs umalloc {b}"
    evicts = [r[3] for r in records[0] if r[0] == "evict"]
    assert True in evicts and None in evicts  # demands that fit after eviction and ones that cannot
    rec = records[0]  # [op, sizes, op, sizes, ...]: some eviction shrank the tree
    assert any(rec[i][0] == "evict" and rec[i + 1][4] < rec[i - 1][4] for i in range(2, len(rec), 2))
    assert any(r[0] == "budget" and r[5][0] for r in rec) and any(r[0] == "budget" and not r[5][0] for r in rec)


def _unified_pair(page_size: int, lazy: bool) -> tuple[object, object]:
    from sglang.srt.mem_cache.allocator.unified_hybrid_swa import UnifiedSWATokenToKVPoolAllocator
    from sglang.test import unified_allocator_fixtures as fx
    from sglang_differential import sglang_module
    from sglang_unified_differential import prepare_unified_context

    prepare_unified_context()
    fx.setup_allocator_context()
    ump = sglang_module("sglang.srt.mem_cache.unified_memory_pool")
    specs = [ump.MHASubPoolSpec(name=n, layer_num=1, head_num=1, head_dim=8, store_dtype=torch.float16,
                                grow_direction=g) for n, g in (("full", "down"), ("swa", "up"))]
    pool = ump.UnifiedKVPool(total_bytes=2 * 16 * page_size * specs[0].entry_bytes(), sub_pool_specs=specs,
                             device="cpu", enable_memory_saver=False, page_size=page_size)
    return tuple(cls(unified_buffer=pool, kvcache=fx.FakeUnifiedSWAKVPool(pool), device="cpu",
                     page_size=page_size, lazy_compaction=lazy)
                 for cls in (UnifiedSWATokenToKVPoolAllocator, um_sglang.UmallocUnifiedSWATokenToKVPoolAllocator))


def test_move_gate_refuses_what_needs_a_flush() -> None:
    """Lazy mode, a full arena whose SWA end has holes (out-of-window pages released): one page more than the
    joint view offers fits only after the SWA holes are compacted into the gap; it is refused while the gate is
    closed and granted once it opens, on SGLang's class and on umalloc's alike."""
    outcomes = []
    for alloc in _unified_pair(4, lazy=True):
        gate = [True]
        alloc.set_host_transfer_move_gate(lambda gate=gate: gate[0])
        chunks = []
        while (c := alloc.alloc(4)) is not None:
            chunks.append(c)
        alloc.free_swa(torch.cat(chunks[:4]))  # SWA holes at its anchor; the full end keeps every page
        need = alloc.available_size() + 4
        gate[0] = False
        closed = alloc.alloc(need)
        gate[0] = True
        opened = alloc.alloc(need)
        outcomes.append((len(chunks), need, closed is None, None if opened is None else opened.numel()))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][2] and outcomes[0][3] == outcomes[0][1]  # refused closed, granted open


def test_move_gate_needs_lazy_compaction() -> None:
    sg, um = _unified_pair(4, lazy=False)
    with pytest.raises(AssertionError):
        sg.set_disagg_move_gate(lambda: True)
    with pytest.raises(UmallocValueError, match="lazy_compaction"):
        um.set_disagg_move_gate(lambda: True)


def test_unified_double_free_is_refused() -> None:
    _, um = _unified_pair(4, lazy=True)
    t = um.alloc(8)
    um.free(t)
    before = (um.available_size(), um.full_available_size(), um.swa_available_size())
    with pytest.raises(DoubleFreeError):
        um.free(t)
    assert (um.available_size(), um.full_available_size(), um.swa_available_size()) == before


def _live_slot_case(alloc: Any, page_size: int) -> None:
    """Page size 4: a request of 6 tokens; a decode whose last_loc is its token 0 asks for its live token 1."""
    from umalloc.integrations.sglang.occupancy import LiveSlotError

    z, six = torch.tensor([0]), torch.tensor([6])
    row = alloc.alloc_extend(z, z, six, six, torch.tensor([-1]), 6)
    before = alloc.available_size()
    two = torch.tensor([2])
    with pytest.raises(LiveSlotError) as info:
        alloc.alloc_decode(two, two, row[:1])
    assert info.value.slot == int(row[1]) and info.value.owner == "request 0 of alloc_extend call 1"
    assert alloc.available_size() == before
    seven = torch.tensor([7])
    dec = alloc.alloc_decode(seven, seven, row[-1:])  # the request's own next slot, on its second page
    assert int(dec[0]) == int(row[-1]) + 1
    alloc.free(dec)  # rows 4, 5 still live on that page: it stays
    assert alloc.available_size() == before
    alloc.free(row[4:])
    assert alloc.available_size() == before + page_size
    with pytest.raises(DoubleFreeError):
        alloc.free(row)  # rows 4, 5 freed already: refused whole
    alloc.free(row[:4])
    assert alloc.available_size() == before + 2 * page_size
    alloc.check_invariants()


def test_paged_class_refuses_a_live_slot_and_frees_pages_when_empty() -> None:
    _, um = _pair(4)
    _live_slot_case(um, 4)


def test_unified_class_refuses_a_live_slot_and_frees_pages_when_empty() -> None:
    for lazy in (False, True):
        _, um = _unified_pair(4, lazy=lazy)
        _live_slot_case(um, 4)


def test_swa_class_frees_both_pools_per_slot() -> None:
    from sglang_differential import fake_swa_kv

    from umalloc.integrations.sglang.occupancy import LiveSlotError

    cls = um_sglang.UmallocSWATokenToKVPoolAllocator
    um = cls(size=64, size_swa=64, page_size=4, dtype=torch.bfloat16, device="cpu", kvcache=fake_swa_kv(),
             need_sort=False)
    z, six = torch.tensor([0]), torch.tensor([6])
    row = um.alloc_extend(z, z, six, six, torch.tensor([-1]), 6)
    full, swa = um.full_available_size(), um.swa_available_size()
    two = torch.tensor([2])
    with pytest.raises(LiveSlotError):
        um.alloc_decode(two, two, row[:1])
    assert (um.full_available_size(), um.swa_available_size()) == (full, swa)
    um.free(row[5:])  # token 4 keeps the second page on both pools
    assert (um.full_available_size(), um.swa_available_size()) == (full, swa)
    um.check_invariants()
    um.free(row[:5])
    assert (um.full_available_size(), um.swa_available_size()) == (full + 8, swa + 8)
    um.check_invariants()


def test_token_class_resize_sizes_the_pool_as_sglang_does() -> None:
    # SGLang's post-capture sizing calls allocator.resize(config): at page size 1 it sets size only, then clear()
    import types

    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    args = (8, torch.bfloat16, "cpu", None, False)
    sg, um = TokenToKVPoolAllocator(*args), um_sglang.UmallocTokenToKVPoolAllocator(*args)
    for n in (16, 5):
        config = types.SimpleNamespace(max_total_num_tokens=n)
        sg.resize(config)
        um.resize(config)
        assert um.available_size() == sg.available_size() == n
        assert um.alloc(n).tolist() == sg.alloc(n).tolist() == list(range(1, n + 1))
        um.check_invariants()
