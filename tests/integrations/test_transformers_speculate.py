"""Greedy speculative decoding in the decode engine over the requests' pages in place
(:mod:`umalloc.integrations.transformers.speculate`: the verify forward, the truncation of rejected tokens, the
early-exit drafter over the cache's ``draft`` end).

Oracles, computed with transformers' stock ``generate()`` (DynamicCache, greedy) only: the tokens; and for every
round the drafts the target accepts, from the target's stock continuation and the drafter's own stock greedy
continuation of the same context. A scripted proposer (the stock continuation with one token spoiled at a chosen
place) fixes each round's acceptance in advance, so a verify that kept a rejected token's KV changes later
tokens. Seeded (``UMALLOC_TF_SEED``, printed).
"""

from __future__ import annotations

import copy
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_transformers_admit import NEW, build, engine, land, prefill, prompts  # noqa: E402

from umalloc import UmallocValueError  # noqa: E402
from umalloc.integrations.transformers import CacheOptions, UnsupportedCacheError  # noqa: E402
from umalloc.integrations.transformers.admit import reserved_pages  # noqa: E402
from umalloc.integrations.transformers.speculate import SpeculativeDecoder, truncate_requests  # noqa: E402

SEED = int(os.environ.get("UMALLOC_TF_SEED", "1234"))
LONG = 16   # tokens per request: several rounds each


def early_exit(model, layers: int = 1):  # type: ignore[no-untyped-def]
    """The target's first ``layers`` layers with its embedding, final norm and head."""
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = layers
    draft = type(model)(cfg).eval()
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    draft.load_state_dict(state, strict=True)
    draft.config._attn_implementation = "sdpa"
    return draft


def greedy(model, context: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    gcfg = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=n,
                                         min_new_tokens=n)
    with torch.no_grad():
        out = model.generate(torch.tensor([context]), generation_config=gcfg,
                             attention_mask=torch.ones(1, len(context), dtype=torch.long))
    return out[0, len(context):].tolist()


def expected_rounds(model, drafter, prompt: list[int], total: int, k: int) -> tuple[list[int], list[int]]:
    """(stock tokens, drafts accepted per round) of greedy speculative decoding, from stock generate() alone."""
    want = greedy(model, prompt, total)
    rounds, j = [], 1   # the first token is the prefill's
    while j < total:
        kk = min(k, total - j)
        props = greedy(drafter, prompt + want[:j], kk)
        n = 0
        while n < kk and props[n] == want[j + n]:
            n += 1
        rounds.append(n)
        j += n + 1
    return want, rounds


def land_draft(eng, vt, kv) -> None:  # type: ignore[no-untyped-def]
    c = eng.cache
    ps = c.page_size
    pp = c.alloc.translate_pages(torch.from_numpy(reserved_pages(vt, ps)), "draft")
    n = int(vt.numel())
    for i, (k, v) in enumerate(kv):
        kview, vview = c.arena.kv_views("draft", i)
        for x, view in ((k, kview), (v, vview)):
            buf = torch.zeros(pp.numel() * ps, x.shape[0], x.shape[2])
            buf[:n] = x.transpose(0, 1)
            view[pp] = buf.view(pp.numel(), ps, x.shape[0], x.shape[2])


def admit_all(eng, model, ps, drafter=None, total: int = LONG) -> None:  # type: ignore[no-untyped-def]
    for i, p in enumerate(ps):
        vt = eng.reserve(str(i), len(p))
        assert vt is not None
        first, kv = prefill(model, p)
        land(eng, vt, kv)
        if drafter is not None:
            land_draft(eng, vt, prefill(drafter, p)[1])
        eng.admit(str(i), p, first, total)


