"""The transfer layer: peer layouts, row arithmetic, descriptors, transfer plans and their builders.

Modules, each depending only on those above it:

* :mod:`~umalloc.transfer.rows`: which local rows of each end travel (SWA tail, DCP sharding); pure.
* :mod:`~umalloc.transfer.layout`: :class:`PeerLayout` (one side's geometry, regions, wire format) and peer
  compatibility (:func:`check_compatible`, checked once at connect: :func:`compatible_layouts`).
* :mod:`~umalloc.transfer.descriptors`: coalesced runs to bounds-checked ``(N, 3)`` uint64 descriptors, and
  how a backend locates a batch in the registered regions and cuts it into bounded submissions.
* :mod:`~umalloc.transfer.plan`: :class:`IndexVector`, :class:`TransferPlan`, :class:`ReceiverHalf`, their
  leases, and :class:`PlanLike` (what backends use of a plan).
* :mod:`~umalloc.transfer.build`: :func:`build_plan`, :func:`build_receiver_half`, :func:`build_send_plan`.
"""

from umalloc.geometry.spec import swa_tail_start
from umalloc.transfer.build import PlanAllocator, VTokens, build_plan, build_receiver_half, build_send_plan
from umalloc.transfer.layout import (
    VECTOR_NAME_BY_ROLE,
    CheckedLayouts,
    PeerLayout,
    check_compatible,
    compatible_layouts,
    layout_differences,
)
from umalloc.transfer.plan import (
    PLAN_ABORTED,
    PLAN_DONE,
    PLAN_FAILED,
    PLAN_PENDING,
    HalfVector,
    IndexVector,
    PlanLike,
    ReceiverHalf,
    TransferPlan,
    VectorStats,
)
from umalloc.transfer.rows import DCP_SHARDED_ROLES, is_dcp_sharded, owned_count, source_ranks, vector_rows

__all__ = [
    "DCP_SHARDED_ROLES", "PLAN_ABORTED", "PLAN_DONE", "PLAN_FAILED", "PLAN_PENDING", "VECTOR_NAME_BY_ROLE",
    "CheckedLayouts", "HalfVector", "IndexVector", "PeerLayout", "PlanAllocator", "PlanLike",
    "ReceiverHalf", "TransferPlan", "VTokens", "VectorStats", "build_plan", "build_receiver_half",
    "build_send_plan", "check_compatible", "compatible_layouts", "is_dcp_sharded", "layout_differences",
    "owned_count", "source_ranks", "swa_tail_start", "vector_rows",
]
