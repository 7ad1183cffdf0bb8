"""The page-size-1 slot pool of :mod:`umalloc.integrations.sglang`: index vectors, no per-page tables.

At page size 1 every token is a page, so a pool that kept umalloc's per-page tables (states, ``v2p``/``p2v``,
bitmaps, band counters: :class:`~umalloc.integrations.sglang.pools.SlotPool`) would do that bookkeeping for
every token. :class:`TokenSlotPool` keeps two vectors instead:

* ``log``: int64, an append-only log of free slots. Position ``base + j`` of the log (a global position, counted
  from the pool's creation) is ``log[j]``; the free slots are the positions ``[head, tail)``, in the order they
  are handed out: ``alloc`` moves ``head`` forward and returns the slots it passed as a view of the log, ``free``
  appends at ``tail``. Inside a free group the frees are appended past ``tail`` (positions ``[tail, end)``:
  staged, neither live nor free) and ``tail`` moves to ``end`` when the group ends. That is the order of SGLang's ``TokenToKVPoolAllocator`` without ``need_sort``: slots
  ``1 .. num_slots`` first, then freed slots oldest first.
* ``pos``: int64 ``(num_slots + 1,)``, the global position slot ``s`` was last appended at. Slot ``s`` is free iff
  ``head <= pos[s] < tail``, live (handed out, not freed) iff ``pos[s] < head``, and staged by the open group iff
  ``pos[s] >= tail``: the liveness check of every free reads one entry, and ``alloc`` writes none.

An ``alloc`` is O(1): no numba call, no per-slot write. A ``free`` is one numba pass (Note [Token pool kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~
``k_give(log, base, tail, end, pos, ids, head)`` stages ``ids`` in one pass, per id: out of range is refused; a
live slot (``pos < head``) is appended at global position ``end + c`` (``log[end - base + c]``) and its ``pos``
set to it; a slot at or past ``tail`` is staged already (by this call or an earlier one of the open group: a
repeat) and is skipped; any other slot (``head <= pos < tail``: free) is refused. A refused call unstages
everything staged since ``tail`` -- this call's appends and the open group's -- by putting each slot's ``pos``
back below ``head`` (live). The caller commits by moving ``tail`` to ``end + c`` (at once outside a group, at the
group's end inside one). Log positions past ``tail`` are never handed out, so writing them again after a refused
call breaks no returned ids (Note [Write-once log]).

A group refused at one of its frees is marked refused: its later frees are dropped unchecked and ``end_group``
raises the first refusal, so a refused group changes nothing, and the error still comes at ``end_group``.

Note [Write-once log]
~~~~~~~~~~~~~~~~~~~~~
A log position is handed out once: ``head`` and ``tail`` only move forward in a buffer. When a free would run past
the buffer's end, the positions ``[head, end)`` (free and staged) are copied to the start of a fresh buffer
(``base`` becomes ``head``; positions stay global, so ``pos`` is unchanged); the old buffer lives as long as some
returned ids view it. So returned ids never change, and an ``alloc`` costs one slice. A buffer holds
``2 * num_slots`` positions (at least 4,096), so a copy of at most ``num_slots`` entries comes at most once per
``num_slots`` appended: O(1) amortised.

Threading: one scheduler thread, as SGLang's allocators.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from umalloc.errors import DoubleFreeError, InvalidIdError, InvariantError, UmallocValueError
from umalloc.ids import check_id_tensor

#: the least log buffer (Note [Write-once log]), in positions
_MIN_LOG = 4096


@numba.njit(cache=True, nogil=True)
def k_give(log: np.ndarray, base: int, tail: int, end: int, pos: np.ndarray, ids: np.ndarray,
           head: int) -> int:  # pragma: no cover - numba
    """Stage ``ids`` at ``end`` (Note [Token pool kernels]); the caller made room for ``ids.shape[0]`` appends.
    Returns the slots staged (``>= 0``), else ``-1 - (2 * i + code)`` for the first bad ``ids[i]`` (code 0: out of
    range or slot 0, code 1: not live) with everything staged since ``tail`` unstaged."""
    n = ids.shape[0]
    top = pos.shape[0]
    j = end - base
    g = end
    bad = -1
    for i in range(n):
        s = ids[i]
        if s < 1 or s >= top:
            bad = 2 * i
            break
        p = pos[s]
        if p < head:                # live: append
            log[j] = s
            pos[s] = g
            j += 1
            g += 1
        elif p < tail:              # free
            bad = 2 * i + 1
            break
        # else: staged already (a repeat)
    if bad < 0:
        return g - end
    for k in range(tail - base, j):  # unstage: live again
        pos[log[k]] = head - 1
    return -1 - bad


def _count(value: object, name: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= int(value) < 1 << 63:
        raise UmallocValueError(f"{name}={value!r}: allowed an int in [{lo}, 2**63)")
    return int(value)


class TokenSlotPool:
    """Slot ids ``1 .. num_slots`` of one page-size-1 KV pool (slot 0 reserved), as index vectors (module
    docstring). The interface of :class:`~umalloc.integrations.sglang.pools.SlotPool` at ``page_size`` 1.

    Args:
        num_slots: usable slots (SGLang's ``size``; an int >= 1).
        device: where returned ids live; the vectors stay on the host.

    Raises:
        UmallocValueError: bad ``num_slots``.

    Memory: 24 bytes per slot on the host (a log of ``2 * num_slots`` positions and ``pos``), plus the log
    buffers that returned ids still view. :meth:`alloc_tokens`, :meth:`begin_group` and :meth:`end_group` are
    O(1) (a refused group: O(its ids)); a free is O(its ids) in one numba pass (O(num_slots) when it starts a
    fresh log buffer, at most once per ``num_slots`` frees); :meth:`free_page_ids`, :meth:`clear` and
    :meth:`check_invariants` are O(num_slots).

    >>> pool = TokenSlotPool(5)
    >>> pool.alloc_tokens(3).tolist(), pool.available_tokens()
    ([1, 2, 3], 2)
    >>> pool.free_tokens(torch.tensor([2])); pool.alloc_tokens(3).tolist()   # freed slots come after the rest
    [4, 5, 2]
    """

    page_size = 1
    allocator = None   #: no umalloc allocator behind this pool (the index vectors are the whole state)

    def __init__(self, num_slots: int, device: str | torch.device = "cpu") -> None:
        self.num_pages = _count(num_slots, "num_slots", 1)
        self.device = torch.device(device)
        self._on_host = self.device.type == "cpu"
        self._log_len = max(2 * self.num_pages, _MIN_LOG)
        self._pos = np.empty(self.num_pages + 1, np.int64)
        self._log = np.empty(0, np.int64)
        self._log_t = torch.from_numpy(self._log)
        self._base = self._head = self._tail = self._end = self._free = 0
        self._group_open = False
        self._group_n = 0
        self._group_error: InvalidIdError | None = None
        self.clear()

    # ---- capacity --------------------------------------------------------------------------------------
    def available_pages(self) -> int:
        """Free slots (frees of an open group not counted). O(1)."""
        return self._free

    available_tokens = available_pages

    def free_page_ids(self) -> torch.Tensor:
        """Free slots, ascending (frees of an open group not counted): a new CPU int64 tensor. O(num_slots)."""
        p = self._pos[1:]
        return torch.from_numpy(np.flatnonzero((p >= self._head) & (p < self._tail)) + 1)

    def live_pages(self) -> int:
        """Slots handed out and not freed (frees of an open group not counted). O(1)."""
        return self.num_pages - self._free

    # ---- allocation ------------------------------------------------------------------------------------
    def alloc_tokens(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` free slots in log order (module docstring).

        Returns:
            int64 ``(need_size,)`` on ``device``, or ``None`` (nothing changed) if fewer are free. On the CPU a view
            of the write-once log (Note [Write-once log]): it never changes. O(1).
        Raises:
            UmallocValueError: ``need_size`` not an int >= 0.
        """
        if type(need_size) is not int or need_size < 0:
            need_size = _count(need_size, "need_size", 0)   # a numpy integer as a Python int: head stays an int
        if need_size > self._free:
            return None
        j = self._head - self._base
        self._head += need_size
        self._free -= need_size
        ids = self._log_t[j:j + need_size]
        return ids if self._on_host else ids.to(self.device, non_blocking=True)

    def _new_log(self, room: int) -> None:
        """Move the positions ``[head, end)`` to the start of a fresh buffer with ``room`` more after them
        (Note [Write-once log]); the old buffer lives on in the ids that view it."""
        b, count = self._base, self._end - self._head
        log = np.empty(max(self._log_len, count + room), np.int64)
        log[:count] = self._log[self._head - b:self._end - b]
        self._log, self._log_t, self._base = log, torch.from_numpy(log), self._head

    # ---- free ------------------------------------------------------------------------------------------
    def free_tokens(self, free_index: torch.Tensor) -> None:
        """Free these slots (a slot named twice is freed once; inside a group they become free at its end).

        Raises:
            InvalidIdError / DoubleFreeError: slot 0 or out of range, a slot not allocated. Nothing changes. Inside a
            group the error is raised at :meth:`end_group`.
        """
        if (type(free_index) is torch.Tensor and free_index.dtype is torch.int64 and free_index.is_cpu
                and free_index.dim() == 1):
            ids = free_index.numpy()
        else:
            ids = self._host(free_index, "free_index")
        if ids.shape[0]:
            self._give(ids, "free_index")

    def free_pages(self, page_ids: torch.Tensor) -> None:
        """:meth:`free_tokens` (pages are slots at page size 1)."""
        ids = self._host(page_ids, "page_ids")
        if ids.shape[0]:
            self._give(ids, "page_ids")

    @staticmethod
    def _host(ids: torch.Tensor, name: str) -> np.ndarray:
        if type(ids) is torch.Tensor and ids.dtype is torch.int64 and ids.is_cpu and ids.dim() == 1:
            return ids.numpy()
        if not isinstance(ids, torch.Tensor):
            raise InvalidIdError(f"{name}: a {type(ids).__name__}; allowed a 1-D torch integer tensor")
        check_id_tensor(ids, name)  # dense, an integer dtype
        return ids.to("cpu", torch.int64).reshape(-1).numpy()

    def _give(self, ids: np.ndarray, name: str) -> None:
        """Stage ``ids`` (Note [Token pool kernels]); outside a group commit them, else count them for the
        group's errors. A refusal raises at once outside a group and marks the group refused inside one."""
        if self._group_error is not None:
            return
        n = ids.shape[0]
        if self._end - self._base + n > self._log.shape[0]:
            self._new_log(n)
        r = k_give(self._log, self._base, self._tail, self._end, self._pos, ids, self._head)
        if r >= 0:
            self._end += r
            if not self._group_open:
                self._tail = self._end
                self._free += r
            else:
                self._group_n += n
            return
        self._end = self._tail
        i, code = divmod(-1 - r, 2)
        where, at = (name, i) if not self._group_open else ("free_group", self._group_n + i)
        if code == 0:
            err: InvalidIdError = InvalidIdError(
                f"{where}[{at}]={int(ids[i])}: allowed a slot in [1, {self.num_pages}]; nothing changed")
        else:
            err = DoubleFreeError(f"{where}[{at}]={int(ids[i])}: the slot is not allocated (freed already or "
                                  f"never handed out); nothing changed")
        if not self._group_open:
            raise err
        self._group_error = err

    def begin_group(self) -> None:
        """Free later frees together at :meth:`end_group`. Raises UmallocValueError if a group is open (no
        nesting)."""
        if self._group_open:
            raise UmallocValueError("free_group_begin: a free group is already open; allowed: no nesting")
        self._group_open = True
        self._group_n = 0

    def end_group(self) -> None:
        """The group's frees become free, in the order they were made (a slot named twice is freed once). O(1).

        Raises:
            UmallocValueError: no group is open. The first error of the group's frees (:meth:`free_tokens`): the
            group is closed, its frees are dropped and nothing changed.
        """
        if not self._group_open:
            raise UmallocValueError("free_group_end: no free group is open; allowed after free_group_begin")
        self._group_open = False
        err, self._group_error = self._group_error, None
        if err is not None:
            raise err
        self._free += self._end - self._tail
        self._tail = self._end

    @property
    def group_open(self) -> bool:
        """Whether a free group is open."""
        return self._group_open

    def clear(self) -> None:
        """Every slot free (log order ``1 .. num_slots`` again, in a fresh log buffer), no group open.
        O(num_slots)."""
        n = self.num_pages
        self._log = np.empty(self._log_len, np.int64)
        self._log[:n] = np.arange(1, n + 1, dtype=np.int64)
        self._log_t = torch.from_numpy(self._log)
        self._base = self._head = 0
        self._tail = self._end = n
        self._pos[1:] = np.arange(n, dtype=np.int64)     # slot s at position s - 1
        self._pos[0] = 1 << 62                           # slot 0: never live (its position is never reached)
        self._free = n
        self._group_open = False
        self._group_n = 0
        self._group_error = None

    def check_invariants(self) -> None:
        """The positions ``[head, end)`` of the log hold each free or staged slot once, at the position ``pos``
        names; every other slot is live (``pos < head``); slot 0 is never live; nothing is staged outside a group.

        Raises:
            InvariantError: the first broken one. O(num_slots).
        """
        h, t, e, b = self._head, self._tail, self._end, self._base
        if (not b <= h <= t <= e <= b + self._log.shape[0] or t - h != self._free
                or (e != t and not self._group_open)):
            raise InvariantError(f"token pool: base {b}, head {h}, tail {t}, end {e}, buffer {self._log.shape[0]}, "
                                 f"free count {self._free}, group open {self._group_open}")
        held = self._log[h - b:e - b]
        if held.shape[0] and (int(held.min()) < 1 or int(held.max()) > self.num_pages):
            raise InvariantError("token pool: a free slot outside [1, num_slots]")
        if (self._pos[held] != np.arange(h, e)).any():
            raise InvariantError("token pool: a free slot's pos is not its log position (or it is free twice)")
        if int((self._pos[1:] >= h).sum()) != e - h or int(self._pos[1:].max(initial=-1)) >= e:
            raise InvariantError("token pool: a slot is free outside the log's free positions")
        if self._pos[0] < h:
            raise InvariantError("token pool: slot 0 is live")


__all__ = ["TokenSlotPool"]
