"""Requests admitted into transformers' continuous batching with their prompt's KV already in the umalloc cache's
pages (:mod:`umalloc.integrations.transformers.admit`, Note [Admission seam]).

Oracle: transformers' own per-prompt ``generate()`` (greedy, its DynamicCache, no paged cache). The KV each
admitted request starts from is computed here by a plain forward (transformers' DynamicCache) and written into
the pages :meth:`DecodeEngine.reserve` returned, through the arena's K/V views — what a transfer plan writes. The
engine never runs the prompt: its tokens equal ``generate()``'s only if the engine attends over those pages.
Seeded (``UMALLOC_TF_SEED``, printed).
"""

from __future__ import annotations

import copy
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

from umalloc import UmallocValueError  # noqa: E402
from umalloc.integrations.transformers import CacheOptions, UnsupportedCacheError  # noqa: E402
from umalloc.integrations.transformers.admit import DecodeEngine, reserved_pages  # noqa: E402

SEED = int(os.environ.get("UMALLOC_TF_SEED", "1234"))
VOCAB = 512
PAGE_SIZE = 4
NEW = 8


def drained(eng: DecodeEngine) -> dict[int, list[int]]:
    """Step ``eng`` until nothing runs; every finished request's generated tokens by request id (a request that
    failed in the engine fails the test)."""
    while eng.step():
        pass
    out = {}
    for rid, st in eng.finished():
        assert st.error is None
        out[int(rid)] = list(st.generated_tokens)
    return out


def build(name: str = "llama"):  # type: ignore[no-untyped-def]
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, initializer_range=0.3, tie_word_embeddings=False)
    if name == "llama":
        cfg, cls = transformers.LlamaConfig(num_hidden_layers=2, **common), transformers.LlamaForCausalLM
    elif name == "qwen3":
        cfg, cls = transformers.Qwen3Config(num_hidden_layers=2, **common), transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.Gemma3TextConfig(num_hidden_layers=2, sliding_window=8,
                                            layer_types=["sliding_attention", "full_attention"], **common)
        cls = transformers.Gemma3ForCausalLM
    torch.manual_seed(SEED)
    model = cls(cfg).eval()
    model.config._attn_implementation = "sdpa"
    return model


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 16, 21, 5, 30)]


def stock(model, prompt: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    gcfg = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=NEW)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=gcfg,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def prefill(model, prompt: list[int]):  # type: ignore[no-untyped-def]
    """(first greedy token, per layer (K, V) ``[kv_heads, L, head_dim]``) from one forward with a DynamicCache."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    return int(out.logits[0, -1].argmax()), [(la.keys[0], la.values[0]) for la in cache.layers]


def engine(model, num_blocks: int = 64, **opts):  # type: ignore[no-untyped-def]
    gcfg = transformers.GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=NEW)
    cb = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=num_blocks, max_batch_tokens=64,
                                  use_async_batching=False, auto_switch_to_flash=False, allow_block_sharing=False,
                                  max_memory_percent=0.9)
    return DecodeEngine(copy.deepcopy(model), gcfg, cb, CacheOptions(check_every_step=True, **opts))


def land(eng: DecodeEngine, vtokens: torch.Tensor, kv, heads_swapped: bool = False) -> None:  # type: ignore[no-untyped-def]
    """Write each layer's K/V into the reserved pages, as a transfer would (sequence page j -> reserved page j)."""
    c = eng.cache
    ps = c.page_size
    pp = c.alloc.translate_pages(torch.from_numpy(reserved_pages(vtokens, ps)), "full")
    n = int(vtokens.numel())
    for i, (k, v) in enumerate(kv):
        if heads_swapped and i == 0:
            k = k[[1, 0]]
        kview, vview = c.arena.kv_views("full", i)
        for x, view in ((k, kview), (v, vview)):
            buf = torch.zeros(pp.numel() * ps, x.shape[0], x.shape[2])
            buf[:n] = x.transpose(0, 1)
            view[pp] = buf.view(pp.numel(), ps, x.shape[0], x.shape[2])


def run(model, eng: DecodeEngine, ps: list[list[int]], join_every: int = 1,  # type: ignore[no-untyped-def]
        heads_swapped: bool = False) -> dict[int, list[int]]:
    """Admit the prompts one at a time, ``join_every`` steps apart, into the running batch; decode all."""
    for i, p in enumerate(ps):
        vt = eng.reserve(str(i), len(p))
        assert vt is not None
        first, kv = prefill(model, p)
        land(eng, vt, kv, heads_swapped)
        eng.admit(str(i), p, first, NEW)
        for _ in range(join_every):
            eng.step()
    return drained(eng)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_admitted_requests_decode_over_the_received_pages_as_generate_does(name: str) -> None:
    print(f"seed {SEED}")
    model = build(name)
    want = {i: stock(model, p) for i, p in enumerate(prompts())}
    eng = engine(model)
    got = run(model, eng, prompts())
    assert got == want
    assert max(eng.step_requests) > 1   # requests joined a batch that was decoding
    assert len(eng.cache.slots) == 0 and eng.cache.alloc.leases_active() == 0
    eng.close()


