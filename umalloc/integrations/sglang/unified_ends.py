"""The pieces of SGLang's unified full/SWA pool that stand apart from the allocator class
(:mod:`umalloc.integrations.sglang.unified`): the umalloc arena spec of a ``UnifiedKVPool``
(:func:`unified_arena_spec`) and the per-end handles SGLang's KV pool and radix cache reach through
(:class:`EndTranslator`, :class:`EndAllocator`). Importing this module does not import SGLang.

Threading: one scheduler thread. Complexity: a translation is one umalloc ``translate`` call, O(tokens).
"""

from __future__ import annotations

from typing import Any

import torch

from umalloc import TOMBSTONE, ArenaSpec, EndRole, EndSpec, Grow, KVDtype, LayerSpec, MultiEndedAllocator
from umalloc.errors import UmallocValueError

FULL, SWA = "full", "swa"
#: SGLang's cap on the pages one non-urgent flush moves (``SGLANG_LAZY_COMPACTION_MAX_MOVES_PER_CALL``).
DEFAULT_FLUSH_MOVES = 4096


#: The nominal window of the SWA end's layer: SGLang's scheduler decides which pages leave the window, so the
#: allocator never reads it (umalloc's spec requires an SWA end's layers to slide).
NOMINAL_WINDOW_TOKENS = 1 << 30


def _end_spec(name: str, entry_bytes: int, page_size: int, grow: str, owner: str | None) -> EndSpec:
    """An end whose tokens take ``entry_bytes`` (one MHA layer of that width: only the size matters here)."""
    window = NOMINAL_WINDOW_TOKENS if owner is not None else None
    if entry_bytes % 4 == 0:
        layer = LayerSpec.mha(1, entry_bytes // 4, dtype=KVDtype.FP16, window_tokens=window)
    elif entry_bytes % 2 == 0:
        layer = LayerSpec.mha(1, entry_bytes // 2, dtype=KVDtype.FP8_E4M3, window_tokens=window)
    else:
        raise UmallocValueError(f"sub-pool {name!r}: entry_bytes={entry_bytes}; allowed an even byte count")
    return EndSpec(name, (layer,), page_size=page_size, grow=Grow(grow), owner=owner,
                   role=EndRole.SWA if owner is not None else EndRole.TARGET)


def unified_arena_spec(total_bytes: int, full_entry_bytes: int, swa_entry_bytes: int, page_size: int,
                       full_grow: str, swa_grow: str) -> ArenaSpec:
    """The umalloc arena of an SGLang ``UnifiedKVPool`` holding a full and an SWA sub-pool.

    Args:
        total_bytes: the pool's buffer size. full_entry_bytes, swa_entry_bytes: bytes per token of each sub-pool
            (``spec.entry_bytes()``). page_size: tokens per page. full_grow, swa_grow: ``"up"``/``"down"``.

    Raises:
        UmallocValueError / SpecError: a geometry umalloc cannot hold (odd entry bytes, a buffer size that is not
        a multiple of 16 bytes, grow directions that are not one up and one down).

    >>> s = unified_arena_spec(100 * 32 * 2, 32, 32, 1, "down", "up")
    >>> s.first_page("swa"), s.top_page("full"), s.floor_bytes
    (1, 199, 32)
    """
    if {full_grow, swa_grow} != {"up", "down"}:
        raise UmallocValueError(f"grow directions full={full_grow!r}, swa={swa_grow!r}; allowed one 'up' and one "
                                f"'down' (a float sub-pool is SGLang's tri-pool, not supported)")
    ends = (_end_spec(FULL, full_entry_bytes, page_size, full_grow, None),
            _end_spec(SWA, swa_entry_bytes, page_size, swa_grow, FULL))
    floor = max(e.page_bytes for e in ends)  # SGLang's reserved sink floor: the largest page
    return ArenaSpec(ends, arena_bytes=total_bytes, floor_bytes=floor)


class EndTranslator:
    """What SGLang's ``UnifiedSWAKVPool.attach_allocators`` holds per sub-pool: ``translate_kv_loc`` of one end
    (virtual token ids -> that end's physical token ids; a page without a page on the end -> the sink).

    Args:
        allocator: the umalloc :class:`~umalloc.MultiEndedAllocator`. end: ``"full"`` or ``"swa"``.
    """

    def __init__(self, allocator: MultiEndedAllocator, end: str) -> None:
        self.allocator = allocator
        self.end = end

    def translate_kv_loc(self, loc: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        res = self.allocator.translate(loc.to(torch.int64).cpu(), self.end, strict=False).to(loc.device)
        if out is None:
            return res
        out.copy_(res)
        return out


class EndAllocator(EndTranslator):
    """The per-end handle SGLang's unified radix cache reaches through (``allocator.full_attn_allocator`` /
    ``.swa_attn_allocator``): translation, the end's own ``available_size``, and frees with SGLang's sub-pool
    meaning -- on the full end a free returns the virtual pages (and their SWA pages, which umalloc never leaves
    bound to a freed id), on the SWA end it unbinds only the SWA pages still bound.

    Args:
        owner: the unified allocator (its frees keep its accounting and eager compaction). end: ``"full"``/``"swa"``.
    """

    def __init__(self, owner: Any, end: str) -> None:
        super().__init__(owner.allocator, end)
        self.owner = owner
        self.page_size = owner.page_size
        self.sub_pool_name = end

    def available_size(self) -> int:
        """Tokens this end alone can take now (SGLang's sub-pool ``available_size``). O(1)."""
        return self.owner.end_available_size(self.end)

    def allocated_count(self) -> int:
        """Tokens on live pages of this end (SGLang's sub-pool ``allocated_count``: live pages x ``page_size``).
        O(1)."""
        return self.owner.live_pages(self.end) * self.page_size

    def _live_on_owner(self, free_index: torch.Tensor) -> torch.Tensor:
        """The tokens whose virtual page is still live: SGLang's tree frees a node's full side before its SWA
        side, and umalloc already unbound the SWA pages of an id it freed."""
        v = free_index.detach().to(torch.int64).reshape(-1).cpu()
        full_v2p = torch.from_numpy(self.allocator.ends[FULL].v2p.copy())
        return v[full_v2p[v // self.page_size] != TOMBSTONE]

    def free(self, free_index: torch.Tensor) -> None:
        if self.end == FULL:
            self.owner.free(free_index)
        else:
            self.owner.free_swa(self._live_on_owner(free_index))

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if self.end == FULL:
            self.owner.free_segment(free_index, start_pos=start_pos)
        else:
            self.owner.free_swa(self._live_on_owner(free_index))


__all__ = ["DEFAULT_FLUSH_MOVES", "FULL", "NOMINAL_WINDOW_TOKENS", "SWA", "EndAllocator", "EndTranslator",
           "unified_arena_spec"]
