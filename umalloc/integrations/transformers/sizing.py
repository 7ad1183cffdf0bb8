"""Sizes of :class:`~umalloc.integrations.transformers.UmallocPagedCache`: the bytes transformers' own cache tensor
would have for a config (for equal bytes), and the most tokens one request can hold alone in an arena (Note
[Cannot fit] in :mod:`umalloc.integrations.transformers.cache`).

Nothing here imports transformers at module import; :func:`stock_sizing` imports its cache module when called.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from umalloc import Arena
from umalloc.errors import UmallocValueError

#: what :func:`tokens_alone` answers for a request no length of which outgrows the arena (every layer slides and a
#: window's pages fit)
UNBOUNDED_TOKENS = 1 << 62


@dataclass(frozen=True)
class StockSizing:
    """transformers' own sizing of its paged cache (its sectors).

    Attributes:
        max_batch_tokens: tokens per forward transformers' memory handler chose.
        cache_bytes: bytes of transformers' cache tensor (its sectors plus its two trash sectors).
        bytes_per_sector: bytes of one sector (the lcm of every attention type's page bytes and 128).
        model_block_bytes: bytes of ``page_size`` tokens of every layer (transformers' whole-model block).
    """

    max_batch_tokens: int
    cache_bytes: int
    bytes_per_sector: int
    model_block_bytes: int


def stock_sizing(config: Any, cb: Any, dtype: torch.dtype, groups: dict[str, list[int]], num_kv_heads: int,
                 head_dim: int, model_supports_logits_to_keep: bool) -> StockSizing:
    """transformers' ``PagedAttentionMemoryHandler`` run on this config with its own sector geometry (``groups``:
    attention type -> layer indices; ``cb``: the continuous-batching config, whose ``num_blocks`` / memory share
    it reads). O(1) beyond transformers' own call."""
    cache_mod = importlib.import_module("transformers.generation.continuous_batching.cache")
    ps = int(cb.page_size)
    page_bytes = {lt: 2 * num_kv_heads * head_dim * dtype.itemsize * ps * len(ix) for lt, ix in groups.items()}
    bytes_per_sector = math.lcm(*page_bytes.values(), 128)
    tokens_per_sector = max(bytes_per_sector // pb * ps for pb in page_bytes.values())
    model_block_bytes = int(config.num_hidden_layers) * 2 * num_kv_heads * head_dim * dtype.itemsize * ps
    max_batch_tokens, num_sectors = cache_mod.PagedAttentionMemoryHandler(
        config=config, cb_config=cb, dtype=dtype, bytes_per_sector=bytes_per_sector,
        tokens_per_sector=tokens_per_sector, bytes_per_block=model_block_bytes, attn_types=list(groups),
        model_supports_logits_to_keep=model_supports_logits_to_keep,
    ).infer_max_batch_tokens_and_num_sectors()
    return StockSizing(int(max_batch_tokens), (num_sectors + 2) * bytes_per_sector, bytes_per_sector,
                       model_block_bytes)


def tokens_alone(arena: Arena, page_size: int, window: int | None) -> int:
    """The most tokens one request holds in ``arena`` when it is the only one (Note [Cannot fit]): ``full`` grows up
    from its first page, ``swa`` (its ring of ``window`` tokens: the ring's slots) or ``draft`` (a drafter's end
    bound to ``full``: one page per full page) down from its top page, and the two must not cross; with both, the
    ``draft`` pages lie between them. An arena without a ``full`` end (every layer slides): a request of any length
    holds one ring, so :data:`UNBOUNDED_TOKENS` once a ring's pages fit, else the ring's tokens. O(log pages)."""
    ps = page_size
    names = {e.name for e in arena.spec.ends}
    if "full" not in names:
        if window is None:
            raise UmallocValueError("an arena without a full end holds sliding layers: window is required")
        ring_tokens = (arena.top_page("swa") + 1 - arena.first_page("swa")) * ps
        return ring_tokens if ring_tokens < window else UNBOUNDED_TOKENS
    f0, fpb = arena.first_page("full"), arena.page_bytes("full")
    f_max = arena.top_page("full") + 1 - f0
    if window is None and "draft" not in names:
        return f_max * ps
    down = "swa" if window is not None else "draft"   # a drafter's end: one page per full page
    top, spb = arena.top_page(down) + 1, arena.page_bytes(down)
    dpb = arena.page_bytes("draft") if window is not None and "draft" in names else 0   # a draft end between

    def fits(full_pages: int) -> bool:
        ring = full_pages if window is None else -(-min(full_pages * ps, window) // ps)
        edge = (f0 + full_pages) * fpb
        if dpb:
            edge = (-(-edge // dpb) + full_pages) * dpb
        return edge <= (top - ring) * spb

    lo, hi = 0, f_max   # fits(lo) holds (an ArenaSpec holds the floor plus one page of each end)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * ps


def never_completes(state: Any, target: int, limit: int) -> int | None:
    """The tokens a transformers request ``state`` must hold that exceed ``limit`` (what it could hold alone), or
    None (Note [Cannot fit] in :mod:`umalloc.integrations.transformers.cache`): ``target`` now, its prompt, or, when
    no end-of-sequence token can stop it early, its prompt plus ``max_new_tokens - 1``. O(eos ids)."""
    prompt = len(state.initial_tokens)
    if max(target, prompt) > limit:
        return max(target, prompt)
    eos = state.eos_token_id
    can_stop = eos is not None and any(t >= 0 for t in ([eos] if isinstance(eos, int) else eos))
    new = state.max_new_tokens
    if new is not None and not can_stop and prompt + new - 1 > limit:
        return prompt + new - 1
    return None


__all__ = ["UNBOUNDED_TOKENS", "StockSizing", "never_completes", "stock_sizing", "tokens_alone"]
