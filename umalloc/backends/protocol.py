"""What a transfer backend is, and what it needs of a plan: :class:`TransferBackend`, the engine holds on a
plan's leases, and the plan checks every backend runs before it posts anything.

Policy:

* Interfaces are ``typing.Protocol`` s; ``tests/backends/test_backends.py`` asserts every implementation conforms.
* Backends know plans and regions, not allocators: a plan is anything with the
  :class:`~umalloc.transfer.plan.PlanLike` members (declared once, with the plans it describes, in
  :mod:`umalloc.transfer.plan`, which this layer may import; re-exported here), and its leases have the
  :class:`~umalloc.transfer.plan.LeaseLike` members. :func:`admit_plan` is plan admission (Note [Plan
  admission]).
* :func:`admit_plan` requires only ``state``, ``descriptors()`` and the endings; the other plan members are
  read when present: ``dst_layout`` (the peer layout the plan was built for; compared with the peer's layout
  checked at connect, never re-checked) and ``vectors`` (their region groups' page sizes give the
  ``item_bytes`` hint of :func:`plan_item_bytes`).

Note [Plan admission]
~~~~~~~~~~~~~~~~~~~~~
A backend admits a plan in one step, :func:`admit_plan`, before anything is copied or posted: that it is a
plan, pending, its leases still protect its pages (F11), it was built for the peer's layout checked at connect
(``submit`` only; never re-checked), it is not in flight on any handle of this process (one plan, one handle:
a second would outlive the leases, F11), and its descriptors have the ``(N, 3)`` uint64 form (``submit``
only; their values were bounds-checked when the plan was built). A refused plan is untouched and nothing is
sent. What admission does not check is each batch's location in the regions registered now, which every batch
gets, a plan's or a raw one, when it is posted (:func:`umalloc.transfer.descriptors.locate`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, overload, runtime_checkable

import numpy as np

from umalloc.backends.handle import HandleTable, TransferHandle
from umalloc.backends.peers import PeerInfo
from umalloc.errors import IncompatiblePeerError, LeaseError, UmallocValueError
from umalloc.transfer.plan import LeaseLike, PlanLike

if TYPE_CHECKING:
    from umalloc.geometry.region import Region


@runtime_checkable
class TransferBackend(Protocol):
    """What every transfer backend provides.

    Lifecycle: ``register`` the arena regions, exchange ``metadata()`` out of band, ``connect`` to the peer's
    metadata, then ``submit`` plans (or ``write_descriptors`` batches) and ``poll`` / ``wait`` / ``forget``
    their handles (``drain`` a failed one whose engine parts may still move bytes); a receiver publishes its
    halves with ``publish_half``; ``close`` finishes every handle (and settles the halves still held).
    All methods are called from one thread.
    """

    name: str

    def register(self, regions: Sequence[Region]) -> None: ...
    def deregister(self, regions: Sequence[Region]) -> None: ...
    def metadata(self) -> bytes: ...
    def connect(self, peer_metadata: bytes) -> str: ...
    def disconnect(self, peer: str) -> None: ...
    def submit(self, plan: PlanLike, peer: str) -> TransferHandle: ...
    def write_descriptors(self, descriptors: np.ndarray, peer: str, *, plan: PlanLike | None = None,
                          item_bytes: int | None = None) -> TransferHandle: ...
    def poll(self, handle: TransferHandle) -> str: ...
    def wait(self, handle: TransferHandle, timeout_s: float) -> None: ...
    def drain(self, handle: TransferHandle, timeout_s: float) -> bool: ...
    def forget(self, handle: TransferHandle) -> None: ...
    def publish_half(self, half: Any) -> dict: ...
    def progress(self) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def check_invariants(self) -> None: ...
    def close(self) -> None: ...


#: The members :func:`admit_plan` requires to be callable (``descriptors`` only for ``submit``).
_PLAN_METHODS = ("complete", "fail", "abort")


def plan_leases_gone(plan: object | None) -> str | None:
    """Why ``plan``'s leases no longer protect its pages (a lease released, expired, or past its deadline), or
    ``None`` while they do (or for no plan / a plan without leases). Reads lease state only, so an engine thread
    may call it before it hands a queued part to the engine (Note [Deadlines and in-flight parts]). O(1).

    >>> plan_leases_gone(None) is None
    True
    """
    if plan is None:
        return None
    for side in ("src_lease", "dst_lease"):
        lease = getattr(plan, side, None)
        if lease is None:
            continue
        if not lease.active:
            return f"the plan's {side} is {lease.state}"
        if getattr(lease, "expired", False):
            return f"the plan's {side} is past its deadline"
    return None


class EngineHold:
    """The engine holds a backend keeps on a plan's leases while an engine may read or write a part of its
    transfer (Note [Lease states] in :mod:`umalloc.leases.table`): taken before the first part is handed to the
    engine, let go once every part finished (:meth:`drop`). A lease whose deadline passes, or whose plan fails or
    is aborted, while a hold is outstanding goes in doubt instead of freeing its pages (F24), and settles on
    the drop. Leases without ``hold_engine`` (hand-made lease objects) are not held.

    Thread-safe: :meth:`drop` is idempotent and may run on an engine thread (Mooncake's sender) or the caller's.
    """

    __slots__ = ("_held", "_lock")

    def __init__(self, plan: object | None) -> None:
        self._lock = threading.Lock()
        self._held: list[tuple[Any, int]] = []
        if plan is None:
            return
        try:
            for side in ("src_lease", "dst_lease"):
                lease = getattr(plan, side, None)
                hold = getattr(lease, "hold_engine", None)
                if hold is not None:
                    self._held.append((lease, hold()))
        except BaseException:
            self.drop()
            raise

    @property
    def held(self) -> bool:
        return bool(self._held)

    def drop(self) -> None:
        """Let go of every hold (the engine reported every part finished). Idempotent. O(1), or O(pages) for a
        lease that settles."""
        with self._lock:
            held, self._held = self._held, []
        for lease, generation in held:
            lease.unhold_engine(generation)


@overload
def admit_plan(plan: object, what: str, handles: HandleTable, *, peer: PeerInfo) -> np.ndarray: ...
@overload
def admit_plan(plan: object, what: str, handles: HandleTable, *, peer: None = None) -> None: ...
def admit_plan(plan: object, what: str, handles: HandleTable, *, peer: PeerInfo | None = None
               ) -> np.ndarray | None:
    """Plan admission (Note [Plan admission]): the one step every backend runs on a plan before anything is
    copied or posted. ``peer`` given (``submit``): the plan's own descriptors are posted to that peer; ``None``
    (``write_descriptors`` with ``plan=``): the caller's batch is posted and the plan only finishes with it.

    Refuses, in this order and with nothing changed: an object that is not a plan (UmallocValueError naming the
    missing member; ``descriptors()`` is required with ``peer``), a plan that is not pending
    (UmallocValueError), one whose leases no longer protect its pages (LeaseError, F11), one built for another
    peer layout than ``peer``'s (IncompatiblePeerError: compared by identity, then digest; a plan without
    ``dst_layout`` or a peer without a layout passes), one in flight on any handle of this process
    (UmallocValueError, F11), and with ``peer`` a ``descriptors()`` that is not an ``(N, 3)`` uint64 array
    (UmallocValueError; its values were checked when the plan was built).

    Returns:
        with ``peer``, the plan's descriptors; else ``None``. O(1).

    >>> from umalloc.backends.handle import HandleTable
    >>> handles = HandleTable("local", lambda h: 0, lambda h: None, lambda h: (0, None))
    >>> try:
    ...     admit_plan(object(), "write_descriptors", handles)
    ... except UmallocValueError as e:
    ...     print(str(e)[:44])
    write_descriptors: plan=object: allowed a pl
    """
    need = ("descriptors", *_PLAN_METHODS) if peer is not None else _PLAN_METHODS
    missing = [m for m in need if not callable(getattr(plan, m, None))]
    state = getattr(plan, "state", None)
    if not isinstance(state, str):
        missing.append("state")
    if missing:
        raise UmallocValueError(f"{what}: plan={type(plan).__name__}: allowed a plan (missing {', '.join(missing)}; "
                                "a TransferPlan has state, descriptors(), complete(), fail(exc) and abort())")
    if state != "pending":
        raise UmallocValueError(f"{what}: plan state={state!r}, allowed 'pending'")
    gone = plan_leases_gone(plan)
    if gone is not None:
        raise LeaseError(f"{what}: {gone}; its pages may be reused, nothing may be posted (F11)")
    if peer is not None:
        _refuse_other_layout(plan, peer, what)
    handles.refuse_in_flight(plan, what)
    if peer is None:
        return None
    d = plan.descriptors()  # type: ignore[attr-defined]
    if not (isinstance(d, np.ndarray) and d.dtype == np.uint64 and d.ndim == 2 and d.shape[1] == 3):
        raise UmallocValueError(f"{what}: plan.descriptors() returned {type(d).__name__} "
                                f"{getattr(d, 'dtype', '')} {getattr(d, 'shape', '')}: allowed an (N, 3) "
                                "uint64 array")
    return d


def _refuse_other_layout(plan: object, info: PeerInfo, what: str) -> None:
    """IncompatiblePeerError for a plan built for another peer layout than the one checked at connect."""
    mine = getattr(plan, "dst_layout", None)
    theirs = info.checked_layout
    if mine is None or theirs is None or mine is theirs:
        return
    if getattr(mine, "digest", None) != theirs.digest:
        raise IncompatiblePeerError([f"{what}: the plan was built for layout {getattr(mine, 'digest', mine)!r} but "
                                     f"peer {info.name!r} connected with layout {theirs.digest!r}: build it with "
                                     "backend.peer_layout(peer)"])


def plan_item_bytes(plan: object) -> int | None:
    """The one page size (bytes) every vector of a plan uses on both sides, else ``None`` (no ``vectors``, or
    several sizes). O(vectors x region members)."""
    vectors = getattr(plan, "vectors", None)
    if not vectors:
        return None
    sizes = set()
    for v in vectors.values():
        for group in (getattr(v, "src_group", None), getattr(v, "dst_group", None)):
            for m in getattr(group, "members", ()):
                sizes.add(int(m.item_bytes))
    return sizes.pop() if len(sizes) == 1 else None


__all__ = ["EngineHold", "LeaseLike", "PlanLike", "TransferBackend", "admit_plan", "plan_item_bytes",
           "plan_leases_gone"]
