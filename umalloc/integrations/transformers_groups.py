"""One attention type of a transformers model on one end of the umalloc arena: the object transformers'
continuous-batching IO builder and attention read as a cache allocator (``cache.cache_allocators``; Note [Seams]
2 in :mod:`umalloc.integrations.transformers`).

* An :class:`EndGroup` holds per-layer K/V row views of the arena (Note [Rows] there) and turns a request's
  virtual tokens into rows through the allocator's translation; it owns no pages (the cache's request table
  does).
* The read / write indices transformers collects per request (``extend_read_and_write_indices``) and pads with
  ``read_trash_index`` / ``write_trash_index`` hold *virtual* token ids; :meth:`EndGroup.update` translates the
  whole batch's indices to rows once per forward, at the group's first layer (Note [Batch translation]).
* Virtual token ``SINK_ROW`` (0) is the sink's first token (padded writes); ``SENTINEL_ROW`` (1) marks, in a
  sliding read index, where this step's new states go. Virtual page 0 maps to physical page 0 on every end, so
  both translate to rows 0 and 1 of the sink page.

Note [Batch translation]
~~~~~~~~~~~~~~~~~~~~~~~~
The IO builder asks for indices request by request; translating there would be one allocator call per request
and group. The indices stay virtual until the forward: the first layer of each group translates its read and
write index tensors (one ``translate`` each, the whole batch) and the group's other layers reuse the rows. The
translation runs after every allocation of the step (the scheduler allocates before the IO builder runs), so
pages compaction moved at the step hook are translated at their new place. Sliding writes translate with
``strict=False``: tokens whose sliding pages a long prefill already unbound (Note [Long prefills] in
:mod:`umalloc.integrations.transformers`) write the sink. The time spent is ``translate_seconds``.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np
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


def swa_window_pages(window: int, page_size: int) -> int:
    """Fresh sliding pages a prefill chunk longer than twice the window leaves bound at its end: the window's
    pages plus the one its unaligned start spills into. A lower bound of what the chunk needs (the page-by-page
    growth of Note [Long prefills] may bind one or two more on the way, and is rolled back if they do not fit)."""
    return -(-window // page_size) + 1


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
        #: seconds spent translating indices (Note [Batch translation])
        self.translate_seconds = 0.0
        self._rows_cache: tuple[torch.Tensor, torch.Tensor] | None = None
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
        """Virtual token of the table's zero page (padded reads), translated with the rest of the read index
        (Note [Batch translation]; Note [Seams] 4)."""
        return int(self._cache.table.pad_read_vtoken)

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
        """Pages this end needs for ``query_length`` more tokens (what transformers' offloading manager sizes its
        evictions by). Every new page is bound on every end; a sliding end first unbinds the pages that left the
        window (Note [Windows] in :mod:`umalloc.requests.table`), counted here as a decode's unbinding (the growth
        before was by one token; an earlier one unbound at least that much), so a decode past the window
        needs no sliding page net."""
        held = self._cache.held_tokens(request_id)
        ps = self.tokens_per_page
        pages = max(0, -(-(past_length + query_length) // ps) - -(-held // ps))
        w = self.sliding_window
        if w is None:
            return pages
        if query_length > 2 * w:
            return min(pages, swa_window_pages(w, ps) + 1)   # Note [Long prefills]
        unbound = max(0, held - w) // ps - max(0, held - 1 - w) // ps
        return max(0, pages - unbound)

    # ---- rows -------------------------------------------------------------------------------------------
    def to_rows(self, vtokens: torch.Tensor, strict: bool = True) -> torch.Tensor:
        """``int64`` rows of an index tensor of virtual tokens (Note [Batch translation]); ``strict=False`` maps
        tokens whose page is not bound here to the sink."""
        ps, rpp = self.tokens_per_page, self.rows_per_page
        if vtokens.device.type == "cpu":   # numpy arithmetic: no torch op dispatch on a few hundred ids
            pn = self._cache.alloc.translate(vtokens.numpy(), self.end, strict=strict)
            assert isinstance(pn, np.ndarray)
            return torch.from_numpy((pn // ps) * rpp + pn % ps)
        pt = self._cache.alloc.translate(vtokens, self.end, strict=strict)
        assert isinstance(pt, torch.Tensor)
        return (pt // ps) * rpp + pt % ps

    def read_vtokens(self, slot: int, past_length: int, query_length: int) -> list[int]:
        """Virtual tokens this step reads (translated in :meth:`update`); sliding: the window before
        ``past_length``, then one ``SENTINEL_ROW`` per new token."""
        r2t = self._cache.table.req_to_token
        if self.sliding_window is None:
            return r2t[slot, : past_length + query_length].tolist()
        lo = max(0, past_length - (self.sliding_window - 1))
        return r2t[slot, lo:past_length].tolist() + [SENTINEL_ROW] * query_length

    def write_vtokens(self, slot: int, past_length: int, query_length: int) -> list[int]:
        """Virtual tokens this step writes (translated in :meth:`update`)."""
        return self._cache.table.req_to_token[slot, past_length: past_length + query_length].tolist()

    def _batch_rows(self, layer_idx: int, read_index: torch.Tensor,
                    write_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward's rows: translated at the group's first layer, reused by its others."""
        if layer_idx == self.layer_indices[0] or self._rows_cache is None:
            t0 = time.perf_counter()
            sliding = self.sliding_window is not None
            reads = self.to_rows(read_index) if read_index.numel() else read_index
            self._rows_cache = (reads, self.to_rows(write_index, strict=not sliding))
            self.translate_seconds += time.perf_counter() - t0
        return self._rows_cache

    # ---- attention update ---------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               read_index: torch.Tensor, write_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's K/V (``[q, kv_heads, head_dim]``) at ``write_index`` rows and return the K/V attention
        reads (``[len(read_index), kv_heads, head_dim]``). Full attention writes then reads; sliding attention reads
        the cached tail first, puts the new states at the sentinel rows, then writes (its reads never include this
        step's rows). ``read_index`` / ``write_index`` hold virtual tokens (Note [Batch translation])."""
        read_index, write_index = self._batch_rows(layer_idx, read_index, write_index)
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


__all__ = ["FULL_ATTENTION", "SENTINEL_ROW", "SINK_ROW", "SLIDING_ATTENTION", "CacheParts", "EndGroup",
           "swa_window_pages"]
