"""What every backend shares: :class:`BackendBase` ties the registry, the peers and the handle table together.

Policy:

* Registration (F21): :mod:`umalloc.backends.registry` (multiset, normalisation, addressable devices only).
* Metadata, peers and the connect-time layout check (F22): :mod:`umalloc.backends.peers`. ``connect`` validates
  the whole metadata, refuses a peer of another backend and a peer whose layout is incompatible — all before any
  engine call — and records the peer's checked layout: a plan submitted to that peer is matched against it by
  identity (or digest), never checked again.
* Descriptors (:mod:`umalloc.transfer.descriptors`) are checked before anything is sent: a raw batch
  (``write_descriptors``) is validated once (shape ``(N, 3)``, non-negative integers, ``nbytes > 0``); a plan's
  batch was validated when the plan was built. Every batch, raw or planned, is located against the regions
  registered *now*: every source range inside one locally registered region, every destination range inside
  one region the peer registered (from its metadata). A bad batch raises
  :class:`~umalloc.errors.DescriptorBoundsError` (or :class:`~umalloc.errors.UmallocValueError`) and changes
  nothing — not even the plan.
* Bounded batches (Note [Bounded batches] in :mod:`umalloc.transfer.descriptors`): a located batch is cut into
  chunks of at most ``max_batch_descriptors`` descriptors and ``max_batch_bytes`` bytes (defaults 2048 and 1 GiB,
  set per backend at construction), each handed to the engine as its own submission; ``handle.num_parts``
  counts the engine submissions and the ``engine_parts_posted`` stat sums them.
* A plan (``submit`` or ``write_descriptors(plan=...)``) must be a plan
  (:class:`~umalloc.backends.protocol.PlanLike`), pending, with its leases active and not past their deadline,
  and may be in flight on one handle at a time across every backend of the process (pending or draining): a
  second handle would outlive the leases the first one's finishing releases (F11). Every one of these is checked
  before a byte is copied or a handle is made.
* Handles (:mod:`umalloc.backends.handle`) belong to the backend that made them: ``poll`` / ``wait`` /
  ``forget`` / ``drain`` refuse another backend's handle, forgotten or not.
* Engine failures never raise from ``submit``: they fail the handle, and ``poll`` / ``wait`` report them. A
  handle is terminal (``done`` / ``failed``) only when every engine part of it has finished (F11; a deadline
  leaves it ``in_doubt``); then, in the caller's thread, its plan finishes exactly once (Note [Plan finishing]) —
  but never while a part the engine was handed may still read or write the plan's pages (Note [Deadlines and
  in-flight parts]).

The plan-finishing rules (Note [Plan finishing], Note [Deadlines and in-flight parts]) live with the handles'
lifecycle in :mod:`umalloc.backends.handle`.
"""

from __future__ import annotations

import os
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Sequence

import numpy as np

from umalloc.backends.handle import HandleTable, TransferHandle, check_timeout
from umalloc.backends.peers import (
    LOOPBACK,
    PeerInfo,
    check_layouts,
    encode_metadata,
    layout_pair,
    parse_metadata,
    peer_info,
)
from umalloc.backends.protocol import EngineHold, PlanLike, admit_plan, plan_item_bytes
from umalloc.backends.published import PublishedHalves, check_half_registered
from umalloc.backends.registry import Registry, validate_regions
from umalloc.errors import (
    BackendError,
    IncompatiblePeerError,
    InvariantError,
    PeerDiedError,
    TransferError,
    TransferTimeout,
    UmallocValueError,
)
from umalloc.geometry.region import Region
from umalloc.transfer import PeerLayout
from umalloc.transfer.descriptors import (
    MAX_BATCH_BYTES,
    MAX_BATCH_DESCRIPTORS,
    Chunk,
    as_descriptors,
    check_batch_limits,
    chunk_located,
    locate,
)
from umalloc.transfer.plan import ReceiverHalf


