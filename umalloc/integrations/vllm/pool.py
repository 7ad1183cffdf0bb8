""":class:`UmallocBlockPool`: vLLM's ``BlockPool`` with umalloc's block ids, reference counts and cached-free LRU
(the policy: :mod:`umalloc.integrations.vllm`). Importing this module imports vLLM and refuses a release outside
:data:`~umalloc.integrations.vllm.seams.SUPPORTED_VERSIONS`
(:class:`~umalloc.integrations.vllm.seams.UnsupportedVLLMVersion`); the differences between the supported
releases are Note [Release seams] in :mod:`umalloc.integrations.vllm.seams`.

Note [Touch and free paths]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
vLLM's own ``touch`` / ``free_blocks`` are Python loops over block objects (a slot read per null block, a few per
real one); here a call that reaches a umalloc kernel pays ~0.3 us of argument unboxing plus its id list, and a count
read or written through a ``memoryview`` costs about two slot reads. So each call takes the cheapest exact path. A
block of another pool goes to its own pool's ``touch`` / ``free_blocks``. ``touch`` (the most frequent call: a
request with no hit touches an empty list, which returns at once) skips the null blocks leading a sliding window's
hit by a slot read each, as vLLM does; a rest of at most :data:`TOUCH_IN_PYTHON` blocks is vLLM's loop, null blocks
skipped by a slot read each and held blocks' counts raised in place (``PageRefs.ref_counts``: an engine may raise a
held page's count); the blocks found at count 0 (cached or free) are one ``PageRefs.ref`` after the loop (a refused
one puts the raised counts back); a longer rest is one ``PageRefs.ref`` of its ids. ``free_blocks`` of several
blocks is one ``PageRefs.unref`` of their ids, null blocks as 0 entries its kernel skips; of one block,
``PageRefs.unref_one`` (Python unless the block goes back to the allocator at or above the spares' floor). Every
path ends in the same counts, states and LRU order as the kernel path. What bounds ``touch`` below vLLM's speed on
short hits: reviving a cached block takes it out of PageRefs' LRU, a ``PageRefs.ref`` of ~0.3 us for one id
(memoryview links) or ~0.5 us for a few (the kernel call and its id list), where vLLM unlinks a block from its free
list in ~0.15 us of slot writes; and a held block's count is two memoryview accesses where vLLM's is two slot
accesses. Counts in the blocks' own ``ref_cnt`` slots (umalloc holding each block once while it is positive) make
``touch`` ~15-35% faster but ``free_blocks`` (the count arithmetic moves from the kernel into a Python loop) and
``get_new_blocks`` slower, a net loss on every mix.

Threading: as vLLM's pool, called from the scheduler thread only.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import vllm
from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from umalloc import TOMBSTONE
from umalloc.errors import InvariantError, UmallocError, UmallocValueError
from umalloc.integrations.vllm.freequeue import UmallocFreeBlockQueue
from umalloc.integrations.vllm.ids import END, id_allocator
from umalloc.integrations.vllm.seams import check_version, hash_slots, pool_ref
from umalloc.requests.pagerefs import PAGE_NOT_MANAGED, PageRefs

VLLM_VERSION = check_version(str(getattr(vllm, "__version__", "unknown")))
#: the slot holding a block's hash and the one holding its token count (Note [Release seams])
HASH_SLOT, HASH_TOKENS_SLOT = hash_slots(KVCacheBlock)
#: whether ``BlockHashToBlockMap`` reads its blocks from the pool's block list (takes it at construction)
MAP_TAKES_BLOCKS = "blocks" in inspect.signature(BlockHashToBlockMap).parameters
#: whether :func:`drop_hashes` reproduces the stock eviction (the map holds blocks in ``_cache``, the hash is in
#: the underscored slots: 0.33's layout, Note [Release seams]); elsewhere the stock per-block eviction runs
INLINE_EVICT = not MAP_TAKES_BLOCKS and HASH_SLOT == "_block_hash" \
    and "_cache" in vars(BlockHashToBlockMap())


def block_class(counts: memoryview, keep: memoryview | None) -> type:
    """vLLM's ``KVCacheBlock`` whose ``ref_cnt`` is umalloc's count of the block (``counts``: the pool's
    :attr:`PageRefs.ref_counts`) and whose hash, when set or reset, sets or clears umalloc's keep flag of the
    block (``keep``: :attr:`PageRefs.keep_flags`; ``None`` with prefix caching off, where a freed block is
    never kept, as in vLLM). One class per pool: the pool's two buffers are bound as default arguments, so
    reading ``ref_cnt`` is one index, the cost of vLLM's own slot read plus a call."""

    def get(self: Any, _counts: memoryview = counts) -> int:
        return _counts[self.block_id]

    def put(self: Any, value: int, _counts: memoryview = counts) -> None:
        if self.block_id >= 0:   # the chain sentinels have no count
            _counts[self.block_id] = value

    class UmallocKVCacheBlock(KVCacheBlock):  # type: ignore[misc, valid-type, unused-ignore]
        __slots__ = ()
        ref_cnt = property(get, put, doc="umalloc's reference count of this block (PageRefs.ref_counts). O(1).")

        # the hash slots written here, one frame per call (the hash is on vLLM's hot path)
        if keep is not None and HASH_SLOT == "block_hash":
            def set_block_hash(self: Any, block_hash: Any, num_tokens: int | None = None) -> None:
                """vLLM's ``set_block_hash`` (the block must have no hash yet: AssertionError) and umalloc's
                keep flag of the block set: freed at count 0, it stays cached. O(1)."""
                assert self.block_hash is None and self.block_hash_num_tokens is None, \
                    f"block {self.block_id} already has a hash"
                self.block_hash = block_hash
                self.block_hash_num_tokens = num_tokens
                keep[self.block_id] = 1

            def reset_hash(self: Any) -> None:
                """vLLM's ``reset_hash`` and umalloc's keep flag of the block cleared. O(1)."""
                self.block_hash = None
                self.block_hash_num_tokens = None
                keep[self.block_id] = 0
        elif keep is not None:
            def set_block_hash(self: Any, block_hash: Any, num_tokens: int | None = None) -> None:
                """vLLM's ``set_block_hash`` (the block must have no hash yet: AssertionError) and umalloc's
                keep flag of the block set: freed at count 0, it stays cached. O(1)."""
                assert self._block_hash is None and self._block_hash_num_tokens is None, \
                    f"block {self.block_id} already has a hash"
                self._block_hash = block_hash
                self._block_hash_num_tokens = num_tokens
                keep[self.block_id] = 1

            def reset_hash(self: Any) -> None:
                """vLLM's ``reset_hash`` and umalloc's keep flag of the block cleared. O(1)."""
                self._block_hash = None
                self._block_hash_num_tokens = None
                keep[self.block_id] = 0

    UmallocKVCacheBlock.__module__ = __name__
    return UmallocKVCacheBlock


