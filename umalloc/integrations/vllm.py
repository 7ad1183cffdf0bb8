"""umalloc behind vLLM's ``BlockPool``: block ids and the free list come from a umalloc allocator.

Enable it with one call before vLLM builds its KV-cache manager::

    import umalloc.integrations.vllm
    umalloc.integrations.vllm.install()     # vLLM's coordinators now build UmallocBlockPool

Tested with vLLM 0.33.0 (:data:`SUPPORTED_VLLM_VERSIONS`; the ``umalloc[vllm]`` extra pins it); :func:`install`
refuses other versions because the pool overrides vLLM internals (``free_block_queue``, the reuse watchers).

Policy:

* **Who owns what.** Block ``i`` of the pool is virtual page ``i`` of a one-end umalloc allocator with
  ``num_gpu_blocks`` page slots (one 16-byte id page per block: the allocator hands out ids, vLLM keeps its own
  KV tensors). umalloc owns the free ids: a block whose reference count is 0 and that holds nothing worth
  keeping is *free in umalloc*. vLLM's ``KVCacheBlock`` objects, their ``ref_cnt``, the prefix-cache hash map
  and the KV events stay vLLM's, unchanged. umalloc has no reference counts or cached pages yet, so two things
  stay in this adapter: ``ref_cnt`` (vLLM's field) and the *evictable* list -- blocks with ``ref_cnt == 0``
  that keep their id because their content is still useful (a prefix-cache hash, or an ``unpin_blocks``
  reader), in LRU order (vLLM's own ``FreeKVCacheBlockQueue``).
* **null_block** is block 0 = umalloc's reserved virtual page 0 (mapped to the sink page, never handed out).
* **Allocation** (``get_new_blocks(n)``): when umalloc has fewer than ``n`` free ids, the least recently used
  evictable blocks go back to umalloc first, exactly as many as missing; then one ``alloc_pages(n)`` call.
  The blocks a call returns are therefore always umalloc's ``n`` lowest free ids, in ascending order, and
  cached blocks are evicted only when no uncached free block is left -- the same eviction rule as vLLM's.
* **By design, not vLLM's order**: vLLM reuses the most recently freed block first (LIFO) to keep the GPU
  cache warm; umalloc hands out the lowest free id, so fresh blocks form ascending contiguous runs
  (fewer transfer descriptors, a compact high end). Tests that pin vLLM's exact reuse order see the
  difference; nothing else does.
* **Free** (``free_blocks``): blocks reaching ``ref_cnt == 0`` without a hash go back to umalloc in one
  ``free_pages`` call; hashed blocks join the evictable list's tail (vLLM's LRU rule). ``unpin_blocks`` puts
  released blocks at the evictable tail (last resort), as vLLM does. ``evict_blocks`` and a successful
  ``reset_prefix_cache`` return the evictable blocks they un-hash to umalloc.
* **Adopting a specific id**: a prefix-cache hit may name a block that umalloc holds as free (a hash put on
  a never-allocated block, as a KV connector or a test can do); ``touch`` then takes exactly that id out of
  umalloc (:meth:`UmallocBlockPool.adopt`), so the hit is served as vLLM serves it.
* Block ids equal physical pages: with one ``up`` end and compaction off, umalloc gives the ``j``-th lowest
  free virtual id the ``j``-th lowest free physical page, so ``v2p`` stays the identity and vLLM's block
  tables index its KV tensors directly (:meth:`UmallocBlockPool.check_invariants` checks it).

Threading: as vLLM's pool, called from the scheduler thread only.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from umalloc import TOMBSTONE, Arena, ArenaSpec, EndSpec, LayerSpec, MultiEndedAllocator
from umalloc.errors import InvariantError, UmallocError, UmallocValueError

#: vLLM versions this adapter is tested with (the ``umalloc[vllm]`` extra pins them).
SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.33.0",)

#: Name of the one end of a pool's id allocator.
END = "blocks"
#: Bytes of one id page (the smallest page an arena holds: 1 token x 1 head x (4 + 4) bf16 elements).
ID_PAGE_BYTES = 16


def id_allocator(num_blocks: int) -> MultiEndedAllocator:
    """A one-end allocator whose virtual pages are the block ids ``1 .. num_blocks - 1`` (id 0 reserved).

    Args:
        num_blocks: pool size in blocks, the null block included (an int >= 2).

    Returns:
        a :class:`~umalloc.MultiEndedAllocator` over an arena of ``num_blocks * 16`` bytes, ``compaction="off"``.

    Raises:
        UmallocValueError: ``num_blocks`` not an int >= 2.

    >>> alloc = id_allocator(4)
    >>> alloc.alloc_pages(3).tolist(), alloc.available_pages(END)
    ([1, 2, 3], 0)
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
        raise UmallocValueError(f"num_blocks={num_blocks!r}: allowed an int >= 2 (the null block plus one)")
    end = EndSpec(END, (LayerSpec.mha(1, 4),), page_size=1)
    return MultiEndedAllocator(Arena(ArenaSpec((end,), arena_bytes=num_blocks * ID_PAGE_BYTES)), compaction="off")


