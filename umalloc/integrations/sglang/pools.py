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

Threading: one scheduler thread, as SGLang's allocators. Ids are CPU ``int64`` tensors; a pool on another device
copies its results there (one host-to-device copy per call) and reads its id inputs back to the host.
"""

from __future__ import annotations

import numpy as np
import torch

from umalloc import TOMBSTONE, Arena, ArenaSpec, EndSpec, LayerSpec, MultiEndedAllocator
from umalloc.errors import InvalidIdError, InvariantError, UmallocValueError
from umalloc.ids import check_id_tensor

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
    >>> pool.free_tokens(torch.tensor([3])); pool.alloc_tokens(2).tolist()   # token 3 frees page 1
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
        return self._dev((pages[:, None] * ps + torch.arange(ps)).reshape(-1))

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
            InvalidIdError: ``extend_num_tokens`` is not that sum, or the allocator's checks
            (:meth:`~umalloc.MultiEndedAllocator.alloc_extend`) refuse the arguments. Nothing changes.
        """
        prefix = _host(prefix_lens_cpu, "prefix_lens_cpu")
        seq = _host(seq_lens_cpu, "seq_lens_cpu")
        total = int((seq - prefix).sum()) if seq.numel() == prefix.numel() else -1
        if total != extend_num_tokens:
            raise InvalidIdError(f"alloc_extend: extend_num_tokens={extend_num_tokens!r}; allowed "
                                 f"sum(seq_lens - prefix_lens) = {total}")
        out = self.allocator.alloc_extend(prefix, seq, _host(last_loc, "last_loc"))
        return None if out is None else self._dev(out)

    def alloc_decode(self, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """One token per request at position ``seq_len - 1`` (SGLang's ``alloc_decode``): a fresh page where that
        position starts a page, else ``last_loc + 1``.

        Returns:
            int64 ``(B,)`` on ``device``, or ``None`` (nothing changed) if the new pages do not fit.
        Raises:
            InvalidIdError / NotAllocatedError: as :meth:`~umalloc.MultiEndedAllocator.alloc_decode`.
        """
        out = self.allocator.alloc_decode(_host(seq_lens_cpu, "seq_lens_cpu"), _host(last_loc, "last_loc"))
        return None if out is None else self._dev(out)

    # ---- free ------------------------------------------------------------------------------------------
    def free_tokens(self, free_index: torch.Tensor) -> None:
        """Free every page holding one of these slot ids (duplicates merge; deferred inside a group).

        Raises:
            InvalidIdError / DoubleFreeError / NotAllocatedError: slot 0 or out of range, a page already free, a
            page never handed out. Nothing changes. Inside a group the check runs at :meth:`end_group`.
        """
        ids = _host(free_index, "free_index")
        if ids.numel() == 0:
            return
        if self._token_group is not None:
            self._token_group.append(ids.clone())
            return
        if self.page_size == 1:  # tokens are pages: the page-level hot path (numpy ids)
            self.allocator.free_pages(ids.numpy())
        else:
            self.allocator.free(ids)

    def free_pages(self, page_ids: torch.Tensor) -> None:
        """Free exactly these pages (SGLang's ``free_page_ids``); deferred inside a group. Raises as
        :meth:`free_tokens`."""
        ids = _host(page_ids, "page_ids")
        if ids.numel() == 0:
            return
        if self._token_group is not None:
            self._page_group.append(ids.clone())
            return
        self.allocator.free_pages(ids.numpy())

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

    def live_pages(self) -> int:
        """Pages handed out and not freed. O(1)."""
        return self.num_pages - self.available_pages()

    def check_invariants(self) -> None:
        """umalloc's invariants, plus: slot ids are physical (``v2p`` is the identity on live pages).

        Raises:
            InvariantError: the first broken one.
        """
        self.allocator.check_invariants()
        v2p = self.allocator.v2p(END).numpy()[1:]
        live = np.flatnonzero(v2p != TOMBSTONE)
        if not np.array_equal(v2p[live], live + 1):
            raise InvariantError(f"{END}: virtual page != physical page for live pages {(live + 1)[v2p[live] != live + 1][:8]}")


__all__ = ["END", "SlotPool"]
