"""The SGLang-facing allocator classes: SGLang's ``BaseTokenToKVPoolAllocator`` interface over umalloc pools.

They subclass SGLang's abstract base (its scheduler hooks -- ``create_prefill_budget``, ``check_decode_capacity``,
``evict_to_free_tokens``, ``free_segments``... -- are written against ``available_size`` and ``free``, which these
classes implement), so importing this module imports SGLang's allocator base. All pool state lives in
:class:`~umalloc.integrations.sglang.pools.SlotPool` objects (at page size 1, in the token class,
:class:`~umalloc.integrations.sglang.tokens.TokenSlotPool`; composition); the methods here translate SGLang's
call shapes.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

import umalloc.integrations.sglang.hostcopy as hostcopy
from umalloc.errors import UmallocValueError
from umalloc.integrations.sglang.pools import SlotPool
from umalloc.integrations.sglang.tokens import TokenSlotPool


def _check_aligned(start_pos: int, page_size: int) -> None:
    if start_pos % page_size:
        raise UmallocValueError(f"free_segment: start_pos={start_pos} is not page-aligned; allowed a multiple "
                                f"of page_size={page_size}")


class _PoolBacked(BaseTokenToKVPoolAllocator):  # type: ignore[misc]
    """Shared by the token and paged classes: one :class:`SlotPool` in :attr:`pool`."""

    pool: SlotPool | TokenSlotPool
    num_pages: int
    free_group: list[torch.Tensor] | None

    def _new_pool(self) -> SlotPool | TokenSlotPool:
        return SlotPool(self.num_pages, self.page_size, self.device)

    def _make_pool(self) -> None:
        old = getattr(self, "pool", None)
        if old is not None and old.num_pages == self.num_pages:
            old.clear()
        else:
            self.pool = self._new_pool()
        self.free_group = None

    @property
    def allocator(self) -> Any:
        """The umalloc :class:`~umalloc.MultiEndedAllocator` holding the ids (``None`` for the page-size-1
        token class, whose :class:`TokenSlotPool` is index vectors only)."""
        return self.pool.allocator

    def clear(self) -> None:
        """Every slot free, no free group open."""
        self._make_pool()

    def available_size(self) -> int:
        """Free tokens (free pages times ``page_size``). O(1)."""
        return self.pool.available_tokens()

    def get_all_free_pages(self) -> torch.Tensor:
        """Free pages ascending (token ids at ``page_size`` 1), on the CPU. O(pages)."""
        return self.pool.free_page_ids()

    def merge_and_sort_free(self) -> None:
        """Nothing to merge: umalloc's free pages are always taken lowest first."""

    def free(self, free_index: torch.Tensor) -> None:
        """Free the pages holding ``free_index`` (deferred inside a free group); typed errors for misuse
        (:meth:`SlotPool.free_tokens`)."""
        self.pool.free_tokens(free_index)

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        """Free exactly these pages (deferred inside a free group)."""
        self.pool.free_pages(page_ids)

    def free_group_begin(self) -> None:
        """Defer frees until :meth:`free_group_end` (no nesting: UmallocValueError)."""
        self.pool.begin_group()
        self.free_group = []  # SGLang's "a group is open" flag; the pool holds the deferred ids

    def free_group_end(self) -> None:
        """Free the group in one umalloc call (:meth:`SlotPool.end_group`)."""
        self.free_group = None
        self.pool.end_group()

    get_cpu_copy = hostcopy.get_cpu_copy
    load_cpu_copy = hostcopy.load_cpu_copy

    def check_invariants(self) -> None:
        """umalloc's invariants and physical slot ids (:meth:`SlotPool.check_invariants`)."""
        self.pool.check_invariants()

class UmallocTokenToKVPoolAllocator(_PoolBacked):
    """SGLang's ``TokenToKVPoolAllocator`` (``page_size`` 1): same constructor, ``alloc``/``free`` over
    umalloc's index-vector pool (:class:`~umalloc.integrations.sglang.tokens.TokenSlotPool`: no per-page
    tables, misuse refused with typed errors). ``alloc_extend``/``alloc_decode`` raise
    ``NotImplementedError``, as SGLang's.

    Args: as SGLang's: ``size`` (tokens, slots ``1 .. size``), ``dtype``, ``device``, ``kvcache`` (used by
    ``get_cpu_copy``/``load_cpu_copy`` only), ``need_sort`` (accepted; slots are handed out in SGLang's order
    without it: ``1 .. size``, then freed slots oldest first).
    """

    def __init__(self, size: int, dtype: torch.dtype, device: str, kvcache: Any, need_sort: bool) -> None:
        super().__init__(size, 1, dtype, device, kvcache, need_sort)
        self.num_pages = size
        self.clear()

    def _new_pool(self) -> SlotPool | TokenSlotPool:
        return TokenSlotPool(self.num_pages, self.device)

    def _make_pool(self) -> None:
        """:meth:`_PoolBacked._make_pool`, then ``alloc`` and ``free`` bound to the pool's own methods on this
        instance (the per-request paths: one call frame, not two; same arguments, results and errors). The pool
        has ``size`` slots: SGLang's ``resize`` sets ``size`` only at page size 1, then calls ``clear``."""
        self.num_pages = self.size
        super()._make_pool()
        self.alloc = self.pool.alloc_tokens  # type: ignore[method-assign]
        self.free = self.pool.free_tokens    # type: ignore[method-assign]

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` free slots, or ``None`` (nothing changed) if fewer are free. O(1): a view of the pool's
        write-once log (:class:`TokenSlotPool`)."""
        return self.pool.alloc_tokens(need_size)

class UmallocPagedTokenToKVPoolAllocator(_PoolBacked):
    """SGLang's ``PagedTokenToKVPoolAllocator``: same constructor and methods over umalloc.

    Args: as SGLang's: ``size`` (tokens; ``size // page_size`` pages ``1 ..``), ``page_size``, ``dtype``,
    ``device``, ``kvcache``, ``need_sort``.
    """

    debug_mode = False  # SGLang's SWA composite reads it on its sub-allocators
    pool: SlotPool

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: str, kvcache: Any,
                 need_sort: bool) -> None:
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)
        self.num_pages = size // page_size
        self.clear()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size // page_size`` whole pages as slot ids, or ``None`` (nothing changed)."""
        return self.pool.alloc_tokens(need_size)

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                     seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int,
                     num_new_pages: int | None = None) -> torch.Tensor | None:
        """SGLang's ``alloc_extend``: tokens ``[prefix_len, seq_len)`` per request; ``None`` if the new pages
        do not fit. ``num_new_pages`` (SGLang's precomputed count) is not needed: umalloc counts itself."""
        del prefix_lens, seq_lens, num_new_pages
        return self.pool.alloc_extend(prefix_lens_cpu, seq_lens_cpu, last_loc, extend_num_tokens)

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor) -> torch.Tensor | None:
        """SGLang's ``alloc_decode``: one token per request; ``None`` if the new pages do not fit."""
        del seq_lens
        return self.pool.alloc_decode(seq_lens_cpu, last_loc)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Free ``kv_row[start_pos : start_pos + n]`` of one request: pages ``[start_pos // ps, ceil(end /
        ps))``. Raises UmallocValueError if ``start_pos`` is not page-aligned."""
        if free_index.numel() == 0:
            return
        _check_aligned(start_pos, self.page_size)
        self.pool.free_pages(free_index[:: self.page_size] // self.page_size)


__all__ = ["UmallocPagedTokenToKVPoolAllocator", "UmallocTokenToKVPoolAllocator"]
