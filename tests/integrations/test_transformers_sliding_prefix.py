"""Prefix sharing on models with sliding-window layers (Note [Sliding prefix] in
``umalloc.integrations.transformers.prefix``): stock transformers shares no prefix there and recomputes it, so stock
``generate_batch`` on the same model, prompts and config is the oracle; umalloc must give identical tokens while
its hits skip the prefix's forward, share its full-attention pages and share the donor's ring pages copy-on-write
(Note [Shared rings] in ``umalloc.integrations.transformers.rings``), or copy them when the window is not whole
pages.

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
from umalloc.integrations.transformers.rings import RingPages  # noqa: E402

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


def tokens(model: Any, prompts: list[list[int]], max_new_tokens: int = 8, **cb: Any) -> dict[str, list[int]]:
    out = model.generate_batch(prompts, generation_config=gen(max_new_tokens), continuous_batching_config=cb_config(**cb),
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


WRAP_WINDOW = 32   # 4 pages; the prompts (16 + 3..12 tokens) fit in it, their generations of 40 tokens pass it


def wrap_run(monkeypatch: pytest.MonkeyPatch, on_copy: Any = None) -> tuple[Any, dict[str, list[int]],
                                                                           dict[str, list[int]], list[Any]]:
    """Stock and umalloc on a shared 16-token system prompt whose requests generate past the window: returns
    ``(cache, stock tokens, umalloc tokens, copies)``, ``copies`` one record per copy-on-write (request id, ring,
    past, end, page indices, their pages before, their holder counts before). ``on_copy(cache, ring, indices)``
    runs right after each copy."""
    model = gemma(WRAP_WINDOW)
    prompts = chat_prompts(16, 8)
    stock = tokens(model, prompts, max_new_tokens=40)
    assert len({tuple(row) for row in stock.values()}) > len(stock) // 2, "degenerate model output"
    current: list[Any] = [None, None]   # (the cache, the request id) of the growth being decided
    copies: list[Any] = []
    inner_store = ut.UmallocPagedCache.can_store_request_tokens
    inner_plan, inner_copy = RingPages.plan_copies, RingPages.copy_on_write

    def store(cache: Any, state: Any, request_len: int, dry_run: bool = False) -> bool:
        current[:] = [cache, state.request_id]
        try:
            return inner_store(cache, state, request_len, dry_run)
        finally:
            current[:] = [None, None]

    def plan(rings: Any, ring: int, past: int, end: int) -> list[int]:
        out = inner_plan(rings, ring, past, end)
        if out and current[1] is not None:   # the growth's plan, not the offloading manager's sizing
            pages = rings.table.pages(ring)[out]
            copies.append((current[1], ring, past, end, out, pages.tolist(), rings.table.holder_counts(pages).tolist()))
        return out

    def copy(rings: Any, ring: int, indices: list[int]) -> Any:
        done = inner_copy(rings, ring, indices)
        if done and on_copy is not None:
            on_copy(current[0], ring, indices)
        return done

    monkeypatch.setattr(ut.UmallocPagedCache, "can_store_request_tokens", store)
    monkeypatch.setattr(RingPages, "plan_copies", plan)
    monkeypatch.setattr(RingPages, "copy_on_write", copy)
    with ut.installed(ut.CacheOptions(check_every_step=True), keep_caches=True) as inst:
        got = tokens(model, prompts, max_new_tokens=40)
    (cache,) = inst.caches
    return cache, stock, got, copies


def test_shared_ring_pages_copied_at_the_first_write_past_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hits share the donor's ring pages (none copied); a ring gets a private copy of a shared page exactly when
    its sequence wraps onto it: every copied page index is the page of a slot ``t % window`` written at a position
    ``t >= window``, and was held by another ring then; tokens identical to stock; nothing held after the work."""
    print(f"seed={SEED}")
    cache, stock, got, copies = wrap_run(monkeypatch)
    c = cache.counters
    detail = (f"hits={c.prefix_hits} shared={c.ring_pages_shared} copied={c.ring_pages_copied} "
              f"cow={c.ring_cow_copies}")
    report(f"gemma3-w{WRAP_WINDOW}", "ring-cow-wrap", got == stock, detail)
    assert got == stock, detail
    assert c.prefix_hits > 0 and c.ring_pages_shared > 0 and c.ring_pages_copied == 0, detail
    assert copies and c.ring_cow_copies == sum(len(rec[4]) for rec in copies), detail
    w = WRAP_WINDOW
    for _, _, past, end, indices, _, counts in copies:
        wrapped = {(t % w) // PAGE_SIZE for t in range(max(past, end - w), end) if t >= w}
        assert set(indices) <= wrapped, (past, end, indices)
        assert all(n > 1 for n in counts), counts
    # the work is over: every ring and full-attention page was given back
    assert cache.ring_table.stats().held_pages == 0 and cache.ring_table.stats().live_requests == 0
    assert cache.table.stats().held_pages == 0 and not cache.slots and not cache.rings.shared


def test_a_write_into_a_copied_ring_page_never_reaches_the_other_sharers(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the first copy-on-write, the writer's private copies are overwritten with noise (standing for any write
    into them): the writer's tokens change, every other request's (those still holding the shared pages included)
    stay stock's, so no other ring reads the writer's copy."""
    print(f"seed={SEED}")
    noised: list[tuple[int, list[int]]] = []

    def noise(cache: Any, ring: int, indices: list[int]) -> None:
        if noised:
            return
        vps = cache.ring_table.pages(ring)[indices]
        noised.append((ring, vps.tolist()))
        g = torch.Generator().manual_seed(SEED)
        for vp in vps.tolist():
            assert int(cache.ring_table.holder_counts([vp])[0]) == 1   # the copy is the writer's alone
            page = cache.arena.envelope("swa", int(cache.alloc.translate_pages(torch.tensor([vp]), "swa")[0]))
            page.view(torch.float32).copy_(torch.randn(page.numel() // 4, generator=g) * 50)

    cache, stock, got, copies = wrap_run(monkeypatch, noise)
    assert noised, "no copy-on-write: the test could not fail"
    writer, _, _, _, _, old_pages, counts = copies[0]
    assert all(n > 1 for n in counts), "the copied pages had no other holder: the test could not fail"
    assert got[writer] != stock[writer], "the noise changed nothing the writer reads: the test could not fail"
    assert {r: t for r, t in got.items() if r != writer} == {r: t for r, t in stock.items() if r != writer}


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
