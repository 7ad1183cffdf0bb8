"""Transfer handles and their lifecycle: the handle, the per-backend handle table, the process-wide in-flight table.

Policy:

* A :class:`TransferHandle` is ``pending`` until every engine part of its transfer has finished (F11), then ``done``
  or ``failed``. A handle whose engine parts may still read or write memory after it stopped being pending is
  ``draining``: its plan (and the plan's leases) finishes only once the engine confirms (Note [Deadlines and
  in-flight parts] below). A deadline is not an outcome: a handle whose ``wait``
  timed out while the engine holds a part is ``in_doubt`` (draining, its plan pending, its pages pinned) until
  the engine reports every part finished, and then ``done`` or ``failed`` as the engine says (F24).
* :class:`HandleTable` owns one backend's handles: the open ones (submitted, not forgotten), the draining ones
  (forgotten or not), and a weak set of every handle it made (another backend's handle is refused, also once
  forgotten). Its transitions (:meth:`HandleTable.finish`, :meth:`HandleTable.reap`) finish a handle's plan exactly
  once (Note [Plan finishing] below).
* :data:`PLANS_IN_FLIGHT` records, across every backend of the process, the handle each plan is in flight on
  (pending or draining). A plan is in flight on one handle at a time: a second handle, on this backend or
  another, would outlive the leases that the first one's finishing releases (F11).
* Not thread-safe: touched only in the callers' thread (engine threads only record results in ``engine`` and
  let go of the plan's engine hold, :class:`~umalloc.backends.protocol.EngineHold`, which is thread-safe).

::

    new ──> pending ──finish("done")───────────────────────────> done      plan.complete()
               │
               ├─finish("failed") ─┬─ engine holds no part ────> failed    plan.fail(exc) / plan.abort()
               │                   └─ engine holds a part ─────> failed + draining
               │                                                   │ reap(): the engine let go
               │                                                   └──> plan.fail(exc) / plan.abort()
               └─time_out() ───────┬─ engine holds no part ────> failed    plan.fail(TransferTimeout)
                                   └─ engine holds a part ─────> in_doubt + draining (plan pending)
                                                                   │ reap(): the engine let go; its outcome:
                                                                   ├─ every part done ──> done    plan.complete()
                                                                   └─ a part failed ────> failed  plan.fail(exc)

Note [Plan finishing]
~~~~~~~~~~~~~~~~~~~
``plan.complete()`` when every part is done; ``plan.fail(exc)`` when a part failed or the peer died (F12: a dead
peer releases the held pages); ``plan.abort()`` when a pending handle is forgotten. ``wait``'s deadline is not a
finish: while the engine holds a part the handle is ``in_doubt`` and the plan finishes with the engine's outcome
(Note [Deadlines and in-flight parts]); only a handle whose parts were all withdrawn fails with the timeout.
The plan is finished by ``poll`` / ``wait`` / ``forget`` / ``progress`` / ``drain`` / ``close`` in the caller's
thread. Before the first part is handed to the engine the backend takes an engine hold on the plan's leases
(:class:`~umalloc.backends.protocol.EngineHold`), let go when the engine reported every part finished — on the
caller's thread, or on the engine's own thread where it has one (Mooncake's sender): leases may be released from any
thread (Note [Lease threading] in :mod:`umalloc.leases.table`). A lease deadline passing, or the caller finishing the
plan (``plan.abort()``/``fail()``) while a hold is outstanding leaves the lease *in doubt*: the plan reports its
failure at once, the pages stay pinned until the hold is let go (F24).

Note [Deadlines and in-flight parts]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The rule (F11 in docs/faults.md): while a transfer may still read or write a page, the page stays
leased. ``wait``'s deadline bounds the *caller's wait*, not the engine: no engine here can take back bytes it
was handed (Mooncake has no cancel; its ``TIMEOUT`` status is the engine's slice-age report about a slice that
is still in flight; NIXL can refuse to release a request that is still active). Setting the engine's timeout
below the lease deadline would not help either, since an engine timeout does not mean the engine stopped. So
the ordering is made correct by construction on the backend side:

* at the deadline ``wait`` raises :class:`~umalloc.errors.TransferTimeout` on time, never hangs; every part
  not yet handed to the engine is withdrawn and never posted, and parts the engine holds are left to finish (a
  timeout is "not known", not "failed", F24: NIXL's release of a request stalled on its receiver returns while
  the bytes still arrive). If the engine holds a part the handle is ``in_doubt``: its plan stays pending with
  its leases, and once the engine reports every part finished the handle turns ``done`` (``plan.complete()``) or
  ``failed`` (``plan.fail(exc)``, the engine's error) as the engine says;
* on ``forget`` of a pending handle the handle fails at once, parts not yet handed over are withdrawn and the
  engine is asked to cancel the rest;
* if the engine may still be working on a part it was handed (``_engine_in_flight``), the handle is
  ``draining``: its plan stays pending and keeps its leases; ``poll`` / ``progress`` / ``drain`` finish the plan
  (the engine's outcome after a deadline, ``abort`` after a ``forget``) in the caller's thread once the engine
  reports every such part finished (completed or failed). Registration changes that would drop engine memory wait
  for drains too;
* an engine thread posts a queued part only while the plan's leases are active and not past their deadline.

::

    submit ── posted ──────────── wait deadline ─────── engine: last part finished
      |  leases held               | handle in_doubt        | handle done / failed as the engine says
      |                            | leases still held      | plan.complete() / plan.fail(exc): pages reusable

Lease deadlines set by the plan's builder (``deadline_s``) are the allocator's F12 backstop for a peer that
never answers; they are reclaimed by the allocator, not by a backend. Choose them longer than any transfer can
stay in an engine. A receiver learns the outcome from the sender, which should report it once its plan finished
(``drain``), so the receiver's half is not released while bytes may still land in it.
"""

