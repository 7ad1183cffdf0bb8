"""The scheduler-facing capacity planning of SGLang 0.5.23's ``UnifiedSWATokenToKVPoolAllocator``, priced on
umalloc's state: how many tokens the radix cache must evict before a demand fits, whether a demand fits at all,
and the calls of SGLang's scheduler and prefill budget built on those two.

Each function takes the umalloc unified allocator (:mod:`umalloc.integrations.sglang.unified`) as its first
argument and is bound there as the method of the same name. Every fit is one call of the unified class's
``_fits`` (SGLang's page-demand rule, :func:`umalloc.integrations.sglang.capacity.fits_page_demand`, on umalloc's
end state), so the answers are SGLang's whenever the sizes are (the differential in tests/integrations compares
them op by op). What SGLang provides and umalloc only calls: the radix cache passed in (its ``evict_for_alloc``,
``full_evictable_size``/``swa_evictable_size``), the runtime context that decides the eviction preference
(``get_memory``/``get_disagg``), the SWA token estimate of a request (``estimate_swa_kv_tokens``) and the prefill
budget object (``SharedSWAPrefillBudget``); those are imported from SGLang when called.

Units: tokens unless a name says pages. Threading: the scheduler thread. Complexity: ``reclaim_plan`` is
O(log(live pages)) fits (two binary searches), each O(1); ``max_new_tokens_for_memory`` O(log max_new_tokens)
plans; the eviction itself is the radix cache's.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import Any


def _pages(tokens: int | float, page_size: int) -> int:
    return -(-math.ceil(tokens) // page_size)


def _least(high: int, ok: Callable[[int], bool]) -> int:
    """The least ``k`` in ``[0, high]`` with ``ok(k)``, ``ok`` monotone and ``ok(high)`` true. O(log high)."""
    return bisect.bisect_left(range(high), True, key=ok)


def reclaim_plan(alloc: Any, full_tokens: int | float, swa_tokens: int | float, *, full_evictable_tokens: int = 0,
                 swa_evictable_tokens: int = 0, empty_pool: bool = False,
                 prefer_swa: bool = False) -> tuple[int, int] | None:
    """The full and SWA tokens the radix cache must evict (cumulative, whole pages) before ``full_tokens`` full and
    ``swa_tokens`` SWA tokens fit; ``None`` when they do not fit even after evicting all that is evictable (or a
    demand is negative). ``(0, 0)``: fits now. ``empty_pool``: against the empty arena, no eviction.

    As SGLang's: an evictable count is capped at the end's live pages; in lazy mode the fit assumes a flush unless
    a move gate is closed (or a umalloc lease pins a page). The plan asks as little SWA eviction as possible with
    all evictable full pages reclaimed, then trims the full eviction; ``prefer_swa`` minimises full first.
    """
    if full_tokens < 0 or swa_tokens < 0:
        return None
    ps = alloc.page_size
    n_full, n_swa = _pages(full_tokens, ps), _pages(swa_tokens, ps)
    compacted = empty_pool or not alloc.lazy_compaction or not alloc.moves_blocked()

    def fits(full_reclaim_pages: int, swa_reclaim_pages: int) -> bool:
        return bool(alloc._fits(n_full, n_swa, compacted, full_reclaim_pages, swa_reclaim_pages, empty_pool))

    if fits(0, 0):
        return (0, 0)
    if empty_pool:
        return None
    top_full = min(alloc.live_pages("full"), max(0, int(full_evictable_tokens)) // ps)
    top_swa = min(alloc.live_pages("swa"), max(0, int(swa_evictable_tokens)) // ps)
    if not fits(top_full, top_swa):
        return None
    if prefer_swa:
        full_pages = _least(top_full, lambda k: fits(k, top_swa))
        swa_pages = _least(top_swa, lambda k: fits(full_pages, k))
    else:
        swa_pages = _least(top_swa, lambda k: fits(top_full, k))
        full_pages = _least(top_full, lambda k: fits(k, swa_pages))
    return (full_pages * ps, swa_pages * ps)


def can_reserve(alloc: Any, full_tokens: int | float, swa_tokens: int | float, *, full_evictable_tokens: int = 0,
                swa_evictable_tokens: int = 0, empty_pool: bool = False, require_token_slack: bool = False) -> bool:
    """Whether the demand fits after evicting at most the evictable tokens (:func:`reclaim_plan` is not None).
    ``require_token_slack``: also refuse a demand of at least ``size_full`` / ``size_swa`` tokens (SGLang's
    one-token slack at the empty-pool boundary). Negative demand: False."""
    if full_tokens < 0 or swa_tokens < 0:
        return False
    if require_token_slack and (full_tokens >= alloc.size_full or swa_tokens >= alloc.size_swa):
        return False
    return reclaim_plan(alloc, full_tokens, swa_tokens, full_evictable_tokens=full_evictable_tokens,
                        swa_evictable_tokens=swa_evictable_tokens, empty_pool=empty_pool) is not None


def prealloc_ceiling_fits(alloc: Any, full_tokens: int, swa_tokens: int) -> bool:
    """Whether the demand fits the empty arena (``can_reserve(..., empty_pool=True)``)."""
    return can_reserve(alloc, full_tokens, swa_tokens, empty_pool=True)


def prealloc_fits_assumes_reclaim(alloc: Any) -> bool:
    """True: :func:`prealloc_fits` already counts what the tree can evict (as SGLang's unified class)."""
    return True


def prealloc_fits(alloc: Any, tree_cache: Any, full_tokens: int, swa_tokens: int, *, full_budget_tokens: int,
                  swa_budget_tokens: int | None = None) -> bool:
    """Whether the demand fits the shared envelope given the scheduler's budget(s): the part of a budget the
    pool cannot hand out now (``available + evictable - budget``, may be negative) is added to that side's
    demand, then :func:`can_reserve` with the tree's evictable tokens. Reads ``tree_cache.full_evictable_size()``
    and ``swa_evictable_size()``."""
    full_evictable = tree_cache.full_evictable_size()
    swa_evictable = tree_cache.swa_evictable_size()
    full_tokens += alloc.full_available_size() + full_evictable - full_budget_tokens
    if swa_budget_tokens is not None:
        swa_tokens += alloc.swa_available_size() + swa_evictable - swa_budget_tokens
    return can_reserve(alloc, full_tokens, swa_tokens, full_evictable_tokens=full_evictable,
                       swa_evictable_tokens=swa_evictable)


def evict_to_free_tokens(alloc: Any, tree_cache: Any, num_tokens: int, *,
                         swa_num_tokens: int | None = None) -> bool | None:
    """Evict from ``tree_cache`` what :func:`reclaim_plan` asks so that ``num_tokens`` full and ``swa_num_tokens``
    (default ``num_tokens``) SWA tokens fit, then :meth:`ensure_capacity` (compacting in lazy mode if needed).

    Returns ``None`` without evicting when there is no tree or it shares no prefixes, or when no plan exists;
    otherwise whether the demand fits afterwards. A free group that holds frees is closed and reopened first (its
    pages count as free). Eviction prefers SWA (minimises full) with HiCache storage or in PD decode mode, read
    from SGLang's runtime context per call; the tree stops early once the plan is ``(0, 0)``.
    """
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.runtime_context import get_disagg, get_memory

    if tree_cache is None or not tree_cache.supports_prefix_sharing():
        return None
    memory = get_memory()
    prefer_swa = (memory.enable_hierarchical_cache and memory.hicache_storage_backend is not None) \
        or get_disagg().disaggregation_mode == "decode"
    swa_tokens = num_tokens if swa_num_tokens is None else swa_num_tokens
    groups = alloc._groups
    if groups is not None and any(groups):
        alloc.free_group_end()
        alloc.free_group_begin()
    plan = reclaim_plan(alloc, num_tokens, swa_tokens, full_evictable_tokens=tree_cache.full_evictable_size(),
                        swa_evictable_tokens=tree_cache.swa_evictable_size(), prefer_swa=prefer_swa)
    if plan is None:
        return None
    if plan != (0, 0):
        tree_cache.evict_for_alloc(EvictParams(num_tokens=plan[0], swa_num_tokens=plan[1]),
                                   allocation_reclaim_satisfied=lambda: reclaim_plan(
                                       alloc, num_tokens, swa_tokens) == (0, 0))
    return bool(alloc.ensure_capacity(num_tokens, swa_tokens))


def reclaim_for_prealloc(alloc: Any, tree_cache: Any, full_tokens: int, swa_tokens: int) -> str | None:
    """Make room for a pre-allocation: :func:`evict_to_free_tokens` (or, without a usable tree,
    :meth:`ensure_capacity`). Returns ``None`` when the demand fits, else a message naming the demand."""
    ready = evict_to_free_tokens(alloc, tree_cache, full_tokens, swa_num_tokens=swa_tokens)
    if ready is None:
        ready = alloc.ensure_capacity(full_tokens, swa_tokens)
    if ready:
        return None
    return f"umalloc unified full/SWA reclamation insufficient: needed=({full_tokens}, {swa_tokens}) tokens"


def max_new_tokens_for_memory(alloc: Any, input_tokens: int, max_new_tokens: int, *, token_capacity: int,
                              sliding_window_size: int | None, chunk_size: int | None) -> int | None:
    """The most new tokens (``<= max_new_tokens``) a request of ``input_tokens`` can decode in the empty arena:
    ``input + new + one page`` full tokens and SGLang's SWA estimate (``estimate_swa_kv_tokens`` with the window
    and ``chunk_size`` as the allocation limit), with the one-token slack. ``None`` when not even 0 fits.
    ``token_capacity`` is accepted and unused (as SGLang's unified class)."""
    from sglang.srt.mem_cache.prefill_budget import estimate_swa_kv_tokens

    ps = alloc.page_size

    def fits(new_tokens: int) -> bool:
        swa = estimate_swa_kv_tokens(input_tokens, new_tokens, sliding_window_size=sliding_window_size,
                                     page_size=ps, allocation_limit=chunk_size)
        return can_reserve(alloc, input_tokens + new_tokens + ps, swa, empty_pool=True, require_token_slack=True)

    if not fits(0):
        return None
    # the greatest k with fits(k): fits is monotone decreasing in k
    return max_new_tokens - bisect.bisect_left(range(max_new_tokens + 1), True,
                                               key=lambda i: fits(max_new_tokens - i))


def create_prefill_budget(alloc: Any, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> Any:
    """SGLang's ``SharedSWAPrefillBudget`` over this allocator and ``tree_cache`` (it admits prefills through
    :func:`can_reserve` and :func:`reclaim_for_prealloc`)."""
    from sglang.srt.mem_cache.prefill_budget import SharedSWAPrefillBudget

    return SharedSWAPrefillBudget(alloc, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)


__all__ = ["can_reserve", "create_prefill_budget", "evict_to_free_tokens", "max_new_tokens_for_memory",
           "prealloc_ceiling_fits", "prealloc_fits", "prealloc_fits_assumes_reclaim", "reclaim_for_prealloc",
           "reclaim_plan"]


def swa_capacity_and_available(alloc: Any, *, full_capacity: int,
                               swa_capacity: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((full capacity, full available), (SWA capacity, SWA available))`` in tokens, as SGLang's unified class
    reports them to its scheduler: the capacities are the current ones (available + live pages of each end), not
    the ``full_capacity`` / ``swa_capacity`` the caller passes (accepted for the signature, unused). O(1)."""
    del full_capacity, swa_capacity
    return ((alloc.current_full_capacity, alloc.full_available_size()),
            (alloc.current_swa_capacity, alloc.swa_available_size()))


def get_extend_allocation_demand(alloc: Any, prefix_lens_cpu: Any, seq_lens_cpu: Any, *,
                                 conservative_num_tokens: int, shard_size: int) -> int:
    """Tokens an extend batch allocates: ``page_size`` x the new pages (per request ``ceil(seq_len / page_size) -
    ceil(prefix_len / page_size)``, summed), or ``conservative_num_tokens`` when ``shard_size != 1`` (SGLang's
    rule). ``prefix_lens_cpu`` / ``seq_lens_cpu``: int CPU tensors of one length per request. O(requests)."""
    if shard_size != 1:
        return conservative_num_tokens
    ps = alloc.page_size
    after = (seq_lens_cpu + ps - 1) // ps
    before = (prefix_lens_cpu + ps - 1) // ps
    return int(ps * int((after - before).sum()))
