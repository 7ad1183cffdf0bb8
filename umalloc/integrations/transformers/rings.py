"""The sliding rings' shared and copied pages of :class:`~umalloc.integrations.transformers.cache.UmallocPagedCache`:
a prefix hit's ring (shared copy-on-write with its donor's, or copied), the copy of a shared ring page at the first
write into it, and the copies that fill a fork's ring (Note [Sliding ring]).

Note [Sliding ring]
~~~~~~~~~~~~~~~~~~~
A sliding layer reads at most the ``window - 1`` tokens before this step's, before it writes. Each request keeps
those tokens in a ring of ``R = ring_tokens`` slots: the token at position ``t`` lives in ring slot ``t % R``, a
request's row in the ``swa`` table (``ring_table``) holds ``min(length, R)`` tokens, grows with the request until
it holds ``R``, and never again. ``R`` is :func:`ring_tokens`: the window itself (``speculative_tokens = 0``, as
transformers' own ring buffer: a write of position ``t`` overwrites the token that just left the window), or, for a
cache built for speculative rounds of ``k`` draft tokens (``CacheOptions.speculative_tokens = k``),
``ceil((window + k) / page_size) * page_size``. A step of ``query_length`` tokens writes only its last
``min(query_length, R)`` tokens (the earlier ones go to the sink: attention reads them from this step's own
states, never from the cache), and reads the ring slots of the ``min(past_length, window - 1)`` tokens before
``past_length``: reads cover the window only, whatever ``R``.

Why ``R >= window + k`` makes a round roll back: a round from ``past`` cached tokens writes positions
``[past, past + k + 1)`` (the last token and ``k`` drafts; ``k + 1 <= R``, so every one is kept) and keeps ``past +
1 + n`` of them (``n`` drafts accepted). A written position ``x`` overwrote slot ``x % R``, the slot of position
``x - R <= past + k - R <= past - window``; the next step reads positions from ``past + 1 + n - (window - 1) >=
past - window + 2``. So no position a later step reads was overwritten by a rejected draft, and truncating the
request back to ``past + 1 + n`` tokens (``min(past + 1 + n, R)`` ring tokens) is the whole rollback: slots below
that length may hold rejected or older positions, never one inside the window. ``R`` is whole pages, so a ring
slot keeps its token's page offset (Note [Ring landing] in :mod:`~umalloc.integrations.transformers.admit`) and a
prefix hit shares ring pages (Note [Shared rings]).

A growth is one call per table, all or nothing (the ring first: its pages are the request's own, so undoing it
frees exactly what it took). A fork copies its source's ring into fresh pages (``perform_cache_copy``). Ring pages
are rewritten in place; a prefix hit's ring shares its donor's pages copy-on-write (Note [Shared rings]): a growth
that would write into a shared page first gives the writer a private copy.

Note [All sliding]
~~~~~~~~~~~~~~~~~~
A model whose every layer slides (Mistral-7B-v0.1's geometry, Phi-3-mini-4k, Qwen2 with ``use_sliding_window``
and ``max_window_layers=0``) has no full-attention end: the arena has one end, ``swa`` (growing up), and
``table`` is its rings' table (``owner == "swa"``, ``ring_table`` None, a request's ring slot is its own slot):
it holds ``min(length, R)`` tokens per request, so a request of any length holds one ring's pages, and
only a ring that does not fit the arena bounds a request (Note [Cannot fit] in the cache module). The request's length is kept
beside the table (``held_tokens``). A fork gets fresh ring pages holding a copy of its source's. No prefix is
shared (stock shares none on such a model either), and ``read_cache_limit`` is the window, as stock's, so the
scheduler sizes reads the same way.

Note [Shared rings]
~~~~~~~~~~~~~~~~~~~
A prefix hit of ``p`` tokens on a model with sliding layers beside full ones needs a ring holding positions
``[max(0, p - window), p)`` (Note [Sliding prefix] in :mod:`~umalloc.integrations.transformers.prefix`). When the
ring (``R`` slots) is a whole number of pages, the request's ring is given the donor's first ``ceil(min(p, R) /
page_size)`` ring pages through the ring table (``attach_prefix``: one more holder each, nothing copied,
``counters.ring_pages_shared``). Both rings then hold those pages with the same slot numbering (position ``t`` in
slot ``t % R``), and those slots hold the same positions' K/V in both, so reads agree. A page with more than
one holder is never written: before a growth whose forward writes positions ``[max(past, end - R), end)``,
every shared page among those positions' slots is replaced in the writer's ring by a private copy
(:meth:`RingPages.plan_copies`, :meth:`RingPages.copy_on_write`: a fresh page, the shared page's bytes copied onto
it, the ring's page swapped for it with ``share_page``; ``counters.ring_cow_copies``); the other holders keep the
unwritten page. Only a ring that wraps (a sequence past the window) writes a slot of a page it shares: a hit's
slots below ``p`` are never rewritten before the wrap, and the donor's shared pages are the matched ones, below
its own later writes. The copies are taken before the growth and undone (the shared page swapped back) if the
growth is refused, so a refusal changes nothing.

The ring being whole pages also makes the first write into a ring page after the wrap a write at a page boundary
of the sequence, which never takes the cache's deferred single-token path (Note [Deferred growth] in
:mod:`~umalloc.integrations.transformers.growth`); with a ring that is not whole pages (a window that is not,
without speculation), a hit copies the donor's ring pages into fresh ones instead (``counters.ring_pages_copied``).

Threading: the scheduler's thread only, as the cache.
"""

