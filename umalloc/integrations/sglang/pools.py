"""The SGLang-free core of :mod:`umalloc.integrations.sglang`: one KV pool's slot ids, held by a umalloc allocator.

:class:`SlotPool` is what SGLang calls a token-to-KV-pool allocator for one pool: it hands out *slot ids* (token
ids ``page * page_size + offset`` that index the pool's KV tensors directly), pages ``1 .. num_pages``, page 0
reserved for the padded dummy slot, exactly SGLang's id space. Its ids come from a one-end
:class:`~umalloc.MultiEndedAllocator` with ``num_pages + 1`` page slots and compaction off: umalloc gives the
``j``-th lowest free virtual page the ``j``-th lowest free physical page, so virtual = physical and the ids need
no translation (:meth:`SlotPool.check_invariants` checks it). Nothing here imports SGLang; the SGLang-facing
classes (:mod:`umalloc.integrations.sglang.classes`) wrap it.

Policy (what differs from SGLang's own allocators, by design):

* **Order**: umalloc hands out the lowest free page first; SGLang hands out its free list front first (freed pages
  go to the back of a token pool's list, to the front of a paged pool's, or are sorted in with ``need_sort``).
  Capacity, refusals and page-boundary layout are the same; the page numbers differ by a relabelling.
* **Misuse raises** (a typed :class:`~umalloc.errors.UmallocValueError`, nothing changes) where SGLang corrupts its
  free list silently: freeing a free page (``DoubleFreeError``), a slot never handed out (``NotAllocatedError``),
  slot 0 or an id outside the pool (``InvalidIdError``), an ``alloc_extend``/``alloc_decode`` whose ``last_loc``
  is not live or not at the page offset of its position (``InvalidIdError``/``NotAllocatedError``).
* **Slot occupancy** (``page_size`` > 1, :mod:`umalloc.integrations.sglang.occupancy`): the pool knows which
  slots of a partly filled page are live. An ``alloc_extend``/``alloc_decode`` that would hand out a live slot
  (a ``last_loc`` that is not its request's last token) raises
  :class:`~umalloc.integrations.sglang.occupancy.LiveSlotError` naming the slot and its holder; a token free
  frees those slots and releases a page only when none of its slots is live (SGLang releases the page of any
  token freed); freeing a slot that is not live raises ``DoubleFreeError``. A caller that frees every token of
  a request, or page-aligned segments, sees SGLang's behaviour exactly.

Threading: one scheduler thread, as SGLang's allocators. Ids are CPU ``int64`` tensors; a pool on another device
copies its results there (one host-to-device copy per call) and reads its id inputs back to the host.
"""

from __future__ import annotations

import numpy as np
import torch

from umalloc import TOMBSTONE, Arena, ArenaSpec, EndSpec, LayerSpec, MultiEndedAllocator
from umalloc.errors import InvalidIdError, InvariantError, UmallocValueError
from umalloc.ids import check_id_tensor
from umalloc.integrations.sglang.occupancy import SlotOccupancy

#: Name of the one end of a pool's id allocator.
END = "kv"