class UmallocFreeBlockQueue:
    """Read-only stand-in for vLLM's ``FreeKVCacheBlockQueue`` on a :class:`UmallocBlockPool`: every block with
    ``ref_cnt == 0`` in allocation order -- umalloc's free ids ascending, then the evictable blocks, LRU first.

    The pool mutates its two parts itself; this object only answers the readers vLLM and its tests have:
    ``num_free_blocks``, ``get_all_free_blocks``, ``iter_blocks_after`` and the linked list's ends
    (Note [Free chain snapshot]).

    Note [Free chain snapshot]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~
    vLLM's readers may walk the free list by hand, ``fake_free_list_head.next_free_block...`` until a block
    whose ``next_free_block`` is ``None``. Blocks free in umalloc are in no list, so reading
    ``fake_free_list_head`` links them, ascending, in front of the evictable list through ``next_free_block``
    only (their ``prev_free_block`` stays ``None``: that is how the pool tells them from evictable blocks) and
    returns a head of its own; with no block free in umalloc it is the evictable list's real head. The chain
    is a snapshot of the moment of reading: the pool clears a block's stale ``next_free_block`` when it hands
    the block out. O(num_gpu_blocks) per read.
    """

    def __init__(self, pool: Any, evictable: Any) -> None:
        self._pool = pool
        self._evictable = evictable
        self._snapshot_head = type(evictable.fake_free_list_head)(block_id=-1)

    @property
    def num_free_blocks(self) -> int:
        """Blocks free in umalloc plus evictable blocks. O(1)."""
        return self._pool.get_num_free_blocks()

    @property
    def fake_free_list_head(self) -> Any:
        """Head of the chain through every free block in allocation order (Note [Free chain snapshot])."""
        free = self._pool.free_ids()
        if free.size == 0:
            return self._evictable.fake_free_list_head
        blocks = self._pool.blocks
        prev = self._snapshot_head
        for i in free.tolist():
            prev.next_free_block = blocks[i]
            prev = blocks[i]
        prev.next_free_block = self._evictable.fake_free_list_head.next_free_block
        return self._snapshot_head

    @property
    def fake_free_list_tail(self) -> Any:
        return self._evictable.fake_free_list_tail

    def get_all_free_blocks(self) -> list[Any]:
        """Every free block in the order allocation takes them. O(num_gpu_blocks)."""
        blocks = self._pool.blocks
        return [blocks[i] for i in self._pool.free_ids().tolist()] + self._evictable.get_all_free_blocks()

    def iter_blocks_after(self, cursor: Any | None) -> Iterator[Any]:
        """Free blocks in allocation order after ``cursor`` (``None``: from the first). O(num_gpu_blocks)."""
        if cursor is None or cursor.prev_free_block is None:
            first = 0 if cursor is None else cursor.block_id + 1
            blocks = self._pool.blocks
            for i in self._pool.free_ids().tolist():
                if i >= first:
                    yield blocks[i]
            cursor = None
        yield from self._evictable.iter_blocks_after(cursor)