def test_pages_moved_by_compaction_between_steps_keep_the_tokens() -> None:
    model = build("llama")
    want = {i: stock(model, p) for i, p in enumerate(prompts())}
    eng = engine(model, compact_every_step=True)
    assert run(model, eng, prompts(), join_every=2) == want
    assert eng.cache.counters.compactions > 0
    eng.close()


def test_a_wrong_received_kv_changes_the_tokens() -> None:
    """Mutation: KV heads 0 and 1 of layer 0 swapped in the received pages: the decode reads those pages, so the
    tokens differ from ``generate()``'s (the seam cannot be recomputing the prompt)."""
    model = build("llama")
    want = {i: stock(model, p) for i, p in enumerate(prompts())}
    got = run(model, engine(model), prompts(), heads_swapped=True)
    assert sum(got[i][1:] != want[i][1:] for i in want) >= len(want) - 1


def test_a_reservation_without_room_changes_nothing_and_waits_for_a_finished_request() -> None:
    model = build("llama")
    eng = engine(model, num_blocks=12)
    p = prompts()[5]   # 30 tokens: 8 pages, their growth to 37 tokens 10
    vt = eng.reserve("a", len(p))
    assert vt is not None
    free = eng.cache.free_bytes()
    assert eng.reserve("b", len(p)) is None
    assert eng.cache.free_bytes() == free and "b" not in eng.cache.slots
    first, kv = prefill(model, p)
    land(eng, vt, kv)
    eng.admit("a", p, first, NEW)
    while eng.step():
        pass
    assert [st.generated_tokens for _, st in eng.finished()] == [stock(model, p)]
    assert eng.reserve("b", len(p)) is not None
    eng.close()


def test_bad_calls_are_refused_with_typed_errors() -> None:
    model = build("llama")
    eng = engine(model)
    free = eng.cache.free_bytes()
    with pytest.raises(UmallocValueError, match="was not reserved"):
        eng.admit("x", [5, 6], 7, NEW)
    vt = eng.reserve("x", 2)
    assert vt is not None and vt.shape == (2,)
    with pytest.raises(UmallocValueError, match="already holds pages"):
        eng.reserve("x", 2)
    with pytest.raises(UmallocValueError, match="allowed 1.."):
        eng.reserve("y", 0)
    with pytest.raises(UmallocValueError, match="prompt of 3 tokens"):
        eng.admit("x", [5, 6, 7], 7, NEW)
    with pytest.raises(UmallocValueError, match="max_new_tokens=1"):
        eng.admit("x", [5, 6], 7, 1)
    eng.release("x")
    assert "x" not in eng.cache.slots and eng.cache.free_bytes() == free
    eng.close()


def test_a_model_with_sliding_layers_needs_reserve_ends() -> None:
    eng = engine(build("gemma3"))
    with pytest.raises(UnsupportedCacheError, match="allowed reserve_ends"):
        eng.reserve("x", 4)
    assert eng.cache.slots == {}
    eng.close()


# ---- sliding layers: the window tail lands in the ring (Note [Ring landing]) ------------------------------------


def prefill_all(model, prompt: list[int]):  # type: ignore[no-untyped-def]
    """:func:`prefill` with every prompt token of the sliding layers too (their past recorded)."""
    cache = transformers.DynamicCache(config=model.config)
    for la in cache.layers:
        if la.is_sliding:
            la.activate_past_recording()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    return int(out.logits[0, -1].argmax()), [(la.keys[0], la.values[0]) for la in cache.layers]


