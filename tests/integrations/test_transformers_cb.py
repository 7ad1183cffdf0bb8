"""umalloc inside transformers' continuous batching: generated tokens identical to the stock engine.

The oracle is transformers itself: per-prompt ``generate()`` (no paged cache at all) and stock ``generate_batch``
(transformers' own ``PagedAttentionCache``). For every (model, scenario) the umalloc run must produce exactly the
same greedy tokens, with ``check_invariants()`` at every step. Models are built from configs in code with seeded
random weights (no hub). Runs only where transformers is installed (the peer venv of
``scripts/peer_suite_transformers.sh``); each result is also appended to ``$UMALLOC_TF_REPORT`` when set, one line
per (model, scenario), for the script's summary.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from umalloc.errors import UmallocValueError  # noqa: E402
from umalloc.integrations import transformers as ut  # noqa: E402

SEED = int(os.environ.get("UMALLOC_TF_SEED", "1234"))
VOCAB = 512
PAGE_SIZE = 4
WINDOW = 8
MAX_NEW_TOKENS = 10


def _build(name: str):  # type: ignore[no-untyped-def]
    """A tiny seeded random-weight model: (model, config) in float32 with sdpa paged attention."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    if name == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, **common)
        cls = transformers.LlamaForCausalLM
    elif name == "qwen3":
        cfg = transformers.Qwen3Config(num_hidden_layers=2, head_dim=16, **common)
        cls = transformers.Qwen3ForCausalLM
    elif name == "gemma3":
        cfg = transformers.Gemma3TextConfig(num_hidden_layers=3, head_dim=16, sliding_window=WINDOW,
                                            layer_types=["sliding_attention", "full_attention",
                                                         "sliding_attention"], **common)
        cls = transformers.Gemma3ForCausalLM
    elif name == "gpt_oss":
        cfg = transformers.GptOssConfig(num_hidden_layers=2, head_dim=16, sliding_window=WINDOW,
                                        num_local_experts=4, num_experts_per_tok=2,
                                        layer_types=["sliding_attention", "full_attention"], **common)
        cls = transformers.GptOssForCausalLM
    elif name == "mistral":   # Mistral-7B-v0.1's layout: no layer_types, every layer slides
        cfg = transformers.MistralConfig(num_hidden_layers=2, head_dim=16, sliding_window=WINDOW, **common)
        cls = transformers.MistralForCausalLM
    elif name == "phi3":   # Phi-3-mini-4k's layout: every layer slides, an odd window (2047 there)
        cfg = transformers.Phi3Config(num_hidden_layers=2, sliding_window=WINDOW - 1, **common)
        cls = transformers.Phi3ForCausalLM
    elif name == "qwen2-sw":   # Qwen2 with use_sliding_window and max_window_layers=0: every layer slides
        cfg = transformers.Qwen2Config(num_hidden_layers=2, use_sliding_window=True, max_window_layers=0,
                                       sliding_window=WINDOW, **common)
        cls = transformers.Qwen2ForCausalLM
    else:
        raise AssertionError(name)
    torch.manual_seed(SEED)
    model = cls(cfg).eval()
    model.config._attn_implementation = "sdpa"
    model.generation_config.eos_token_id = None   # generate() must not stop at a sampled 2 where CB does not
    return model


MODELS = ("llama", "qwen3", "gemma3", "gpt_oss", "mistral", "phi3", "qwen2-sw")
#: models whose every layer slides (Note [All sliding] in umalloc.integrations.transformers.rings)
ALL_SLIDING = {"mistral", "phi3", "qwen2-sw"}
_cache: dict[str, object] = {}


def model_for(name: str):  # type: ignore[no-untyped-def]
    if name not in _cache:
        _cache[name] = _build(name)
    return _cache[name]


def prompts() -> list[list[int]]:
    """Mixed lengths: short, longer than the window, two pairs sharing a 12- and a 20-token prefix."""
    g = torch.Generator().manual_seed(SEED)

    def rnd(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    base = [rnd(n) for n in (5, 17, 9, 33, 3, 26)]
    shared = [base[3][:12] + rnd(6), base[5][:20] + rnd(3)]
    return base + shared


def gen_config(num_return_sequences: int = 1):  # type: ignore[no-untyped-def]
    """Greedy; with several return sequences, sampling from the top-1 token (transformers refuses
    ``num_return_sequences > 1`` without sampling), which is greedy again."""
    if num_return_sequences == 1:
        return transformers.GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None,
                                             pad_token_id=0)
    return transformers.GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=True, top_k=1, eos_token_id=None,
                                         pad_token_id=0, num_return_sequences=num_return_sequences)


