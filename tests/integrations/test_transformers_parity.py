"""umalloc inside transformers' continuous batching is never worse than the stock engine on the same inputs (F31,
F32): caches die with their work, requests prefilled in one step share their common pages, a request that can
never fit fails alone, seeded sampling gives the same tokens, bad options are refused.

The oracle is stock ``generate_batch`` (transformers' own ``PagedAttentionCache``) on the same model, prompts and
config, measured with the same probe on both caches. Runs where transformers is installed (the peer venv of
``scripts/peer_suite_transformers.sh``); models are seeded random-weight configs built in code (no hub).
"""

from __future__ import annotations

import gc
import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from umalloc.errors import UmallocValueError  # noqa: E402
from umalloc.integrations import transformers as ut  # noqa: E402

SEED = int(os.environ.get("UMALLOC_TF_SEED", "4321"))
VOCAB = 512
FULL = "full_attention"


def build(name: str) -> Any:
    """A tiny seeded random-weight model in float32 with sdpa paged attention."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    torch.manual_seed(SEED)
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2, **common))
    elif name == "gemma3":
        cfg = transformers.Gemma3TextConfig(num_hidden_layers=3, head_dim=16, sliding_window=12,
                                            layer_types=["sliding_attention", "full_attention",
                                                         "sliding_attention"], **common)
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        raise AssertionError(name)
    model = model.eval()
    model.config._attn_implementation = "sdpa"
    return model


_models: dict[str, Any] = {}


def model_for(name: str) -> Any:
    if name not in _models:
        _models[name] = build(name)
    return _models[name]


def rnd(g: Any, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def cb_config(**kw: Any) -> Any:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    base = dict(page_size=8, num_blocks=256, max_batch_tokens=8192, use_async_batching=False,
                auto_switch_to_flash=False, max_memory_percent=0.9)
    base.update(kw)
    return ContinuousBatchingConfig(**base)


def greedy(max_new_tokens: int = 6) -> Any:
    return transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                         pad_token_id=0)


def run(model: Any, prompts: list[list[int]], gcfg: Any, cbcfg: Any) -> dict[str, Any]:
    return dict(model.generate_batch(prompts, generation_config=gcfg, continuous_batching_config=cbcfg,
                                     progress_bar=False))


@contextmanager
def probe_blocks() -> Iterator[list[int]]:
    """Per scheduling step, the full-attention blocks held by requests (distinct block ids over the group's
    ``block_table``), sampled at the step hook the scheduler calls first in every step (after the previous
    forward and its ``mark_complete_blocks``), on whichever cache transformers builds in the block."""
    api = pytest.importorskip("transformers.generation.continuous_batching.continuous_api")
    inner = api.PagedAttentionCache
    samples: list[int] = []

    def factory(*args: Any, **kwargs: Any) -> Any:
        cache = inner(*args, **kwargs)
        pool = cache.pool
        hook = pool.try_to_free_sectors

        def sampled() -> None:
            tables = cache.cache_allocators[FULL].block_table
            samples.append(len({b for blocks in tables.values() for b in blocks}))
            hook()
        pool.try_to_free_sectors = sampled
        return cache

    api.PagedAttentionCache = factory
    try:
        yield samples
    finally:
        api.PagedAttentionCache = inner


# ---- caches die with their work ---------------------------------------------------------------------------
def test_caches_die_with_their_work() -> None:
    """Four successive generate_batch calls: after each, no cache built by the installation is alive (counted
    through weak references and through the garbage collector's own list) and no arena bytes are held; the
    installation kept the counters only (so a cache kept by any call fails the check of that very call).
    uninstall() leaves nothing of the installation in the module."""
    model = model_for("llama")
    g = torch.Generator().manual_seed(SEED)
    prompts = [rnd(g, 30) for _ in range(6)]
    inst = ut.install()
    try:
        for call in range(4):
            run(model, prompts, greedy(4), cb_config(num_blocks=64))
            gc.collect()
            alive = [o for o in gc.get_objects() if isinstance(o, ut.UmallocPagedCache)]
            assert inst.caches == [] and alive == [], f"call {call}: {len(alive)} caches alive"
            assert inst.caches_built == call + 1
            assert inst.last_counters is not None and inst.last_counters.steps > 0
    finally:
        ut.uninstall()
    api = pytest.importorskip("transformers.generation.continuous_batching.continuous_api")
    assert api.PagedAttentionCache.__name__ == "PagedAttentionCache"
    assert api.ContinuousBatchProcessor.__name__ == "ContinuousBatchProcessor"


def test_keep_caches_holds_them_until_released() -> None:
    model = model_for("llama")
    with ut.installed(keep_caches=True) as inst:
        run(model, [[5, 6, 7, 8, 9] * 3], greedy(3), cb_config(num_blocks=32))
        run(model, [[5, 6, 7, 8, 9] * 3], greedy(3), cb_config(num_blocks=32))
    gc.collect()
    assert len(inst.caches) == 2
    inst.release()
    gc.collect()
    assert inst.caches == []
    with pytest.raises(UmallocValueError, match="keep_caches=1"):
        ut.install(keep_caches=1)  # type: ignore[arg-type]


# ---- same-step prefix sharing -----------------------------------------------------------------------------
@pytest.mark.parametrize("num_prompts", [8, 32])
@pytest.mark.parametrize("prefix_tokens", [64, 200])
def test_same_step_prefixes_are_shared(num_prompts: int, prefix_tokens: int) -> None:
    """Prompts sharing a prefix, all prefilled in one step: from the second step on umalloc holds no more
    full-attention blocks than stock at every step (stock swaps a completed duplicate for the indexed block after
    the forward; so does umalloc), tokens identical, and umalloc did de-duplicate pages."""
    print(f"seed={SEED}")
    model = model_for("llama")
    g = torch.Generator().manual_seed(SEED + num_prompts + prefix_tokens)
    prefix = rnd(g, prefix_tokens)
    prompts = [prefix + rnd(g, 3 + i % 5) for i in range(num_prompts)]
    cbcfg = cb_config(num_blocks=num_prompts * (prefix_tokens // 8 + 4))
    with probe_blocks() as stock_blocks:
        stock = run(model, prompts, greedy(), cbcfg)
    with ut.installed(ut.CacheOptions(check_every_step=True), keep_caches=True) as inst:
        with probe_blocks() as mine_blocks:
            mine = run(model, prompts, greedy(), cbcfg)
    assert {r: o.generated_tokens for r, o in mine.items()} == {r: o.generated_tokens for r, o in stock.items()}
    assert len(stock_blocks) == len(mine_blocks), (stock_blocks, mine_blocks)   # the same schedule
    # the first sample precedes the first forward; from the second step on the pages are de-duplicated
    for step, (s, m) in enumerate(zip(stock_blocks[1:], mine_blocks[1:], strict=True), start=1):
        assert m <= s, f"step {step}: umalloc holds {m} blocks, stock {s} ({mine_blocks} vs {stock_blocks})"
    naive = num_prompts * (prefix_tokens // 8)   # every request's own copy of the prefix's full pages
    assert mine_blocks[1] < naive
    (cache,) = inst.caches
    assert cache.counters.deduplicated_pages >= (num_prompts - 1) * (prefix_tokens // 8)
    ledger = cache.cache_allocators[FULL].ledger   # transformers' ledger shape, read-only
    assert len(ledger.hash_to_block) >= prefix_tokens // 8
    assert {ledger.block_to_hash[b] for b in ledger.hash_to_block.values()} == set(ledger.hash_to_block)
    with pytest.raises(TypeError):
        ledger.hash_to_block[0] = 1  # type: ignore[index]
    print(f"blocks after step 1: stock {stock_blocks[1]}, umalloc {mine_blocks[1]} (naive {naive})")


def test_a_no_cache_free_keeps_the_hashes_of_pages_others_hold() -> None:
    """free_blocks(no_cache=True) (transformers' preemption) unindexes only the pages the request was the last
    holder of, as stock's ledger releases a hash only at reference count 0: a third request still hits the prefix
    another live request shares. Stock's own cache, driven the same way, is the oracle."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.requests import RequestState

    g = torch.Generator().manual_seed(SEED)
    prompt = rnd(g, 33)
    hits = {}
    for name, cls in (("stock", PagedAttentionCache), ("umalloc", ut.UmallocPagedCache)):
        one_rank = SimpleNamespace(tp_size=1)   # the stock cache reads only tp_size when it is 1
        cache = cls(model_for("llama").config, cb_config(num_blocks=64), "cpu", one_rank, torch.float32)
        a = RequestState(request_id="a", initial_tokens=prompt, max_new_tokens=4)
        assert cache.can_store_request_tokens(a, len(prompt))
        a.position_offset = len(prompt)
        cache.mark_complete_blocks(a, cache.count_new_complete_blocks(RequestState(request_id="x",
                                                                                     initial_tokens=[]), 33))
        got = [cache.search_prefix_match("b", prompt)]
        cache.free_blocks("a", no_cache=True)
        got.append(cache.search_prefix_match("c", prompt))
        hits[name] = got
    assert hits["umalloc"] == hits["stock"] == [32, 32], hits


# ---- a request that can never fit fails alone -------------------------------------------------------------
def _workloads(g: Any) -> dict[str, tuple[list[list[int]], int, int]]:
    """name -> (prompts, max_new_tokens, return sequences): each with one or two requests too long for the
    tightest arenas below."""
    prefix = rnd(g, 40)
    return {
        "long-prompt": ([rnd(g, 12 + 3 * i) for i in range(9)] + [rnd(g, 150)], 8, 1),
        "shared-prefix": ([prefix + rnd(g, 5 + i) for i in range(8)] + [prefix + rnd(g, 120)], 8, 1),
        "long-generation": ([rnd(g, 10 + i) for i in range(7)] + [rnd(g, 60)], 90, 1),
        "mixed": ([rnd(g, n) for n in (3, 70, 9, 33, 140, 17, 5, 101)], 12, 1),
        "forks": ([rnd(g, 14 + 5 * i) for i in range(5)] + [rnd(g, 130)], 8, 2),
    }


def _cannot_fit_alone(cache: Any, config: Any, prompt: int, new_tokens: int) -> bool:
    """Whether a request of ``prompt`` tokens generating ``new_tokens`` could not complete with the arena to
    itself, by a byte count independent of the cache's own (a lower bound on the room: the arena less its floor
    and one page of slack per end, so this answers True for every request that truly cannot fit and perhaps a
    few more)."""
    tokens = prompt + new_tokens - 1
    ps = cache.page_size
    pages = -(-tokens // ps)
    room = cache.arena.arena_bytes - cache.arena.floor_bytes
    need = 0
    for grp in cache.cache_allocators.values():
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bytes_per_page = 2 * len(grp.layer_indices) * ps * config.num_key_value_heads * head_dim * 4   # float32
        n = pages if grp.sliding_window is None else -(-min(tokens, grp.sliding_window) // ps)
        need += n * bytes_per_page
        room -= bytes_per_page
    return need > room


#: tight capacities per model (a Gemma-3 block is three layers, its ring caps the sliding ones: fewer blocks)
SWEEP_BLOCKS = {"llama": (10, 14, 18, 22), "gemma3": (4, 5, 7, 10)}


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_cannot_fit_requests_fail_alone(name: str) -> None:
    """Tight num_blocks x workloads: umalloc's failed requests are a subset of stock's and of the requests that
    cannot fit alone, each failed with RequestCannotFitError's message; every request both complete has the same
    tokens. The sweep must exercise something: umalloc fails some request, and stock fails more than umalloc
    somewhere (its cascade) or as many."""
    print(f"seed={SEED}")
    model = model_for(name)
    g = torch.Generator().manual_seed(SEED)
    umalloc_failed_total = stock_failed_total = 0
    for wl, (prompts, max_new, nret) in _workloads(g).items():
        gcfg = (transformers.GenerationConfig(max_new_tokens=max_new, do_sample=True, top_k=1, eos_token_id=None,
                                              pad_token_id=0, num_return_sequences=nret)
                if nret > 1 else greedy(max_new))
        for num_blocks in SWEEP_BLOCKS[name]:
            cbcfg = cb_config(num_blocks=num_blocks, max_batch_tokens=64)
            stock = run(model, prompts, gcfg, cbcfg)
            with ut.installed(keep_caches=True) as inst:
                mine = run(model, prompts, gcfg, cbcfg)
            cache = inst.caches[-1]
            expected = set(stock) | set(mine)   # a request missing from the output was lost: failed too
            failed_stock = {r for r, o in stock.items() if o.status.name == "FAILED"} | (expected - set(stock))
            failed_mine = {r for r, o in mine.items() if o.status.name == "FAILED"} | (expected - set(mine))
            lengths = {r: len(o.prompt_ids) for r, o in (stock | mine).items()}
            too_long = {r for r in expected if _cannot_fit_alone(cache, model.config, lengths[r], max_new)}
            where = f"{name}/{wl}/num_blocks={num_blocks}: umalloc failed {sorted(failed_mine)}, stock " \
                    f"{sorted(failed_stock)}, cannot fit alone {sorted(too_long)}"
            assert failed_mine <= failed_stock, where
            assert failed_mine <= too_long, where
            for r in failed_mine:
                assert "can never complete" in mine[r].error, mine[r].error
            assert cache.counters.failed_alone == len(failed_mine)
            for r in expected - failed_stock - failed_mine:
                assert mine[r].generated_tokens == stock[r].generated_tokens, (where, r)
            umalloc_failed_total += len(failed_mine)
            stock_failed_total += len(failed_stock)
            print(where)
    assert umalloc_failed_total > 0 and stock_failed_total >= umalloc_failed_total


def test_cannot_fit_with_eos_is_admitted_when_its_prompt_fits() -> None:
    """A request that may stop early (it has an end-of-sequence token) and whose prompt fits is admitted; with a
    long max_new_tokens it fails alone only once it needs more than the arena holds for one request."""
    model = model_for("llama")
    g = torch.Generator().manual_seed(SEED)
    prompts = [rnd(g, 12) for _ in range(4)] + [rnd(g, 40)]
    gcfg = transformers.GenerationConfig(max_new_tokens=400, do_sample=False, eos_token_id=VOCAB - 1,
                                         pad_token_id=0)
    with ut.installed(keep_caches=True) as inst:
        out = run(model, prompts, gcfg, cb_config(num_blocks=12, max_batch_tokens=64))
    cache = inst.caches[-1]
    for r, o in out.items():
        if o.status.name == "FAILED":
            assert len(o.prompt_ids) + len(o.generated_tokens) >= cache.tokens_alone - cache.page_size, r
            assert "can never complete" in o.error
        else:
            assert o.status.name == "FINISHED"


def test_tokens_alone_matches_the_allocator() -> None:
    """The cache's per-request capacity is exactly what the allocator can hand one request on an empty arena."""
    for name in ("llama", "gemma3"):
        cache = ut.UmallocPagedCache(model_for(name).config, cb_config(num_blocks=20), "cpu", None, torch.float32)
        ps, t, window = cache.page_size, cache.tokens_alone, cache.window
        need = {"full": -(-t // ps)}
        more = {"full": -(-t // ps) + 1}
        if window is not None:
            need["swa"] = more["swa"] = -(-min(t, window) // ps)
        assert cache.alloc.can_alloc(need), name
        assert not cache.alloc.can_alloc(more), name


# ---- seeded sampling --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_seeded_sampling_identical(name: str) -> None:
    """do_sample=True with a fixed seed and the same schedule (no pressure): tokens identical to stock. Block
    sharing is off on Gemma-3: umalloc shares prefixes there and stock does not, so their schedules (and the order
    in which they draw from the shared generator) would differ."""
    model = model_for(name)
    sharing = name != "gemma3"
    g = torch.Generator().manual_seed(SEED)
    prompts = [rnd(g, n) for n in (5, 23, 40, 9, 17)]
    gcfg = transformers.GenerationConfig(max_new_tokens=10, do_sample=True, temperature=1.3, top_k=50,
                                         eos_token_id=None, pad_token_id=0)

    def sampled(installed: bool) -> dict[str, list[int]]:
        torch.manual_seed(SEED)
        if installed:
            with ut.installed():
                out = run(model, prompts, gcfg, cb_config(max_batch_tokens=48, allow_block_sharing=sharing))
        else:
            out = run(model, prompts, gcfg, cb_config(max_batch_tokens=48, allow_block_sharing=sharing))
        return {r: o.generated_tokens for r, o in out.items()}

    stock, mine = sampled(False), sampled(True)
    assert mine == stock
    assert stock != {r: o.generated_tokens for r, o in run(model, prompts, greedy(10), cb_config()).items()}


# ---- options ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [
    ("compact_budget_pages", -3), ("compact_budget_pages", 0), ("max_requests", 0), ("max_requests", 2.5),
    ("arena_bytes", 0), ("arena_bytes", True), ("compaction", "sometimes"), ("compact_every_step", 1),
    ("check_every_step", "yes"),
])
def test_bad_options_refused(field: str, value: object) -> None:
    with pytest.raises(UmallocValueError, match=rf"CacheOptions\.{field}={value!r}"):
        ut.CacheOptions(**{field: value})


def test_too_small_arena_names_its_size() -> None:
    cfg = model_for("llama").config
    with pytest.raises(ut.UnsupportedCacheError, match=r"CacheOptions.arena_bytes=1: allowed a multiple of 16 bytes"):
        ut.UmallocPagedCache(cfg, cb_config(), "cpu", None, torch.float32, options=ut.CacheOptions(arena_bytes=1))
    with pytest.raises(ut.UnsupportedCacheError, match=r"arena_bytes=32 \(CacheOptions.arena_bytes\): allowed >= "):
        ut.UmallocPagedCache(cfg, cb_config(), "cpu", None, torch.float32, options=ut.CacheOptions(arena_bytes=32))


def test_latent_attention_refused_naming_it() -> None:
    """A multi-head latent attention config (DeepSeek-V3 style, transformers 5.25 caches compressed latents) is
    refused at construction, naming the layer and why."""
    cfg = model_for("llama").config.__class__(**model_for("llama").config.to_dict())
    cfg.kv_lora_rank = 32
    with pytest.raises(ut.UnsupportedCacheError, match=r"layer 0 is multi-head latent attention \(kv_lora_rank=32\)"):
        ut.UmallocPagedCache(cfg, cb_config(), "cpu", None, torch.float32)


def test_version_check_reads_the_imported_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.import_module("transformers"), "__version__", "5.22.0")
    assert ut.installed_version() == "5.22.0"
    with pytest.raises(ut.UnsupportedTransformersVersion, match=r"transformers 5.22.0 is untested .*allowed 5.23.0, 5.24.0, 5.25.0"):
        ut.install()
    from umalloc.integrations.versions import EngineVersionError
    assert issubclass(ut.UnsupportedTransformersVersion, EngineVersionError)