from __future__ import annotations

import numpy as np
import torch

from umalloc import Arena, InvariantError, MultiEndedAllocator, RequestTable
from umalloc.integrations.transformers.options import CacheCounters


def ring_tokens(window: int, page_size: int, speculative_tokens: int = 0) -> int:
    """Slots of a sliding ring (Note [Sliding ring]): ``window`` without speculation, else ``ceil((window +
    speculative_tokens) / page_size) * page_size``. O(1).

    >>> ring_tokens(8, 4), ring_tokens(8, 4, 3), ring_tokens(6, 4, 1), ring_tokens(5, 16, 40)
    (8, 12, 8, 48)
    """
    if speculative_tokens <= 0:
        return window
    return -(-(window + speculative_tokens) // page_size) * page_size


class RingPages:
    """Shared, copied-on-write and fork-copied pages of the rings held by ``table`` on the ``swa`` end.

    Args:
        table: the request table holding the rings (the cache's ring table, or its only table when every layer
            slides); it must have a slot free beyond its live rings for :meth:`copy_on_write` (the cache sizes it
            one larger).
        arena, alloc: the cache's arena and allocator. window, page_size: tokens. counters: the cache's.
        ring: the ring's slots (:func:`ring_tokens`; None: ``window``).

    Attributes:
        shared: ring slots that may hold a page another ring holds (donors and sharers), checked at each growth.
    """

    def __init__(self, table: RequestTable, arena: Arena, alloc: MultiEndedAllocator, window: int, page_size: int,
                 counters: CacheCounters, ring: int | None = None) -> None:
        self.table, self.arena, self.alloc = table, arena, alloc
        self.window, self.page_size, self.counters = window, page_size, counters
        self.ring = window if ring is None else ring
        self.shared: set[int] = set()
        self._fork_copies: list[tuple[int, int]] = []   # (source ring slot, fork's ring slot) to copy

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.arena.copy_pages("swa", self.alloc.translate_pages(dst, "swa"), self.alloc.translate_pages(src, "swa"))

    # ---- prefix hits --------------------------------------------------------------------------------------
    def give(self, donor: int, tokens: int) -> int | None:
        """A new ring holding the ring of positions ``[max(0, tokens - window), tokens)`` that ring ``donor``
        holds (Note [Shared rings]): its pages shared when the ring is whole pages, else copied into fresh ones.
        Returns its slot, or None if the slots or pages fall short (nothing taken). O(pages)."""
        w, ps = self.ring, self.page_size
        got = self.table.new_requests(1)
        if got is None:
            return None
        ring = int(got[0])
        held = min(tokens, w)
        src = self.table.pages(donor)[: -(-held // ps)]
        if w % ps == 0:
            if not self.table.attach_prefix(ring, src):
                self.table.free_requests([ring])
                return None
            self.shared.update((ring, donor))
            self.counters.ring_pages_shared += int(src.numel())
            return ring
        if self.table.extend(got, np.array([held], np.int64)) is None:
            self.table.free_requests([ring])
            return None
        self._copy(self.table.pages(ring), src)
        self.counters.ring_pages_copied += int(src.numel())
        return ring

    # ---- copy on write --------------------------------------------------------------------------------------
    def plan_copies(self, ring: int, past: int, end: int) -> list[int]:
        """Page indices of ring ``ring`` that a forward writing positions ``[max(past, end - R), end)`` would
        write while another ring holds them (Note [Shared rings]). O(pages of the ring) for a ring in ``shared``,
        O(1) otherwise."""
        if ring not in self.shared:
            return []
        w, ps = self.ring, self.page_size
        pages = self.table.pages(ring)
        counts = self.table.holder_counts(pages).tolist() if pages.numel() else []
        if all(c <= 1 for c in counts):
            self.shared.discard(ring)   # every page its own: nothing of it is shared again unless it gives a hit
            return []
        touched = sorted({(t % w) // ps for t in range(max(past, end - w), end)})
        return [j for j in touched if j < len(counts) and counts[j] > 1]

    def copy_on_write(self, ring: int, indices: list[int]) -> list[tuple[int, int]] | None:
        """Replace pages ``indices`` of ring ``ring`` by private copies (a fresh page each, the shared page's bytes
        copied onto it). Returns ``(index, shared page)`` per copy, for :meth:`undo`; None if a page falls short
        (the copies made are undone first). O(len(indices) * page_bytes)."""
        done: list[tuple[int, int]] = []
        for j in indices:
            got = self.table.new_requests(1)
            if got is None or self.table.extend(got, np.array([self.page_size], np.int64)) is None:
                if got is not None:
                    self.table.free_requests(got)
                self.undo(ring, done)
                return None
            old = int(self.table.pages(ring)[j])
            new = self.table.pages(int(got[0]))
            self._copy(new, torch.tensor([old]))
            self.table.share_page(ring, j, int(new[0]))
            self.table.free_requests(got)   # the ring is the private copy's only holder now
            done.append((j, old))
        self.counters.ring_cow_copies += len(done)
        return done

    def undo(self, ring: int, done: list[tuple[int, int]]) -> None:
        """Give ring ``ring`` back the shared pages :meth:`copy_on_write` replaced (their other holders kept them);
        the private copies are freed."""
        for j, old in reversed(done):
            self.table.share_page(ring, j, old)
        self.counters.ring_cow_copies -= len(done)

    def forget(self, rings: list[int]) -> None:
        """These rings are freed."""
        self.shared.difference_update(rings)

    # ---- invariants ----------------------------------------------------------------------------------------------
    def check(self, ring_slots: dict[int, int], held: dict[int, int], staged: int) -> None:
        """Raise :class:`~umalloc.errors.InvariantError` unless the ring table holds exactly one ring per live
        request (``ring_slots``: request slot -> ring slot; ``held``: request slot -> its tokens) plus ``staged``
        staging rings, each request's ring holding ``min(length, ring)`` tokens (Note [Sliding ring]), and the
        table's own invariants hold. O(pages)."""
        self.table.check_invariants()
        live = sorted(held)
        if sorted(ring_slots) != live:
            raise InvariantError(f"rings: kept for slots {sorted(ring_slots)}, live slots {live}")
        if self.table.stats().live_requests != len(live) + staged:
            raise InvariantError("rings: the ring table has requests no live slot names")
        if live and self.table.num_tokens([ring_slots[s] for s in live]).tolist() != \
                [min(held[s], self.ring) for s in live]:
            raise InvariantError("rings: a ring does not hold min(length, ring_tokens) tokens")

    # ---- forks ------------------------------------------------------------------------------------------------
    def queue_fork_copy(self, src: int, dst: int) -> None:
        """Ring ``dst`` (a fork's, fresh pages) is to hold a copy of ring ``src``'s pages (:meth:`copy_forks`)."""
        self._fork_copies.append((src, dst))

    def copy_forks(self) -> None:
        """Copy the queued forks' rings (one batched page copy)."""
        if not self._fork_copies:
            return
        src = torch.cat([self.table.pages(s) for s, _ in self._fork_copies])
        dst = torch.cat([self.table.pages(d) for _, d in self._fork_copies])
        self._fork_copies.clear()
        self._copy(dst, src)


__all__ = ["RingPages", "ring_tokens"]
