"""umalloc behind vLLM's ``BlockPool``: block ids, reference counts and the cached-free LRU are umalloc's.

Enable it with one call before vLLM builds its KV-cache manager::

    import umalloc.integrations.vllm
    umalloc.integrations.vllm.install()     # vLLM's coordinators now build UmallocBlockPool

Tested with vLLM 0.33.0 (:data:`SUPPORTED_VERSIONS`; the ``umalloc[vllm]`` extra pins it); :func:`install`
refuses other versions (:class:`UnsupportedVLLMVersion`) because the pool overrides vLLM internals
(``free_block_queue``, the reuse watchers). :func:`uninstall` and :func:`installed` (a context manager) undo it.

Policy:

* **Who owns what.** Block ``i`` of the pool is virtual page ``i`` of a one-end umalloc id allocator with
  ``num_gpu_blocks`` page slots (one 16-byte id page per block: the allocator hands out ids, vLLM keeps its own
  KV tensors). One :class:`~umalloc.requests.pagerefs.PageRefs` over it holds every block's holders: its reference
  count (``KVCacheBlock.ref_cnt`` of this pool's blocks reads and writes umalloc's count; there is no second
  copy) and whether a block with count 0 is *cached* (content kept, in umalloc's LRU: the page states and links
  the request table uses) or free in the allocator, and whether a block's content is worth keeping (its keep
  flag: "has a hash"). vLLM keeps what only it knows: the prefix-cache hash map,
  the hashes on the blocks, the KV events and metrics. umalloc's invariants
  (:meth:`UmallocBlockPool.check_invariants`) report a leaked block (held with count 0, or live in the
  allocator with no holder); a double free raises :class:`~umalloc.errors.DoubleFreeError`, nothing changed.
* **null_block** is block 0 = umalloc's reserved virtual page 0 (mapped to the sink page, never handed out).
* **Allocation** (``get_new_blocks(n)``): when umalloc has fewer than ``n`` free ids, the least recently used
  cached blocks go back to it first, exactly as many as missing (their hashes leave vLLM's map); all in one
  ``PageRefs.take(n)`` kernel call (Note [Fused kernels] in :mod:`umalloc.requests.pagerefs`). The blocks a call returns are umalloc's ``n`` lowest free ids, ascending, and cached
  blocks are evicted only when no uncached free block is left, oldest first -- vLLM's eviction rule.
* **By design, not vLLM's order**: vLLM reuses the most recently freed block first (LIFO) to keep the GPU
  cache warm; umalloc hands out the lowest free id, so fresh blocks form ascending contiguous runs
  (fewer transfer descriptors, a compact high end). Tests that pin vLLM's exact reuse order see the
  difference; nothing else does.
* **Free** (``free_blocks``): one ``unref`` of the batch's ids: a block reaching count 0 goes back to umalloc,
  or joins the LRU tail if umalloc's keep flag of it is set -- the block's ``set_block_hash`` / ``reset_hash``
  set and clear it, so the flag is "has a hash" (vLLM's rule) and the free path reads nothing but ids. A bare
  ``KVCacheBlock`` that is not one of the pool's blocks (``pool=None``, as some of vLLM's tests build) only has
  its own ``ref_cnt`` lowered, as vLLM does. ``unpin_blocks`` puts released blocks at the LRU tail (last
  resort), as vLLM does. ``evict_blocks`` and a successful ``reset_prefix_cache`` return the cached blocks they
  un-hash to umalloc.
* **A specific id**: a prefix-cache hit may name a block that umalloc holds as free (a hash put on a
  never-allocated block, as a KV connector or a test can do); ``touch`` then claims exactly that id from the
  allocator (:meth:`~umalloc.allocator.facade.MultiEndedAllocator.claim_pages`), so the hit is served as vLLM
  serves it.
* Block ids equal physical pages: with one ``up`` end and compaction off, umalloc gives the ``j``-th lowest
  free virtual id the ``j``-th lowest free physical page (and a claimed id its own page), so ``v2p`` stays the
  identity and vLLM's block tables index its KV tensors directly (:meth:`UmallocBlockPool.check_invariants`).

Threading: as vLLM's pool, called from the scheduler thread only.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from umalloc import TOMBSTONE, Arena, ArenaSpec, EndSpec, LayerSpec, MultiEndedAllocator
from umalloc.errors import InvariantError, UmallocValueError
from umalloc.integrations.versions import EngineVersionError, check_engine_version
from umalloc.requests.pagerefs import PAGE_NOT_MANAGED, PageRefs

#: vLLM versions this adapter is tested with (the ``umalloc[vllm]`` extra pins them).
SUPPORTED_VERSIONS: tuple[str, ...] = ("0.33.0",)
SUPPORTED_VLLM_VERSIONS = SUPPORTED_VERSIONS   #: the same tuple under the name earlier releases used


class UnsupportedVLLMVersion(EngineVersionError):
    """:func:`install` on a vLLM release this adapter was not tested against (nothing is rebound)."""


#: module name -> the stock ``BlockPool`` that :func:`install` replaced there (what :func:`uninstall` restores)
_rebound: dict[str, type] = {}

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
    count 0 in allocation order -- umalloc's free ids ascending, then the cached blocks, LRU first.

    The pool's :class:`~umalloc.requests.pagerefs.PageRefs` holds both parts; this object only answers the readers
    vLLM and its tests have: ``num_free_blocks``, ``get_all_free_blocks``, ``iter_blocks_after`` and the linked
    list's ends (Note [Free chain snapshot]).

    Note [Free chain snapshot]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~
    vLLM's readers may walk the free list by hand, ``fake_free_list_head.next_free_block...`` until a block
    whose ``next_free_block`` is ``None`` (the tail sentinel). Free blocks are in no Python list, so reading
    ``fake_free_list_head`` links every free block in allocation order through ``prev_free_block`` /
    ``next_free_block`` between a head and a tail sentinel of this object's own. The chain is a snapshot of the
    moment of reading: the pool's next call that changes a block's state clears the links it set.
    O(num_gpu_blocks) per read.
    """

    def __init__(self, pool: Any, block_cls: type) -> None:
        self._pool = pool
        self._head = block_cls(block_id=-1)
        self._tail = block_cls(block_id=-1)

    @property
    def num_free_blocks(self) -> int:
        """Blocks free in umalloc plus cached blocks. O(1)."""
        refs = self._pool.refs
        return refs.num_free + refs.num_cached

    @property
    def fake_free_list_head(self) -> Any:
        """Head sentinel of the chain through every free block in allocation order (Note [Free chain
        snapshot]): reading it links the chain."""
        chain = self.get_all_free_blocks()
        prev = self._head
        for b in chain:
            prev.next_free_block = b
            b.prev_free_block = prev
            prev = b
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev
        self._pool._linked = chain
        return self._head

    @property
    def fake_free_list_tail(self) -> Any:
        """Tail sentinel of the chain (its ``next_free_block`` is ``None``)."""
        return self._tail

    def get_all_free_blocks(self) -> list[Any]:
        """Every free block in the order allocation takes them. O(num_gpu_blocks)."""
        refs, blocks = self._pool.refs, self._pool.blocks
        return [blocks[i] for i in refs.free_ids().tolist()] + [blocks[i] for i in refs.cached().tolist()]

    def iter_blocks_after(self, cursor: Any | None) -> Iterator[Any]:
        """Free blocks in allocation order after ``cursor`` (``None``, or a block no longer free: from the
        first). O(num_gpu_blocks)."""
        refs, blocks = self._pool.refs, self._pool.blocks
        cached_cursor = cursor is not None and 0 < cursor.block_id < len(blocks) and refs.is_cached(cursor.block_id)
        if not cached_cursor:
            first = 0 if cursor is None or refs.state(cursor.block_id) != PAGE_NOT_MANAGED else cursor.block_id + 1
            for i in refs.free_ids().tolist():
                if i >= first:
                    yield blocks[i]
        v = refs.next_cached(cursor.block_id if cursor is not None and cached_cursor else 0)
        while v:
            yield blocks[v]
            v = refs.next_cached(v)