def land_tail(eng: DecodeEngine, vts: dict, kv, layer_types: list[str], window: int,  # type: ignore[no-untyped-def]
              shift_swa: bool = False) -> None:
    """Write what a transfer plan writes: per end, whole sequence pages (``full``: all; ``swa``: from the page
    holding token ``L - window``) onto the page of ``vts[end]``'s id at each page's first position, tokens past
    ``L`` zero. ``shift_swa`` writes each swa page with the previous sequence page's tokens (a wrong tail)."""
    c = eng.cache
    ps = c.page_size
    for end, vt in vts.items():
        n = int(vt.numel())
        lo = 0 if end == "full" else max(0, n - window) // ps
        seq = list(range(lo, -(-n // ps)))
        vpages = [int(vt[j * ps]) // ps for j in seq]
        assert len(set(vpages)) == len(vpages)   # a plan names no destination page twice
        pp = c.alloc.translate_pages(torch.tensor(vpages, dtype=torch.int64), end)
        layers = [i for i, t in enumerate(layer_types) if (t == "sliding_attention") == (end == "swa")]
        for idx, layer in enumerate(layers):
            kview, vview = c.arena.kv_views(end, idx)
            for x, view in zip(kv[layer], (kview, vview), strict=True):
                for d, j in zip(pp.tolist(), seq, strict=True):
                    a = (j - 1 if shift_swa and end == "swa" else j) * ps
                    page = torch.zeros(ps, x.shape[0], x.shape[2])
                    got = x[:, max(a, 0): min(a + ps, n)].transpose(0, 1)
                    page[max(0, -a): max(0, -a) + got.shape[0]] = got
                    view[d] = page


def gemma(window: int):  # type: ignore[no-untyped-def]
    model = build("gemma3")
    model.config.sliding_window = window
    for layer in model.model.layers:
        if layer.self_attn.is_sliding:
            layer.self_attn.sliding_window = window
    return model


def run_ring(model, eng: DecodeEngine, ps: list[list[int]], shift_swa: bool = False) -> dict[int, list[int]]:  # type: ignore[no-untyped-def]
    types, w = list(model.config.layer_types), int(model.config.sliding_window)
    for i, p in enumerate(ps):
        vts = eng.reserve_ends(str(i), len(p))
        assert vts is not None and set(vts) == {"full", "swa"}
        first, kv = prefill_all(model, p)
        land_tail(eng, vts, kv, types, w, shift_swa)
        eng.admit(str(i), p, first, NEW)
        eng.step()
    return drained(eng)


def test_sliding_window_tails_land_in_the_ring_and_decode_as_generate_does() -> None:
    """Window 8, page size 4 (two ring pages): prompts of 3 and 5 tokens (inside the window), 16 (past it, a
    whole number of pages), 9, 21 and 30 (past it, the last page partial: the tail's first and last sequence
    pages share a ring page, Note [Ring landing])."""
    print(f"seed {SEED}")
    model = gemma(8)
    ps = prompts()
    want = {i: stock(model, p) for i, p in enumerate(ps)}
    eng = engine(model)
    assert run_ring(model, eng, ps) == want
    assert max(eng.step_requests) > 1
    assert eng.cache.slots == {} and eng.cache.staged_rings == set()
    eng.close()


def test_a_tail_that_shares_a_ring_page_takes_one_staging_page_until_admitted() -> None:
    model = gemma(8)
    eng = engine(model)
    c = eng.cache
    assert c.ring_table is not None
    vts = eng.reserve_ends("a", 21)   # 21 = 5 pages + 1 token: tail pages 3, 4, 5 on 2 ring pages
    assert vts is not None and len(c.staged_rings) == 1
    assert c.ring_table.stats().live_requests == 2
    c.check_invariants()
    eng.release("a")
    assert c.staged_rings == set() and c.ring_table.stats().live_requests == 0 and c.slots == {}
    vts = eng.reserve_ends("b", 16)   # whole pages: no staging
    assert vts is not None and c.staged_rings == set()
    eng.close()


def test_a_tail_landed_one_page_early_changes_the_tokens() -> None:
    """Mutation: each swa page written with the previous sequence page's tokens: the prompts past the window
    decode otherwise (the engine reads the ring, not a recomputed prompt)."""
    model = gemma(8)
    ps = prompts()
    want = {i: stock(model, p) for i, p in enumerate(ps)}
    got = run_ring(model, engine(model), ps, shift_swa=True)
    past = [i for i, p in enumerate(ps) if len(p) > 8]
    assert sum(got[i][1:] != want[i][1:] for i in past) >= len(past) - 1


def test_a_window_not_a_multiple_of_the_page_size_takes_only_prompts_inside_it() -> None:
    """Window 6, page size 4: a prompt of up to 6 tokens lands (ring slot = position); a longer one is refused
    with a typed error naming why, nothing taken."""
    model = gemma(6)
    eng = engine(model)
    free = eng.cache.free_bytes()
    with pytest.raises(UnsupportedCacheError, match="not a multiple of page_size 4"):
        eng.reserve_ends("x", 9)
    assert eng.cache.slots == {} and eng.cache.free_bytes() == free
    eng.close()
    p = prompts()[4]   # 5 tokens
    eng = engine(model)
    assert run_ring(model, eng, [p]) == {0: stock(model, p)}
    eng.close()


def test_without_the_staging_copy_the_prompts_with_a_shared_ring_page_decode_otherwise(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Mutation: the staging page's rows never copied onto the ring page its tail shares (Note [Ring landing]):
    the prompts of 9, 21 and 30 tokens (past the window of 8 with a partial last page) read the ring's stale
    rows, so they decode otherwise; the others keep ``generate()``'s tokens."""
    from umalloc.integrations.transformers.groups import EndGroup

    model = gemma(8)
    ps = prompts()
    want = {i: stock(model, p) for i, p in enumerate(ps)}
    monkeypatch.setattr(EndGroup, "copy_rows", lambda self, src, dst: None)
    got = run_ring(model, engine(model), ps)
    staged = [i for i, p in enumerate(ps) if len(p) > 8 and len(p) % PAGE_SIZE]
    assert staged == [1, 3, 5]
    assert all(got[i] == want[i] for i in want if i not in staged)
    assert sum(got[i][1:] != want[i][1:] for i in staged) >= len(staged) - 1