def _count(value: object, name: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= int(value) < 1 << 63:
        raise UmallocValueError(f"{name}={value!r}: allowed an int in [{lo}, 2**63)")
    return int(value)


def _host(ids: torch.Tensor, name: str) -> torch.Tensor:
    """``ids`` as a contiguous CPU int64 tensor (a copy only when it is not one already)."""
    if not isinstance(ids, torch.Tensor):
        raise InvalidIdError(f"{name}: a {type(ids).__name__}; allowed a 1-D torch integer tensor")
    check_id_tensor(ids, name)  # dense, an integer dtype
    if ids.dtype != torch.int64:
        ids = ids.to(torch.int64)
    return ids.reshape(-1).contiguous().cpu() if ids.dim() != 1 or ids.device.type != "cpu" else ids.contiguous()


class SlotPool:
    """Slot ids of one KV pool (``num_pages`` pages of ``page_size`` tokens, page 0 reserved) from umalloc.

    Args:
        num_pages: usable pages (SGLang's ``size // page_size``; an int >= 1).
        page_size: tokens per page (an int >= 1).
        device: where returned ids live (SGLang's allocator ``device``); umalloc's tables stay on the host.

    Frees can be deferred (:meth:`begin_group` / :meth:`end_group`, SGLang's ``free_group_begin/end``): inside a
    group freed ids are copied and held, and the whole group is freed in one umalloc call at the end.

    Raises:
        UmallocValueError: bad ``num_pages`` or ``page_size``.

    >>> pool = SlotPool(4, 2)
    >>> pool.alloc_tokens(4).tolist(), pool.available_tokens()
    ([2, 3, 4, 5], 4)
    >>> pool.free_tokens(torch.tensor([3])); pool.available_tokens()          # token 2 still holds page 1
    4
    >>> pool.free_tokens(torch.tensor([2])); pool.alloc_tokens(2).tolist()   # page 1 empty: released
    [2, 3]
    """

    def __init__(self, num_pages: int, page_size: int, device: str | torch.device = "cpu") -> None:
        self.num_pages = _count(num_pages, "num_pages", 1)
        self.page_size = _count(page_size, "page_size", 1)
        self.device = torch.device(device)
        self._on_host = self.device.type == "cpu"
        self._token_group: list[torch.Tensor] | None = None
        self._page_group: list[torch.Tensor] = []
        self.allocator = self._new_allocator()
        #: live slots of partly filled pages (None at page_size 1, where a slot is a page)
        self.slots = SlotOccupancy((self.num_pages + 1) * self.page_size, self.page_size) \
            if self.page_size > 1 else None

    def _new_allocator(self) -> MultiEndedAllocator:
        end = EndSpec(END, (LayerSpec.mha(1, 4),), page_size=self.page_size)
        spec = ArenaSpec((end,), arena_bytes=(self.num_pages + 1) * end.page_bytes)
        return MultiEndedAllocator(Arena(spec), compaction="off")

    # ---- capacity --------------------------------------------------------------------------------------
    def available_pages(self) -> int:
        """Free pages (deferred frees of an open group not counted, as SGLang). O(1)."""
        return self.allocator.available_pages(END)

    def available_tokens(self) -> int:
        """:meth:`available_pages` times ``page_size``. O(1)."""
        return self.allocator.available_pages(END) * self.page_size

    def free_page_ids(self) -> torch.Tensor:
        """Free pages, ascending (the order :meth:`alloc_tokens` takes them): a new CPU int64 tensor. O(pages)."""
        v2p = self.allocator.v2p(END).numpy()
        return torch.from_numpy(np.flatnonzero(v2p[1:] == TOMBSTONE) + 1)

    def _dev(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self._on_host else ids.to(self.device, non_blocking=True)

    # ---- allocation ------------------------------------------------------------------------------------
    def alloc_tokens(self, need_size: int) -> torch.Tensor | None:
        """``need_size // page_size`` fresh pages as their slot ids, page by page (SGLang's ``alloc``: a size that
        is not page-aligned is floored, as SGLang's paged pool does).

        Returns:
            int64 ``(pages * page_size,)`` on ``device``, or ``None`` (nothing changed) if too few pages are free.
        Raises:
            UmallocValueError: ``need_size`` not an int >= 0.
        """
        k = _count(need_size, "need_size", 0) // self.page_size
        if k > self.num_pages:
            return None   # more than the whole pool: too few pages are free (nothing changed)
        out = np.empty(k, dtype=np.int64)  # a numpy out: the allocator's page-level hot path
        if self.allocator.alloc_pages(k, out=out) is None:
            return None
        pages = torch.from_numpy(out)
        if self.page_size == 1:
            return self._dev(pages)
        ps = self.page_size
        slots = (pages[:, None] * ps + torch.arange(ps)).reshape(-1)
        if self.slots is not None:
            self.slots.mark(slots.numpy(), self.slots.next_tag("alloc"))
        return self._dev(slots)

    def alloc_extend(self, prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor,
                     extend_num_tokens: int) -> torch.Tensor | None:
        """Tokens ``[prefix_len, seq_len)`` of each request (SGLang's ``alloc_extend``): the partial last page
        first (``last_loc + 1, ...``), then fresh pages in request order.

        Args:
            prefix_lens_cpu, seq_lens_cpu: int64 ``(B,)`` on the CPU. last_loc: int64 ``(B,)`` slot of each
                request's last prefix token (``-1`` with no prefix), any device. extend_num_tokens: their sum of
                ``seq_lens - prefix_lens``.

        Returns:
            int64 ``(extend_num_tokens,)`` slot ids on ``device``, or ``None`` (nothing changed) if the new pages
            do not fit.
        Raises:
            LiveSlotError: a slot of a request's tail page that it would fill is live (its ``last_loc`` is not
            its last token); the error names the slot and its holder.
            InvalidIdError: ``extend_num_tokens`` is not that sum, or the allocator's checks
            (:meth:`~umalloc.MultiEndedAllocator.alloc_extend`) refuse the arguments. Nothing changes.
        """
        prefix = _host(prefix_lens_cpu, "prefix_lens_cpu")
        seq = _host(seq_lens_cpu, "seq_lens_cpu")
        total = int((seq - prefix).sum()) if seq.numel() == prefix.numel() else -1
        if total != extend_num_tokens:
            raise InvalidIdError(f"alloc_extend: extend_num_tokens={extend_num_tokens!r}; allowed "
                                 f"sum(seq_lens - prefix_lens) = {total}")
        last = _host(last_loc, "last_loc")
        occ = self.slots
        if occ is not None:
            occ.check_extend(prefix.numpy(), seq.numpy(), last.numpy())
        out = self.allocator.alloc_extend(prefix, seq, last)
        if out is None:
            return None
        if occ is not None:
            occ.mark_extend(occ.next_tag("alloc_extend"), prefix.numpy(), seq.numpy(), out.numpy())
        return self._dev(out)

    def alloc_decode(self, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """One token per request at position ``seq_len - 1`` (SGLang's ``alloc_decode``): a fresh page where that
        position starts a page, else ``last_loc + 1``.

        Returns:
            int64 ``(B,)`` on ``device``, or ``None`` (nothing changed) if the new pages do not fit.
        Raises:
            LiveSlotError: ``last_loc + 1`` is live (``last_loc`` is not its request's last token); the error
            names the slot and its holder. InvalidIdError: two requests ask for the same slot.
            InvalidIdError / NotAllocatedError: as :meth:`~umalloc.MultiEndedAllocator.alloc_decode`. Nothing
            changes.

        >>> pool = SlotPool(4, 4)
        >>> row = pool.alloc_extend(torch.tensor([0]), torch.tensor([6]), torch.tensor([-1]), 6)
        >>> row.tolist()
        [4, 5, 6, 7, 8, 9]
        >>> pool.alloc_decode(torch.tensor([2]), row[:1])
        Traceback (most recent call last):
        ...
        umalloc.integrations.sglang.occupancy.LiveSlotError: alloc_decode: request 0: slot 5 is live, held by request 0 of alloc_extend call 1; allowed a last_loc that is its request's last token (the slot after it free)
        """
        seq, last = _host(seq_lens_cpu, "seq_lens_cpu"), _host(last_loc, "last_loc")
        occ = self.slots
        if occ is not None:
            occ.check_decode(seq.numpy(), last.numpy())
        out = self.allocator.alloc_decode(seq, last)
        if out is None:
            return None
        if occ is not None:
            occ.mark_each(occ.next_tag("alloc_decode"), out.numpy())
        return self._dev(out)

    # ---- free ------------------------------------------------------------------------------------------
    def free_tokens(self, free_index: torch.Tensor) -> None:
        """Free these slot ids (duplicates merge; deferred inside a group); a page is released when none of its
        slots is live any more (at ``page_size`` 1: every page named).

        Raises:
            InvalidIdError / DoubleFreeError / NotAllocatedError: slot 0 or out of range, a page already free, a
            page never handed out, a slot that is not live on a live page. Nothing changes. Inside a group the
            check runs at :meth:`end_group`.

        Complexity: O(n log n + page_size * pages touched) numpy work, one allocator call.
        """
        ids = _host(free_index, "free_index")
        if ids.numel() == 0:
            return
        if self._token_group is not None:
            self._token_group.append(ids.clone())
            return
        if self.slots is None:  # tokens are pages: the page-level hot path (numpy ids)
            self.allocator.free_pages(ids.numpy())
        else:
            self._free_slots(ids.numpy(), np.empty(0, dtype=np.int64), "free")

    def _free_slots(self, slots: np.ndarray, pages: np.ndarray, where: str) -> None:
        """Free ``slots`` and whole ``pages`` (page_size > 1): the pages left empty in one allocator call, then
        the tags (the allocator refuses first: nothing changes on an error)."""
        assert self.slots is not None
        self.slots.free(slots, pages, where, "free_index", self.allocator.free_pages)

    def free_pages(self, page_ids: torch.Tensor) -> None:
        """Free exactly these pages (SGLang's ``free_page_ids``); deferred inside a group. Raises as
        :meth:`free_tokens`."""
        ids = _host(page_ids, "page_ids")
        if ids.numel() == 0:
            return
        if self._token_group is not None:
            self._page_group.append(ids.clone())
            return
        if self.slots is None:
            self.allocator.free_pages(ids.numpy())
        else:
            self._free_slots(np.empty(0, dtype=np.int64), ids.numpy(), "free_page_ids")

    def begin_group(self) -> None:
        """Defer frees until :meth:`end_group`. Raises UmallocValueError if a group is open (no nesting)."""
        if self._token_group is not None:
            raise UmallocValueError("free_group_begin: a free group is already open; allowed: no nesting")
        self._token_group, self._page_group = [], []

    def end_group(self) -> None:
        """Free everything deferred since :meth:`begin_group` in one umalloc call (a page id ``p`` as its token
        ``p * page_size``; a page named twice in one group is freed once, as SGLang's paged pool dedups).

        Raises:
            UmallocValueError: no group is open. The errors of :meth:`free_tokens`: the group is closed, its frees
            are dropped and nothing changed in the allocator.
        """
        if self._token_group is None:
            raise UmallocValueError("free_group_end: no free group is open; allowed after free_group_begin")
        tokens, pages = self._token_group, self._page_group
        self._token_group, self._page_group = None, []
        if self.slots is not None:
            if tokens or pages:
                self._free_slots(torch.cat(tokens).numpy() if tokens else np.empty(0, dtype=np.int64),
                                 torch.cat(pages).numpy() if pages else np.empty(0, dtype=np.int64), "free_group_end")
            return
        ids = tokens + [p * self.page_size for p in pages]
        if ids:
            self.allocator.free(torch.cat(ids))

    @property
    def group_open(self) -> bool:
        """Whether a free group is open."""
        return self._token_group is not None

    def clear(self) -> None:
        """Everything free again, no group open (a fresh umalloc allocator on a fresh arena)."""
        self._token_group, self._page_group = None, []
        self.allocator = self._new_allocator()
        if self.slots is not None:
            self.slots.clear()

    def live_pages(self) -> int:
        """Pages handed out and not freed. O(1)."""
        return self.num_pages - self.available_pages()

    def check_invariants(self) -> None:
        """umalloc's invariants, plus: slot ids are physical (``v2p`` is the identity on live pages), and (page_size
        > 1) a page is live iff one of its slots is.

        Raises:
            InvariantError: the first broken one.
        """
        self.allocator.check_invariants()
        v2p = self.allocator.v2p(END).numpy()[1:]
        live = np.flatnonzero(v2p != TOMBSTONE)
        if not np.array_equal(v2p[live], live + 1):
            raise InvariantError(f"{END}: virtual page != physical page for live pages {(live + 1)[v2p[live] != live + 1][:8]}")
        if self.slots is not None:
            self.slots.check_pages(np.concatenate([[False], v2p != TOMBSTONE]))


__all__ = ["END", "SlotPool"]