def cb_config(num_blocks: int = 96, max_batch_tokens: int = 48):  # type: ignore[no-untyped-def]
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    return ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                    use_async_batching=False, auto_switch_to_flash=False, max_memory_percent=0.9)


def batch_tokens(model, inputs, gcfg, cbcfg) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    out = model.generate_batch(inputs, generation_config=gcfg, continuous_batching_config=cbcfg,
                               progress_bar=False)
    return {rid: list(o.generated_tokens) for rid, o in out.items()}


_oracle: dict[str, list[list[int]]] = {}


def reference(name: str) -> list[list[int]]:
    """Per-prompt ``generate()`` tokens (transformers' dynamic cache, no batching)."""
    if name not in _oracle:
        model = model_for(name)
        gcfg = gen_config()
        rows = []
        for p in prompts():
            with torch.no_grad():
                out = model.generate(torch.tensor([p]), generation_config=gcfg, attention_mask=torch.ones(1, len(p),
                                     dtype=torch.long))
            rows.append(out[0, len(p):].tolist())
        _oracle[name] = rows
    return _oracle[name]


_stock: dict[str, list[list[int]]] = {}


def stock_tokens(name: str) -> list[list[int]]:
    """Stock ``generate_batch`` tokens (transformers' own cache), once per model."""
    if name not in _stock:
        _stock[name] = by_prompt(batch_tokens(model_for(name), prompts(), gen_config(), cb_config()), len(prompts()))
    return _stock[name]


