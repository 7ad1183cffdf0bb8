"""PD fault soak across two processes: the replay's :class:`~umalloc_replay.single.remote.RemotePrefill` (a
spawned prefill process over ``nixl`` or ``mooncake``) killed with SIGKILL while its KV is in flight, restarted,
and decode cancellations while KV is in flight.

:func:`remote_fault_soak` runs steps as :func:`umalloc_replay.faults.fault_soak` does, with the prefill side in
a real child process (its arena from :func:`umalloc_replay.faults.fault_spec`, built by :func:`child_setup_faults`):
decode preallocates, the child allocates, fills, plans and posts (``RemotePrefill.start``); then at most one
fault:

* **prefill killed** -- the child gets SIGKILL after posting; ``finish_all`` fails, every receiver half of the
  step is settled once the child is confirmed gone (``RemotePrefill.close``), decode's pages are freed without
  being decoded, a new child is started, the requests are retried on it.
* **decode cancelled** -- after the step's transfers finish, one request is freed on decode without being read
  (the transfer still landed in its pages: the cancellation came while it was in flight) and reported cancelled.

The stall of :func:`~umalloc_replay.faults.fault_soak` (a settable lease clock) has no equivalent here: the
child's leases run on the wall clock. At the end no page or lease on decode, none in the last child (its own
stats), and no child process left (every one ever started has exited).

Threading: one thread (the parent); the child is the worker's process.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field

import torch

from umalloc import Arena, MultiEndedAllocator
from umalloc.errors import UmallocValueError
from umalloc_replay.faults import fault_spec
from umalloc_replay.report import PhaseTimer
from umalloc_replay.single.kvfill import KVPattern
from umalloc_replay.single.prefill import alloc_sequence
from umalloc_replay.single.remote import RemotePrefill, adopt_prefill_side
from umalloc_replay.trace import TraceRequest
from umalloc_replay.workload import RequestState, first_kept_page

#: Fault kinds of the two-process soak.
REMOTE_FAULTS = ("prefill_killed", "decode_cancelled")


def child_setup_faults(ctx, pages: int, seed: int) -> dict:
    """Inside the child: the prefill arena of :func:`~umalloc_replay.faults.fault_spec` (``pages`` slots per
    end) and the pattern of ``seed``. Returns the child's stats."""
    spec = fault_spec(pages)
    torch.set_num_threads(1)
    return adopt_prefill_side(ctx, MultiEndedAllocator(Arena(spec, zero=False), compaction="lazy"),
                              KVPattern(spec, seed))


@dataclass
class RemoteFaultResult:
    """What one :func:`remote_fault_soak` run did and left."""

    backend: str
    seed: int
    requests: int = 0
    steps: int = 0
    seconds: float = 0.0
    completed: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    retries: int = 0
    injected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REMOTE_FAULTS, 0))
    survived: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REMOTE_FAULTS, 0))
    requests_hit: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REMOTE_FAULTS, 0))
    children: list[int] = field(default_factory=list)       # pids of every prefill process started
    bytes_verified: int = 0
    mismatched_pages: int = 0
    leaks: dict[str, int] = field(default_factory=dict)


def _verify(dec: MultiEndedAllocator, pattern: KVPattern, rid: int, vt: torch.Tensor, n: int) -> tuple[int, int]:
    import numpy as np

    from umalloc.geometry.spec import pages_for_tokens
    bad = checked = 0
    for e in dec.spec.ends:
        ps = e.page_size
        sp = np.arange(first_kept_page(dec.spec, e.name, n), pages_for_tokens(n, ps), dtype=np.int64)
        vp = torch.div(vt[torch.from_numpy(sp * ps)], ps, rounding_mode="floor")
        r = pattern.verify_pages(dec.arena, e.name, rid, sp, dec.translate_pages(vp, e.name))
        bad += r.mismatched_pages
        checked += r.checked_bytes
    return bad, checked


