"""The id allocator under a vLLM pool: block ``i`` is virtual page ``i`` of a one-end umalloc allocator.

Block ids equal physical pages: with one ``up`` end and compaction off, umalloc gives the ``j``-th lowest free
virtual id the ``j``-th lowest free physical page (and a claimed id its own page), so ``v2p`` stays the identity
and vLLM's block tables index its KV tensors directly. Imports no vLLM.
"""

from __future__ import annotations

from umalloc import Arena, ArenaSpec, EndSpec, LayerSpec, MultiEndedAllocator
from umalloc.errors import UmallocValueError

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


__all__ = ["END", "ID_PAGE_BYTES", "id_allocator"]
