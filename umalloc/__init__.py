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
    "LayerKind": "umalloc.geometry.spec",
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
    "TombstoneError": "umalloc.errors",
    "LeaseError": "umalloc.errors",
    "StaleLeaseError": "umalloc.errors",
    "InvariantError": "umalloc.errors",
    "ArenaInUseError": "umalloc.errors",
    "WriteIncompleteError": "umalloc.errors",
    # transfer errors
    "IncompatiblePeerError": "umalloc.errors",
    "DescriptorBoundsError": "umalloc.errors",
    "BackendError": "umalloc.errors",
    "BackendUnavailable": "umalloc.errors",
    "RegistrationError": "umalloc.errors",
    "TransferError": "umalloc.errors",
    "TransferTimeout": "umalloc.errors",
    "PeerDiedError": "umalloc.errors",
    # presets, geometry helpers, row and routing rules, the backends' worker (names the replay application uses)
    "DEFAULT_PRESET": "umalloc.geometry.presets",
    "PRESETS": "umalloc.geometry.presets",
    "preset_ends": "umalloc.geometry.presets",
    "rank_kv_heads": "umalloc.geometry.presets",
    "ARENA_ALIGN_BYTES": "umalloc.geometry.spec",
    "pages_for_tokens": "umalloc.geometry.spec",
    "swa_pages_per_seq": "umalloc.geometry.spec",
    "swa_tail_start": "umalloc.geometry.spec",
    "Region": "umalloc.geometry.region",
    "check_compatible": "umalloc.transfer.layout",
    "is_dcp_sharded": "umalloc.transfer.rows",
    "owned_count": "umalloc.transfer.rows",
    "rows_of_checked": "umalloc.transfer.rows",
    "sends_to": "umalloc.transfer.slices",
    "coalesce_runs": "umalloc.translators.runs",
    "host_ids": "umalloc.ids",
    "BackendWorker": "umalloc.backends.worker",
    "WorkerDied": "umalloc.backends.worker",
    "WorkerTimeout": "umalloc.backends.worker",
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
    from umalloc.backends.worker import (
        BackendWorker,
        WorkerDied,
        WorkerTimeout,
    )
    from umalloc.errors import (
        ArenaInUseError,
        BackendError,
        BackendUnavailable,
        DescriptorBoundsError,
        DoubleFreeError,
        IncompatiblePeerError,
        InvalidIdError,
        InvariantError,
        LeaseError,
        NotAllocatedError,
        PeerDiedError,
        RegistrationError,
        SpecError,
        StaleLeaseError,
        TombstoneError,
        TransferError,
        TransferTimeout,
        UmallocError,
        UmallocValueError,
        WriteIncompleteError,
    )
    from umalloc.geometry.arena import Arena
    from umalloc.geometry.presets import (
        DEFAULT_PRESET,
        PRESETS,
        preset_ends,
        rank_kv_heads,
    )
    from umalloc.geometry.region import (
        Region,
    )
    from umalloc.geometry.spec import (
        ARENA_ALIGN_BYTES,
        ArenaSpec,
        EndRole,
        EndSpec,
        Grow,
        KVDtype,
        LayerKind,
        LayerSpec,
        pages_for_tokens,
        swa_pages_per_seq,
        swa_tail_start,
    )
    from umalloc.ids import host_ids
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
    from umalloc.transfer.rows import (
        is_dcp_sharded,
        owned_count,
        rows_of_checked,
    )
    from umalloc.transfer.slices import (
        sends_to,
    )
    from umalloc.translators.runs import coalesce_runs

__all__ = [
    "ARENA_ALIGN_BYTES", "Arena", "ArenaInUseError", "ArenaSpec", "BackendError", "BackendUnavailable",
    "BackendWorker", "CompactionReport", "DEFAULT_PRESET", "DescriptorBoundsError", "DoubleFreeError",
    "EndRole", "EndSpec", "EndStats", "Grow", "IncompatiblePeerError", "InvalidIdError", "InvariantError",
    "KVDtype", "LayerKind", "LayerSpec", "Lease", "LeaseError", "MultiEndedAllocator", "NotAllocatedError",
    "PRESETS", "PeerDiedError", "PeerLayout", "ReceiverHalf", "Region", "RegistrationError", "RequestTable",
    "RequestTableStats", "RetractedKV", "SpecError", "StaleLeaseError", "TOMBSTONE", "TombstoneError", "TransferError",
    "TransferPlan", "TransferTimeout", "UmallocError", "UmallocValueError", "WorkerDied", "WorkerTimeout",
    "WriteGate", "WriteIncompleteError",
    "build_plan", "build_receiver_half", "build_send_plan", "check_compatible", "coalesce_runs", "get_backend",
    "host_ids", "is_dcp_sharded", "owned_count", "pages_for_tokens", "preset_ends", "rank_kv_heads", "rows_of_checked",
    "sends_to", "swa_pages_per_seq", "swa_tail_start",
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
