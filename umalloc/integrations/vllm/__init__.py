"""umalloc behind vLLM's ``BlockPool``: block ids, reference counts and the cached-free LRU are umalloc's.

Enable it with one call before vLLM builds its KV-cache manager::

    import umalloc.integrations.vllm
    umalloc.integrations.vllm.install()     # vLLM's coordinators now build UmallocBlockPool

Tested with vLLM 0.33.0 and 0.34.0 (:data:`SUPPORTED_VERSIONS`; the ``umalloc[vllm]`` extra allows exactly
these); :func:`install` refuses other releases (:class:`UnsupportedVLLMVersion`, an
:class:`~umalloc.integrations.versions.EngineVersionError`) because the pool overrides vLLM internals
(``free_block_queue``, the reuse watchers). :func:`uninstall` and :func:`installed` (a context manager) undo it.
Modules, one concept each: :mod:`~umalloc.integrations.vllm.ids` (the id allocator),
:mod:`~umalloc.integrations.vllm.seams` (supported releases and what differs between them),
:mod:`~umalloc.integrations.vllm.pool` (the pool and its blocks; imports vLLM),
:mod:`~umalloc.integrations.vllm.freequeue` (the free-list reader) and :mod:`~umalloc.integrations.vllm.install`.

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
  ``PageRefs.take(n)`` kernel call (Note [Fused kernels] in :mod:`umalloc.requests.pagerefs`), or for one block
  (a decode or window step) ``PageRefs.take_one`` in Python, on ids minted a batch at a time (Note [Spare ids]
  there). The blocks a call returns are umalloc's ``n`` lowest free ids, ascending, and cached
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
* Block ids equal physical pages (:mod:`umalloc.integrations.vllm.ids`; checked by
  :meth:`UmallocBlockPool.check_invariants`).
* **evict_first** (vLLM 0.34's ``free_blocks(blocks, evict_first=True)``): the blocks the call caches go to the
  LRU head, so they are the first cached blocks evicted.

Threading: as vLLM's pool, called from the scheduler thread only.
"""

from __future__ import annotations

from typing import Any

from umalloc.integrations.vllm.freequeue import UmallocFreeBlockQueue
from umalloc.integrations.vllm.ids import END, ID_PAGE_BYTES, id_allocator
from umalloc.integrations.vllm.install import install, installed, uninstall
from umalloc.integrations.vllm.seams import (
    SUPPORTED_VERSIONS,
    SUPPORTED_VLLM_VERSIONS,
    UnsupportedVLLMVersion,
    check_version,
)


def __getattr__(name: str) -> Any:
    if name == "UmallocBlockPool":   # importing the pool imports vLLM
        from umalloc.integrations.vllm.pool import UmallocBlockPool

        return UmallocBlockPool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# UmallocBlockPool is reached as an attribute (module __getattr__: it imports vLLM), so it is not in __all__
__all__ = ["END", "ID_PAGE_BYTES", "SUPPORTED_VERSIONS", "SUPPORTED_VLLM_VERSIONS", "UmallocFreeBlockQueue",
           "UnsupportedVLLMVersion", "check_version", "id_allocator", "install", "installed", "uninstall"]
