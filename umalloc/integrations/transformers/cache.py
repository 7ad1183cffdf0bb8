"""umalloc as the KV memory of Hugging Face transformers' continuous batching (``generate_batch``).

:func:`install` makes every ``PagedAttentionCache`` that transformers builds afterwards an
:class:`UmallocPagedCache`: the model's KV lives in one umalloc :class:`~umalloc.geometry.arena.Arena`, its pages
are handed out by a :class:`~umalloc.allocator.facade.MultiEndedAllocator` and owned per request by a
:class:`~umalloc.requests.table.RequestTable`. transformers' scheduler, request states, logits processing, masks
and attention kernels are unchanged: only the memory layer is replaced.

Policy:

* **One arena, one end per attention type.** Full-attention layers are the ``full`` end (grows up), sliding-window
  layers the ``swa`` end (grows down); both mint their own virtual pages, each has its own page geometry
  (``page_size`` tokens of every layer it holds, page-major envelope: layer 0 K, layer 0 V, layer 1 K, ...) and
  its own :class:`~umalloc.requests.table.RequestTable`; the split between them is dynamic (no sectors).
* **Sliding layers keep a ring** (Note [Sliding ring]): a request holds ``ceil(min(length, R) / page_size)``
  sliding pages, ``R`` the window as in transformers' ring buffer, or a window plus a speculative round's drafts.
* **Block ids are virtual pages.** A request's pages are its tables' ``req_to_token`` rows; the read / write row
  indices handed to attention are computed every step by translating those virtual tokens to physical ones on the
  layer's end, so compaction may move pages between steps (Note [Rows]).
* **Sharing is the table's.** Prefix hits, forks and cached pages use the table's reference counts, copy-on-write
  and cached-free LRU; the integration keeps only a content-hash index (:mod:`~umalloc.integrations.transformers.prefix`,
  hash -> virtual page), cleaned by ``on_evict``. Cached pages are evicted only when an allocation falls short.
* **Padding lanes** write umalloc's sink (physical page 0, row 0) and read row 2 of it, which nothing writes
  (Note [Rows]).
* **Size**: the arena has exactly the bytes transformers' own cache tensor would have (its sectors plus its two
  trash sectors, computed by transformers' ``PagedAttentionMemoryHandler`` from ``num_blocks`` / memory), or
  ``arena_bytes`` if given.
* **Out of memory** behaves as transformers' cache does: ``can_store_request_tokens`` returns ``False`` with
  nothing allocated (F29), the request waits or is preempted by transformers' own offloading manager.

Note [Seams]
~~~~~~~~~~~~
Where transformers 5.23's interfaces are adapted, all in this package:

1. ``continuous_api.PagedAttentionCache`` (the name ``_create_batch_processor`` calls) is replaced by a factory
   (:mod:`~umalloc.integrations.transformers.install`); :func:`uninstall` puts the original back.
2. ``cache.cache_allocators`` holds one :class:`EndGroup` per attention type (the attributes the IO builder,
   the offloading manager and ``update`` read: ``index``, ``layer_type``, ``tokens_per_page``, ``get_seqlen_k``,
   ``read_trash_index`` / ``write_trash_index``, ``needs_new_blocks``, ``block_table``; and ``ledger``, a
   read-only ``hash_to_block`` / ``block_to_hash`` view of the prefix index), not a CacheAllocator.
3. ``cache.pool.try_to_free_sectors()``, which the scheduler calls once per step before scheduling, is the step
   hook: forced compaction (``compact_every_step``) and the per-step ``check_invariants`` run there, after the
   previous forward and before the next step's indices are built.
4. The indices the IO builder collects are physical rows computed when it asks for them, after every move of
   the step (Note [Index time] in :mod:`umalloc.integrations.transformers.groups`); ``read_trash_index`` is a
   property it reads at every batch.
5. The decode fast path (block tables) is off (``max_blocks_per_request = 0``): block tables would hold physical
   pages that compaction may move; eager / sdpa read through row indices only.
6. ``evict_cached_blocks`` evicts nothing and returns ``False``: the table evicts LRU pages itself when an
   allocation falls short, and ``compute_free_capacity`` counts cached pages as free.
7. De-duplication on block completion, as transformers' own allocator does it: after the forward, each page the
   forward completed gets its chained content hash; a new hash is indexed, and a page whose hash is already
   indexed is replaced in the request by the indexed page (``RequestTable.share_page``) and freed, so requests
   prefilled in the same step share their common full pages from the next step on.
8. Refused at construction (typed errors): tensor parallelism, asynchronous batching (it schedules, so allocates
   and compacts, while a forward reads rows computed before), CPU offloading (``cpu_offload_space > 0``, it copies
   by physical block id), and attention types other than full / sliding (naming the first such layer and its
   type). A model whose every layer slides is held with rings only (Note [All sliding]).
9. sdpa and flash attention test ``isinstance(cache, PagedAttentionCache)``: :func:`install` builds the class the
   engine instantiates with transformers' class as a second base (after :class:`UmallocPagedCache`), for that
   check only; it verifies that every method the engine calls resolves to umalloc's.
10. ``continuous_api.ContinuousBatchProcessor`` is likewise replaced by transformers' class with one step added
    after ``__init__`` (:func:`~umalloc.integrations.transformers.install.bind_processor`): its scheduler object's
    ``schedule_batch`` also fails, alone, the requests the cache found unable to complete (Note [Cannot fit]),
    and the cache can read a request's state (``state_of``). A prefix hit never leaves a fork parent (a request
    with children) a single token to prefill: transformers prefills such a parent up to its last token and would
    schedule it with none (an empty batch that fails every request; stock meets it too when its cached blocks
    survive). transformers' classes and files are not modified; :func:`uninstall` puts both names back.

Note [Cannot fit]
~~~~~~~~~~~~~~~~~
With the arena to itself a request can hold at most ``tokens_alone`` tokens: ``full`` grows up from its first
page, ``swa`` (its ring) down from its top page, and the two must not cross (``max_position_embeddings`` caps
it too). A request that needs more -- now, for its prompt, or for its prompt plus ``max_new_tokens - 1`` when no
end-of-sequence token can stop it early -- can never complete. The stock cache cannot tell: it admits such a
request, the request grows until no request can be scheduled, and transformers fails every outstanding request.
This cache refuses it and, through the batch processor's scheduler (Note [Seams] 10), fails it alone at its
first scheduling, with a :class:`RequestCannotFitError` naming what it needs and what one request can hold. A
request with an end-of-sequence token whose prompt fits is admitted (it may stop early) and failed alone only
once it needs more than ``tokens_alone``.

Note [Rows]
~~~~~~~~~~~
transformers' eager / sdpa paged attention indexes a per-layer view of the cache as token rows of
``[num_kv_heads, head_dim]``: row ``r`` of layer ``i`` of a group is element row ``r + 2 * i * page_size`` of the
group's flat row view, and physical page ``p`` starts at row ``p * rows_per_page`` with
``rows_per_page = 2 * page_size * num_layers``. That is exactly umalloc's page-major envelope, so the row of
virtual token ``t`` on end ``e`` is ``(pt // page_size) * rows_per_page + pt % page_size`` with
``pt = translate(t, e)``. Page 0 of every end lies in the arena's reserved floor (virtual page 0 translates to
it on every end): row 0 is the sink (padded writes, and the early tokens of a chunk longer than the window); row
1 is the sliding reads' sentinel (a marker, replaced by this step's states, never read as data); row 2 is where
padded lanes read (``PAD_READ_ROW``). The floor is zeroed at creation and only sink rows are ever written, all
at multiples of ``page_size`` in the flat row view (row 0 of every layer's K and V), so, ``page_size`` being at
least 4 (transformers' own bound, checked at construction), row 2 of every layer stays zero: the padded reads
see zeros, as from transformers' never-written read trash, and no page is spent on them (the tables mint no zero
page).

Note [Sliding ring] and Note [All sliding] are in :mod:`~umalloc.integrations.transformers.rings`, with the
rings' shared and copied pages.

Note [Deferred growth] is in :mod:`~umalloc.integrations.transformers.growth`, with the tokens each request holds
and the growth of its tables.

Threading: the scheduler's thread only (transformers drives the cache from one thread).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from umalloc import (
    ARENA_ALIGN_BYTES,
    Arena,
    ArenaSpec,
    EndRole,
    EndSpec,
    Grow,
    InvariantError,
    LayerSpec,
    MultiEndedAllocator,
    RequestTable,
    SpecError,
)
from umalloc.integrations.transformers.groups import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    EndGroup,
)
from umalloc.integrations.transformers.growth import Growth
from umalloc.integrations.transformers.options import (
    END_OF,
    TORCH_TO_KV,
    CacheCounters,
    CacheOptions,
    MemoryTimer,
    RequestCannotFitError,
    UnsupportedCacheError,
    text_config_dims,
)
from umalloc.integrations.transformers.prefix import PrefixIndex, ring_donor
from umalloc.integrations.transformers.rings import RingPages, ring_tokens
from umalloc.integrations.transformers.sizing import never_completes, stock_sizing, tokens_alone


def _weak_call(method: Any) -> Any:
    """A function calling the bound ``method`` while its object lives (a no-op after): a callback that does not
    keep its object alive (Note [Lifetime])."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        m = ref()
        if m is not None:
            m(*args)
    return call