def report(name: str, scenario: str, same: bool, detail: str) -> None:
    path = os.environ.get("UMALLOC_TF_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(f"{name:8s} {scenario:16s} {'identical' if same else 'DIFFER'}  {detail}\n")


def by_prompt(tokens: dict[str, list[int]], n: int) -> list[list[int]]:
    return [tokens[f"req_{i}"] for i in range(n)]


# ---- scenarios: (options, cb config kwargs, what the counters must show) -------------------------------------
SCENARIOS = {
    "plain": (ut.CacheOptions(), {}),
    "compact-forced": (ut.CacheOptions(compact_every_step=True), {}),
    "compact-eager": (ut.CacheOptions(compaction="eager"), {}),
    "compact-lazy": (ut.CacheOptions(compaction="lazy", compact_every_step=True, compact_budget_pages=1), {}),
    "pressure": (ut.CacheOptions(compact_every_step=True), {"num_blocks": 14}),
    # prompts split over steps: later chunks longer than twice the window read the window before them
    "chunked-prefill": (ut.CacheOptions(compact_every_step=True), {"max_batch_tokens": 20}),
    "prefix": (ut.CacheOptions(), {"max_batch_tokens": 24}),
    "evict": (ut.CacheOptions(), {"max_batch_tokens": 24, "num_blocks": 20}),
}
FULL_ONLY = {"llama", "qwen3"}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name", MODELS)
def test_tokens_identical_to_stock(name: str, scenario: str) -> None:
    if (scenario == "prefix" and name in ALL_SLIDING) or (scenario == "evict" and name not in FULL_ONLY):
        pytest.skip("no prefix is shared where every layer slides; with sliding layers freed pages are not cached")
    print(f"seed={SEED}")
    model = model_for(name)
    inputs = prompts()
    want = reference(name)
    assert len({t for row in want for t in row}) > 2 * len(want), "degenerate model output: the test could not fail"
    opts, cb_kwargs = SCENARIOS[scenario]
    assert stock_tokens(name) == want, "stock generate_batch differs from generate(): the oracle itself disagrees"
    with ut.installed(replace(opts, check_every_step=True), keep_caches=True) as inst:
        got = by_prompt(batch_tokens(model, inputs, gen_config(), cb_config(**cb_kwargs)), len(inputs))
    (cache,) = inst.caches
    c = cache.counters
    moved_alloc = sum(s.pages_moved for s in cache.alloc.stats().values())
    detail = (f"steps={c.steps} moved(forced)={c.pages_moved} moved(alloc)={moved_alloc} "
              f"refused={c.refused_allocations} prefix_hits={c.prefix_hits} evicted={c.evicted_pages}")
    report(name, scenario, got == want, detail)
    assert got == want, detail
    cache.check_invariants()
    assert c.steps > 0
    if scenario in ("compact-forced", "compact-lazy"):
        assert c.pages_moved > 0, detail
    if scenario == "compact-eager":
        assert moved_alloc > 0, detail
    if scenario == "pressure":
        assert c.refused_allocations > 0, detail
    if scenario == "prefix" and name in FULL_ONLY:   # the sliding models' shared prefixes outgrow the window
        assert c.prefix_hits > 0 and c.prefix_hit_tokens > 0, detail
    if scenario == "evict":
        assert c.evicted_pages > 0, detail
    if name in ALL_SLIDING:   # rings only, on one end; the longest prompt alone wraps its ring
        assert cache.owner == "swa" and cache.ring_table is None and set(cache.alloc.ends) == {"swa"}
        assert max(map(len, inputs)) > 2 * cache.window


@pytest.mark.parametrize(("name", "window", "page_size"), [("mistral", 4096, 16), ("phi3", 2047, 16)])
def test_all_sliding_at_the_real_window_identical(name: str, window: int, page_size: int) -> None:
    """Mistral-7B-v0.1's and Phi-3-mini-4k's real windows at small widths: tokens identical to stock
    ``generate_batch``; each request's ring holds ``min(length, window)`` tokens (checked every step) and the
    arena holds one end."""
    print(f"seed={SEED}")
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    model = _build(name)
    model.config.sliding_window = window
    model.config.max_position_embeddings = 2 * window
    kw = dict(page_size=page_size, num_blocks=64, max_batch_tokens=64, use_async_batching=False,
              auto_switch_to_flash=False, max_memory_percent=0.9)
    inputs = prompts()
    stock = batch_tokens(model, inputs, gen_config(), ContinuousBatchingConfig(**kw))
    assert len({t for row in stock.values() for t in row}) > 2 * len(stock), "degenerate model output"
    with ut.installed(ut.CacheOptions(compact_every_step=True, check_every_step=True), keep_caches=True) as inst:
        got = batch_tokens(model, inputs, gen_config(), ContinuousBatchingConfig(**kw))
    (cache,) = inst.caches
    report(f"{name}-w{window}", "plain", got == stock, f"steps={cache.counters.steps}")
    assert got == stock
    assert cache.window == window and set(cache.alloc.ends) == {"swa"} and cache.read_cache_limit == window


@pytest.mark.parametrize("name", ("llama", "gemma3", "mistral"))
def test_forks_identical(name: str) -> None:
    """num_return_sequences=2, greedy: every child is a fork of its parent (shared pages, copy-on-write) and must
    produce the parent's tokens, which are generate()'s."""
    model = model_for(name)
    inputs = prompts()
    want = reference(name)
    with ut.installed(ut.CacheOptions(compact_every_step=True, check_every_step=True), keep_caches=True) as inst:
        got = batch_tokens(model, inputs, gen_config(2), cb_config())
    stock = batch_tokens(model, inputs, gen_config(2), cb_config())
    for i, row in enumerate(want):
        assert got[f"req_{i}"] == row and got[f"req_{i}__child#0"] == row
    same = got == stock
    cache = inst.caches[0]
    report(name, "fork", same, f"forks={cache.counters.forks} copied-on-write={cache.table.stats().pages_copied}")
    assert same
    assert cache.counters.forks == len(inputs)


def test_install_refuses_other_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ut.UnsupportedTransformersVersion, match="transformers 4.57.1"):
        ut.check_version("4.57.1")
    ut.check_version(ut.installed_version())
    monkeypatch.setattr(importlib.import_module("transformers"), "__version__", "5.22.0")
    with pytest.raises(ut.UnsupportedTransformersVersion, match="5.22.0"):
        ut.install()
    api = pytest.importorskip("transformers.generation.continuous_batching.continuous_api")
    assert api.PagedAttentionCache.__name__ == "PagedAttentionCache"


