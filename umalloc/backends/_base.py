"""What every backend shares: registration bookkeeping, metadata, peers, descriptor checks, handle lifecycle.

Policy:

* Registration (F21): the backend keeps a multiset of the regions callers registered. The engine holds exactly
  ``normalize_regions(distinct registered regions)``: identical regions register once (refcounted), overlapping or
  touching regions of one device and memory kind merge into their union, regions sharing a base but with
  different lengths are kept as two entries of the multiset (so deregistering one leaves the other's bytes
  registered), and regions of different device/kind never fold. ``deregister`` must balance ``register``
  (more deregistrations than registrations raise :class:`~umalloc.errors.RegistrationError`, nothing changes).
  A change that would drop or merge an engine region is refused while a transfer is pending. The caller keeps
  registered memory alive until it is deregistered (engines read and write it by address).
* Metadata is JSON bytes: format tag, backend name, peer id, pid, host, the local
  :class:`~umalloc.transfer.plan.PeerLayout` dict (or ``null``), the engine-registered regions, and engine data. It
  reflects the registrations at the time it is taken: register first, then export.
* ``connect`` refuses a peer of another backend, and a peer whose layout is incompatible
  (``umalloc.transfer.plan.check_compatible``, F22) — before any engine call. Both sides without a layout is allowed
  (descriptor-level use); exactly one side without a layout is refused.
* Descriptors are checked before anything is sent: shape ``(N, 3)``, non-negative integers, ``nbytes > 0``,
  every source range inside one locally registered region and every destination range inside one region the
  peer registered (from its metadata). A bad batch raises :class:`~umalloc.errors.DescriptorBoundsError` (or
  :class:`~umalloc.errors.UmallocValueError`) and changes nothing — not even the plan. A plan (``submit`` or
  ``write_descriptors(plan=...)``) must be pending with its leases active and not past their deadline, and may be
  in flight on one handle at a time across every backend of the process (pending or draining): a second handle
  would outlive the leases the first one's ending releases (F11).
* Handles belong to the backend that made them: ``poll`` / ``wait`` / ``release`` / ``drain`` refuse another
  backend's handle, released or not.
* Engine failures never raise from ``submit``: they fail the handle, and ``poll`` / ``wait`` report them. A
  handle is terminal only when every engine part of it has ended or its deadline passed (F11); then, in the
  caller's thread, its plan ends exactly once (Note [Plan endings]) — but never while a part the engine was
  handed may still read or write the plan's pages (Note [Deadlines and in-flight parts]).

Note [Plan endings]
~~~~~~~~~~~~~~~~~~~
``plan.complete()`` when every part is done; ``plan.fail(exc)`` when a part failed, the peer died, or ``wait``'s
deadline passed (F12: a dead peer releases the held pages); ``plan.abort()`` when a pending handle is released.
Leases are not thread-safe (umalloc/leases.py), so engine threads (Mooncake's status waiter) only record
results; the plan is ended by ``poll`` / ``wait`` / ``release`` / ``progress`` / ``drain`` / ``close`` in the
caller's thread.

Note [Deadlines and in-flight parts]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The rule (DESIGN: compaction gating, F11): while a transfer may still read or write a page, the page stays
leased. ``wait``'s deadline bounds the *caller's wait*, not the engine: no engine here can take back bytes it
was handed (Mooncake has no cancel; its ``TIMEOUT`` status is the engine's slice-age report about a slice that
is still in flight; NIXL can refuse to release a request that is still active). Setting the engine's timeout
below the lease deadline would not help either, since an engine timeout does not mean the engine stopped. So
the ordering is made correct by construction on the backend side:

* at the deadline (or on ``release`` of a pending handle) the handle is failed at once — ``wait`` raises
  :class:`~umalloc.errors.TransferTimeout` on time, never hangs — and every part not yet handed to the engine
  is withdrawn and never posted;
* if the engine may still be working on a part it was handed (``_engine_in_flight``), the handle is
  ``draining``: its plan stays pending and keeps its leases; ``poll`` / ``progress`` / ``drain`` end the plan
  (``fail``, or ``abort`` after a release) in the caller's thread once the engine reports every such part
  ended (completed or failed). Registration changes that would drop engine memory wait for drains too;
* an engine thread posts a queued part only while the plan's leases are active and not past their deadline.

::

    submit ── posted ──────────── wait deadline ─────── engine: last part ended
      |  leases held               | handle failed          | plan.fail(TransferTimeout)
      |                            | leases still held      | leases released, pages reusable

Lease deadlines set by the plan's builder (``deadline_s``) are the allocator's F12 backstop for a peer that
never answers; they are reclaimed by the allocator, not by a backend. Choose them longer than any transfer can
stay in an engine. A receiver learns the outcome from the sender, which should report it once its plan ended
(``drain``), so the receiver's half is not released while bytes may still land in it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from umalloc.backends._handle import TransferHandle
from umalloc.errors import (
    BackendError,
    DescriptorBoundsError,
    IncompatiblePeerError,
    InvariantError,
    LeaseError,
    RegistrationError,
    TransferError,
    TransferTimeout,
    UmallocValueError,
)
from umalloc.geometry.region import Region, normalize_regions

#: Format tag of backend metadata.
METADATA_FORMAT = "umalloc-backend-md/1"

#: Loopback host every backend binds to by default.
LOOPBACK = "127.0.0.1"

#: The handle each plan is in flight on (pending, or draining: its plan not ended yet), across every backend of
#: this process, by ``id(plan)`` (the handle keeps the plan alive, so the id is not reused meanwhile). A plan is in
#: flight on one handle at a time (F11: a second handle, on this backend or another, would outlive the leases
#: that the first one's ending releases). Touched only in callers' threads.
_PLANS_IN_FLIGHT: dict[int, TransferHandle] = {}


@dataclass(frozen=True)
class PeerInfo:
    """A connected peer as seen from its metadata.

    Attributes:
        name: engine peer name (NIXL agent name, Mooncake ``host:rpc_port``, local peer id).
        peer_id: the peer backend's unique id.
        pid: the peer's process id.
        backend: the peer's backend name.
        regions: the peer's engine-registered regions, sorted by base.
        starts, ends: ``uint64`` arrays of the regions' byte ranges (for vectorised bounds checks).
        layout: the peer's layout dict, or ``None``.
        engine: the engine part of its metadata.
    """

    name: str
    peer_id: str
    pid: int
    backend: str
    regions: tuple[Region, ...]
    starts: np.ndarray
    ends: np.ndarray
    layout: dict | None
    engine: dict


def as_descriptors(descriptors: object) -> np.ndarray:
    """Validate a descriptor batch and return it as a C-contiguous ``(N, 3)`` ``uint64`` array.

    Rows are ``(src_addr, dst_addr, nbytes)``. Accepts any integer numpy dtype with non-negative values.

    Raises:
        UmallocValueError: not a 2-D ``(N, 3)`` integer array, a negative value, or an ``nbytes`` of 0.

    >>> as_descriptors(np.array([[4096, 8192, 16]], dtype=np.int64)).dtype
    dtype('uint64')
    """
    if not isinstance(descriptors, np.ndarray):
        raise UmallocValueError(f"descriptors: allowed a numpy (N, 3) uint64 array, got {type(descriptors).__name__}")
    d = descriptors
    if d.ndim != 2 or d.shape[1] != 3:
        raise UmallocValueError(f"descriptors.shape={d.shape}: allowed (N, 3) rows of (src_addr, dst_addr, nbytes)")
    if not np.issubdtype(d.dtype, np.integer):
        raise UmallocValueError(f"descriptors.dtype={d.dtype}: allowed an integer dtype (uint64)")
    if d.dtype != np.uint64:
        if d.size and int(d.min()) < 0:
            raise UmallocValueError("descriptors: allowed non-negative addresses and lengths")
        d = d.astype(np.uint64)
    d = np.ascontiguousarray(d)
    if d.shape[0] and not bool((d[:, 2] > 0).all()):
        row = int(np.flatnonzero(d[:, 2] == 0)[0])
        raise UmallocValueError(f"descriptor row {row}: nbytes=0, allowed > 0")
    return d


def region_ranges(regions: Sequence[Region]) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)`` ``uint64`` arrays of regions already sorted by base."""
    starts = np.array([r.base_ptr for r in regions], dtype=np.uint64)
    ends = np.array([r.end_ptr for r in regions], dtype=np.uint64)
    return starts, ends


