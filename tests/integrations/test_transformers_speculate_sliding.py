"""Speculative rounds in place on models with sliding-window layers
(:mod:`umalloc.integrations.transformers.speculate` over rings of ``ring_tokens`` slots, Note [Sliding ring] in
:mod:`umalloc.integrations.transformers.rings`).

Oracles, from transformers' stock ``generate()`` and forwards over its ``DynamicCache`` only: the tokens; each
round's accepted drafts (the drafter's own stock greedy continuation against the target's); and, after every
round, the K/V of every position inside the window, read from the ring's bytes in the arena and compared with a
stock forward over the same context. A scripted proposer spoils drafts at chosen places, so rounds reject drafts
and roll back. Prompts run past the window; windows that are and are not whole pages; ``k`` up to past the
window. Seeded (``UMALLOC_TF_SEED``, printed).
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_transformers_admit import SEED, VOCAB, drained, land_tail, prefill_all  # noqa: E402
from test_transformers_speculate import Scripted, expected_rounds, greedy  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

from umalloc import UmallocValueError  # noqa: E402
from umalloc.integrations.transformers import CacheOptions, UnsupportedCacheError  # noqa: E402
from umalloc.integrations.transformers.admit import DecodeEngine, reserved_pages  # noqa: E402
from umalloc.integrations.transformers.rings import ring_tokens  # noqa: E402
from umalloc.integrations.transformers.speculate import SpeculativeDecoder  # noqa: E402

S, F = "sliding_attention", "full_attention"
TOTAL = 14   # tokens per request: several rounds each


def model_of(types: list[str], window: int):  # type: ignore[no-untyped-def]
    """A tiny random Gemma-3 (``types`` per layer, sliding window ``window``), or a Mistral whose every layer
    slides when ``types`` has no full layer."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    if F not in types:
        cfg = transformers.MistralConfig(num_hidden_layers=len(types), sliding_window=window, **common)
        model = transformers.MistralForCausalLM(cfg).eval()
    else:
        cfg = transformers.Gemma3TextConfig(num_hidden_layers=len(types), sliding_window=window,
                                            layer_types=list(types), **common)
        model = transformers.Gemma3ForCausalLM(cfg).eval()
    model.config._attn_implementation = "sdpa"
    return model


def early_exit(model, layers: int):  # type: ignore[no-untyped-def]
    """The target's first ``layers`` layers (each of its type) with its embedding, final norm and head."""
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = cfg.layer_types[:layers]
    draft = type(model)(cfg).eval()
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    draft.load_state_dict(state, strict=True)
    draft.config._attn_implementation = "sdpa"
    return draft


def prompts(window: int) -> list[list[int]]:
    """Prompts inside the window, at it, and past it (whole pages and not)."""
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, window, window + 1, 2 * window + 5, 30)]


def engine(model, page_size: int, k: int, **opts):  # type: ignore[no-untyped-def]
    gcfg = transformers.GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=TOTAL)
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=256, max_batch_tokens=64, use_async_batching=False,
                                  auto_switch_to_flash=False, allow_block_sharing=False, max_memory_percent=0.9)
    return DecodeEngine(copy.deepcopy(model), gcfg, cb,
                        CacheOptions(check_every_step=True, speculative_tokens=k, **opts))


def admit_all(eng: DecodeEngine, model, ps: list[list[int]], drafter=None) -> None:  # type: ignore[no-untyped-def]
    """Reserve, land what a transfer plan lands (the target's window tail in its rings, the drafter's every token
    in the ``draft`` end) and admit every prompt."""
    c = eng.cache
    types = list(getattr(model.config, "layer_types", None) or [S] * model.config.num_hidden_layers)
    for i, p in enumerate(ps):
        vts = eng.reserve_ends(str(i), len(p))
        assert vts is not None
        first, kv = prefill_all(model, p)
        land_tail(eng, vts, kv, types, int(model.config.sliding_window))
        if drafter is not None:
            pp = c.alloc.translate_pages(torch.from_numpy(reserved_pages(vts["full"], c.page_size)), "draft")
            for j, (dk, dv) in enumerate(prefill_all(drafter, p)[1]):
                for x, view in zip((dk, dv), c.arena.kv_views("draft", j), strict=True):
                    buf = torch.zeros(pp.numel() * c.page_size, x.shape[0], x.shape[2])
                    buf[: len(p)] = x.transpose(0, 1)
                    view[pp] = buf.view(pp.numel(), c.page_size, x.shape[0], x.shape[2])
        eng.admit(str(i), p, first, TOTAL)