def remote_fault_soak(backend: str, num_requests: int, seed: int, *, p_kill: float = 0.03,
                      p_cancel: float = 0.06, max_attempts: int = 4, max_batch: int = 4, max_prompt: int = 60,
                      pages: int = 96, minutes: float | None = None, log=None) -> RemoteFaultResult:
    """Run ``num_requests`` seeded requests through a prefill child over ``backend`` with the faults above.

    Raises:
        UmallocValueError: bad counts or probabilities (as :func:`~umalloc_replay.faults.fault_soak`).
        BackendUnavailable: ``backend`` cannot start here.
    """
    if num_requests < 1 or max_attempts < 1 or max_batch < 1:
        raise UmallocValueError(f"num_requests={num_requests}, max_attempts={max_attempts}, "
                                f"max_batch={max_batch}: allowed >= 1 each")
    if not (0.0 <= p_kill <= 1.0 and 0.0 <= p_cancel <= 1.0 and p_kill + p_cancel <= 1.0):
        raise UmallocValueError(f"p_kill={p_kill}, p_cancel={p_cancel}: allowed in [0, 1], summing to at most 1")
    rng = random.Random(seed)
    res = RemoteFaultResult(backend, seed)
    spec = fault_spec(pages)
    pattern = KVPattern(spec, seed)
    dec = MultiEndedAllocator(Arena(spec, zero=False), compaction="lazy")
    timer = PhaseTimer()

    def start_child() -> RemotePrefill:
        pre = RemotePrefill(backend, spec, dec, timer, model="", page_size=0, draft=False, seed=seed,
                            compaction="lazy", padded=False, transfer_timeout_s=30.0, lease_deadline_s=60.0,
                            setup=("umalloc_replay.faults_remote:child_setup_faults", (pages, seed)))
        res.children.append(pre.worker.pid)
        return pre

    pre = start_child()
    lengths = [rng.randint(1, max_prompt) for _ in range(num_requests)]
    waiting = list(range(num_requests))[::-1]
    attempts = dict.fromkeys(range(num_requests), 0)
    t0 = time.perf_counter()
    deadline = None if minutes is None else t0 + 60 * minutes
    try:
        while waiting:
            if deadline is not None and time.perf_counter() >= deadline and res.requests:
                waiting[:] = [r for r in waiting if attempts[r] > 0]
                if not waiting:
                    break
            step: list[tuple[int, torch.Tensor, object]] = []
            while waiting and len(step) < max_batch:
                rid = waiting[-1]
                n = lengths[rid]
                vt = alloc_sequence(dec, n)
                if vt is None:
                    break
                ticket = pre.start(RequestState(TraceRequest(rid, 0.0, n, 1, ())), vt)
                if ticket is None:      # the child's arena is short: nothing changed there
                    dec.free(vt)
                    break
                waiting.pop()
                res.requests += attempts[rid] == 0
                attempts[rid] += 1
                step.append((rid, vt, ticket))
            if not step:
                raise RuntimeError(f"step {res.steps}: nothing could be admitted with {len(waiting)} waiting")
            u = rng.random()
            fault = "prefill_killed" if u < p_kill else "decode_cancelled" if u < p_kill + p_cancel else None
            if fault is not None:
                res.injected[fault] += 1
            if fault == "prefill_killed":
                os.kill(pre.worker.pid, signal.SIGKILL)
                try:
                    pre.finish_all([t for _r, _v, t in step])
                    raise AssertionError("finish_all succeeded with the prefill process killed")
                except AssertionError:
                    raise
                except BaseException:   # the dead child: every half settled or kept until close confirms it gone
                    pass
                pre.close()
                for rid, vt, _t in step:
                    dec.free(vt)        # never decoded
                    res.requests_hit[fault] += 1
                    if attempts[rid] >= max_attempts:
                        res.failed.append(rid)
                    else:
                        res.retries += 1
                        waiting.append(rid)
                pre = start_child()
            else:
                pre.finish_all([t for _r, _v, t in step])
                if fault == "decode_cancelled":
                    rid, vt, _t = step.pop(rng.randrange(len(step)))
                    dec.free(vt)
                    res.cancelled.append(rid)
                    res.requests_hit[fault] += 1
                for rid, vt, _t in step:
                    bad, checked = _verify(dec, pattern, rid, vt, lengths[rid])
                    res.mismatched_pages += bad
                    res.bytes_verified += checked
                    res.completed.append(rid)
                    dec.free(vt)
            dec.check_invariants()
            pre.check_invariants()
            res.steps += 1
            if fault is not None:
                res.survived[fault] += 1
            if log is not None and res.steps % 200 == 0:
                log(f"  step {res.steps}: {res.requests} requests, {len(res.completed)} completed, "
                    f"faults {res.injected}")
        res.seconds = time.perf_counter() - t0
        st = dec.stats().values()
        res.leaks["decode_pages"] = sum(s.live_pages + s.pending_pages for s in st)
        res.leaks["decode_leases"] = dec.leases_active()
        res.leaks["prefill_pages"] = sum(s.live_pages + s.pending_pages for s in pre.stats().values())
        res.leaks["prefill_leases"] = pre.leases_active()
    finally:
        pre.close()
    res.leaks["processes_left"] = sum(_alive(pid) for pid in res.children)
    return res


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def remote_summary(res: RemoteFaultResult) -> str:
    return (f"backend={res.backend} seed={res.seed} requests={res.requests} steps={res.steps} "
            f"seconds={res.seconds:.1f} completed={len(res.completed)} cancelled={len(res.cancelled)} "
            f"failed={len(res.failed)} retries={res.retries} prefill processes={len(res.children)} "
            f"faults injected={sum(res.injected.values())} survived={sum(res.survived.values())} "
            f"verified={res.bytes_verified} B mismatched pages={res.mismatched_pages} "
            f"leaks={sum(res.leaks.values())} {res.leaks}")


__all__ = ["REMOTE_FAULTS", "RemoteFaultResult", "child_setup_faults", "remote_fault_soak", "remote_summary"]