def locate_ranges(addrs: np.ndarray, nbytes: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Index of the region containing each ``[addr, addr + nbytes)``, or -1. Regions sorted by base,
    disjoint. O(N log R), vectorised.

    >>> s, e = np.array([100, 200], np.uint64), np.array([150, 300], np.uint64)
    >>> locate_ranges(np.array([100, 140, 250], np.uint64), np.array([50, 20, 50], np.uint64), s, e).tolist()
    [0, -1, 1]
    """
    if starts.size == 0:
        return np.full(addrs.shape[0], -1, dtype=np.int64)
    idx = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
    safe = np.maximum(idx, 0)
    end = ends[safe]
    room = np.where(addrs < end, end - np.minimum(addrs, end), np.uint64(0))
    ok = (idx >= 0) & (addrs >= starts[safe]) & (nbytes <= room)
    return np.where(ok, idx, -1)


def _located(d: np.ndarray, col: int, starts: np.ndarray, ends: np.ndarray, what: str) -> np.ndarray:
    """:func:`locate_ranges` of column ``col`` of a descriptor batch; raise DescriptorBoundsError naming the first
    row outside every region (``what`` says which side and why)."""
    idx = locate_ranges(d[:, col], d[:, 2], starts, ends)
    if d.shape[0] and (idx < 0).any():
        row = int(np.flatnonzero(idx < 0)[0])
        raise DescriptorBoundsError(f"descriptor row {row}: [{int(d[row, col]):#x}, +{int(d[row, 2])}): {what}")
    return idx


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
            return f"the plan's {side} ended ({lease.state})"
        if getattr(lease, "expired", False):
            return f"the plan's {side} is past its deadline"
    return None


class BackendBase:
    """Shared implementation of :class:`~umalloc.backends.TransferBackend`; engines override the ``_engine_*``
    hooks. Not thread-safe: call every method from one thread.

    Args:
        layout: this side's ``PeerLayout`` (or its ``to_dict()``), carried in :meth:`metadata` and checked at
            :meth:`connect`; ``None`` for descriptor-level use.
        host: address the engine binds to (loopback by default).
    """

    name = "base"
    #: True when a target only advances while it is progressed (:meth:`progress`); NIXL without a progress thread.
    needs_progress = False
    #: Live backends per class in this process (engines whose targets need progress use it).
    _live: weakref.WeakSet

    def __init_subclass__(cls, **kw: object) -> None:
        super().__init_subclass__(**kw)
        cls._live = weakref.WeakSet()

    def __init__(self, *, layout: object | None = None, host: str = LOOPBACK) -> None:
        self._layout_obj = layout
        self._layout = self._layout_to_dict(layout)
        self._host = host
        self._peer_id = uuid.uuid4().hex
        self._reg_counts: Counter[Region] = Counter()
        self._engine_regions: dict[Region, object] = {}
        self._local_regions: tuple[Region, ...] = ()
        self._local_starts, self._local_ends = region_ranges(())
        self._peers: dict[str, PeerInfo] = {}
        self._handles: dict[int, TransferHandle] = {}
        #: Failed handles whose engine parts may still touch memory (released or not): their plans end when the
        #: engine confirms (Note [Deadlines and in-flight parts]).
        self._draining: dict[int, TransferHandle] = {}
        #: Every handle this backend made (released ones too): the others are refused, even once released.
        self._made: weakref.WeakSet[TransferHandle] = weakref.WeakSet()
        self._next_id = itertools.count(1)
        self._counts: Counter[str] = Counter()
        self._closed = False
        type(self)._live.add(self)

    # ---- layout ----------------------------------------------------------------------------------------
    @staticmethod
    def _layout_to_dict(layout: object | None) -> dict | None:
        if layout is None:
            return None
        if isinstance(layout, dict):
            return layout
        to_dict = getattr(layout, "to_dict", None)
        if to_dict is None:
            raise UmallocValueError(f"layout={layout!r}: allowed a PeerLayout, its to_dict(), or None")
        return to_dict()

    def set_layout(self, layout: object | None) -> None:
        """Set the layout carried by :meth:`metadata` (affects later ``metadata`` / ``connect`` calls only)."""
        self._check_open()
        self._layout = self._layout_to_dict(layout)
        self._layout_obj = layout

    @property
    def layout(self) -> dict | None:
        """This side's layout dict, or ``None``."""
        return self._layout

    @property
    def peer_id(self) -> str:
        """Unique id of this backend instance (travels in the metadata)."""
        return self._peer_id

    # ---- registration (F21) ----------------------------------------------------------------------------
    def _check_region(self, region: Region) -> None:
        """Engine hook: raise RegistrationError for a region this engine cannot register."""

    def _validate_regions(self, regions: Iterable[Region]) -> list[Region]:
        if isinstance(regions, Region):
            regions = [regions]
        out = list(regions)
        for r in out:
            if not isinstance(r, Region):
                raise RegistrationError(f"region {r!r}: allowed umalloc.geometry.region.Region")
            self._check_region(r)
        return out

    def register(self, regions: Sequence[Region]) -> None:
        """Register byte ranges with the engine (F21 normalisation, see the module policy).

        Args:
            regions: :class:`~umalloc.geometry.region.Region` objects (a single Region is accepted too).

        Raises:
            RegistrationError: not a Region, a kind this engine cannot register, a merge refused while
                transfers are pending, or the engine refused; nothing changed.

        Complexity: O(R log R) over the distinct registered regions plus one engine call per changed region.
        """
        self._check_open()
        regs = self._validate_regions(regions)
        if not regs:
            return
        new_counts = self._reg_counts.copy()
        new_counts.update(regs)
        self._apply_registration(new_counts)
        self._counts["register_calls"] += 1

    def deregister(self, regions: Sequence[Region]) -> None:
        """Undo earlier :meth:`register` calls, region by region (each must have been registered at least as
        many times as it is deregistered).

        Raises:
            RegistrationError: a region registered fewer times than asked (nothing changed), or an engine
                region would be dropped while a transfer is pending.
        """
        self._check_open()
        regs = self._validate_regions(regions)
        need = Counter(regs)
        for r, k in need.items():
            have = self._reg_counts.get(r, 0)
            if have < k:
                raise RegistrationError(f"deregister {r}: registered {have} time(s), asked to deregister {k}")
        self._apply_registration(self._reg_counts - need)
        self._counts["deregister_calls"] += 1

    def _apply_registration(self, new_counts: Counter[Region]) -> None:
        target = {rr.region for rr in normalize_regions(new_counts.keys())}
        current = set(self._engine_regions)
        to_remove = sorted(current - target)
        to_add = sorted(target - current)
        if to_remove and self._num_busy():
            raise RegistrationError(
                f"registration change drops or merges {len(to_remove)} engine region(s) while "
                f"{self._num_busy()} transfer(s) are pending or draining: wait for them first")
        removed: list[tuple[Region, object]] = []
        added: list[Region] = []
        try:
            for r in to_remove:
                tok = self._engine_regions[r]
                self._engine_deregister(r, tok)
                del self._engine_regions[r]
                removed.append((r, tok))
            for r in to_add:
                self._engine_regions[r] = self._engine_register(r)
                added.append(r)
        except Exception as e:
            for r in added:  # roll back to the state before the call
                try:
                    self._engine_deregister(r, self._engine_regions.pop(r))
                except Exception:  # pragma: no cover - best effort
                    pass
            for r, _ in removed:
                try:
                    self._engine_regions[r] = self._engine_register(r)
                except Exception:  # pragma: no cover
                    pass
            self._refresh_local()
            if isinstance(e, RegistrationError):
                raise
            raise RegistrationError(f"{self.name}: engine registration failed: {e}") from e
        self._reg_counts = +new_counts
        self._refresh_local()
        if to_remove or to_add:
            self._on_registration_change()

    def _refresh_local(self) -> None:
        self._local_regions = tuple(sorted(self._engine_regions, key=lambda r: (r.base_ptr, r.nbytes)))
        self._local_starts, self._local_ends = region_ranges(self._local_regions)

    def registered_regions(self) -> list[Region]:
        """The engine-registered (normalised) regions, sorted by base."""
        return list(self._local_regions)

    def registration_counts(self) -> dict[Region, int]:
        """Each region as registered by callers with its outstanding registration count."""
        return dict(self._reg_counts)

    # ---- metadata and peers ----------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """This side's metadata as JSON bytes (see the module policy). Take it after registering.

        Raises:
            BackendError: the backend is closed.
        """
        self._check_open()
        d = {
            "format": METADATA_FORMAT,
            "backend": self.name,
            "peer_id": self._peer_id,
            "pid": os.getpid(),
            "host": self._host,
            "layout": self._layout,
            "regions": [r.to_dict() for r in self._local_regions],
            "engine": self._engine_metadata(),
        }
        return json.dumps(d, separators=(",", ":")).encode()

    @staticmethod
    def parse_metadata(peer_metadata: bytes) -> dict:
        """Decode metadata bytes made by :meth:`metadata`.

        Raises:
            UmallocValueError: not umalloc backend metadata.
        """
        try:
            d = json.loads(bytes(peer_metadata).decode())
        except (TypeError, ValueError) as e:
            raise UmallocValueError(f"peer metadata: not umalloc backend metadata ({e})") from e
        if not isinstance(d, dict) or d.get("format") != METADATA_FORMAT:
            raise UmallocValueError(f"peer metadata: allowed format {METADATA_FORMAT!r}")
        return d

    def _check_layouts(self, remote: dict | None) -> None:
        local = self._layout
        if local is None and remote is None:
            return
        if local is None or remote is None:
            raise IncompatiblePeerError([f"layout: local {'set' if local else 'missing'}, "
                                         f"peer {'set' if remote else 'missing'}"])
        from umalloc.transfer import PeerLayout, check_compatible

        mine = self._layout_obj if isinstance(self._layout_obj, PeerLayout) else PeerLayout.from_dict(local)
        check_compatible(mine, PeerLayout.from_dict(remote))

    def connect(self, peer_metadata: bytes) -> str:
        """Connect to a peer from its :meth:`metadata` bytes; returns the peer name for :meth:`submit`.

        Reconnecting to an already-connected peer refreshes its regions (and engine metadata).

        Raises:
            UmallocValueError: bytes that are not umalloc backend metadata.
            IncompatiblePeerError: another backend kind, or an incompatible layout (F22) — checked before any
                engine call.
            BackendError: the engine refused the peer (unreachable, closed).
        """
        self._check_open()
        d = self.parse_metadata(peer_metadata)
        if d.get("backend") != self.name:
            raise IncompatiblePeerError([f"backend: local {self.name!r}, peer {d.get('backend')!r}"])
        self._check_layouts(d.get("layout"))
        regions = tuple(sorted((Region.from_dict(x) for x in d.get("regions", [])),
                               key=lambda r: (r.base_ptr, r.nbytes)))
        starts, ends = region_ranges(regions)
        name = self._engine_connect(d)
        self._peers[name] = PeerInfo(name=name, peer_id=str(d["peer_id"]), pid=int(d["pid"]),
                                     backend=str(d["backend"]), regions=regions, starts=starts, ends=ends,
                                     layout=d.get("layout"), engine=d.get("engine", {}))
        self._counts["connects"] += 1
        return name

    def disconnect(self, peer: str) -> None:
        """Forget a peer.

        Raises:
            UmallocValueError: unknown peer, or transfers to it still pending (wait or release them first).
        """
        self._check_open()
        info = self._get_peer(peer)
        busy = sum(1 for h in self._handles.values() if h.peer == peer and h.state == "pending")
        if busy:
            raise UmallocValueError(f"disconnect {peer!r}: {busy} transfer(s) still pending")
        try:
            self._engine_disconnect(info)
        finally:
            del self._peers[peer]

    def peers(self) -> list[str]:
        """Connected peer names."""
        return list(self._peers)

    def peer_info(self, peer: str) -> PeerInfo:
        """What the peer's metadata said (regions, layout, pid)."""
        return self._get_peer(peer)

    def peer_layout(self, peer: str) -> object | None:
        """The peer's :class:`~umalloc.transfer.plan.PeerLayout` rebuilt from its metadata (``None`` if it sent none)."""
        info = self._get_peer(peer)
        if info.layout is None:
            return None
        from umalloc.transfer import PeerLayout

        return PeerLayout.from_dict(info.layout)

    def _get_peer(self, peer: str) -> PeerInfo:
        try:
            return self._peers[peer]
        except (KeyError, TypeError):
            raise UmallocValueError(f"peer={peer!r}: allowed a connected peer, one of {sorted(self._peers)}") from None

    # ---- transfers -------------------------------------------------------------------------------------
    def submit(self, plan: object, peer: str) -> TransferHandle:
        """WRITE a plan's descriptors to ``peer``; returns its handle.

        Args:
            plan: a ``TransferPlan`` (anything with ``descriptors()`` -> ``(N, 3)`` uint64 bounds-checked by the
                plan, ``complete()``, ``fail(exc)``, ``abort()`` and optionally ``state``).
            peer: a name returned by :meth:`connect`.

        Raises:
            UmallocValueError: the plan is not pending, or already in flight (pending or draining) on this or
                any other backend of this process (F11), or unknown peer.
            DescriptorBoundsError: a source range not registered here, or a destination range the peer never
                registered; nothing was sent and the plan is untouched.
            LeaseError: a lease the plan holds already ended (``plan.descriptors()`` refuses) or is past its
                deadline (F11).
        """
        self._check_open()
        if not callable(getattr(plan, "descriptors", None)):
            raise UmallocValueError(f"submit: plan={type(plan).__name__}: allowed a TransferPlan (an object with "
                                    "descriptors(), complete(), fail(exc) and abort())")
        self._check_plan(plan, "submit")
        item_bytes = self._plan_item_bytes(plan)
        descriptors = plan.descriptors()
        return self.write_descriptors(descriptors, peer, plan=plan, item_bytes=item_bytes)

    @staticmethod
    def _check_plan(plan: object, what: str) -> None:
        """Refuse a plan that is not pending (UmallocValueError) or whose leases no longer protect its pages
        (LeaseError): nothing may be posted for it (F11)."""
        state = getattr(plan, "state", "pending")
        if state != "pending":
            raise UmallocValueError(f"{what}: plan state={state!r}, allowed 'pending'")
        gone = plan_leases_gone(plan)
        if gone is not None:
            raise LeaseError(f"{what}: {gone}; its pages may be reused, nothing may be posted (F11)")

    @staticmethod
    def _plan_item_bytes(plan: object) -> int | None:
        """The one page size (bytes) every vector of a plan uses on both sides, else ``None``."""
        vectors = getattr(plan, "vectors", None)
        if not vectors:
            return None
        sizes = set()
        for v in vectors.values():
            for group in (getattr(v, "src_group", None), getattr(v, "dst_group", None)):
                for m in getattr(group, "members", ()):
                    sizes.add(int(m.item_bytes))
        return sizes.pop() if len(sizes) == 1 else None

    def write_descriptors(self, descriptors: np.ndarray, peer: str, *, plan: object | None = None,
                          item_bytes: int | None = None) -> TransferHandle:
        """WRITE a raw descriptor batch ``(src_addr, dst_addr, nbytes)`` to ``peer``.

        Args:
            descriptors: ``(N, 3)`` uint64 (see :func:`as_descriptors`); sources local, destinations the peer's.
            peer: a connected peer name.
            plan: ended with the handle (Note [Plan endings]), or ``None``; it must be pending, its leases active
                and not past their deadline, and not in flight on another handle.
            item_bytes: page size in bytes the descriptors are made of (a hint engines may use to post
                per-page prepared lists); ``None`` when unknown.

        Raises:
            UmallocValueError / DescriptorBoundsError: bad batch, unknown peer, ``plan`` not pending, or ``plan``
                already in flight on a handle of any backend of this process (F11); nothing sent.
            LeaseError: a lease of ``plan`` ended or is past its deadline (F11); nothing sent.

        Complexity: O(N log R) checks plus the engine's post.
        """
        self._check_open()
        info = self._get_peer(peer)
        d = as_descriptors(descriptors)
        n = d.shape[0]
        src_idx = _located(d, 0, self._local_starts, self._local_ends,
                           f"source lies outside every region registered on this {self.name} backend "
                           f"({len(self._local_regions)} region(s))")
        dst_idx = _located(d, 1, info.starts, info.ends,
                           f"destination was never registered by peer {peer!r} ({len(info.regions)} region(s) "
                           "in its metadata)")
        if item_bytes is not None and (isinstance(item_bytes, bool) or not isinstance(item_bytes, int)
                                       or item_bytes <= 0):
            raise UmallocValueError(f"item_bytes={item_bytes!r}: allowed a positive int or None")
        if plan is not None:
            self._check_plan(plan, "write_descriptors")
            other = _PLANS_IN_FLIGHT.get(id(plan))
            if other is not None and other.plan is plan:
                mine = self._handles.get(other.handle_id) is other or self._draining.get(other.handle_id) is other
                where = "this" if mine else f"another {other.backend}"
                raise UmallocValueError(
                    f"plan is already in flight on {where} backend (handle {other.handle_id}, "
                    f"{'draining' if other.draining else other.state}): a second handle would outlive its leases "
                    "(F11); wait for, release or drain that handle first")
        total = int(d[:, 2].sum()) if n else 0
        h = TransferHandle(handle_id=next(self._next_id), backend=self.name, peer=peer, num_descriptors=n,
                           total_bytes=total, submitted_at=time.monotonic(), plan=plan)
        self._handles[h.handle_id] = h
        self._made.add(h)
        if plan is not None:
            _PLANS_IN_FLIGHT[id(plan)] = h
        self._counts["handles_submitted"] += 1
        self._counts["descriptors_posted"] += n
        self._counts["bytes_posted"] += total
        if n == 0:
            self._finish(h, "done")
            return h
        try:
            self._engine_post(h, d, info, src_idx, dst_idx, item_bytes)
        except Exception as e:  # engine refused part of it: fail once every posted part has ended
            err = e if isinstance(e, TransferError) else TransferError(f"{self.name}: post to {peer!r} failed: {e}")
            if err is not e:
                err.__cause__ = e
            h.engine["post_error"] = err
        self._counts["engine_parts_posted"] += h.num_parts
        self.poll(h)
        return h

    def poll(self, handle: TransferHandle) -> str:
        """Progress and return the handle's state: ``"pending"``, ``"done"`` or ``"failed"``. Non-blocking.
        Ends the plan when the handle becomes terminal (Note [Plan endings]), or, for a ``draining`` handle,
        once the engine confirms its parts ended (Note [Deadlines and in-flight parts])."""
        h = self._own(handle)
        if h.state != "pending":
            if h.draining:
                self.progress()
            return h.state
        self.progress()
        pending, err = self._engine_poll(h)
        if pending == 0:
            err = err or h.engine.get("post_error")
            if err is not None:
                self._finish(h, "failed", err)
            else:
                self._finish(h, "done")
        return h.state

    #: Busy polls before ``wait`` starts sleeping between polls.
    wait_spin_polls = 64
    #: Longest sleep between polls in ``wait`` (seconds).
    wait_max_sleep_s = 0.0005

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        """Block until the handle is terminal or ``timeout_s`` passed.

        Raises:
            UmallocValueError: ``timeout_s`` not a positive finite number.
            TransferTimeout: deadline passed; parts not yet handed to the engine are withdrawn, engine parts are
                cancelled where the engine can, and the handle is failed. Its plan fails (releasing the leases)
                at once if no part can still touch memory, else when the engine confirms that every part ended:
                until then the handle is ``draining`` and the pages stay leased (Note [Deadlines and in-flight
                parts]; see :meth:`drain`).
            TransferError: the transfer failed (engine error, dead or closed peer); plan failed.
        """
        h = self._own(handle)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
                timeout_s > 0 and math.isfinite(timeout_s)):
            raise UmallocValueError(f"timeout_s={timeout_s!r}: allowed a positive finite number of seconds")
        deadline = time.monotonic() + timeout_s
        spins = 0
        while self.poll(h) == "pending":
            now = time.monotonic()
            if now >= deadline:
                exc = TransferTimeout(f"{self.name}: transfer {h.handle_id} to {h.peer!r} "
                                      f"({h.num_descriptors} descriptors, {h.total_bytes} bytes) not done "
                                      f"after {timeout_s:.3g} s")
                try:
                    self._engine_cancel(h)
                finally:
                    self._finish(h, "failed", exc)
                break
            spins += 1
            if spins > self.wait_spin_polls:
                time.sleep(min(self.wait_max_sleep_s, deadline - now))
        if h.state == "failed":
            assert h.error is not None
            raise h.error

    def release(self, handle: TransferHandle) -> None:
        """Free the handle's engine resources. Idempotent. A pending handle is cancelled first (its plan
        aborted, Note [Plan endings]); if the engine may still be working on one of its parts, the handle keeps
        draining after release and its plan is aborted (and its engine resources freed) when the engine confirms
        (Note [Deadlines and in-flight parts]).

        Raises:
            UmallocValueError: not a handle of this backend (also once released).
        """
        h = self._own(handle)
        if h.released:
            return
        if h.state == "pending":
            try:
                self._engine_cancel(h)
            finally:
                self._finish(h, "failed", TransferError(f"{self.name}: transfer {h.handle_id} released while "
                                                        "pending"), abort=True)
        if h.draining:  # engine resources go when the engine is done with them (_reap_draining)
            h.released = True
            self._handles.pop(h.handle_id, None)
            return
        try:
            self._engine_release(h)
        finally:
            h.released = True
            self._handles.pop(h.handle_id, None)

    def drain(self, handle: TransferHandle, timeout_s: float) -> bool:
        """Block until a terminal handle is no longer ``draining`` (its plan ended, its leases released) or
        ``timeout_s`` passed. Returns True when drained (also for a handle that never drained), False if the
        engine still holds one of its parts. Never raises for the handle's own failure.

        Raises:
            UmallocValueError: ``timeout_s`` not a positive finite number, a pending handle (``wait`` for it
                first), or a handle of another backend (released or not).

        Complexity: polls the engine until drained or the deadline (sleeps between polls).
        """
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
                timeout_s > 0 and math.isfinite(timeout_s)):
            raise UmallocValueError(f"timeout_s={timeout_s!r}: allowed a positive finite number of seconds")
        self._own(handle)
        if not handle.draining:
            if handle.state == "pending":
                raise UmallocValueError(f"drain: handle {handle.handle_id} is pending: wait for it first")
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            self.progress()
            if not handle.draining:
                return True
            now = time.monotonic()
            if now >= deadline:
                return False
            time.sleep(min(self.wait_max_sleep_s * 4, deadline - now))

    def _own(self, handle: TransferHandle) -> TransferHandle:
        """``handle`` if this backend made it (released or not), else UmallocValueError."""
        if not isinstance(handle, TransferHandle):
            raise UmallocValueError(f"handle={handle!r}: allowed a TransferHandle")
        if handle not in self._made:
            raise UmallocValueError(f"handle {handle.handle_id} (of a {handle.backend} backend) does not belong to "
                                    f"this {self.name} backend")
        return handle

    def _finish(self, h: TransferHandle, state: str, error: BaseException | None = None, *,
                abort: bool = False) -> None:
        if h.state != "pending":
            raise InvariantError(f"handle {h.handle_id} finished twice ({h.state} -> {state})")
        h.state = state
        h.error = error
        h.finished_at = time.monotonic()
        if state == "done":
            self._counts["handles_done"] += 1
            self._counts["bytes_done"] += h.total_bytes
        else:
            self._counts["handles_failed"] += 1
        if state != "done" and self._engine_in_flight(h):  # Note [Deadlines and in-flight parts]
            h.draining = True
            h.engine["ending_abort"] = abort
            self._draining[h.handle_id] = h
            self._counts["handles_drained_late"] += 1
            return
        self._end_plan(h, abort)

    def _end_plan(self, h: TransferHandle, abort: bool) -> None:
        plan = h.plan
        if plan is None:
            return
        if _PLANS_IN_FLIGHT.get(id(plan)) is h:
            del _PLANS_IN_FLIGHT[id(plan)]
        if h.state == "done":
            plan.complete()
        elif abort:
            plan.abort()
        else:
            plan.fail(h.error)

    def _reap_draining(self) -> None:
        """End the plans of draining handles whose engine parts all ended (caller's thread)."""
        for hid, h in list(self._draining.items()):
            if self._engine_in_flight(h):
                continue
            del self._draining[hid]
            h.draining = False
            try:
                if h.released:
                    self._engine_release(h)
            finally:
                self._end_plan(h, bool(h.engine.pop("ending_abort", False)))

    def _num_pending(self) -> int:
        return sum(1 for h in self._handles.values() if h.state == "pending")

    def _num_busy(self) -> int:
        """Transfers whose engine parts may touch registered memory: pending plus draining."""
        return self._num_pending() + len(self._draining)

    def draining_handles(self) -> list[TransferHandle]:
        """Failed handles (released or not) whose engine parts may still read or write memory; their plans
        end when the engine confirms (Note [Deadlines and in-flight parts])."""
        return list(self._draining.values())

    def open_handles(self) -> list[TransferHandle]:
        """Handles submitted and not yet released."""
        return list(self._handles.values())

    def progress(self) -> None:
        """Progress every live backend of this kind in this process (NIXL targets need it; no-op elsewhere),
        then end the plans of this backend's draining handles whose engine parts all ended."""
        for b in list(type(self)._live):
            if not b._closed:
                b._engine_progress()
        if self._draining:
            self._reap_draining()

    # ---- observability ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Fixed-schema counters (ints): registered_regions (engine-level), registrations (outstanding
        caller registrations), open_handles, pending_handles, draining_handles (failed, engine parts maybe still
        in flight, plan not ended yet), peers, handles_submitted, handles_done, handles_failed,
        handles_drained_late (failed handles whose plan had to wait for the engine), descriptors_posted,
        bytes_posted, bytes_done, engine_parts_posted, connects."""
        c = self._counts
        return {
            "registered_regions": len(self._engine_regions),
            "registrations": sum(self._reg_counts.values()),
            "open_handles": len(self._handles),
            "pending_handles": self._num_pending(),
            "draining_handles": len(self._draining),
            "peers": len(self._peers),
            "handles_submitted": c["handles_submitted"],
            "handles_done": c["handles_done"],
            "handles_failed": c["handles_failed"],
            "handles_drained_late": c["handles_drained_late"],
            "descriptors_posted": c["descriptors_posted"],
            "bytes_posted": c["bytes_posted"],
            "bytes_done": c["bytes_done"],
            "engine_parts_posted": c["engine_parts_posted"],
            "connects": c["connects"],
        }

    def check_invariants(self) -> None:
        """O(R + H): engine regions are exactly the normalised registrations; handle table consistent;
        a closed backend holds nothing. Raises InvariantError naming the broken invariant."""
        if any(k <= 0 for k in self._reg_counts.values()):
            raise InvariantError("registration counts must be positive")
        want = {rr.region for rr in normalize_regions(self._reg_counts.keys())}
        if want != set(self._engine_regions):
            raise InvariantError(f"engine regions {sorted(self._engine_regions)} != normalised registrations "
                                 f"{sorted(want)}")
        if set(self._local_regions) != set(self._engine_regions):
            raise InvariantError("cached local region ranges out of date")
        for hid, h in self._handles.items():
            if h.handle_id != hid or h.released:
                raise InvariantError(f"handle table entry {hid} inconsistent (released={h.released})")
            if (h.state == "pending") != (h.finished_at is None):
                raise InvariantError(f"handle {hid}: state {h.state} vs finished_at {h.finished_at}")
            if h.draining != (hid in self._draining):
                raise InvariantError(f"handle {hid}: draining={h.draining} but in the draining table: "
                                     f"{hid in self._draining}")
        for h in (*self._handles.values(), *self._draining.values()):
            if h.plan is not None and (h.state == "pending" or h.draining) and \
                    _PLANS_IN_FLIGHT.get(id(h.plan)) is not h:
                raise InvariantError(f"handle {h.handle_id}: its plan is in flight but not recorded as in flight "
                                     "on it")
        for hid, h in self._draining.items():
            if h.handle_id != hid or not h.draining or h.state != "failed":
                raise InvariantError(f"draining handle {hid} inconsistent (state {h.state}, draining={h.draining})")
            if not h.released and self._handles.get(hid) is not h:
                raise InvariantError(f"draining handle {hid} is neither released nor open")
        c = self._counts
        if c["handles_done"] + c["handles_failed"] + self._num_pending() != c["handles_submitted"]:
            raise InvariantError("handles submitted != done + failed + pending")
        if self._closed and (self._handles or self._engine_regions or self._peers):
            raise InvariantError("closed backend still holds handles, regions or peers")
        # (a closed backend may keep draining handles: their engine parts never ended, so their leases stay)

    # ---- lifecycle -------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Return to the just-constructed state without restarting the engine: release every handle (pending
        ones cancelled, their plans aborted), disconnect every peer, deregister everything, drop the layout, zero
        the counters and take a new peer id (metadata taken before the reset no longer names this backend).
        Cheaper than ``close`` + a new backend where engines are slow to stop (Mooncake: about 1 s).

        Raises:
            BackendError: the backend is closed, or a released transfer is still in the engine after
                ``_engine_quiesce``: every handle is released by then, but peers, registrations (the engine may
                still touch that memory) and the layout stay, and the transfer's plan stays pending.
        """
        self._check_open()
        for h in list(self._handles.values()):
            self.release(h)
        if self._draining:
            self._engine_quiesce()
            self.progress()
            if self._draining:
                raise BackendError(f"{self.name}: reset refused: {len(self._draining)} transfer(s) still in the "
                                   "engine (Note [Deadlines and in-flight parts]); drain them first")
        for p in list(self._peers):
            self.disconnect(p)
        if self._reg_counts or self._engine_regions:
            self._apply_registration(Counter())
        self._layout = None
        self._layout_obj = None
        self._counts.clear()
        old = self._peer_id
        self._peer_id = uuid.uuid4().hex
        self._on_reset(old)

    def _on_reset(self, old_peer_id: str) -> None:
        """Engine hook: the peer id changed from ``old_peer_id``."""

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"{self.name} backend is closed")

    def close(self) -> None:
        """Release every handle (cancelling pending ones), forget peers, deregister everything, stop the
        engine. Idempotent."""
        if self._closed:
            return
        try:
            for h in list(self._handles.values()):
                self.release(h)
            if self._draining:  # let the engine finish what it was handed before memory goes
                self._engine_quiesce()
                self.progress()
            for p in list(self._peers.values()):
                try:
                    self._engine_disconnect(p)
                except Exception:  # pragma: no cover - best effort on close
                    pass
            self._peers.clear()
            for r, tok in list(self._engine_regions.items()):
                try:
                    self._engine_deregister(r, tok)
                except Exception:  # pragma: no cover
                    pass
            self._engine_regions.clear()
            self._reg_counts.clear()
            self._refresh_local()
        finally:
            self._closed = True
            type(self)._live.discard(self)
            self._engine_close()
            if self._draining:
                self._reap_draining()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return (f"<{type(self).__name__} {'closed' if self._closed else 'open'} regions={s['registered_regions']} "
                f"peers={s['peers']} open_handles={s['open_handles']}>")

    # ---- engine hooks ----------------------------------------------------------------------------------
    def _engine_register(self, region: Region) -> object:
        raise NotImplementedError

    def _engine_deregister(self, region: Region, token: object) -> None:
        raise NotImplementedError

    def _on_registration_change(self) -> None:
        """Called after the engine region set changed (drop caches keyed by regions)."""

    def _engine_metadata(self) -> dict:
        return {}

    def _engine_connect(self, md: dict) -> str:
        raise NotImplementedError

    def _engine_disconnect(self, peer: PeerInfo) -> None:
        """Forget the peer in the engine."""

    def _engine_post(self, h: TransferHandle, d: np.ndarray, peer: PeerInfo, src_idx: np.ndarray,
                     dst_idx: np.ndarray, item_bytes: int | None) -> None:
        """Post the batch; record parts in ``h.engine`` and ``h.num_parts``. May raise after posting some."""
        raise NotImplementedError

    def _engine_poll(self, h: TransferHandle) -> tuple[int, BaseException | None]:
        """``(parts still pending, first error or None)``; non-blocking."""
        raise NotImplementedError

    def _engine_cancel(self, h: TransferHandle) -> None:
        """Cancel pending parts where the engine can (best effort); parts not yet handed to the engine must never
        be handed to it afterwards."""

    def _engine_in_flight(self, h: TransferHandle) -> int:
        """Parts of ``h`` the engine may still be reading or writing memory for (after ``_engine_cancel``): a
        part handed to the engine that it has not reported ended. Conservative default: the parts
        ``_engine_poll`` still reports pending. Called in the caller's thread."""
        return self._engine_poll(h)[0]

    def _engine_quiesce(self) -> None:
        """Give the engine a bounded time to finish the parts it was handed (``close`` / ``reset``)."""

    def _engine_release(self, h: TransferHandle) -> None:
        """Free engine resources of a terminal handle."""

    def _engine_progress(self) -> None:
        """Drive the engine's target side (NIXL without a progress thread)."""

    def _engine_close(self) -> None:
        """Stop the engine."""