def drop_hashes(pool: Any, ids: list[int]) -> None:
    """vLLM's ``_maybe_evict_cached_block`` for each of ``pool``'s blocks ``ids`` (blocks handed out with a hash,
    kv-cache events and metrics off), in one loop: each hash leaves the prefix-cache map (the entry of that block
    only: another block under the same hash stays), the block's hash slots and umalloc's keep flag are cleared. A
    block with extra (partial-prefix) hashes takes the stock path. Only where :data:`INLINE_EVICT`. O(len(ids))."""
    cache = pool.cached_block_hash_to_block._cache
    extra = pool.cached_block_hashes_by_block
    blocks, keep = pool.blocks, pool.refs.keep_flags
    for i in ids:
        b = blocks[i]
        if extra and i in extra:
            pool._maybe_evict_cached_block(b)
            continue
        h = b._block_hash
        if h is None:   # no hash to drop (the stock eviction leaves the block as it is)
            continue
        got = cache.pop(h, None)
        if got is not None:
            if type(got) is dict:             # several blocks under the hash: only this one leaves
                got.pop(i, None)
                if got:
                    cache[h] = got
            elif got.block_id != i:           # another block under the hash: it stays
                cache[h] = got
        b._block_hash = None
        b._block_hash_num_tokens = None
        keep[i] = 0


#: the longest block list (null blocks leading it not counted) ``touch`` walks in Python, raising held blocks'
#: counts in place (Note [Touch and free paths]); a longer one is one ``PageRefs.ref``
TOUCH_IN_PYTHON = 8