def test_install_twice_refused_and_uninstall_restores() -> None:
    api = pytest.importorskip("transformers.generation.continuous_batching.continuous_api")
    stock = api.PagedAttentionCache
    with ut.installed():
        assert api.PagedAttentionCache is not stock
        with pytest.raises(UmallocValueError, match="already installed"):
            ut.install()
    assert api.PagedAttentionCache is stock


def test_refuses_attention_type_it_cannot_hold() -> None:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1)
    cfg.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ut.UnsupportedCacheError, match="layer 1 has attention type 'chunked_attention'"):
        ut.UmallocPagedCache(cfg, cb_config(), "cpu", None, torch.float32)
    cfg.layer_types = ["sliding_attention", "sliding_attention"]
    cfg.sliding_window = None
    with pytest.raises(ut.UnsupportedCacheError, match="layer 0 is 'sliding_attention' with sliding_window=None"):
        ut.UmallocPagedCache(cfg, cb_config(), "cpu", None, torch.float32)


def test_out_of_arena_is_all_or_nothing() -> None:
    """A request that does not fit is refused with nothing allocated; the table and allocator are unchanged."""
    from transformers.generation.continuous_batching.requests import RequestState

    from umalloc.allocator.observe import snapshots_equal

    cfg = model_for("gemma3").config
    cache = ut.UmallocPagedCache(cfg, cb_config(num_blocks=8), "cpu", None, torch.float32)
    a = RequestState(request_id="a", initial_tokens=list(range(3, 40)))
    assert cache.can_store_request_tokens(a, 20)
    before = cache.table.snapshot()
    b = RequestState(request_id="b", initial_tokens=list(range(3, 400)))
    assert not cache.can_store_request_tokens(b, 300)
    assert snapshots_equal(before, cache.table.snapshot())
    assert "b" not in cache.slots
    cache.check_invariants()


def test_readme_transformers_example_runs(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The docs' runnable transformers example runs as written (its own assert: tokens identical to stock)."""
    import pathlib
    import re
    import runpy

    repo = pathlib.Path(__file__).resolve().parents[2]
    blocks = [b for doc in (repo / "README.md", *sorted((repo / "docs").glob("*.md")))
              for b in re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S) if "umalloc_tf.installed" in b]
    assert len(blocks) == 1, "README.md and docs/*.md should hold the transformers example exactly once"
    script = tmp_path / "readme_transformers.py"
    script.write_text(blocks[0])
    runpy.run_path(str(script), run_name="__main__")
    assert "CacheCounters(" in capsys.readouterr().out


def test_long_later_prefill_chunk_reads_the_window_before_it() -> None:
    """A prefill chunk longer than the window, after an earlier chunk (past > 0, not page-aligned): the sliding
    rows this step reads for the window before ``past`` hold the K/V the earlier step wrote for those positions
    (ring slots ``t % window``, Note [Sliding ring]), and the chunk's own writes keep only its last window."""
    from transformers.generation.continuous_batching.requests import RequestState

    from umalloc.integrations.transformers.groups import SENTINEL_ROW, SINK_ROW

    cfg = model_for("gemma3").config
    cache = ut.UmallocPagedCache(cfg, cb_config(num_blocks=96), "cpu", None, torch.float32)
    grp = cache.cache_allocators["sliding_attention"]
    k_rows, _ = grp._views[0]
    state = RequestState(request_id="r", initial_tokens=list(range(3, 100)))
    past = 4 * PAGE_SIZE + 1
    assert cache.can_store_request_tokens(state, past)
    writes: list[list[int]] = [[], []]
    cache.extend_read_and_write_indices("r", 0, past, None, writes)
    rows = writes[grp.index]
    assert rows[: past - WINDOW] == [SINK_ROW] * (past - WINDOW)   # only the chunk's last window is stored
    assert len(set(rows[past - WINDOW:])) == WINDOW
    k_rows[torch.tensor(rows)] = torch.arange(past, dtype=torch.float32).view(-1, 1, 1).expand(-1, *k_rows.shape[1:])
    cache.step_hook()
    state.position_offset = past
    q = 3 * WINDOW + 1
    assert cache.can_store_request_tokens(state, q)
    reads: list[list[int]] = [[], []]
    cache.extend_read_and_write_indices("r", past, q, reads, [[], []])
    assert reads[grp.index][WINDOW - 1:] == [SENTINEL_ROW] * q
    got = k_rows[torch.tensor(reads[grp.index][: WINDOW - 1])][:, 0, 0].tolist()
    assert got == [float(t) for t in range(past - WINDOW + 1, past)]
    cache.check_invariants()
    cache.step_hook()
    cache.free_blocks("r")
    cache.check_invariants()
    assert cache.table.stats().live_requests == 0


