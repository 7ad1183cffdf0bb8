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
  counted as available) until its last lease is released (F11). Expired leases are reclaimed at the start of every
  allocator call (F12). Compaction (:mod:`umalloc.pool.compaction`) never moves a pinned or pending page.

* **Layers** (one concept per module): :mod:`umalloc.pool.heap` owns every array and the root address
  vector; :mod:`umalloc.pool.kernels` is the numba layer (the only pointer intrinsics are in
  :mod:`umalloc.pool.kernels.raw`); :mod:`umalloc.pool.ladder` plans the shortfall ladder (pure);
  :mod:`umalloc.ids` validates ids and counts at the boundary, :mod:`umalloc.allocator.arguments` turns them
  into kernel arguments; :mod:`umalloc.pool.views` holds the typed, read-only end views and the heap's invariant checks, :mod:`umalloc.allocator.observe` the stats schema and snapshots.
  This module is the facade: it validates the constructor's arguments, builds the services (Note [Composed
  services]) and runs trials and the observability calls.
* **Tables handed out are read-only**: :meth:`MultiEndedAllocator.v2p` / :meth:`~MultiEndedAllocator.p2v` return
  :class:`~umalloc.allocator.arguments.ReadOnlyTable` views (writes and ``out=`` refused), :class:`EndView` arrays
  are read-only numpy views, :meth:`~MultiEndedAllocator.snapshot` returns copies.
* **One allocator per arena** (a second one on the same :class:`~umalloc.geometry.arena.Arena` raises
  :class:`~umalloc.errors.ArenaInUseError` while the first is alive).
* ``strict`` is a ``bool`` everywhere, default ``True`` (a tombstoned or unbound page raises); ``0``, ``"no"``
  and other non-bools are refused.

Note [Composed services]
~~~~~~~~~~~~~~~~~~~~~~~~
The allocator is a composition, not a class cut into files. Each part is a small object that owns its state and
receives, at construction, the parts it calls (nothing else reaches into it):

::

    MultiEndedAllocator --+-- Heap (pool: every host array, typed accessors)
                          +-- EndIndex (names -> indices)        KernelEntry (root, direct entries, errors)
                          +-- LeaseService (LeaseTable, expiry)  AfterCall (mirrors, debug checks)
                          +-- SpaceService (capacity, ladder, compaction policy, last shortfall)
                          +-- AllocationService, FreeingService, TranslationService (the per-call work)

The facade's methods delegate to the service of their concern with the same signature; each service method
documents its call in full. For the per-call methods (allocation, translation, free and unbind) the facade
binds the service's bound method on the instance at construction, so a call costs what a call on the service
costs (one attribute lookup, no extra frame); a subclass that overrides one of them keeps its override.

Note [Pending pages]
~~~~~~~~~~~~~~~~~~~~
``free`` and ``unbind_end`` retire the virtual id at once (tables become TOMBSTONE, the id may be re-minted,
F02); the *physical* page becomes a hole, or ``PAGE_PENDING`` if a lease pins it. A pending page is not in any
table, not drained, not counted as available, and blocks the band from retreating past it. When its last pin
drops the lease table calls back and it becomes a hole.

Note [Trials]
~~~~~~~~~~~~~
:meth:`MultiEndedAllocator.trial` lets a caller that composes several allocator calls (the request table: window
unbinds, evictions, one allocation) refuse the whole of them with nothing changed (F29). The heap saves its
tables on entry (:meth:`~umalloc.pool.heap.Heap.save`: ``meta``, ``h64`` and ``h8``, the bind-mask area excepted:
masks are append-only and cached by the heap) and writes them back on a rollback
(:meth:`~umalloc.pool.heap.Heap.restore`), then every device mirror is re-copied. Each service suspends its own
policy for the trial through its own context manager: the lease service pauses expiry
(:meth:`~umalloc.allocator.leasing.LeaseService.pausing`), the space service turns compaction off on request
(:meth:`~umalloc.allocator.space.SpaceService.compaction_off`), the after-call work skips the debug checks
(:meth:`~umalloc.allocator.calls.AfterCall.checks_off`). Pins are not touched by allocation, freeing
or compaction, and lease expiry waits while a trial runs, so the lease table and the restored tables agree.
Bytes: with ``compaction=False`` no envelope is written; with compaction on, moves write only into holes and gap
pages, so a rollback is exact except for the bytes of pages the trial itself freed, which ``keep_bytes`` saves.

