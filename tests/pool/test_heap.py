"""``Heap.save`` / ``Heap.restore``: what a trial rolls back through (Note [Trials] in umalloc.allocator.facade)."""

from __future__ import annotations

import numpy as np
import pytest

from umalloc.errors import UmallocValueError
from umalloc.pool.heap import Heap
from umalloc.testing import tiny_spec


def _tables(heap: Heap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return heap.meta.copy(), heap.h64.copy(), heap.h8.copy()


def test_restore_writes_back_every_table_in_place() -> None:
    heap = Heap(tiny_spec(), {})
    before = _tables(heap)
    addresses = (heap.meta.ctypes.data, heap.h64.ctypes.data, heap.h8.ctypes.data)
    saved = heap.save()
    heap.set_band(0, 1, 4)
    heap.h64[:] = 7
    heap.h8[: heap.mask_base] = 3
    heap.restore(saved)
    after = _tables(heap)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    # the kernels hold these addresses: restore writes into the arrays, never rebinds them
    assert (heap.meta.ctypes.data, heap.h64.ctypes.data, heap.h8.ctypes.data) == addresses


def test_restore_keeps_the_bind_masks_written_after_the_save() -> None:
    """Bind masks are a cache keyed by their arguments (append-only): a rollback leaves them."""
    heap = Heap(tiny_spec(), {})
    saved = heap.save()
    heap.h8[heap.mask_base:] = 1
    heap.restore(saved)
    assert (heap.h8[heap.mask_base:] == 1).all()


@pytest.mark.parametrize("foreign", ["another heap", "not a save"])
def test_restore_refuses_what_this_heap_did_not_save_and_changes_nothing(foreign: str) -> None:
    heap = Heap(tiny_spec(), {})
    heap.set_band(0, 1, 3)
    before = _tables(heap)
    saved = Heap(tiny_spec(), {}).save() if foreign == "another heap" else (heap.meta, heap.h64, heap.h8)
    with pytest.raises(UmallocValueError, match="not a save of this heap"):
        heap.restore(saved)  # type: ignore[arg-type]
    assert all(np.array_equal(a, b) for a, b in zip(before, _tables(heap), strict=True))
