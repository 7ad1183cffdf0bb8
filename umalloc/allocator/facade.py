"""The multi-ended page allocator: every end (sub-pool) of one arena, virtual token ids, watermarks.

Policy:

* **Ends form a chain** in the arena, ordered by position: the ``up`` end (band ``[first_page, watermark)``,
  growing from the reserved floor), the ``float`` ends in spec order (band ``[lo, hi)``), the ``down`` end (band
  ``(watermark, top_page]``, growing from the top). Facing ends bound each other by *byte frontiers*, so free
  space between them (the gap) is shared dynamically even when their ``page_bytes`` differ
  (Note [Byte frontiers]).
* **Virtual ids.** Each id-owner end mints virtual pages (lowest free id first; id 0 is reserved and maps to the
  sink on every end, so padded block-table lanes holding token 0 translate to the sink). Bound ends (SWA, a draft
  that shares the target's token positions) bind their own physical page to the owner's virtual page. Token id
  ``t = vpage * page_size + offset``.
* **Placement contract** (Note [Placement order]): an end first drains its holes -- the *lowest* holes of an
  ``up`` or ``float`` end, the *highest* holes of a ``down`` end (it grows toward lower pages) -- then moves its
  frontier into the gap. The pages one call takes on one end are handed out in *ascending* physical order, and
  consecutive fresh virtual pages get consecutive physical pages, so fresh pages come out as ascending
  contiguous runs on every end.
* **Freed frontier pages retreat the band**: freeing the page at a band's moving edge turns it and every hole
  behind it into gap (no bytes move), so the facing end can grow. Pages in the middle become holes.
* **Failures** (docs/architecture.md, "Failure tiers"): out of space returns ``None`` and nothing changes (the whole plan over
  every end is computed before anything is written); misuse raises a typed
  :class:`~umalloc.errors.UmallocValueError` subclass and nothing changes; a broken invariant raises
  :class:`~umalloc.errors.InvariantError` from :meth:`MultiEndedAllocator.check_invariants`.
* **Bookkeeping lives on the host** (numpy masters driven by numba kernels, one kernel per call); when the arena
  is on CUDA each owner's ``v2p`` rows have a device mirror refreshed by one batched scatter per call.
* **Leases** (:mod:`umalloc.leases.table`): a physical page freed while pinned becomes *pending* (not reusable, not
  counted as available) until its last lease ends (F11). Expired leases are reclaimed at the start of every
  allocator call (F12). Compaction (:mod:`umalloc.pool.compaction`) never moves a pinned or pending page.

* **Layers** (one concept per module): :mod:`umalloc.pool.heap` owns every array and the root address
  vector; :mod:`umalloc.pool.kernels` is the numba layer (the only pointer intrinsics are in
  :mod:`umalloc.pool.kernels.raw`); :mod:`umalloc.pool.ladder` plans the shortfall ladder (pure);
  :mod:`umalloc.allocator.ids` validates ids at the boundary; :mod:`umalloc.pool.views` holds the typed, read-only
  end views and the heap's invariant checks, :mod:`umalloc.allocator.observe` the stats schema and snapshots. The
  facade reads the heap only through its typed accessors (band, owner, page size, counters), never its columns.
  This module is the facade: validation, hot paths, the calls; its
  parts :mod:`~umalloc.allocator.translation`, :mod:`~umalloc.allocator.space`, :mod:`~umalloc.allocator.leasing` and
  :mod:`~umalloc.allocator.freeing` (free and release) hold the rest of its methods.
* **Tables handed out are read-only**: :meth:`MultiEndedAllocator.v2p` / :meth:`~MultiEndedAllocator.p2v` return
  :class:`~umalloc.allocator.ids.ReadOnlyTable` views (writes and ``out=`` refused), :class:`EndView` arrays are
  read-only numpy views, :meth:`~MultiEndedAllocator.snapshot` returns copies.
* **One allocator per arena** (a second one on the same :class:`~umalloc.geometry.arena.Arena` raises
  :class:`~umalloc.errors.ArenaInUseError` while the first is alive).
* ``strict`` is a ``bool`` everywhere, default ``True`` (a tombstoned or unbound page raises); ``0``, ``"no"``
  and other non-bools are refused.

Note [Pending pages]
~~~~~~~~~~~~~~~~~~~~
``free`` and ``release_end`` retire the virtual id at once (tables become TOMBSTONE, the id may be re-minted,
F02); the *physical* page becomes a hole, or ``PAGE_PENDING`` if a lease pins it. A pending page is not in any
table, not drained, not counted as available, and blocks the band from retreating past it. When its last pin
drops the lease table calls back and it becomes a hole.

Note [Trials]
~~~~~~~~~~~~~
:meth:`MultiEndedAllocator.trial` lets a caller that composes several allocator calls (the request table: window
releases, evictions, one allocation) refuse the whole of them with nothing changed (F29). It copies ``meta``,
``h64`` and ``h8`` (the bind-mask area excepted: masks are append-only and cached by the heap) on entry and
writes them back on a rollback, then re-copies every device mirror. Pins are not touched by allocation, freeing
or compaction, and lease expiry waits while a trial runs, so the lease table and the restored tables agree.
Bytes: with ``compaction=False`` no envelope is written; with compaction on, moves write only into holes and gap
pages, so a rollback is exact except for the bytes of pages the trial itself freed, which ``keep_bytes`` saves.

Note [Page-level hot path]
~~~~~~~~~~~~~~~~~~~~~~~~~~
``alloc_pages(out=)``, ``free_pages`` and ``release_pages`` call the kernel's direct entry (Note [Direct entry] in
:mod:`umalloc.pool.kernels.ops`) from the public method when every argument has the one form the entry was
compiled for -- an ``int`` ``num_pages``, 1-D arrays whose dtype *is* the canonical native int64
(``type(x) is np.ndarray``; a writeable ``out``), the default owner -- and nothing runs around the kernel: one
id owner (``_plain``), no device mirror, no debug checks, no eager compaction, and no active lease. With no
active lease ``_tick`` has nothing to reclaim: a lease past its deadline stays in the active table until
``_tick`` takes it out, so the first call after a deadline still sees it and takes the general path (F12).
Anything else -- torch ids, other dtypes or dtype objects, ``owner=``, a shortfall's retry -- takes the general
path, which validates and converts, then runs the same kernel through the dispatcher: both paths give the same
result and the same typed errors. The kernels bound every read and write by the lengths they are given (an
``index`` slot is checked against the table before anything changes, and all slots are read before the first
write, so ``index`` may overlap ``out``).

Note [Exact ids]
~~~~~~~~~~~~~~~~
:meth:`MultiEndedAllocator.claim_pages` takes the virtual pages the caller names instead of the lowest free ones,
for an allocator used as an id allocator: one ``up`` end, the only end of its arena, never compacted by the
caller, so that virtual page ``v`` sits on physical page ``v`` (lowest-free-first minting keeps that identity,
and a claim binds ``v`` to page ``v``). A claimed page below the band's edge is a hole taken out of the hole
bitmap; one at or past the edge moves the edge to ``v + 1`` and the pages skipped become holes. One kernel
call, O(len(vpages) + pages skipped).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NoReturn, overload

import numpy as np
import torch

from umalloc.allocator import retraction
from umalloc.allocator.freeing import FreePart
from umalloc.allocator.ids import (
    _I64,
    _NP_I64,
    _id_arg,
    _ids,
    _out,
    _out_arg,
    count_arg,
    id_batch,
)
from umalloc.allocator.leasing import LeasePart
from umalloc.allocator.observe import (
    EndStats,
    EndView,
    check_invariants,
    end_stats,
    snapshot,
    snapshots_equal,
)
from umalloc.allocator.space import SpacePart
from umalloc.allocator.translation import TranslationPart
from umalloc.errors import (
    HeapCopyError,
    InvalidIdError,
    UmallocValueError,
)
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, Grow
from umalloc.leases.table import LeaseTable
from umalloc.pool.heap import Heap, claim_arena
from umalloc.pool.kernels import raw
from umalloc.pool.kernels.codes import OK, raise_for
from umalloc.pool.kernels.layout import (
    SPLIT_ONE,
    V_FREED,
    V_LIVE,
    V_NEVER,
    V_RESERVED,
)
from umalloc.pool.kernels.ops import (
    CLAIM_LIVE,
    CLAIM_RANGE,
    hot_entries,
    k_alloc_pages,
    k_bind,
    k_claim,
    k_decode,
    k_extend,
)
from umalloc.pool.mirror import make_mirrors, refresh

logger = logging.getLogger(__name__)

COMPACTION_MODES = ("eager", "lazy", "off")

class AllocatorTrial:
    """The handle :meth:`MultiEndedAllocator.trial` yields: :meth:`commit` keeps what the trial did."""

    __slots__ = ("committed",)

    def __init__(self) -> None:
        self.committed = False

    def commit(self) -> None:
        """Keep every change made inside the trial (idempotent). O(1)."""
        self.committed = True


class MultiEndedAllocator(TranslationPart, SpacePart, LeasePart, FreePart):
    """Hands out pages of every end of one :class:`~umalloc.geometry.arena.Arena` under virtual token ids.

    Args:
        arena: the arena whose ends this allocator manages (one allocator per arena).
        compaction: ``"lazy"`` (default: compact only when an allocation falls short), ``"eager"`` (compact
            after every free) or ``"off"``. Compaction is :mod:`umalloc.pool.compaction`'s (Note [Shortfall]).
        move_budget_pages: most pages one lazy compaction may move per call (``None``: unbounded).
        clock: monotonic clock in seconds for lease deadlines (tests pass a fake one).
        debug_checks: run :meth:`check_invariants` after every mutating call (O(slots) each: tests only).
        float_split: where an empty float end is placed in its gap (Note [Float policy]): one fraction in
            ``[0, 1]`` for every float end, or a mapping end name -> fraction (default 0.5).
        mirror_device: device of the ``v2p`` mirrors (default: the arena's device when it is CUDA, else no
            mirror: :meth:`v2p` then aliases the host masters). A CPU mirror exercises the refresh path in tests.

    Internal representation (the agreed one, see :class:`EndView` and Note [Host heaps]): per end, host ``p2v``
    (int64) and ``state`` (int8, :mod:`umalloc.pool.pagestate`) of length ``num_page_slots(end)`` and ``v2p`` (int64)
    of length ``num_vpages(owner)``; per owner a virtual-page state array (``V_NEVER/V_LIVE/V_FREED/
    V_RESERVED``); pin counts are the heap's, lent to the :class:`~umalloc.leases.table.LeaseTable`.

    Threading: one owner thread calls the allocator; lease and plan endings may come from any thread (Note
    [Lease threading] in :mod:`umalloc.leases.table`).

    >>> from umalloc.testing import small_allocator
    >>> alloc = small_allocator()          # full (up, owner) + swa (down, bound), 10 slots each, page_size 2
    >>> alloc.alloc_pages(3).tolist()          # virtual pages 1, 2, 3
    [1, 2, 3]
    >>> alloc.translate_pages(torch.tensor([1, 2, 3]), "full").tolist(), alloc.translate_pages(
    ...     torch.tensor([1, 2, 3]), "swa").tolist()
    ([1, 2, 3], [7, 8, 9])
    """
    def __init__(self, arena: Arena, *, compaction: str = "lazy", move_budget_pages: int | None = None,
                 clock: Callable[[], float] = time.monotonic, debug_checks: bool = False,
                 float_split: float | Mapping[str, float] = 0.5,
                 mirror_device: str | torch.device | None = None) -> None:
        if not isinstance(arena, Arena):
            raise UmallocValueError(f"arena={arena!r}: allowed an umalloc.geometry.arena.Arena")
        if compaction not in COMPACTION_MODES:
            raise UmallocValueError(f"compaction={compaction!r}: allowed one of {COMPACTION_MODES}")
        if move_budget_pages is not None and (isinstance(move_budget_pages, bool)
                                              or not isinstance(move_budget_pages, int) or move_budget_pages < 0):
            raise UmallocValueError(f"move_budget_pages={move_budget_pages!r}: allowed None or an int >= 0")
        if not callable(clock):
            raise UmallocValueError(f"clock={clock!r}: allowed a callable returning monotonic seconds")
        if not isinstance(debug_checks, (bool, np.bool_)):
            raise UmallocValueError(f"debug_checks={debug_checks!r}: allowed True or False")
        self.arena = arena
        self.spec: ArenaSpec = arena.spec
        self.compaction_mode = compaction
        self.move_budget_pages = move_budget_pages
        self.debug_checks = bool(debug_checks)
        self.last_shortfall: dict[str, int] = {}
        self._names: tuple[str, ...] = tuple(e.name for e in self.spec.ends)
        self._index: dict[str, int] = {n: i for i, n in enumerate(self._names)}
        if mirror_device is None:
            device = arena.device
        else:
            try:
                device = torch.device(mirror_device)
            except (RuntimeError, ValueError, TypeError):
                raise UmallocValueError(f"mirror_device={mirror_device!r}: allowed None, 'cpu' or 'cuda[:N]'") from None
            if device.type not in ("cpu", "cuda"):
                raise UmallocValueError(f"mirror_device={mirror_device!r}: allowed None, 'cpu' or 'cuda[:N]'")
            if device.type == "cuda" and not torch.cuda.is_available():
                raise UmallocValueError(f"mirror_device={mirror_device!r}: no CUDA device is available here; "
                                        "allowed None or 'cpu'")
        heap = Heap(self.spec, self._float_splits(float_split))
        self._heap = heap
        # the heap's arrays under the names the facade's code uses (aliases: the heap owns them)
        self._meta, self._h64, self._h8, self._pins = heap.meta, heap.h64, heap.h8, heap.pins
        self._chain, self._err, self._scratch = heap.chain, heap.err, heap.scratch
        self._owners, self._group, self._host2d = heap.owners, heap.group, heap.host2d
        self._root_a, self._mask_base = heap.root_a, heap.mask_base
        owners = self._owners
        self._default_owner = owners[0] if len(owners) == 1 else -1
        self._default_mask = self._bind_mask(owners[0], None) if len(owners) == 1 else -1
        self.ends: Mapping[str, EndView] = MappingProxyType(
            {n: EndView(heap, self.spec, i) for i, n in enumerate(self._names)})

        self._holder_checks: list[weakref.WeakMethod] = []  # attach_holder_check: RequestTable checks
        # ---- leases: the heap's pin arrays, lent to the table
        self._leases = LeaseTable({n: heap.slots[i] for i, n in enumerate(self._names)}, clock=clock,
                                  on_unpinned=self._on_unpinned,
                                  first_pages={n: heap.first_page(i) for i, n in enumerate(self._names)},
                                  validator=self._validate_lease_pages,
                                  pins=dict(zip(self._names, heap.pins, strict=True)))
        # O(1) truthiness: the hot path's "any lease work?" test (an active lease, or pages unpinned on another
        # thread waiting to be delivered: Note [Lease threading])
        self._active_leases = self._leases.work_view
        self._expired_by_end = [0] * len(self._names)
        self._trial_depth = 0   # trial(): lease expiry waits while a trial runs (Note [Trials])

        # ---- device mirrors of v2p (one 2-D block per owner group) when the arena lives on CUDA
        self._device = device
        self._mirror: dict[int, torch.Tensor] = {}
        if device.type == "cuda" or mirror_device is not None:
            self._mirror = make_mirrors(self._host2d, device)
        self._sync = bool(self._mirror) or self.debug_checks
        self._eager = compaction == "eager"
        # Note [Page-level hot path]: alloc_pages / free_pages / release_pages with numpy ids, the default owner
        # and nothing to do after the kernel (no device mirror, no debug checks, no eager compaction, no lease)
        # run the kernel straight from the public method; anything else takes the general path
        self._plain = not self._sync and not self._eager and len(owners) == 1
        # UMALLOC_DEBUG=1: every direct-entry argument is checked (Note [Direct entry]); ids a direct entry reads
        # by address are lent (raw.lend) so the check can bound them. Dispatcher calls type their own arguments.
        self._debug = os.environ.get("UMALLOC_DEBUG", "") == "1"
        self._hot = hot_entries(self._debug)
        self._addr = raw.lend if self._debug else raw.address
        self._bound: dict[str, int] = {n: i for i, n in enumerate(self._names) if heap.owner_of(i) != i}
        if self.debug_checks:
            self.check_invariants()
        claim_arena(arena, self)

    def _refuse_copy(self, *_: Any) -> NoReturn:
        raise HeapCopyError("a MultiEndedAllocator cannot be copied, deep-copied or pickled (it owns a heap of raw "
                            "addresses and its arena); allowed: build a new allocator on a new Arena")

    __copy__ = _refuse_copy
    __deepcopy__ = _refuse_copy
    __reduce_ex__ = _refuse_copy
    __reduce__ = _refuse_copy

    def _float_splits(self, float_split: float | Mapping[str, float]) -> dict[str, int]:
        floats = [e.name for e in self.spec.ends if e.grow is Grow.FLOAT]
        items = float_split.items() if isinstance(float_split, Mapping) else [(n, float_split) for n in floats]
        out = {}
        for name, frac in items:
            if name not in floats:
                raise UmallocValueError(f"float_split names {name!r}: allowed one of the float ends {floats}")
            if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
                raise UmallocValueError(f"float_split[{name!r}]={frac!r}: allowed a number in [0, 1]")
            out[name] = int(round(frac * SPLIT_ONE))
        return out

    # ------------------------------------------------------------------------------------------------------
    # ends and id spaces
    # ------------------------------------------------------------------------------------------------------
    def _end_index(self, end: str) -> int:
        try:
            return self._index[end]
        except (KeyError, TypeError):
            raise UmallocValueError(f"end {end!r}: allowed one of {list(self._names)}") from None

    def _owner_index(self, owner: str | None) -> int:
        if owner is None:
            if self._default_owner < 0:
                raise UmallocValueError(
                    f"owner=None is ambiguous: this arena has id-owner ends "
                    f"{[self._names[o] for o in self._owners]}; pass owner=")
            return self._default_owner
        o = self._end_index(owner)
        if self._heap.owner_of(o) != o:
            raise UmallocValueError(f"owner={owner!r} is bound to {self.owner_of(owner)!r}; allowed an id-owner "
                                    f"end: {[self._names[i] for i in self._owners]}")
        return o

    def _bind_mask(self, o: int, bind: Iterable[str] | None, *, only: int = -1) -> int:
        """Offset in ``h8`` of the bind mask of owner ``o`` (:meth:`umalloc.pool.heap.Heap.bind_mask`)."""
        return self._heap.bind_mask(o, bind, only=only)

    def owner_of(self, end: str) -> str:
        """Name of the id-owner end whose virtual ids ``end`` uses (``end`` itself for an owner).

        >>> from umalloc.testing import small_allocator
        >>> small_allocator().owner_of("swa")
        'full'
        """
        return self._names[self._heap.owner_of(self._end_index(end))]

    def num_vpages(self, owner: str | None = None) -> int:
        """Size of the owner's virtual page id space (``num_page_slots(owner)``; id 0 is reserved).

        >>> from umalloc.testing import small_allocator
        >>> small_allocator().num_vpages()
        10
        """
        return self._heap.num_vpages(self._owner_index(owner))

    def bound_ends(self, owner: str | None = None) -> tuple[str, ...]:
        """Names of the ends bound to ``owner`` (excluding the owner)."""
        return tuple(self._names[b] for b in self._group[self._owner_index(owner)][1:])

    def band(self, end: str) -> tuple[int, int]:
        """The band ``[lo, hi)`` of ``end`` in its physical pages. O(1)."""
        return self._heap.band(self._end_index(end))

    def watermark(self, end: str) -> int:
        """``hi`` of an up/float end's band; ``lo - 1`` of a down end's (band ``(watermark, top]``). O(1)."""
        return self.ends[self._names[self._end_index(end)]].watermark

    # ------------------------------------------------------------------------------------------------------
    # per-call plumbing
    # ------------------------------------------------------------------------------------------------------
    def _raise(self, where: str, *, pages: bool = False) -> NoReturn:
        """Raise the typed error the last kernel left in err (ids are virtual pages if ``pages``)."""
        raise_for(self._err, self._meta, self._names, where, pages=pages)
        raise AssertionError("unreachable")

    def _after(self, o: int, n_scratch: int) -> None:
        """After a mutating call: refresh owner ``o``'s ``v2p`` mirror for the ``n_scratch`` virtual pages the
        kernel left in the scratch area; debug checks."""
        if self._mirror and n_scratch:
            self._refresh_mirror(o, self._scratch[:n_scratch])
        if self.debug_checks:
            self.check_invariants()

    def _refresh_mirror(self, o: int, vids: np.ndarray) -> None:
        """Refresh owner ``o``'s device mirror at the virtual pages ``vids`` (:func:`umalloc.pool.mirror.refresh`)."""
        if self._mirror:
            refresh(self._mirror[o], self._host2d[o], vids)

    # ------------------------------------------------------------------------------------------------------
    # allocation
    # ------------------------------------------------------------------------------------------------------
    def _resolve(self, owner: str | None, bind: Sequence[str] | None) -> tuple[int, int]:
        if owner is None and bind is None and self._default_owner >= 0:
            return self._default_owner, self._default_mask
        o = self._owner_index(owner)
        return o, self._bind_mask(o, bind)

    @overload
    def alloc_pages(self, num_pages: int, *, owner: str | None = None, bind: Sequence[str] | None = None,
                    out: None = None, index: None = None) -> torch.Tensor | None: ...
    @overload
    def alloc_pages(self, num_pages: int, *, owner: str | None = None, bind: Sequence[str] | None = None,
                    out: torch.Tensor, index: torch.Tensor | np.ndarray | None = None) -> torch.Tensor | None: ...
    @overload
    def alloc_pages(self, num_pages: int, *, owner: str | None = None, bind: Sequence[str] | None = None,
                    out: np.ndarray, index: torch.Tensor | np.ndarray | None = None) -> np.ndarray | None: ...
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
                and not self._active_leases and out.dtype is _NP_I64 and out.ndim == 1 and out.flags.writeable:
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
                if self._hot.alloc_pages(*args) != OK and self._retry(
                        k_alloc_pages, args, self._default_mask, "alloc_pages") is None:
                    return None
                return out
        num_pages = count_arg(num_pages, "num_pages")
        if owner is None and bind is None and self._default_owner >= 0:  # the hot path: no call
            o, mask = self._default_owner, self._default_mask
        else:
            o, mask = self._resolve(owner, bind)
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
        if self._active_leases:
            self._tick()
        args = (self._root_a, o, mask, k, arg, n_out, idx_arg, n_idx)
        if k_alloc_pages(*args) != OK and self._retry(k_alloc_pages, args, mask, "alloc_pages") is None:
            return None
        del keep_idx
        if self._sync:
            self._after(o, k)
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

        >>> from umalloc import Arena, ArenaSpec, EndSpec, LayerSpec
        >>> alloc = MultiEndedAllocator(Arena(ArenaSpec((EndSpec("ids", (LayerSpec.mha(1, 4),), page_size=1),),
        ...                                             arena_bytes=8 * 16)), compaction="off")
        >>> alloc.claim_pages([5])
        >>> alloc.alloc_pages(3).tolist(), alloc.translate_pages(torch.tensor([5]), "ids").tolist()
        ([1, 2, 3], [5])
        """
        if len(self._names) != 1 or self.spec.ends[0].grow is not Grow.UP:
            raise UmallocValueError(f"claim_pages: allowed an id allocator (one 'up' end, the arena's only one); "
                                    f"this arena has ends {list(self._names)}")
        vp = id_batch(vpages, "vpages")
        if self._active_leases:
            self._tick()
        r = int(k_claim(self._root_a, 0, vp))
        if r:
            code, pos = r % 8, r // 8
            v = int(vp[pos])
            if code == CLAIM_RANGE:
                raise InvalidIdError(f"claim_pages: vpages[{pos}]={v} is out of range; allowed "
                                     f"[{max(1, self.ends[self._names[0]].first_page)}, {self.ends[self._names[0]].top_page}]")
            what = "is live or repeated in the batch" if code == CLAIM_LIVE else "has a physical page that is not free"
            raise InvalidIdError(f"claim_pages: vpages[{pos}]={v} {what}; allowed distinct free virtual pages")
        if self._sync:
            self._refresh_mirror(0, vp)
            if self.debug_checks:
                self.check_invariants()

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
            o, mask = self._resolve(owner, bind)
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
        if self._active_leases:
            self._tick()
        addr = self._addr
        args = (self._root_a, o, mask, addr(prefix_lens), addr(seq_lens), addr(last_loc), B, out_a, n_out)
        res = self._hot.extend(*args)
        if self._err[0] != OK:
            res = self._retry(k_extend, args, mask, "alloc_extend")
            if res is None:
                return None
        if self._sync:
            self._after(o, int(self._err[1]))
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
            o, mask = self._resolve(owner, bind)
        seq_lens = _ids(seq_lens, "seq_lens")
        last_loc = _ids(last_loc, "last_loc")
        B = seq_lens.numel()
        if last_loc.numel() != B:
            raise InvalidIdError(f"alloc_decode: shapes seq_lens ({B},), last_loc ({last_loc.numel()},); allowed "
                                 f"two equal (B,) shapes")
        res = torch.empty(B, dtype=_I64) if out is None else _out(out, B)
        if self._active_leases:
            self._tick()
        addr = self._addr
        args = (self._root_a, o, mask, addr(seq_lens), addr(last_loc), B, addr(res))
        if self._hot.decode(*args) != OK and self._retry(k_decode, args, mask, "alloc_decode") is None:
            return None
        if self._sync:
            self._after(o, int(self._err[1]))
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
        b = self._bound_index(end, "bind_end")
        toks = _ids(vtokens, "vtokens")
        o = self._heap.owner_of(b)
        mask = self._bind_mask(o, None, only=b)
        if self._active_leases:
            self._tick()
        args = (self._root_a, b, mask, raw.address(toks), toks.numel())
        n = k_bind(*args)
        if n < 0:
            n = self._retry(k_bind, args, mask, "bind_end")
            if n is None:
                return False
        if self._sync:
            self._after(o, n)
        return True

    @contextlib.contextmanager
    def trial(self, *, compaction: bool = True, keep_bytes: Mapping[str, np.ndarray] | None = None,
              ) -> Iterator[AllocatorTrial]:
        """Run allocator calls that a caller may roll back as one (Note [Trials]): on leaving the ``with`` block
        without :meth:`AllocatorTrial.commit`, every host table, band, counter and mirror is restored to what it
        was on entry; ``keep_bytes`` (end name -> physical pages) have their envelope bytes saved on entry and
        written back on a rollback (pages a trial frees whose content must survive it).

        Args:
            compaction: ``False`` runs the trial with compaction off (no byte moves: a rollback is exact without
                ``keep_bytes``); ``True`` keeps the allocator's mode, whose moves write only into holes and gap.

        Raises:
            UmallocValueError: ``compaction`` not a bool, a bad ``keep_bytes``, or a trial inside a trial.

        Threading: holds the lease table's lock throughout; lease expiry (F12) waits until the trial ends.
        Complexity: O(slots + virtual pages) to save and to restore, plus the ``keep_bytes``.

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator(); before = alloc.snapshot()
        >>> with alloc.trial() as t:
        ...     _ = alloc.alloc_pages(3)
        >>> snapshots_equal(before, alloc.snapshot())
        True
        """
        if type(compaction) is not bool:
            raise UmallocValueError(f"trial: compaction={compaction!r}; allowed True or False")
        if self._trial_depth:
            raise UmallocValueError("trial: a trial is already running on this allocator; allowed one at a time")
        saved_bytes: list[tuple[str, np.ndarray, torch.Tensor]] = []
        for end, pages in (keep_bytes or {}).items():
            e = self._end_index(end)
            p = np.asarray(pages, dtype=np.int64).reshape(-1)
            if p.size and (int(p.min()) < 1 or int(p.max()) >= int(self.ends[self._names[e]].num_page_slots)):
                raise UmallocValueError(f"trial: keep_bytes[{end!r}] holds a page outside [1, slots)")
            env = self.arena.envelopes(end)
            saved_bytes.append((end, p, env[torch.from_numpy(p).to(env.device)].clone()))
        with self._leases.lock:
            if self._active_leases:
                self._tick()
            heap = self._heap
            mb = heap.mask_base
            saved = (self._meta.copy(), self._h64.copy(), self._h8[:mb].copy(), dict(self.last_shortfall))
            mode, eager, debug = self.compaction_mode, self._eager, self.debug_checks
            handle = AllocatorTrial()
            self._trial_depth = 1
            if not compaction:
                self.compaction_mode, self._eager = "off", False
            self.debug_checks = False   # a caller's tables are mid-change inside a trial
            try:
                yield handle
            finally:
                self._trial_depth = 0
                self.compaction_mode, self._eager, self.debug_checks = mode, eager, debug
                if not handle.committed:
                    self._meta[:] = saved[0]
                    self._h64[:] = saved[1]
                    self._h8[:mb] = saved[2]
                    for end, p, data in saved_bytes:
                        env = self.arena.envelopes(end)
                        env[torch.from_numpy(p).to(env.device)] = data
                    for o, mirror in self._mirror.items():
                        mirror.copy_(torch.from_numpy(self._host2d[o]))
                elif self.debug_checks:
                    self.check_invariants()

    def _bound_index(self, end: str, where: str) -> int:
        b = self._end_index(end)
        if self._heap.owner_of(b) == b:
            raise UmallocValueError(f"{where}: end {end!r} is an id-owner end; allowed a bound end: "
                                    f"{[n for n in self._names if self.owner_of(n) != n]}")
        return b

    def retract(self, vtokens: torch.Tensor, *, owner: str | None = None) -> Any:
        """Copy a request's pages of every end (owner and every bound end) to host memory, then free them;
        see :func:`umalloc.allocator.retraction.retract` (returns a ``RetractedKV``)."""
        return retraction.retract(self, vtokens, owner=owner)

    def restore(self, retracted: Any) -> torch.Tensor | None:
        """Re-allocate a retracted request (virtual ids re-minted) and write its bytes back; ``None`` (nothing
        changed) if an end lacks space. See :func:`umalloc.allocator.retraction.restore`."""
        return retraction.restore(self, retracted)

    # ------------------------------------------------------------------------------------------------------
    # observability
    # ------------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, EndStats]:
        """Fixed-schema :class:`EndStats` per end name. O(ends + active leases).

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()
        >>> _ = alloc.alloc_pages(3)
        >>> s = alloc.stats()["swa"]
        >>> s.live_pages, s.live_bytes, s.band_lo, s.watermark, s.free_pages
        (3, 96, 7, 6, 3)
        """
        if self._active_leases:
            self._tick()
        return end_stats(self._heap, self.spec, self.ends, self._leases, self._expired_by_end)

    def snapshot(self) -> dict[str, Any]:
        """Every page's state and every table, as copies (numpy arrays), plus bands and counters.

        Schema: ``{"ends": {name: {"state", "p2v", "v2p", "pins": arrays; "band": (lo, hi), "watermark",
        "grow", "owner", "page_bytes", "page_size", "first_page", "top_page", "counters": dict}}, "owners":
        {name: {"vstate": array (V_NEVER=0, V_LIVE=1, V_FREED=2, V_RESERVED=3), "live": int}}, "leases": [...]}``.
        Two snapshots compare equal (:func:`snapshots_equal`) iff nothing observable changed. O(slots).
        """
        return snapshot(self._heap, self.ends, self._leases)

    def check_invariants(self) -> None:
        """Check every invariant in O(slots + virtual pages) (:func:`umalloc.allocator.observe.check_invariants` lists
        them); raise :class:`~umalloc.errors.InvariantError` naming the first broken one. Call it on the owner
        thread: it first delivers pages that leases ended on other threads (Note [Lease threading]) and holds
        the lease table's lock while it checks.

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator(); _ = alloc.alloc_pages(2); alloc.check_invariants()
        """
        with self._leases.lock:
            if self._leases._queue:
                self._leases.drain()
            check_invariants(self._heap, self.spec, self.ends, self._mirror, self._leases)
        for ref in tuple(self._holder_checks):
            if (check := ref()) is not None:
                check()

    def attach_holder_check(self, check: Callable[[], None]) -> None:
        """Run bound method ``check`` (held weakly) at the end of every :meth:`check_invariants`: a holder of
        pages (the :class:`~umalloc.requests.table.RequestTable`) adds what only it can see, e.g. a live page
        held by no one (F08, F28). O(1)."""
        self._holder_checks.append(weakref.WeakMethod(check))  # type: ignore[arg-type]

    def holders(self) -> list[object]:
        """The live objects whose checks :meth:`attach_holder_check` attached (request tables). O(holders)."""
        return [c.__self__ for r in self._holder_checks if (c := r()) is not None]

    def __repr__(self) -> str:
        ends = ", ".join(repr(v) for v in self.ends.values())
        return f"MultiEndedAllocator({ends})"


__all__ = ["COMPACTION_MODES", "AllocatorTrial", "V_FREED", "V_LIVE", "V_NEVER", "V_RESERVED", "EndStats", "EndView",
           "MultiEndedAllocator", "snapshots_equal"]