def window_matches_stock(eng: DecodeEngine, model, ps: list[list[int]]) -> int:  # type: ignore[no-untyped-def]
    """Compare, for every running request, the K and V of every position inside the window (the ``window - 1``
    before its next token) in its ring's bytes with a stock forward over its context; returns the positions
    compared. Fails on the first that differs."""
    c = eng.cache
    w, r, ps_ = c.window, c.ring_tokens, c.page_size
    rt = c.ring_table if c.ring_table is not None else c.table
    sliding = [i for i, t in enumerate(getattr(model.config, "layer_types", None) or
                                       [S] * model.config.num_hidden_layers) if t == S]
    seen = 0
    for rid, st in eng.processor.scheduler.active_requests.items():
        past = st.position_offset
        context = (ps[int(rid)] + st.generated_tokens)[:past]
        _, kv = prefill_all(model, context)
        ring = c.ring_slots.get(c.slots[rid], c.slots[rid])
        vpages = rt.pages(ring)
        for t in range(max(0, past - (w - 1)), past):
            vt = int(vpages[(t % r) // ps_]) * ps_ + (t % r) % ps_
            pt = int(c.alloc.translate(torch.tensor([vt]), "swa")[0])
            for idx, layer in enumerate(sliding):
                kview, vview = c.arena.kv_views("swa", idx)
                for got, x in ((kview, kv[layer][0]), (vview, kv[layer][1])):
                    torch.testing.assert_close(got[pt // ps_, pt % ps_], x[:, t], rtol=1e-4, atol=1e-4,
                                               msg=lambda m, t=t, rid=rid: f"request {rid} position {t}: {m}")
            seen += 1
    return seen


def drain_checked(eng: DecodeEngine, spec: SpeculativeDecoder, model, ps: list[list[int]]) -> tuple[dict, int]:  # type: ignore[no-untyped-def]
    seen = 0
    while spec.step():
        seen += window_matches_stock(eng, model, ps)
    return drained(eng), seen


@pytest.mark.parametrize("types, drafter_layers, window, page_size, k", [
    ([S, F, S], 2, 8, 4, 3),    # a drafter of a sliding and a full layer; window whole pages
    ([S, F, S], 1, 6, 4, 4),    # a sliding-only drafter; window not whole pages
    ([S, F, S, S], 3, 5, 8, 11),   # k past the window
])
def test_early_exit_on_a_sliding_model_equals_stock_tokens_and_rounds(types, drafter_layers, window, page_size,
                                                                     k) -> None:  # type: ignore[no-untyped-def]
    print(f"seed {SEED}: layers {types}, window {window}, page size {page_size}, k {k}")
    model = model_of(types, window)
    drafter = early_exit(model, drafter_layers)
    ps = prompts(window)
    want = {i: expected_rounds(model, drafter, p, TOTAL, k) for i, p in enumerate(ps)}
    eng = engine(model, page_size, k, draft_layers=drafter_layers, compact_every_step=True)
    assert eng.cache.ring_tokens == ring_tokens(window, page_size, k) >= window + k
    admit_all(eng, model, ps, drafter)
    spec = SpeculativeDecoder(eng, k, drafter=copy.deepcopy(drafter))
    got, seen = drain_checked(eng, spec, model, ps)
    assert got == {i: w[0] for i, w in want.items()}
    assert {int(r): rs for r, rs in spec.figures.per_round.items()} == {i: w[1] for i, w in want.items()}
    assert spec.figures.proposed > spec.figures.accepted   # some drafts were rejected and rolled back
    assert seen > 0 and max(eng.step_requests) == len(ps)
    assert eng.cache.slots == {} and all(s.live_pages == 0 for s in eng.cache.alloc.stats().values())
    eng.close()


@pytest.mark.parametrize("types, window, page_size, k", [
    ([S, F], 8, 4, 3), ([S, F], 7, 4, 2), ([S, S], 8, 4, 3), ([S, S], 6, 4, 9), ([F, S, S], 5, 16, 4),
    ([S, F], 6, 4, 2),   # a ring of 8: the 17-token prompt's tail spans 3 pages, its first and last staged
    ([S, F], 3, 32, 1),
    ([S, F], 8, 4, 20)])   # 5 requests' rounds of 14 tokens: more than one forward's 64, some sit a round out
def test_rejected_drafts_never_overwrite_a_position_inside_the_window(types, window, page_size, k) -> None:  # type: ignore[no-untyped-def]
    """Scripted rounds (drafts spoiled at chosen places, all accepted in some rounds): after every round the
    ring's bytes of every position inside the window equal a stock forward's, and the tokens equal stock's."""
    print(f"seed {SEED}: layers {types}, window {window}, page size {page_size}, k {k}")
    model = model_of(types, window)
    ps = prompts(window)
    want = {str(i): greedy(model, p, TOTAL) for i, p in enumerate(ps)}
    eng = engine(model, page_size, k, compact_every_step=True)
    admit_all(eng, model, ps)
    prop = Scripted(want, k)
    spec = SpeculativeDecoder(eng, k, proposer=prop)
    got, seen = drain_checked(eng, spec, model, ps)
    assert got == {int(r): w for r, w in want.items()}
    assert spec.figures.per_round == prop.expect and seen > 0
    assert any(0 <= n < min(k, 2) for rs in prop.expect.values() for n in rs)   # rounds rejected drafts
    eng.close()


class FirstSpoiled(Scripted):
    """Proposes the stock continuation with its first token spoiled: every round rejects every draft."""

    def __init__(self, want: dict[str, list[int]]) -> None:
        super().__init__(want, 0)

    def propose(self, request_id: str, last: int, k: int) -> list[int]:
        j = self.pos[request_id]
        props = list(self.want[request_id][j: j + k])
        return [(props[0] + 1) % VOCAB, *props[1:]] if props else []


def test_a_ring_too_small_for_the_round_loses_window_positions() -> None:
    """Mutation: a cache built for rounds of 1 draft runs rounds of 6 (past the check at construction): a
    rejected draft overwrites a position still inside the window, and the ring-bytes check sees it."""
    model = model_of([S, F], 8)
    ps = prompts(8)
    want = {str(i): greedy(model, p, TOTAL) for i, p in enumerate(ps)}
    eng = engine(model, 4, 1)
    admit_all(eng, model, ps)
    spec = SpeculativeDecoder(eng, 1, proposer=FirstSpoiled(want))
    spec.draft_tokens = 6
    with pytest.raises(AssertionError):
        drain_checked(eng, spec, model, ps)
    eng.close()


def test_the_stock_step_over_rings_built_for_speculation_equals_generate() -> None:
    """Rings of ``ring_tokens`` slots (more than the window) under transformers' own one-token steps."""
    model = model_of([S, F], 6)
    ps = prompts(6)
    want = {i: greedy(model, p, TOTAL) for i, p in enumerate(ps)}
    eng = engine(model, 4, 5)
    assert eng.cache.ring_tokens == 12
    admit_all(eng, model, ps)
    assert drained(eng) == want
    eng.close()


def test_speculation_on_sliding_layers_needs_rings_built_for_its_rounds() -> None:
    model = model_of([S, F], 8)
    eng = engine(model, 4, 2)
    with pytest.raises(UnsupportedCacheError, match="speculative_tokens >= 3"):
        SpeculativeDecoder(eng, 3, proposer=Scripted({}, 3))
    SpeculativeDecoder(eng, 2, proposer=Scripted({}, 2))
    eng.close()
    with pytest.raises(UmallocValueError, match="speculative_tokens"):
        CacheOptions(speculative_tokens=-1)
    with pytest.raises(UnsupportedCacheError, match="draft_layers"):
        engine(model_of([S, S], 8), 4, 2, draft_layers=1)


def test_a_tail_one_page_past_a_speculative_ring_takes_a_staging_page() -> None:
    """Window 6, page size 4, rounds of 2: a ring of 8 slots (2 pages); a 17-token prompt's tail spans sequence
    pages 2 to 4, and pages 2 and 4 share ring page 0 (Note [Ring landing]); the 12-token one's fits."""
    eng = engine(model_of([S, F], 6), 4, 2)
    c = eng.cache
    assert c.ring_tokens == 8
    assert eng.reserve_ends("a", 17) is not None and len(c.staged_rings) == 1
    assert eng.reserve_ends("b", 12) is not None and len(c.staged_rings) == 1
    c.check_invariants()
    eng.release("a")
    eng.release("b")
    assert c.staged_rings == set() and c.slots == {}
    eng.close()
