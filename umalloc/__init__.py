"""umalloc: a multi-ended KV-cache page allocator for LLM inference engines.

One byte arena holds every end (sub-pool) of a model -- full attention, sliding window, draft -- under virtual
token ids; transfer leases keep in-flight pages in place; compaction and plans move bytes in batched copies.

The public names below are imported lazily (PEP 562), so ``import umalloc`` stays cheap and pulls in no numba
kernel until one is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # allocator
    "MultiEndedAllocator": "umalloc.allocator.facade",
    "EndStats": "umalloc.allocator.facade",
    "EndView": "umalloc.allocator.facade",
    "snapshots_equal": "umalloc.allocator.facade",
    "ReadOnlyTable": "umalloc.allocator.ids",
    # request ownership
    "RequestTable": "umalloc.requests.table",
    "RequestTableStats": "umalloc.requests.table",
    # geometry
    "Arena": "umalloc.geometry.arena",
    "ArenaSpec": "umalloc.geometry.spec",
    "EndSpec": "umalloc.geometry.spec",
    "LayerSpec": "umalloc.geometry.spec",
    "LayerKind": "umalloc.geometry.spec",
    "KVDtype": "umalloc.geometry.spec",
    "Grow": "umalloc.geometry.spec",
    "EndRole": "umalloc.geometry.spec",
    # leases and compaction
    "Lease": "umalloc.leases.table",
    "LeaseTable": "umalloc.leases.table",
    "CompactionReport": "umalloc.pool.compaction",
    # page states
    "TOMBSTONE": "umalloc.pool.pagestate",
    "PAGE_RESERVED": "umalloc.pool.pagestate",
    "PAGE_GAP": "umalloc.pool.pagestate",
    "PAGE_HOLE": "umalloc.pool.pagestate",
    "PAGE_LIVE": "umalloc.pool.pagestate",
    "PAGE_PENDING": "umalloc.pool.pagestate",
    # errors
    "UmallocError": "umalloc.errors",
    "UmallocValueError": "umalloc.errors",
    "SpecError": "umalloc.errors",
    "InvalidIdError": "umalloc.errors",
    "DoubleFreeError": "umalloc.errors",
    "NotAllocatedError": "umalloc.errors",
    "TombstoneError": "umalloc.errors",
    "LeaseError": "umalloc.errors",
    "OutOfPages": "umalloc.errors",
    "InvariantError": "umalloc.errors",
    "ArenaInUseError": "umalloc.errors",
    "HeapCopyError": "umalloc.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'umalloc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
