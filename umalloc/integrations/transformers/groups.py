"""One attention type of a transformers model on one end of the umalloc arena: the object transformers'
continuous-batching IO builder and attention read as a cache allocator (``cache.cache_allocators``; Note [Seams]
2 in :mod:`umalloc.integrations.transformers.cache`).

* An :class:`EndGroup` holds per-layer K/V row views of the arena (Note [Rows] there) and turns a request's
  virtual tokens into rows through the allocator's v2p table; it owns no pages (the cache's request tables do).
* A sliding group's tokens are ring slots of the request's row in the cache's ``ring_table`` (Note [Sliding
  ring] in :mod:`umalloc.integrations.transformers.rings`); a full group's are the request's row in the cache's ``table``.
* ``SINK_ROW`` (0) is where padded lanes and dropped tokens write; ``SENTINEL_ROW`` (1) marks, in a sliding read
  index, where this step's new states go; ``PAD_READ_ROW`` (2) is where padded lanes read. All three lie in the
  sink page, physical page 0 of every end (Note [Rows]).

Note [Row reuse]
~~~~~~~~~~~~~~~~
A token's row changes only when compaction moves its page (its virtual id never changes) or when the table
rewrites the token (copy-on-write of a shared partial page, a truncation). So each group keeps, per slot of its
table, the rows it computed together with the end's cumulative moved-page count (``pages_moved``) at that time,
and extends them as the request grows: a decode computes one new row instead of all of them. The kept rows are
dropped when the count moved on, when the slot is freed or shrinks (``forget_rows``), and never kept for a slot
whose tokens copy-on-write may rewrite (the cache passes ``keep=False`` for a fork's source and its forks).

Note [Index time]
~~~~~~~~~~~~~~~~~
The rows handed to attention are physical, computed when transformers' IO builder asks for a request's indices
(``extend_read_and_write_indices``), from the v2p table as it is then: ``v2p[t // page_size] * rows_per_page +
t % page_size`` for each virtual token ``t``. That is after every move of the step: compaction runs at the step
hook, in allocations (the scheduler's, before the IO builder) and in eager mode after frees (the offloading
manager's, also before it); nothing allocates, frees or compacts between the IO builder and the forward that
reads the rows (transformers' synchronous loop: prepare the batch, forward, then update the requests).
Asynchronous batching, which schedules the next batch while a forward runs, is refused at construction (Note
[Seams] 8). On a host arena the arithmetic runs on numpy views of the tables; on a device arena through the
allocator's ``translate``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Protocol

import numpy as np
import torch

from umalloc import Arena, MultiEndedAllocator, RequestTable

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
SENTINEL_ROW = 1
SINK_ROW = 0
PAD_READ_ROW = 2


class CacheParts(Protocol):
    """What an :class:`EndGroup` reads of its :class:`~umalloc.integrations.transformers.UmallocPagedCache`."""

    page_size: int
    allow_block_sharing: bool
    arena: Arena
    alloc: MultiEndedAllocator
    table: RequestTable
    dtype: torch.dtype
    slots: dict[str, int]
    ring_slots: dict[int, int]

    def held_tokens(self, request_id: str) -> int: ...

    def cow_pages(self, request_id: str) -> int: ...

    def ring_cow_pages(self, request_id: str, past_length: int, query_length: int) -> int: ...

    def hash_index(self) -> tuple[Mapping[int, int], Mapping[int, int]]: ...


class LedgerView:
    """A read-only view of the prefix index with the shape of transformers' block ledger (``hash_to_block``,
    ``block_to_hash``): content hash -> virtual page and back. The hashes are umalloc's own (chained blake2b of
    a page's tokens, stable across processes), not transformers'; the pages are the group's block ids. Empty on a
    sliding group (prefixes are indexed by full-attention pages)."""

    def __init__(self, hash_to_block: Mapping[int, int], block_to_hash: Mapping[int, int]) -> None:
        self.hash_to_block = MappingProxyType(hash_to_block)
        self.block_to_hash = MappingProxyType(block_to_hash)


class BlockTableView(Mapping[str, list[int]]):
    """request id -> a copy of its virtual pages on one group's end, computed per lookup (O(its pages)): what
    transformers' offloading manager reads (``block_table.get(request_id, [])``) without a copy of every
    request's table. Live: it reflects the cache at lookup time."""

    def __init__(self, cache: CacheParts, table: RequestTable, ring: bool) -> None:
        self._cache, self._table, self._ring = cache, table, ring

    def __getitem__(self, request_id: str) -> list[int]:
        slot = self._cache.slots[request_id]
        # a ring's slot: the ring table's, or the request's own where its table holds the rings (every layer slides)
        pages: list[int] = self._table.pages(self._cache.ring_slots.get(slot, slot) if self._ring else slot).tolist()
        return pages

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._cache.slots))

    def __len__(self) -> int:
        return len(self._cache.slots)


