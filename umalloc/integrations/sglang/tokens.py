"""The page-size-1 slot pool of :mod:`umalloc.integrations.sglang`: index vectors, no per-page tables.

At page size 1 every token is a page, so a pool that kept umalloc's per-page tables (states, ``v2p``/``p2v``,
bitmaps, band counters: :class:`~umalloc.integrations.sglang.pools.SlotPool`) would do that bookkeeping for
every token. :class:`TokenSlotPool` keeps two vectors instead:

* ``ring``: int64 ``(num_slots,)``, the free slots in the order they are handed out (a ring buffer: ``alloc``
  takes from its head, ``free`` appends at its tail), the order of SGLang's ``TokenToKVPoolAllocator`` without
  ``need_sort``: slots ``1 .. num_slots`` first, then freed slots oldest first;
* ``live``: int8 ``(num_slots + 1,)``, 1 for a slot handed out and not freed (slot 0, SGLang's padded dummy
  slot, is never live and never handed out).

One numba pass per call (Note [Token pool kernels]); the misuse :class:`SlotPool` refuses is refused the same way
(typed errors, nothing changed): a slot out of ``[1, num_slots]`` or slot 0 (``InvalidIdError``), a slot freed
twice or never handed out (``DoubleFreeError``); one slot named twice in one call is freed once, as
:class:`SlotPool` does.

Note [Token pool kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~
``k_take(ring, head_count, live, k, out, at)`` copies ``k`` slots from the ring's head into ``out[at:]``, marked live;
``k_give(ring, head_count, live, stamp, ids)`` frees in one pass: each live id is cleared, stamped with this call's
epoch and appended at the ring's tail; an id that is not live but carries this call's stamp is a repeat and is
skipped; any other id is refused, and the slots this call cleared are made live again (the ring's count is only
raised at the end, so the entries written past the tail are dead). ``head_count`` is int64 ``[head, count,
epoch]``; ``stamp`` int64 ``(num_slots + 1,)``.

Note [Output buffers]
~~~~~~~~~~~~~~~~~~~~~
``alloc_tokens`` writes its ids into the next unused stretch of an output buffer and returns a tensor view of it;
a buffer is only ever written once per position, and a full one is replaced by a fresh one (the old one lives as
long as some returned ids view it). So returned ids never change, and a call costs one slice, not an allocation.
Deferred frees of a group are copied into one growing buffer and freed from it in one pass at the group's end.

Threading: one scheduler thread, as SGLang's allocators.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from umalloc.errors import DoubleFreeError, InvalidIdError, InvariantError, UmallocValueError
from umalloc.ids import check_id_tensor

_HEAD, _COUNT, _EPOCH = 0, 1, 2
#: slots per output buffer (Note [Output buffers]): 512 KiB
_OUT_SLOTS = 1 << 16


@numba.njit(cache=True, nogil=True)
def k_take(ring: np.ndarray, head_count: np.ndarray, live: np.ndarray, k: int, out: np.ndarray,
           at: int) -> None:  # pragma: no cover - numba
    """``k`` slots from the ring's head into ``out[at:at + k]``, marked live (the caller checked ``k <= count`` and
    the room in ``out``)."""
    cap = ring.shape[0]
    h = head_count[_HEAD]
    for i in range(k):
        s = ring[h]
        out[at + i] = s
        live[s] = 1
        h += 1
        if h == cap:
            h = 0
    head_count[_HEAD] = h
    head_count[_COUNT] -= k


@numba.njit(cache=True, nogil=True)
def k_give(ring: np.ndarray, head_count: np.ndarray, live: np.ndarray, stamp: np.ndarray,
           ids: np.ndarray) -> int:  # pragma: no cover - numba
    """Free ``ids`` (Note [Token pool kernels]). Returns the slots freed (``>= 0``), else ``-1 - (2 * i + code)``
    for the first bad ``ids[i]`` (code 0: out of range or slot 0, code 1: not live) with nothing changed."""
    n = ids.shape[0]
    top = live.shape[0]
    cap = ring.shape[0]
    head_count[_EPOCH] += 1
    epoch = head_count[_EPOCH]
    t0 = head_count[_HEAD] + head_count[_COUNT]
    if t0 >= cap:
        t0 -= cap
    t = t0
    c = 0
    bad = -1
    for i in range(n):
        s = ids[i]
        if s < 1 or s >= top:
            bad = 2 * i
            break
        if live[s] == 1:
            live[s] = 0
            stamp[s] = epoch
            ring[t] = s
            t += 1
            if t == cap:
                t = 0
            c += 1
        elif stamp[s] != epoch:
            bad = 2 * i + 1
            break
    if bad < 0:
        head_count[_COUNT] += c
        return c
    t = t0                      # undo: the slots this call freed are live again; the ring's count never moved
    for _ in range(c):
        live[ring[t]] = 1
        t += 1
        if t == cap:
            t = 0
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

    Memory: 17 bytes per slot. Every call is O(its ids) in one numba pass, except :meth:`free_page_ids` and
    :meth:`check_invariants` (O(num_slots)).

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
        self._ring = np.empty(self.num_pages, np.int64)
        self._live = np.zeros(self.num_pages + 1, np.int8)
        self._hc = np.zeros(3, np.int64)
        self._stamp = np.zeros(self.num_pages + 1, np.int64)
        self._group_open = False
        self._group_n = 0
        self._group_buf = np.empty(1024, np.int64)
        self._out_pos = 0
        self._out = np.empty(0, np.int64)
        self._out_t = torch.from_numpy(self._out)
        self._new_out(0)
        self.clear()

    # ---- capacity --------------------------------------------------------------------------------------
    def available_pages(self) -> int:
        """Free slots (deferred frees of an open group not counted). O(1)."""
        return self._free

    available_tokens = available_pages

    def free_page_ids(self) -> torch.Tensor:
        """Free slots, ascending: a new CPU int64 tensor. O(num_slots)."""
        return torch.from_numpy(np.flatnonzero(self._live[1:] == 0) + 1)

    def live_pages(self) -> int:
        """Slots handed out and not freed. O(1)."""
        return self.num_pages - self._free

    # ---- allocation ------------------------------------------------------------------------------------
    def alloc_tokens(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` free slots in ring order (module docstring).

        Returns:
            int64 ``(need_size,)`` on ``device`` (a new tensor), or ``None`` (nothing changed) if fewer are free.
        Raises:
            UmallocValueError: ``need_size`` not an int >= 0.
        """
        if type(need_size) is not int or need_size < 0:
            _count(need_size, "need_size", 0)
        if need_size > self._free:
            return None
        pos = self._out_pos
        if pos + need_size > self._out.shape[0]:
            self._new_out(need_size)
            pos = 0
        self._out_pos = pos + need_size
        k_take(self._ring, self._hc, self._live, need_size, self._out, pos)
        self._free -= need_size
        ids = self._out_t[pos:pos + need_size]
        return ids if self._on_host else ids.to(self.device, non_blocking=True)

    def _new_out(self, at_least: int) -> None:
        """A fresh output buffer (Note [Output buffers]); the old one lives on in the ids handed out of it."""
        self._out = np.empty(max(_OUT_SLOTS, at_least), np.int64)
        self._out_t = torch.from_numpy(self._out)
        self._out_pos = 0

    # ---- free ------------------------------------------------------------------------------------------
    @staticmethod
    def _host(ids: torch.Tensor, name: str) -> np.ndarray:
        if type(ids) is torch.Tensor and ids.dtype is torch.int64 and ids.is_cpu and ids.dim() == 1:
            return ids.numpy()
        if not isinstance(ids, torch.Tensor):
            raise InvalidIdError(f"{name}: a {type(ids).__name__}; allowed a 1-D torch integer tensor")
        check_id_tensor(ids, name)  # dense, an integer dtype
        return ids.to("cpu", torch.int64).reshape(-1).numpy()

    def _give(self, ids: np.ndarray, name: str) -> None:
        r = k_give(self._ring, self._hc, self._live, self._stamp, ids)
        if r >= 0:
            self._free += r
        else:
            i, code = divmod(-1 - r, 2)
            if code == 0:
                raise InvalidIdError(f"{name}[{i}]={int(ids[i])}: allowed a slot in [1, {self.num_pages}]; nothing "
                                     f"changed")
            raise DoubleFreeError(f"{name}[{i}]={int(ids[i])}: the slot is not allocated (freed already or never "
                                  f"handed out); nothing changed")

    def free_tokens(self, free_index: torch.Tensor) -> None:
        """Free these slots (a slot named twice is freed once; deferred inside a group).

        Raises:
            InvalidIdError / DoubleFreeError: slot 0 or out of range, a slot not allocated. Nothing changes. Inside a
            group the check runs at :meth:`end_group`.
        """
        ids = self._host(free_index, "free_index")
        if ids.shape[0] == 0:
            return
        if self._group_open:
            self._defer(ids)
            return
        self._give(ids, "free_index")

    def free_pages(self, page_ids: torch.Tensor) -> None:
        """:meth:`free_tokens` (pages are slots at page size 1)."""
        ids = self._host(page_ids, "page_ids")
        if ids.shape[0] == 0:
            return
        if self._group_open:
            self._defer(ids)
            return
        self._give(ids, "page_ids")

    def _defer(self, ids: np.ndarray) -> None:
        """Copy ``ids`` into the open group's buffer (doubled when full)."""
        n, m = self._group_n, ids.shape[0]
        if n + m > self._group_buf.shape[0]:
            grown = np.empty(max(2 * self._group_buf.shape[0], n + m), np.int64)
            grown[:n] = self._group_buf[:n]
            self._group_buf = grown
        self._group_buf[n:n + m] = ids
        self._group_n = n + m

    def begin_group(self) -> None:
        """Defer frees until :meth:`end_group`. Raises UmallocValueError if a group is open (no nesting)."""
        if self._group_open:
            raise UmallocValueError("free_group_begin: a free group is already open; allowed: no nesting")
        self._group_open = True
        self._group_n = 0

    def end_group(self) -> None:
        """Free everything deferred since :meth:`begin_group` in one pass (a slot named twice is freed once).

        Raises:
            UmallocValueError: no group is open. The errors of :meth:`free_tokens`: the group is closed, its frees
            are dropped and nothing changed.
        """
        if not self._group_open:
            raise UmallocValueError("free_group_end: no free group is open; allowed after free_group_begin")
        self._group_open = False
        if self._group_n:
            self._give(self._group_buf[:self._group_n], "free_group")

    @property
    def group_open(self) -> bool:
        """Whether a free group is open."""
        return self._group_open

    def clear(self) -> None:
        """Every slot free (ring order ``1 .. num_slots`` again), no group open. O(num_slots)."""
        self._ring[:] = np.arange(1, self.num_pages + 1, dtype=np.int64)
        self._live[:] = 0
        self._hc[:] = (0, self.num_pages, self._hc[_EPOCH])
        self._free = self.num_pages      # the ring's count, mirrored as a Python int for the O(1) queries
        self._group_open = False

    def check_invariants(self) -> None:
        """The free slots in the ring and the live slots partition ``1 .. num_slots``; slot 0 is never live.

        Raises:
            InvariantError: the first broken one. O(num_slots).
        """
        h, c = int(self._hc[_HEAD]), int(self._hc[_COUNT])
        if c != self._free:
            raise InvariantError(f"token pool: the ring holds {c} free slots, the count says {self._free}")
        free = np.roll(self._ring, -h)[:c]
        seen = np.zeros(self.num_pages + 1, np.int8)
        if c and (int(free.min()) < 1 or int(free.max()) > self.num_pages):
            raise InvariantError("token pool: a free slot outside [1, num_slots]")
        np.add.at(seen, free, 1)
        if self._live[0] != 0 or (seen[1:] > 1).any():
            raise InvariantError("token pool: slot 0 live, or a slot free twice")
        if ((seen[1:] == 1) == (self._live[1:] == 1)).any() or not np.isin(self._live, (0, 1)).all():
            raise InvariantError("token pool: a slot is neither free nor live, or both")


__all__ = ["TokenSlotPool"]
