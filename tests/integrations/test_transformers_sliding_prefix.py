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
    detail = (f"prefix_hits={c.prefix_hits} hit_tokens={c.prefix_hit_tokens} ring_pages_copied={c.ring_pages_copied}"
              f" dedup={c.deduplicated_pages}")
    report(f"gemma3-w{window}", f"prefix-sys{system_tokens}", got == stock, detail)
    assert got == stock, detail
    if system_tokens <= window:
        assert c.prefix_hits > 0 and c.prefix_hit_tokens >= c.prefix_hits * PAGE_SIZE, detail
        # every hit copied its ring: min(hit, window) tokens in whole pages
        assert c.ring_pages_copied == c.prefix_hit_tokens // PAGE_SIZE, detail