from __future__ import annotations

import itertools
import math
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from umalloc.errors import InvariantError, TransferTimeout, UmallocValueError

#: Handle states. ``pending`` until every engine part of the transfer has finished (F11); then ``done`` or
#: ``failed`` (engine error, dead peer, or forgotten while pending). A handle failed by ``forget`` may still be
#: ``draining``: the engine has not confirmed that its parts stopped touching memory, so its plan (and leases)
#: has not finished yet (Note [Deadlines and in-flight parts] below). ``in_doubt``: ``wait``'s
#: deadline passed while the engine held a part — the outcome is not known (F24); the handle drains and turns
#: ``done`` or ``failed`` when the engine reports every part finished.
HANDLE_STATES: tuple[str, ...] = ("pending", "in_doubt", "done", "failed")


@dataclass(eq=False)
class TransferHandle:
    """One submitted transfer (one plan or one descriptor batch) to one peer.

    A handle may own several engine parts: the chunks of Note [Bounded batches] in
    :mod:`umalloc.transfer.descriptors` (at most ``max_batch_descriptors`` descriptors and ``max_batch_bytes``
    bytes each), and on NIXL one request per chunk and memory-kind group; it is ``done`` only when every part is done, and ``failed`` once a part failed and every part
    has finished, or when ``wait``'s deadline passed or it was forgotten while pending. In the last two cases parts
    already handed to the engine may still be moving bytes: the handle is then ``draining`` and its plan finishes
    (releasing its leases) only when the engine confirms that every part finished (F11: every handle of a
    multi-part transfer; Note [Deadlines and in-flight parts]).

    Attributes:
        handle_id: id unique within its backend.
        backend: the backend's name.
        peer: the peer name given to ``submit``.
        num_descriptors: descriptors posted (rows of the batch).
        total_bytes: sum of the descriptors' ``nbytes``.
        num_parts: engine submissions the transfer was split into (the batch's chunks; NIXL: one per chunk and
            memory-kind group; fewer when posting failed part way). Summed by the ``engine_parts_posted`` stat.
        plan: the plan submitted, or ``None`` for a raw descriptor batch.
        state: ``"pending"``, ``"in_doubt"``, ``"done"`` or ``"failed"`` (:data:`HANDLE_STATES`).
        error: the exception that failed the handle (a ``TransferError``), the ``TransferTimeout`` of an
            ``in_doubt`` handle, else ``None``.
        forgotten: ``True`` once :meth:`TransferBackend.forget` ran (idempotent).
        draining: ``True`` while the handle is failed but the engine may still read or write its memory; the
            plan's leases are held until it turns ``False`` (``poll`` / ``progress`` / ``drain`` observe it).
        submitted_at / finished_at: ``time.monotonic()`` stamps in seconds (``finished_at`` ``None`` while
            pending or in doubt).
    """

    handle_id: int
    backend: str
    peer: str
    num_descriptors: int
    total_bytes: int
    submitted_at: float
    plan: object | None = None
    num_parts: int = 0
    state: str = "pending"
    error: BaseException | None = None
    forgotten: bool = False
    draining: bool = False
    finished_at: float | None = None
    engine: dict = field(default_factory=dict, repr=False)

    @property
    def elapsed_s(self) -> float | None:
        """Seconds from submit to the terminal state, ``None`` while pending."""
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    @property
    def terminal(self) -> bool:
        """``done`` or ``failed``: the outcome is known."""
        return self.state in ("done", "failed")


