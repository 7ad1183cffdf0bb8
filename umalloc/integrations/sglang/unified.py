"""SGLang's ``UnifiedSWATokenToKVPoolAllocator`` over umalloc: the full and SWA sub-pools of one ``UnifiedKVPool``
as the two ends of one umalloc :class:`~umalloc.MultiEndedAllocator`.

Mapping (SGLang 0.5.23 -> umalloc):

* **One arena, two ends.** The ``UnifiedKVPool``'s sub-pool specs become two :class:`~umalloc.EndSpec`: ``full``
  (the id owner) and ``swa`` (bound to it), with SGLang's grow directions, the same bytes per token, the same
  buffer size and the same reserved floor, so page ``p`` of an end starts at byte ``p * page_bytes`` on both
  sides and every capacity is the same.
* **Shared virtual ids.** A token id is ``virtual page * page_size + offset`` of the full end; the SWA end binds
  its own physical page to the same virtual page (umalloc's bound end). ``translate_kv_loc`` /
  ``translate_loc_from_full_to_swa`` translate through each end's ``v2p``.
* **Compaction.** umalloc runs with its own compaction off and this class drives :meth:`~umalloc.
  MultiEndedAllocator.compact` where SGLang compacts: after every free in eager mode, on ``flush_opportunistic``
  and on an allocation that falls short in lazy mode (SGLang's urgent flush). Each compaction's page moves are
  replayed on the KV pools' ``move_physical_pages(dst, src, page_size)`` so the bytes SGLang's kernels read follow
  the ids (umalloc's own arena holds no KV data here: see "Memory").
* **The move gate.** ``set_disagg_move_gate`` / ``set_host_transfer_move_gate`` install SGLang's callables (lazy
  mode only, as SGLang asserts); while either returns ``False`` -- or umalloc leases pin a page of either end --
  no page moves: allocations that would need a flush are refused and ``flush_opportunistic`` moves nothing.
* **Capacity** is priced by SGLang's rules (:mod:`umalloc.integrations.sglang.capacity`) on umalloc's end state;
  the allocation itself is umalloc's (``alloc_pages``/``alloc_extend``/``alloc_decode`` binding both ends).

Differences from SGLang's class (docs/engines.md): virtual ids are the lowest free ones (SGLang: a FIFO of freed
ids) and physical pages come out ascending on both ends, so ids match SGLang's up to a relabelling of pages; a
double free, a free of an unallocated id, or a segment free of a page already unbound raise umalloc's typed
errors (SGLang: a stale-slot assertion or an invariant log); ``set_full_to_swa_mapping`` with SWA ids of SGLang's
own choosing is refused (umalloc picks physical pages). At ``page_size`` > 1 the class keeps slot occupancy of
its virtual ids (:mod:`umalloc.integrations.sglang.occupancy`): an allocation into a live slot raises
``LiveSlotError``, and a token free releases a virtual page only when none of its slots is live.

The scheduler's reclaim planning (``reclaim_plan``, ``can_reserve``, ``prealloc_fits``, ``prealloc_ceiling_fits``,
``reclaim_for_prealloc``, ``max_new_tokens_for_memory``, ``evict_to_free_tokens``, ``create_prefill_budget``) is
SGLang's own code, bound from its class and priced on umalloc's end state through :meth:`fits_page_demand`
(Note [SGLang's reclaim planning]). Importing this module imports SGLang; the arena spec and the per-end handles
are :mod:`umalloc.integrations.sglang.unified_ends`.

Memory: umalloc's :class:`~umalloc.Arena` is a host buffer of the pool's size created with ``zero=False``; only
compaction writes to it (the page moves umalloc makes on its own envelopes), so on a CUDA pool the device memory
is SGLang's alone.

Threading: one scheduler thread. Complexity: each call is one or two umalloc kernel calls plus O(tokens) torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.unified_hybrid_swa import UnifiedSWAAllocatorBase
from sglang.srt.mem_cache.allocator.unified_hybrid_swa import (
    UnifiedSWATokenToKVPoolAllocator as SGLangUnified,
)

import umalloc.integrations.sglang.hostcopy as hostcopy
from umalloc import TOMBSTONE, Arena, MultiEndedAllocator
from umalloc.errors import InvalidIdError, InvariantError, UmallocValueError
from umalloc.integrations.sglang.capacity import (
    EndAccounting,
    EndState,
    end_available_pages,
    fits_page_demand,
    joint_available_pages,
)
from umalloc.integrations.sglang.occupancy import SlotOccupancy
from umalloc.integrations.sglang.unified_ends import (
    DEFAULT_FLUSH_MOVES,
    FULL,
    SWA,
    EndAllocator,
    EndTranslator,
    unified_arena_spec,
)


class UmallocUnifiedSWATokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):  # type: ignore[misc]
    """SGLang's ``UnifiedSWATokenToKVPoolAllocator`` (module docstring): same keyword constructor.

    Args: as SGLang's: ``unified_buffer`` (a ``UnifiedKVPool`` with sub-pools ``full`` and ``swa``),
    ``kvcache`` (its ``UnifiedSWAKVPool``: ``full_kv_pool``/``swa_kv_pool``, ``attach_allocators``),
    ``device``, ``full_max_total_num_tokens``/``swa_max_total_num_tokens`` (both or neither), ``page_size``,
    ``need_sort`` (accepted: umalloc's pages come out ascending), ``forward_stream`` (accepted),
    ``lazy_compaction``.

    Raises:
        UmallocValueError: one capacity without the other, or a geometry :func:`unified_arena_spec` refuses.
    """

    def __init__(self, *, unified_buffer: Any, kvcache: Any, device: str,
                 full_max_total_num_tokens: int | None = None, swa_max_total_num_tokens: int | None = None,
                 page_size: int = 1, need_sort: bool = False, forward_stream: Any = None,
                 lazy_compaction: bool = False) -> None:
        if (full_max_total_num_tokens is None) != (swa_max_total_num_tokens is None):
            raise UmallocValueError("full_max_total_num_tokens and swa_max_total_num_tokens: allowed both "
                                    "set or both omitted (SGLang's rule)")
        full_spec, swa_spec = unified_buffer.spec(FULL), unified_buffer.spec(SWA)
        super().__init__(full_max_total_num_tokens or 1, page_size, full_spec.get_dtype(), device,
                      kvcache, need_sort)
        self.unified_buffer = unified_buffer
        self.lazy_compaction = bool(lazy_compaction)
        self.forward_stream = forward_stream
        self.arena_spec = unified_arena_spec(int(unified_buffer.total_bytes), full_spec.entry_bytes(),
                                             swa_spec.entry_bytes(), page_size, full_spec.grow_direction,
                                             swa_spec.grow_direction)
        self._kvcache = kvcache
        self.disagg_move_gate: Callable[[], bool] | None = None
        self.host_transfer_move_gate: Callable[[], bool] | None = None
        self.pages_moved = 0
        self._new_allocator()
        full, swa = self.accounting.end_states()
        self._empty_gap_bytes = self.accounting.gap_bytes()
        if full_max_total_num_tokens is not None:
            self._size_full = int(full_max_total_num_tokens)
            self._size_swa = int(swa_max_total_num_tokens)  # type: ignore[arg-type]
        else:
            self._size_full = end_available_pages(full, self._empty_gap_bytes, lazy=self.lazy_compaction) \
                * page_size
            self._size_swa = min(end_available_pages(swa, self._empty_gap_bytes, lazy=self.lazy_compaction),
                                 full.capacity_pages) * page_size
        self.free_pages = torch.empty(0, dtype=torch.int64)
        self.release_pages = torch.empty(0, dtype=torch.int64)
        self._attach()

    # ---- the umalloc allocator -------------------------------------------------------------------------
    def _new_allocator(self) -> None:
        self.allocator = MultiEndedAllocator(Arena(self.arena_spec, zero=False), compaction="off")
        self._full_view = self.allocator.ends[FULL]
        self._swa_view = self.allocator.ends[SWA]
        # the open free group, under SGLang's names (all None when no group is open): token frees, full-side
        # token frees, segment frees (page ids), full-side segment frees (page ids)
        self.free_group: list[torch.Tensor] | None = None
        self.full_free_group: list[torch.Tensor] | None = None
        self.free_page_reps_group: list[torch.Tensor] | None = None
        self.full_page_reps_group: list[torch.Tensor] | None = None
        #: both ends as SGLang's accounting sees them (Note [Deferred boundary pages] in the capacity module)
        self.accounting = EndAccounting(self._full_view, self._swa_view, lazy=self.lazy_compaction)
        ps = self.page_size
        #: live slots of partly filled virtual pages (None at page_size 1)
        self.slots = SlotOccupancy(self._full_view.v2p.shape[0] * ps, ps) if ps > 1 else None

    def _attach(self) -> None:
        """Give the KV pool one translator per end (it translates SWA reads through the SWA one)."""
        kv = self._kvcache
        if kv is not None and hasattr(kv, "attach_allocators"):
            kv.attach_allocators(full_allocator=EndTranslator(self.allocator, FULL),
                                 swa_allocator=EndTranslator(self.allocator, SWA))
        if kv is not None and hasattr(kv, "full_kv_pool"):
            kv.full_kv_pool.host_transfer_translate = self.translate_kv_loc
        self.full_attn_allocator = EndAllocator(self, FULL)
        self.swa_attn_allocator = EndAllocator(self, SWA)

    def end_available_size(self, end: str) -> int:
        """Tokens end ``end`` alone can take now, peers not compacted (SGLang's sub-pool view). O(1)."""
        full, swa = self.accounting.end_states()
        state = full if end == FULL else swa
        return end_available_pages(state, self.accounting.gap_bytes(), lazy=self.lazy_compaction) * self.page_size

    # ---- sizes -----------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return min(self._size_full, self._size_swa)

    @size.setter
    def size(self, value: int) -> None:  # SGLang's base __init__ assigns it
        pass

    @property
    def size_full(self) -> int:
        return self._size_full

    @property
    def size_swa(self) -> int:
        return self._size_swa

    @property
    def swa_req_ring(self) -> bool:
        return False

    @property
    def swa_ring_cost_tokens(self) -> int:
        return 0

    def moves_blocked(self) -> bool:
        """Whether a move gate returns False now, or a umalloc lease pins a page of either end."""
        for gate in (self.disagg_move_gate, self.host_transfer_move_gate):
            if gate is not None and not gate():
                return True
        return self.allocator.moves_blocked(FULL) or self.allocator.moves_blocked(SWA)

    def _credit(self, peer: EndState) -> int:
        if not self.lazy_compaction or self.moves_blocked():
            return 0
        return peer.hole_pages * peer.page_bytes

    def available_size(self) -> int:
        """Tokens one ``alloc`` can take now on both ends (SGLang's joint view). O(1)."""
        full, swa = self.accounting.end_states()
        return joint_available_pages(full, swa, self.accounting.gap_bytes(), lazy=self.lazy_compaction) * self.page_size

    def conserve_full_available_size(self) -> int:
        return self._size_full - self._full_view.live_pages * self.page_size

    def conserve_swa_available_size(self) -> int:
        return self._size_swa - self._swa_view.live_pages * self.page_size

    _conserve_full_available_size = conserve_full_available_size
    _conserve_swa_available_size = conserve_swa_available_size

    def schedulable_full_available_size(self) -> int:
        full, swa = self.accounting.end_states()
        return end_available_pages(full, self.accounting.gap_bytes(), lazy=self.lazy_compaction,
                                   extra_gap_bytes=self._credit(swa)) * self.page_size

    def schedulable_swa_available_size(self) -> int:
        full, swa = self.accounting.end_states()
        return end_available_pages(swa, self.accounting.gap_bytes(), lazy=self.lazy_compaction,
                                   extra_gap_bytes=self._credit(full)) * self.page_size

    def full_available_size(self) -> int:
        """Full tokens schedulable now: SGLang's ``min(conserve, schedulable)``. O(1)."""
        return min(self.conserve_full_available_size(), self.schedulable_full_available_size())

    def swa_available_size(self) -> int:
        """SWA tokens schedulable now: SGLang's ``min(conserve, schedulable)``. O(1)."""
        return min(self.conserve_swa_available_size(), self.schedulable_swa_available_size())

    @property
    def current_full_capacity(self) -> int:
        return self.full_available_size() + self._full_view.live_pages * self.page_size

    @property
    def current_swa_capacity(self) -> int:
        return self.swa_available_size() + self._swa_view.live_pages * self.page_size

    def debug_print(self) -> str:
        return (f"#full-available={self.full_available_size()}, #swa-available={self.swa_available_size()}, "
                f"#joint-available={self.available_size()}")

    def get_kvcache(self) -> Any:
        return self._kvcache

    # ---- capacity gate and compaction ------------------------------------------------------------------
    def fits_page_demand(self, num_full_pages: int, num_swa_pages: int, *, compacted: bool,
                         full_reclaim_pages: int = 0, swa_reclaim_pages: int = 0, empty_pool: bool = False) -> bool:
        """Whether ``num_full_pages`` full and ``num_swa_pages`` SWA pages fit at once now (SGLang's page-demand
        rule, :func:`~umalloc.integrations.sglang.capacity.fits_page_demand`, on this allocator's end state).

        Args:
            compacted: price as if both ends had no holes (the state after a flush).
            full_reclaim_pages / swa_reclaim_pages: live pages of each end priced as freed first.
            empty_pool: price against the empty arena (live pages and reclaims ignored).

        Changes nothing. O(1). SGLang's reclaim planning calls it under its own name ``_fits_page_demand``.
        """
        full, swa = self.accounting.end_states()
        cap = full.capacity_pages
        return fits_page_demand(full, swa, self.accounting.gap_bytes(), num_full_pages, num_swa_pages,
                                free_virtual_pages=cap - full.live_pages, virtual_capacity_pages=cap,
                                empty_gap_bytes=self._empty_gap_bytes, compacted=compacted,
                                full_reclaim_pages=full_reclaim_pages, swa_reclaim_pages=swa_reclaim_pages,
                                empty_pool=empty_pool)

    def live_pages(self, end: str) -> int:
        """Pages of end ``end`` holding a live virtual page (SGLang's ``allocated_count() // page_size``). O(1)."""
        return int((self._full_view if end == FULL else self._swa_view).live_pages)

    def ensure_capacity(self, full_tokens: int, swa_tokens: int) -> bool:
        """Whether ``full_tokens``/``swa_tokens`` fit now; in lazy mode, with the gate open, compacts both
        ends first when only a compacted arena fits them (SGLang's urgent flush)."""
        if full_tokens < 0 or swa_tokens < 0:
            return False
        if full_tokens == 0 and swa_tokens == 0:
            return True
        ps = self.page_size
        n_full, n_swa = -(-int(full_tokens) // ps), -(-int(swa_tokens) // ps)
        if self.fits_page_demand(n_full, n_swa, compacted=False):
            return True
        if not self.lazy_compaction or self.moves_blocked() or \
                not self.fits_page_demand(n_full, n_swa, compacted=True):
            return False
        self._compact(None)
        return self.fits_page_demand(n_full, n_swa, compacted=False)

    def _compact(self, budget_pages: int | None) -> int:
        """Compact both ends; replay umalloc's page moves on the KV pools. Returns pages moved."""
        moved = 0
        for end, kv in ((FULL, getattr(self._kvcache, "full_kv_pool", None)),
                        (SWA, getattr(self._kvcache, "swa_kv_pool", None))):
            view = self.allocator.ends[end]
            if view.hole_pages == 0:
                continue  # nothing to move, and a freed frontier already retreated
            before = view.v2p.copy()
            report = self.allocator.compact(end, budget_pages=budget_pages)
            if report.pages_moved:
                after = view.v2p
                changed = (before != after) & (before != TOMBSTONE) & (after != TOMBSTONE)
                src, dst = torch.from_numpy(before[changed]), torch.from_numpy(after[changed])
                if kv is not None and hasattr(kv, "move_physical_pages"):
                    kv.move_physical_pages(dst, src, self.page_size)
                moved += int(src.numel())
        self.accounting.reset()
        self.pages_moved += moved
        return moved

    def flush_opportunistic(self) -> int:
        """Lazy mode: compact both ends (at most ``SGLANG_LAZY_COMPACTION_MAX_MOVES_PER_CALL`` moves each)
        unless a move gate is closed. Returns pages moved (0 in eager mode: nothing is left to move)."""
        if not self.lazy_compaction or self.moves_blocked():
            return 0
        budget = int(os.environ.get("SGLANG_LAZY_COMPACTION_MAX_MOVES_PER_CALL", DEFAULT_FLUSH_MOVES))
        return self._compact(budget)

    def flush_for_allocation(self) -> int:
        return 0 if self.moves_blocked() else self._compact(None)

    def _after_free(self) -> None:
        if not self.lazy_compaction:
            self._compact(None)

    def _install_gate(self, slot: str, gate: Callable[[], bool]) -> None:
        if not self.lazy_compaction:
            raise UmallocValueError(f"{slot}: allowed with lazy_compaction=True only (SGLang asserts it: "
                                    f"eager compaction moves pages under in-flight transfers)")
        if not callable(gate):
            raise UmallocValueError(f"{slot}: gate={gate!r}; allowed a callable returning bool")
        setattr(self, slot, gate)

    def set_disagg_move_gate(self, gate: Callable[[], bool]) -> None:
        """Block page moves while ``gate()`` returns False (PD transfers in flight). Lazy mode only."""
        self._install_gate("disagg_move_gate", gate)

    def set_host_transfer_move_gate(self, gate: Callable[[], bool]) -> None:
        """Block page moves while ``gate()`` returns False (HiCache transfers in flight). Lazy mode only."""
        self._install_gate("host_transfer_move_gate", gate)

    def prewarm_compaction(self) -> None:
        """Nothing to prewarm: umalloc's kernels compile on import."""

    # ---- translation -----------------------------------------------------------------------------------
    def translate_kv_loc(self, loc: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Virtual token ids -> full-end physical token ids (unbound pages -> the sink, slot ``offset``)."""
        res = self.allocator.translate(loc.to(torch.int64).cpu(), FULL, strict=False).to(loc.device)
        if out is None:
            return res
        out.copy_(res)
        return out

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor, *,
                                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Virtual token ids -> SWA-end physical token ids (a page without an SWA page -> the sink)."""
        res = self.allocator.translate(kv_indices.to(torch.int64).cpu(), SWA, strict=False)
        res = res.to(kv_indices.device)
        if out is None:
            return res
        out.copy_(res)
        return out

    def translate_kv_indices_for_transfer(self, kv_indices: torch.Tensor) -> torch.Tensor:
        return self.translate_kv_loc(kv_indices)

    def translate_swa_indices_for_transfer(self, kv_indices: torch.Tensor) -> torch.Tensor:
        return self.translate_loc_from_full_to_swa(kv_indices)

    translate_write_loc = translate_kv_loc

    @property
    def full_v2p_page_table(self) -> Any:
        return self.allocator.v2p(FULL)

    @property
    def swa_v2p_page_table(self) -> Any:
        return self.allocator.v2p(SWA)

    def swa_bound(self, vtokens: torch.Tensor) -> torch.Tensor:
        """Whether each token's virtual page has an SWA page (bool ``(n,)``)."""
        pages = torch.from_numpy(self._swa_view.v2p.copy())[vtokens.to(torch.int64) // self.page_size]
        return pages != TOMBSTONE

    def is_slot_allocated(self, slot: int) -> bool:
        v = int(slot) // self.page_size
        return 0 < v < self._full_view.v2p.shape[0] and int(self._full_view.v2p[v]) != TOMBSTONE

    # ---- allocation ------------------------------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` tokens (a multiple of ``page_size``) on both ends, as virtual token ids; ``None``
        (nothing changed) if they do not fit."""
        ps = self.page_size
        if isinstance(need_size, bool) or not isinstance(need_size, int) or need_size < 0 or need_size % ps:
            raise UmallocValueError(f"alloc: need_size={need_size!r}; allowed an int >= 0, a multiple of "
                                    f"page_size={ps}")
        if not self.ensure_capacity(need_size, need_size):
            return None
        with self.accounting.tracked():
            pages = self.allocator.alloc_pages(need_size // ps)
        if pages is None:
            raise InvariantError("unified alloc: umalloc refused pages SGLang's capacity rule admits")
        slots = (pages[:, None] * ps + torch.arange(ps)).reshape(-1)
        if self.slots is not None:
            self.slots.mark(slots.numpy(), self.slots.next_tag("alloc"))
        return slots.to(self.device)

    def _new_pages(self, prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor) -> int:
        ps = self.page_size
        return int(((seq_lens_cpu + ps - 1) // ps - (prefix_lens_cpu + ps - 1) // ps).sum())

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                     seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int,
                     num_new_pages: int | None = None) -> torch.Tensor | None:
        """SGLang's ``alloc_extend`` in virtual space, both ends bound; ``None`` if it does not fit."""
        del prefix_lens, seq_lens, num_new_pages
        self._check_extend(prefix_lens_cpu, seq_lens_cpu, last_loc)
        n = self._new_pages(prefix_lens_cpu, seq_lens_cpu)
        if not self.ensure_capacity(n * self.page_size, n * self.page_size):
            return None
        return self._extend(prefix_lens_cpu, seq_lens_cpu, last_loc, extend_num_tokens, None)

    def _check_extend(self, prefix: torch.Tensor, seq: torch.Tensor, last_loc: torch.Tensor) -> None:
        """LiveSlotError before anything runs (a flush included) if the extend would fill a live slot."""
        if self.slots is not None:
            self.slots.check_extend(self._host(prefix).numpy(), self._host(seq).numpy(),
                                    self._host(last_loc).numpy())

    def _extend(self, prefix: torch.Tensor, seq: torch.Tensor, last_loc: torch.Tensor, total: int,
                bind: Sequence[str] | None) -> torch.Tensor:
        prefix, seq = prefix.to(torch.int64).cpu(), seq.to(torch.int64).cpu()
        if int((seq - prefix).sum()) != total:
            raise InvalidIdError(f"alloc_extend: extend_num_tokens={total}; allowed sum(seq_lens - prefix_lens)"
                                 f" = {int((seq - prefix).sum())}")
        with self.accounting.tracked():
            out = self.allocator.alloc_extend(prefix, seq, last_loc.to(torch.int64).cpu(), bind=bind)
        if out is None:
            raise InvariantError("unified alloc_extend: umalloc refused pages SGLang's capacity rule admits")
        if self.slots is not None:
            self.slots.mark_extend(self.slots.next_tag("alloc_extend"), prefix.numpy(), seq.numpy(), out.numpy())
        return out.to(self.device)

    def alloc_extend_swa_tail(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor,
                              seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor,
                              extend_num_tokens: int, swa_tail_len: int) -> torch.Tensor | None:
        """Full pages for the whole extend, SWA pages only for the new pages holding the last
        ``swa_tail_len`` tokens (one request, SGLang's rule)."""
        del prefix_lens, seq_lens
        if len(prefix_lens_cpu) != 1 or len(seq_lens_cpu) != 1:
            raise InvalidIdError("alloc_extend_swa_tail: allowed one request (SGLang's rule)")
        if not 0 <= swa_tail_len <= extend_num_tokens:
            raise InvalidIdError(f"alloc_extend_swa_tail: swa_tail_len={swa_tail_len}; allowed "
                                 f"[0, {extend_num_tokens}]")
        ps = self.page_size
        self._check_extend(prefix_lens_cpu, seq_lens_cpu, last_loc)
        prefix_len, seq_len = int(prefix_lens_cpu[0]), int(seq_lens_cpu[0])
        first_new = -(-prefix_len // ps)
        n_swa = (-(-seq_len // ps) - max(first_new, (seq_len - swa_tail_len) // ps)) if swa_tail_len else 0
        n = self._new_pages(prefix_lens_cpu, seq_lens_cpu)
        if not self.ensure_capacity(n * ps, max(0, n_swa) * ps):
            return None
        out = self._extend(prefix_lens_cpu, seq_lens_cpu, last_loc, extend_num_tokens, [])
        if swa_tail_len:
            new_pages = torch.unique(out[torch.arange(prefix_len, seq_len) >= first_new * ps] // ps)
            tail_pages = new_pages[torch.isin(new_pages, torch.unique(out[-swa_tail_len:] // ps))]
            with self.accounting.tracked():
                bound = not tail_pages.numel() or self.allocator.bind_end(SWA, tail_pages * ps)
            if not bound:
                raise InvariantError("alloc_extend_swa_tail: umalloc refused SWA pages the rule admits")
        return out

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor) -> torch.Tensor | None:
        """One token per request, a new page (both ends) only where the decode wraps; ``None`` if short."""
        del seq_lens
        ps = self.page_size
        seq, last = self._host(seq_lens_cpu), self._host(last_loc)
        if self.slots is not None:
            self.slots.check_decode(seq.numpy(), last.numpy())
        n = int(((seq - 1) % ps == 0).sum())
        if not self.ensure_capacity(n * ps, n * ps):
            return None
        with self.accounting.tracked():
            out = self.allocator.alloc_decode(seq, last)
        if out is None:
            raise InvariantError("unified alloc_decode: umalloc refused pages SGLang's capacity rule admits")
        if self.slots is not None:
            self.slots.mark_each(self.slots.next_tag("alloc_decode"), out.numpy())
        return out.to(self.device)

    # ---- frees -----------------------------------------------------------------------------------------
    @staticmethod
    def _host(ids: torch.Tensor) -> torch.Tensor:
        return ids.detach().to(torch.int64).reshape(-1).cpu().clone()

    def _reps(self, free_index: torch.Tensor, start_pos: int) -> torch.Tensor:
        ps = self.page_size
        if start_pos % ps:
            raise UmallocValueError(f"segment free: start_pos={start_pos} is not page-aligned; allowed a "
                                    f"multiple of page_size={ps}")
        return self._host(free_index)[::ps] // ps

    def free(self, free_index: torch.Tensor) -> None:
        """Both ends of these tokens' virtual pages (SWA where still bound); deferred inside a free group.
        Raises umalloc's typed errors for a page that is not live (nothing changes)."""
        if free_index is None or free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._host(free_index))
            return
        self._free_ids(self._host(free_index), None, "free")
        self._after_free()

    def _free_ids(self, tokens: torch.Tensor | None, pages: torch.Tensor | None, where: str) -> None:
        """Free ``tokens`` (a virtual page when none of its slots stays live) and whole ``pages`` on both
        ends in one umalloc call; the slot tags change only after umalloc accepted the call."""
        if self.slots is None:
            with self.accounting.tracked():
                if tokens is not None:
                    self.allocator.free(tokens)
                if pages is not None:
                    self.allocator.free_pages(pages)
            return
        empty = np.empty(0, dtype=np.int64)
        self.slots.free(empty if tokens is None else tokens.numpy(), empty if pages is None else pages.numpy(),
                        where, "free_index", self._release_pages)

    def _release_pages(self, pages: np.ndarray) -> None:
        with self.accounting.tracked():
            self.allocator.free_pages(pages)

    def free_swa(self, free_index: torch.Tensor) -> None:
        """Unbind the SWA pages of these tokens' virtual pages where bound; full pages and ids stay."""
        if free_index is None or free_index.numel() == 0:
            return
        with self.accounting.tracked():
            self.allocator.unbind_end(SWA, self._host(free_index), strict=False)
        self._after_free()

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """:meth:`free_swa` of a page-aligned kv-row segment whose SWA pages are all bound (a live page
        without one raises NotAllocatedError; a page whose virtual id is already free is skipped: its SWA page
        went with the id)."""
        if free_index is None or free_index.numel() == 0:
            return
        pages = self._reps(free_index, start_pos)
        # SGLang's tree frees a node's full side first; umalloc unbound the SWA pages with those ids already
        pages = pages[torch.from_numpy(self._full_view.v2p.copy())[pages] != TOMBSTONE]
        with self.accounting.tracked():
            self.allocator.unbind_pages(SWA, pages)
        self._after_free()

    def free_full(self, free_index: torch.Tensor) -> None:
        """The full pages and ids of tokens whose SWA pages are unbound; deferred inside a free group."""
        if free_index is None or free_index.numel() == 0:
            return
        if self.full_free_group is not None:
            self.full_free_group.append(self._host(free_index))
            return
        self._free_ids(self._host(free_index), None, "free_full")
        self._after_free()

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """:meth:`free_full` of a page-aligned kv-row segment; deferred inside a free group."""
        if free_index is None or free_index.numel() == 0:
            return
        pages = self._reps(free_index, start_pos)
        if self.full_page_reps_group is not None:
            self.full_page_reps_group.append(pages)
            return
        self._free_ids(None, pages, "free_full_segment")
        self._after_free()

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """:meth:`free` of a page-aligned kv-row segment; deferred inside a free group."""
        if free_index is None or free_index.numel() == 0:
            return
        pages = self._reps(free_index, start_pos)
        if self.free_page_reps_group is not None:
            self.free_page_reps_group.append(pages)
            return
        self._free_ids(None, pages, "free_segment")
        self._after_free()

    def free_group_begin(self) -> None:
        """Defer ``free``/``free_full``/segment frees until :meth:`free_group_end` (no nesting)."""
        if self.free_group is not None:
            raise UmallocValueError("free_group_begin: a free group is already open; allowed: no nesting")
        self.free_group, self.full_free_group, self.free_page_reps_group, self.full_page_reps_group = [], [], [], []

    def free_group_end(self) -> None:
        """Free the group: its tokens in one umalloc call, its pages in another, then (eager) compact."""
        if self.free_group is None:
            raise UmallocValueError("free_group_end: no free group is open; allowed after free_group_begin")
        tokens, full_tokens = self.free_group, self.full_free_group or []
        pages, full_pages = self.free_page_reps_group or [], self.full_page_reps_group or []
        self.free_group = self.full_free_group = self.free_page_reps_group = self.full_page_reps_group = None
        if self.slots is not None:
            if tokens or full_tokens or pages or full_pages:
                self._free_ids(torch.cat(tokens + full_tokens) if tokens or full_tokens else None,
                               torch.cat(pages + full_pages) if pages or full_pages else None, "free_group_end")
        else:
            with self.accounting.tracked():
                if tokens or full_tokens:
                    self.allocator.free(torch.cat(tokens + full_tokens))
                if pages or full_pages:
                    self.allocator.free_pages(torch.cat(pages + full_pages))
        if tokens or full_tokens or pages or full_pages:
            self._after_free()

    def set_full_to_swa_mapping(self, full_indices: torch.Tensor, swa_indices: torch.Tensor) -> None:
        """Refused: umalloc chooses the SWA end's physical pages itself (bind with ``bind_end``)."""
        raise UmallocValueError("set_full_to_swa_mapping: binding SWA pages SGLang chose is not supported by "
                                "umalloc's unified class; allowed: SWA pages bound by alloc_* / bind_end")

    def clear_full_to_swa_mapping(self, full_indices: torch.Tensor) -> None:
        """Nothing: the shared virtual id is the mapping (as SGLang's unified class)."""

    # ---- lifecycle -------------------------------------------------------------------------------------
    def clear(self) -> None:
        """Everything free (a fresh umalloc allocator on a fresh arena); move gates stay installed."""
        self._new_allocator()
        self._attach()

    def set_latest_forward_done_event(self, event: Any) -> None:
        """Accepted: umalloc moves pages synchronously on the scheduler thread."""
        self._latest_forward_done_event = event

    def set_inflight_forward(self, forward_done: Any, out_cache_loc_virtual: Any) -> None:
        """Accepted (see :meth:`set_latest_forward_done_event`)."""
        self._inflight_forward = (forward_done, out_cache_loc_virtual)

    def set_hicache_transfer_done_event(self, transfer_key: Any, event: Any) -> None:
        """Accepted: a HiCache transfer in flight is expressed with the move gate."""

    # ---- the scheduler's reclaim planning: SGLang's own methods (Note [SGLang's reclaim planning]) -------------
    # Note [SGLang's reclaim planning]
    # How many tokens the radix cache must evict before a demand fits, whether a demand fits at all, and the
    # scheduler and prefill-budget calls built on those are SGLang's ``UnifiedSWATokenToKVPoolAllocator`` methods,
    # bound here unchanged. They reach this class through the hooks SGLang's class defines for them:
    # ``_fits_page_demand`` (:meth:`fits_page_demand`), ``_compaction_allowed`` (no move gate closed and no lease
    # pinning a page), ``ensure_capacity``, the per-end ``allocated_count`` (:class:`EndAllocator`) and the free
    # group lists under SGLang's names, so every plan is SGLang's rule priced on umalloc's end state.
    _fits_page_demand = fits_page_demand

    def _compaction_allowed(self) -> bool:
        return not self.moves_blocked()

    reclaim_plan = SGLangUnified.reclaim_plan
    can_reserve = SGLangUnified.can_reserve
    prealloc_fits = SGLangUnified.prealloc_fits
    prealloc_fits_assumes_reclaim = SGLangUnified.prealloc_fits_assumes_reclaim
    prealloc_ceiling_fits = SGLangUnified.prealloc_ceiling_fits
    reclaim_for_prealloc = SGLangUnified.reclaim_for_prealloc
    max_new_tokens_for_memory = SGLangUnified.max_new_tokens_for_memory
    evict_to_free_tokens = SGLangUnified.evict_to_free_tokens
    create_prefill_budget = SGLangUnified.create_prefill_budget
    swa_capacity_and_available = SGLangUnified.swa_capacity_and_available
    get_extend_allocation_demand = SGLangUnified.get_extend_allocation_demand

    get_cpu_copy = hostcopy.get_cpu_copy
    load_cpu_copy = hostcopy.load_cpu_copy

    def check_invariants(self) -> None:
        """umalloc's invariants, plus: every live virtual page has a full page (SWA pages only on live
        virtual pages). Raises InvariantError."""
        self.allocator.check_invariants()
        fv, sv = self._full_view.v2p, self._swa_view.v2p
        if ((sv != TOMBSTONE) & (fv == TOMBSTONE))[1:].any():
            raise InvariantError("unified: an SWA page bound to a virtual page with no full page")
        if self.slots is not None:
            live = fv != TOMBSTONE
            live[0] = False
            self.slots.check_pages(live)


# an abc.ABC: a virtual subclass, so SGLang's isinstance routing treats the class as its unified allocator while
# nothing of SGLang's class is inherited
UnifiedSWAAllocatorBase.register(UmallocUnifiedSWATokenToKVPoolAllocator)

__all__ = ["UmallocUnifiedSWATokenToKVPoolAllocator"]