Note [Page-level hot path]
~~~~~~~~~~~~~~~~~~~~~~~~~~
``alloc_pages(out=)``, ``free_pages`` and ``unbind_pages`` call the kernel's direct entry (Note [Direct entry] in
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
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NoReturn, overload

import numpy as np
import torch

from umalloc.allocator import retraction
from umalloc.allocator.allocation import AllocationService
from umalloc.allocator.calls import AfterCall, KernelEntry
from umalloc.allocator.ends import EndIndex
from umalloc.allocator.freeing import FreeingService
from umalloc.allocator.leasing import LeaseService
from umalloc.allocator.observe import (
    EndStats,
    EndView,
    check_invariants,
    end_stats,
    snapshot,
    snapshots_equal,
)
from umalloc.allocator.space import SpaceService
from umalloc.allocator.translation import TranslationService
from umalloc.errors import (
    HeapCopyError,
    UmallocValueError,
)
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, Grow, swa_tail_start
from umalloc.leases.table import Lease, LeaseTable
from umalloc.pool.compaction import CompactionReport
from umalloc.pool.heap import Heap, claim_arena
from umalloc.pool.kernels.layout import (
    SPLIT_ONE,
    V_FREED,
    V_LIVE,
    V_NEVER,
    V_RESERVED,
)
from umalloc.pool.pagestate import PAGE_PENDING

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