def _gemma(window: int):  # type: ignore[no-untyped-def]
    """The matrix's Gemma-3 with another sliding window (same seed, same widths)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    cfg = transformers.Gemma3TextConfig(num_hidden_layers=3, head_dim=16, sliding_window=window,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        **common)
    torch.manual_seed(SEED)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    model.config._attn_implementation = "sdpa"
    return model


@pytest.mark.parametrize(("window", "page_size", "cb_kwargs"), [
    (10, 4, {}),                                    # the window spans a partial ring page
    (10, 4, {"max_batch_tokens": 20}),              # chunks longer than the window
    (7, 4, {"num_blocks": 14}),                     # pressure: requests wait and are preempted
    (6, 8, {"max_batch_tokens": 20}),               # a window shorter than one page
])
def test_unaligned_windows_identical(window: int, page_size: int, cb_kwargs: dict) -> None:
    """Sliding windows that are not a multiple of the page size: tokens identical to stock ``generate_batch``
    (the oracle) with forced compaction and the invariants checked at every step."""
    print(f"seed={SEED}")
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    model = _gemma(window)
    kw = dict(page_size=page_size, num_blocks=96, max_batch_tokens=48, use_async_batching=False,
              auto_switch_to_flash=False, max_memory_percent=0.9)
    kw.update(cb_kwargs)
    inputs = prompts()
    stock = batch_tokens(model, inputs, gen_config(), ContinuousBatchingConfig(**kw))
    assert len({t for row in stock.values() for t in row}) > 2 * len(stock), "degenerate model output"
    with ut.installed(ut.CacheOptions(compact_every_step=True, check_every_step=True), keep_caches=True) as inst:
        got = batch_tokens(model, inputs, gen_config(), ContinuousBatchingConfig(**kw))
    (cache,) = inst.caches
    c = cache.counters
    scenario = "chunked-prefill" if "max_batch_tokens" in cb_kwargs else "pressure" if cb_kwargs else "plain"
    report(f"gemma3-w{window}p{page_size}", scenario, got == stock,
           f"steps={c.steps} moved(forced)={c.pages_moved} refused={c.refused_allocations}")
    assert got == stock, cache.counters
    assert cache.counters.pages_moved > 0
    if "num_blocks" in cb_kwargs:
        assert cache.counters.refused_allocations > 0


def test_ring_holds_the_fewest_pages_of_a_window() -> None:
    """A request holds ceil(min(length, window) / page_size) sliding pages whatever its length (transformers'
    ring buffer), counted on the allocator's swa end, independently of the cache's own bookkeeping."""
    from transformers.generation.continuous_batching.requests import RequestState

    window, ps = 10, 4
    cache = ut.UmallocPagedCache(_gemma(window).config, cb_config(num_blocks=96), "cpu", None, torch.float32)
    base, base_full = (cache.alloc.stats()[e].live_pages for e in ("swa", "full"))
    state = RequestState(request_id="r", initial_tokens=list(range(3, 200)))
    length = 0
    for grow in (3, 5, 1, 1, 30, 1, 1, 1, 7):
        assert cache.can_store_request_tokens(state, grow)
        length += grow
        state.position_offset = length
        cache.check_invariants()   # also puts deferred decodes into the tables
        live = cache.alloc.stats()["swa"].live_pages - base
        assert live == -(-min(length, window) // ps), (length, live)
        assert cache.alloc.stats()["full"].live_pages - base_full == -(-length // ps)
    cache.free_blocks("r")
    cache.check_invariants()
    assert cache.alloc.stats()["swa"].live_pages == base


def test_refused_growth_of_a_known_request_changes_nothing() -> None:
    """A known request whose ring page would fit but whose full-attention pages do not is refused with both
    tables and the allocator exactly as before: nothing is allocated, not even the ring's page."""
    from transformers.generation.continuous_batching.requests import RequestState

    from umalloc.allocator.observe import snapshots_equal

    window, ps = 10, 4
    cache = ut.UmallocPagedCache(_gemma(window).config, cb_config(num_blocks=16), "cpu", None, torch.float32)
    a = RequestState(request_id="a", initial_tokens=list(range(3, 43)), max_new_tokens=4)   # it could complete alone
    assert cache.can_store_request_tokens(a, ps + 1)   # a ring of 2 pages, 3 once it holds the window
    a.position_offset = ps + 1
    b = RequestState(request_id="b", initial_tokens=list(range(3, 43)), max_new_tokens=4)
    assert cache.can_store_request_tokens(b, 40)   # another request holds room: a's growth can fit alone
    full_bytes = cache.cache_allocators["full_attention"].bytes_per_block
    free_full_pages = cache.free_bytes() // full_bytes
    grow = (free_full_pages + 1) * ps   # the ring's page fits, the full pages cannot
    assert cache.alloc.can_alloc({"swa": 1})
    assert a.current_len() + grow <= cache.max_tokens_per_request
    before = (cache.table.snapshot(), cache.ring_table.snapshot())
    live = {e: s.live_pages for e, s in cache.alloc.stats().items()}
    allocated = cache.alloc.stats()["swa"].pages_allocated
    assert not cache.can_store_request_tokens(a, grow)
    assert cache.alloc.stats()["swa"].pages_allocated == allocated
    after = (cache.table.snapshot(), cache.ring_table.snapshot())
    assert all(snapshots_equal(x, y) for x, y in zip(before, after, strict=True))
    assert {e: s.live_pages for e, s in cache.alloc.stats().items()} == live
    assert cache.held_tokens("a") == ps + 1
    cache.check_invariants()


