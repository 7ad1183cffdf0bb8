"""A read-only stand-in for vLLM's ``FreeKVCacheBlockQueue`` over a umalloc pool's free and cached blocks.

Imports no vLLM: the pool hands its block class in.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from umalloc.requests.pagerefs import PAGE_NOT_MANAGED


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


__all__ = ["UmallocFreeBlockQueue"]
