"""Options, counters, errors and config reading of :mod:`umalloc.integrations.transformers.cache` (Note [Seams] there).

Nothing here imports transformers at module import; :func:`text_config_dims` imports its utils when called.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import torch

from umalloc import KVDtype, UmallocValueError
from umalloc.integrations.transformers.groups import FULL_ATTENTION, SLIDING_ATTENTION
from umalloc.integrations.versions import EngineVersionError

#: attention type -> arena end
END_OF = {FULL_ATTENTION: "full", SLIDING_ATTENTION: "swa"}
#: the allocator's compaction modes (:class:`~umalloc.allocator.facade.MultiEndedAllocator`)
COMPACTION_MODES = ("lazy", "eager", "off")
#: cache dtypes the arena holds
TORCH_TO_KV = {torch.float32: KVDtype.FP32, torch.float16: KVDtype.FP16, torch.bfloat16: KVDtype.BF16}


class UnsupportedTransformersVersion(EngineVersionError):
    """:func:`install` on a transformers version this integration was not tested against."""


class UnsupportedCacheError(UmallocValueError):
    """A model or continuous-batching config the umalloc cache cannot hold (layer and type, or option, named)."""


class RequestCannotFitError(UmallocValueError):
    """A request that could not complete even with the whole cache to itself: its prompt, or its prompt plus
    ``max_new_tokens`` when no end-of-sequence token can stop it early, exceeds what one request can hold. The
    request fails alone (its output carries this message); the others run on."""


@dataclass(frozen=True)
class CacheOptions:
    """How :class:`~umalloc.integrations.transformers.UmallocPagedCache` builds its arena.

    Attributes:
        arena_bytes: total arena bytes; ``None``: the bytes of transformers' own cache tensor for the same config.
        compaction: the allocator's mode, ``"lazy"`` (compact when an allocation falls short), ``"eager"`` (after
            every free) or ``"off"``.
        compact_every_step: compact every end at the step hook (Note [Seams] 3), to exercise moving pages.
        compact_budget_pages: most pages that forced compaction moves per end and step (``None``: unbounded), the
            lazy allocator's move budget applied between steps.
        check_every_step: run ``check_invariants`` (table and allocator) at the step hook.
        max_requests: request slots (``None``: ``min(owner pages, 1024)``).
        draft_layers: layers of an early-exit drafter whose KV the arena holds in a ``draft`` end bound to
            ``full`` (every page of a request on ``full`` has its page there, every token of every drafter layer,
            a sliding one's included; same heads and head dim as the model's); 0: no ``draft`` end. Models with
            full-attention layers only (the end is bound to ``full``).
        speculative_tokens: draft tokens ``k`` a speculative round verifies (what
            :class:`~umalloc.integrations.transformers.speculate.SpeculativeDecoder` needs): each sliding ring then
            has ``ring_tokens(window, page_size, k)`` slots, enough that a rejected draft never overwrites a
            position still inside the window after the round is rolled back (Note [Sliding ring] in
            :mod:`~umalloc.integrations.transformers.rings`); 0: rings of ``window`` slots, as transformers' own.

    Raises:
        UmallocValueError: a field of the wrong type or out of range, naming the field, the value and what is
            allowed (checked at construction; :func:`dataclasses.replace` checks again).
    """

    arena_bytes: int | None = None
    compaction: str = "lazy"
    compact_every_step: bool = False
    compact_budget_pages: int | None = None
    check_every_step: bool = False
    max_requests: int | None = None
    draft_layers: int = 0
    speculative_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("arena_bytes", "compact_budget_pages", "max_requests"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise UmallocValueError(f"CacheOptions.{name}={v!r}: allowed None or an int >= 1")
        for name in ("draft_layers", "speculative_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UmallocValueError(f"CacheOptions.{name}={v!r}: allowed an int >= 0")
        if self.compaction not in COMPACTION_MODES:
            raise UmallocValueError(f"CacheOptions.compaction={self.compaction!r}: allowed one of "
                                    f"{list(COMPACTION_MODES)}")
        for name in ("compact_every_step", "check_every_step"):
            v = getattr(self, name)
            if type(v) is not bool:
                raise UmallocValueError(f"CacheOptions.{name}={v!r}: allowed True or False")


@dataclass
class CacheCounters:
    """Cumulative counters of one :class:`~umalloc.integrations.transformers.UmallocPagedCache` (plain ints).

    Attributes:
        steps: step hooks seen. compactions / pages_moved: forced compactions and the pages they moved (the
        allocator's own eager / lazy moves are in ``alloc.stats()[end].pages_moved``). prefix_hits /
        prefix_hit_tokens: prompts that reused cached pages and the tokens reused. deduplicated_pages: completed
        pages replaced by an indexed page of the same content (Note [Seams] 7). evicted_pages: cached pages
        evicted (``on_evict``). refused_allocations: ``can_store_request_tokens`` answers ``False``. failed_alone:
        requests failed because they could never complete, with the children they were to fork into (Note
        [Cannot fit]). ring_pages_shared / ring_pages_copied: ring pages a prefix hit shared with its donor, or
        copied from it when the window is not whole pages; ring_cow_copies: shared ring pages copied at a ring's
        first write into them (Note [Shared rings] in :mod:`~umalloc.integrations.transformers.rings`).
        max_live_requests: most requests holding pages at once. memory_seconds: wall time inside this layer's
        scheduler-facing calls (allocation, index building and translation, freeing, hooks), measured with
        ``time.perf_counter``.
    """

    steps: int = 0
    compactions: int = 0
    pages_moved: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    deduplicated_pages: int = 0
    evicted_pages: int = 0
    refused_allocations: int = 0
    max_live_requests: int = 0
    failed_alone: int = 0
    forks: int = 0
    ring_pages_copied: int = 0
    ring_pages_shared: int = 0
    ring_cow_copies: int = 0
    memory_seconds: float = 0.0
    live_requests_sum: int = 0


class MemoryTimer:
    """Adds the wall time of a ``with`` block to ``counters.memory_seconds`` (``time.perf_counter``)."""

    __slots__ = ("counters", "t0")

    def __init__(self, counters: CacheCounters) -> None:
        self.counters = counters
        self.t0 = 0.0

    def __enter__(self) -> None:
        self.t0 = perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.counters.memory_seconds += perf_counter() - self.t0


def text_config_dims(config: Any, dtype: torch.dtype) -> tuple[int, int, dict[str, list[int]], int | None]:
    """``(num_kv_heads, head_dim, layers by attention type, sliding_window)`` of a text config; refuses what the
    arena cannot hold (Note [Seams] 8)."""
    if getattr(config, "kv_lora_rank", None) is not None:
        raise UnsupportedCacheError(f"layer 0 is multi-head latent attention (kv_lora_rank={config.kv_lora_rank}): "
                                    "transformers 5.25 caches its compressed latents; the umalloc cache holds "
                                    "per-head K/V of full_attention and sliding_attention layers only")
    utils = importlib.import_module("transformers.generation.continuous_batching.utils")
    num_kv_heads = int(utils.find_num_key_value_heads(config))
    head_dim = int(utils.find_head_dim(config))
    layer_types = getattr(config, "layer_types", None)
    sliding_window = getattr(config, "sliding_window", None)
    n = int(config.num_hidden_layers)
    if layer_types is None:
        layer_types = [SLIDING_ATTENTION if sliding_window is not None else FULL_ATTENTION] * n
    groups: dict[str, list[int]] = {}
    for i, lt in enumerate(layer_types):
        if lt not in END_OF:
            raise UnsupportedCacheError(f"layer {i} has attention type {lt!r}; the umalloc cache holds "
                                        f"{sorted(END_OF)}")
        groups.setdefault(lt, []).append(i)
    if SLIDING_ATTENTION in groups and (not isinstance(sliding_window, int) or sliding_window <= 0):
        raise UnsupportedCacheError(f"layer {groups[SLIDING_ATTENTION][0]} is {SLIDING_ATTENTION!r} with "
                                    f"sliding_window={sliding_window!r}; allowed a positive int")
    if dtype not in TORCH_TO_KV:
        raise UnsupportedCacheError(f"cache dtype {dtype}; allowed {sorted(map(str, TORCH_TO_KV))}")
    return num_kv_heads, head_dim, groups, sliding_window if SLIDING_ATTENTION in groups else None


__all__ = ["COMPACTION_MODES", "END_OF", "TORCH_TO_KV", "CacheCounters", "CacheOptions", "MemoryTimer", "RequestCannotFitError", "UnsupportedCacheError",
           "UnsupportedTransformersVersion", "text_config_dims"]