def check_timeout(timeout_s: object) -> None:
    """UmallocValueError unless ``timeout_s`` is a positive finite number of seconds (bools refused). O(1)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
            timeout_s > 0 and math.isfinite(timeout_s)):
        raise UmallocValueError(f"timeout_s={timeout_s!r}: allowed a positive finite number of seconds")


class PlansInFlight:
    """The handle each plan is in flight on (pending, or draining: its plan not finished yet), by ``id(plan)``
    (the handle keeps the plan alive, so the id is not reused meanwhile). O(1) per call.

    >>> t, plan = PlansInFlight(), object()
    >>> h = TransferHandle(1, "local", "p", 0, 0, 0.0, plan=plan)
    >>> t.claim(h); t.holder(plan) is h
    True
    >>> t.drop(h); t.holder(plan) is None
    True
    """

    def __init__(self) -> None:
        self._by_plan: dict[int, TransferHandle] = {}

    def holder(self, plan: object) -> TransferHandle | None:
        """The handle ``plan`` is in flight on, or ``None``."""
        h = self._by_plan.get(id(plan))
        return h if h is not None and h.plan is plan else None

    def claim(self, h: TransferHandle) -> None:
        """Record ``h``'s plan as in flight on ``h`` (the caller checked :meth:`holder` first)."""
        self._by_plan[id(h.plan)] = h

    def drop(self, h: TransferHandle) -> None:
        """Forget ``h``'s plan if it is in flight on ``h``."""
        if self._by_plan.get(id(h.plan)) is h:
            del self._by_plan[id(h.plan)]


#: The process-wide table (every backend of this process shares it).
PLANS_IN_FLIGHT = PlansInFlight()