class BackendBase:
    """Shared implementation of :class:`~umalloc.backends.TransferBackend`; engines override the ``_engine_*``
    hooks. Not thread-safe: call every method from one thread.

    Args:
        layout: this side's ``PeerLayout`` (or its ``to_dict()``), carried in :meth:`metadata` and checked at
            :meth:`connect`; ``None`` for descriptor-level use.
        host: address the engine binds to (loopback by default).
        max_batch_descriptors: most descriptors in one engine submission (default 2048, Note [Bounded batches]
            in :mod:`umalloc.transfer.descriptors`).
        max_batch_bytes: most bytes in one engine submission (default 1 GiB); a longer descriptor is cut into
            contiguous pieces of this size.

    Raises:
        UmallocValueError: a malformed ``layout``, or a batch cap that is not an int in ``[1, 2**63)``; checked
            before any engine starts.
    """

    name = "base"
    #: True when a target only advances while it is progressed (:meth:`progress`); NIXL without a progress thread.
    needs_progress = False
    #: True when no peer can write memory this engine no longer has registered (:meth:`close` / :meth:`reset`
    #: then settle the halves of :meth:`publish_half`); False where a peer's write may still land there.
    fences_peer_writes = False
    #: Live backends per class in this process (engines whose targets need progress use it).
    _live: weakref.WeakSet

    def __init_subclass__(cls, **kw: object) -> None:
        super().__init_subclass__(**kw)
        cls._live = weakref.WeakSet()

    def __init__(self, *, layout: object | None = None, host: str = LOOPBACK,
                 max_batch_descriptors: int = MAX_BATCH_DESCRIPTORS, max_batch_bytes: int = MAX_BATCH_BYTES) -> None:
        check_batch_limits(max_batch_descriptors, max_batch_bytes)
        self._layout, self._layout_obj = layout_pair(layout)
        self._max_batch = (int(max_batch_descriptors), int(max_batch_bytes))
        self._host = host
        self._peer_id = uuid.uuid4().hex
        self._reg = Registry(self._engine_register, self._engine_deregister)
        self._peers: dict[str, PeerInfo] = {}
        self._ht = HandleTable(self.name, self._engine_in_flight, self._engine_free, self._engine_poll)
        self._counts: Counter[str] = Counter()  # connects, register_calls, deregister_calls
        self._halves = PublishedHalves()
        self._closed = False
        type(self)._live.add(self)

    # ---- layout ----------------------------------------------------------------------------------------
    def set_layout(self, layout: object | None) -> None:
        """Set the layout carried by :meth:`metadata` (affects later ``metadata`` / ``connect`` calls only).

        Raises:
            BackendError: the backend is closed.
            UmallocValueError: a malformed layout (nothing changed).
        """
        self._check_open()
        self._layout, self._layout_obj = layout_pair(layout)

    @property
    def max_batch_descriptors(self) -> int:
        """Most descriptors in one engine submission, set at construction (Note [Bounded batches] in
        :mod:`umalloc.transfer.descriptors`)."""
        return self._max_batch[0]

    @property
    def max_batch_bytes(self) -> int:
        """Most bytes in one engine submission, set at construction (Note [Bounded batches])."""
        return self._max_batch[1]

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

    def register(self, regions: Sequence[Region]) -> None:
        """Register byte ranges with the engine (F21 normalisation, :mod:`umalloc.backends.registry`).

        Args:
            regions: :class:`~umalloc.geometry.region.Region` objects (a single Region is accepted too).

        Raises:
            RegistrationError: not a Region, memory no engine can address (a ``meta`` device, address 0), a kind
                this engine cannot register, a merge refused while transfers are pending, or the engine refused;
                nothing changed.

        Complexity: O(R log R) over the distinct registered regions plus one engine call per changed region.
        """
        self._check_open()
        regs = validate_regions(regions, self._check_region)
        if not regs:
            return
        self._apply(self._reg.added(regs))
        self._counts["register_calls"] += 1

    def deregister(self, regions: Sequence[Region]) -> None:
        """Undo earlier :meth:`register` calls, region by region (each must have been registered at least as
        many times as it is deregistered).

        Raises:
            RegistrationError: a region registered fewer times than asked (nothing changed), or an engine
                region would be dropped while a transfer is pending.
        """
        self._check_open()
        regs = validate_regions(regions, self._check_region)
        self._apply(self._reg.removed(regs))
        self._counts["deregister_calls"] += 1

    def _apply(self, new_counts: Counter[Region]) -> None:
        if self._reg.apply(new_counts, self._ht.num_busy(), self.name):
            self._on_registration_change()

    def registered_regions(self) -> list[Region]:
        """The engine-registered (normalised) regions, sorted by base."""
        return list(self._reg.regions)

    def registration_counts(self) -> dict[Region, int]:
        """Each region as registered by callers with its outstanding registration count."""
        return dict(self._reg.counts)

    # ---- metadata and peers ----------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """This side's metadata as JSON bytes (:mod:`umalloc.backends.peers`). Take it after registering.

        Raises:
            BackendError: the backend is closed.
        """
        self._check_open()
        return encode_metadata(backend=self.name, peer_id=self._peer_id, pid=os.getpid(), host=self._host,
                               layout=self._layout, regions=self._reg.regions, engine=self._engine_metadata())

    def _check_engine_metadata(self, engine: dict) -> None:
        """Engine hook: raise UmallocValueError for engine metadata this engine cannot connect to (called before
        any engine call)."""

    def connect(self, peer_metadata: bytes) -> str:
        """Connect to a peer from its :meth:`metadata` bytes; returns the peer name for :meth:`submit`.

        Reconnecting to an already-connected peer refreshes its regions (and engine metadata). Every field is
        validated and the layouts are checked (once) before any engine call.

        Raises:
            UmallocValueError: bytes that are not umalloc backend metadata, or a field missing or mistyped.
            IncompatiblePeerError: another backend kind, or an incompatible layout (F22).
            BackendError: the engine refused the peer (unreachable, closed).
        """
        self._check_open()
        d = parse_metadata(peer_metadata)
        if d["backend"] != self.name:
            raise IncompatiblePeerError([f"backend: local {self.name!r}, peer {d['backend']!r}"])
        self._check_engine_metadata(d["engine"])
        checked = check_layouts(self._layout_obj, d["layout"])
        name = self._engine_connect(d)
        self._peers[name] = peer_info(name, d, checked)
        self._counts["connects"] += 1
        return name

    def disconnect(self, peer: str) -> None:
        """Forget a peer.

        Raises:
            UmallocValueError: unknown peer, or transfers to it still pending (wait for or forget them first).
        """
        self._check_open()
        info = self._get_peer(peer)
        busy = sum(1 for h in self._ht.open.values() if h.peer == peer and h.state == "pending")
        if busy:
            raise UmallocValueError(f"disconnect {peer!r}: {busy} transfer(s) still pending")
        try:
            self._engine_disconnect(info)
        finally:
            del self._peers[peer]

    def peer_state(self, peer: str) -> str:
        """What this side knows of a connected peer's liveness (F12), cheapest evidence first:

        * ``"gone"``: its process is confirmed gone (its metadata names a process on this host — loopback —
          and no such process exists any more): its engine can read or write nothing more;
        * ``"unreachable"``: the engine reports the peer down (Mooncake: a failed probe; NIXL: the agent said
          goodbye or closed) but the process may live — what it may still write is in doubt;
        * ``"alive"`` otherwise.

        Raises:
            UmallocValueError: unknown peer.

        Complexity: one ``kill(pid, 0)`` plus the engine's check (Mooncake: a probe bounded by 1 s).
        """
        info = self._get_peer(peer)
        if info.host in (LOOPBACK, "localhost") and info.pid != os.getpid():
            try:
                os.kill(info.pid, 0)
            except ProcessLookupError:
                return "gone"
            except PermissionError:
                pass
        return "alive" if self._engine_peer_alive(info) else "unreachable"

    def fail_half_if_peer_died(self, half: object, peer: str) -> str:
        """Receiver side: fail ``half`` (a :class:`~umalloc.transfer.plan.ReceiverHalf` published to ``peer``)
        with :class:`~umalloc.errors.PeerDiedError` if :meth:`peer_state` says the sender is not alive. A
        ``"gone"`` sender can write nothing more, so the half settles (its pages come free); an
        ``"unreachable"`` one leaves it in doubt (pages pinned) until a confirmed end. Returns the peer state.
        Call it from the receiver's scheduler loop (or any thread) while waiting for a sender.

        Raises:
            UmallocValueError: unknown peer.
        """
        state = self.peer_state(peer)
        if state != "alive":
            exc = PeerDiedError(f"{self.name}: sender {peer!r} is {state}")
            if state == "gone":
                half.settle(exc)  # type: ignore[attr-defined]
            else:
                half.fail(exc)  # type: ignore[attr-defined]
        return state

    def publish_half(self, half: object, sender: str | None = None) -> dict:
        """Receiver side: ``half.publish()`` for senders that write through this backend into memory registered
        here (a :class:`~umalloc.transfer.plan.ReceiverHalf`), keeping the half so that :meth:`close` and
        :meth:`reset` settle it, if it is still held then, once the engine released every registration — where
        that stops every peer's writes (:attr:`fences_peer_writes`: ``local``, ``mooncake``; not ``nixl``, whose
        shared-memory WRITEs land in deregistered memory), see :mod:`umalloc.backends.published`. Otherwise only
        the sender's report (``half.complete()`` / ``half.settle()``) or :meth:`fail_half_if_peer_died` finishes it.
        O(halves held).

        ``sender``: the connected peer that writes the half (optional): :meth:`poll_half` and :meth:`wait_half`
        then check its liveness on every call and fail the half with :class:`~umalloc.errors.PeerDiedError` once
        it is not alive (F12), so a receiver that only waits learns of a dead sender.

        Raises:
            BackendError: the backend is closed.
            UmallocValueError: ``half`` is not a ReceiverHalf, or ``sender`` not a connected peer.
            RegistrationError: the half's pages lie outside the memory registered here, or this backend has no
                layout to place them with (:meth:`set_layout`), or the half names another layout (nothing kept).
            LeaseError, UmallocValueError: the half's lease is no longer active or the half already finished (nothing kept).
        """
        self._check_open()
        if not isinstance(half, ReceiverHalf):
            raise UmallocValueError(f"publish_half: half={type(half).__name__}; allowed a ReceiverHalf "
                                    f"(build_receiver_half)")
        if sender is not None:
            self._get_peer(sender)
        check_half_registered(half, self._layout_obj, self._reg.regions, self.name)
        return self._halves.publish(half, sender)

    # Note [Published half liveness]: a receiver that names the sender at publish_half gets its liveness
    # checked on every poll_half / wait_half (peer_state: the process gone -> the half settles; the engine
    # reports it down -> the half fails, in doubt), so an engine that only waits is told PeerDiedError (F12).
    def poll_half(self, half: object) -> str:
        """Receiver side: the state of a half published here (``"pending"``, ``"done"``, ``"failed"``) after a
        liveness check of the sender named at :meth:`publish_half` (Note [Published half liveness]): a sender
        that is not alive fails the half (``"gone"``: it settles, its pages come free; ``"unreachable"``: in
        doubt) and :class:`~umalloc.errors.PeerDiedError` is raised. Progresses the engine first.

        Raises: UmallocValueError: not a ReceiverHalf. PeerDiedError: the sender died (the half has finished).
        Complexity: one :meth:`peer_state` (Mooncake: a probe bounded by 1 s) while the half is pending.
        """
        self._check_open()
        if not isinstance(half, ReceiverHalf):
            raise UmallocValueError(f"poll_half: half={type(half).__name__}; allowed a ReceiverHalf published here")
        sender = self._halves.sender_of(half)
        self.progress()
        if half.state == "pending" and sender is not None and sender in self._peers:  # type: ignore[attr-defined]
            self.fail_half_if_peer_died(half, sender)
        if isinstance(half.error, PeerDiedError):  # type: ignore[attr-defined]
            raise half.error  # type: ignore[attr-defined]
        return half.state  # type: ignore[attr-defined, no-any-return]

    def wait_half(self, half: object, timeout_s: float) -> str:
        """Receiver side: block until a half published here finished (the sender's report: ``half.complete()`` /
        ``settle()`` from any thread) or ``timeout_s`` passed, checking the sender's liveness on every poll
        (:meth:`poll_half`). Returns the half's terminal state.

        Raises:
            UmallocValueError: not a ReceiverHalf, or a bad ``timeout_s``. PeerDiedError: the sender died.
            TransferTimeout: still pending at the deadline; the half is left as it is (a timeout proves nothing:
                the sender may still write, F24).
        """
        check_timeout(timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.poll_half(half) == "pending":
            now = time.monotonic()
            if now >= deadline:
                raise TransferTimeout(f"{self.name}: receiver half {half.request_id!r} still pending after "  # type: ignore[attr-defined]
                                      f"{timeout_s:.3g} s (left pending: its sender may still write)")
            time.sleep(min(self.wait_max_sleep_s * 4, deadline - now))
        return half.state  # type: ignore[attr-defined, no-any-return]

    def published_halves(self) -> int:
        """Halves published through :meth:`publish_half` that may still be written (pending, or in doubt). O(n)."""
        return self._halves.held()

    def peers(self) -> list[str]:
        """Connected peer names."""
        return list(self._peers)

    def peer_info(self, peer: str) -> PeerInfo:
        """What the peer's metadata said (regions, layout, pid)."""
        return self._get_peer(peer)

    def peer_layout(self, peer: str) -> PeerLayout | None:
        """The peer's :class:`~umalloc.transfer.plan.PeerLayout` as checked at connect (the same object every
        call; ``None`` if it sent none). Build plans for the peer with it. O(1)."""
        return self._get_peer(peer).checked_layout

    def _get_peer(self, peer: str) -> PeerInfo:
        try:
            return self._peers[peer]
        except (KeyError, TypeError):
            raise UmallocValueError(f"peer={peer!r}: allowed a connected peer, one of {sorted(self._peers)}") from None

    # ---- transfers -------------------------------------------------------------------------------------
    def submit(self, plan: PlanLike, peer: str) -> TransferHandle:
        """WRITE a plan's descriptors to ``peer``; returns its handle.

        Args:
            plan: a :class:`~umalloc.backends.protocol.PlanLike` (a ``TransferPlan``), built for the peer's
                layout (:meth:`peer_layout`); its descriptors were validated when it was built.
            peer: a name returned by :meth:`connect`.

        Raises (plan admission: Note [Plan admission] in :mod:`umalloc.backends.protocol`):
            UmallocValueError: unknown peer, not a plan (or ``descriptors()`` not an ``(N, 3)`` uint64 array), the
                plan is not pending, or already in flight (pending or draining) on this or any other backend of
                this process (F11).
            IncompatiblePeerError: the plan was built for another layout than the peer's.
            DescriptorBoundsError: a source range not registered here, or a destination range the peer never
                registered; nothing was sent and the plan is untouched.
            LeaseError: a lease the plan holds is no longer active or is past its deadline (F11).
        """
        self._check_open()
        info = self._get_peer(peer)
        d = admit_plan(plan, "submit", self._ht, peer=info)
        return self._post(d, info, peer, plan, plan_item_bytes(plan))

    def write_descriptors(self, descriptors: np.ndarray, peer: str, *, plan: PlanLike | None = None,
                          item_bytes: int | None = None) -> TransferHandle:
        """WRITE a raw descriptor batch ``(src_addr, dst_addr, nbytes)`` to ``peer``.

        Args:
            descriptors: ``(N, 3)`` uint64 (see :func:`~umalloc.transfer.descriptors.as_descriptors`); sources
                local, destinations the peer's.
            peer: a connected peer name.
            plan: finished with the handle (Note [Plan finishing]), or ``None``; it must be a plan (``state``,
                ``complete()``, ``fail(exc)``, ``abort()``), pending, its leases active and not past their
                deadline, and not in flight on another handle.
            item_bytes: page size in bytes the descriptors are made of (a hint engines may use to post
                per-page prepared lists); ``None`` when unknown.

        Raises:
            UmallocValueError / DescriptorBoundsError: bad batch, unknown peer, ``plan`` not a plan or not
                pending, or ``plan`` already in flight on a handle of any backend of this process (F11); nothing
                sent, no handle made.
            LeaseError: a lease of ``plan`` is no longer active or is past its deadline (F11); nothing sent.

        Complexity: O(N log R) checks plus the engine's post.
        """
        self._check_open()
        info = self._get_peer(peer)
        d = as_descriptors(descriptors)
        if item_bytes is not None and (isinstance(item_bytes, bool) or not isinstance(item_bytes, int)
                                       or item_bytes <= 0):
            raise UmallocValueError(f"item_bytes={item_bytes!r}: allowed a positive int or None")
        if plan is not None:
            admit_plan(plan, "write_descriptors", self._ht)
        return self._post(d, info, peer, plan, item_bytes)

    def _post(self, d: np.ndarray, info: PeerInfo, peer: str, plan: PlanLike | None,
              item_bytes: int | None) -> TransferHandle:
        """Locate a validated batch against the regions registered now, cut it into chunks (Note [Bounded
        batches]), make the handle, hand the chunks to the engine."""
        reg = self._reg
        src_idx = locate(d, 0, reg.starts, reg.ends,
                         f"source lies outside every region registered on this {self.name} backend "
                         f"({len(reg.regions)} region(s))")
        dst_idx = locate(d, 1, info.starts, info.ends,
                         f"destination was never registered by peer {peer!r} ({len(info.regions)} region(s) "
                         "in its metadata)")
        self._engine_check_peer_metadata(info)
        n = d.shape[0]
        total = int(d[:, 2].sum()) if n else 0
        chunks = chunk_located(d, src_idx, dst_idx, *self._max_batch, self._reg, info)
        h = self._ht.new(peer, n, total, plan)
        if n == 0:
            self._ht.finish(h, "done")
            return h
        try:
            # before any part reaches the engine: a deadline or a plan finishing from now on leaves the plan's
            # leases in doubt until the engine lets go (Note [Lease states] in umalloc.leases.table, F24)
            h.engine["hold"] = EngineHold(plan)
            self._engine_post(h, chunks, info, item_bytes)
        except Exception as e:  # engine refused part of it: fail once every posted part has finished
            err = e if isinstance(e, TransferError) else TransferError(f"{self.name}: post to {peer!r} failed: {e}")
            if err is not e:
                err.__cause__ = e
            h.engine["post_error"] = err
        self._ht.counts["engine_parts_posted"] += h.num_parts
        self.poll(h)
        return h

    def poll(self, handle: TransferHandle) -> str:
        """Progress and return the handle's state: ``"pending"``, ``"in_doubt"`` (``wait`` timed out while the
        engine held a part), ``"done"`` or ``"failed"``. Non-blocking. Finishes the plan when the handle becomes
        terminal (Note [Plan finishing]), or, for a ``draining`` handle, once the engine confirms its parts finished
        (Note [Deadlines and in-flight parts]).

        Raises:
            UmallocValueError: not a handle of this backend (also once forgotten).
        """
        h = self._ht.own(handle)
        if h.state != "pending":
            if h.draining:
                self.progress()
            return h.state
        self.progress()
        pending, err = self._engine_poll(h)
        if pending == 0 and h.state == "pending":
            err = err or h.engine.get("post_error")
            if err is not None:
                self._ht.finish(h, "failed", err)
            else:
                self._ht.finish(h, "done")
        return h.state

    #: Busy polls before ``wait`` starts sleeping between polls.
    wait_spin_polls = 64
    #: Longest sleep between polls in ``wait`` (seconds).
    wait_max_sleep_s = 0.0005

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        """Block until the handle's outcome is known (``done`` or ``failed``) or ``timeout_s`` passed. Also
        waits out an ``in_doubt`` handle (an earlier deadline): it returns once the engine reported every part
        done.

        Raises:
            UmallocValueError: ``timeout_s`` not a positive finite number, or not a handle of this backend.
            TransferTimeout: deadline passed: the outcome is not known (F24). Parts not yet handed to the engine
                are withdrawn (never posted); parts the engine holds are left to finish — no engine here can take
                back what it was handed, and NIXL's release of a request stalled on its receiver does not stop
                the bytes. If the engine holds a part the handle is ``in_doubt`` (draining): its plan stays
                pending with its leases (pages pinned, not reusable) until the engine reports every part finished;
                then the handle and the plan finish as the engine says (``done``: ``plan.complete()``; a failure:
                ``plan.fail(exc)``), in the caller's thread (:meth:`poll`, :meth:`progress`, :meth:`drain`).
                Else the handle fails and the plan fails with the timeout (Note [Deadlines and in-flight
                parts]).
            TransferError: the transfer failed (engine error, dead or closed peer); plan failed.
        """
        h = self._ht.own(handle)
        check_timeout(timeout_s)
        self._ht.wait(h, timeout_s, self.poll, self._engine_withdraw, self.wait_spin_polls, self.wait_max_sleep_s)

    def forget(self, handle: TransferHandle) -> None:
        """Free the handle's engine resources. Idempotent. A pending handle is cancelled first (its plan
        aborted, Note [Plan finishing]); if the engine may still be working on one of its parts, the handle keeps
        draining after ``forget`` and its plan is aborted (and its engine resources freed) when the engine confirms
        (Note [Deadlines and in-flight parts]).

        Raises:
            UmallocValueError: not a handle of this backend (also once forgotten).
        """
        h = self._ht.own(handle)
        if h.forgotten:
            return
        if h.state == "pending":
            try:
                self._engine_cancel(h)
            finally:
                self._ht.finish(h, "failed", TransferError(f"{self.name}: transfer {h.handle_id} forgotten while "
                                                           "pending"), abort=True)
        self._ht.forget(h)

    def drain(self, handle: TransferHandle, timeout_s: float) -> bool:
        """Block until a terminal handle is no longer ``draining`` (its plan finished, its leases released) or
        ``timeout_s`` passed. Returns True when drained (also for a handle that never drained), False if the
        engine still holds one of its parts. Never raises for the handle's own failure.

        Raises:
            UmallocValueError: ``timeout_s`` not a positive finite number, a pending handle (``wait`` for it
                first), or a handle of another backend (forgotten or not).

        Complexity: polls the engine until drained or the deadline (sleeps between polls).
        """
        check_timeout(timeout_s)
        return self._ht.drain(self._ht.own(handle), timeout_s, self.progress, self.wait_max_sleep_s * 4)

    def draining_handles(self) -> list[TransferHandle]:
        """Failed handles (forgotten or not) whose engine parts may still read or write memory; their plans
        finish when the engine confirms (Note [Deadlines and in-flight parts])."""
        return list(self._ht.draining.values())

    def open_handles(self) -> list[TransferHandle]:
        """Handles submitted and not yet forgotten."""
        return list(self._ht.open.values())

    def progress(self) -> None:
        """Progress every live backend of this kind in this process (NIXL targets need it; no-op elsewhere),
        then finish the plans of this backend's draining handles whose engine parts all finished."""
        for b in list(type(self)._live):
            if not b._closed:
                b._engine_progress()
        if self._ht.draining:
            self._ht.reap()

    # ---- observability ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Fixed-schema counters (ints): registered_regions (engine-level), registrations (outstanding
        caller registrations), open_handles, pending_handles, draining_handles (failed or in doubt, engine parts
        maybe still in flight, plan not finished yet), in_doubt_handles (``wait`` timed out while the engine held a
        part: outcome not known yet, F24), peers, handles_submitted, handles_done, handles_failed,
        handles_drained_late (failed handles whose plan had to wait for the engine), descriptors_posted,
        bytes_posted, bytes_done, engine_parts_posted, connects."""
        c = self._ht.counts
        return {
            "registered_regions": len(self._reg.engine),
            "registrations": sum(self._reg.counts.values()),
            "open_handles": len(self._ht.open),
            "pending_handles": self._ht.num_pending(),
            "draining_handles": len(self._ht.draining),
            "in_doubt_handles": self._ht.num_in_doubt(),
            "peers": len(self._peers),
            "handles_submitted": c["handles_submitted"],
            "handles_done": c["handles_done"],
            "handles_failed": c["handles_failed"],
            "handles_drained_late": c["handles_drained_late"],
            "descriptors_posted": c["descriptors_posted"],
            "bytes_posted": c["bytes_posted"],
            "bytes_done": c["bytes_done"],
            "engine_parts_posted": c["engine_parts_posted"],
            "connects": self._counts["connects"],
        }

    def check_invariants(self) -> None:
        """O(R log R + H): engine regions are exactly the normalised registrations; handle tables consistent;
        a closed backend holds nothing. Raises InvariantError naming the broken invariant."""
        self._reg.check_invariants()
        self._ht.check_invariants()
        if self._closed and (self._ht.open or self._reg.engine or self._peers):
            raise InvariantError("closed backend still holds handles, regions or peers")
        # (a closed backend may keep draining handles: their engine parts never finished, so their leases stay)

    # ---- lifecycle -------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Return to the just-constructed state without restarting the engine: forget every handle (pending
        ones cancelled, their plans aborted), disconnect every peer, deregister everything (then settle every
        half still held of :meth:`publish_half` where that fences the peers, :attr:`fences_peer_writes`), drop
        the layout, zero the counters and take a new peer id (metadata taken before the reset no longer names
        this backend). Cheaper than ``close`` + a new backend where engines are slow to stop (Mooncake: about
        1 s).

        Raises:
            BackendError: the backend is closed, or a forgotten transfer is still in the engine after
                ``_engine_quiesce``: every handle is forgotten by then, but peers, registrations (the engine may
                still touch that memory) and the layout stay, and the transfer's plan stays pending.
        """
        self._check_open()
        for h in list(self._ht.open.values()):
            self.forget(h)
        if self._ht.draining:
            self._engine_quiesce()
            self.progress()
            if self._ht.draining:
                raise BackendError(f"{self.name}: reset refused: {len(self._ht.draining)} transfer(s) still in "
                                   "the engine (Note [Deadlines and in-flight parts]); drain them first")
        for p in list(self._peers):
            self.disconnect(p)
        if self._reg.counts or self._reg.engine:
            self._apply(Counter())
        self._halves.forget_all(BackendError(f"{self.name}: backend reset: its registrations were released"),
                             settle=self.fences_peer_writes)
        self._layout = None
        self._layout_obj = None
        self._counts.clear()
        self._ht.counts.clear()
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
        """Forget every handle (cancelling pending ones), forget peers, deregister everything, stop the
        engine, then settle every half still held of :meth:`publish_half` where no sender can write it now
        (:attr:`fences_peer_writes`, and no transfer of this side's still in the engine, which keeps it running).
        Idempotent."""
        if self._closed:
            return
        try:
            for h in list(self._ht.open.values()):
                self.forget(h)
            if self._ht.draining:  # let the engine finish what it was handed before memory goes
                self._engine_quiesce()
                self.progress()
            for p in list(self._peers.values()):
                try:
                    self._engine_disconnect(p)
                except Exception:  # pragma: no cover - best effort on close
                    pass
            self._peers.clear()
            self._reg.drop_all()
        finally:
            self._closed = True
            type(self)._live.discard(self)
            self._engine_close()
            if self._ht.draining:
                self._ht.reap()
            self._halves.forget_all(BackendError(f"{self.name}: backend closed: its engine stopped"),
                                 settle=self.fences_peer_writes and not self._ht.draining)

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

    def _engine_check_peer_metadata(self, peer: PeerInfo) -> None:
        """Engine hook, before a batch is posted: raise RegistrationError if the peer's metadata is known to be
        stale (its registrations changed since it was taken); nothing is posted then."""

    def _engine_connect(self, md: dict) -> str:
        raise NotImplementedError

    def _engine_disconnect(self, peer: PeerInfo) -> None:
        """Forget the peer in the engine."""

    def _engine_peer_alive(self, peer: PeerInfo) -> bool:
        """Engine hook: False when the engine reports the peer down (connection state, goodbye)."""
        return True

    def _engine_post(self, h: TransferHandle, chunks: list[Chunk], peer: PeerInfo, item_bytes: int | None) -> None:
        """Post every chunk (``(descriptors, source region indices, destination region indices)``, each within
        the batch caps, Note [Bounded batches]) as its own engine submission, in order; record the parts in
        ``h.engine`` and their number in ``h.num_parts``. May raise after posting some."""
        raise NotImplementedError

    def _engine_poll(self, h: TransferHandle) -> tuple[int, BaseException | None]:
        """``(parts still pending, first error or None)``; non-blocking."""
        raise NotImplementedError

    def _engine_cancel(self, h: TransferHandle) -> None:
        """Cancel pending parts where the engine can (best effort); parts not yet handed to the engine must never
        be handed to it afterwards."""

    def _engine_withdraw(self, h: TransferHandle) -> None:
        """At ``wait``'s deadline: parts not yet handed to the engine are never handed to it; parts the engine
        holds are left alone (their outcome is still to come, F24)."""

    def _engine_in_flight(self, h: TransferHandle) -> int:
        """Parts of ``h`` the engine may still be reading or writing memory for (after ``_engine_cancel``): a
        part handed to the engine that it has not reported finished. Conservative default: the parts
        ``_engine_poll`` still reports pending. Called in the caller's thread."""
        return self._engine_poll(h)[0]

    def _engine_quiesce(self) -> None:
        """Give the engine a bounded time to finish the parts it was handed (``close`` / ``reset``)."""

    def _engine_free(self, h: TransferHandle) -> None:
        """Free engine resources of a terminal handle."""

    def _engine_progress(self) -> None:
        """Drive the engine's target side (NIXL without a progress thread)."""

    def _engine_close(self) -> None:
        """Stop the engine."""