def _block_class(base: type, counts: memoryview, keep: memoryview | None) -> type:
    """vLLM's ``KVCacheBlock`` whose ``ref_cnt`` is umalloc's count of the block (``counts``: the pool's
    :attr:`PageRefs.ref_counts`) and whose hash, when set or reset, sets or clears umalloc's keep flag of the
    block (``keep``: :attr:`PageRefs.keep_flags`; ``None`` with prefix caching off, where a freed block is
    never kept, as in vLLM); one class per pool."""

    def get(self: Any, _counts: memoryview = counts) -> int:
        return _counts[self.block_id]

    def put(self: Any, value: int, _counts: memoryview = counts) -> None:
        if self.block_id >= 0:   # the chain sentinels have no count
            _counts[self.block_id] = value

    class UmallocKVCacheBlock(base):  # type: ignore[misc, valid-type, unused-ignore]
        __slots__ = ()
        ref_cnt = property(get, put, doc="umalloc's reference count of this block (PageRefs.ref_counts). O(1).")

        if keep is not None:   # the hash slots written here, one frame per call (the hash is on vLLM's hot path)
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


@functools.cache
def _pool_class() -> type:
    """Build :class:`UmallocBlockPool` on first use (vLLM is imported only then)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    class UmallocBlockPool(BlockPool):  # type: ignore[misc, valid-type, unused-ignore]
        """vLLM ``BlockPool`` whose blocks' ids, reference counts and cached-free LRU are umalloc's (module
        docstring for the policy).

        Same constructor and methods as vLLM's ``BlockPool``; additionally :attr:`allocator` (the id
        allocator), :attr:`refs` (its :class:`~umalloc.requests.pagerefs.PageRefs`, the blocks' only owner),
        :meth:`free_ids`, :meth:`adopt` and :meth:`check_invariants`. ``free_block_queue`` is a read-only
        :class:`UmallocFreeBlockQueue`. Complexities: ``get_new_blocks(n)`` O(n + evicted) plus at most three
        umalloc kernel calls; ``free_blocks``/``touch`` O(blocks) plus one or two; ``get_num_free_blocks`` O(1).
        """

        def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                     *args: Any, **kwargs: Any) -> None:
            super().__init__(num_gpu_blocks, enable_caching, hash_block_size, *args, **kwargs)
            self.allocator = id_allocator(num_gpu_blocks)
            self.refs = PageRefs(self.allocator)
            cls = _block_class(KVCacheBlock, self.refs.ref_counts, self.refs.keep_flags if enable_caching else None)
            self.blocks = [cls(i, pool=self) for i in range(num_gpu_blocks)]
            self.null_block = self.blocks[0]
            self.null_block.is_null = True
            self.free_block_queue = UmallocFreeBlockQueue(self, cls)
            self._linked: list[Any] = []   # blocks the last free-chain snapshot linked

        def _unlink(self) -> None:
            for b in self._linked:
                b.prev_free_block = b.next_free_block = None
            self._linked = []

        # ---- umalloc side ------------------------------------------------------------------------------
        def free_ids(self) -> np.ndarray:
            """Block ids free in umalloc, ascending (the order ``get_new_blocks`` hands them out): a new
            ``int64`` numpy array. O(num_gpu_blocks)."""
            return self.refs.free_ids()

        def adopt(self, block: Any) -> None:
            """Take exactly ``block``'s id out of umalloc's free ids with one reference (one
            ``claim_pages`` call).

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

        # ---- vLLM's BlockPool API ----------------------------------------------------------------------
        def get_num_free_blocks(self) -> int:
            refs = self.refs
            return refs.num_free + refs.num_cached

        def get_new_blocks(self, num_blocks: int) -> list[Any]:
            refs = self.refs
            if self._linked:
                self._unlink()
            try:
                ids = refs.take(num_blocks)
            except UmallocValueError:   # nothing changed
                raise UmallocValueError(f"Cannot get {num_blocks} free blocks from the pool: allowed at most "
                                        f"{refs.num_free + refs.num_cached}") from None
            blocks = self.blocks
            ret = [blocks[i] for i in ids]
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
            else:
                for i in kept:
                    self._maybe_evict_cached_block(blocks[i])
            return ret

        def touch(self, blocks: Sequence[Any]) -> None:
            if not blocks:
                return
            if self._linked:
                self._unlink()
            self.refs.ref([b.block_id for b in blocks])   # the null block is id 0: skipped
            if self.metrics_collector:
                for block in blocks:
                    if not block.is_null:
                        self.metrics_collector.on_block_accessed(block)

        def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
            blocks = ordered_blocks if type(ordered_blocks) is list else list(ordered_blocks)
            ids = [b.block_id for b in blocks if b.pool is self]   # kept or freed at 0 by the keep flags
            if len(ids) == len(blocks):
                if ids:
                    if self._linked:
                        self._unlink()
                    self.refs.unref(ids)
                return
            other_pools: dict[Any, list[Any]] = {}   # blocks of other pools (deferred frees), or pool-less blocks
            ids = []
            for b in blocks:
                if b.pool is self:
                    ids.append(b.block_id)
                elif b.pool is not None:
                    other_pools.setdefault(b.pool, []).append(b)
                elif not b.is_null:
                    b.ref_cnt -= 1   # a bare KVCacheBlock (not one of this pool's): its own count, as vLLM
            if ids:
                if self._linked:
                    self._unlink()
                self.refs.unref(ids)
            for pool, theirs in other_pools.items():
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

        # ---- checks ------------------------------------------------------------------------------------
        def check_invariants(self) -> None:
            """O(num_gpu_blocks): umalloc's invariants (the allocator's and the block owner's:
            :meth:`PageRefs.check_invariants` -- a leaked block, a count set behind the pool, a block freed
            or allocated behind it); ``v2p`` is the identity on live ids; the null block is id 0 and never
            handed out; a block's keep flag is set iff it has a hash (prefix caching on). Raises
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
                if keep[b.block_id] != (self.enable_caching and b._block_hash is not None):
                    raise InvariantError(f"keep-flags: block {b.block_id} has hash {b._block_hash!r} but umalloc's "
                                         f"keep flag {keep[b.block_id]} (a hash written behind set_block_hash)")

    UmallocBlockPool.__module__ = __name__
    return UmallocBlockPool


def install() -> type:
    """Make vLLM build :class:`UmallocBlockPool` wherever it builds a ``BlockPool``: rebinds the name in
    ``vllm.v1.core.block_pool`` and in every loaded module of ``vllm.v1.core`` that imported it (the KV-cache
    coordinators). Call it before vLLM builds its scheduler (modules that import ``BlockPool`` later get the
    new class too). Idempotent; :func:`uninstall` undoes it. The hisparse host pool
    (``SharedEventQueueBlockPool``, a subclass of the stock class) stays vLLM's.

    Returns:
        the pool class.

    Raises:
        ImportError: vLLM is not installed. UnsupportedVLLMVersion (an
        :class:`~umalloc.integrations.versions.EngineVersionError`): the installed vLLM is not one of
        :data:`SUPPORTED_VERSIONS`; nothing is rebound.
    """
    import vllm

    check_engine_version("vLLM", str(getattr(vllm, "__version__", "unknown")), SUPPORTED_VERSIONS, "vllm",
                         UnsupportedVLLMVersion)
    import vllm.v1.core.kv_cache_coordinator  # noqa: F401 - the module that builds the pool

    pool = _pool_class()
    stock = pool.__mro__[1]
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.v1.core") and getattr(module, "BlockPool", None) is stock:
            _rebound[name] = stock
            setattr(module, "BlockPool", pool)  # noqa: B010 - rebinding another package's module attribute
    return pool


def uninstall() -> None:
    """Give every module :func:`install` rebound its stock ``BlockPool`` back (no-op if not installed). Pools
    already built stay umalloc's until vLLM drops them."""
    for name, stock in list(_rebound.items()):
        module = sys.modules.get(name)
        if module is not None:
            setattr(module, "BlockPool", stock)  # noqa: B010 - restoring another package's module attribute
        del _rebound[name]


@contextlib.contextmanager
def installed() -> Iterator[type]:
    """``with installed() as pool_cls:`` -- :func:`install` for the block, :func:`uninstall` after."""
    pool = install()
    try:
        yield pool
    finally:
        uninstall()


def __getattr__(name: str) -> Any:
    if name == "UmallocBlockPool":
        return _pool_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# UmallocBlockPool is reached as an attribute (module __getattr__: it imports vLLM), so it is not in __all__
__all__ = ["END", "ID_PAGE_BYTES", "SUPPORTED_VERSIONS", "SUPPORTED_VLLM_VERSIONS", "UmallocFreeBlockQueue",
           "UnsupportedVLLMVersion", "id_allocator", "install", "installed", "uninstall"]