class MultiEndedAllocator:
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
        self._holder_checks: list[weakref.WeakMethod] = []  # attach_holder_check: RequestTable checks
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
        # the parts (Note [Composed services]): each owns its state and gets what it uses at construction
        heap = Heap(self.spec, self._float_splits(float_split))
        self._heap = heap
        ends = self._ends = EndIndex(heap)
        entry = self._entry = KernelEntry(heap)
        # v2p mirrors (one 2-D block per owner group) when the arena lives on CUDA, or on request
        mirrored = device.type == "cuda" or mirror_device is not None
        after_call = self._after_call = AfterCall(heap, device if mirrored else None, bool(debug_checks),
                                                  self.check_invariants)
        leasing = self._leasing = LeaseService(heap, ends, clock)
        space = self._space = SpaceService(heap, arena, self.spec, ends, entry, leasing, after_call,
                                           compaction=compaction, move_budget_pages=move_budget_pages)
        self._trial_depth = 0
        self.ends: Mapping[str, EndView] = MappingProxyType(
            {n: EndView(heap, self.spec, i) for i, n in enumerate(ends.names)})
        # Note [Page-level hot path]: alloc_pages / free_pages / unbind_pages with numpy ids, the default owner
        # and nothing to do after the kernel (no device mirror, no debug checks, no eager compaction, no lease)
        # run the kernel straight from the public method; anything else takes the general path
        self._plain = not after_call.sync and not space.eager and len(ends.owners) == 1
        self._translation = TranslationService(heap, ends, entry, after_call.mirrors)
        self._freeing = FreeingService(heap, ends, entry, leasing, after_call, space, plain=self._plain)
        self._allocation = AllocationService(heap, self.spec, ends, entry, leasing, after_call, space,
                                             plain=self._plain)
        self._bind_delegates()
        if after_call.debug_checks:
            self.check_invariants()
        claim_arena(arena, self)
        arena.guard_pages(self.pages_in_use)  # Note [Guarded destinations] in umalloc.geometry.arena

    def _bind_delegates(self) -> None:
        """Note [Composed services]: the per-call methods bound straight to their service on this instance."""
        cls = type(self)
        for name, service in (("alloc_pages", self._allocation), ("alloc_extend", self._allocation),
                              ("alloc_decode", self._allocation), ("bind_end", self._allocation),
                              ("translate", self._translation), ("translate_pages", self._translation),
                              ("free", self._freeing), ("free_pages", self._freeing),
                              ("unbind_end", self._freeing), ("unbind_pages", self._freeing)):
            if getattr(cls, name) is getattr(MultiEndedAllocator, name):  # a subclass's override wins
                self.__dict__[name] = getattr(service, name)

    # ---- the parts' state, read through the facade
    @property
    def compaction_mode(self) -> str:
        """``"lazy"``, ``"eager"`` or ``"off"`` (the constructor's ``compaction``)."""
        return self._space.compaction_mode

    @property
    def move_budget_pages(self) -> int | None:
        """Most pages one lazy compaction may move per call (``None``: unbounded)."""
        return self._space.move_budget_pages

    @property
    def last_shortfall(self) -> dict[str, int]:
        """End name -> pages lacking in the last allocation that fell short (F20)."""
        return self._space.last_shortfall

    @property
    def debug_checks(self) -> bool:
        """Whether :meth:`check_invariants` runs after every mutating call."""
        return self._after_call.debug_checks

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
    def owner_of(self, end: str) -> str:
        """Name of the id-owner end whose virtual ids ``end`` uses (``end`` itself for an owner).

        >>> from umalloc.testing import small_allocator
        >>> small_allocator().owner_of("swa")
        'full'
        """
        return self._ends.owner_name(self._ends.end(end))

    def num_vpages(self, owner: str | None = None) -> int:
        """Size of the owner's virtual page id space (``num_page_slots(owner)``; id 0 is reserved).

        >>> from umalloc.testing import small_allocator
        >>> small_allocator().num_vpages()
        10
        """
        return self._heap.num_vpages(self._ends.owner(owner))

    def bound_ends(self, owner: str | None = None) -> tuple[str, ...]:
        """Names of the ends bound to ``owner`` (excluding the owner)."""
        return tuple(self._ends.names[b] for b in self._ends.group[self._ends.owner(owner)][1:])

    def band(self, end: str) -> tuple[int, int]:
        """The band ``[lo, hi)`` of ``end`` in its physical pages. O(1)."""
        return self._heap.band(self._ends.end(end))

    def watermark(self, end: str) -> int:
        """``hi`` of an up/float end's band; ``lo - 1`` of a down end's (band ``(watermark, top]``). O(1)."""
        return self.ends[self._ends.names[self._ends.end(end)]].watermark

    # ------------------------------------------------------------------------------------------------------
    # allocation (:class:`~umalloc.allocator.allocation.AllocationService`)
    # ------------------------------------------------------------------------------------------------------
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
        """Mint ``num_pages`` fresh virtual pages bound on the owner and its bound ends:
        :meth:`AllocationService.alloc_pages <umalloc.allocator.allocation.AllocationService.alloc_pages>`."""
        return self._allocation.alloc_pages(num_pages, owner=owner, bind=bind, out=out, index=index)

    def claim_pages(self, vpages: torch.Tensor | np.ndarray | Sequence[int]) -> None:
        """Mint exactly the free virtual pages ``vpages`` (Note [Exact ids]):
        :meth:`AllocationService.claim_pages <umalloc.allocator.allocation.AllocationService.claim_pages>`."""
        self._allocation.claim_pages(vpages)

    def direct_kernel_args(self) -> tuple[int, int, int, Mapping[int, object]] | None:
        """``(root, owner, mask, lease_work)`` for a holder of this allocator's pages that calls the page kernels
        (``k_alloc_pages`` / ``k_free`` of :mod:`umalloc.pool.kernels.ops`) from its own numba kernel, fused with
        its bookkeeping (:class:`~umalloc.requests.pagerefs.PageRefs`): the heap root address, the one id owner's
        end index and its bind mask (ints, valid for the allocator's life), and a mapping that is non-empty while
        lease work is due (then call the public methods instead: they tick the leases first). ``None`` when a
        call does more than its kernel (a device mirror, ``debug_checks``, eager compaction, several id owners):
        use the public methods. O(1).

        >>> from umalloc.testing import small_allocator
        >>> len(small_allocator().direct_kernel_args()), small_allocator(debug_checks=True).direct_kernel_args()
        (4, None)
        """
        if not self._plain:
            return None
        return self._entry.root_a, self._ends.default_owner, self._ends.default_mask, self._leasing.work

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor, *,
                     owner: str | None = None, bind: Sequence[str] | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Allocate the tokens ``[prefix_len, seq_len)`` of each request (SGLang ``alloc_extend`` semantics):
        :meth:`AllocationService.alloc_extend <umalloc.allocator.allocation.AllocationService.alloc_extend>`."""
        return self._allocation.alloc_extend(prefix_lens, seq_lens, last_loc, owner=owner, bind=bind, out=out)

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor, *, owner: str | None = None,
                     bind: Sequence[str] | None = None, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Allocate one token per request at position ``seq_len - 1`` (SGLang ``alloc_decode`` semantics):
        :meth:`AllocationService.alloc_decode <umalloc.allocator.allocation.AllocationService.alloc_decode>`."""
        return self._allocation.alloc_decode(seq_lens, last_loc, owner=owner, bind=bind, out=out)

    def bind_end(self, end: str, vtokens: torch.Tensor) -> bool:
        """Bind fresh physical pages of bound ``end`` to live virtual pages:
        :meth:`AllocationService.bind_end <umalloc.allocator.allocation.AllocationService.bind_end>`."""
        return self._allocation.bind_end(end, vtokens)

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
            e = self._ends.end(end)
            p = np.asarray(pages, dtype=np.int64).reshape(-1)
            if p.size and (int(p.min()) < 1 or int(p.max()) >= int(self.ends[self._ends.names[e]].num_page_slots)):
                raise UmallocValueError(f"trial: keep_bytes[{end!r}] holds a page outside [1, slots)")
            env = self.arena.envelopes(end)
            saved_bytes.append((end, p, env[torch.from_numpy(p).to(env.device)].clone()))
        leasing, space, after_call = self._leasing, self._space, self._after_call
        with leasing.table.lock:
            if leasing.work:
                leasing.tick()
            saved = self._heap.save()
            handle = AllocatorTrial()
            self._trial_depth = 1
            try:
                with leasing.pausing(), space.compaction_off(not compaction), after_call.checks_off():
                    yield handle
            finally:
                self._trial_depth = 0
                if not handle.committed:
                    self._heap.restore(saved)
                    for end, p, data in saved_bytes:
                        env = self.arena.envelopes(end)
                        env[torch.from_numpy(p).to(env.device)] = data
                    after_call.reload_mirrors()
                else:
                    after_call.checks()

    # ------------------------------------------------------------------------------------------------------
    # the services' calls (Note [Composed services]; each documents its call in full)
    # ------------------------------------------------------------------------------------------------------
    @overload
    def translate(self, vtokens: torch.Tensor, end: str, *, strict: bool = True,
                  out: torch.Tensor | None = None) -> torch.Tensor: ...
    @overload
    def translate(self, vtokens: np.ndarray, end: str, *, strict: bool = True,
                  out: np.ndarray | None = None) -> np.ndarray: ...
    def translate(self, vtokens: torch.Tensor | np.ndarray, end: str, *, strict: bool = True,
                  out: torch.Tensor | np.ndarray | None = None) -> torch.Tensor | np.ndarray:
        """Physical token ids of ``end`` for virtual token ids: :meth:`TranslationService.translate
        <umalloc.allocator.translation.TranslationService.translate>`."""
        return self._translation.translate(vtokens, end, strict=strict, out=out)

    @overload
    def translate_pages(self, vpages: torch.Tensor, end: str, *, strict: bool = True,
                        out: torch.Tensor | None = None) -> torch.Tensor: ...
    @overload
    def translate_pages(self, vpages: np.ndarray, end: str, *, strict: bool = True,
                        out: np.ndarray | None = None) -> np.ndarray: ...
    def translate_pages(self, vpages: torch.Tensor | np.ndarray, end: str, *, strict: bool = True,
                        out: torch.Tensor | np.ndarray | None = None) -> torch.Tensor | np.ndarray:
        """Physical pages of ``end`` for virtual pages: :meth:`TranslationService.translate_pages
        <umalloc.allocator.translation.TranslationService.translate_pages>`."""
        return self._translation.translate_pages(vpages, end, strict=strict, out=out)

    def v2p(self, end: str) -> torch.Tensor:
        """Read-only ``int64 (num_vpages(owner),)`` table of ``end``: :meth:`TranslationService.v2p
        <umalloc.allocator.translation.TranslationService.v2p>`."""
        return self._translation.v2p(end)

    def p2v(self, end: str) -> torch.Tensor:
        """Read-only ``int64 (num_page_slots(end),)`` table of ``end``: :meth:`TranslationService.p2v
        <umalloc.allocator.translation.TranslationService.p2v>`."""
        return self._translation.p2v(end)

    def num_contiguous_runs(self, vpages: torch.Tensor, end: str) -> int:
        """Runs of consecutive ascending physical pages ``vpages`` forms on ``end``:
        :meth:`TranslationService.num_contiguous_runs
        <umalloc.allocator.translation.TranslationService.num_contiguous_runs>`."""
        return self._translation.num_contiguous_runs(vpages, end)

    def free(self, vtokens: torch.Tensor | np.ndarray, *, owner: str | None = None) -> None:
        """Free the virtual pages holding ``vtokens`` on every end: :meth:`FreeingService.free
        <umalloc.allocator.freeing.FreeingService.free>`."""
        self._freeing.free(vtokens, owner=owner)

    def free_pages(self, vpages: torch.Tensor | np.ndarray, *, owner: str | None = None,
                   index: torch.Tensor | np.ndarray | None = None) -> None:
        """:meth:`free` for virtual page ids: :meth:`FreeingService.free_pages
        <umalloc.allocator.freeing.FreeingService.free_pages>`."""
        self._freeing.free_pages(vpages, owner=owner, index=index)

    def unbind_end(self, end: str, vtokens: torch.Tensor | np.ndarray, *, strict: bool = True) -> None:
        """Tombstone bound ``end`` only for the pages of ``vtokens``: :meth:`FreeingService.unbind_end
        <umalloc.allocator.freeing.FreeingService.unbind_end>`."""
        self._freeing.unbind_end(end, vtokens, strict=strict)

    def unbind_pages(self, end: str, vpages: torch.Tensor | np.ndarray, *, strict: bool = True,
                     index: torch.Tensor | np.ndarray | None = None) -> None:
        """:meth:`unbind_end` for virtual page ids: :meth:`FreeingService.unbind_pages
        <umalloc.allocator.freeing.FreeingService.unbind_pages>`."""
        self._freeing.unbind_pages(end, vpages, strict=strict, index=index)

    def available_pages(self, end: str) -> int:
        """Pages ``end`` can allocate now: :meth:`SpaceService.available_pages
        <umalloc.allocator.space.SpaceService.available_pages>`."""
        return self._space.available_pages(end)

    def available_tokens(self, end: str) -> int:
        """:meth:`available_pages` times ``page_size``."""
        return self._space.available_tokens(end)

    def can_alloc(self, num_pages_by_end: Mapping[str, int]) -> bool:
        """True if every named end can take its page count at once: :meth:`SpaceService.can_alloc
        <umalloc.allocator.space.SpaceService.can_alloc>`."""
        return self._space.can_alloc(num_pages_by_end)

    def shortfall_pages(self, num_pages_by_end: Mapping[str, int]) -> dict[str, int]:
        """Per end, the pages it would lack: :meth:`SpaceService.shortfall_pages
        <umalloc.allocator.space.SpaceService.shortfall_pages>`."""
        return self._space.shortfall_pages(num_pages_by_end)

    def compact(self, end: str | None = None, *, budget_pages: int | None = None) -> CompactionReport:
        """Compact ``end`` (default: every end): :meth:`SpaceService.compact
        <umalloc.allocator.space.SpaceService.compact>`."""
        return self._space.compact(end, budget_pages=budget_pages)

    @staticmethod
    def swa_tail_start(seq_len: int, window: int, prefix_len: int, page_size: int) -> int:
        """First token whose SWA page must exist: ``floor_to_page(max(prefix_len, seq_len - window))``
        (:func:`umalloc.geometry.spec.swa_tail_start`, the one function prefill and decode use, F18/F19).

        Raises:
            UmallocValueError: negative lengths, ``window < 1``, ``page_size < 1`` or ``prefix_len > seq_len``.

        >>> MultiEndedAllocator.swa_tail_start(100, 32, 0, 16)     # window [68, 100): pages from token 64
        64
        >>> MultiEndedAllocator.swa_tail_start(10, 3, 0, 16)       # page_size > window: keep page 0
        0
        """
        return swa_tail_start(seq_len, window, prefix_len, page_size)

    def lease(self, pages: Mapping[str, torch.Tensor], *, deadline_s: float | None = None, tag: str = "") -> Lease:
        """Pin physical pages of any ends: :meth:`LeaseService.lease
        <umalloc.allocator.leasing.LeaseService.lease>`. Any thread."""
        return self._leasing.lease(pages, deadline_s=deadline_s, tag=tag)

    def pages_in_use(self, end: str, ppages: np.ndarray) -> np.ndarray:
        """Which physical pages of ``end`` another party still reads or writes: pinned by a lease, or pending
        (freed while pinned). ``ppages``: int64 ``(n,)`` in the end's page range. Returns bool ``(n,)``. What
        :meth:`Arena.copy_pages <umalloc.geometry.arena.Arena.copy_pages>` refuses to overwrite. O(n).

        Raises: UmallocValueError for an unknown end."""
        e = self._ends.end(end)
        _, state, _ = self._heap.end_tables(e)
        return (self._heap.pins[e][ppages] > 0) | (state[ppages] == PAGE_PENDING)

    def leases_active(self) -> int:
        """Active leases over all ends (after reclaiming expired ones)."""
        return self._leasing.leases_active()

    def moves_blocked(self, end: str) -> bool:
        """Coarse gate: True while any page of ``end`` is pinned (umalloc's compaction plans around single pins)."""
        return self._leasing.moves_blocked(end)

    @property
    def lease_table(self) -> LeaseTable:
        """The :class:`~umalloc.leases.table.LeaseTable` holding this arena's pins."""
        return self._leasing.table

    def retract(self, vtokens: torch.Tensor | np.ndarray, *, owner: str | None = None) -> retraction.RetractedKV:
        """Copy a request's pages of every end (owner and every bound end) to host memory, then free them;
        see :func:`umalloc.allocator.retraction.retract` (returns a ``RetractedKV``)."""
        return retraction.retract(self, vtokens, owner=owner)

    def restore(self, retracted: retraction.RetractedKV) -> torch.Tensor | None:
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
        if self._leasing.work:
            self._leasing.tick()
        return end_stats(self._heap, self.spec, self.ends, self._leasing.table, self._leasing.expired_by_end)

    def snapshot(self) -> dict[str, Any]:
        """Every page's state and every table, as copies (numpy arrays), plus bands and counters.

        Schema: ``{"ends": {name: {"state", "p2v", "v2p", "pins": arrays; "band": (lo, hi), "watermark",
        "grow", "owner", "page_bytes", "page_size", "first_page", "top_page", "counters": dict}}, "owners":
        {name: {"vstate": array (V_NEVER=0, V_LIVE=1, V_FREED=2, V_RESERVED=3), "live": int}}, "leases": [...]}``.
        Two snapshots compare equal (:func:`snapshots_equal`) iff nothing observable changed. O(slots).
        """
        return snapshot(self._heap, self.ends, self._leasing.table)

    def check_invariants(self) -> None:
        """Check every invariant in O(slots + virtual pages) (:func:`umalloc.allocator.observe.check_invariants` lists
        them); raise :class:`~umalloc.errors.InvariantError` naming the first broken one. Call it on the owner
        thread: it first delivers pages unpinned on other threads (Note [Lease threading]) and holds
        the lease table's lock while it checks.

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator(); _ = alloc.alloc_pages(2); alloc.check_invariants()
        """
        table = self._leasing.table
        with table.lock:
            if table.unpinned_waiting:
                table.drain()
            check_invariants(self._heap, self.spec, self.ends, self._after_call.mirrors, table)
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
