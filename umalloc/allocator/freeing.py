"""The allocator's freeing service: the free and unbind calls.

* :meth:`FreeingService.free` / :meth:`~FreeingService.free_pages` give a request's virtual pages back on the owner and on
  every bound end; :meth:`~FreeingService.unbind_end` / :meth:`~FreeingService.unbind_pages` tombstone one bound end only
  (SWA pages that left the window, F18). Tokens or pages, torch or numpy ids, an optional ``index`` gather from
  a block table; every one validates at the boundary and changes nothing on an error.
* A physical page pinned by a lease becomes pending instead of a hole (Note [Pending pages] in
  :mod:`umalloc.allocator.facade`); with eager compaction the freed ends are compacted at once.
* The page forms have the kernel's direct entry as their hot path (Note [Page-level hot path] in
  :mod:`umalloc.allocator.facade`); every other form takes the general path to the same kernel.
"""

from __future__ import annotations

import numpy as np
import torch

from umalloc.allocator.arguments import _NP_I64, _hot_index, _id_arg
from umalloc.allocator.calls import AfterCall, KernelEntry
from umalloc.allocator.ends import EndIndex
from umalloc.allocator.leasing import LeaseService
from umalloc.allocator.space import SpaceService
from umalloc.ids import check_strict
from umalloc.pool.heap import Heap
from umalloc.pool.kernels.ops import k_free, k_unbind