@functools.cache
def _pool_class() -> type:
    """Build :class:`UmallocBlockPool` on first use (vLLM is imported only then)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    class UmallocBlockPool(BlockPool):  # type: ignore[misc, valid-type, unused-ignore]
        """vLLM ``BlockPool`` with block ids and the free list from umalloc (module docstring for the policy).

        Same constructor and methods as vLLM's ``BlockPool``; additionally :attr:`allocator`, :meth:`free_ids`,
        :meth:`adopt` and :meth:`check_invariants`. ``free_block_queue`` is a read-only
        :class:`UmallocFreeBlockQueue`. Complexities: ``get_new_blocks(n)`` O(n + evicted) plus one umalloc
        kernel call; ``free_blocks`` O(blocks) plus one; ``get_num_free_blocks`` O(1).
        """

        def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                     *args: Any, **kwargs: Any) -> None:
            super().__init__(num_gpu_blocks, enable_caching, hash_block_size, *args, **kwargs)
            self.allocator = id_allocator(num_gpu_blocks)
            for block in self.blocks:  # vLLM's queue linked every block: umalloc holds them now
                block.prev_free_block = block.next_free_block = None
            self._evictable = FreeKVCacheBlockQueue([])
            self.free_block_queue = UmallocFreeBlockQueue(self, self._evictable)

        # ---- umalloc side ------------------------------------------------------------------------------
        def free_ids(self) -> np.ndarray:
            """Block ids free in umalloc, ascending (the order ``get_new_blocks`` hands them out): a new
            ``int64`` numpy array. O(num_gpu_blocks)."""
            v2p = self.allocator.v2p(END).numpy()
            return np.flatnonzero(v2p == TOMBSTONE).astype(np.int64)

        def adopt(self, block: Any) -> None:
            """Take exactly ``block``'s id out of umalloc's free ids (it keeps ``ref_cnt`` 0; the caller
            raises it). The lower free ids are allocated with it and freed again: two umalloc calls.

            Raises:
                UmallocValueError: ``block`` is the null block or its id is not free in umalloc.
            """
            free = self.free_ids()
            below = int(np.searchsorted(free, block.block_id))
            if block.is_null or below == free.size or free[below] != block.block_id:
                raise UmallocValueError(f"adopt: block {block.block_id} is not free in umalloc; allowed one of "
                                        f"the {free.size} free ids")
            got = self.allocator.alloc_pages(below + 1)
            if got is None or int(got[-1]) != block.block_id:
                raise InvariantError(f"lowest-free-first: alloc_pages({below + 1}) gave {got} while adopting "
                                     f"block {block.block_id}")
            if below:
                self.allocator.free_pages(got[:-1].numpy())
            block.next_free_block = None  # Note [Free chain snapshot]

        def _free_to_umalloc(self, blocks: Sequence[Any]) -> None:
            if blocks:
                self.allocator.free_pages(np.fromiter((b.block_id for b in blocks), np.int64, len(blocks)))

        # ---- vLLM's BlockPool API ----------------------------------------------------------------------
        def get_num_free_blocks(self) -> int:
            return self.allocator.available_pages(END) + self._evictable.num_free_blocks

        def get_new_blocks(self, num_blocks: int) -> list[Any]:
            free = self.allocator.available_pages(END)
            if num_blocks > free + self._evictable.num_free_blocks:
                raise UmallocValueError(f"Cannot get {num_blocks} free blocks from the pool: allowed at most "
                                        f"{free + self._evictable.num_free_blocks}")
            if num_blocks <= 0:
                return []
            if num_blocks > free:  # LRU evictable blocks back to umalloc, exactly as many as missing
                self._free_to_umalloc(self._evictable.popleft_n(num_blocks - free))
            ids = self.allocator.alloc_pages(num_blocks)
            if ids is None:
                raise InvariantError(f"free-count: umalloc refused {num_blocks} ids it counted as free")
            ret = [self.blocks[i] for i in ids.tolist()]
            if self._reuse_watchers:
                self._notify_reuse(ret)
            for block in ret:
                block.next_free_block = None  # Note [Free chain snapshot]
                if self.enable_caching:
                    self._maybe_evict_cached_block(block)
                assert block.ref_cnt == 0
                block.ref_cnt += 1
                if self.metrics_collector:
                    self.metrics_collector.on_block_allocated(block)
            return ret

        def touch(self, blocks: Sequence[Any]) -> None:
            for block in blocks:
                if block.is_null:
                    continue
                if block.ref_cnt == 0:
                    if block.prev_free_block is not None:
                        self._evictable.remove(block)
                    else:
                        self.adopt(block)
                block.ref_cnt += 1
                if self.metrics_collector:
                    self.metrics_collector.on_block_accessed(block)

        def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
            to_umalloc: list[Any] = []
            to_evictable: list[Any] = []
            other_pools: dict[Any, list[Any]] = {}
            for block in ordered_blocks:
                if block.is_null:  # never pooled; its ref_cnt is not maintained
                    continue
                if block.pool is not None and block.pool is not self:
                    other_pools.setdefault(block.pool, []).append(block)
                    continue
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    if block.block_hash is None or not self.enable_caching:
                        to_umalloc.append(block)
                    else:
                        to_evictable.append(block)
            self._free_to_umalloc(to_umalloc)
            self._evictable.append_n(to_evictable)
            for pool, blocks in other_pools.items():
                pool.free_blocks(blocks)

        def unpin_blocks(self, blocks: Iterable[Any], on_reuse: Callable[[Any], None]) -> None:
            released: list[Any] = []
            for block in blocks:
                assert block.ref_cnt > 0 and not block.is_null
                block.ref_cnt -= 1
                self._reuse_watchers[block.block_id] = on_reuse
                if block.ref_cnt == 0:
                    released.append(block)
            self._evictable.append_n(released)

        def evict_blocks(self, block_ids: set[int]) -> None:
            back: list[Any] = []
            for block_id in block_ids:
                assert block_id < len(self.blocks), f"Invalid block_id {block_id} >= {len(self.blocks)}"
                block = self.blocks[block_id]
                if self._maybe_evict_cached_block(block) and block.ref_cnt == 0 \
                        and block.prev_free_block is not None:
                    self._evictable.remove(block)
                    back.append(block)
            self._free_to_umalloc(back)

        def reset_prefix_cache(self) -> bool:
            if not super().reset_prefix_cache():
                return False
            self._free_to_umalloc(self._evictable.popleft_n(self._evictable.num_free_blocks))
            return True

        # ---- checks ------------------------------------------------------------------------------------
        def check_invariants(self) -> None:
            """O(num_gpu_blocks): umalloc's own invariants; ``v2p`` is the identity on live ids; a block is free
            in umalloc iff its ``ref_cnt`` is 0 and it is not evictable; evictable blocks have ``ref_cnt`` 0; the
            null block is id 0 and never handed out. Raises :class:`~umalloc.errors.InvariantError`."""
            self.allocator.check_invariants()
            v2p = self.allocator.v2p(END).numpy()
            live = np.flatnonzero(v2p != TOMBSTONE)
            if not np.array_equal(v2p[live], live):
                raise InvariantError("identity: v2p differs from the identity on live block ids")
            evictable = {b.block_id for b in self._evictable.get_all_free_blocks()}
            if len(evictable) != self._evictable.num_free_blocks:
                raise InvariantError("evictable-count: the evictable list and its count disagree")
            free = set(np.flatnonzero(v2p == TOMBSTONE).tolist())
            for block in self.blocks[1:]:
                idle = block.ref_cnt == 0 and block.block_id not in evictable
                if idle != (block.block_id in free):
                    raise InvariantError(f"ownership: block {block.block_id} (ref_cnt {block.ref_cnt}, "
                                         f"evictable {block.block_id in evictable}) is "
                                         f"{'free' if block.block_id in free else 'live'} in umalloc")
                if block.block_id in evictable and block.ref_cnt != 0:
                    raise InvariantError(f"evictable-idle: block {block.block_id} has ref_cnt {block.ref_cnt}")
            if not self.null_block.is_null or self.null_block.block_id != 0 or v2p[0] != 0:
                raise InvariantError("null-block: block 0 must be the null block on umalloc's reserved page 0")

    UmallocBlockPool.__module__ = __name__
    return UmallocBlockPool


def install() -> type:
    """Make vLLM build :class:`UmallocBlockPool` wherever it builds a ``BlockPool``: rebinds the name in
    ``vllm.v1.core.block_pool`` and in every loaded module of ``vllm.v1.core`` that imported it (the KV-cache
    coordinators). Call it before vLLM builds its scheduler (modules that import ``BlockPool`` later get the
    new class too). Idempotent. The hisparse host pool (``SharedEventQueueBlockPool``, a subclass of the stock
    class) stays vLLM's.

    Returns:
        the pool class.

    Raises:
        ImportError: vLLM is not installed. UmallocError: the installed vLLM is not one of
        :data:`SUPPORTED_VLLM_VERSIONS`.
    """
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if version not in SUPPORTED_VLLM_VERSIONS:
        raise UmallocError(f"vLLM {version} is untested with umalloc.integrations.vllm; allowed "
                           f"{', '.join(SUPPORTED_VLLM_VERSIONS)} (pip install 'umalloc[vllm]')")
    import vllm.v1.core.kv_cache_coordinator  # noqa: F401 - the module that builds the pool

    pool = _pool_class()
    stock = pool.__mro__[1]
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.v1.core") and getattr(module, "BlockPool", None) is stock:
            setattr(module, "BlockPool", pool)  # noqa: B010 - rebinding another package's module attribute
    return pool


def __getattr__(name: str) -> Any:
    if name == "UmallocBlockPool":
        return _pool_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# UmallocBlockPool is reached as an attribute (module __getattr__: it imports vLLM), so it is not in __all__
__all__ = ["END", "ID_PAGE_BYTES", "SUPPORTED_VLLM_VERSIONS", "UmallocFreeBlockQueue", "id_allocator", "install"]