def test_async_batching_and_tiny_pages_are_refused() -> None:
    """Asynchronous batching schedules (allocates, compacts) while a forward reads rows; pages under 4 tokens
    (transformers' own bound) leave no never-written pad row: both refused at construction, typed."""
    cb = cb_config()
    cb.use_async_batching = True
    with pytest.raises(ut.UnsupportedCacheError, match="use_async_batching"):
        ut.UmallocPagedCache(model_for("gemma3").config, cb, "cpu", None, torch.float32)
    cb = cb_config()
    cb.page_size = 2
    with pytest.raises(ut.UnsupportedCacheError, match="page_size=2"):
        ut.UmallocPagedCache(model_for("gemma3").config, cb, "cpu", None, torch.float32)


def test_padded_reads_read_zeros() -> None:
    """After a run, the row padded lanes read (row 2 of the sink page, every layer's K and V) is still zero."""
    from umalloc.integrations.transformers.groups import PAD_READ_ROW

    model = model_for("gemma3")
    with ut.installed(ut.CacheOptions(compact_every_step=True), keep_caches=True) as inst:
        batch_tokens(model, prompts(), gen_config(), cb_config(max_batch_tokens=20))
    (cache,) = inst.caches
    for grp in cache.cache_allocators.values():
        assert grp.read_trash_index == PAD_READ_ROW
        for k_rows, v_rows in grp._views.values():
            assert not k_rows[PAD_READ_ROW].any() and not v_rows[PAD_READ_ROW].any()


def test_forks_under_pressure_identical() -> None:
    """num_return_sequences=2 on a small arena: forks share a partial page (copied on write, counted in the
    growth's pages and in ``needs_new_blocks`` alike, so transformers' offloading manager frees what the cache
    refuses), requests are refused and preempted, and the tokens equal stock ``generate_batch``'s."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    model = _gemma(10)
    kw = dict(page_size=4, num_blocks=20, max_batch_tokens=24, use_async_batching=False,
              auto_switch_to_flash=False, max_memory_percent=0.9)
    stock = batch_tokens(model, prompts(), gen_config(2), ContinuousBatchingConfig(**kw))
    with ut.installed(ut.CacheOptions(compaction="eager", compact_every_step=True, check_every_step=True), keep_caches=True) as inst:
        got = batch_tokens(model, prompts(), gen_config(2), ContinuousBatchingConfig(**kw))
    c = inst.caches[0].counters
    report("gemma3-w10p4", "fork-pressure", got == stock, f"forks={c.forks} refused={c.refused_allocations}")
    assert got == stock, c
    assert c.forks > 0 and c.refused_allocations > 0
