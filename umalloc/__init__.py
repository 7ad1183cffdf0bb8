"""umalloc: a multi-ended KV-cache page allocator for LLM inference engines.

One byte arena holds every end (sub-pool) of a model -- full attention, sliding window, draft -- under virtual
token ids; transfer leases keep in-flight pages in place; compaction and plans move bytes in batched copies.

The public names below are imported lazily (PEP 562), so ``import umalloc`` stays cheap and pulls in no numba
kernel until one is used. Type checkers read the same names through the imports under ``TYPE_CHECKING`` (the
package ships ``py.typed``); ``tests/typing/test_public_face.py`` keeps the two lists equal.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # allocator
    "MultiEndedAllocator": "umalloc.allocator.facade",
    "EndStats": "umalloc.allocator.facade",
    "RetractedKV": "umalloc.allocator.retraction",
    # request ownership
    "RequestTable": "umalloc.requests.table",
    "RequestTableStats": "umalloc.requests.table",
    # geometry
    "Arena": "umalloc.geometry.arena",
    "ArenaSpec": "umalloc.geometry.spec",
    "EndSpec": "umalloc.geometry.spec",
    "LayerSpec": "umalloc.geometry.spec",
    "KVDtype": "umalloc.geometry.spec",
    "Grow": "umalloc.geometry.spec",
    "EndRole": "umalloc.geometry.spec",
    # leases and compaction
    "Lease": "umalloc.leases.lease",
    "CompactionReport": "umalloc.pool.compaction",
    # page states
    "TOMBSTONE": "umalloc.pool.pagestate",
    # transfer
    "PeerLayout": "umalloc.transfer.layout",
    "TransferPlan": "umalloc.transfer.plan",
    "ReceiverHalf": "umalloc.transfer.plan",
    "build_plan": "umalloc.transfer.build",
    "build_receiver_half": "umalloc.transfer.build",
    "build_send_plan": "umalloc.transfer.build",
    "WriteGate": "umalloc.transfer.gate",
    "get_backend": "umalloc.backends",
    # errors
    "UmallocError": "umalloc.errors",
    "UmallocValueError": "umalloc.errors",
    "SpecError": "umalloc.errors",
    "InvalidIdError": "umalloc.errors",
    "DoubleFreeError": "umalloc.errors",
    "NotAllocatedError": "umalloc.errors",
    "LeaseError": "umalloc.errors",
    "StaleLeaseError": "umalloc.errors",
    "InvariantError": "umalloc.errors",
    # transfer errors
    "BackendError": "umalloc.errors",
    "BackendUnavailable": "umalloc.errors",
    "TransferError": "umalloc.errors",
    # the arena's alignment and the peer-compatibility check a transfer adapter needs
    "ARENA_ALIGN_BYTES": "umalloc.geometry.spec",
    "check_compatible": "umalloc.transfer.layout",
}

if TYPE_CHECKING:
    from umalloc.allocator.facade import (
        EndStats,
        MultiEndedAllocator,
    )
    from umalloc.allocator.retraction import (
        RetractedKV,
    )
    from umalloc.backends import get_backend
    from umalloc.errors import (
        BackendError,
        BackendUnavailable,
        DoubleFreeError,
        InvalidIdError,
        InvariantError,
        LeaseError,
        NotAllocatedError,
        SpecError,
        StaleLeaseError,
        TransferError,
        UmallocError,
        UmallocValueError,
    )
    from umalloc.geometry.arena import Arena
    from umalloc.geometry.spec import (
        ARENA_ALIGN_BYTES,
        ArenaSpec,
        EndRole,
        EndSpec,
        Grow,
        KVDtype,
        LayerSpec,
    )
    from umalloc.leases.lease import Lease
    from umalloc.pool.compaction import CompactionReport
    from umalloc.pool.pagestate import TOMBSTONE
    from umalloc.requests.table import (
        RequestTable,
        RequestTableStats,
    )
    from umalloc.transfer.build import (
        build_plan,
        build_receiver_half,
        build_send_plan,
    )
    from umalloc.transfer.gate import WriteGate
    from umalloc.transfer.layout import (
        PeerLayout,
        check_compatible,
    )
    from umalloc.transfer.plan import (
        ReceiverHalf,
        TransferPlan,
    )

__all__ = [
    "ARENA_ALIGN_BYTES", "Arena", "ArenaSpec", "BackendError", "BackendUnavailable", "CompactionReport",
    "DoubleFreeError", "EndRole", "EndSpec", "EndStats", "Grow", "InvalidIdError", "InvariantError", "KVDtype",
    "LayerSpec", "Lease", "LeaseError", "MultiEndedAllocator", "NotAllocatedError", "PeerLayout",
    "ReceiverHalf", "RequestTable", "RequestTableStats", "RetractedKV", "SpecError", "StaleLeaseError",
    "TOMBSTONE", "TransferError", "TransferPlan", "UmallocError", "UmallocValueError", "WriteGate",
    "build_plan", "build_receiver_half", "build_send_plan", "check_compatible", "get_backend",
]


if not TYPE_CHECKING:  # a type checker reads the imports above; a module __getattr__ would make every name Any

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'umalloc' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