class UmallocBlockPool(BlockPool):  # type: ignore[misc, valid-type, unused-ignore]
    """vLLM ``BlockPool`` whose blocks' ids, reference counts and cached-free LRU are umalloc's (the policy:
    :mod:`umalloc.integrations.vllm`).

    Same constructor and methods as the installed vLLM's ``BlockPool`` (0.34's ``free_blocks(blocks,
    evict_first=False)`` included); additionally :attr:`allocator` (the id allocator), :attr:`refs` (its
    :class:`~umalloc.requests.pagerefs.PageRefs`, the blocks' only owner), :meth:`free_ids`, :meth:`adopt` and
    :meth:`check_invariants`. ``free_block_queue`` is a read-only
    :class:`~umalloc.integrations.vllm.freequeue.UmallocFreeBlockQueue`. Complexities: ``get_new_blocks(n)``
    O(n + evicted) plus at most three umalloc kernel calls; ``free_blocks``/``touch`` O(blocks) plus one or two;
    ``get_num_free_blocks`` O(1).
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 *args: Any, **kwargs: Any) -> None:
        super().__init__(num_gpu_blocks, enable_caching, hash_block_size, *args, **kwargs)
        self.allocator = id_allocator(num_gpu_blocks)
        self.refs = PageRefs(self.allocator)
        cls = block_class(self.refs.ref_counts, self.refs.keep_flags if enable_caching else None)
        self._ref = ref = pool_ref(self)   # what this pool's blocks hold as their pool (Note [Release seams])
        self.blocks = [cls(i, pool=ref) for i in range(num_gpu_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        if MAP_TAKES_BLOCKS:   # the stock map holds ids into the block list just replaced
            self.cached_block_hash_to_block = BlockHashToBlockMap(self.blocks)
        self.free_block_queue = UmallocFreeBlockQueue(self, cls)
        self._linked: list[Any] = []   # blocks the last free-chain snapshot linked
        self._unref_one = self.refs.unref_one
        self._counts = self.refs.ref_counts

    def _unlink(self) -> None:
        for b in self._linked:
            b.prev_free_block = b.next_free_block = None
        self._linked = []

    # ---- umalloc side ----------------------------------------------------------------------------------------
    def free_ids(self) -> np.ndarray:
        """Block ids free in umalloc, ascending (the order ``get_new_blocks`` hands them out): a new ``int64``
        numpy array. O(num_gpu_blocks)."""
        return self.refs.free_ids()

    def adopt(self, block: Any) -> None:
        """Take exactly ``block``'s id out of umalloc's free ids with one reference (one ``claim_pages`` call).

        Raises:
            UmallocValueError: ``block`` is the null block or its id is not free in umalloc.
        """
        if block.is_null or not 0 < block.block_id < len(self.blocks) \
                or self.refs.state(block.block_id) != PAGE_NOT_MANAGED:
            raise UmallocValueError(f"adopt: block {block.block_id} is not free in umalloc; allowed one of "
                                    f"the {self.refs.num_free} free ids")
        if self._linked:
            self._unlink()
        self.refs.ref([block.block_id])

    # ---- vLLM's BlockPool API --------------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        refs = self.refs
        return refs.num_free + refs.num_cached

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        refs = self.refs
        if self._linked:
            self._unlink()
        blocks = self.blocks
        try:
            if num_blocks == 1:   # a decode or window step: no buffer, no map (PageRefs.take_one)
                v = refs.take_one()
                ret = [blocks[v]]
                if not self._reuse_watchers and not self.metrics_collector:
                    if refs.num_taken_kept:   # an evicted block: its hash leaves the map
                        if INLINE_EVICT and not self.enable_kv_cache_events \
                                and type(self.cached_block_hash_to_block) is BlockHashToBlockMap:
                            drop_hashes(self, [v])
                        else:
                            self._maybe_evict_cached_block(ret[0])
                    return ret
                ids = None
            else:
                ids = refs.take(num_blocks)
        except UmallocValueError:   # nothing changed
            raise UmallocValueError(f"Cannot get {num_blocks} free blocks from the pool: allowed at most "
                                    f"{refs.num_free + refs.num_cached}") from None
        if ids is not None:
            ret = list(map(blocks.__getitem__, ids))
        # the blocks handed out with a hash (evicted cached ones, or a hash put on a free block): vLLM's
        # per-block eviction runs for these only, the others have no hash to drop
        kept = refs.taken_kept().tolist() if refs.num_taken_kept else ()
        if self._reuse_watchers:
            self._notify_reuse(ret)
        metrics = self.metrics_collector
        if metrics:
            for block in ret:
                if self.enable_caching:
                    self._maybe_evict_cached_block(block)
                metrics.on_block_allocated(block)
        elif kept:
            if INLINE_EVICT and not self.enable_kv_cache_events \
                    and type(self.cached_block_hash_to_block) is BlockHashToBlockMap:
                drop_hashes(self, kept)
            else:
                for i in kept:
                    self._maybe_evict_cached_block(blocks[i])
        return ret

    def touch(self, blocks: Sequence[Any]) -> None:
        """vLLM's ``touch``: one reference more per block, null blocks skipped (Note [Touch and free paths])."""
        if not blocks:   # a request with no prefix hit
            return
        if type(blocks) is not list:
            blocks = list(blocks)
        rest = blocks
        if blocks[0].is_null:   # a sliding window's hit starts with null blocks: a slot read each, as vLLM
            s = 1
            for b in blocks[1:]:
                if not b.is_null:
                    break
                s += 1
            rest = blocks[s:]
        ref = self._ref
        if len(rest) > TOUCH_IN_PYTHON:   # one PageRefs.ref; null blocks are 0 entries its kernel skips
            ids = [b.block_id for b in rest if b.pool is ref]
            theirs = None
            if len(ids) != len(rest):   # blocks of other pools go to their own pool, as free_blocks does
                ids, theirs = self._split_pools(rest)
            if self._linked:
                self._unlink()
            if ids:
                self.refs.ref(ids)
            if theirs:
                for pool, their_blocks in theirs.items():
                    pool.touch(their_blocks)
        elif rest:
            self._touch_short(rest)
        if self.metrics_collector:
            for block in blocks:
                if not block.is_null and (block.pool is ref or block.pool is None):
                    self.metrics_collector.on_block_accessed(block)

    def _split_pools(self, blocks: Sequence[Any]) -> tuple[list[int], dict[Any, list[Any]]]:
        """(ids of this pool's blocks, null blocks and pool-less blocks -- :meth:`PageRefs.ref` skips 0 entries and
        refuses ids not in the pool --, the other pools' blocks by pool). O(len(blocks))."""
        ref = self._ref
        ids: list[int] = []
        theirs: dict[Any, list[Any]] = {}
        for b in blocks:
            pool = b.pool
            if pool is ref or pool is None or b.is_null:
                ids.append(b.block_id)
            else:
                pool = pool() if isinstance(pool, weakref.ref) else pool   # 0.34 holds a weakref
                if pool is not None:
                    theirs.setdefault(pool, []).append(b)
        return ids, theirs

    def _touch_short(self, blocks: Sequence[Any]) -> None:
        """``touch`` of at most :data:`TOUCH_IN_PYTHON` blocks: vLLM's loop, held blocks' counts raised in place
        (as PageRefs allows), the blocks at count 0 (cached or free) one ``PageRefs.ref`` after it (a block
        listed twice is counted there once per entry); another pool's blocks go to that pool's ``touch`` after.
        A refused call puts the raised counts back."""
        counts, ref = self._counts, self._ref
        zeros = theirs = None
        try:
            for b in blocks:
                if b.is_null:
                    continue
                if b.pool is not ref and b.pool is not None:   # another pool's block: touched there below
                    if theirs is None:
                        theirs = [b]
                    else:
                        theirs.append(b)
                    continue
                v = b.block_id
                c = counts[v] if v > 0 else 0
                if c:
                    counts[v] = c + 1
                elif zeros is None:
                    zeros = [v]
                else:
                    zeros.append(v)
        except Exception as e:   # an id past the pool, not an int, or not a block: nothing stays raised
            self._undo_touch(blocks, b, zeros)
            if isinstance(e, (IndexError, TypeError)):
                self.refs.ref([b.block_id])   # PageRefs' own refusal (InvalidIdError)
            raise
        if zeros is not None:
            if self._linked:
                self._unlink()
            try:
                self.refs.ref(zeros)
            except UmallocError:   # refused, nothing changed there: nor here
                self._undo_touch(blocks, None, zeros)
                raise
        if theirs is not None:
            for pool, their_blocks in self._split_pools(theirs)[1].items():
                pool.touch(their_blocks)

    def _undo_touch(self, blocks: Sequence[Any], stop: Any, zeros: list[int] | None) -> None:
        """The counts :meth:`_touch_short` raised go back: every non-null entry of ``blocks`` before ``stop``
        (all, for ``None``) of this pool whose id is not in ``zeros`` (those were not raised)."""
        counts, skip, ref = self._counts, set(zeros or ()), self._ref
        for b in blocks:
            if b is stop:
                return
            if not b.is_null and (b.pool is ref or b.pool is None) and b.block_id not in skip:
                counts[b.block_id] -= 1

    def free_blocks(self, ordered_blocks: Iterable[Any], evict_first: bool = False) -> None:
        """vLLM's ``free_blocks``: one reference less per block (module docstring's Free). ``evict_first``
        (vLLM 0.34: blocks whose content another tier holds): the blocks this call caches go to the LRU head,
        in the batch's order, so they are evicted before any other cached block."""
        if type(ordered_blocks) is list and len(ordered_blocks) == 1:   # one block (a window's step)
            b = ordered_blocks[0]
            if b.pool is self._ref:
                if self._linked:
                    self._unlink()
                self._unref_one(b.block_id)   # PageRefs.unref_one: in Python unless the block leaves umalloc
                if evict_first and self.enable_caching:
                    self.refs.cache_first([b.block_id])
                return
        blocks = ordered_blocks if type(ordered_blocks) is list else list(ordered_blocks)
        ref = self._ref
        ids = [b.block_id for b in blocks if b.pool is ref]   # kept or freed at 0 by the keep flags
        if len(ids) == len(blocks):
            if any(ids):   # 0 entries (null blocks: a sliding window's) are skipped in PageRefs.unref's kernel
                if self._linked:
                    self._unlink()
                self.refs.unref(ids)
                if evict_first and self.enable_caching:
                    self.refs.cache_first(ids)
            return
        other_pools: dict[Any, list[Any]] = {}   # blocks of other pools (deferred frees), or pool-less blocks
        ids = []
        bare = []
        for b in blocks:
            if b.pool is ref:
                ids.append(b.block_id)
            elif b.pool is not None:
                pool = b.pool() if isinstance(b.pool, weakref.ref) else b.pool   # 0.34 holds a weakref
                if pool is not None:
                    other_pools.setdefault(pool, []).append(b)
            elif not b.is_null:
                bare.append(b)
        if ids:
            if self._linked:
                self._unlink()
            self.refs.unref(ids)   # a refused one changes nothing, and nothing below runs
            if evict_first and self.enable_caching:
                self.refs.cache_first(ids)
        for b in bare:
            b.ref_cnt -= 1   # a bare KVCacheBlock (not one of this pool's): its own count, as vLLM
        for pool, theirs in other_pools.items():
            if evict_first:
                pool.free_blocks(theirs, evict_first=True)
            else:
                pool.free_blocks(theirs)

    def unpin_blocks(self, blocks: Iterable[Any], on_reuse: Callable[[Any], None]) -> None:
        ids: list[int] = []
        for block in blocks:
            assert block.ref_cnt > 0 and not block.is_null
            self._reuse_watchers[block.block_id] = on_reuse
            ids.append(-block.block_id)   # cached at count 0 whatever its hash: a reader still reads it
        if ids:
            if self._linked:
                self._unlink()
            self.refs.unref(ids)

    def evict_blocks(self, block_ids: set[int]) -> None:
        back: list[int] = []
        for block_id in block_ids:
            assert block_id < len(self.blocks), f"Invalid block_id {block_id} >= {len(self.blocks)}"
            if self._maybe_evict_cached_block(self.blocks[block_id]):
                back.append(block_id)
        if back:
            if self._linked:
                self._unlink()
            self.refs.uncache(back)   # the un-hashed cached ones go back to umalloc; held ones stay held

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        if self._linked:
            self._unlink()
        self.refs.uncache_all()
        return True

    # ---- checks ----------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """O(num_gpu_blocks): umalloc's invariants (the allocator's and the block owner's:
        :meth:`PageRefs.check_invariants` -- a leaked block, a count set behind the pool, a block freed or
        allocated behind it); ``v2p`` is the identity on live ids; the null block is id 0 and never handed out;
        a block's keep flag is set iff it has a hash (prefix caching on). Raises
        :class:`~umalloc.errors.InvariantError`."""
        self.allocator.check_invariants()
        v2p = self.allocator.v2p(END).numpy()
        live = np.flatnonzero(v2p != TOMBSTONE)
        if not np.array_equal(v2p[live], live):
            raise InvariantError("identity: v2p differs from the identity on live block ids")
        if not self.null_block.is_null or self.null_block.block_id != 0 or v2p[0] != 0 \
                or self.blocks[0] is not self.null_block:
            raise InvariantError("null-block: block 0 must be the null block on umalloc's reserved page 0")
        keep = self.refs.keep_flags
        for b in self.blocks:   # the keep flags are the blocks' hashes (set and reset through the block)
            if keep[b.block_id] != (self.enable_caching and b.block_hash is not None):
                raise InvariantError(f"keep-flags: block {b.block_id} has hash {b.block_hash!r} but umalloc's "
                                     f"keep flag {keep[b.block_id]} (a hash written behind set_block_hash)")


__all__ = ["HASH_SLOT", "HASH_TOKENS_SLOT", "INLINE_EVICT", "TOUCH_IN_PYTHON", "VLLM_VERSION", "UmallocBlockPool",
           "block_class", "drop_hashes"]
