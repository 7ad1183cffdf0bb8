"""Slot generations of a request table: handles that a freed, reused slot refuses (F30).

Note [Handles]
~~~~~~~~~~~~~~
A slot is a row of ``req_to_token`` and is reused once freed. Each slot has a generation (1 at creation, + 1 each
time :meth:`~umalloc.requests.table.RequestTable.free_requests` frees it). A handle is ``generation << 32 | slot`` (always >= 2**32, so it
never reads as a slot); every call taking slots accepts slots or handles, and a handle whose generation is not the
slot's live one raises :class:`~umalloc.errors.StaleHandleError` before anything changes. A bare slot carries no
generation: engines that keep slots across a free should keep handles (:meth:`~umalloc.requests.table.RequestTable.slot_of` gives the
row back).

>>> from umalloc.requests.table import RequestTable
>>> from umalloc.testing import small_allocator
>>> table = RequestTable(small_allocator(), max_requests=2, max_tokens_per_request=4)
>>> (h,) = table.new_requests(1, handles=True).tolist(); table.free_requests([h])
>>> table.new_requests(1).tolist(), table.handles([0]).tolist() == [h]    # slot 0 again, a new generation
([0], False)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import torch

from umalloc.errors import InvalidIdError, StaleHandleError
from umalloc.ids import id_batch

HANDLE_SHIFT = 32                     # handle = generation << 32 | slot
SLOT_MASK = (1 << HANDLE_SHIFT) - 1

#: A batch of slots, handles, token counts or virtual pages: a 1-D torch tensor (any device) of any integer dtype
#: (int64, int32, int16, int8, uint8), a 1-D numpy array of any integer dtype (signed or unsigned, values that fit
#: int64, native byte order), or a sequence of ints; bools, floats and other ranks are refused. Validated once, by
#: :func:`umalloc.ids.id_batch`.
IdBatch: TypeAlias = "torch.Tensor | np.ndarray | Sequence[int]"
#: One request slot or handle: an int (numpy integers too) or a one-element int32/int64 torch tensor.
SlotLike: TypeAlias = "int | np.integer[Any] | torch.Tensor"


class SlotGenerations:
    """The generation of every slot of one table (``int64 (max_requests,)``, 1 at creation). Not thread-safe."""

    def __init__(self, max_requests: int) -> None:
        self.gen = np.ones(max_requests, np.int64)

    def rows(self, s: np.ndarray, in_use: np.ndarray, where: str) -> np.ndarray:
        """Slots given as rows or handles -> rows (``in_use``: the table's live-slot flags); a handle of a slot
        out of range raises InvalidIdError, a stale one StaleHandleError. O(B)."""
        if not s.size or int(s.max()) <= SLOT_MASK:
            return s
        h = s > SLOT_MASK
        rows = np.where(h, s & SLOT_MASK, s)
        gens = s >> HANDLE_SHIFT
        for i in np.flatnonzero(h).tolist():
            r = int(rows[i])
            if r >= self.gen.shape[0]:
                raise InvalidIdError(f"{where}: slots[{i}] is a handle of slot {r}; allowed slots in "
                                     f"[0, {self.gen.shape[0]})")
            if int(gens[i]) != int(self.gen[r]) or not in_use[r]:
                raise StaleHandleError(f"{where}: slots[{i}] is a handle of slot {r} generation {int(gens[i])}; "
                                       f"the slot is at generation {int(self.gen[r])}"
                                       f"{'' if in_use[r] else ' and free'} (freed since; a stale handle)")
        return rows

    def handles(self, rows: np.ndarray) -> np.ndarray:
        """``int64`` handles of (checked) rows. O(B)."""
        return (self.gen[rows] << HANDLE_SHIFT) | rows

    def bump(self, rows: np.ndarray) -> None:
        """The rows were freed: their handles go stale. O(B)."""
        self.gen[rows] += 1


def slot_of(handles: IdBatch) -> torch.Tensor:
    """``int64 (B,)`` slots (``req_to_token`` rows) of handles or slots (unchecked; a slot is its own). O(B)."""
    s = id_batch(handles, "handles")
    return torch.from_numpy(np.where(s > SLOT_MASK, s & SLOT_MASK, s))


__all__ = ["HANDLE_SHIFT", "SLOT_MASK", "IdBatch", "SlotGenerations", "SlotLike", "slot_of"]
