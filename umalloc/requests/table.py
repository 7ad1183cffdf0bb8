"""The request table: umalloc, not the engine, knows what every request holds (F08).

A :class:`RequestTable` sits on one id-owner end of a :class:`~umalloc.allocator.facade.MultiEndedAllocator` and
keeps, per request slot, the virtual token ids of the request (``req_to_token``, what attention kernels index),
its length, and its extent on every end. Pages carry reference counts (requests and the engine's prefix cache);
a page whose count reaches 0 is freed or kept as *cached* (content kept, evictable in LRU order).

Policy:

* **Extents are the table's.** ``extend`` / ``decode`` fill each request's partial last page first, then take
  fresh pages (one ``alloc_pages`` call per batch); the engine never passes ``last_loc`` or page boundaries, so
  page arithmetic always uses the request's absolute positions (F07). ``free_requests`` returns exactly what the
  request holds, once; ``truncate`` exactly the pages past the kept length (F09, F28).
* **Reference counts** (Note [Holders]) on virtual pages: a page is freed (or cached) only when its last holder
  lets go (F28). Compaction moves shared pages like any other: one virtual id, the allocator's tables rewritten,
  ``req_to_token`` unchanged.
* **Copy-on-write** (Note [Copy-on-write]): a page with more than one holder is never written. ``fork`` shares
  every page of the source prefix, a partial last page included; the first ``extend`` / ``decode`` that writes
  into a shared partial page copies it into a fresh page on every end first.
* **Bound ends follow the request** (Note [Windows]): a bound end with a sliding window unbinds, at the start
  of every ``extend`` / ``decode``, the pages that left the request's window (automatic; there is no separate
  call, so a page is never unbound twice). A bound end without a window (a draft) holds every page.
* **Cached pages** (Note [Cached pages]): ``free_requests(cache=True)`` / ``drop_refs(cache=True)`` keep full pages
  whose count reaches 0 as cached, in LRU order; ``reclaim`` revives them; an extend evicts them, LRU first, only
  when the eviction makes it fit and only as many as it needs (Note [Room]), calling ``on_evict(vpages)`` before
  their ids can be reused.
* **Admission** (Note [Room]): ``capacity`` per end, ``can_extend``, ``max_extend_tokens``. **Handles** (Note
  [Handles]): ``new_requests(handles=True)`` / ``handles``; every call taking slots refuses a stale one (F30).
* **Padded lanes** (F05, Note [Padded lanes]): writes of a padded lane go to :attr:`RequestTable.pad_write_vtoken`
  (the sink); reads to :attr:`RequestTable.pad_read_vtoken`, a page of zeros the table holds and no write maps to.
  Unused entries of ``req_to_token`` hold the zero page's token, so a read past a request's length is finite.
* **Failures**: misuse (unknown or freed slot, a slot twice in a batch, extend past ``max_tokens_per_request``,
  truncate beyond the length, a page the engine does not hold, a stale handle) raises a typed
  :class:`~umalloc.errors.UmallocValueError` subclass and changes nothing; a shortage returns ``None`` and changes
  nothing either: no window advanced, no page evicted, no ``on_evict`` call (F29); a broken invariant raises
  :class:`~umalloc.errors.InvariantError` from :meth:`RequestTable.check_invariants`.

The table's pages are freed and unbound only through it: the allocator's ``free`` / ``unbind_end`` /
``retract`` on them are reported by :meth:`RequestTable.check_invariants` (``owner-live`` / ``bound``); its
``compact`` is always fine (virtual ids never change). Not thread-safe: call from the thread that owns the
scheduler (as the allocator).

Note [Holders]
~~~~~~~~~~~~~~
``ref[vp]`` counts every holder of virtual page ``vp``: each request whose first ``ceil(len / page_size)`` pages
include it, each engine reference (``retain`` / ``reclaim``), and the table itself for the zero page.
``need[b][vp]`` counts the requests that hold ``vp`` *on bound end* ``b``: request ``s`` holds on ``b`` its pages
``[front[b][s], ceil(len / page_size))``. Engine references hold the owner page only (its id and full-attention
content): a bound end's binding is unbound when the last *request* holding it there lets go, so a page is
bound on ``b`` exactly while ``need[b][vp] > 0``. A managed page is *held* (``ref > 0``), *cached* (``ref == 0``,
in the LRU list, bound on the owner only) or not the table's.

Note [Copy-on-write]
~~~~~~~~~~~~~~~~~~~~
Requests of one batch that write into one shared partial page are served in batch order: each copies while the
page still has another holder (its count then drops by one); the last remaining holder writes in place. The copy
is a whole-envelope copy on the owner and on every bound end where the request holds the page, made before the
request's own new tokens are handed out; the copied request's earlier tokens of that page get new ids (the
request's ``req_to_token`` row is rewritten there).

Note [Windows]
~~~~~~~~~~~~~~
For a bound end with window ``W``, before a request of length ``L`` grows, its pages wholly before token
``swa_tail_start(L, W, 0, page_size)`` are unbound there (the rule SGLang's ``free_swa_out_of_window_slots``
applies, in the units of :func:`~umalloc.geometry.spec.swa_tail_start`). The front only moves forward: a
``truncate`` or a ``fork`` below the length the window last advanced at leaves those pages unbound (the engine's
attention over that short window would read recomputed KV; speculative rollback never goes below it). A fork
holds on ``b`` the source's pages from ``max(source front, tail of the fork length)``.

Note [Cached pages]
~~~~~~~~~~~~~~~~~~~
Only *full* pages are cached: a request's partial last page is freed with it. Pages enter the LRU at its tail:
``free_requests`` per request in the given order, each request's pages last page first (so a request's tail is
evicted before its prefix, as vLLM's ``free_blocks(reversed(blocks))``); ``drop_refs`` in the given order. Eviction
takes pages from the LRU head, once per extend, exactly as many as the extend lacks (Note [Room]); none if even the
whole cache would not make it fit.

Notes [Room] and [Chunked prefill]: :mod:`umalloc.requests.room`; Note [Handles]: :mod:`umalloc.requests.handles`.

Note [Padded lanes]
~~~~~~~~~~~~~~~~~~~
``pad_write_vtoken`` is token 0: virtual page 0 maps to the sink (physical page 0) on every end, which padded
writes may clobber and nothing reads. ``pad_read_vtoken`` is the first token of a virtual page the table mints at
creation (``zero_page=True``), zeroes on every end and holds for its lifetime: it is never in a request, never
written, never freed (compaction may move it, bytes and all). A masked read of a padded lane through it reads
zeros, never the NaN a padded write may have left in the sink (sglang #36207). With allocator support (reserved
trash and zero pages below ``first_page``) the minted page would not be needed.

Note [Managed pages]
~~~~~~~~~~~~~~~~~~~~
The table manages the virtual pages it minted (fresh pages of ``extend`` / ``decode``, copies, the zero page)
until it frees them. With ``exclusive=True`` (default) every live page of the owner end must be managed:
``check_invariants`` reports a page allocated outside the table (held by no one it knows: a leak, F08). With
``exclusive=False`` the engine may also allocate through the allocator's token-level or page-level API; those
pages are its own and outside every check here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.errors import InvalidIdError, InvariantError, NotAllocatedError, UmallocValueError
from umalloc.ids import count_arg, id_batch
from umalloc.requests.cow import EnvelopeCopier
from umalloc.requests.device_rows import DeviceRows
from umalloc.requests.handles import IdBatch, SlotGenerations, SlotLike, slot_of
from umalloc.requests.refcounts import (
    I_CODE,
    I_NCACHED,
    I_NCOW,
    I_NFREED,
    I_PAGES,
    I_REL,
    I_TOTAL,
    PAGE_CACHED,
    PAGE_HELD,
    PAGE_NOT_MANAGED,
    PG_ENG,
    PG_NEED,
    PG_REF,
    PG_STATE,
    RQ_FRONT,
    RQ_INUSE,
    RQ_LEN,
    RequestTableStats,
    check_against_allocator,
    check_slots,
    check_state,
    k_check_truncate,
    k_drop,
    k_evict,
    k_fork,
    k_grow_apply,
    k_grow_plan,
    k_lru_walk,
    k_new,
    k_revive,
    k_unref,
    k_window_apply,
    raise_for_code,
)
from umalloc.requests.room import Room, largest
from umalloc.requests.sharing import attach_pages, swap_page

_I32_MAX = (1 << 31) - 1
MAX_REQUESTS, MAX_TABLE_CELLS = 1 << 31, 1 << 36   #: most slots / slots x tokens: more is refused before allocating


# =============================================================================================================
# the table
# =============================================================================================================


class RequestTable:
    """Per-request ownership of virtual pages on one id-owner end of an allocator (module docstring).

    Args:
        alloc: the allocator (one table per owner end; the table calls its public API only).
        max_requests: request slots (``>= 1``).
        max_tokens_per_request: tokens one request may hold (``>= 1``).
        dtype: ``torch.int32`` (SGLang's ``ReqToTokenPool`` and the attention kernels) or ``torch.int64``, the
            dtype of :attr:`req_to_token`; int32 is refused if the owner's token id space does not fit.
        owner: the id-owner end (``None``: the allocator's only one).
        zero_page: mint and zero a page for padded reads (Note [Padded lanes]); costs one page per end.
        exclusive: every live page of the owner end is the table's (Note [Managed pages]).
        on_evict: called with the ``int64`` virtual pages about to be evicted from the cache, before their ids
            can be re-minted (the engine drops them from its prefix index).

    Attributes:
        req_to_token: ``[max_requests, max_tokens_per_request]`` tensor of ``dtype`` on the arena's device: row
            ``slot``, column ``position`` -> virtual token id; entries past a request's length hold
            :attr:`pad_read_vtoken`. Read it, never write it (on the CPU it aliases the table's master).
        pad_read_vtoken / pad_write_vtoken: the token ids padded lanes read from / write to.

    Raises:
        UmallocValueError: bad arguments, an int32 table over an id space that does not fit, or (``zero_page``)
        an arena without a free page on every end. Nothing is allocated on any error.

    Complexity: O(max_requests * max_tokens_per_request) to fill ``req_to_token``; O(virtual pages) memory for
    the counts (int32 ``[3 + bound ends, num_vpages]``) and the LRU links.

    >>> from umalloc.testing import small_allocator
    >>> alloc = small_allocator()          # full (up) + swa (down, window 4), page_size 2, 9 usable pages each
    >>> table = RequestTable(alloc, max_requests=4, max_tokens_per_request=12)   # zero page: virtual page 1
    >>> slots = table.new_requests(2)
    >>> table.extend(slots, torch.tensor([3, 1])).tolist()   # request 0: pages 2, 3; request 1: page 4
    [4, 5, 6, 8]
    >>> table.decode(slots).tolist()                          # both fill their partial pages
    [7, 9]
    >>> table.free_requests(slots); table.stats().held_pages  # the zero page only
    1
    """

    def __init__(self, alloc: MultiEndedAllocator, *, max_requests: int, max_tokens_per_request: int,
                 dtype: torch.dtype = torch.int32, owner: str | None = None, zero_page: bool = True,
                 exclusive: bool = True, on_evict: Callable[[torch.Tensor], None] | None = None) -> None:
        if not isinstance(alloc, MultiEndedAllocator):
            raise UmallocValueError(f"alloc={alloc!r}: allowed a MultiEndedAllocator")
        for nm, v in (("max_requests", max_requests), ("max_tokens_per_request", max_tokens_per_request)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UmallocValueError(f"{nm}={v!r}: allowed an int >= 1")
        if max_requests > MAX_REQUESTS or max_requests * max_tokens_per_request > MAX_TABLE_CELLS:
            raise UmallocValueError(f"max_requests={max_requests} x max_tokens_per_request={max_tokens_per_request}"
                                    f": allowed max_requests <= 2**31 and a product <= 2**36 cells")
        if dtype not in (torch.int32, torch.int64):
            raise UmallocValueError(f"dtype={dtype!r}: allowed torch.int32 or torch.int64")
        if on_evict is not None and not callable(on_evict):
            raise UmallocValueError(f"on_evict={on_evict!r}: allowed None or a callable")
        owners = [e.name for e in alloc.spec.ends if e.is_owner]
        if owner is None:
            if len(owners) != 1:
                raise UmallocValueError(f"owner=None is ambiguous: allowed one of {owners}")
            owner = owners[0]
        if owner not in owners:
            raise UmallocValueError(f"owner={owner!r}: allowed an id-owner end, one of {owners}")
        self.alloc = alloc
        self.owner = owner
        self._owner_arg: str | None = None if len(owners) == 1 else owner   # None: the allocator's fast path
        self.page_size = ps = alloc.spec.end(owner).page_size
        self.bound_ends: tuple[str, ...] = alloc.bound_ends(owner)
        self._win = np.array([alloc.spec.end(b).window_tokens or 0 for b in self.bound_ends], np.int64)
        NV = alloc.num_vpages(owner)
        if dtype is torch.int32 and NV * ps - 1 > _I32_MAX:
            raise UmallocValueError(f"dtype=torch.int32: the owner {owner!r} has token ids up to {NV * ps - 1}, "
                                    f"allowed at most {_I32_MAX}; use torch.int64")
        others = [t for t in alloc.holders() if isinstance(t, RequestTable) and t.owner == owner]
        if exclusive and others:
            raise UmallocValueError(f"exclusive=True: the allocator already has a request table on {owner!r}; "
                                    "allowed one table per owner end (or exclusive=False on every table)")
        if any(t.exclusive for t in others):
            raise UmallocValueError(f"the allocator's request table on {owner!r} is exclusive; allowed no second "
                                    "table on that end")
        if exclusive and (live := alloc.stats()[owner].live_pages):
            raise UmallocValueError(f"exclusive=True: {owner!r} already holds {live} live pages allocated outside "
                                    "a table; allowed an allocator with none (or exclusive=False)")
        self.max_requests = R = max_requests
        self.max_tokens_per_request = MT = max_tokens_per_request
        MP = -(-MT // ps)
        NB = len(self.bound_ends)
        self.dtype = dtype
        self.exclusive: bool = bool(exclusive)
        self.on_evict = on_evict
        self._rq = np.zeros((RQ_FRONT + NB, R), np.int64)
        self._gens = SlotGenerations(R)   # Note [Handles]
        self._pg = np.zeros((PG_NEED + NB, NV), np.int32)
        self._lru = np.zeros((2, NV), np.int64)
        self._r2p = np.zeros((R, MP), np.int64)
        np_dtype = np.int32 if dtype is torch.int32 else np.int64
        self._r2t = np.zeros((R, MT), np_dtype)
        # scratch (every kernel bounds its writes by these shapes)
        self._mark = np.zeros(R, np.int8)
        self._cow = np.zeros(R, np.int8)
        self._rel = np.zeros((NB, NV), np.int64)
        self._freed = np.zeros(NV, np.int64)
        self._pagebuf = np.zeros(NV, np.int64)
        self._cowpairs = np.zeros((2, R), np.int64)
        self._info = np.zeros(I_REL + NB, np.int64)
        self._zeros = np.zeros(R, np.int64)
        self._ones = np.ones(R, np.int64)
        self._no_flat = np.zeros(0, np.int64)
        self._counters = {"cached": 0, "reclaimed": 0, "evicted": 0, "copied": 0}
        self.pad_write_vtoken = 0
        self.zero_vpage = 0
        if zero_page:
            got = alloc.alloc_pages(1, owner=self._owner_arg)
            if got is None:
                raise UmallocValueError(f"zero_page=True: the arena has no free page on {alloc.last_shortfall}; "
                                        f"allowed an arena with a free page on every end (or zero_page=False)")
            vp = torch.as_tensor(got)
            self.zero_vpage = z = int(vp[0])
            for end in (owner, *self.bound_ends):
                alloc.arena.envelopes(end)[int(alloc.translate_pages(vp, end)[0])] = 0
            self._pg[PG_REF, z] = 1
            self._pg[PG_STATE, z] = PAGE_HELD
            self._pg[PG_NEED:, z] = 1
        self.pad_read_vtoken = self.zero_vpage * ps
        self._r2t[:] = self.pad_read_vtoken
        device = alloc.arena.device
        self._dev = device if device.type != "cpu" else None
        self._copier = EnvelopeCopier(alloc, (owner, *self.bound_ends))  # Note [Copy-on-write]
        self._device_rows = DeviceRows(self._r2t, device)
        self.req_to_token: torch.Tensor = self._device_rows.table
        self._room = Room(alloc, owner, self._owner_arg, self.bound_ends, self._pagebuf, self.cached_pages, self._lru)
        alloc.attach_holder_check(self._check_as_holder)  # the allocator's invariants now see this table's holds

    def _check_as_holder(self) -> None:
        self.check_invariants(allocator=False)

    # ------------------------------------------------------------------------------------------------------
    # helpers
    # ------------------------------------------------------------------------------------------------------
    def _raise(self, where: str, what: str = "slots") -> None:
        raise_for_code(self._info, where, what, self.max_requests, self.max_tokens_per_request)

    def _slots(self, slots: IdBatch, where: str) -> np.ndarray:
        s = self._rows(id_batch(slots, "slots"), where)
        info = self._info
        info[:] = 0
        if not check_slots(self._rq, s, self._mark, info):
            self._raise(where)
        return s

    def _slot(self, slot: SlotLike, where: str) -> int:
        if (isinstance(slot, torch.Tensor) and slot.numel() == 1 and slot.dim() <= 1
                and slot.dtype in (torch.int64, torch.int32)):
            slot = int(slot.reshape(-1)[0])
        if isinstance(slot, (bool, np.bool_)) or not isinstance(slot, (int, np.integer)):
            raise InvalidIdError(f"{where}: slot={slot!r}; allowed an int in [0, {self.max_requests}) or a handle")
        if not 0 <= int(slot) < 1 << 63:
            raise InvalidIdError(f"{where}: slot={slot}; allowed an int in [0, {self.max_requests}) or a handle")
        return int(self._slots(np.array([int(slot)], np.int64), where)[0])   # raises the typed error

    def _rows(self, s: np.ndarray, where: str) -> np.ndarray:
        return self._gens.rows(s, self._rq[RQ_INUSE], where)

    def handles(self, slots: IdBatch) -> torch.Tensor:
        """``int64 (B,)`` handles ``generation << 32 | slot`` of live requests (Note [Handles], with a doctest).
        Raises: as :meth:`extend` for bad slots. O(B)."""
        return torch.from_numpy(self._gens.handles(self._slots(slots, "handles")))

    slot_of = staticmethod(slot_of)

    def _page_ids(self, vpages: IdBatch, where: str) -> np.ndarray:
        vp = id_batch(vpages, "vpages")
        NV = self._pg.shape[1]
        bad = np.flatnonzero((vp < 1) | (vp >= NV) | (vp == self.zero_vpage))
        if bad.size:
            raise InvalidIdError(f"{where}: vpages[{int(bad[0])}]={int(vp[bad[0]])}; allowed a page of the table in "
                                 f"[1, {NV}) other than the zero page {self.zero_vpage}")
        return vp

    def _unbind_bound(self) -> None:
        """Unbind the listed bound-end pages (kernels leave their counts in ``info[I_REL:]``)."""
        info, rel, unbind = self._info, self._rel, self.alloc.unbind_pages
        for b, end in enumerate(self.bound_ends):
            c = int(info[I_REL + b])
            if c:
                unbind(end, rel[b, :c])

    def _free_listed(self, n: int) -> None:
        if n:
            self.alloc.free_pages(self._freed[:n], owner=self._owner_arg)

    def _plan(self, s: np.ndarray, e: np.ndarray, where: str) -> tuple[int, list[np.ndarray]]:
        """Validate and plan an extend batch, changing nothing: its fresh pages and, per bound end, the pages its
        window advance unbinds (copies). Raises as :meth:`extend`."""
        info, rel = self._info, self._rel
        k_grow_plan(self._rq, self._pg, self._r2p, s, e, self.page_size, self.max_tokens_per_request, self._win,
                     self._mark, self._cow, rel, info)
        if info[I_CODE]:
            self._raise(where)
        return int(info[I_PAGES]), [rel[b, : int(info[I_REL + b])].copy() for b in range(rel.shape[0])]

    # ------------------------------------------------------------------------------------------------------
    # requests
    # ------------------------------------------------------------------------------------------------------
    def new_requests(self, num_requests: int, *, handles: bool = False) -> torch.Tensor | None:
        """Open ``num_requests`` empty requests in the lowest free slots.

        Returns:
            ``int64 (num_requests,)`` slots, ascending (with ``handles``: their handles, Note [Handles]); ``None``
            if fewer slots are free (nothing changed).

        Raises:
            UmallocValueError: a bad count or ``handles`` not a bool. Complexity: O(max_requests).
        """
        n = count_arg(num_requests, "num_requests")
        if type(handles) is not bool:
            raise UmallocValueError(f"new_requests: handles={handles!r}; allowed True or False")
        if n > self.max_requests:
            return None   # more than every slot: fewer are free (nothing changed)
        out = np.empty(n, np.int64)
        if k_new(self._rq, n, out) < 0:
            return None
        if handles:
            out = self._gens.handles(out)
        return torch.from_numpy(out)

    def extend(self, slots: IdBatch, extend_lens: IdBatch) -> torch.Tensor | None:
        """Append ``extend_lens[i]`` tokens to request ``slots[i]``: its partial last page first, then fresh
        pages (one allocator call for the batch), in batch order; a shared partial page is copied first (Note
        [Copy-on-write]); windowed bound ends unbind the pages that left each window first (Note [Windows]).

        Args:
            slots: ``(B,)`` live request slots, each once (int32/int64 torch tensor, numpy array or list).
            extend_lens: ``(B,)`` tokens to add, each ``>= 0``.

        Returns:
            ``int64`` CPU tensor ``(sum(extend_lens),)`` of the new tokens' virtual ids, request by request (what
            the engine writes KV to); ``None`` if the arena lacks space even after evicting every cached page
            (nothing changed: no window advanced, no page evicted, Note [Room]).

        Raises:
            InvalidIdError: bad shapes/dtypes, a slot out of range or twice. NotAllocatedError: a slot not live.
            StaleHandleError: a handle of a slot freed since. UmallocValueError: a negative length or a request
            past ``max_tokens_per_request``. Nothing changes.

        Complexity: O(B + new tokens + unbound pages), three numba kernels around one ``alloc_pages`` when the
        pages fit outright; when the owner alone is short, O(pages evicted) more and no allocator trial; otherwise
        under pressure O(slots) per allocator trial (Note [Room]).
        """
        s = self._rows(id_batch(slots, "slots"), "extend")
        e = id_batch(extend_lens, "extend_lens")
        if e.shape[0] != s.shape[0]:
            raise InvalidIdError(f"extend: slots ({s.shape[0]},) and extend_lens ({e.shape[0]},); allowed equal "
                                 f"(B,) shapes")
        return self._grow(s, e, "extend")

    def decode(self, slots: IdBatch) -> torch.Tensor | None:
        """One token for each request (:meth:`extend` with every length 1).

        Returns / Raises: as :meth:`extend`; the result is ``int64 (B,)``.
        """
        s = self._rows(id_batch(slots, "slots"), "decode")
        return self._grow(s, self._ones[: s.shape[0]] if s.shape[0] <= self.max_requests
                          else np.ones(s.shape[0], np.int64), "decode")

    def _grow(self, s: np.ndarray, e: np.ndarray, where: str) -> torch.Tensor | None:
        k, unbinds = self._plan(s, e, where)
        room = self._room.make(k, unbinds)
        if room is False:
            return None
        if room is not True:
            self.evict(int(room))   # on_evict runs here, while the pages are still allocated
            return self._grow(s, e, where)   # planned again: on_evict may have called back into the table
        info, rel = self._info, self._rel
        k_window_apply(self._rq, self._pg, self._r2p, s, e, self.page_size, self._win)
        total, ncow = int(info[I_TOTAL]), int(info[I_NCOW])
        pages = self._pagebuf[:k]
        out = np.empty(total, np.int64)
        flat = self._no_flat if self._dev is None else np.empty(total + s.shape[0] * self.page_size, np.int64)
        k_grow_apply(self._rq, self._pg, self._r2p, self._r2t, s, e, self.page_size, self._cow, pages, out, flat,
                      self._cowpairs, rel, info)
        if ncow:
            self._copier.copy(self._cowpairs[:, :ncow])
            self._counters["copied"] += ncow
            self._unbind_bound()
        if self._dev is not None:
            self._device_rows.push(flat[: int(info[I_TOTAL])])
        return torch.from_numpy(out)

    def can_extend(self, slots: IdBatch, extend_lens: IdBatch) -> bool:
        """True if :meth:`extend` with these arguments would hand out its tokens now (window unbinds, the
        evictions it would make and compaction counted: Note [Room]); the admission query of a scheduler.
        Changes nothing (it runs in allocator trials that are rolled back).

        Raises: as :meth:`extend`. Complexity: O(B) when the pages fit outright; else O(slots) per trial, at most
        2 + 2 * log2(cached pages + 1) trials.

        >>> from umalloc.testing import small_allocator
        >>> table = RequestTable(small_allocator(), max_requests=2, max_tokens_per_request=40)
        >>> (s,) = table.new_requests(1).tolist()
        >>> table.can_extend([s], [6]), table.can_extend([s], [7])   # 7 shared slots: 3 pages on both ends
        (True, False)
        """
        s = self._rows(id_batch(slots, "slots"), "can_extend")
        e = id_batch(extend_lens, "extend_lens")
        if e.shape[0] != s.shape[0]:
            raise InvalidIdError(f"can_extend: slots ({s.shape[0]},) and extend_lens ({e.shape[0]},); allowed "
                                 f"equal (B,) shapes")
        return self._room.fits(*self._plan(s, e, "can_extend"))

    def max_extend_tokens(self, slot: SlotLike) -> int:
        """The most tokens one :meth:`extend` of request ``slot`` alone can take now (:meth:`can_extend`'s
        answer, searched): the chunk size of a chunked prefill (Note [Chunked prefill]). Changes nothing.

        Raises: as :meth:`extend` for a bad slot. Complexity: O(log max_tokens_per_request) :meth:`can_extend`
        calls.
        """
        one = np.array([self._slot(slot, "max_extend_tokens")], np.int64)
        return largest(lambda n: self.can_extend(one, np.array([n], np.int64)),
                       self.max_tokens_per_request - int(self._rq[RQ_LEN, one[0]]))

    def truncate(self, slots: IdBatch, num_tokens: IdBatch) -> None:
        """Roll requests back to ``num_tokens[i]`` tokens (speculative decoding: drop rejected drafts): frees
        exactly the pages past the kept length, on every end, each only when its last holder lets go (F09, F28).

        Raises:
            InvalidIdError / NotAllocatedError: as :meth:`extend`. UmallocValueError: ``num_tokens`` outside
            ``[0, length]``. Nothing changes on any error.

        Complexity: O(B + dropped tokens).

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()            # page_size 2; the zero page is virtual page 1
        >>> table = RequestTable(alloc, max_requests=2, max_tokens_per_request=8)
        >>> (s,) = table.new_requests(1).tolist(); table.extend([s], [5]).tolist()     # pages 2, 3, 4
        [4, 5, 6, 7, 8]
        >>> table.truncate([s], [2]); table.pages(s).tolist(), alloc.stats()["full"].live_pages
        ([2], 2)
        """
        s = self._rows(id_batch(slots, "slots"), "truncate")
        keep = id_batch(num_tokens, "num_tokens")
        if keep.shape[0] != s.shape[0]:
            raise InvalidIdError(f"truncate: slots ({s.shape[0]},) and num_tokens ({keep.shape[0]},); allowed "
                                 f"equal (B,) shapes")
        k_check_truncate(self._rq, s, keep, self._mark, self._info)
        if self._info[I_CODE]:
            self._raise("truncate")
        self._drop(s, keep, False, False)

    def free_requests(self, slots: IdBatch, cache: bool = False) -> None:
        """Free every page the requests hold (each once) and close their slots. A page is freed when its last
        holder lets go; with ``cache=True`` a *full* page reaching 0 is kept as cached instead (Note [Cached
        pages]); a request's partial last page is freed.

        Raises:
            InvalidIdError: a slot out of range or twice. DoubleFreeError: a slot not live (already freed).
            UmallocValueError: ``cache`` not a bool. Nothing changes on any error.

        Complexity: O(B + tokens freed) in one numba kernel, plus one ``free_pages`` and one ``unbind_pages``
        per bound end.
        """
        if type(cache) is not bool:
            raise UmallocValueError(f"free_requests: cache={cache!r}; allowed True or False")
        s = self._slots(slots, "free_requests")
        self._drop(s, self._zeros[: s.shape[0]], cache, True)
        self._gens.bump(s)

    def _drop(self, s: np.ndarray, keep: np.ndarray, cache: bool, clear: bool) -> None:
        old = self._rq[RQ_LEN, s] if self._dev is not None else None
        info = self._info
        k_drop(self._rq, self._pg, self._r2p, self._r2t, self._lru, s, keep, self.page_size, cache, clear,
                self.pad_read_vtoken, self._freed, self._rel, info)
        self._counters["cached"] += int(info[I_NCACHED])
        if self._rel.shape[0]:
            self._unbind_bound()
        self._free_listed(int(info[I_NFREED]))
        if old is not None:
            self._device_rows.push_ranges(s, keep, old)

    def fork(self, src_slot: SlotLike, num_tokens: int | None = None) -> int | None:
        """Open a request holding the first ``num_tokens`` tokens (default: all) of request ``src_slot``: it shares
        every page of that prefix (counts + 1), a partial last page included (copied on the first write into it,
        Note [Copy-on-write]); windowed bound ends hold the source's pages from ``max(source front, tail of
        num_tokens)`` (Note [Windows]). Nothing is allocated.

        Returns:
            the new slot (the lowest free one), or ``None`` if no slot is free (nothing changed).

        Raises:
            InvalidIdError / NotAllocatedError: a bad or free ``src_slot``. UmallocValueError: ``num_tokens``
            outside ``[0, length]``. Nothing changes on any error.

        Complexity: O(num_tokens).

        >>> from umalloc.testing import small_allocator
        >>> table = RequestTable(small_allocator(), max_requests=2, max_tokens_per_request=8)
        >>> (a,) = table.new_requests(1).tolist(); _ = table.extend([a], [3])   # pages 2, 3 (3 partial)
        >>> b = table.fork(a); table.pages(b).tolist(), table.stats().shared_pages
        ([2, 3], 2)
        >>> table.decode([b]).tolist(), table.pages(b).tolist()                # b copies page 3 to 4 first
        ([9], [2, 4])
        >>> table.free_requests([a, b], cache=True); table.cached_pages().tolist()   # a's partial 3 is freed
        [4, 2]
        >>> table.reclaim([2]); table.cached_pages().tolist(), table.stats().engine_refs
        ([4], 1)
        """
        src = self._slot(src_slot, "fork")
        L = int(self._rq[RQ_LEN, src])
        n = L if num_tokens is None else count_arg(num_tokens, "num_tokens")
        if n > L:
            raise UmallocValueError(f"fork: num_tokens={n}; allowed [0, {L}] (the source's length)")
        c = int(k_fork(self._rq, self._pg, self._r2p, self._r2t, src, n, self.page_size, self._win))
        if c < 0:
            return None
        if self._dev is not None:
            self._device_rows.push_ranges(np.array([c], np.int64), np.zeros(1, np.int64), np.array([n], np.int64))
        return c

    def attach_prefix(self, slot: SlotLike, vpages: IdBatch, *, revive: bool = False) -> bool:
        """Give an empty request the pages ``vpages`` as its first ``len(vpages) * page_size`` tokens (a prefix
        hit: pages the engine holds, e.g. revived by :meth:`reclaim`; with ``revive=True`` cached pages too, which
        leave the cache, as :meth:`reclaim` then :meth:`drop_refs` would leave them, in one call); each count + 1. On each bound end the
        request holds its window tail (every page without a window); pages of it not bound there are bound
        fresh (``bind_end``: their bytes are not the prefix's, the engine recomputes them).

        Returns:
            True; False if a bound end lacks space for those bindings (nothing changed).

        Raises:
            InvalidIdError: bad ids, a page twice, the zero page. NotAllocatedError: a free ``slot``, or a page the
            table does not hold (count 0 or not its own; cached without ``revive``). UmallocValueError: the request is
            not empty, the prefix is longer than ``max_tokens_per_request``, or ``revive`` is not a bool. Nothing
            changes on any error.
        """
        if type(revive) is not bool:
            raise UmallocValueError(f"attach_prefix: revive={revive!r}; allowed True or False")
        return attach_pages(self, self._slot(slot, "attach_prefix"), self._page_ids(vpages, "attach_prefix"), revive)

    def share_page(self, slot: SlotLike, page_index: int, vpage: int) -> None:
        """De-duplicate one full page of a request: its page ``page_index`` becomes ``vpage`` (held or cached,
        holding the same tokens' K/V: the engine found its content hash already indexed), which gains the request
        as a holder (a cached page leaves the cache); the request's old page loses it and is freed when that was
        its last holder (never cached: its content duplicates ``vpage``'s). The request's ``req_to_token`` row is
        rewritten on that page (Note [Holders]).

        Raises:
            UmallocValueError: the table has bound ends (their holds would follow the page; not supported), or
            ``page_index`` is not a full page of the request (``[0, length // page_size)``).
            InvalidIdError: a bad slot or page id, the zero page, or ``vpage`` already a page of the request.
            NotAllocatedError: a free slot, or ``vpage`` neither held nor cached. Nothing changes on any error.

        Complexity: O(page_size).

        >>> from umalloc import Arena, ArenaSpec, EndSpec, LayerSpec
        >>> spec = ArenaSpec((EndSpec("full", (LayerSpec.mha(1, 4),), page_size=2),), arena_bytes=320)
        >>> table = RequestTable(MultiEndedAllocator(Arena(spec)), max_requests=2, max_tokens_per_request=8,
        ...                      zero_page=False)
        >>> a, b = table.new_requests(2).tolist(); _ = table.extend([a, b], [2, 2])   # one page each
        >>> pa = int(table.pages(a)[0]); table.share_page(b, 0, pa)
        >>> table.pages(b).tolist() == [pa], table.stats().shared_pages, table.stats().held_pages
        (True, 1, 1)
        """
        if self.bound_ends:
            raise UmallocValueError(f"share_page: the table on {self.owner!r} has bound ends {list(self.bound_ends)};"
                                    " allowed a table without bound ends")
        swap_page(self, self._slot(slot, "share_page"), count_arg(page_index, "page_index"),
                  int(self._page_ids([vpage], "share_page")[0]))

    def holder_counts(self, vpages: IdBatch) -> torch.Tensor:
        """``int64 (n,)`` holders of each page (requests and engine references, Note [Holders]); 0 for a cached
        page or one the table does not manage. Raises: InvalidIdError for bad ids. O(n)."""
        vp = self._page_ids(vpages, "holder_counts")
        return torch.from_numpy(self._pg[PG_REF, vp].astype(np.int64))

    def num_tokens(self, slots: IdBatch) -> torch.Tensor:
        """``int64 (B,)`` lengths of live requests. Raises: as :meth:`extend` for bad slots."""
        s = self._slots(slots, "num_tokens")
        return torch.from_numpy(self._rq[RQ_LEN, s].copy())

    def tokens(self, slot: SlotLike) -> torch.Tensor:
        """``int64 (length,)`` virtual token ids of one live request (a copy). Raises: as :meth:`extend`."""
        s = self._slot(slot, "tokens")
        return torch.from_numpy(self._r2t[s, : self._rq[RQ_LEN, s]].astype(np.int64))

    def pages(self, slot: SlotLike) -> torch.Tensor:
        """``int64 (ceil(length / page_size),)`` virtual pages of one live request (a copy)."""
        s = self._slot(slot, "pages")
        return torch.from_numpy(self._r2p[s, : -(-int(self._rq[RQ_LEN, s]) // self.page_size)].copy())

    # ------------------------------------------------------------------------------------------------------
    # engine references and the cache
    # ------------------------------------------------------------------------------------------------------
    def retain(self, vpages: IdBatch) -> None:
        """The engine takes one reference per entry of ``vpages`` (a page twice: two) on held pages (an
        engine's prefix cache holding a request's pages, as SGLang's radix tree does). Engine references hold
        the owner page only (Note [Holders]).

        Raises:
            InvalidIdError: bad ids or the zero page. NotAllocatedError: a page without a holder (use
            :meth:`reclaim` for cached pages). Nothing changes on any error.
        """
        vp = self._page_ids(vpages, "retain")
        held = self._pg[PG_STATE, vp] == PAGE_HELD
        if not held.all():
            bad = int(vp[np.flatnonzero(~held)[0]])
            raise NotAllocatedError(f"retain: virtual page {bad} has no holder; allowed held pages (reclaim a "
                                    f"cached one)")
        k_revive(self._pg, self._lru, vp)

    def reclaim(self, vpages: IdBatch) -> None:
        """A prefix hit: the engine takes one reference per entry of ``vpages``, held or cached; cached pages
        leave the cache (content intact). O(len(vpages)).

        Raises:
            InvalidIdError: bad ids or the zero page. NotAllocatedError: a page neither held nor cached (evicted:
            the engine was told through ``on_evict``). Nothing changes on any error.
        """
        vp = self._page_ids(vpages, "reclaim")
        st = self._pg[PG_STATE, vp]
        ok = st != PAGE_NOT_MANAGED
        if not ok.all():
            bad = int(vp[np.flatnonzero(~ok)[0]])
            raise NotAllocatedError(f"reclaim: virtual page {bad} is neither held nor cached (evicted?)")
        n_cached = int(np.unique(vp[st == PAGE_CACHED]).shape[0])
        k_revive(self._pg, self._lru, vp)
        self._counters["reclaimed"] += n_cached

    def drop_refs(self, vpages: IdBatch, cache: bool = False) -> None:
        """Drop one engine reference per entry of ``vpages`` (taken by :meth:`retain` or :meth:`reclaim`); pages
        whose count reaches 0 are freed, or with ``cache=True`` cached (in the given order, Note [Cached pages]).

        Raises:
            InvalidIdError: bad ids. NotAllocatedError: more drops of a page than engine references on it.
            UmallocValueError: ``cache`` not a bool. Nothing changes on any error.
        """
        if type(cache) is not bool:
            raise UmallocValueError(f"drop_refs: cache={cache!r}; allowed True or False")
        vp = self._page_ids(vpages, "drop_refs")
        u, c = np.unique(vp, return_counts=True)
        bad = np.flatnonzero(self._pg[PG_ENG, u] < c)
        if bad.size:
            raise NotAllocatedError(f"drop_refs: virtual page {int(u[bad[0]])} dropped {int(c[bad[0]])} times, the "
                                    f"engine holds {int(self._pg[PG_ENG, u[bad[0]]])} references")
        nf = k_unref(self._pg, self._lru, vp, cache, self._freed)
        if cache:
            self._counters["cached"] += int(np.count_nonzero(self._pg[PG_STATE, u] == PAGE_CACHED))
        self._free_listed(nf)

    def evict(self, num_pages: int) -> int:
        """Evict up to ``num_pages`` cached pages, LRU first: ``on_evict(vpages)`` is called, then they are
        freed (an exception from ``on_evict`` propagates once they are freed). Allocation calls this itself
        under pressure. Returns the pages evicted. O(num_pages)."""
        n = count_arg(num_pages, "num_pages")
        got = k_evict(self._pg, self._lru, n, self._freed)
        if got == 0:
            return 0
        self._counters["evicted"] += got
        evicted = self._freed[:got].copy()   # on_evict may call back into the table, which reuses the scratch
        try:
            if self.on_evict is not None:
                self.on_evict(torch.from_numpy(evicted.copy()))
        finally:
            self.alloc.free_pages(evicted, owner=self._owner_arg)
        return got

    def cached_pages(self) -> torch.Tensor:
        """``int64`` cached pages in LRU order (the next to be evicted first). O(cached pages)."""
        out = np.empty(self._lru.shape[1], np.int64)
        n = int(k_lru_walk(self._lru, out, out.shape[0]))
        return torch.from_numpy(out[:n].copy())

    # ------------------------------------------------------------------------------------------------------
    # capacity and observability
    # ------------------------------------------------------------------------------------------------------
    def capacity(self) -> dict[str, dict[str, int]]:
        """Per end of the table (the owner first, then each bound end): ``free_pages`` (what that end can
        allocate now, :meth:`~umalloc.allocator.facade.MultiEndedAllocator.available_pages`),
        ``reclaimable_pages`` (cached pages eviction returns to it: the owner's cached pages; 0 on a bound end,
        where cached pages hold nothing) and ``available_pages`` (their sum). An extend takes one page per
        fresh page on *every* end, so the fewest ``available_pages`` over the ends bounds it; ask
        :meth:`can_extend` for a given batch (it also counts window unbinds and compaction). O(ends).

        >>> from umalloc.testing import small_allocator
        >>> RequestTable(small_allocator(), max_requests=1, max_tokens_per_request=4).capacity()["swa"]
        {'free_pages': 7, 'reclaimable_pages': 0, 'available_pages': 7}
        """
        return self._room.capacity(int(np.count_nonzero(self._pg[PG_STATE] == PAGE_CACHED)))

    def stats(self) -> RequestTableStats:
        """:class:`RequestTableStats` now. O(max_requests + virtual pages)."""
        return RequestTableStats.of(self._rq, self._pg, self.max_requests, self.capacity()[self.owner],
                                    self._counters)

    def snapshot(self) -> dict[str, Any]:
        """The allocator's :meth:`~MultiEndedAllocator.snapshot` plus copies of every table array and counter;
        compare two with :func:`~umalloc.allocator.facade.snapshots_equal`. O(slots + table size)."""
        return {"alloc": self.alloc.snapshot(),
                "table": {"rq": self._rq.copy(), "pg": self._pg.copy(), "lru": self._lru.copy(),
                          "r2p": self._r2p.copy(), "r2t": self._r2t.copy(), "gen": self._gens.gen.copy(),
                          "counters": dict(self._counters)}}

    def check_invariants(self, *, allocator: bool = True) -> None:
        """Check every invariant (the allocator's first, unless ``allocator=False``); raise
        :class:`~umalloc.errors.InvariantError` naming the first broken one:

        * ``rows``: a free slot is empty; a live request's pages ``[0, ceil(len / page_size))`` are held pages,
          distinct, its other entries empty; ``req_to_token`` equals ``page * page_size + offset`` on
          ``[0, len)`` and the zero page's token past it (page-aligned extents, F08); fronts within the extent;
        * ``counts``: ``ref`` = requests + engine references (+ the table for the zero page); ``need`` per bound
          end = the requests holding the page there (Note [Holders]);
        * ``held``: a page is held iff its count is positive: a managed page held by no one is a leak;
        * ``cached``: cached pages have no holder and form the LRU list exactly;
        * ``owner-live``: every managed page is live on the owner (not freed behind the table), and with
          ``exclusive`` every live owner page is managed (none allocated outside the table);
        * ``bound``: a managed page is bound on a bound end iff a request holds it there;
        * ``device``: the device copy of ``req_to_token`` equals the master.

        Complexity: O(max_requests * max_tokens_per_request + virtual pages).
        """
        if allocator:
            self.alloc.check_invariants()  # runs this table's checks too (attach_holder_check at creation)
            return
        where = f"request table on {self.owner!r}"
        check_state(self._rq, self._pg, self._lru, self._r2p, self._r2t, self.page_size, self.zero_vpage,
                    self.pad_read_vtoken, where)
        check_against_allocator(self._pg, {e: self.alloc.ends[e].v2p for e in (self.owner, *self.bound_ends)},
                                self.exclusive, where)
        if self._dev is not None and not torch.equal(self.req_to_token.cpu(), torch.from_numpy(self._r2t)):
            raise InvariantError(f"[device] {where}: the device req_to_token differs from the master")

    def __repr__(self) -> str:
        s = self.stats()
        return (f"RequestTable(owner={self.owner!r}, requests={s.live_requests}/{self.max_requests}, "
                f"held={s.held_pages}, cached={s.cached_pages})")


__all__ = ["PAGE_CACHED", "PAGE_HELD", "PAGE_NOT_MANAGED", "RequestTable", "RequestTableStats"]
