"""The replay's prefill side in a second process (``--backend nixl`` / ``--backend mooncake``).

Policy:

* The child is a :class:`umalloc.backends.worker.BackendWorker` (the backends' one worker harness: spawn,
  bounded calls, remote exceptions re-raised as their umalloc type); the ``child_*`` functions below run inside
  it through :meth:`BackendWorker.run`. The child owns the prefill arena, its allocator and the KV pattern
  (rebuilt from the preset name, page size, draft flag, arena bytes and seed, so both processes compute the same
  bytes); the parent owns the decode arena and the receiving backend.
* Per request (a real PD split, F13: only physical ids cross the process boundary): the parent preallocates on
  decode and builds the receiver half (:func:`umalloc.transfer.plan.build_receiver_half`, which leases decode's
  pages) and publishes it through the receiving backend (``publish_half``: the lease takes an engine hold, so
  its deadline never frees pages the child may still write, F24); the child allocates, fills, builds the send
  plan from the half (:func:`umalloc.transfer.plan.build_send_plan`, which leases prefill's pages) and posts the
  WRITE without waiting. The parent then runs its decode step while the
  transfer is in flight, and later asks the child to wait for the step's transfers (one call); the child ends
  their plans (source leases), then frees their pages, and the parent completes the halves (destination
  leases) and verifies every page.
* Every call is bounded (``transfer_timeout_s``, twice that for the wait-and-drain of ``child_finish``, plus a
  margin); a failed transfer settles the half on the child's report (its lease is released) and raises — except while
  bytes may still land in the half (the child's drain gave up, or the child did not answer): then the half stays
  held (in doubt once its deadline passes) until the child is confirmed gone, which :meth:`RemotePrefill.close`
  waits for before it settles every half kept so (:func:`settle_failed_half`). The parent progresses its own
  backend while it waits for the child (a NIXL target).
* Asynchronous start (:meth:`RemotePrefill.submit` / :meth:`RemotePrefill.arrived`, ``umalloc generate``): the
  parent leases, publishes the receiver half and submits :func:`child_prefill_send` without waiting
  (Note [Submitted requests] of :mod:`umalloc.backends.worker`); the child prefills, plans, posts, waits for that
  one transfer and frees its prompt, then replies. The parent polls between its decode steps and completes each
  half when its reply arrives (in submission order: the child answers one request at a time). Per-request
  finishing frees a prompt while the child's later transfers are not yet posted, so Note [Finishing a step's
  transfers] (equal compactions across backends) is the synchronous path's, not this one's. Failures keep the
  synchronous path's rules: the failed request's half is settled or kept as :func:`settle_failed_half` says,
  and every request behind it is kept held (the child may still be writing it) until the child is gone.
* Time: each call is measured in the parent as ``transfer``; the child reports its own split (allocator, fill,
  translate+plan) which is moved to those phases, so the report's split means the same for every backend.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, TypeVar, cast

import torch

from umalloc import ArenaSpec, MultiEndedAllocator, PeerLayout, ReceiverHalf, build_receiver_half
from umalloc_replay.report import PhaseTimer
from umalloc_replay.signals import sigint_ignored
from umalloc_replay.single.prefill import Arrival, PlanFigures, warm_up
from umalloc_replay.workload import RequestState

_HERE = "umalloc_replay.single.remote:"
#: Seconds a worker call may take beyond the transfer timeout (allocation, fill and plan building in the child).
CALL_MARGIN_S = 120.0


# ==== inside the child ==========================================================================================


def _child_stats(ctx) -> dict:
    alloc = ctx.objects["replay_alloc"]
    t = alloc.lease_table
    return {"ends": {n: s.to_dict() for n, s in alloc.stats().items()}, "leases_active": alloc.leases_active(),
            "leases_taken": t.leases_taken, "leases_expired": t.leases_expired, "leases_in_doubt": t.leases_in_doubt}


def child_setup(ctx, model: str, page_size: int, draft: bool, arena_bytes: int, seed: int, compaction: str,
                padded: bool, draft_sliding: str = "swa") -> dict:
    """Create the prefill arena (preset ``model`` with the drafter's sliding layers where ``draft_sliding``
    puts them, :func:`umalloc.geometry.presets.preset_ends`; its ends padded as vLLM pads them when ``padded``,
    :func:`umalloc_replay.single.layouts.padded_ends`), its allocator and the KV pattern; register the arena with the
    child's backend and publish its layout. Returns the child's stats."""
    from umalloc import Arena
    from umalloc.geometry.presets import preset_ends
    from umalloc_replay.single.kvfill import KVPattern
    from umalloc_replay.single.layouts import padded_ends

    ends = preset_ends(model, page_size=page_size, draft=draft, draft_sliding=draft_sliding)
    spec = ArenaSpec(padded_ends(ends) if padded else ends, arena_bytes=arena_bytes)
    arena = Arena(spec, zero=False)
    alloc = MultiEndedAllocator(arena, compaction=compaction)
    torch.set_num_threads(1)
    return adopt_prefill_side(ctx, alloc, KVPattern(spec, seed))


def adopt_prefill_side(ctx, alloc: MultiEndedAllocator, pattern: object) -> dict:
    """Make ``alloc`` (and its arena) the child's prefill side, filled by ``pattern``: warm the allocator up,
    register the arena with the child's backend, publish its layout. ``pattern`` has ``fill_pages(arena, end,
    request_id, seq_pages, ppages) -> bytes`` (:class:`~umalloc_replay.single.kvfill.KVPattern`, or a model's
    KV writer, as ``umalloc generate``'s prefill side). Returns the child's stats. Every setup function passed as
    :class:`RemotePrefill`'s ``setup`` ends with it."""
    warm_up(alloc)
    b = ctx._b()
    b.register(alloc.arena.regions())
    b.set_layout(PeerLayout.from_arena(alloc.arena))
    ctx.objects.update(replay_arena=alloc.arena, replay_alloc=alloc, replay_pattern=pattern,
                       replay_inflight={}, replay_filled=0)
    return _child_stats(ctx)


def child_start(ctx, request_id: int, num_tokens: int, half: dict, peer: str,
                deadline_s: float | None) -> dict:
    """Allocate and fill a prompt of ``num_tokens``, build the send plan from the receiver ``half`` and post it
    (no wait). Returns ``{"short": bool, "phases": {...}, "filled": bytes, "stats": ...}``; ``short`` means the
    prefill arena could not take the prompt and nothing changed."""
    from umalloc import build_send_plan
    from umalloc_replay.single.prefill import alloc_sequence, fill_sequence

    alloc = ctx.objects["replay_alloc"]
    b = ctx._b()
    ph = {"allocator": 0.0, "fill": 0.0, "translate_plan": 0.0}
    t0 = time.perf_counter()
    vt = alloc_sequence(alloc, num_tokens)
    ph["allocator"] += time.perf_counter() - t0
    if vt is None:
        return {"short": True, "phases": ph, "filled": 0, "stats": _child_stats(ctx)}
    try:
        t0 = time.perf_counter()
        filled = fill_sequence(alloc, ctx.objects["replay_pattern"], request_id, vt, num_tokens)
        t1 = time.perf_counter()
        plan = build_send_plan(str(request_id), alloc, vt, half, b.peer_layout(peer), deadline_s=deadline_s)
        t2 = time.perf_counter()
        ph["fill"] += t1 - t0
        ph["translate_plan"] += t2 - t1
        handle = b.submit(plan, peer)
    except BaseException:
        alloc.free(vt)
        raise
    ctx.objects["replay_filled"] += filled
    ctx.objects["replay_inflight"][request_id] = (plan, handle, vt)
    leases = alloc.leases_active()
    return {"short": False, "phases": ph, "filled": filled, "leases_at_post": leases, "stats": _child_stats(ctx)}


def _wait_drained(b, handle, timeout_s: float) -> None:
    """``b.wait(handle)``; a failed transfer is drained (up to ``timeout_s`` more) before the failure is raised,
    since the parent releases the receiver's half on it (Note [Deadlines and in-flight parts]); a handle left in
    doubt by the deadline whose engine then reported every part done is a success. If the engine
    still holds a part when the drain gives up, the error is a ``TransferError`` with ``draining = True`` (it
    survives the trip to the parent): the receiver must keep its half leased (:func:`settle_failed_half`)."""
    from umalloc import TransferError

    try:
        b.wait(handle, timeout_s)
    except Exception as exc:
        if handle.state != "pending" and not b.drain(handle, timeout_s):
            err = TransferError(f"{type(exc).__name__}: {exc}; the engine still held a part of the transfer after "
                                f"draining {timeout_s:.3g} s more: keep the receiver's half leased (Note [Deadlines "
                                "and in-flight parts])")
            err.draining = True  # type: ignore[attr-defined]
            raise err from exc
        if handle.state == "done":  # a deadline left it in doubt; the engine then reported every part done (F24)
            return
        raise


def child_finish_all(ctx, request_ids: list[int], timeout_s: float) -> dict:
    """Wait for every posted plan of ``request_ids`` and forget it (its source lease is released with it), then free
    every prompt's pages; returns ``{"phases", "stats", "plans": [figures per request, in order]}``.

    Every wait comes before any free (Note [Finishing a step's transfers] in :mod:`umalloc_replay.single.prefill`).
    A failure is raised once every handle was forgotten and every prompt freed (the first failure, drained as
    :func:`_wait_drained` says). Takes at most about ``2 * timeout_s`` per request.
    """
    items = [(rid, *ctx.objects["replay_inflight"].pop(rid)) for rid in request_ids]
    alloc = ctx.objects["replay_alloc"]
    b = ctx._b()
    first: BaseException | None = None
    try:
        for _rid, _plan, handle, _vt in items:
            try:
                _wait_drained(b, handle, timeout_s)
            except BaseException as exc:
                first = first or exc
            finally:
                b.forget(handle)
    finally:
        t0 = time.perf_counter()
        for _rid, _plan, _handle, vt in items:
            alloc.free(vt)
        dt = time.perf_counter() - t0
    if first is not None:
        raise first
    plans = [{"bytes_total": plan.total_bytes, "bytes_by_vector": {n: s.bytes for n, s in plan.stats_by_vector.items()},
              "descriptors": plan.num_descriptors, "runs": plan.num_runs,
              "per_layer_per_page": plan.per_layer_descriptor_equivalent} for _rid, plan, _h, _vt in items]
    return {"phases": {"allocator": dt}, "stats": _child_stats(ctx), "plans": plans}


def child_finish(ctx, request_id: int, timeout_s: float) -> dict:
    """:func:`child_finish_all` of one request; returns its figures with ``phases`` and ``stats``."""
    res = child_finish_all(ctx, [request_id], timeout_s)
    return {"phases": res["phases"], "stats": res["stats"], **res["plans"][0]}


def child_prefill_send(ctx, request_id: int, num_tokens: int, half: dict, peer: str, deadline_s: float | None,
                       timeout_s: float, after: str | None) -> dict:
    """One submitted request of :meth:`RemotePrefill.submit`: :func:`child_start`, then (unless the arena was short)
    :func:`child_finish_all` of this request alone (its transfer waited for, its plan ended, its prompt freed),
    then ``after(ctx, [request_id])`` when ``after`` (``"module:function"``) is given. Returns
    :func:`child_start`'s dict with both calls' ``phases`` summed, ``plan`` (the plan's figures, ``None`` when
    short) and ``extra`` (``after``'s result, ``None`` without one). Takes at most about ``2 * timeout_s`` plus
    the prefill's own time. Raises what :func:`child_start` or :func:`child_finish_all` raise."""
    import importlib

    res = child_start(ctx, request_id, num_tokens, half, peer, deadline_s)
    if res["short"]:
        return {**res, "plan": None, "extra": None}
    fin = child_finish_all(ctx, [request_id], timeout_s)
    phases = dict(res["phases"])
    for k, v in fin["phases"].items():
        phases[k] = phases.get(k, 0.0) + v
    extra = None
    if after is not None:
        mod, fn = after.split(":", 1)
        extra = getattr(importlib.import_module(mod), fn)(ctx, [request_id])
    return {**res, "phases": phases, "stats": fin["stats"], "plan": fin["plans"][0], "extra": extra}


def child_check(ctx) -> dict:
    """``check_invariants`` of the child's allocator and backend; returns its stats."""
    ctx.objects["replay_alloc"].check_invariants()
    ctx._b().check_invariants()
    return _child_stats(ctx)


# ==== in the parent =============================================================================================


@dataclass
class _Submitted:
    request_id: int
    half: ReceiverHalf
    seq: int


def _child_gone(exc: BaseException) -> bool:
    from umalloc.backends.worker import WorkerDied

    return isinstance(exc, WorkerDied)



def settle_failed_half(half: ReceiverHalf, exc: BaseException) -> bool:
    """End the receiver ``half`` of a transfer that failed with ``exc`` — unless bytes may still land in its pages.

    The half is kept pending (held: a published half's lease goes in doubt at its deadline, never free, F24) when
    the child said its engine still holds a part of the transfer (``exc.draining``, set by :func:`child_finish`
    when its bounded drain gave up) or when the child did not answer in time
    (:class:`~umalloc.backends.worker.WorkerTimeout`: it may still be sending). Otherwise (the child's report of
    a transfer that finished, or the child process ended) the termination is confirmed: the half settles
    (:meth:`~umalloc.transfer.plan.ReceiverHalf.settle`: failed with ``exc``, its lease released).

    Returns:
        True if the half was settled, False if it was kept pending.
    """
    from umalloc.backends.worker import WorkerTimeout

    if getattr(exc, "draining", False) or isinstance(exc, WorkerTimeout):
        return False
    half.settle(exc)
    return True


_T = TypeVar("_T")


class RemotePrefill:
    """The prefill side in a spawned child; same interface as :class:`umalloc_replay.single.prefill.LocalPrefill`.

    Args:
        backend: ``"nixl"`` or ``"mooncake"`` (both processes use it; ``"local"`` cannot cross processes).
        pre_spec: the prefill arena spec (its ``arena_bytes`` is what the child allocates).
        decode: the decode allocator (this process).
        timer: the replay's phase timer.
        model, page_size, draft, seed, compaction, padded, draft_sliding: what the child rebuilds its arena and
            pattern from.
        transfer_timeout_s, lease_deadline_s: bound of each transfer wait; deadline of both sides' leases.
        setup: ``("module:function", args)`` that the child runs as ``function(ctx, *args)`` instead of
            :func:`child_setup` (then ``model`` ... ``padded`` are unused): it builds the child's allocator and
            pattern and ends with :func:`adopt_prefill_side` (``umalloc generate``: a model's KV as the pattern).
        after: ``"module:function"`` the child runs as ``function(ctx, [request_id])`` once a submitted
            request's transfer finished (:meth:`submit`); its result rides the request's :class:`Arrival`.

    Threading: the caller's thread only.

    Raises:
        BackendUnavailable: the engine cannot start here (in either process).
    """

    name = "remote"

    def __init__(self, backend: str, pre_spec: ArenaSpec, decode: MultiEndedAllocator, timer: PhaseTimer, *,
                 model: str, page_size: int, draft: bool, seed: int, compaction: str, padded: bool,
                 transfer_timeout_s: float, lease_deadline_s: float | None,
                 setup: tuple[str, tuple] | None = None, after: str | None = None,
                 draft_sliding: str = "swa") -> None:
        from umalloc import get_backend
        from umalloc.backends.worker import BackendWorker

        self.decode = decode
        self.timer = timer
        self.timeout_s = transfer_timeout_s
        self.deadline_s = lease_deadline_s
        self.dst_layout = PeerLayout.from_arena(decode.arena)
        self.kept_halves: list[ReceiverHalf] = []  # halves the child may still write: settled once it is confirmed gone
        self.after = after
        self._submitted: deque[_Submitted] = deque()  # submitted requests, in the order the child answers them
        self._head_since = 0.0  # when the child could start on the head of _submitted (monotonic)
        with sigint_ignored():  # the child inherits SIGINT ignored: Ctrl-C is the parent's (umalloc_replay.signals)
            self.worker = BackendWorker(backend)
        self.b = None
        try:
            self.b = get_backend(backend, layout=self.dst_layout)
            self.b.register(decode.arena.regions())
            self.worker.wait_ready(timeout_s=CALL_MARGIN_S)
            if setup is None:
                self._stats = self._call("child_setup", model, page_size, draft, pre_spec.arena_bytes, seed,
                                         compaction, padded, draft_sliding)
            else:
                target, args = setup
                got = self.worker.run(target, *args, progress=self.b.progress,
                                      timeout_s=self.timeout_s + CALL_MARGIN_S)
                assert isinstance(got, dict), f"{target} returned {type(got).__name__}, not the child's stats"
                self._stats = got
            self.peer = self.worker.call("connect", self.b.metadata(), progress=self.b.progress,
                                         timeout_s=CALL_MARGIN_S)
        except BaseException:
            self.close()
            raise
        self.bytes_filled = 0
        self.max_leases = 0
        self.step_leases = 0

    def _call(self, fn: str, *args: object, transfer_s: float | None = None) -> dict:
        """Run ``child_<fn>`` in the child, bounded by ``transfer_s`` (default: one transfer timeout) plus
        :data:`CALL_MARGIN_S`."""
        bound = (self.timeout_s if transfer_s is None else transfer_s) + CALL_MARGIN_S
        assert self.b is not None, "the backend is set before the first call"
        return cast(dict, self.worker.run(_HERE + fn, *args, progress=self.b.progress, timeout_s=bound))

    def _account(self, res: dict) -> None:
        """Move the child's own phase split out of the parent's ``transfer`` measurement."""
        for phase, secs in res["phases"].items():
            self.timer.reassign("transfer", phase, secs)
        self._stats = res["stats"]

    def _hand_over(self, rs: RequestState, dst_vtokens: torch.Tensor | dict[str, torch.Tensor],
                   send: Callable[[Any], _T]) -> tuple[ReceiverHalf, _T]:
        """Lease ``rs``'s receiver half on ``dst_vtokens``, publish it, and ``send(wire)`` it to the child; the half
        and what ``send`` returned. On a failure the half is settled, or kept held when the child may have the
        request (:meth:`_settle_or_keep`), and the error raised."""
        with self.timer.phase("translate_plan"):
            half = build_receiver_half(str(rs.rid), self.decode, dst_vtokens, layout=self.dst_layout,
                                       deadline_s=self.deadline_s)
        try:
            with self.timer.phase("transfer"):
                wire = self.b.publish_half(half)  # type: ignore[union-attr]
                return half, send(wire)
        except BaseException as exc:
            self._settle_or_keep(half, exc)  # a child that did not answer may have posted: keep the half then
            raise

    def start(self, rs: RequestState, dst_vtokens: torch.Tensor) -> object | None:
        """Receiver half (decode lease, published to the child) here, then the child's prefill + send plan + post.
        ``None`` if the child's arena is short (it posted nothing: the half settles, nothing changed)."""
        half, res = self._hand_over(rs, dst_vtokens, lambda wire: self._call(
            "child_start", rs.rid, rs.req.input_tokens, wire, self.peer, self.deadline_s))
        self._account(res)
        if res["short"]:
            # the child's terminal report: it posted nothing. complete() lets go of the publication hold before
            # the lease is released, so the lease never passes through in doubt (settle() releases it first, then
            # lets go)
            half.complete()
            return None
        self.bytes_filled += res["filled"]
        held = res["leases_at_post"] + self.decode.leases_active()
        self.max_leases = max(self.max_leases, held)
        self.step_leases = max(self.step_leases, held)
        return (half, rs.rid)

    def finish_all(self, tickets: list) -> list[PlanFigures]:
        """Wait (in the child) for every transfer of ``tickets``, end both sides' leases, free the prompts (every
        wait before any free: Note [Finishing a step's transfers]); the plans' figures, in order. On a failure
        every receiver half is settled (:func:`settle_failed_half`: kept held while bytes may still land)."""
        if not tickets:
            return []
        halves = [half for half, _rid in tickets]
        try:
            with self.timer.phase("transfer"):
                self.b.progress()  # type: ignore[union-attr]
                # the child waits up to timeout_s per transfer, then drains a failed one up to timeout_s more
                res = self._call("child_finish_all", [rid for _half, rid in tickets], self.timeout_s,
                                 transfer_s=2 * self.timeout_s * len(tickets))
        except BaseException as exc:
            for half in halves:
                self._settle_or_keep(half, exc)
            raise
        for half in halves:
            half.complete()
        self._account(res)
        return [PlanFigures(f["bytes_total"], f["bytes_by_vector"], f["descriptors"], f["runs"],
                            f["per_layer_per_page"]) for f in res["plans"]]

    # ---- asynchronous start -------------------------------------------------------------------------------
    def submit(self, rs: RequestState, dst_vtokens: torch.Tensor | dict[str, torch.Tensor]) -> None:
        """Asynchronous :meth:`start`: lease and publish the receiver half here, submit :func:`child_prefill_send`
        and return at once (module docstring); :meth:`arrived` reports the request once its transfer finished.

        Raises:
            BackendError: publishing or sending failed (the half is settled, or kept held when the child may
                have the request: :func:`settle_failed_half`).
        """
        half, seq = self._hand_over(rs, dst_vtokens, lambda wire: self.worker.submit(
            _HERE + "child_prefill_send", rs.rid, rs.req.input_tokens, wire, self.peer, self.deadline_s,
            self.timeout_s, self.after))
        if not self._submitted:
            self._head_since = time.monotonic()
        self._submitted.append(_Submitted(rs.rid, half, seq))

    def in_flight(self) -> list[int]:
        """The submitted requests not reported by :meth:`arrived` yet, in submission order."""
        return [s.request_id for s in self._submitted]

    def arrived(self, allowed: Collection[int] | None = None, wait_s: float = 0.0) -> list[Arrival]:
        """The submitted requests whose replies arrived, in submission order, each half completed (its lease
        released) — up to the first request not in ``allowed`` (``None``: any): a request outside it stays in
        flight, leased. Never blocks with ``wait_s`` 0; otherwise waits up to ``wait_s`` seconds for the first.
        A request short of prefill room comes back with ``figures`` None (its half completed, nothing sent).

        Raises:
            WorkerTimeout: the child did not answer the first request within its bound (two transfer timeouts
                plus :data:`CALL_MARGIN_S` from when the child could start on it). WorkerDied, or the child's
                error for the first request. On any of them the first request's half is settled or kept as
                :func:`settle_failed_half` says, and every later one is kept held (settled once the child is
                gone, :meth:`close`); none of them is in flight any more.
        """
        out: list[Arrival] = []
        while self._submitted and (allowed is None or self._submitted[0].request_id in allowed):
            head = self._submitted[0]
            try:
                with self.timer.phase("transfer"):
                    self.b.progress()  # type: ignore[union-attr]
                    got = self.worker.poll(head.seq, 0.0 if out else wait_s, progress=self.b.progress)  # type: ignore[union-attr]
                    if not got:
                        bound = 2 * self.timeout_s + CALL_MARGIN_S
                        if time.monotonic() - self._head_since > bound:
                            from umalloc.backends.worker import WorkerTimeout

                            raise WorkerTimeout(f"prefill child (pid {self.worker.pid}): no reply for request "
                                                f"{head.request_id} within {bound:.3g} s")
                        break
                    res = cast(dict, self.worker.result(head.seq))
            except BaseException as exc:
                self._submitted.popleft()
                self._settle_or_keep(head.half, exc)
                for rest in self._submitted:   # the child may still write them: held until it is gone
                    self.worker.discard(rest.seq)
                    if _child_gone(exc):
                        self._settle_or_keep(rest.half, exc)
                    else:
                        self.kept_halves.append(rest.half)
                self._submitted.clear()
                self.worker.discard(head.seq)
                raise
            self._submitted.popleft()
            self._head_since = time.monotonic()
            for phase, secs in res["phases"].items():   # the child's own split, measured there
                self.timer.seconds[phase] += secs
            self._stats = res["stats"]
            head.half.complete()
            if res["short"]:
                out.append(Arrival(head.request_id, None, res["extra"]))
                continue
            self.bytes_filled += res["filled"]
            held = res["leases_at_post"] + self.decode.leases_active() + 1
            self.max_leases = max(self.max_leases, held)
            f = res["plan"]
            out.append(Arrival(head.request_id, PlanFigures(f["bytes_total"], f["bytes_by_vector"], f["descriptors"],
                                                            f["runs"], f["per_layer_per_page"]), res["extra"]))
        return out

    def _settle_or_keep(self, half: ReceiverHalf, exc: BaseException) -> None:
        if not settle_failed_half(half, exc):
            self.kept_halves.append(half)

    # ---- observers ---------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """The child's allocator stats as of its last reply (``EndStats`` fields as attributes)."""
        return {n: SimpleNamespace(**d) for n, d in self._stats["ends"].items()}

    def leases_active(self) -> int:
        return int(self._stats["leases_active"])

    def lease_counts(self) -> dict[str, int]:
        return {"leases_taken": int(self._stats["leases_taken"]),
                "leases_expired": int(self._stats["leases_expired"]),
                "leases_in_doubt": int(self._stats["leases_in_doubt"])}

    def check_invariants(self) -> None:
        self._stats = self._call("child_check")
        self.b.check_invariants()  # type: ignore[union-attr]

    def close(self, *, interrupted: bool = False) -> None:
        """End the child, settle every half it might still have written (kept ones, and submitted requests not
        reported yet) once it is confirmed gone (its engine can write no more), and close the receiving backend
        (idempotent). ``interrupted`` (Ctrl-C): the child is killed at once instead of being asked to finish and
        close its engine (which waits for its transfers)."""
        try:
            for sub in self._submitted:   # still in flight: the child may write them until it is gone
                self.worker.discard(sub.seq)
                self.kept_halves.append(sub.half)
            self._submitted.clear()
            if interrupted:
                self.worker.kill()
            self.worker.close()
            if not self.worker.alive():
                from umalloc.backends.worker import WorkerDied

                kept, self.kept_halves = self.kept_halves, []
                for half in kept:
                    half.settle(WorkerDied(f"prefill child (pid {self.worker.pid}) ended"))
        finally:
            if self.b is not None:
                self.b.close()


__all__ = ["CALL_MARGIN_S", "RemotePrefill", "adopt_prefill_side", "child_check", "child_finish",
           "child_finish_all", "child_prefill_send", "child_setup", "child_start", "settle_failed_half"]