class FreeingService:
    """Free and unbind on one allocator's ends (owner thread).

    Args:
        heap, ends, entry, leasing, after_call, space: the allocator's heap, end index, kernel entry, lease
            service, after-call work and space service (eager compaction after a free).
        plain: the page-level hot path applies (Note [Page-level hot path] in :mod:`umalloc.allocator.facade`).
    """

    __slots__ = ("_addr", "_after_call", "_bound", "_default_owner", "_ends", "_entry", "_group", "_heap", "_hot",
                 "_leasing", "_plain", "_root_a", "_space", "_sync", "_work")

    def __init__(self, heap: Heap, ends: EndIndex, entry: KernelEntry, leasing: LeaseService,
                 after_call: AfterCall, space: SpaceService, *, plain: bool) -> None:
        self._heap = heap
        self._ends = ends
        self._entry = entry
        self._leasing = leasing
        self._after_call = after_call
        self._space = space
        # what the hot paths read, held directly (each is fixed for the allocator's life)
        self._plain = plain
        self._sync = after_call.sync
        self._work = leasing.work
        self._hot, self._root_a, self._addr = entry.hot, entry.root_a, entry.addr
        self._default_owner = ends.default_owner
        self._bound = ends.bound
        self._group = ends.group

    def free(self, vtokens: torch.Tensor | np.ndarray, *, owner: str | None = None) -> None:
        """Free the unique virtual pages containing ``vtokens`` on the owner and on every bound end where they
        are still bound (page granularity: one token frees its whole page, duplicates merge; F01/F06/F07).

        Physical pages pinned by a lease become pending (Note [Pending pages]); the virtual ids are free at once.

        Args:
            vtokens: ``int64 (n,)`` virtual token ids of the owner: a 1-D ``torch.int64`` tensor (read in place
                if contiguous on the CPU, else copied there), or a 1-D native ``int64`` numpy array of any strides
                (Note [Zero-copy tensor inputs]).

        Raises:
            InvalidIdError: bad dtype/shape, id out of range, or in virtual page 0. DoubleFreeError: a page already
            free. NotAllocatedError: a page never allocated. Nothing changes on any error.

        Complexity: O(n + pages freed) in one numba kernel.

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()
        >>> t = alloc.alloc_extend(torch.tensor([0]), torch.tensor([4]), torch.tensor([-1]))
        >>> alloc.free(t[:1]); alloc.stats()["full"].hole_pages      # token 2 frees page 1 (a hole)
        1
        >>> alloc.free(t[:1])
        Traceback (most recent call last):
        ...
        umalloc.errors.DoubleFreeError: free: token 2 at position 0 is in a virtual page of 'full' that is already free
        """
        self._free(vtokens, owner, False, "free")

    def free_pages(self, vpages: torch.Tensor | np.ndarray, *, owner: str | None = None,
                   index: torch.Tensor | np.ndarray | None = None) -> None:
        """:meth:`free` for virtual *page* ids (an engine with a per-request page table, vLLM style): the same
        checks, errors and effects, with ``vpages`` instead of tokens (``token = vpage * page_size + offset``).

        Args:
            vpages: ``int64 (n,)`` live virtual pages of the owner (duplicates merge), in the forms :meth:`free`
                takes. With ``index``: the flat block table holding them (any length).
            owner: id-owner end (``None``: the only one; ambiguous -> error).
            index: optional ``int64 (m,)`` slots of ``vpages`` to free, same forms (a gather from a
                ``req_to_page`` block table, no gather by the caller).

        Raises:
            as :meth:`free`; also InvalidIdError for a bad ``index`` (type, dtype, shape) or a slot outside
            ``[0, len(vpages))``. Nothing changes on any error.

        Complexity: O(n, or m with ``index``, + pages freed) in one numba kernel.

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()
        >>> vp = alloc.alloc_pages(3)
        >>> alloc.free_pages(vp[1:]); alloc.stats()["full"].live_pages
        1
        >>> alloc.free_pages(vp[1:2])
        Traceback (most recent call last):
        ...
        umalloc.errors.DoubleFreeError: free_pages: virtual page 2 at position 0 is a virtual page of 'full' that is already free
        """
        if type(vpages) is np.ndarray and owner is None and self._plain and not self._work \
                and vpages.dtype is _NP_I64 and vpages.ndim == 1:  # the hot path, Note [Page-level hot path]
            idx, n_idx = _hot_index(vpages, index)
            if idx is not None:
                if self._hot.free(self._root_a, self._default_owner, vpages, vpages.shape[0], True, idx, n_idx) < 0:
                    self._entry.raise_error("free_pages", pages=True)
                return
        self._free(vpages, owner, True, "free_pages", index)

    def _free(self, ids: torch.Tensor | np.ndarray, owner: str | None, pages: bool, where: str,
              index: torch.Tensor | np.ndarray | None = None) -> None:
        if owner is None and self._default_owner >= 0:
            o = self._default_owner
        else:
            o = self._ends.owner(owner)
        keep, arg, n_ids = _id_arg(ids, "vpages" if pages else "vtokens", self._addr)
        keep_idx, idx_arg, n_idx = (None, 0, -1) if index is None else _id_arg(index, "index", self._addr)
        if self._work:
            self._leasing.tick()
        if type(arg) is int and type(idx_arg) is int:  # torch ids by address: Note [Direct entry]
            n = self._hot.free_addr(self._root_a, o, arg, n_ids, pages, idx_arg, n_idx)
        else:
            n = k_free(self._root_a, o, arg, n_ids, pages, idx_arg, n_idx)
        del keep, keep_idx
        if n < 0:
            self._entry.raise_error(where, pages=pages)
        if n and self._space.eager:
            self._space.after_free(self._group[o])
        if self._sync:
            self._after_call.after(o, n)

    def unbind_end(self, end: str, vtokens: torch.Tensor | np.ndarray, *, strict: bool = True) -> None:
        """Tombstone bound ``end`` only, for the unique virtual pages of ``vtokens`` (SWA pages that left the
        window: use :meth:`swa_tail_start` for the frontier, F18). The virtual ids and the other ends stay live.

        Args:
            end: a bound end (SWA, or a draft bound to the owner).
            vtokens: ``int64 (n,)`` live virtual token ids of the owner, in the forms :meth:`free` takes.
            strict: a page already unbound on ``end`` raises (default); ``strict=False`` skips it.

        Raises:
            UmallocValueError: unknown end or an id-owner end. InvalidIdError: bad ids or page 0.
            NotAllocatedError: a page not live, or (strict) not bound on ``end``. DoubleFreeError: a page already
            freed. Nothing changes on any error.

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()
        >>> vp = alloc.alloc_pages(2)
        >>> alloc.unbind_end("swa", vp[:1] * 2)
        >>> alloc.translate_pages(vp, "swa", strict=False).tolist(), alloc.translate_pages(vp, "full").tolist()
        ([0, 9], [1, 2])
        """
        self._unbind(end, vtokens, strict, False, "unbind_end")

    def unbind_pages(self, end: str, vpages: torch.Tensor | np.ndarray, *, strict: bool = True,
                     index: torch.Tensor | np.ndarray | None = None) -> None:
        """:meth:`unbind_end` for virtual *page* ids (vLLM-style page tables): tombstone bound ``end`` only for
        ``vpages`` (or, with ``index``, for ``vpages[index]``: a gather from the block table, as
        :meth:`free_pages`); the same checks, errors and effects.

        Args:
            end: a bound end (SWA, or a draft bound to the owner).
            vpages: ``int64 (n,)`` live virtual pages of the owner (duplicates merge), in the forms :meth:`free`
                takes. With ``index``: the flat block table holding them (any length).
            strict: a page already unbound on ``end`` raises (default); ``strict=False`` skips it.
            index: optional ``int64 (m,)`` slots of ``vpages`` to unbind, same forms.

        Raises:
            as :meth:`unbind_end`; also InvalidIdError for a bad ``index`` (type, dtype, shape) or a slot outside
            ``[0, len(vpages))``. Nothing changes on any error.

        Complexity: O(n, or m with ``index``, + pages unbound) in one numba kernel.

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()
        >>> vp = alloc.alloc_pages(2)
        >>> alloc.unbind_pages("swa", vp[:1])
        >>> alloc.translate_pages(vp, "swa", strict=False).tolist()
        [0, 9]
        """
        if type(vpages) is np.ndarray and self._plain and not self._work and vpages.dtype is _NP_I64 \
                and vpages.ndim == 1 and type(end) is str and (strict is True or strict is False):  # the hot path
            b = self._bound.get(end, -1)
            idx, n_idx = _hot_index(vpages, index)
            if b >= 0 and idx is not None:
                if self._hot.unbind(self._root_a, b, vpages, vpages.shape[0], strict, True, idx,
                                    n_idx) < 0:
                    self._entry.raise_error("unbind_pages", pages=True)
                return
        self._unbind(end, vpages, strict, True, "unbind_pages", index)

    def _unbind(self, end: str, ids: torch.Tensor | np.ndarray, strict: bool, pages: bool, where: str,
                index: torch.Tensor | np.ndarray | None = None) -> None:
        b = self._bound.get(end, -1) if type(end) is str else -1
        if b < 0:
            b = self._ends.bound_end(end, where)
        strict = check_strict(strict, where)
        keep, arg, n_ids = _id_arg(ids, "vpages" if pages else "vtokens", self._addr)
        keep_idx, idx_arg, n_idx = (None, 0, -1) if index is None else _id_arg(index, "index", self._addr)
        if self._work:
            self._leasing.tick()
        if type(arg) is int and type(idx_arg) is int:  # torch ids by address: Note [Direct entry]
            n = self._hot.unbind_addr(self._root_a, b, arg, n_ids, strict, pages, idx_arg, n_idx)
        else:
            n = k_unbind(self._root_a, b, arg, n_ids, strict, pages, idx_arg, n_idx)
        del keep, keep_idx
        if n < 0:
            self._entry.raise_error(where, pages=pages)
        if n and self._space.eager:
            self._space.after_free((b,))
        if self._sync:
            self._after_call.after(self._heap.owner_of(b), n)


__all__ = ["FreeingService"]
