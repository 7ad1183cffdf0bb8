"""The allocator's allocation service: minting virtual pages and binding physical pages on every end.

* :meth:`AllocationService.alloc_pages` (page level, vLLM ``BlockPool.get_new_blocks`` style),
  :meth:`~AllocationService.alloc_extend` / :meth:`~AllocationService.alloc_decode` (token level, SGLang
  semantics), :meth:`~AllocationService.bind_end` (a bound end's pages for live virtual pages) and
  :meth:`~AllocationService.claim_pages` (exact ids, Note [Exact ids] in :mod:`umalloc.allocator.facade`).
* Pages are placed per Note [Placement order] (:mod:`umalloc.allocator.facade`); a call that falls short goes
  through the space service's ladder (:meth:`umalloc.allocator.space.SpaceService.retry`) once, and otherwise
  returns ``None`` (or ``False``) with nothing changed (:attr:`~umalloc.allocator.space.SpaceService.last_shortfall`
  holds each end's deficit).
* ``alloc_pages(out=)`` with numpy arrays has the kernel's direct entry as its hot path (Note [Page-level hot
  path] in :mod:`umalloc.allocator.facade`); every other form validates at the boundary and runs the same kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from umalloc.allocator.arguments import _I64, _NP_I64, _id_arg, _ids, _out, _out_arg
from umalloc.allocator.calls import AfterCall, KernelEntry
from umalloc.allocator.ends import EndIndex
from umalloc.allocator.leasing import LeaseService
from umalloc.allocator.space import SpaceService
from umalloc.errors import InvalidIdError, UmallocValueError
from umalloc.geometry.spec import ArenaSpec, Grow
from umalloc.ids import count_arg, id_batch
from umalloc.pool.heap import Heap
from umalloc.pool.kernels import raw
from umalloc.pool.kernels.codes import OK
from umalloc.pool.kernels.ops import (
    CLAIM_LIVE,
    CLAIM_RANGE,
    k_alloc_pages,
    k_bind,
    k_claim,
    k_decode,
    k_extend,
)


class AllocationService:
    """Allocation on one allocator's ends (owner thread).

    Args:
        heap, spec, ends, entry, leasing, after_call, space: the allocator's heap, geometry, end index, kernel
            entry, lease service, after-call work and space service (the shortfall ladder).
        plain: the page-level hot path applies (Note [Page-level hot path] in :mod:`umalloc.allocator.facade`).
    """

    __slots__ = ("_addr", "_after_call", "_default_mask", "_default_owner", "_ends", "_err", "_heap", "_hot",
                 "_leasing", "_plain", "_root_a", "_space", "_spec", "_sync", "_work")

    def __init__(self, heap: Heap, spec: ArenaSpec, ends: EndIndex, entry: KernelEntry, leasing: LeaseService,
                 after_call: AfterCall, space: SpaceService, *, plain: bool) -> None:
        self._heap = heap
        self._spec = spec
        self._ends = ends
        self._leasing = leasing
        self._after_call = after_call
        self._space = space
        # what the hot paths read, held directly (each is fixed for the allocator's life)
        self._plain = plain
        self._sync = after_call.sync
        self._work = leasing.work
        self._hot, self._root_a, self._addr, self._err = entry.hot, entry.root_a, entry.addr, entry.err
        self._default_owner, self._default_mask = ends.default_owner, ends.default_mask

    def alloc_pages(self, num_pages: int, *, owner: str | None = None,
                    bind: Sequence[str] | None = None, out: torch.Tensor | np.ndarray | None = None,
                    index: torch.Tensor | np.ndarray | None = None) -> torch.Tensor | np.ndarray | None:
        """Mint ``num_pages`` fresh virtual pages and bind a physical page of the owner and of each bound end
        (the page-level call of an engine that keeps a per-request page table, as vLLM's
        ``BlockPool.get_new_blocks`` does).

        Args:
            num_pages: pages to allocate (an ``int`` or numpy integer in ``[0, 2**63)``; not a ``bool``).
            owner: id-owner end (``None``: the only one; ambiguous -> error).
            bind: bound ends to bind too (default: every bound end of the owner; ``[]``: the owner only).
            out: optional preallocated output of ``num_pages`` int64s: a contiguous CPU ``torch.int64`` tensor or
                a writeable 1-D native ``int64`` numpy array (any strides). With ``index``: the flat block table
                to write into (any length).
            index: optional ``int64 (num_pages,)`` slots of ``out`` (a 1-D torch tensor or numpy array): page
                ``j`` is written to ``out[index[j]]`` -- straight into a ``req_to_page`` block table, no scatter by
                the caller. Every slot is checked to lie in ``[0, len(out))`` before anything changes, and all are
                read before the first write (``index`` may overlap ``out``); slots should be distinct (a repeated
                slot keeps the last page written to it).

        Returns:
            the virtual pages (ascending, lowest free ids first): a new ``int64`` CPU tensor ``(num_pages,)``, or
            ``out`` itself if given (with ``index``: the whole table, pages at the slots), or ``None`` if any end
            lacks space or the owner lacks free virtual ids (nothing changed, ``out`` untouched;
            :attr:`last_shortfall` holds each end's deficit).

        Raises:
            UmallocValueError: bad ``num_pages``, owner or bind names. InvalidIdError: a wrong ``out`` or
            ``index`` (type, dtype, shape, device, a read-only numpy ``out``, ``index`` without ``out``, an
            ``index`` length other than ``num_pages``, a slot outside ``out``). Nothing changes on any error.

        Complexity: O(num_pages + holes scanned) in one numba kernel; pages per Note [Placement order].

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()
        >>> alloc.alloc_pages(2, bind=[]).tolist(), alloc.stats()["swa"].live_pages
        ([1, 2], 0)
        >>> alloc.alloc_pages(100) is None, alloc.last_shortfall
        (True, {'full': 93})
        """
        if type(out) is np.ndarray and type(num_pages) is int and owner is None and bind is None and self._plain \
                and not self._work and out.dtype is _NP_I64 and out.ndim == 1 and out.flags.writeable:
            # the hot path, Note [Page-level hot path]: out holds the pages, or with index is the table
            idx: Any = None
            if index is None:
                if out.shape[0] == num_pages:
                    idx, n_idx, n_out = out, -1, num_pages
            elif type(index) is np.ndarray and index.dtype is _NP_I64 and index.ndim == 1 \
                    and index.shape[0] == num_pages:
                idx, n_idx, n_out = index, num_pages, out.shape[0]
            if idx is not None:
                args = (self._root_a, self._default_owner, self._default_mask, num_pages, out, n_out, idx, n_idx)
                if self._hot.alloc_pages(*args) != OK and self._space.retry(
                        k_alloc_pages, args, self._default_mask, "alloc_pages") is None:
                    return None
                return out
        num_pages = count_arg(num_pages, "num_pages")
        if owner is None and bind is None and self._default_owner >= 0:  # the hot path: no call
            o, mask = self._default_owner, self._default_mask
        else:
            o, mask = self._ends.resolve(owner, bind)
        k = num_pages
        keep_idx, idx_arg, n_idx = None, 0, -1
        if index is not None:
            if out is None:
                raise InvalidIdError("alloc_pages: index given without out; allowed index only with out (the "
                                     "block table it indexes)")
            keep_idx, idx_arg, n_idx = _id_arg(index, "index")  # dispatcher path: plain addresses
            if n_idx != k:
                raise InvalidIdError(f"alloc_pages: index has {n_idx} slots; allowed exactly num_pages={k}")
            res, arg, n_out = _out_arg(out, None)
        elif out is None:
            # more pages than the owner has free virtual ids is refused by the kernel before anything is
            # written, so a huge num_pages must not size the output either
            free_ids = self._heap.num_vpages(o) - 1 - self._heap.live_vpages(o)
            res = torch.empty(min(k, free_ids + 1), dtype=_I64)
            arg, n_out = raw.address(res), k
        else:
            res, arg, n_out = _out_arg(out, k)
        if self._work:
            self._leasing.tick()
        args = (self._root_a, o, mask, k, arg, n_out, idx_arg, n_idx)
        if k_alloc_pages(*args) != OK and self._space.retry(k_alloc_pages, args, mask, "alloc_pages") is None:
            return None
        del keep_idx
        if self._sync:
            self._after_call.after(o, k)
        return res

    def claim_pages(self, vpages: torch.Tensor | np.ndarray | Sequence[int]) -> None:
        """Mint exactly the free virtual pages ``vpages``, each on the physical page of the same number (Note
        [Exact ids]): the entry an id allocator uses to take one named id (a prefix-cache hit on a block it
        holds as free) without an allocate-and-free of the ids below it.

        Args:
            vpages: ``int64 (n,)`` distinct virtual pages, each free (never allocated or freed), a torch tensor,
                numpy array or list of ints.

        Raises:
            UmallocValueError: the allocator is not an id allocator (more than one end, or its end does not
            grow ``up``). InvalidIdError: an id outside ``[max(1, first_page), top_page]``, a live or repeated
            id, or one whose physical page is not free (pending under a lease). Nothing changes on any error.

        Complexity: O(n + pages skipped) in one numba kernel.

        >>> from umalloc import Arena, ArenaSpec, EndSpec, LayerSpec, MultiEndedAllocator
        >>> alloc = MultiEndedAllocator(Arena(ArenaSpec((EndSpec("ids", (LayerSpec.mha(1, 4),), page_size=1),),
        ...                                             arena_bytes=8 * 16)), compaction="off")
        >>> alloc.claim_pages([5])
        >>> alloc.alloc_pages(3).tolist(), alloc.translate_pages(torch.tensor([5]), "ids").tolist()
        ([1, 2, 3], [5])
        """
        names = self._ends.names
        if len(names) != 1 or self._spec.ends[0].grow is not Grow.UP:
            raise UmallocValueError(f"claim_pages: allowed an id allocator (one 'up' end, the arena's only one); "
                                    f"this arena has ends {list(names)}")
        vp = id_batch(vpages, "vpages")
        if self._work:
            self._leasing.tick()
        r = int(k_claim(self._root_a, 0, vp))
        if r:
            code, pos = r % 8, r // 8
            v = int(vp[pos])
            if code == CLAIM_RANGE:
                raise InvalidIdError(f"claim_pages: vpages[{pos}]={v} is out of range; allowed "
                                     f"[{max(1, self._heap.first_page(0))}, {self._spec.top_page(names[0])}]")
            what = "is live or repeated in the batch" if code == CLAIM_LIVE else "has a physical page that is not free"
            raise InvalidIdError(f"claim_pages: vpages[{pos}]={v} {what}; allowed distinct free virtual pages")
        if self._sync:
            self._after_call.refresh(0, vp)
            self._after_call.checks()

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor, *,
                     owner: str | None = None, bind: Sequence[str] | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Allocate the tokens ``[prefix_len, seq_len)`` of each request (SGLang ``alloc_extend`` semantics).

        Each request first fills its partial last page (tokens ``last_loc + 1, ...``), then gets
        ``ceil(seq_len / page_size) - ceil(prefix_len / page_size)`` fresh virtual pages, in request order, each
        bound on the owner and the ``bind`` ends (default all bound ends).

        Args:
            prefix_lens: ``int64 (B,)`` tokens each request already holds.
            seq_lens: ``int64 (B,)`` tokens after the extend (``>= prefix_lens``).
            last_loc: ``int64 (B,)`` virtual token id of each request's last prefix token (position
                ``prefix_len - 1``), or ``-1`` where ``prefix_len == 0``.
            out: optional preallocated contiguous CPU ``int64`` output of shape ``(sum(seq_lens - prefix_lens),)``.

        Returns:
            ``int64`` CPU tensor ``(sum(seq_lens - prefix_lens),)`` of virtual token ids, request by request (``out``
            if given), or ``None`` if any end lacks space (nothing changed).

        Raises:
            InvalidIdError: bad dtype/shape, ``prefix_len > seq_len``, ``last_loc`` out of range, in page 0, at the
                wrong page offset, a partial tail page extended twice in one batch, or a wrong-sized ``out``.
            NotAllocatedError / DoubleFreeError: ``last_loc`` not live; a partial tail page unbound on a ``bind``
                end.

        Complexity: O(B + new tokens) in one numba kernel.

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()            # page_size 2
        >>> t = alloc.alloc_extend(torch.tensor([0, 0]), torch.tensor([3, 1]), torch.tensor([-1, -1]))
        >>> t.tolist()                               # request 0: pages 1, 2; request 1: page 3
        [2, 3, 4, 6]
        >>> alloc.alloc_extend(torch.tensor([3]), torch.tensor([5]), torch.tensor([4])).tolist()
        [5, 8]
        """
        if owner is None and bind is None and self._default_owner >= 0:  # the hot path: no call
            o, mask = self._default_owner, self._default_mask
        else:
            o, mask = self._ends.resolve(owner, bind)
        prefix_lens = _ids(prefix_lens, "prefix_lens")
        seq_lens = _ids(seq_lens, "seq_lens")
        last_loc = _ids(last_loc, "last_loc")
        B = prefix_lens.numel()
        if seq_lens.numel() != B or last_loc.numel() != B:
            raise InvalidIdError(f"alloc_extend: shapes prefix_lens ({B},), seq_lens ({seq_lens.numel()},), "
                                 f"last_loc ({last_loc.numel()},); allowed three equal (B,) shapes")
        if out is None:
            out_a = n_out = 0
        else:
            out = _out(out, None)
            out_a, n_out = self._addr(out), out.numel()
        if self._work:
            self._leasing.tick()
        addr = self._addr
        args = (self._root_a, o, mask, addr(prefix_lens), addr(seq_lens), addr(last_loc), B, out_a, n_out)
        res = self._hot.extend(*args)
        if self._err[0] != OK:
            res = self._space.retry(k_extend, args, mask, "alloc_extend")
            if res is None:
                return None
        if self._sync:
            self._after_call.after(o, int(self._err[1]))
        return torch.from_numpy(res) if out is None else out

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor, *, owner: str | None = None,
                     bind: Sequence[str] | None = None, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Allocate one token per request at position ``seq_len - 1`` (SGLang ``alloc_decode`` semantics): a
        fresh virtual page only where that position starts a page, else ``last_loc + 1``.

        Args:
            seq_lens: ``int64 (B,)`` lengths *after* adding the new token (``>= 1``).
            last_loc: ``int64 (B,)`` virtual token id of position ``seq_len - 2`` (``-1`` where ``seq_len == 1``).
            out: optional preallocated contiguous CPU ``int64 (B,)`` output.

        Returns:
            ``int64`` CPU tensor ``(B,)`` of virtual token ids (``out`` if given), or ``None`` if any end lacks
            space (nothing changed).

        Raises: as :meth:`alloc_extend`.

        Pages, not slots: the allocator knows which pages are live, not which slots of a page a request holds,
        so a ``last_loc`` that is not its request's last token yields a slot that may be live (and :meth:`free`
        of any token frees its whole page). The SGLang token API (:mod:`umalloc.integrations.sglang.occupancy`)
        keeps slot occupancy on top of this call and refuses that.

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()            # page_size 2
        >>> alloc.alloc_decode(torch.tensor([1, 1]), torch.tensor([-1, -1])).tolist()   # new pages 1, 2
        [2, 4]
        >>> alloc.alloc_decode(torch.tensor([2, 2]), torch.tensor([2, 4])).tolist()     # same pages
        [3, 5]
        >>> alloc.alloc_decode(torch.tensor([3]), torch.tensor([3])).tolist()           # position 2: page 3
        [6]
        >>> alloc.alloc_decode(torch.tensor([2]), torch.tensor([3]))
        Traceback (most recent call last):
        ...
        umalloc.errors.InvalidIdError: alloc_decode: request 0: last_loc=3 is not at the page offset of token position 0 (page arithmetic uses absolute positions, F07)
        """
        if owner is None and bind is None and self._default_owner >= 0:  # the hot path: no call
            o, mask = self._default_owner, self._default_mask
        else:
            o, mask = self._ends.resolve(owner, bind)
        seq_lens = _ids(seq_lens, "seq_lens")
        last_loc = _ids(last_loc, "last_loc")
        B = seq_lens.numel()
        if last_loc.numel() != B:
            raise InvalidIdError(f"alloc_decode: shapes seq_lens ({B},), last_loc ({last_loc.numel()},); allowed "
                                 f"two equal (B,) shapes")
        res = torch.empty(B, dtype=_I64) if out is None else _out(out, B)
        if self._work:
            self._leasing.tick()
        addr = self._addr
        args = (self._root_a, o, mask, addr(seq_lens), addr(last_loc), B, addr(res))
        if self._hot.decode(*args) != OK and self._space.retry(k_decode, args, mask, "alloc_decode") is None:
            return None
        if self._sync:
            self._after_call.after(o, int(self._err[1]))
        return res

    def bind_end(self, end: str, vtokens: torch.Tensor) -> bool:
        """Bind fresh physical pages of bound ``end`` to the live virtual pages of ``vtokens``, which must be
        unbound on it (e.g. the SWA window tail of a request whose earlier pages were allocated with
        ``bind=[]``). Pages are taken per Note [Placement order] and assigned in first-occurrence order.

        Returns:
            True, or False if ``end`` lacks space (nothing changed).

        Raises:
            UmallocValueError: ``end`` unknown or an id owner. InvalidIdError: bad ids, page 0, or a page already
            bound on ``end``. NotAllocatedError / DoubleFreeError: a page that is not live. Nothing changes.

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()
        >>> vp = alloc.alloc_pages(2, bind=[])
        >>> alloc.bind_end("swa", vp * 2), alloc.translate_pages(vp, "swa").tolist()
        (True, [8, 9])
        """
        b = self._ends.bound_end(end, "bind_end")
        toks = _ids(vtokens, "vtokens")
        o = self._heap.owner_of(b)
        mask = self._ends.bind_mask(o, None, only=b)
        if self._work:
            self._leasing.tick()
        args = (self._root_a, b, mask, raw.address(toks), toks.numel())
        n = k_bind(*args)
        if n < 0:
            n = self._space.retry(k_bind, args, mask, "bind_end")
            if n is None:
                return False
        if self._sync:
            self._after_call.after(o, n)
        return True


__all__ = ["AllocationService"]