def drain(eng, spec) -> dict[int, list[int]]:  # type: ignore[no-untyped-def]
    while spec.step():
        for rid, st in eng.processor.scheduler.active_requests.items():   # rejected tokens' pages are gone
            held = eng.cache.held_tokens(rid)
            assert held == st.position_offset
            slot = eng.cache.slots[rid]
            assert eng.cache.table.pages(slot).numel() == -(-held // eng.cache.page_size)
    out = {}
    for rid, st in eng.finished():
        assert st.error is None
        out[int(rid)] = list(st.generated_tokens)
    return out


@pytest.mark.parametrize("name, layers, k", [("llama", 1, 3), ("qwen3", 1, 4), ("llama", 1, 1)])
def test_early_exit_in_place_equals_stock_tokens_and_rounds(name: str, layers: int, k: int) -> None:
    print(f"seed {SEED}")
    model = build(name)
    drafter = early_exit(model, layers)
    ps = prompts()
    want = {i: expected_rounds(model, drafter, p, LONG, k) for i, p in enumerate(ps)}
    eng = engine(model, num_blocks=128, draft_layers=layers, compact_every_step=True)
    admit_all(eng, model, ps, drafter)
    spec = SpeculativeDecoder(eng, k, drafter=copy.deepcopy(drafter))
    got = drain(eng, spec)
    assert got == {i: w[0] for i, w in want.items()}
    assert {int(r): rs for r, rs in spec.figures.per_round.items()} == {i: w[1] for i, w in want.items()}
    assert max(eng.step_requests) == len(ps)   # every request verified in one forward
    assert len(eng.cache.slots) == 0 and all(s.live_pages == 0 for s in eng.cache.alloc.stats().values())
    eng.close()


class Scripted:
    """Proposes the stock continuation, its ``(round + request) % (k + 1)``-th token spoiled (k + 1: none)."""

    def __init__(self, want: dict[str, list[int]], k: int) -> None:
        self.want, self.k = want, k
        self.pos = {r: 1 for r in want}
        self.rounds = {r: 0 for r in want}
        self.expect: dict[str, list[int]] = {r: [] for r in want}

    def propose(self, request_id: str, last: int, k: int) -> list[int]:
        j = self.pos[request_id]
        props = list(self.want[request_id][j: j + k])
        bad = (self.rounds[request_id] + int(request_id)) % (self.k + 1)
        if bad < len(props):
            props[bad] = (props[bad] + 1) % 512
        self.expect[request_id].append(min(bad, len(props)))
        return props

    def accepted(self, request_id: str, props: list[int], n_acc: int, emitted: list[int]) -> None:
        self.pos[request_id] += len(emitted)
        self.rounds[request_id] += 1


def test_rejected_drafts_leave_no_kv_behind() -> None:
    """Every round's acceptance is scripted; the tokens after a rejected draft equal stock's only if the
    rejected tokens' KV was truncated (a kept one would be attended to at the next round's positions)."""
    model = build("llama")
    ps = prompts()
    want = {str(i): greedy(model, p, LONG) for i, p in enumerate(ps)}
    eng = engine(model, num_blocks=128)
    admit_all(eng, model, ps)
    prop = Scripted(want, 3)
    spec = SpeculativeDecoder(eng, 3, proposer=prop)
    got = drain(eng, spec)
    assert got == {int(r): w for r, w in want.items()}
    assert spec.figures.per_round == prop.expect
    assert any(n == 3 for rs in prop.expect.values() for n in rs) and any(0 < n < 3 for rs in prop.expect.values()
                                                                          for n in rs)
    eng.close()


def test_truncate_frees_the_pages_past_the_kept_tokens_on_both_ends() -> None:
    model = build("llama")
    eng = engine(model, draft_layers=1)
    vt = eng.reserve("a", 9)   # 3 pages of 4 tokens on full, and on draft
    assert vt is not None
    stats = eng.cache.alloc.stats()
    assert stats["full"].live_pages == stats["draft"].live_pages == 3
    truncate_requests(eng.cache, ["a"], [4])
    stats = eng.cache.alloc.stats()
    assert stats["full"].live_pages == stats["draft"].live_pages == 1 and eng.cache.held_tokens("a") == 4
    eng.cache.check_invariants()
    with pytest.raises(UmallocValueError):
        truncate_requests(eng.cache, ["nobody"], [1])
    eng.close()


def test_bad_speculative_configurations_are_refused() -> None:
    model = build("llama")
    drafter = early_exit(model)
    eng = engine(model)
    with pytest.raises(UmallocValueError, match="draft_tokens"):
        SpeculativeDecoder(eng, 0, drafter=drafter)
    with pytest.raises(UmallocValueError, match="exactly one"):
        SpeculativeDecoder(eng, 2)
    with pytest.raises(UnsupportedCacheError, match="no draft end"):   # the cache has none
        SpeculativeDecoder(eng, 2, drafter=drafter)
    eng.close()
    with pytest.raises(UmallocValueError, match="draft_layers"):
        CacheOptions(draft_layers=-1)
    eng = engine(build("gemma3"), draft_layers=1)   # rings of a window: no speculative rounds
    with pytest.raises(UnsupportedCacheError, match="speculative_tokens >= 2"):
        SpeculativeDecoder(eng, 2, drafter=early_exit(build("gemma3")))
    eng.close()
    assert NEW >= 2
