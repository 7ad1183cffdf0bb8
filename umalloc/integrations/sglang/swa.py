"""SGLang's ``SWATokenToKVPoolAllocator`` over umalloc: a full pool and a sliding-window (SWA) pool, each a
umalloc-backed token/paged allocator, tied by SGLang's token-level ``full -> swa`` index mapping.

Policy (SGLang 0.5.23's semantics, with the differences listed):

* **Two pools, two capacities**: ``size`` full tokens and ``size_swa`` SWA tokens in separate KV buffers, as
  SGLang's class (the shared-arena design is :mod:`umalloc.integrations.sglang.unified`'s). Every allocation takes
  the same page count from both pools; ``available_size`` is the smaller side.
* **The mapping** ``full_to_swa_index_mapping`` (int64 ``(size + page_size + 1,)``, last entry ``-1`` so a
  ``last_loc`` of ``-1`` maps to ``-1``) is registered with the KV pool (``kvcache.register_mapping``), which the
  attention kernels read; entry 0 means "no SWA peer".
* **Frees**: ``free`` frees both sides; ``free_swa``/``free_swa_segment`` only the SWA peers (out-of-window
  tokens; the mapping entries of their whole full pages are cleared); ``free_full``/``free_full_segment`` only
  the full side of tokens whose SWA peers are gone. Inside a free group the SWA peers are resolved (and the
  mapping cleared) at the call, their free deferred to ``free_group_end``, as SGLang.
* **Differences**: a refused ``alloc_decode`` changes nothing on either pool (SGLang runs both pools' decode and
  keeps the side that succeeded when the other refuses); ``free_full`` of a token whose SWA peer is still mapped,
  a segment free of a token with no SWA peer, and the misuse :mod:`umalloc.integrations.sglang.pools` lists raise
  a typed error (SGLang's invariant checks log or assert); the per-request SWA ring (``swa_req_ring_size``) is not
  supported (UmallocValueError at construction).

Threading: one scheduler thread. Complexity: each call O(tokens) torch work plus one umalloc call per pool.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

import umalloc.integrations.sglang.hostcopy as hostcopy
from umalloc.errors import InvalidIdError, UmallocValueError
from umalloc.integrations.sglang.classes import (
    UmallocPagedTokenToKVPoolAllocator,
    UmallocTokenToKVPoolAllocator,
)


class UmallocSWATokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):  # type: ignore[misc]
    """SGLang's ``SWATokenToKVPoolAllocator`` (module docstring): same constructor and methods.

    Args: as SGLang's: ``size`` (full tokens), ``size_swa`` (SWA tokens), ``page_size``, ``dtype``,
    ``device``, ``kvcache`` (a ``BaseSWAKVPool``: ``full_kv_pool``, ``swa_kv_pool``, ``register_mapping``),
    ``need_sort``, ``req_to_token_pool`` (accepted; used by SGLang's SWA ring only).

    Raises:
        UmallocValueError: ``kvcache.swa_req_ring_size`` is set (the per-request ring is not supported).
    """

    _swa_req_ring = False
    _swa_ring_cost = 0

    def __init__(self, size: int, size_swa: int, page_size: int, dtype: torch.dtype, device: str,
                 kvcache: Any, need_sort: bool, req_to_token_pool: Any = None) -> None:
        if getattr(kvcache, "swa_req_ring_size", None) is not None:
            raise UmallocValueError(f"kvcache.swa_req_ring_size={kvcache.swa_req_ring_size}: the per-request "
                                    f"SWA ring is not supported by umalloc.integrations.sglang; allowed None")
        self._size_full = size
        self._size_swa = size_swa
        self.dtype = dtype
        self.device = device
        self.page_size = page_size
        self.need_sort = need_sort
        full_kv = getattr(kvcache, "full_kv_pool", None)
        swa_kv = getattr(kvcache, "swa_kv_pool", None)
        if page_size == 1:
            self.full_attn_allocator = UmallocTokenToKVPoolAllocator(size, dtype, device, full_kv, need_sort)
            self.swa_attn_allocator = UmallocTokenToKVPoolAllocator(size_swa, dtype, device, swa_kv, need_sort)
        else:
            self.full_attn_allocator = UmallocPagedTokenToKVPoolAllocator(size, page_size, dtype, device, full_kv,
                                                                          need_sort)
            self.swa_attn_allocator = UmallocPagedTokenToKVPoolAllocator(size_swa, page_size, dtype, device, swa_kv,
                                                                         need_sort)
        self.full_to_swa_index_mapping = torch.cat(
            [torch.zeros(size + page_size, dtype=torch.int64, device=device),
             torch.tensor([-1], dtype=torch.int64, device=device)])
        self.free_pages = None
        self.release_pages = None
        self.free_group: list[torch.Tensor] | None = None
        self._kvcache = kvcache
        self._req_to_token_pool = req_to_token_pool
        self.clear()
        if kvcache is not None:
            kvcache.register_mapping(self.full_to_swa_index_mapping)

    # ---- sizes -----------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return min(self._size_full, self._size_swa)

    @property
    def size_full(self) -> int:
        return self._size_full

    @property
    def size_swa(self) -> int:
        return self._size_swa

    @property
    def swa_req_ring(self) -> bool:
        return False

    @property
    def swa_ring_cost_tokens(self) -> int:
        return 0

    def available_size(self) -> int:
        """Tokens both pools can take: the smaller side. O(1)."""
        return min(self.full_attn_allocator.available_size(), self.swa_attn_allocator.available_size())

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    def _conserve_full_available_size(self) -> int:
        return self.full_available_size()

    def _conserve_swa_available_size(self) -> int:
        return self.swa_available_size()

    def new_pages_available(self, num_full_pages: int, num_swa_pages: int) -> bool:
        ps = self.page_size
        return (num_full_pages <= self.full_attn_allocator.available_size() // ps
                and num_swa_pages <= self.swa_attn_allocator.available_size() // ps)

    def swa_capacity_and_available(self, *, full_capacity: int, swa_capacity: int) -> tuple[Any, Any]:
        return (full_capacity, self.full_available_size()), (swa_capacity, self.swa_available_size())

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> Any:
        from sglang.srt.mem_cache.prefill_budget import SWAPrefillBudget

        return SWAPrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def reclaim_for_prealloc(self, tree_cache: Any, full_tokens: int, swa_tokens: int) -> str | None:
        """SGLang's rule: evict SWA cache until ``swa_tokens`` fit; a shortfall description, or None."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        available = self.swa_available_size()
        if available < swa_tokens:
            tree_cache.evict_for_alloc(EvictParams(swa_num_tokens=swa_tokens - available))
            available = self.swa_available_size()
        if available < swa_tokens:
            return f"SWA eviction insufficient: needed={swa_tokens}, available={available}"
        return None

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return
        full_short = max(0, num_tokens - self.full_available_size())
        swa_short = max(0, num_tokens - self.swa_available_size())
        if full_short or swa_short:
            tree_cache.evict_for_alloc(EvictParams(num_tokens=full_short, swa_num_tokens=swa_short))

    def debug_print(self) -> str:
        return (f"#swa-available-size: {self.swa_available_size()}, "
                f"#full-attn-available-size: {self.full_available_size()}, ")

    def get_kvcache(self) -> Any:
        return self._kvcache

    # ---- the mapping -----------------------------------------------------------------------------------
    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """SWA slot of each full slot (0: none; ``-1`` -> ``-1``). A gather, O(n)."""
        return self.full_to_swa_index_mapping[kv_indices]

    def translate_swa_indices_for_transfer(self, kv_indices: torch.Tensor) -> torch.Tensor:
        return self.translate_loc_from_full_to_swa(kv_indices)

    def set_full_to_swa_mapping(self, full_indices: torch.Tensor, swa_indices: torch.Tensor) -> None:
        if full_indices.numel() == 0:
            return
        if full_indices.numel() != swa_indices.numel():
            raise InvalidIdError(f"set_full_to_swa_mapping: {full_indices.numel()} full vs "
                                 f"{swa_indices.numel()} SWA indices; allowed equal counts")
        self.full_to_swa_index_mapping[full_indices.to(torch.int64)] = swa_indices.to(torch.int64)

    def clear_full_to_swa_mapping(self, full_indices: torch.Tensor) -> None:
        if full_indices.numel():
            self.full_to_swa_index_mapping.index_fill_(0, full_indices.to(torch.int64), 0)

    def _expand_to_full_pages(self, indices: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        base_ids = (indices // ps) * ps
        return (base_ids[:, None] + torch.arange(ps, dtype=indices.dtype, device=indices.device)).reshape(-1)

    # ---- allocation ------------------------------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``page_size`` 1 only (SGLang's rule): ``need_size`` slots on both pools, mapped. ``None`` if
        either pool is short (nothing changed)."""
        if self.page_size != 1:
            raise UmallocValueError(f"alloc: page_size={self.page_size}; allowed at page_size 1 only "
                                    f"(alloc_extend/alloc_decode otherwise), as SGLang's SWA allocator")
        if need_size > self.full_attn_allocator.available_size() or \
                need_size > self.swa_attn_allocator.available_size():
            return None
        full = self.full_attn_allocator.alloc(need_size)
        swa = self.swa_attn_allocator.alloc(need_size)
        assert full is not None and swa is not None, "both sides had need_size free"
        self.set_full_to_swa_mapping(full, swa)
        return full

    def _new_pages(self, prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor) -> int:
        ps = self.page_size
        return int(((seq_lens_cpu + ps - 1) // ps - (prefix_lens_cpu + ps - 1) // ps).sum())

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                     seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor,
                     extend_num_tokens: int) -> torch.Tensor | None:
        """SGLang's ``alloc_extend`` on both pools (SWA ``last_loc`` through the mapping); ``None`` if either
        pool lacks the new pages (nothing changed)."""
        n = self._new_pages(prefix_lens_cpu, seq_lens_cpu)
        if not self.new_pages_available(n, n):
            return None
        swa_last = self.translate_loc_from_full_to_swa(last_loc)
        full = self.full_attn_allocator.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                                                     last_loc, extend_num_tokens)
        swa = self.swa_attn_allocator.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                                                   swa_last, extend_num_tokens)
        self.set_full_to_swa_mapping(full, swa)
        return full

    def alloc_extend_swa_tail(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor,
                              seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor,
                              extend_num_tokens: int, swa_tail_len: int) -> torch.Tensor | None:
        """Full KV for the whole extend, SWA KV for the last ``swa_tail_len`` tokens only (one request)."""
        if len(seq_lens_cpu) != 1 or len(prefix_lens_cpu) != 1:
            raise InvalidIdError("alloc_extend_swa_tail: allowed one request (SGLang's rule)")
        if not 0 <= swa_tail_len <= extend_num_tokens:
            raise InvalidIdError(f"alloc_extend_swa_tail: swa_tail_len={swa_tail_len}; allowed "
                                 f"[0, {extend_num_tokens}]")
        ps = self.page_size
        n_full = self._new_pages(prefix_lens_cpu, seq_lens_cpu)
        n_swa = (swa_tail_len + ps - 1) // ps
        if not self.new_pages_available(n_full, n_swa):
            return None
        full = self.full_attn_allocator.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                                                     last_loc, extend_num_tokens)
        if swa_tail_len == 0:
            return full
        zero, tail = torch.zeros(1, dtype=torch.int64), torch.tensor([swa_tail_len], dtype=torch.int64)
        swa = self.swa_attn_allocator.alloc_extend(zero, zero, tail, tail, torch.tensor([-1]), swa_tail_len)
        self.set_full_to_swa_mapping(full[-swa_tail_len:], swa)
        if swa_tail_len < extend_num_tokens:
            self.clear_full_to_swa_mapping(full[:-swa_tail_len])
        return full

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor) -> torch.Tensor | None:
        """SGLang's ``alloc_decode`` on both pools; ``None`` (nothing changed on either) if either is short."""
        ps = self.page_size
        n = int(((seq_lens_cpu - 1) % ps == 0).sum())
        if not self.new_pages_available(n, n):
            return None
        swa_last = self.translate_loc_from_full_to_swa(last_loc)
        full = self.full_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        swa = self.swa_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, swa_last)
        self.full_to_swa_index_mapping[full] = swa
        return full

    # ---- frees -----------------------------------------------------------------------------------------
    def free(self, free_index: torch.Tensor) -> None:
        """Both sides of these tokens' pages: SWA peers first (they read the mapping), then full."""
        if free_index.numel() == 0:
            return
        self.free_swa(free_index)
        self.free_full(free_index)

    def free_swa(self, free_index: torch.Tensor) -> None:
        """Free the SWA peers of ``free_index`` (entries without a peer are skipped) and clear their mapping.
        The SWA pool releases a page when none of its slots is live (as the full pool does)."""
        if free_index.numel() == 0:
            return
        full = free_index.to(torch.int64)
        swa = self.full_to_swa_index_mapping[full]
        swa = swa[swa > 0]
        self.swa_attn_allocator.free(swa)
        self.clear_full_to_swa_mapping(full)

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Free the SWA pages of ``kv_row[start_pos : start_pos + n]`` (page-aligned start; every page
        must still have its SWA peer) and clear their mapping.

        Raises:
            UmallocValueError: ``start_pos`` not page-aligned. InvalidIdError: a page without an SWA peer
            (nothing changed).
        """
        if free_index.numel() == 0:
            return
        ps = self.page_size
        if start_pos % ps:
            raise UmallocValueError(f"free_swa_segment: start_pos={start_pos} is not page-aligned; allowed "
                                    f"a multiple of page_size={ps}")
        reps = free_index[::ps]
        swa = self.full_to_swa_index_mapping[reps]
        if bool((swa <= 0).any()):
            bad = reps[swa <= 0][:4].tolist()
            raise InvalidIdError(f"free_swa_segment: full slots {bad} have no SWA peer (already freed?); "
                                 f"allowed slots with a live SWA peer (free_full for the rest)")
        self.swa_attn_allocator.free_page_ids(swa // ps)
        self.clear_full_to_swa_mapping(self._expand_to_full_pages(reps) if ps > 1 else reps)

    def _check_no_peer(self, free_index: torch.Tensor, where: str) -> None:
        peers = self.full_to_swa_index_mapping[free_index]
        if bool((peers != 0).any()):
            bad = free_index[peers != 0][:4].tolist()
            raise InvalidIdError(f"{where}: full slots {bad} still have an SWA peer; allowed slots whose SWA "
                                 f"peer is freed (free for both sides)")

    def free_full(self, free_index: torch.Tensor) -> None:
        """The full side of tokens whose SWA peers are freed.

        Raises:
            InvalidIdError: a token still has an SWA peer (nothing changed).
        """
        if free_index.numel() == 0:
            return
        self._check_no_peer(free_index, "free_full")
        self.full_attn_allocator.free(free_index)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Both sides of ``kv_row[start_pos : start_pos + n]`` (page-aligned start)."""
        if free_index.numel() == 0:
            return
        self.free_swa_segment(free_index, start_pos=start_pos)
        self.full_attn_allocator.free_segment(free_index, start_pos=start_pos)

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """The full side of a kv-row segment whose SWA peers are freed."""
        if free_index.numel() == 0:
            return
        self._check_no_peer(free_index, "free_full_segment")
        self.full_attn_allocator.free_segment(free_index, start_pos=start_pos)

    def free_group_begin(self) -> None:
        """Defer both pools' frees until :meth:`free_group_end` (SWA peers resolved at each call)."""
        if self.free_group is not None:
            raise UmallocValueError("free_group_begin: a free group is already open; allowed: no nesting")
        self.full_attn_allocator.free_group_begin()
        self.swa_attn_allocator.free_group_begin()
        self.free_group = []

    def free_group_end(self) -> None:
        """End the group: the SWA pool's deferred frees, then the full pool's."""
        if self.free_group is None:
            raise UmallocValueError("free_group_end: no free group is open; allowed after free_group_begin")
        self.free_group = None
        self.swa_attn_allocator.free_group_end()
        self.full_attn_allocator.free_group_end()

    # ---- lifecycle -------------------------------------------------------------------------------------
    def clear(self) -> None:
        self.swa_attn_allocator.clear()
        self.full_attn_allocator.clear()
        self.full_to_swa_index_mapping[:-1].fill_(0)
        self.free_group = None

    def resize(self, config: Any) -> None:
        """SGLang's resize: new ``full_max_total_num_tokens``/``swa_max_total_num_tokens``, then clear (the
        mapping keeps its length: a larger full size is refused)."""
        size_full = int(config.full_max_total_num_tokens)
        if size_full + self.page_size + 1 > self.full_to_swa_index_mapping.numel():
            raise UmallocValueError(f"resize: full_max_total_num_tokens={size_full}; allowed at most "
                                    f"{self.full_to_swa_index_mapping.numel() - self.page_size - 1} (the "
                                    f"mapping registered with the KV pool keeps its length)")
        size_swa = int(config.swa_max_total_num_tokens)
        self._size_full, self._size_swa = size_full, size_swa
        for alloc, sz in ((self.full_attn_allocator, size_full), (self.swa_attn_allocator, size_swa)):
            alloc.size = sz
            alloc.num_pages = sz // self.page_size
        self.clear()

    get_cpu_copy = hostcopy.get_cpu_copy
    load_cpu_copy = hostcopy.load_cpu_copy

    def check_invariants(self) -> None:
        """Both pools' invariants, plus: every mapped full slot is live on the full side and its SWA slot
        live on the SWA side, at the same page offset, one full page to one SWA page.

        Raises:
            InvariantError: the first broken one.
        """
        from umalloc.errors import InvariantError

        self.full_attn_allocator.check_invariants()
        self.swa_attn_allocator.check_invariants()
        m = self.full_to_swa_index_mapping[:-1]
        full = torch.nonzero(m > 0).reshape(-1)
        swa = m[full]
        ps = self.page_size
        if not torch.equal(full % ps, swa % ps):
            raise InvariantError("swa mapping: a full slot and its SWA peer at different page offsets")
        pairs = torch.unique(torch.stack([full // ps, swa // ps], 1), dim=0)
        if torch.unique(pairs[:, 0]).numel() != pairs.shape[0] or \
                torch.unique(pairs[:, 1]).numel() != pairs.shape[0]:
            raise InvariantError("swa mapping: full pages and SWA pages are not one to one")
        for side, pages in ((self.full_attn_allocator, pairs[:, 0]), (self.swa_attn_allocator, pairs[:, 1])):
            free = side.pool.free_page_ids()
            if bool(torch.isin(pages, free).any()):
                raise InvariantError("swa mapping: a mapped page is free on its pool")


__all__ = ["UmallocSWATokenToKVPoolAllocator"]
