"""Which slots of each page are live, and which allocation holds each: the token API's occupancy.

umalloc's allocator works in pages: it knows a page is live, not which of its ``page_size`` slots a request
holds. SGLang's token API (``alloc_extend``/``alloc_decode``/``free`` on a paged pool) hands out single slots of a
request's partly filled last page, so the pool keeps :class:`SlotOccupancy` next to the allocator:

* **One tag per slot** (``int64``, ``-1`` = free): the allocation that handed the slot out -- the call
  (``alloc``, ``alloc_extend``, ``alloc_decode``), its sequence number on the pool (1-based) and the request's
  index in that call's batch. A page is live in the allocator iff one of its slots is live
  (:meth:`SlotOccupancy.check_pages` checks it).
* **Allocation into a live slot is refused**: ``alloc_extend`` filling a tail page and ``alloc_decode`` writing
  ``last_loc + 1`` must find those slots free, else :class:`LiveSlotError` names the slot and its holder and
  nothing changes (a scheduler that passes another request's ``last_loc`` would otherwise get a slot whose KV
  another request still reads).
* **A page is released when its last live slot is freed**: freeing some tokens of a page frees those slots only.
  Freeing a slot that is not live raises (``DoubleFreeError``, or the allocator's error for a page that is not
  live) and nothing changes. Page frees (``free_page_ids``, segment frees) free every slot of the page.

     page 2 (page_size 4):  | 8: req A | 9: req A | 10: free | 11: free |
     alloc_decode(last_loc=8)  -> slot 9 is live: LiveSlotError (held by req A)
     free([9])                 -> slot 9 free, page 2 stays (slot 8 live)
     free([8])                 -> page 2 released

Memory: 8 bytes per slot on the host. Complexity: each check or update is one numba pass, O(B + tokens of the
call) (a free also reads the ``page_size`` tags of each page it touches); whole-page frees add O(pages * page_size)
numpy work. Threading: the pool's thread (one scheduler thread).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit

from umalloc.errors import DoubleFreeError, InvalidIdError, InvariantError

#: The calls a tag names (its kind field).
KINDS = ("alloc", "alloc_extend", "alloc_decode")
_KIND_SHIFT = 20
_CALL_SHIFT = 22
_REQ_MASK = (1 << _KIND_SHIFT) - 1


# ---- kernels: one pass over a call's ids (tags: the pool's int64 slot tags, -1 free) --------------------------
@njit(cache=True, error_model="numpy")
def _first_live_extend(tags: np.ndarray, prefix: np.ndarray, seq: np.ndarray, last: np.ndarray,
                       ps: int) -> tuple[int, int]:
    """(request, slot) of the first live slot an extend would fill on a tail page, or (-1, -1)."""
    n = tags.shape[0]
    for i in range(prefix.shape[0]):
        p, q = prefix[i], seq[i]
        if p % ps != 0 and q > p:
            end = min(q, (p + ps - 1) // ps * ps)
            for k in range(end - p):
                x = last[i] + 1 + k
                if 0 < x < n and tags[x] >= 0:
                    return i, x
    return -1, -1


@njit(cache=True, error_model="numpy")
def _first_live_decode(tags: np.ndarray, seq: np.ndarray, last: np.ndarray, ps: int) -> int:
    """The first request whose decode slot ``last + 1`` (position not starting a page) is live, or -1."""
    n = tags.shape[0]
    for i in range(seq.shape[0]):
        if (seq[i] - 1) % ps != 0:
            x = last[i] + 1
            if 0 < x < n and tags[x] >= 0:
                return i
    return -1


@njit(cache=True, error_model="numpy")
def _mark_extend(tags: np.ndarray, base: int, prefix: np.ndarray, seq: np.ndarray, out: np.ndarray) -> None:
    j = 0
    for i in range(prefix.shape[0]):
        for _ in range(seq[i] - prefix[i]):
            tags[out[j]] = base + i
            j += 1


@njit(cache=True, error_model="numpy")
def _mark_each(tags: np.ndarray, base: int, out: np.ndarray) -> None:
    for i in range(out.shape[0]):
        tags[out[i]] = base + i


@njit(cache=True, error_model="numpy")
def _free_tokens(tags: np.ndarray, slots: np.ndarray, ps: int, old: np.ndarray, released: np.ndarray,
                 info: np.ndarray) -> int:
    """Check, then free ``slots`` (``old`` keeps their tags for an undo); ``released`` gets the pages left
    without a live slot. Returns how many, or -1 with ``info`` = (1: out of range | 2: dead slot on a live
    page, its index) and nothing changed. A dead slot on a free page lands in ``released``."""
    n = tags.shape[0]
    for i in range(slots.shape[0]):
        s = slots[i]
        if s < ps or s >= n:
            info[0], info[1] = 1, i
            return -1
        if tags[s] < 0:
            base = s // ps * ps
            for k in range(ps):
                if tags[base + k] >= 0:
                    info[0], info[1] = 2, i
                    return -1
    for i in range(slots.shape[0]):
        old[i] = tags[slots[i]]
        tags[slots[i]] = -1
    r, prev = 0, -1
    for i in range(slots.shape[0]):
        p = slots[i] // ps
        if p == prev:
            continue
        prev = p
        empty = True
        for k in range(ps):
            if tags[p * ps + k] >= 0:
                empty = False
                break
        if empty:
            released[r] = p
            r += 1
    return r


@njit(cache=True, error_model="numpy")
def _undo_free(tags: np.ndarray, slots: np.ndarray, old: np.ndarray) -> None:
    for i in range(slots.shape[0] - 1, -1, -1):  # backwards: a duplicate's first (original) tag is written last
        tags[slots[i]] = old[i]


class LiveSlotError(InvalidIdError):
    """An allocation would hand out a slot that is live (held by another allocation).

    Attributes:
        slot: the live slot id. owner: who holds it, as text (``"request 0 of alloc_extend call 1"``).
        request: the index, in the refused call's batch, of the request that asked for it.
    """

    def __init__(self, where: str, request: int, slot: int, owner: str) -> None:
        self.slot, self.owner, self.request = slot, owner, request
        super().__init__(f"{where}: request {request}: slot {slot} is live, held by {owner}; allowed a last_loc "
                         f"that is its request's last token (the slot after it free)")


class SlotOccupancy:
    """Slot tags of one pool: ``num_slots`` slots (``page * page_size + offset``), all free at first.

    Args:
        num_slots: slots of the pool (pages times ``page_size``, page 0 included). page_size: tokens per page.
    """

    def __init__(self, num_slots: int, page_size: int) -> None:
        self.page_size = page_size
        self.tags = np.full(num_slots, -1, dtype=np.int64)
        self.calls = 0

    # ---- tags ---------------------------------------------------------------------------------------------
    def next_tag(self, kind: str) -> int:
        """The tag base of a new call of ``kind`` (a request index is added to it)."""
        self.calls += 1
        return (self.calls << _CALL_SHIFT) | (KINDS.index(kind) << _KIND_SHIFT)

    @staticmethod
    def describe(tag: int) -> str:
        """Who a tag names: ``"request <i> of <call> call <n>"``."""
        return f"request {tag & _REQ_MASK} of {KINDS[(tag >> _KIND_SHIFT) & 3]} call {tag >> _CALL_SHIFT}"

    def holder(self, slot: int) -> str | None:
        """Who holds ``slot`` (:meth:`describe`), or None if it is free."""
        tag = int(self.tags[slot])
        return None if tag < 0 else self.describe(tag)

    # ---- allocation checks (before the allocator runs) --------------------------------------------------------
    def check_extend(self, prefix: np.ndarray, seq: np.ndarray, last_loc: np.ndarray) -> None:
        """Refuse an ``alloc_extend`` whose tail-page slots (``last_loc + 1 ..`` up to the page end or
        ``seq_len``) are live. Arguments: int64 ``(B,)``; other misuse is left to the allocator's checks.

        Raises:
            LiveSlotError: the first such slot, with its holder.
        """
        if self.page_size == 1 or prefix.shape != seq.shape or prefix.shape != last_loc.shape:
            return
        i, slot = _first_live_extend(self.tags, prefix, seq, last_loc, self.page_size)
        if i >= 0:
            raise LiveSlotError("alloc_extend", i, slot, self.describe(int(self.tags[slot])))

    def check_decode(self, seq: np.ndarray, last_loc: np.ndarray) -> None:
        """Refuse an ``alloc_decode`` whose slot ``last_loc + 1`` (where position ``seq_len - 1`` does not
        start a page) is live. (Two requests of one batch asking for one slot: the allocator refuses it.)

        Raises:
            LiveSlotError: a live slot, with its holder.
        """
        if self.page_size == 1 or seq.shape != last_loc.shape:
            return
        i = _first_live_decode(self.tags, seq, last_loc, self.page_size)
        if i >= 0:
            slot = int(last_loc[i]) + 1
            raise LiveSlotError("alloc_decode", i, slot, self.describe(int(self.tags[slot])))

    # ---- updates (after the allocator succeeded) ----------------------------------------------------------
    def mark(self, slots: np.ndarray, tag: int) -> None:
        """Slots just handed out to one request (``alloc``): tag ``tag``."""
        self.tags[slots] = tag

    def mark_each(self, base: int, slots: np.ndarray) -> None:
        """Slots just handed out one per request (``alloc_decode``): request ``i`` gets ``base + i``."""
        _mark_each(self.tags, base, slots)

    def mark_extend(self, base: int, prefix: np.ndarray, seq: np.ndarray, slots: np.ndarray) -> None:
        """The slots of an ``alloc_extend``, request by request (``seq - prefix`` each)."""
        _mark_extend(self.tags, base, prefix, seq, slots)

    # ---- frees ----------------------------------------------------------------------------------------------
    def free(self, slots: np.ndarray, pages: np.ndarray, where: str, name: str,
             release: Callable[[np.ndarray], None]) -> None:
        """Free ``slots`` (tokens) and whole ``pages``: ``release(pages)`` is called once with every page left
        without a live slot (``pages`` plus the token pages emptied; duplicates possible), and the tags change
        for good only if it returns.

        Args:
            slots, pages: int64 ids (duplicates merge; a token on a page of ``pages`` goes with its page).
            where, name: the call and argument named in errors.
            release: frees pages in the allocator; it raises (changing nothing) for a page that is not live.

        Raises:
            InvalidIdError: a token in page 0 or outside the pool. DoubleFreeError: a token that is not live on a
            live page (freed already, or never handed out). What ``release`` raises: a page of ``pages``, or a
            token's page, that is not live. Nothing changes on any error.

        Complexity: one numba pass, O(n + page_size * pages touched); whole ``pages`` add O(pages * page_size)
        numpy work. No sort.
        """
        ps, tags = self.page_size, self.tags
        if pages.shape[0] and slots.shape[0]:
            slots = slots[~np.isin(slots // ps, pages)]
        old = np.empty(slots.shape[0], dtype=np.int64)
        emptied = np.empty(slots.shape[0], dtype=np.int64)
        info = np.zeros(2, dtype=np.int64)
        r = _free_tokens(tags, slots, ps, old, emptied, info)
        if r < 0:
            s = int(slots[info[1]])
            if info[0] == 1:
                raise InvalidIdError(f"{where}: {name}[{int(info[1])}]={s} is out of range; allowed slot ids in "
                                     f"[{ps}, {tags.shape[0]})")
            raise DoubleFreeError(f"{where}: slot {s} is not live (freed already or never handed out) while "
                                  f"its page {s // ps} is; allowed live slots")
        if not pages.shape[0]:
            try:
                if r:
                    release(emptied[:r])
            except BaseException:
                _undo_free(tags, slots, old)
                raise
            return
        whole = pages[(pages >= 0) & (pages < tags.shape[0] // ps)]  # out-of-range pages: release refuses them
        old_whole = tags.reshape(-1, ps)[whole]
        try:
            tags.reshape(-1, ps)[whole] = -1
            release(np.concatenate([pages, emptied[:r]]))
        except BaseException:
            tags.reshape(-1, ps)[whole] = old_whole
            _undo_free(tags, slots, old)
            raise

    def clear(self) -> None:
        """Every slot free (the call count restarts)."""
        self.tags.fill(-1)
        self.calls = 0

    def check_pages(self, page_live: np.ndarray) -> None:
        """Invariant: a page is live in the allocator (``page_live``, bool per page) iff one of its slots is.

        Raises:
            AssertionError subclass InvariantError: the first page where they disagree.
        """
        ours = np.asarray((self.tags.reshape(-1, self.page_size) >= 0).any(axis=1))
        wrong = np.flatnonzero(ours != page_live)
        if wrong.shape[0]:
            p = int(wrong[0])
            raise InvariantError(f"occupancy: page {p} is {'live' if page_live[p] else 'free'} in the allocator "
                                 f"but {'has' if ours[p] else 'has no'} live slots")


__all__ = ["KINDS", "LiveSlotError", "SlotOccupancy"]
