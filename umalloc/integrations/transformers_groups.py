"""One attention type of a transformers model on one end of the umalloc arena: the object transformers'
continuous-batching IO builder and attention read as a cache allocator (``cache.cache_allocators``; Note [Seams]
2 in :mod:`umalloc.integrations.transformers`).

* An :class:`EndGroup` holds per-layer K/V row views of the arena (Note [Rows] there) and turns a request's
  virtual tokens into rows through the allocator's translation; it owns no pages (the cache's request table
  does).
* ``SINK_ROW`` (page 0's first row) takes writes of padded lanes; ``SENTINEL_ROW`` marks, in a sliding read
  index, where this step's new states go.
"""

from __future__ import annotations

from typing import Protocol

import torch

from umalloc import Arena, MultiEndedAllocator, RequestTable

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
SENTINEL_ROW = 1
SINK_ROW = 0


class CacheParts(Protocol):
    """What an :class:`EndGroup` reads of its :class:`~umalloc.integrations.transformers.UmallocPagedCache`."""

    page_size: int
    allow_block_sharing: bool
    arena: Arena
    alloc: MultiEndedAllocator
    table: RequestTable
    dtype: torch.dtype
    slots: dict[str, int]

    def held_tokens(self, request_id: str) -> int: ...


def swa_peak_pages(window: int, page_size: int) -> int:
    """Most fresh sliding pages a long prefill grown page by page binds at once: the window's pages, the page
    being filled, one unbound page not yet drained, one shared partial page copied on write, one spare."""
    return -(-window // page_size) + 4


class EndGroup:
    """One attention type of the model on one end of the arena, with the attributes transformers reads from a
    cache allocator (Note [Seams] 2). Holds per-layer K/V row views of the arena (Note [Rows])."""

    supports_block_table = False

    def __init__(self, cache: CacheParts, index: int, layer_type: str, end: str, layer_indices: list[int],
                 num_kv_heads: int, head_dim: int, sliding_window: int | None) -> None:
        self._cache = cache
        self.index = index
        self.layer_type = layer_type
        self.end = end
        self.layer_indices = list(layer_indices)
        self.tokens_per_page = cache.page_size
        self.sliding_window = sliding_window
        self.use_block_sharing = layer_type == FULL_ATTENTION and cache.allow_block_sharing
        self.rows_per_page = 2 * cache.page_size * len(layer_indices)
        self.write_trash_index = SINK_ROW
        self.sentinel_index = SENTINEL_ROW
        arena = cache.arena
        self.bytes_per_block = arena.page_bytes(end)
        self.num_blocks = arena.top_page(end) + 1 - arena.first_page(end)
        row_elems = num_kv_heads * head_dim
        flat = arena.data.view(cache.dtype)
        num_rows = flat.numel() // row_elems
        flat = flat[: num_rows * row_elems].view(num_rows, num_kv_heads, head_dim)
        ps = cache.page_size
        self._views = {layer: (flat[2 * i * ps:], flat[(2 * i + 1) * ps:]) for i, layer in enumerate(layer_indices)}

    # ---- transformers' allocator attributes -----------------------------------------------------------------
    @property
    def read_trash_index(self) -> int:
        """Row of the table's zero page on this end (padded reads); recomputed each step (Note [Seams] 4)."""
        return int(self.rows(torch.tensor([self._cache.table.pad_read_vtoken], dtype=torch.int64))[0])

    @property
    def block_table(self) -> dict[str, list[int]]:
        """request id -> its virtual pages (read-only copy)."""
        c = self._cache
        return {rid: c.table.pages(slot).tolist() for rid, slot in c.slots.items()}

    def get_seqlen_k(self, past_length: int, query_length: int) -> int:
        if self.sliding_window is None:
            return past_length + query_length
        return query_length + min(past_length, self.sliding_window - 1)

    def needs_new_blocks(self, request_id: str, past_length: int, query_length: int) -> int:
        """Pages this end needs for ``query_length`` more tokens (every new page is bound on every end)."""
        held = self._cache.held_tokens(request_id)
        ps = self.tokens_per_page
        pages = max(0, -(-(past_length + query_length) // ps) - -(-held // ps))
        if self.sliding_window is not None and query_length > 2 * self.sliding_window:
            pages = min(pages, swa_peak_pages(self.sliding_window, ps))   # Note [Long prefills]
        return pages

    # ---- rows -------------------------------------------------------------------------------------------
    def rows(self, vtokens: torch.Tensor) -> torch.Tensor:
        """``int64`` rows (Note [Rows]) of virtual tokens ``vtokens`` on this end. Raises ``TombstoneError`` for a
        token whose page is not bound here."""
        pt = self._cache.alloc.translate(vtokens, self.end)
        assert isinstance(pt, torch.Tensor)
        ps = self.tokens_per_page
        return (pt // ps) * self.rows_per_page + pt % ps

    def read_rows(self, slot: int, past_length: int, query_length: int) -> list[int]:
        r2t = self._cache.table.req_to_token
        if self.sliding_window is None:
            return self.rows(r2t[slot, : past_length + query_length].to(torch.int64)).tolist()
        lo = max(0, past_length - (self.sliding_window - 1))
        return self.rows(r2t[slot, lo:past_length].to(torch.int64)).tolist() + [SENTINEL_ROW] * query_length

    def write_rows(self, slot: int, past_length: int, query_length: int) -> list[int]:
        """Rows this step writes. A sliding end may have unbound the pages of a long prefill's early tokens
        (Note [Long prefills]): their writes go to the sink, as no later step reads them."""
        vt = self._cache.table.req_to_token[slot, past_length: past_length + query_length].to(torch.int64)
        if self.sliding_window is None:
            return self.rows(vt).tolist()
        pt = self._cache.alloc.translate(vt, self.end, strict=False)
        assert isinstance(pt, torch.Tensor)
        ps = self.tokens_per_page
        return ((pt // ps) * self.rows_per_page + pt % ps).tolist()

    # ---- attention update ---------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               read_index: torch.Tensor, write_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's K/V (``[q, kv_heads, head_dim]``) at ``write_index`` rows and return the K/V attention
        reads (``[len(read_index), kv_heads, head_dim]``). Full attention writes then reads; sliding attention reads
        the cached tail first, puts the new states at the sentinel rows, then writes (its reads never include this
        step's rows)."""
        k_rows, v_rows = self._views[layer_idx]
        if self.sliding_window is None or read_index.numel() == 0:
            k_rows.index_copy_(0, write_index, key_states)
            v_rows.index_copy_(0, write_index, value_states)
            if read_index.numel() == 0:
                return key_states, value_states
            return k_rows.index_select(0, read_index), v_rows.index_select(0, read_index)
        new = (read_index == SENTINEL_ROW).view(-1, 1, 1)
        k_out = k_rows.index_select(0, read_index)
        v_out = v_rows.index_select(0, read_index)
        k_out.masked_scatter_(new, key_states)
        v_out.masked_scatter_(new, value_states)
        k_rows.index_copy_(0, write_index, key_states)
        v_rows.index_copy_(0, write_index, value_states)
        return k_out, v_out


__all__ = ["FULL_ATTENTION", "SENTINEL_ROW", "SINK_ROW", "SLIDING_ATTENTION", "CacheParts", "EndGroup", "swa_peak_pages"]