class HandleTable:
    """One backend's handles and their transitions.

    Args:
        backend: the backend's name (stamped on each handle, named in errors).
        in_flight: ``in_flight(h)`` -> engine parts of ``h`` that may still touch memory (the engine hook).
        free_engine: ``free_engine(h)`` frees the engine resources of a terminal handle (the engine hook).
        outcome: ``outcome(h)`` -> ``(parts pending, first error or None)`` as the engine reports them (the poll
            hook); read when an ``in_doubt`` handle's parts all finished.

    Attributes:
        open: handles submitted and not forgotten, by id.
        draining: failed handles (forgotten or not) whose engine parts may still touch memory, by id.
        counts: ``handles_submitted``, ``handles_done``, ``handles_failed``, ``handles_drained_late``,
            ``handles_timed_out`` (``wait`` deadlines that left a handle in doubt), ``descriptors_posted``,
            ``bytes_posted``, ``bytes_done``, ``engine_parts_posted``.
    """

    def __init__(self, backend: str, in_flight: Callable[[TransferHandle], int],
                 free_engine: Callable[[TransferHandle], None],
                 outcome: Callable[[TransferHandle], tuple[int, BaseException | None]]) -> None:
        self.backend = backend
        self._in_flight = in_flight
        self._free_engine = free_engine
        self._outcome = outcome
        self.open: dict[int, TransferHandle] = {}
        self.draining: dict[int, TransferHandle] = {}
        self._made: weakref.WeakSet[TransferHandle] = weakref.WeakSet()
        self._next_id = itertools.count(1)
        self.counts: Counter[str] = Counter()

    def refuse_in_flight(self, plan: object, what: str) -> None:
        """UmallocValueError if ``plan`` is in flight on any handle of this process (F11). O(1)."""
        other = PLANS_IN_FLIGHT.holder(plan)
        if other is None:
            return
        mine = self.open.get(other.handle_id) is other or self.draining.get(other.handle_id) is other
        where = "this" if mine else f"another {other.backend}"
        raise UmallocValueError(
            f"{what}: plan is already in flight on {where} backend (handle {other.handle_id}, "
            f"{'draining' if other.draining else other.state}): a second handle would outlive its leases "
            "(F11); wait for, forget or drain that handle first")

    def new(self, peer: str, num_descriptors: int, total_bytes: int, plan: object | None) -> TransferHandle:
        """A pending handle, recorded as open (and its plan as in flight on it). The caller checked everything."""
        h = TransferHandle(handle_id=next(self._next_id), backend=self.backend, peer=peer,
                           num_descriptors=num_descriptors, total_bytes=total_bytes, submitted_at=time.monotonic(),
                           plan=plan)
        self.open[h.handle_id] = h
        self._made.add(h)
        if plan is not None:
            PLANS_IN_FLIGHT.claim(h)
        c = self.counts
        c["handles_submitted"] += 1
        c["descriptors_posted"] += num_descriptors
        c["bytes_posted"] += total_bytes
        return h

    def own(self, handle: object) -> TransferHandle:
        """``handle`` if this table made it (forgotten or not), else UmallocValueError."""
        if not isinstance(handle, TransferHandle):
            raise UmallocValueError(f"handle={handle!r}: allowed a TransferHandle")
        if handle not in self._made:
            raise UmallocValueError(f"handle {handle.handle_id} (of a {handle.backend} backend) does not belong to "
                                    f"this {self.backend} backend")
        return handle

    def finish(self, h: TransferHandle, state: str, error: BaseException | None = None, *,
               abort: bool = False) -> None:
        """``pending`` -> ``state`` (``"done"`` / ``"failed"``). Finishes the plan now, or, when the engine may still
        touch a part of a failed handle, marks it draining (its plan finishes in :meth:`reap`)."""
        if h.state != "pending":
            raise InvariantError(f"handle {h.handle_id} finished twice ({h.state} -> {state})")
        h.state = state
        h.error = error
        h.finished_at = time.monotonic()
        if state == "done":
            self.counts["handles_done"] += 1
            self.counts["bytes_done"] += h.total_bytes
        else:
            self.counts["handles_failed"] += 1
        if state != "done" and self._in_flight(h):  # Note [Deadlines and in-flight parts]
            h.draining = True
            h.engine["finish_abort"] = abort
            self.draining[h.handle_id] = h
            self.counts["handles_drained_late"] += 1
            return
        self._finish_plan(h, abort)

    def time_out(self, h: TransferHandle, exc: BaseException) -> None:
        """``pending`` -> ``in_doubt`` at ``wait``'s deadline while the engine holds a part of ``h`` (the plan
        stays pending, its leases hold every page: the bytes may still move, F24); -> ``failed`` (plan failed with
        ``exc``) when the engine holds none. The caller withdrew the parts not handed to the engine yet."""
        if h.state != "pending":
            raise InvariantError(f"handle {h.handle_id} timed out while {h.state}")
        if not self._in_flight(h):
            self.finish(h, "failed", exc)
            return
        h.state = "in_doubt"
        h.error = exc
        h.draining = True
        h.engine["finish_abort"] = False
        self.draining[h.handle_id] = h
        self.counts["handles_timed_out"] += 1
        self.counts["handles_drained_late"] += 1

    def _settle_in_doubt(self, h: TransferHandle) -> None:
        """``in_doubt`` -> the engine's outcome, once every part finished: ``done`` when the engine reports no
        failure, else ``failed`` with the engine's error (the deadline's ``TransferTimeout`` as its context)."""
        _pending, err = self._outcome(h)
        h.finished_at = time.monotonic()
        if err is None:
            h.state, h.error = "done", None
            self.counts["handles_done"] += 1
            self.counts["bytes_done"] += h.total_bytes
        else:
            if err.__context__ is None and h.error is not err:
                err.__context__ = h.error
            h.state, h.error = "failed", err
            self.counts["handles_failed"] += 1

    def wait(self, h: TransferHandle, timeout_s: float, poll: Callable[[TransferHandle], str],
             withdraw: Callable[[TransferHandle], None], spin_polls: int, max_sleep_s: float) -> None:
        """The loop of ``BackendBase.wait`` (its docstring says what it promises): ``poll(h)`` until the outcome
        is known or ``timeout_s`` passed, busy for ``spin_polls`` polls, then sleeping up to ``max_sleep_s``
        between polls; at the deadline a pending handle's unposted parts are withdrawn (``withdraw``) and it
        goes in doubt (:meth:`time_out`) or fails. Raises the failure, or TransferTimeout."""
        deadline = time.monotonic() + timeout_s
        spins = 0
        while poll(h) in ("pending", "in_doubt"):
            now = time.monotonic()
            if now >= deadline:
                exc = TransferTimeout(f"{self.backend}: transfer {h.handle_id} to {h.peer!r} "
                                      f"({h.num_descriptors} descriptors, {h.total_bytes} bytes) not done "
                                      f"after {timeout_s:.3g} s: outcome not known (in doubt until the engine "
                                      "reports every part finished)")
                if h.state == "pending":
                    try:
                        withdraw(h)
                    finally:
                        self.time_out(h, exc)
                if h.state != "failed":
                    raise exc
                break
            spins += 1
            if spins > spin_polls:
                time.sleep(min(max_sleep_s, deadline - now))
        if h.state == "failed":
            assert h.error is not None
            raise h.error

    @staticmethod
    def drain(h: TransferHandle, timeout_s: float, progress: Callable[[], None], sleep_s: float) -> bool:
        """The loop of ``BackendBase.drain``: ``progress()`` until ``h`` no longer drains (True) or ``timeout_s``
        passed (False), sleeping up to ``sleep_s`` between rounds; a pending handle is refused."""
        if not h.draining:
            if h.state == "pending":
                raise UmallocValueError(f"drain: handle {h.handle_id} is pending: wait for it first")
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            progress()
            if not h.draining:
                return True
            now = time.monotonic()
            if now >= deadline:
                return False
            time.sleep(min(sleep_s, deadline - now))

    @staticmethod
    def _finish_plan(h: TransferHandle, abort: bool) -> None:
        plan = h.plan
        if plan is None:
            return
        hold = h.engine.get("hold")
        if hold is not None:  # the engine let go of every part: in-doubt leases settle (F24)
            hold.drop()
        PLANS_IN_FLIGHT.drop(h)
        if h.state == "done":
            plan.complete()
        elif abort:
            plan.abort()
        else:
            plan.fail(h.error)

    def reap(self) -> None:
        """Finish the plans of draining handles whose engine parts all finished (caller's thread)."""
        for hid, h in list(self.draining.items()):
            if self._in_flight(h):
                continue
            del self.draining[hid]
            h.draining = False
            if h.state == "in_doubt":
                self._settle_in_doubt(h)
            try:
                if h.forgotten:
                    self._free_engine(h)
            finally:
                self._finish_plan(h, bool(h.engine.pop("finish_abort", False)))

    def forget(self, h: TransferHandle) -> None:
        """Mark a terminal handle forgotten and drop it from the open table; its engine resources are freed now
        (``free_engine``) unless it is draining (then :meth:`reap` frees them)."""
        if h.draining:
            h.forgotten = True
            self.open.pop(h.handle_id, None)
            return
        try:
            self._free_engine(h)
        finally:
            h.forgotten = True
            self.open.pop(h.handle_id, None)

    def num_pending(self) -> int:
        return sum(1 for h in self.open.values() if h.state == "pending")

    def num_in_doubt(self) -> int:
        """Handles (forgotten or not) whose ``wait`` timed out while the engine held a part, outcome not known."""
        return sum(1 for h in self.draining.values() if h.state == "in_doubt")

    def num_busy(self) -> int:
        """Transfers whose engine parts may touch registered memory: pending plus draining."""
        return self.num_pending() + len(self.draining)

    def check_invariants(self) -> None:
        """O(H): open and draining tables consistent with each handle's state, plans recorded as in flight on
        their handles, counters balanced. Raises InvariantError naming the broken invariant."""
        for hid, h in self.open.items():
            if h.handle_id != hid or h.forgotten:
                raise InvariantError(f"handle table entry {hid} inconsistent (forgotten={h.forgotten})")
            if (h.state in ("pending", "in_doubt")) != (h.finished_at is None):
                raise InvariantError(f"handle {hid}: state {h.state} vs finished_at {h.finished_at}")
            if h.draining != (hid in self.draining):
                raise InvariantError(f"handle {hid}: draining={h.draining} but in the draining table: "
                                     f"{hid in self.draining}")
        for h in (*self.open.values(), *self.draining.values()):
            in_flight = h.state == "pending" or h.draining
            if h.plan is not None and in_flight and PLANS_IN_FLIGHT.holder(h.plan) is not h:
                raise InvariantError(f"handle {h.handle_id}: its plan is in flight but not recorded as in flight "
                                     "on it")
        for hid, h in self.draining.items():
            if h.handle_id != hid or not h.draining or h.state not in ("failed", "in_doubt"):
                raise InvariantError(f"draining handle {hid} inconsistent (state {h.state}, draining={h.draining})")
            if not h.forgotten and self.open.get(hid) is not h:
                raise InvariantError(f"draining handle {hid} is neither forgotten nor open")
        c = self.counts
        if c["handles_done"] + c["handles_failed"] + self.num_pending() + self.num_in_doubt() \
                != c["handles_submitted"]:
            raise InvariantError("handles submitted != done + failed + pending + in doubt")
        for h in self.open.values():
            if h.state == "in_doubt" and not h.draining:
                raise InvariantError(f"handle {h.handle_id} in doubt but not draining")
