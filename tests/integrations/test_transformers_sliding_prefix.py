"""Prefix sharing on models with sliding-window layers (Note [Sliding prefix] in
``umalloc.integrations.transformers.prefix``): stock transformers shares no prefix there and recomputes it, so stock
``generate_batch`` on the same model, prompts and config is the oracle; umalloc must give identical tokens while
its hits skip the prefix's forward, share its full-attention pages and copy the donor's ring pages.

Runs where transformers is installed (the peer venv of ``scripts/peer_suite_transformers.sh``); the model is a
seeded random-weight Gemma-3-style config built in code (no hub). Each result is also appended to
``$UMALLOC_TF_REPORT`` when set, for the script's summary.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from umalloc.integrations import transformers as ut  # noqa: E402
from umalloc.integrations.transformers.prefix import ring_donor  # noqa: E402

SEED = int(os.environ.get("UMALLOC_TF_SEED", "2468"))
VOCAB = 512
PAGE_SIZE = 8


def gemma(window: int) -> Any:
    """A tiny seeded random-weight Gemma-3-style model (sliding, full, sliding) in float32 with sdpa."""
    cfg = transformers.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2, num_hidden_layers=3, head_dim=16,
                                        sliding_window=window,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    torch.manual_seed(SEED)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    model.config._attn_implementation = "sdpa"
    return model


def chat_prompts(system_tokens: int, num: int) -> list[list[int]]:
    """``num`` prompts: one shared system prompt of ``system_tokens`` tokens, then a user turn of 3-12 tokens."""
    g = torch.Generator().manual_seed(SEED)
    system = torch.randint(3, VOCAB, (system_tokens,), generator=g).tolist()
    return [system + torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
            for n in torch.randint(3, 13, (num,), generator=g)]


def cb_config(**kw: Any) -> Any:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    base = dict(page_size=PAGE_SIZE, num_blocks=128, max_batch_tokens=40, use_async_batching=False,
                auto_switch_to_flash=False, max_memory_percent=0.9, allow_block_sharing=True)
    base.update(kw)
    return ContinuousBatchingConfig(**base)


def gen(max_new_tokens: int = 8) -> Any:
    return transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                         pad_token_id=0)


def tokens(model: Any, prompts: list[list[int]], **cb: Any) -> dict[str, list[int]]:
    out = model.generate_batch(prompts, generation_config=gen(), continuous_batching_config=cb_config(**cb),
                               progress_bar=False)
    return {rid: list(o.generated_tokens) for rid, o in out.items()}


def report(name: str, scenario: str, same: bool, detail: str) -> None:
    path = os.environ.get("UMALLOC_TF_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(f"{name:8s} {scenario:16s} {'identical' if same else 'DIFFER'}  {detail}\n")


@pytest.mark.parametrize(("window", "system_tokens"), [(48, 24), (40, 32), (12, 24)])
def test_sliding_prefix_shared_tokens_identical(window: int, system_tokens: int) -> None:
    """A shared system prompt within the window (hits, shared full-attention pages, copied ring pages) and one
    longer than the window (hits only from a donor holding exactly the prefix): tokens identical to stock, which
    recomputes every prefix; the invariants hold at every step."""
    print(f"seed={SEED}")
    model = gemma(window)
    prompts = chat_prompts(system_tokens, 8)
    stock = tokens(model, prompts)
    # the user turns steer the tokens: most requests differ, so a wrong prefix or ring would show
    assert len({tuple(row) for row in stock.values()}) > len(stock) // 2, "degenerate model output"
    with ut.installed(ut.CacheOptions(check_every_step=True), keep_caches=True) as inst:
        got = tokens(model, prompts)
    (cache,) = inst.caches
    c = cache.counters
    assert cache.use_prefix_sharing and not cache.cache_freed
    detail = (f"prefix_hits={c.prefix_hits} hit_tokens={c.prefix_hit_tokens} ring_pages_shared="
              f"{c.ring_pages_shared} ring_pages_copied={c.ring_pages_copied} ring_cow_copies={c.ring_cow_copies}"
              f" dedup={c.deduplicated_pages}")
    report(f"gemma3-w{window}", f"prefix-sys{system_tokens}", got == stock, detail)
    assert got == stock, detail
    if system_tokens <= window:
        assert c.prefix_hits > 0 and c.prefix_hit_tokens >= c.prefix_hits * PAGE_SIZE, detail
        # every hit shared its ring (window in whole pages) or copied it: min(hit, window) tokens in whole pages
        given = c.ring_pages_shared if window % PAGE_SIZE == 0 else c.ring_pages_copied
        assert given == c.prefix_hit_tokens // PAGE_SIZE, detail
        assert (c.ring_pages_copied if window % PAGE_SIZE == 0 else c.ring_pages_shared) == 0, detail


def test_a_donor_ring_written_after_the_hit_leaves_the_sharer_unaffected(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the first hit, right after the request got its copy of the donor's ring, the donor's ring pages are
    overwritten with noise (standing for any later write into those slots): the donor's own tokens change, the
    sharer's stay stock's, so the sharer reads no byte of the donor's ring."""
    print(f"seed={SEED}")
    model = gemma(48)
    prompts = chat_prompts(24, 8)
    stock = tokens(model, prompts)
    inner = ut.UmallocPagedCache._copy_ring_prefix
    seen: list[tuple[int, int]] = []

    def copy_then_overwrite(cache: Any, slot: int, donor: int, num_tokens: int) -> bool:
        ok = inner(cache, slot, donor, num_tokens)
        if ok and not seen:
            seen.append((slot, donor))
            g = torch.Generator().manual_seed(SEED)
            for vp in cache.ring_table.pages(cache.ring_slots[donor]).tolist():
                page = cache.arena.envelope("swa", int(cache.alloc.translate_pages(torch.tensor([vp]), "swa")[0]))
                page.view(torch.float32).copy_(torch.randn(page.numel() // 4, generator=g) * 50)
        return ok

    monkeypatch.setattr(ut.UmallocPagedCache, "_copy_ring_prefix", copy_then_overwrite)
    named: list[tuple[str, str]] = []   # (sharer, donor) request ids of the first hit, named when it happens
    inner_search = ut.UmallocPagedCache.search_prefix_match

    def search(cache: Any, request_id: str, prompt_ids: list[int]) -> int:
        got = inner_search(cache, request_id, prompt_ids)
        if seen and not named:
            by_slot = {s: r for r, s in cache.slots.items()}
            named.append((by_slot[seen[0][0]], by_slot[seen[0][1]]))
        return got

    monkeypatch.setattr(ut.UmallocPagedCache, "search_prefix_match", search)
    with ut.installed(ut.CacheOptions(check_every_step=True), keep_caches=True):
        got = tokens(model, prompts)
    assert seen, "no prefix hit: the test could not fail"
    ((sharer, donor),) = named
    assert got[donor] != stock[donor], "the overwrite changed nothing the donor reads: the test could not fail"
    assert got[sharer] == stock[sharer]


def test_ring_donor_gives_only_what_its_ring_still_holds() -> None:
    """The donor rule (Note [Sliding prefix]), against positions computed by hand: window 16, pages of 4; a
    holder of at most a window gives every matched page it holds; a longer one only its exact prefix."""
    matched = [7, 8, 9, 10, 11, 12]   # 24 tokens: longer than the window
    # (slot, held, pages): 12 tokens held, first 3 pages match -> 12 tokens; 16 held, 4 pages -> 16
    assert ring_donor(matched, [(0, 12, [7, 8, 9]), (1, 16, [7, 8, 9, 10])], 16, 4) == (1, 4)
    # 17 held: its ring rewrote slot 0 (position 16), so it holds neither 12 nor 16 tokens of the prefix
    assert ring_donor(matched, [(0, 17, [7, 8, 9, 10, 13])], 16, 4) == (-1, 0)
    # exactly the 24-token prefix held: its ring holds positions 8..23, the window before token 24
    assert ring_donor(matched, [(2, 24, matched)], 16, 4) == (2, 6)
    # a holder whose pages differ at page 1 gives page 0 only
    assert ring_donor(matched, [(3, 10, [7, 99, 9])], 16, 4) == (3, 1)