class EndGroup:
    """One attention type of the model on one end of the arena, with the attributes transformers reads from a
    cache allocator (Note [Seams] 2). Holds per-layer K/V row views of the arena (Note [Rows])."""

    supports_block_table = False

    def __init__(self, cache: CacheParts, index: int, layer_type: str, end: str, table: RequestTable,
                 layer_indices: list[int], num_kv_heads: int, head_dim: int, sliding_window: int | None,
                 ring_tokens: int | None = None) -> None:
        self._cache = cache
        self._table = table   # the request table of this group's end (the ring table for a sliding group)
        self.index = index
        self.layer_type = layer_type
        self.end = end
        self.layer_indices = list(layer_indices)
        self.tokens_per_page = cache.page_size
        self.sliding_window = sliding_window
        #: a sliding group's ring slots (Note [Sliding ring]): ``ring_tokens``, or the window; 0 for a full group
        self.ring_tokens: int = ring_tokens if ring_tokens is not None else (sliding_window or 0)
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
        # host arena: the tables' numpy views (zero-copy, they follow every later call; read only here) for the
        # index arithmetic of Note [Index time]; a device arena goes through the allocator's translate
        on_host = arena.device.type == "cpu"
        self._host_r2t = table.req_to_token.numpy() if on_host else None
        self._host_v2p = cache.alloc.v2p(end).numpy() if on_host else None
        self._page_shift = ps.bit_length() - 1 if ps & (ps - 1) == 0 else -1   # log2(page_size), or -1
        self._end_view = cache.alloc.ends[end]
        self._kept_rows: dict[int, tuple[int, list[int]]] = {}   # slot -> (end's moves then, rows) (Note [Row reuse])

    # ---- transformers' allocator attributes -----------------------------------------------------------------
    #: the row padded lanes read: row 2 of the sink page, never written (Note [Rows] in
    #: :mod:`umalloc.integrations.transformers.cache`)
    read_trash_index = PAD_READ_ROW

    @property
    def ledger(self) -> LedgerView:
        """The prefix index as transformers' ledger shape (:class:`LedgerView`, read-only, live)."""
        if self.sliding_window is not None:
            return LedgerView({}, {})
        return LedgerView(*self._cache.hash_index())

    @property
    def block_table(self) -> BlockTableView:
        """request id -> its virtual pages on this group's end (a sliding group: its ring's), read-only, each
        request's list computed when asked (:class:`BlockTableView`)."""
        return BlockTableView(self._cache, self._table, self.sliding_window is not None)

    def get_seqlen_k(self, past_length: int, query_length: int) -> int:
        if self.sliding_window is None:
            return past_length + query_length
        return query_length + min(past_length, self.sliding_window - 1)

    def needs_new_blocks(self, request_id: str, past_length: int, query_length: int) -> int:
        """Pages this end needs for ``query_length`` more tokens (what transformers' offloading manager sizes its
        evictions by): a full group one per page past the held ones (and one for the copy of a shared partial
        page), a sliding group the pages its ring still lacks (Note [Sliding ring] in :mod:`umalloc.integrations.transformers.rings`)
        and the copies of shared ring pages it would write."""
        held = self._cache.held_tokens(request_id)
        ps = self.tokens_per_page
        total = past_length + query_length
        w = self.sliding_window
        if w is None:   # plus the copy of a shared partial last page, as the cache counts its refusals
            return max(0, -(-total // ps) - -(-held // ps)) + (total > held and self._cache.cow_pages(request_id))
        cow = self._cache.ring_cow_pages(request_id, past_length, query_length)   # shared pages it would write
        r = self.ring_tokens
        total, held = min(total, r), min(held, r)
        return max(0, -(-total // ps) - -(-held // ps)) + cow

    # ---- rows -------------------------------------------------------------------------------------------
    def to_rows(self, vtokens: torch.Tensor | np.ndarray) -> torch.Tensor:
        """``int64 (n,)`` CPU rows of ``(n,)`` virtual tokens of this group's end (Note [Rows]): on a host arena
        ``v2p[t // page_size] * rows_per_page + t % page_size`` (one gather); ids outside the id space or on a page
        not bound here go through the allocator's ``translate``, which raises its typed error."""
        ps, rpp = self.tokens_per_page, self.rows_per_page
        v2p = self._host_v2p
        vt = vtokens.numpy() if isinstance(vtokens, torch.Tensor) and vtokens.device.type == "cpu" else vtokens
        if v2p is not None and isinstance(vt, np.ndarray):
            if vt.size == 0:
                return torch.zeros(0, dtype=torch.int64)
            if vt.dtype == np.int64 and vt.min() >= 0 and vt.max() < v2p.shape[0] * ps:
                sh = self._page_shift
                pp = v2p[vt >> sh] if sh >= 0 else v2p[vt // ps]
                if pp.min() >= 0:
                    return torch.from_numpy(pp * rpp + (vt & (ps - 1) if sh >= 0 else vt % ps))
            pn = self._cache.alloc.translate(vt.astype(np.int64, copy=False), self.end)
            assert isinstance(pn, np.ndarray)
            return torch.from_numpy((pn // ps) * rpp + pn % ps)
        ids = torch.as_tensor(vt, dtype=torch.int64)
        pt = self._cache.alloc.translate(ids.to(self._cache.arena.device), self.end)
        assert isinstance(pt, torch.Tensor)
        return ((pt // ps) * rpp + pt % ps).cpu()

    def _rows_list(self, vt: np.ndarray | torch.Tensor) -> list[int]:
        """:meth:`to_rows` of a table slice, as a list. On a host arena the table's tokens are valid ids by
        construction, so only an unbound page (a tombstone in v2p) or an id past the id space sends the slice
        through :meth:`to_rows`'s checked path, which raises the allocator's typed error."""
        v2p = self._host_v2p
        sh = self._page_shift
        if v2p is None or sh < 0 or not isinstance(vt, np.ndarray):
            return self.to_rows(vt).tolist()
        n = vt.shape[0]
        if n == 0:
            return []
        try:
            if n <= 4:   # a decode's few tokens: Python ints beat numpy's per-call overhead
                m = self.tokens_per_page - 1
                rpp = self.rows_per_page
                out = [int(v2p[t >> sh]) * rpp + (t & m) for t in vt.tolist()]
                if min(out) >= 0:
                    return out
            else:
                pp = v2p[vt >> sh]
                if pp.min() >= 0:
                    return (pp * self.rows_per_page + (vt & (self.tokens_per_page - 1))).tolist()
        except IndexError:
            pass
        return self.to_rows(vt).tolist()

    def _row(self, slot: int) -> np.ndarray | torch.Tensor:
        """Request ``slot``'s virtual tokens in this group's table (a view)."""
        return self._host_r2t[slot] if self._host_r2t is not None else self._table.req_to_token[slot]

    def forget_rows(self, slots: list[int]) -> None:
        """Drop the kept rows of these slots of this group's table (Note [Row reuse]): call when a slot is freed
        or shrinks."""
        for s in slots:
            self._kept_rows.pop(s, None)

    def _rows_of(self, slot: int, num_tokens: int, keep: bool) -> list[int]:
        """Rows of the first ``num_tokens`` tokens of request ``slot`` (at most its length), from the rows kept
        since the end last moved a page plus the new tokens' (Note [Row reuse]); ``keep=False`` computes them
        all and keeps nothing (a request whose tokens may be rewritten: copy-on-write after a fork). The list is
        the kept one: read it, never change it."""
        row = self._row(slot)
        if not keep:
            return self._rows_list(row[:num_tokens])
        moves = self._end_view.pages_moved
        kept = self._kept_rows.get(slot)
        if kept is None or kept[0] != moves:
            rows = self._rows_list(row[:num_tokens])
            self._kept_rows[slot] = (moves, rows)
            return rows
        rows = kept[1]
        if len(rows) < num_tokens:
            rows.extend(self._rows_list(row[len(rows):num_tokens]))
        return rows

    def read_rows(self, slot: int, past_length: int, query_length: int, keep: bool = True) -> list[int]:
        """Rows this step reads for request ``slot`` of this group's table (Note [Index time]); sliding: the ring
        slots (``position % ring_tokens``) of the ``min(past_length, window - 1)`` tokens before ``past_length``
        (oldest first), then one ``SENTINEL_ROW`` per new token. ``keep``: as :meth:`_rows_of`."""
        w = self.sliding_window
        if w is None:
            return self._rows_of(slot, past_length + query_length, keep)[: past_length + query_length]
        r, m = self.ring_tokens, min(past_length, w - 1)
        if past_length <= r:   # the ring has not wrapped below past_length: slot = position
            rows = self._rows_of(slot, past_length, keep)[past_length - m: past_length]
        elif m == 0:
            rows = []
        else:   # the ring is full: slots (past - m) % r, ... wrapping, m of them
            ring = self._rows_of(slot, r, keep)
            lo, hi = (past_length - m) % r, past_length % r
            rows = ring[lo:hi] if lo < hi else ring[lo:] + ring[:hi]
        return rows + [SENTINEL_ROW] * query_length

    def write_rows(self, slot: int, past_length: int, query_length: int, keep: bool = True) -> list[int]:
        """Rows this step writes for request ``slot`` of this group's table (Note [Index time]); sliding: the last
        ``min(query_length, ring_tokens)`` tokens to their ring slots (``position % ring_tokens``), the earlier
        ones to the sink. ``keep``: as :meth:`_rows_of`."""
        w = self.sliding_window
        end = past_length + query_length
        if w is None:
            return self._rows_of(slot, end, keep)[past_length:end]
        r = self.ring_tokens
        kept = min(query_length, r)
        ring = self._rows_of(slot, min(end, r), keep)
        lo = (end - kept) % r
        rows = ring[lo: lo + kept] if lo + kept <= r else ring[lo:r] + ring[: lo + kept - r]
        return [SINK_ROW] * (query_length - kept) + rows

    def copy_rows(self, src_vtokens: torch.Tensor, dst_vtokens: torch.Tensor) -> None:
        """Copy every layer's K and V rows of virtual tokens ``src_vtokens`` onto those of ``dst_vtokens`` (int64
        ``(n,)`` each, this group's end, distinct from the sources). O(n * layers)."""
        src, dst = self.to_rows(src_vtokens), self.to_rows(dst_vtokens)
        for k_rows, v_rows in self._views.values():
            k_rows.index_copy_(0, dst, k_rows.index_select(0, src))
            v_rows.index_copy_(0, dst, v_rows.index_select(0, src))

    # ---- attention update ---------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               read_index: torch.Tensor, write_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's K/V (``[q, kv_heads, head_dim]``) at ``write_index`` rows and return the K/V attention
        reads (``[len(read_index), kv_heads, head_dim]``). Full attention writes then reads; sliding attention reads
        the cached tail first, puts the new states at the sentinel rows, then writes (its reads never include this
        step's rows). ``read_index`` / ``write_index`` hold rows (Note [Index time])."""
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


__all__ = ["FULL_ATTENTION", "PAD_READ_ROW", "SENTINEL_ROW", "SINK_ROW", "SLIDING_ATTENTION", "CacheParts",
           "BlockTableView", "EndGroup", "LedgerView"]