class _Pool:
    """The object transformers' scheduler reaches as ``cache.pool``: its ``try_to_free_sectors`` is the step hook
    (Note [Seams] 3)."""

    def __init__(self, cache: UmallocPagedCache) -> None:
        self._cache = weakref.proxy(cache)   # the cache owns its pool: no cycle keeps a dropped cache alive

    def try_to_free_sectors(self) -> None:
        self._cache.step_hook()

    @property
    def num_free_sectors(self) -> int:
        return 0


class UmallocPagedCache:
    """transformers' ``PagedAttentionCache`` interface (5.23) over a umalloc arena (module docstring).

    Constructed by transformers' batch processor once :func:`install` is active, with the stock signature.

    Attributes:
        arena, alloc, table: the umalloc arena, allocator and request table.
        cache_allocators: attention type -> :class:`EndGroup` (order: full first).
        slots: request id -> table slot of every request holding pages.
        counters: :class:`CacheCounters`.
        stock_cache_bytes: bytes transformers' own cache tensor would have for this config.

    Raises:
        UnsupportedCacheError: Note [Seams] 8.
    """

    def __init__(self, config: Any, continuous_batching_config: Any, device: torch.device | str,
                 distributed_helper: Any, dtype: torch.dtype = torch.float16,
                 model_supports_logits_to_keep: bool = False, *, options: CacheOptions | None = None) -> None:
        opts = options or CacheOptions()
        cb = continuous_batching_config
        if distributed_helper is not None and getattr(distributed_helper, "tp_size", 1) > 1:
            raise UnsupportedCacheError(f"tp_size={distributed_helper.tp_size}; the umalloc cache allows 1")
        if cb.use_async_batching:
            raise UnsupportedCacheError("use_async_batching=True; the umalloc cache allows False (the next batch's "
                                        "allocations may move pages the running forward reads)")
        if (cb.cpu_offload_space or 0) > 0:
            raise UnsupportedCacheError(f"cpu_offload_space={cb.cpu_offload_space}; the umalloc cache allows 0 "
                                        "(transformers' CPU swap copies by physical block id)")
        self.config = config
        self.dtype = dtype
        self.device = device
        self.page_size = ps = int(cb.page_size)
        if ps < 4:
            raise UnsupportedCacheError(f"page_size={ps}; the umalloc cache allows >= 4 (transformers' own bound; "
                                        "padded reads use row 2 of the sink page, Note [Rows])")
        self.allow_block_sharing = bool(cb.allow_block_sharing)
        num_kv_heads, head_dim, groups, window = text_config_dims(config, dtype)
        kv = TORCH_TO_KV[dtype]

        # ---- transformers' own sizing (sectors), for equal bytes
        stock = stock_sizing(config, cb, dtype, groups, num_kv_heads, head_dim, model_supports_logits_to_keep)
        self.max_batch_tokens = stock.max_batch_tokens
        self.stock_cache_bytes = stock.cache_bytes
        self.bytes_per_sector = stock.bytes_per_sector
        model_block_bytes = stock.model_block_bytes
        arena_bytes = self.stock_cache_bytes if opts.arena_bytes is None else int(opts.arena_bytes)
        if arena_bytes % ARENA_ALIGN_BYTES:
            raise UnsupportedCacheError(f"CacheOptions.arena_bytes={arena_bytes}: allowed a multiple of "
                                        f"{ARENA_ALIGN_BYTES} bytes")

        # ---- the arena: full (up) and swa (down), each an id owner with its own request table
        #: whether the model has full-attention layers; without (every layer slides) the arena has one end,
        #: ``swa``, and ``table`` is the rings' table (Note [All sliding])
        self.has_full = FULL_ATTENTION in groups
        ends = []
        if self.has_full:
            ends.append(EndSpec("full", tuple(LayerSpec.mha(num_kv_heads, head_dim, dtype=kv)
                                              for _ in groups[FULL_ATTENTION]), page_size=ps, grow=Grow.UP))
        if SLIDING_ATTENTION in groups:
            ends.append(EndSpec("swa", tuple(LayerSpec.mha(num_kv_heads, head_dim, dtype=kv, window_tokens=window)
                                             for _ in groups[SLIDING_ATTENTION]), page_size=ps,
                                grow=Grow.DOWN if self.has_full else Grow.UP, role=EndRole.SWA))
        if opts.draft_layers:   # an early-exit drafter's KV, bound to full (Note [Draft end] in speculate)
            if not self.has_full:
                raise UnsupportedCacheError("CacheOptions.draft_layers: the draft end is bound to the full-attention "
                                            "end; allowed for a model with full-attention layers")
            ends.append(EndSpec("draft", tuple(LayerSpec.mha(num_kv_heads, head_dim, dtype=kv) for _ in range(
                opts.draft_layers)), page_size=ps, grow=Grow.FLOAT if SLIDING_ATTENTION in groups else Grow.DOWN,
                owner="full", role=EndRole.DRAFT))
        #: the end whose request table names the requests (``full``; ``swa`` when every layer slides)
        self.owner = owner = "full" if self.has_full else "swa"
        try:
            spec = ArenaSpec(tuple(ends), arena_bytes=arena_bytes)
        except SpecError as e:
            source = "CacheOptions.arena_bytes" if opts.arena_bytes is not None else "the stock cache's size"
            raise UnsupportedCacheError(f"arena_bytes={arena_bytes} ({source}): allowed {e.allowed} for this "
                                        "model's pages") from e
        self.arena = Arena(spec, device=device)
        self.alloc = MultiEndedAllocator(self.arena, compaction=opts.compaction)
        owner_pages = self.arena.top_page(owner) + 1 - self.arena.first_page(owner)
        #: the most tokens one request can hold with the arena to itself (Note [Cannot fit])
        self.window = window if SLIDING_ATTENTION in groups else None
        #: a ring's slots (Note [Sliding ring]); None without sliding layers
        self.ring_tokens = None if self.window is None else ring_tokens(self.window, ps, opts.speculative_tokens)
        ring = self.ring_tokens or 0
        self.tokens_alone = tokens_alone(self.arena, ps, self.ring_tokens)
        max_pos = int(getattr(config, "max_position_embeddings", owner_pages * ps) or owner_pages * ps)
        self.max_tokens_per_request = max(ps, min(max_pos, self.tokens_alone))
        #: request id -> its transformers request state, bound with the batch processor (Note [Seams] 10); while
        #: it is None no processor fails the requests this cache finds unable to complete (Note [Cannot fit]):
        #: such a request is refused and waits, as in the stock cache
        self.state_of: Any = None
        self._doomed: dict[str, tuple[Any, RequestCannotFitError]] = {}
        max_requests = opts.max_requests or max(1, min(owner_pages, 1024))
        self.table = RequestTable(self.alloc, max_requests=max_requests,
                                  max_tokens_per_request=self.max_tokens_per_request if self.has_full or window is None else ring,
                                  dtype=torch.int64, owner=owner, zero_page=False,
                                  on_evict=_weak_call(self._on_evict))
        #: the sliding layers' ring per request (Note [Sliding ring]) beside the full-attention table; None without
        #: sliding layers, and None when every layer slides (``table`` holds the rings, Note [All sliding])
        self.ring_table: RequestTable | None = None
        if self.window is not None and self.has_full:
            self.ring_table = RequestTable(self.alloc, max_requests=max_requests + 1,   # + 1: Note [Shared rings]
                                           max_tokens_per_request=ring, dtype=torch.int64, owner="swa",
                                           zero_page=False)
        self.options = opts
        self.counters = CacheCounters()
        self._timer = MemoryTimer(self.counters)
        self.slots: dict[str, int] = {}
        self.ring_slots: dict[int, int] = {}   # slot -> its ring's slot in ring_table (Note [Sliding ring])
        #: ring-table slots held outside any request: a receiver's staging pages (Note [Ring landing] in
        #: :mod:`~umalloc.integrations.transformers.admit`), counted by :meth:`check_invariants`
        self.staged_rings: set[int] = set()
        self.prefix = PrefixIndex()
        #: the rings' shared, copied-on-write and fork-copied pages (:mod:`~umalloc.integrations.transformers.rings`)
        self.rings = None if self.window is None else RingPages(
            self.ring_table if self.ring_table is not None else self.table, self.arena, self.alloc, self.window, ps,
            self.counters, self.ring_tokens)

        self.cache_allocators: dict[str, EndGroup] = {}
        self.layer_to_allocator: dict[int, EndGroup] = {}
        for index, lt in enumerate(sorted(groups, key=lambda t: t != FULL_ATTENTION)):
            sliding = lt == SLIDING_ATTENTION
            table = self.ring_table if sliding and self.ring_table is not None else self.table
            grp = EndGroup(weakref.proxy(self), index, lt, END_OF[lt], table, groups[lt], num_kv_heads, head_dim,
                           window if sliding else None, self.ring_tokens if sliding else None)
            self.cache_allocators[lt] = grp
            for layer in groups[lt]:
                self.layer_to_allocator[layer] = grp
        self.pool = _Pool(self)
        #: bytes one full-attention page takes, its bound draft page included
        self.full_page_bytes = sum(self.arena.page_bytes(e.name) for e in spec.ends if e.name in ("full", "draft"))
        #: prefixes are shared where a full-attention group indexes them (rings copied: Note [Sliding prefix] in
        #: :mod:`~umalloc.integrations.transformers.prefix`)
        self.use_prefix_sharing = self.allow_block_sharing and self.has_full
        #: whether freed full-attention pages stay cached: not with sliding layers (no live ring gives their window)
        self.cache_freed = self.use_prefix_sharing and self.window is None
        #: the tokens each request holds and the growth of the tables (:mod:`~umalloc.integrations.transformers.growth`)
        self.growth = Growth(self.table, self.ring_table, self.alloc, self.arena, owner, ps, self.ring_tokens,
                             self.full_page_bytes, self.arena.page_bytes("swa") if SLIDING_ATTENTION in groups else 0,
                             self.cache_freed, self.slots, self.ring_slots, _weak_call(self._forget_rows))
        # stock's scheduler reads at most a window of a request's cache when every layer slides
        self.read_cache_limit = None if self.has_full else window
        self.num_blocks = (arena_bytes - self.arena.floor_bytes) // model_block_bytes
        self.max_blocks_per_request = 0
        self.max_decode_fast_path_length = 0
        self.max_tokens_read = max(g.num_blocks * ps for g in self.cache_allocators.values())

    def take_doomed(self) -> list[tuple[Any, RequestCannotFitError]]:
        """The requests found unable to complete since the last call, with their errors (Note [Cannot fit])."""
        out = list(self._doomed.values())
        self._doomed.clear()
        return out

    # ---- bookkeeping ---------------------------------------------------------------------------------------
    def hash_index(self) -> tuple[dict[int, int], dict[int, int]]:
        """The prefix index: (content hash -> virtual page, virtual page -> content hash), live; read it only."""
        return self.prefix.hash_to_vpage, self.prefix.vpage_to_hash

    def held_tokens(self, request_id: str) -> int:
        slot = self.slots.get(request_id)
        return 0 if slot is None else self.growth.held.get(slot, 0)

    def _free_table_slots(self, slots: list[int], cache: bool = False) -> None:
        self.growth.flush()
        self.growth.free_bytes_memo = None
        self.table.free_requests(slots, cache=cache)
        rings = [self.ring_slots.pop(s) for s in slots if s in self.ring_slots]
        if rings and self.ring_table is not None:
            self.ring_table.free_requests(rings)
            self.rings.forget(rings)   # type: ignore[union-attr]
        self._forget_rows(slots, rings)
        for s in slots:
            self.growth.held.pop(s, None)
            self.growth.forked.discard(s)

    def _forget_rows(self, slots: list[int], rings: list[int]) -> None:
        """Drop the groups' kept rows of these table slots and ring slots (Note [Row reuse] in
        :mod:`umalloc.integrations.transformers.groups`)."""
        for grp in self.cache_allocators.values():
            grp.forget_rows(rings if grp.sliding_window is not None else slots)

    def _on_evict(self, vpages: torch.Tensor) -> None:
        self.counters.evicted_pages += int(vpages.numel())
        self.prefix.forget(vpages.tolist())

    def _free_slot(self, request_id: str, cache: bool) -> None:
        """Free one request's slot. With ``cache`` its full pages stay cached (their hashes stay indexed: only full
        pages are hashed and only partial pages are freed); without, the pages it was the last holder of lose their
        hashes (pages another request holds keep theirs, as transformers' ledger does)."""
        slot = self.slots.pop(request_id, None)
        if slot is None:
            return
        self.growth.flush()
        pages = self.table.pages(slot) if not cache and self.prefix.vpage_to_hash else None
        self._free_table_slots([slot], cache=cache)
        if pages is not None and pages.numel():   # pages another request still holds keep their hash, as in stock
            gone = pages[self.table.holder_counts(pages) == 0]
            self.prefix.forget(gone.tolist())

    def step_hook(self) -> None:
        """Once per scheduling step (Note [Seams] 3): optional forced compaction and invariant checks."""
        with self._timer:
            self.growth.free_bytes_memo = None
            self.growth.flush()
            if self.rings is not None:   # a caller that skipped perform_cache_copy still reads the forks' rings
                self.rings.copy_forks()
            c = self.counters
            c.steps += 1
            c.live_requests_sum += len(self.slots)
            if self.options.compact_every_step:
                report = self.alloc.compact(budget_pages=self.options.compact_budget_pages)
                c.compactions += 1
                c.pages_moved += report.pages_moved
            if self.options.check_every_step:
                self.check_invariants()

    def check_invariants(self) -> None:
        """The tables' and the allocator's invariants, plus: every indexed page is held by a request or cached,
        the hash index is one-to-one, the kept lengths are the table's, and every request's ring holds
        ``min(length, ring_tokens)`` tokens (Note [Sliding ring]). Puts deferred growths into the tables first (Note
        [Deferred growth]). O(pages)."""
        self.growth.flush()
        self.table.check_invariants()
        kept = set(self.table.cached_pages().tolist())
        for slot in self.slots.values():
            kept.update(self.table.pages(slot).tolist())
        self.prefix.check(kept)
        live = sorted(self.slots.values())
        if sorted(self.growth.held) != live:
            raise InvariantError(f"held lengths: kept for slots {sorted(self.growth.held)}, live slots {live}")
        held = self.growth.held
        if live and self.table.num_tokens(live).tolist() != [self.growth.table_tokens(held[s]) for s in live]:
            raise InvariantError("held lengths: a kept length differs from the table's")
        if self.ring_table is not None and self.rings is not None:
            self.rings.check(self.ring_slots, self.growth.held, len(self.staged_rings))

    # ---- scheduler-facing API (transformers' PagedAttentionCache) --------------------------------------------
    def can_store_request_tokens(self, state: Any, request_len: int, dry_run: bool = False) -> bool:
        """Make ``state``'s request hold ``state.current_len() + request_len`` tokens (all or nothing; already
        held tokens are not allocated twice). ``dry_run``: only answer whether the arena could hold
        ``request_len`` tokens of a new request now."""
        with self._timer:
            if dry_run:
                full_pages, swa_pages = self.growth.fresh_pages(int(request_len))
                need = {"full": full_pages, "swa": swa_pages} if self.ring_table is not None else \
                    {self.owner: full_pages if self.has_full else swa_pages}
                return request_len <= self.max_tokens_per_request and self.alloc.can_alloc(need)
            rid = state.request_id
            target = int(state.current_len()) + int(request_len)   # transformers' contract: past + query
            if target > self.max_tokens_per_request or rid not in self.slots:
                need_tokens = never_completes(state, target, self.max_tokens_per_request)
                if need_tokens is not None:
                    if self.state_of is not None:
                        self._doomed[rid] = (state, RequestCannotFitError(
                            f"request {rid!r} needs {need_tokens} tokens of KV cache; this cache holds at most "
                            f"{self.max_tokens_per_request} for one request alone ({self.arena.arena_bytes} arena "
                            f"bytes, max_position_embeddings included): it can never complete, so it fails alone"))
                    self.counters.refused_allocations += 1
                    return False
            known = self.slots.get(rid)
            held = 0 if known is None else self.growth.held[known]
            grow = target - held
            if grow <= 0:
                return True
            if known is not None and self.growth.defer(known, target):   # Note [Deferred growth]
                return True
            self.growth.flush()
            ring = self.ring_slots.get(known, -1) if known is not None else -1
            cow = self.rings.plan_copies(ring, target - int(request_len), target) if ring >= 0 and self.rings else []
            full_pages, swa_pages = self.growth.new_pages(known, held, grow)
            if not self.growth.fits_bytes(full_pages, swa_pages + len(cow)):   # refused before anything is touched
                self.counters.refused_allocations += 1
                return False
            done = self.rings.copy_on_write(ring, cow) if cow and self.rings else []   # Note [Shared rings]
            ok = done is not None and self.growth.grow(rid, known, held, grow)
            if done and not ok:
                self.rings.undo(ring, done)   # type: ignore[union-attr]
            if cow:
                self._forget_rows([], [ring])
            self.growth.free_bytes_memo = None   # the growth (or its undoing) may have changed the free bytes
            if not ok:
                self.counters.refused_allocations += 1
                return False
            if known is None:
                self.counters.max_live_requests = max(self.counters.max_live_requests, len(self.slots))
            return True

    def cow_pages(self, request_id: str) -> int:
        """:meth:`~umalloc.integrations.transformers.growth.Growth.cow_pages` of a request id (0 for an unknown
        one): what ``needs_new_blocks`` adds on the full-attention group, so transformers' offloading manager sizes
        a growth as this cache refuses it."""
        slot = self.slots.get(request_id)
        return 0 if slot is None else self.growth.cow_pages(slot)

    def ring_cow_pages(self, request_id: str, past_length: int, query_length: int) -> int:
        """Shared ring pages a forward of ``query_length`` tokens after ``past_length`` would copy first (Note
        [Shared rings] in :mod:`~umalloc.integrations.transformers.rings`): what ``needs_new_blocks`` adds on the
        sliding group. 0 for an unknown request."""
        ring = self.ring_slots.get(self.slots.get(request_id, -1), -1)
        if ring < 0 or self.rings is None:
            return 0
        return len(self.rings.plan_copies(ring, past_length, past_length + query_length))

    def count_storable_requests(self, list_blocks_needed: list[dict[str, int]]) -> int:
        """How many of the requests, in order, the free bytes (free pages, gap, cached pages; memoized) could
        hold."""
        free_bytes = int(self.compute_free_capacity(relative=False))
        for i, blocks in enumerate(list_blocks_needed):
            need = sum(n * self.cache_allocators[name].bytes_per_block for name, n in blocks.items())
            if need > free_bytes:
                return i
            free_bytes -= need
        return len(list_blocks_needed)

    def free_bytes(self) -> int:
        """Bytes allocatable now or after evicting every cached page (:meth:`~umalloc.integrations.transformers.
        growth.Growth.free_bytes`: holes of every end, the gap between the ends, cached full-attention pages).
        O(ends)."""
        return self.growth.free_bytes()

    def compute_free_capacity(self, relative: bool = True) -> int | float:
        """Free bytes (:meth:`free_bytes`, memoized until the next allocation or free), or their share of the
        usable arena."""
        free = self.growth.free_bytes_now()
        return free / (self.arena.arena_bytes - self.arena.floor_bytes) if relative else free

    def evict_cached_blocks(self) -> bool:
        """Nothing to do: the table evicts cached pages itself when an allocation falls short (Note [Seams] 6)."""
        return False

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """Free a request's pages; with prefix sharing its full pages stay cached (unless ``no_cache``)."""
        with self._timer:
            self._free_slot(request_id, cache=self.cache_freed and not no_cache)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        with self._timer:
            self.growth.flush()
            for rid in list(self.slots):
                self._free_slot(rid, cache=self.cache_freed and not clear_ledgers)
            if clear_ledgers:
                cached = self.table.cached_pages()
                if cached.numel():
                    self.table.evict(int(cached.numel()))
                self.prefix.clear()

    def reset(self) -> None:
        self.free_all_requests(clear_ledgers=True)

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        """Share the longest indexed prefix of ``prompt_ids`` (whole pages, never the last token) with a new
        request; returns the tokens shared."""
        if not self.use_prefix_sharing:
            return 0
        with self._timer:
            ps = self.page_size
            matched = self.prefix.match(prompt_ids, ps)
            state = self.state_of(request_id) if self.state_of is not None else None
            if matched and state is not None and state.num_children > 0 and len(prompt_ids) - len(matched) * ps < 2:
                matched.pop()   # a fork parent must keep two tokens to prefill (Note [Seams] 10)
            if not matched or request_id in self.slots:
                return 0
            self.growth.flush()
            self.growth.free_bytes_memo = None
            donor, rings = -1, self.rings
            if self.ring_table is not None and self.window is not None and rings:   # Note [Sliding prefix] (prefix)
                rings.copy_forks()   # forks' rings hold their source's before they give any
                donor, k = ring_donor(matched, ((s, self.growth.held[s], self.table.pages(s).tolist())
                                                for s in self.slots.values()), self.window, ps,
                                               self.ring_tokens)
                del matched[k:]
                if not matched:
                    return 0
            got = self.table.new_requests(1)
            if got is None:
                return 0
            slot = int(got[0])
            ok = self.table.attach_prefix(slot, matched, revive=True)
            if ok and donor >= 0 and rings:
                ring = rings.give(self.ring_slots[donor], len(matched) * ps)
                ok = ring is not None
                if ring is not None:
                    self.ring_slots[slot] = ring
            if not ok:
                self.table.free_requests([slot])
                return 0
            self.slots[request_id] = slot
            self.growth.held[slot] = len(matched) * ps
            self.counters.prefix_hits += 1
            self.counters.prefix_hit_tokens += len(matched) * ps
            return len(matched) * ps

    def count_new_complete_blocks(self, state: Any, request_len: int) -> dict[str, int]:
        if not self.use_prefix_sharing:
            return {}
        ps = self.page_size
        n = (state.current_len() % ps + request_len) // ps
        return {FULL_ATTENTION: n} if n else {}

    def mark_complete_blocks(self, state: Any, complete_blocks: dict[str, int]) -> None:
        """Index the content hashes of the pages the last forward completed; a completed page whose hash is
        already indexed is replaced by the indexed page and freed (Note [Seams] 7)."""
        if not self.allow_block_sharing or not complete_blocks or state.request_id not in self.slots:
            return
        with self._timer:
            self.growth.flush()
            slot = self.slots[state.request_id]
            replaced = self.prefix.complete(self.table.pages(slot).tolist(), state.initial_tokens + state.generated_tokens,
                                            sum(complete_blocks.values()), self.page_size,
                                            lambda i, vp: self.table.share_page(slot, i, vp))
            if replaced:
                self.counters.deduplicated_pages += replaced
                self.growth.free_bytes_memo = None
                self._forget_rows([slot], [])

    def extend_read_and_write_indices(self, request_id: str, past_length: int, query_length: int,
                                      read_index: list[list[int]] | None, write_index: list[list[int]]) -> None:
        """Append the request's attention rows per attention type, in ``cache_allocators`` order (Note [Rows];
        Note [Index time] in :mod:`umalloc.integrations.transformers.groups`)."""
        with self._timer:
            self.growth.flush()
            slot = self.slots[request_id]
            ring = self.ring_slots.get(slot, slot)   # the table's own slot when it holds the rings
            keep = slot not in self.growth.forked   # Note [Row reuse] in transformers.groups
            for grp, out in zip(self.cache_allocators.values(), write_index, strict=True):
                sliding = grp.sliding_window is not None
                out.extend(grp.write_rows(ring if sliding else slot, past_length, query_length, keep or sliding))
            if read_index is not None:
                for grp, out in zip(self.cache_allocators.values(), read_index, strict=True):
                    sliding = grp.sliding_window is not None
                    out.extend(grp.read_rows(ring if sliding else slot, past_length, query_length, keep or sliding))

    def fill_block_table(self, request_id: str, past_length: int, query_length: int,
                         block_table: torch.Tensor) -> None:
        raise UnsupportedCacheError("the umalloc cache has no decode fast path (max_blocks_per_request = 0)")

    def prepare_fork_request(self, src_state: Any, dst_req_ids: list[str],
                             copy_src_and_dst: dict[str, tuple[list[int], list[int]]]) -> list[str]:
        """Fork the source into new requests: its full-attention pages shared (copy-on-write in the table), its
        ring into fresh pages that :meth:`perform_cache_copy` fills (Note [Sliding ring]); returns the ids forked
        (those the slots and pages sufficed for, in order)."""
        with self._timer:
            self.growth.flush()
            self.growth.free_bytes_memo = None
            src = self.slots[src_state.request_id]
            held = self.growth.held[src]
            if self.has_full:
                self.growth.forked.add(src)
            self._forget_rows([src], [])   # its rows are not kept while copy-on-write may rewrite its tokens
            forked = []
            for rid in dst_req_ids:
                slot = self.table.fork(src) if self.has_full else self._new_ring(src, held)
                if slot is None:
                    break
                slot = int(slot)
                if self.ring_table is not None and self.window is not None:
                    got = self.ring_table.new_requests(1)
                    ring_len = np.array([min(held, self.ring_tokens or 0)], np.int64)
                    if got is None or self.ring_table.extend(got, ring_len) is None:
                        if got is not None:
                            self.ring_table.free_requests(got)
                        self.table.free_requests([slot])
                        break
                    self.ring_slots[slot] = int(got[0])
                    self.rings.queue_fork_copy(self.ring_slots[src], int(got[0]))   # type: ignore[union-attr]
                self.slots[rid] = slot
                self.growth.held[slot] = held
                if self.has_full:
                    self.growth.forked.add(slot)
                forked.append(rid)
                self.counters.forks += 1
            self.counters.max_live_requests = max(self.counters.max_live_requests, len(self.slots))
            return forked

    def _new_ring(self, src: int, held: int) -> int | None:
        """A fork's slot when the table holds the rings (Note [All sliding]): fresh pages for ``min(held, ring)``
        tokens, queued for the copy of ``src``'s ring; None if the slots or pages fall short (nothing taken)."""
        assert self.ring_tokens is not None
        got = self.table.new_requests(1)
        if got is None:
            return None
        if self.table.extend(got, np.array([min(held, self.ring_tokens)], np.int64)) is None:
            self.table.free_requests(got)
            return None
        self.rings.queue_fork_copy(src, int(got[0]))   # type: ignore[union-attr]
        return int(got[0])

    def perform_cache_copy(self, copy_src_and_dst: dict[str, tuple[list[int], list[int]]]) -> None:
        """Copy the rings of the forks :meth:`prepare_fork_request` made (one page copy per fork on the ``swa``
        end); the full-attention pages are shared, the table copies them on write."""
        with self._timer:
            if self.rings is not None:
                self.rings.copy_forks()

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' per-layer cache call: ``key_states`` / ``value_states`` ``[1, kv_heads, q, head_dim]``;
        returns the attention's K/V ``[1, kv_heads, q + read, head_dim]`` (``kwargs`` updated in place)."""
        grp = self.layer_to_allocator[layer_idx]
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][grp.layer_type].to(torch.int32)
        kwargs["max_length_k"] = kwargs["max_length_k"][grp.layer_type]
        if kwargs.get("block_table") is not None:
            raise UnsupportedCacheError("the umalloc cache has no block-table path (max_blocks_per_request = 0)")
        k, v = (x.squeeze(0).transpose(0, 1) for x in (key_states, value_states))
        k, v = grp.update(k, v, layer_idx, kwargs["read_index"][grp.index], kwargs["write_index"][grp.index])
        return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)


__all__ = ["UmallocPagedCache"]
