"""Transfer plans: named index vectors of physical pages bound to region groups, and the leases that keep them.

Policy:

* A :class:`TransferPlan` pairs, per end, source and destination *physical* page ids (F13) in named
  :class:`IndexVector` s: ``target`` (full attention), ``swa_tail`` (the sliding window tail only),
  ``draft`` (the drafter's own end, own page size, never the target's ids: F10, F14) and ``state`` (one slot
  per request). Every end of the layout travels in its own vector (F10).
* One id representation: every id array here is a read-only numpy ``int64`` 1-D array; descriptors are a
  read-only numpy ``uint64`` ``(N, 3)`` array. Public constructors convert and check once (torch tensors, numpy
  arrays or lists of ints); the builders in :mod:`umalloc.transfer.build` hand over arrays they made and checked.
* Descriptors come from :mod:`umalloc.transfer.descriptors`, bounds-checked once when the plan is built against
  the regions and the pages leased on both sides; a violation raises
  :class:`~umalloc.errors.DescriptorBoundsError` and no plan exists.
* A plan holds the leases of the pages it touches (source pages on the sender, destination pages on the
  receiver); :meth:`TransferPlan.complete`, :meth:`~TransferPlan.fail` and :meth:`~TransferPlan.abort` release
  them, idempotently, the first terminal transition winning; the plan is a context manager (an exception fails
  it). A :class:`ReceiverHalf` is the receiver's side in the two-process form (JSON-safe, physical ids only).
* :class:`PlanLike` is what the backends use of a plan; :class:`TransferPlan` implements it.
* Finishing a plan while an engine may hold a part of it (a backend's engine hold on its leases) marks it failed
  or aborted at once, and the leases go in doubt: the pages stay pinned until the engine lets go (F24). A
  :class:`ReceiverHalf` whose pages were sent to a peer (:meth:`ReceiverHalf.publish`) is held the same way
  until the sender's terminal report (:meth:`~ReceiverHalf.complete`) or a confirmed termination
  (:meth:`~ReceiverHalf.settle`).
* Threading: a plan is built and posted by one thread; its finishing (``complete``/``fail``/``abort``/``settle``)
  may come from any thread, once (the first terminal transition wins; leases are thread-safe, Note [Lease
  threading] in :mod:`umalloc.leases.table`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from umalloc.errors import (
    DescriptorBoundsError,
    InvalidIdError,
    LeaseError,
    TransferTimeout,
    UmallocValueError,
)
from umalloc.geometry.region import RegionGroup
from umalloc.ids import host_ids
from umalloc.transfer.descriptors import EMPTY_IDS, SideBounds, vector_descriptors
from umalloc.transfer.layout import PeerLayout, wire_int
from umalloc.transfer.rows import check_dcp, check_tokens
from umalloc.translators import get_translator

PLAN_PENDING = "pending"
PLAN_DONE = "done"
PLAN_FAILED = "failed"
PLAN_ABORTED = "aborted"

_HALF_FORMAT = 1
_FINISHING = threading.Lock()  # the first terminal transition wins, whichever thread it comes from
_NO_DESCRIPTORS = np.zeros((0, 3), dtype=np.uint64)
_NO_DESCRIPTORS.setflags(write=False)


# ==== ids =====================================================================================================


def as_ids(x: object, what: str) -> np.ndarray:
    """``x`` as a private read-only 1-D numpy ``int64`` array of non-negative physical ids.

    Accepted: an int64 torch tensor (any device; strided), an integer numpy array whose values fit int64, a
    list or tuple of Python ints. O(n), one copy.

    Raises:
        InvalidIdError: another dtype (floats, bools), a meta or sparse tensor, a list holding anything but
            ints, values past int64, not 1-D, or a negative id.

    >>> as_ids([3, 4], "ids").tolist(), as_ids(np.array([5], dtype=np.uint8), "ids").dtype
    ([3, 4], dtype('int64'))
    """
    # umalloc.ids checks and converts; tensors are int64 only (a plan's ids come from int64 tables)
    a = host_ids(x, what, accept="int64" if isinstance(x, torch.Tensor) else "int", lists=True, nonnegative=True)
    if a is x or not a.flags.owndata:  # the caller's memory: the plan keeps a private copy
        a = a.copy()
    a.setflags(write=False)
    return a


def unique_pages_by_end(pages: Mapping[str, object] | None, what: str) -> dict[str, np.ndarray]:
    """``{end: sorted unique read-only int64 pages}`` from a mapping of id arrays (see :func:`as_ids`).
    O(n log n). Raises :class:`~umalloc.errors.InvalidIdError` as :func:`as_ids`."""
    out: dict[str, np.ndarray] = {}
    for end, arr in (pages or {}).items():
        u = np.unique(as_ids(arr, f"{what}[{end!r}]"))
        u.setflags(write=False)
        out[end] = u
    return out


@dataclass(frozen=True, eq=False)
class IndexVector:
    """One named vector of a plan: source and destination *physical* ids of one end, bound to region groups.

    Attributes:
        name: ``"target"``, ``"draft"``, ``"swa_tail"``, ``"state"`` (or ``"<role>.<end>"`` for a second end of
            a role).
        src_end, dst_end: end names on each side (equal for plans built here).
        src_pages, dst_pages: read-only int64 numpy ``(n,)``; pair ``i`` is one whole-envelope copy.
        src_group, dst_group: region groups whose members step by that end's ``page_bytes``.
        src_rows, dst_rows: read-only int64 numpy ``(m,)`` of physical *token* ids (``page * page_size + row``);
            pair ``i`` copies one token row of every layer block (Note [Boundary page], Note [DCP rows]).

    The id arguments may be int64 torch tensors, integer numpy arrays or lists of ints (copied once, see
    :func:`as_ids`).

    Raises:
        InvalidIdError: non-1-D, non-integer or negative ids, or unequal pair lengths.
    """

    name: str
    src_end: str
    dst_end: str
    src_pages: np.ndarray
    dst_pages: np.ndarray
    src_group: RegionGroup
    dst_group: RegionGroup
    src_rows: np.ndarray = field(default_factory=lambda: EMPTY_IDS)
    dst_rows: np.ndarray = field(default_factory=lambda: EMPTY_IDS)

    def __post_init__(self) -> None:
        for attr in ("src_pages", "dst_pages", "src_rows", "dst_rows"):
            object.__setattr__(self, attr, as_ids(getattr(self, attr), f"{self.name}.{attr}"))
        self._check_pairs()

    @classmethod
    def of_checked(cls, name: str, src_end: str, dst_end: str, src_pages: np.ndarray, dst_pages: np.ndarray,
                   src_group: RegionGroup, dst_group: RegionGroup, src_rows: np.ndarray = EMPTY_IDS,
                   dst_rows: np.ndarray = EMPTY_IDS) -> IndexVector:
        """A vector of ids the caller made and checked (read-only non-negative int64 numpy 1-D arrays): no
        conversion, no copy. The builders use it; pair lengths and groups are still checked. O(1)."""
        v = object.__new__(cls)
        for attr, val in (("name", name), ("src_end", src_end), ("dst_end", dst_end), ("src_pages", src_pages),
                          ("dst_pages", dst_pages), ("src_group", src_group), ("dst_group", dst_group),
                          ("src_rows", src_rows), ("dst_rows", dst_rows)):
            object.__setattr__(v, attr, val)
        v._check_pairs()
        return v

    def _check_pairs(self) -> None:
        if self.src_pages.shape[0] != self.dst_pages.shape[0]:
            raise InvalidIdError(f"vector {self.name!r}: {self.src_pages.shape[0]} source pages but "
                                 f"{self.dst_pages.shape[0]} destination pages; they pair by position")
        if self.src_rows.shape[0] != self.dst_rows.shape[0]:
            raise InvalidIdError(f"vector {self.name!r}: {self.src_rows.shape[0]} source rows but "
                                 f"{self.dst_rows.shape[0]} destination rows; they pair by position")
        if not isinstance(self.src_group, RegionGroup) or not isinstance(self.dst_group, RegionGroup):
            raise UmallocValueError(f"vector {self.name!r}: src_group/dst_group must be RegionGroup")
        if len(self.src_group.members) != len(self.dst_group.members):
            raise UmallocValueError(f"vector {self.name!r}: region groups of {len(self.src_group.members)} and "
                                    f"{len(self.dst_group.members)} members; they pair by position")

    @property
    def num_pages(self) -> int:
        """Whole-envelope page pairs."""
        return int(self.src_pages.shape[0])

    @property
    def num_rows(self) -> int:
        """Row pairs (boundary or DCP rows)."""
        return int(self.src_rows.shape[0])

    @property
    def empty(self) -> bool:
        return self.num_pages == 0 and self.num_rows == 0


# ==== leases ==================================================================================================


class LeaseLike(Protocol):
    """What a plan, and a backend posting it, need of a lease (:class:`umalloc.leases.table.Lease` is one):
    ``active``, ``state`` and ``expired`` (past its deadline) are read — by engine threads too, before a queued
    part is posted — and ``release()`` releases it."""

    @property
    def active(self) -> bool: ...

    @property
    def state(self) -> str: ...

    @property
    def expired(self) -> bool: ...

    def release(self) -> bool: ...


class _LeaseHolder:
    """Shared terminal-state machinery of :class:`TransferPlan` and :class:`ReceiverHalf`."""

    _leases: tuple[LeaseLike | None, ...]
    state: str
    error: BaseException | None

    def _finish(self, state: str, exc: BaseException | None = None) -> bool:
        with _FINISHING:
            if self.state != PLAN_PENDING:
                return False  # idempotent: the first terminal transition wins
            self.state = state
            self.error = exc
        for lease in self._leases:
            if lease is not None:
                lease.release()
        return True

    def complete(self) -> bool:
        """Mark done and release every lease this object holds. Returns False (and changes nothing) if it had
        already finished. O(leased pages)."""
        return self._finish(PLAN_DONE)

    def fail(self, exc: BaseException | None = None) -> bool:
        """Mark failed (keeping ``exc`` as ``error``) and release every lease. Idempotent like :meth:`complete`."""
        return self._finish(PLAN_FAILED, exc)

    def abort(self) -> bool:
        """Mark aborted and release every lease. Idempotent like :meth:`complete`. A lease an engine still holds
        a part of goes in doubt instead (its pages stay pinned until the engine lets go, F24)."""
        return self._finish(PLAN_ABORTED)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            self.fail(exc)
        else:
            self.complete()

    def _check_usable(self) -> None:
        if self.state != PLAN_PENDING:
            raise UmallocValueError(f"{type(self).__name__} is {self.state}: its leases are released, nothing "
                                    "may be posted")
        for lease in self._leases:
            if lease is not None and not lease.active:
                raise LeaseError(f"a lease of this {type(self).__name__} was {lease.state} before the transfer was "
                                 "posted; its pages may be reused (F11)")


# ==== TransferPlan ============================================================================================


@dataclass(frozen=True)
class VectorStats:
    """Counters of one vector: page pairs, row pairs, runs, descriptors, bytes, per-layer-equivalent."""

    pages: int
    rows: int
    runs: int
    descriptors: int
    bytes: int
    per_layer_descriptor_equivalent: int


def _refuse_overlapping_destinations(request_id: str, desc: np.ndarray) -> None:
    """Raise :class:`~umalloc.errors.DescriptorBoundsError` if two descriptors write a common destination byte
    (the result would depend on the engine's order). O(N log N)."""
    if desc.shape[0] < 2:
        return
    order = np.argsort(desc[:, 1], kind="stable")
    dst, n = desc[order, 1], desc[order, 2]
    bad = np.flatnonzero(dst[1:] < dst[:-1] + n[:-1])
    if bad.size:
        i, j = int(order[bad[0]]), int(order[bad[0] + 1])
        raise DescriptorBoundsError(f"plan {request_id!r}: descriptors {i} and {j} write overlapping destination "
                                    f"bytes at {int(desc[j, 1]):#x}; allowed destinations that do not overlap")


class TransferPlan(_LeaseHolder):
    """One request's transfer: named :class:`IndexVector` s, their bounds-checked descriptors, and the leases.

    Built by :func:`~umalloc.transfer.build.build_plan` (two in-process allocators) or
    :func:`~umalloc.transfer.build.build_send_plan` (sender side of two processes); constructible directly from
    hand-made vectors (the bounds check still runs).

    Args:
        request_id: the request's id (str).
        vectors: the vectors (sequence, or mapping name -> vector) in plan order.
        src_layout, dst_layout: the two sides' layouts (geometry, regions, base addresses).
        src_leased_pages, dst_leased_pages: per end, the physical pages leased on each side for this plan;
            every descriptor must lie inside them.
        src_lease, dst_lease: lease objects released when the plan finishes (``None``: held elsewhere, e.g. by the
            remote receiver's :class:`ReceiverHalf`).

    Attributes:
        total_bytes, num_descriptors, num_runs: counters over every vector.
        per_layer_descriptor_equivalent: descriptors a per-layer (non-envelope) design would post: for every
            whole page ``layers x (2 for MHA K/V, 1 for MLA)`` per region, plus the row descriptors (a per-layer
            design needs those too); for a vector between different TP, page size or head groups, one per (token
            row, head slice piece), what a per-token slice sender (SGLang's ``send_kvcache_slice``) posts.
        state: ``"pending"`` | ``"done"`` | ``"failed"`` | ``"aborted"``; ``error`` keeps the failure.

    Raises:
        DescriptorBoundsError: a descriptor outside the regions, the handable pages, or the leased pages
            (nothing is posted; the plan is not created).
        UmallocValueError: vectors naming unknown ends or duplicate names.

    Complexity: O(pages + rows * blocks + descriptors * log leased pages) at construction; :meth:`descriptors`
    is O(1).

    >>> from umalloc.geometry.region import Region
    >>> from umalloc.geometry.spec import ArenaSpec, EndSpec, LayerSpec
    >>> spec = ArenaSpec((EndSpec("full", (LayerSpec.mha(1, 8),), page_size=2),), arena_bytes=640)
    >>> src, dst = PeerLayout(spec, (Region(1000, 640),), 1000), PeerLayout(spec, (Region(2000, 640),), 2000)
    >>> v = IndexVector("target", "full", "full", torch.tensor([3, 4]), torch.tensor([7, 8]),
    ...                 src.region_group("full"), dst.region_group("full"))
    >>> plan = TransferPlan("r1", [v], src_layout=src, dst_layout=dst, src_leased_pages={"full": [3, 4]},
    ...                     dst_leased_pages={"full": [7, 8]})
    >>> plan.descriptors().tolist(), plan.per_layer_descriptor_equivalent
    ([[1192, 2448, 128]], 4)
    """

    def __init__(self, request_id: str, vectors: Sequence[IndexVector] | Mapping[str, IndexVector], *,
                 src_layout: PeerLayout, dst_layout: PeerLayout,
                 src_leased_pages: Mapping[str, object] | None = None,
                 dst_leased_pages: Mapping[str, object] | None = None,
                 src_lease: LeaseLike | None = None, dst_lease: LeaseLike | None = None) -> None:
        vecs = list(vectors.values()) if isinstance(vectors, Mapping) else list(vectors)
        by_name: dict[str, IndexVector] = {}
        for v in vecs:
            if not isinstance(v, IndexVector):
                raise UmallocValueError(f"vectors: {type(v).__name__}, allowed IndexVector")
            if v.name in by_name:
                raise UmallocValueError(f"vectors: duplicate name {v.name!r}")
            src_layout.end(v.src_end)
            dst_layout.end(v.dst_end)
            by_name[v.name] = v
        self._setup(request_id, by_name, src_layout, dst_layout,
                    unique_pages_by_end(src_leased_pages, "src_leased_pages"),
                    unique_pages_by_end(dst_leased_pages, "dst_leased_pages"), src_lease, dst_lease)

    @classmethod
    def of_checked(cls, request_id: str, vectors: dict[str, IndexVector], src_layout: PeerLayout,
                   dst_layout: PeerLayout, src_leased_pages: dict[str, np.ndarray],
                   dst_leased_pages: dict[str, np.ndarray]) -> TransferPlan:
        """A plan from vectors the caller built on these layouts' ends (names unique, in plan order) and leased
        pages already sorted, unique, read-only int64: the descriptors are still made and bounds-checked, nothing
        is converted again. The builders use it; leases are attached afterwards. Raises as the constructor."""
        plan = object.__new__(cls)
        plan._setup(request_id, vectors, src_layout, dst_layout, src_leased_pages, dst_leased_pages, None, None)
        return plan

    def _setup(self, request_id: str, vectors: dict[str, IndexVector], src_layout: PeerLayout,
               dst_layout: PeerLayout, src_leased: dict[str, np.ndarray], dst_leased: dict[str, np.ndarray],
               src_lease: LeaseLike | None, dst_lease: LeaseLike | None) -> None:
        self.request_id = request_id
        self.src_layout = src_layout
        self.dst_layout = dst_layout
        self.vectors = vectors
        self.src_leased_pages = src_leased
        self.dst_leased_pages = dst_leased
        self.state = PLAN_PENDING
        self.error: BaseException | None = None
        self._leases = ()
        self._split: dict[str, VectorPart] = {}  # vector name -> the part it is submitted in (F10)
        self._arrived: set[str] = set()
        self._by_vector, self.stats_by_vector = self._build_descriptors()
        parts = [d for d in self._by_vector.values() if d.shape[0]]
        all_desc = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else _NO_DESCRIPTORS
        all_desc.setflags(write=False)
        _refuse_overlapping_destinations(request_id, all_desc)
        self._all = all_desc
        self.num_descriptors = int(all_desc.shape[0])
        self.total_bytes = sum(s.bytes for s in self.stats_by_vector.values())
        self.num_runs = sum(s.runs for s in self.stats_by_vector.values())
        self.per_layer_descriptor_equivalent = sum(
            s.per_layer_descriptor_equivalent for s in self.stats_by_vector.values())
        self._leases = (src_lease, dst_lease)

    @property
    def src_lease(self) -> LeaseLike | None:
        return self._leases[0]

    @property
    def dst_lease(self) -> LeaseLike | None:
        return self._leases[1]

    def attach_leases(self, src_lease: LeaseLike | None, dst_lease: LeaseLike | None) -> None:
        """Hand the plan the leases of its pages (the builders lease after the bounds check); they are released
        when the plan finishes. O(1)."""
        self._leases = (src_lease, dst_lease)

    def _build_descriptors(self) -> tuple[dict[str, np.ndarray], dict[str, VectorStats]]:
        by_vector: dict[str, np.ndarray] = {}
        stats: dict[str, VectorStats] = {}
        src_lay, dst_lay = self.src_layout, self.dst_layout
        translator = get_translator("cpu")
        for v in self.vectors.values():
            s_geom, d_geom = src_lay.geometry(v.src_end), dst_lay.geometry(v.dst_end)
            made = vector_descriptors(
                v.name, v.src_pages, v.dst_pages, v.src_rows, v.dst_rows,
                SideBounds(src_lay, s_geom, v.src_group, self.src_leased_pages.get(v.src_end, EMPTY_IDS)),
                SideBounds(dst_lay, d_geom, v.dst_group, self.dst_leased_pages.get(v.dst_end, EMPTY_IDS)),
                translator)
            desc = made.descriptors
            by_vector[v.name] = desc
            blocks, k = s_geom.num_blocks, len(v.src_group.members)
            stats[v.name] = VectorStats(
                pages=v.num_pages, rows=v.num_rows, runs=made.page_runs + made.row_runs,
                descriptors=int(desc.shape[0]),
                bytes=int(desc[:, 2].sum(dtype=np.uint64)) if desc.shape[0] else 0,
                per_layer_descriptor_equivalent=made.slice_pieces or
                v.num_pages * blocks * k + made.row_runs * blocks * k)
        return by_vector, stats

    def descriptors(self) -> np.ndarray:
        """All descriptors, vector by vector in plan order: read-only ``(N, 3)`` uint64
        ``(src_addr, dst_addr, nbytes)``, bounds-checked at construction.

        Raises:
            UmallocValueError: the plan already finished, or it is submitted per vector (:meth:`split`).
            LeaseError: a lease the plan holds is no longer active (expired or released elsewhere) before posting.
        """
        self._check_usable()
        if self._split:
            raise UmallocValueError(f"plan {self.request_id!r} is submitted per vector ({sorted(self._split)} "
                                    "split off): submit its parts, not the whole plan")
        return self._all

    # ---- per-vector submission (F10) ----------------------------------------------------------------------
    def split(self, names: Sequence[str]) -> VectorPart:
        """A part of this plan made of the vectors ``names``, to submit on its own (target now, draft after the
        drafter's pass). The plan completes only once every vector arrived (each part done); a part that fails
        or is aborted fails (aborts) the plan; a vector never submitted fails it at its lease deadline
        (:meth:`check_deadline`). The plan's leases stay with the plan and are released with it. O(descriptors of the
        part).

        Raises:
            UmallocValueError: the plan finished, an unknown name, no names, or a vector already split off.
        """
        if self.state != PLAN_PENDING:
            raise UmallocValueError(f"plan {self.request_id!r} is {self.state}: nothing may be split off")
        names = tuple(names)
        bad = [n for n in names if n not in self.vectors or n in self._split]
        if not names or bad or len(set(names)) != len(names):
            raise UmallocValueError(f"split({list(names)}): allowed distinct vectors of {list(self.vectors)} not "
                                    f"yet split off ({sorted(self._split)} are)")
        part = VectorPart(self, names)
        for n in names:
            self._split[n] = part
        return part

    def missing_vectors(self) -> list[str]:
        """Vectors that have not arrived yet (plan order)."""
        return [n for n in self.vectors if n not in self._arrived]

    def check_deadline(self) -> bool:
        """Fail the plan with :class:`~umalloc.errors.TransferTimeout` naming the vectors that never arrived if a
        lease it holds is past its deadline (F10: never a silent partial transfer). Returns True if this call
        failed it. Call it from the loop that waits for the parts. O(vectors)."""
        if self.state != PLAN_PENDING:
            return False
        for lease in self._leases:
            if lease is not None and (not lease.active or getattr(lease, "expired", False)):
                return self.fail(TransferTimeout(f"plan {self.request_id!r}: vectors {self.missing_vectors()} "
                                                 f"never arrived before the lease deadline ({lease.state})"))
        return False

    def _part_finished(self, part: VectorPart, state: str, exc: BaseException | None) -> None:
        if state == PLAN_DONE:
            self._arrived.update(part.names)
            if len(self._arrived) == len(self.vectors):
                self.complete()
        elif state == PLAN_ABORTED:
            self.abort()
        else:
            self.fail(exc)

    def descriptors_by_vector(self) -> dict[str, np.ndarray]:
        """``{vector name: read-only (n, 3) uint64 descriptors}`` (the rows of :meth:`descriptors`, split).
        Raises as :meth:`descriptors`."""
        self._check_usable()
        return dict(self._by_vector)

    def summary(self) -> dict[str, Any]:
        """Counters as a JSON-safe dict (fixed keys)."""
        return {
            "request_id": self.request_id, "state": self.state, "descriptors": self.num_descriptors,
            "runs": self.num_runs, "bytes": self.total_bytes,
            "per_layer_descriptor_equivalent": self.per_layer_descriptor_equivalent,
            "vectors": {n: vars(s) for n, s in self.stats_by_vector.items()},
        }

    def __repr__(self) -> str:
        return (f"TransferPlan({self.request_id!r}, state={self.state}, vectors={list(self.vectors)}, "
                f"descriptors={self.num_descriptors}, bytes={self.total_bytes})")


class VectorPart(_LeaseHolder):
    """Some vectors of a :class:`TransferPlan`, submitted on their own (:meth:`TransferPlan.split`, F10); a
    :class:`PlanLike` a backend posts like a plan. Its leases are the plan's (a backend's engine hold reaches
    them), but finishing the part does not release them: it reports to the plan, which completes when every
    vector arrived and fails or aborts with any part.

    Attributes:
        plan: the whole plan; names: the part's vector names; vectors, num_descriptors, total_bytes, state,
            error: as on a plan.
    """

    def __init__(self, plan: TransferPlan, names: tuple[str, ...]) -> None:
        self.plan = plan
        self.names = names
        self.request_id = plan.request_id
        self.src_layout, self.dst_layout = plan.src_layout, plan.dst_layout
        self.vectors = {n: plan.vectors[n] for n in names}
        parts = [plan._by_vector[n] for n in names if plan._by_vector[n].shape[0]]
        desc = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else _NO_DESCRIPTORS
        desc.setflags(write=False)
        self._all = desc
        self.num_descriptors = int(desc.shape[0])
        self.total_bytes = sum(plan.stats_by_vector[n].bytes for n in names)
        self.state = PLAN_PENDING
        self.error: BaseException | None = None
        self._leases = ()  # the plan's leases are released with the plan

    @property
    def src_lease(self) -> LeaseLike | None:
        return self.plan.src_lease

    @property
    def dst_lease(self) -> LeaseLike | None:
        return self.plan.dst_lease

    def descriptors(self) -> np.ndarray:
        """The part's descriptors (its vectors' rows, plan order). Raises UmallocValueError if the part or the
        plan finished, LeaseError if a lease of the plan is no longer active."""
        self._check_usable()
        self.plan._check_usable()
        return self._all

    def _finish(self, state: str, exc: BaseException | None = None) -> bool:
        if not super()._finish(state, exc):
            return False
        self.plan._part_finished(self, state, exc)
        return True

    def __repr__(self) -> str:
        return f"VectorPart({self.request_id!r}, {list(self.names)}, state={self.state})"


# ==== receiver half ===========================================================================================


@dataclass(frozen=True, eq=False)
class HalfVector:
    """The receiver's side of one vector.

    Attributes:
        name: vector name; end: the receiver's end.
        kind: ``"rows"`` (token-addressed: pages cover local rows ``[row_lo, row_hi)``) or ``"slots"`` (state).
        row_lo, row_hi: the receiver's local rows filled (``"slots"``: 0 and the slot's tokens).
        pages: read-only int64 physical pages covering ``[row_lo // page_size, ceil(row_hi / page_size))``.
    """

    name: str
    end: str
    kind: str
    row_lo: int
    row_hi: int
    pages: np.ndarray

    def to_dict(self) -> dict:
        return {"end": self.end, "kind": self.kind, "row_lo": self.row_lo, "row_hi": self.row_hi,
                "pages": [int(p) for p in self.pages]}


class ReceiverHalf(_LeaseHolder):
    """What the receiver (decode) publishes for one request: its physical pages per vector (F13), the rows they
    cover, the request length and prefix, and the digest of the :class:`PeerLayout` they refer to.

    Built by :func:`~umalloc.transfer.build.build_receiver_half`, which leases the pages; the receiver releases the lease with
    :meth:`complete` / :meth:`fail` / :meth:`abort` (or a ``with`` block) when every sender has finished.
    :meth:`to_dict` is JSON-safe (physical ids only, never virtual ids); :meth:`from_dict` rebuilds a lease-less
    copy on the sender.

    ``leased`` (per end, the pages the receiver's lease actually pins) travels separately from the vectors, so
    the sender's bounds check compares every destination descriptor with the lease, not with the vectors that
    produced it: a corrupted vector entry is refused (``None``: the vectors' own pages, for hand-built halves).
    """

    def __init__(self, request_id: str, layout_digest: str, seq_len_tokens: int, prefix_tokens: int,
                 dcp_size: int, dcp_rank: int, vectors: Mapping[str, HalfVector], *,
                 leased: Mapping[str, object] | None = None, lease: LeaseLike | None = None) -> None:
        check_tokens(seq_len_tokens, prefix_tokens)
        check_dcp(dcp_size, dcp_rank)
        self.request_id = request_id
        self.layout_digest = layout_digest
        self.seq_len_tokens = seq_len_tokens
        self.prefix_tokens = prefix_tokens
        self.dcp_size = dcp_size
        self.dcp_rank = dcp_rank
        self.vectors = dict(vectors)
        self._leased = self.pages_by_end() if leased is None else unique_pages_by_end(leased, "leased")
        self.state = PLAN_PENDING
        self.error: BaseException | None = None
        self._leases = (lease,)
        self._published: tuple[Any, int] | None = None

    @classmethod
    def of_checked(cls, request_id: str, layout_digest: str, seq_len_tokens: int, prefix_tokens: int,
                   dcp_size: int, dcp_rank: int, vectors: dict[str, HalfVector], leased: dict[str, np.ndarray],
                   lease: LeaseLike | None) -> ReceiverHalf:
        """A half from checked parts (lengths and DCP checked, ``leased`` sorted unique read-only int64, e.g. a
        lease's ``pages``): nothing is converted again. The builder uses it. O(1)."""
        half = object.__new__(cls)
        half.request_id, half.layout_digest = request_id, layout_digest
        half.seq_len_tokens, half.prefix_tokens = seq_len_tokens, prefix_tokens
        half.dcp_size, half.dcp_rank = dcp_size, dcp_rank
        half.vectors, half._leased = vectors, leased
        half.state, half.error, half._leases = PLAN_PENDING, None, (lease,)
        half._published = None
        return half

    def publish(self) -> dict:
        """:meth:`to_dict` for sending to a peer: from now on the peer's engine may write these pages, so the
        lease takes an engine hold (Note [Lease states] in :mod:`umalloc.leases.table`): its deadline, or
        :meth:`fail` / :meth:`abort`, leaves it in doubt — pages pinned — until the sender's terminal report
        (:meth:`complete`) or a confirmed termination (:meth:`settle`). Idempotent. O(pages).

        Raises:
            LeaseError: the half's lease is no longer active (its pages may be reused: do not publish them).
            UmallocValueError: the half already finished.
        """
        self._check_usable()
        lease = self.lease
        if self._published is None and lease is not None and hasattr(lease, "hold_engine"):
            self._published = (lease, lease.hold_engine())
        return self.to_dict()

    def _let_go(self) -> None:
        with _FINISHING:
            published, self._published = self._published, None
        if published is not None:
            lease, generation = published
            lease.unhold_engine(generation)

    def complete(self) -> bool:
        """The sender reported the transfer done (its plan finished): mark done and release the lease (also one
        that went in doubt meanwhile). Returns False if the half had already finished (its lease is still let go
        of if it was in doubt). The publication hold is let go first, so a normal completion never passes
        through in doubt. O(leased pages)."""
        self._let_go()
        return self._finish(PLAN_DONE)

    def settle(self, exc: BaseException | None = None) -> bool:
        """A confirmed termination of everything the peer was sent: the sender's terminal report of a failed transfer,
        the sender process confirmed gone, or this side's backend closed/reset after the engine released its
        registrations. Fails the half if still pending (``exc``), then lets go of the publication hold, so an
        in-doubt lease settles (state ``settled``: the termination was confirmed, not reported done). Returns True if the
        half was still pending. Any thread. O(leased pages)."""
        finished = self._finish(PLAN_FAILED, exc)
        self._let_go()
        return finished

    @property
    def lease(self) -> LeaseLike | None:
        return self._leases[0]

    def leased_pages(self) -> dict[str, np.ndarray]:
        """Per end, the sorted unique pages the receiver's lease pins (what destination descriptors may touch)."""
        return dict(self._leased)

    def pages_by_end(self) -> dict[str, np.ndarray]:
        """Per end, the sorted unique pages of every vector."""
        out: dict[str, list[np.ndarray]] = {}
        for hv in self.vectors.values():
            out.setdefault(hv.end, []).append(hv.pages)
        return {e: np.unique(np.concatenate(p)) for e, p in out.items()}

    def to_dict(self) -> dict:
        """JSON-safe dict (ints, strs, lists)."""
        return {"format": _HALF_FORMAT, "request_id": self.request_id, "layout_digest": self.layout_digest,
                "seq_len_tokens": self.seq_len_tokens, "prefix_tokens": self.prefix_tokens,
                "dcp_size": self.dcp_size, "dcp_rank": self.dcp_rank,
                "vectors": {n: hv.to_dict() for n, hv in self.vectors.items()},
                "leased": {e: [int(p) for p in pages] for e, pages in self._leased.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReceiverHalf:
        """Inverse of :meth:`to_dict` (without the lease). Raises :class:`UmallocValueError` on a malformed dict."""
        try:
            if d["format"] != _HALF_FORMAT:
                raise UmallocValueError(f"ReceiverHalf format {d['format']!r}: allowed {_HALF_FORMAT}")
            vectors = {}
            for name, hv in d["vectors"].items():
                if hv["kind"] not in ("rows", "slots"):
                    raise UmallocValueError(f"half vector {name!r} kind {hv['kind']!r}: allowed 'rows', 'slots'")
                pages = as_ids(list(hv["pages"]), f"half vector {name!r} pages")
                vectors[str(name)] = HalfVector(str(name), str(hv["end"]), hv["kind"], wire_int(hv["row_lo"]),
                                                wire_int(hv["row_hi"]), pages)
            return cls(str(d["request_id"]), str(d["layout_digest"]), wire_int(d["seq_len_tokens"]),
                       wire_int(d["prefix_tokens"]), wire_int(d["dcp_size"]), wire_int(d["dcp_rank"]), vectors,
                       leased={str(e): list(p) for e, p in d["leased"].items()})
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            if isinstance(exc, UmallocValueError):
                raise
            raise UmallocValueError(f"malformed ReceiverHalf dict: {exc!r}") from exc

    def __repr__(self) -> str:
        return (f"ReceiverHalf({self.request_id!r}, state={self.state}, L={self.seq_len_tokens}, "
                f"P={self.prefix_tokens}, vectors={ {n: len(v.pages) for n, v in self.vectors.items()} })")


# ==== what backends use of a plan =============================================================================


@runtime_checkable
class PlanLike(Protocol):
    """What the transfer backends use of a plan (:class:`TransferPlan` implements it; backends accept any
    object that does). Declared once, here; :mod:`umalloc.backends.protocol` re-exports it.

    Members:
        state: ``"pending"`` | ``"done"`` | ``"failed"`` | ``"aborted"``; only a pending plan may be posted.
        vectors: ``{name: vector}``; a backend reads ``vector.src_group`` / ``vector.dst_group`` members'
            ``item_bytes`` (the page size it may post in).
        src_lease, dst_lease: the leases the plan holds (``None`` where held elsewhere); a backend reads
            ``active``, ``state`` and ``expired`` to refuse posting a plan whose pages may be reused (F11).
        num_descriptors, total_bytes: counters (descriptor rows; bytes over every descriptor).
        descriptors(): read-only uint64 ``(N, 3)`` ``(src_addr, dst_addr, nbytes)``, bounds-checked when the plan
            was built; raises if the plan finished or a lease is no longer active.
        complete(), fail(exc), abort(): finish the plan once (idempotent, first wins), releasing its leases.
    """

    state: str
    num_descriptors: int
    total_bytes: int

    @property
    def vectors(self) -> Mapping[str, Any]: ...

    @property
    def src_lease(self) -> LeaseLike | None: ...

    @property
    def dst_lease(self) -> LeaseLike | None: ...

    def descriptors(self) -> np.ndarray: ...

    def complete(self) -> bool: ...

    def fail(self, exc: BaseException | None = None) -> bool: ...

    def abort(self) -> bool: ...


__all__ = ["EMPTY_IDS", "PLAN_ABORTED", "PLAN_DONE", "PLAN_FAILED", "PLAN_PENDING", "HalfVector", "IndexVector",
           "LeaseLike", "PlanLike", "ReceiverHalf", "TransferPlan", "VectorPart", "VectorStats",
           "as_ids", "unique_pages_by_end"]
