"""PD fault soak: the replay's prefill -> decode hand-off under a dying prefill, a stalled peer and cancellations.

:func:`fault_soak` runs many requests through the replay's own pieces (``alloc_sequence``, ``fill_sequence``,
the :class:`~umalloc_replay.single.kvfill.KVPattern`, :func:`umalloc.build_plan` leasing both sides, the
``local`` backend) in steps: each step admits a few requests (decode preallocates, prefill allocates, fills and
plans), may inject one fault, then posts every plan still alive and completes it; decode verifies every page it
received and frees the request. Faults (seeded, one at most per step):

* **prefill killed** -- the prefill side dies with the step's plans built but not posted: its arena, allocator
  and backend are dropped without finishing anything, and a new prefill side is started (a restart: a fresh
  arena, nothing of the old one reused). Decode learns it from the dead peer: each plan is failed
  (``plan.fail``: both leases are released), decode's pages are freed without being read as KV, and the request is
  retried on the new prefill side.
* **peer stalled** -- the peer answers only after the leases' deadline (the lease clock is advanced past it):
  every plan of the step reports its deadline passed (``check_deadline``), is failed, and its request retried.
* **decode cancelled** -- one request of the step is cancelled by decode while its KV is in flight
  (``plan.abort``); it is reported cancelled, never retried or decoded.

A request lost to a fault more than ``max_attempts`` times is reported failed. Every request that completes is
verified page by page against the pattern (it must be identical); a lost request's pages are also read before
they are freed, and the stale ones counted (``stale_pages_seen``: what decoding them would have read). After
every step both allocators' ``check_invariants()``; at the end no page, lease or pending page on decode or on
the (last) prefill side. The local backend keeps both sides in this process, so "killed" is the loss of every
object of the prefill side, not of an operating-system process.

Threading: one thread. Seeded (``seed``); no sleeps (the lease clock is a settable one).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from umalloc import (
    Arena,
    ArenaSpec,
    EndSpec,
    Grow,
    LayerSpec,
    MultiEndedAllocator,
    TransferPlan,
    build_plan,
    get_backend,
)
from umalloc.errors import UmallocValueError
from umalloc.geometry.spec import EndRole, pages_for_tokens
from umalloc_replay.single.kvfill import KVPattern
from umalloc_replay.single.prefill import alloc_sequence, fill_sequence
from umalloc_replay.workload import first_kept_page

#: Fault kinds, in the order the summary table lists them.
FAULTS = ("prefill_killed", "peer_stalled", "decode_cancelled")
#: Lease deadline of every plan, in seconds of the settable lease clock.
DEADLINE_S = 5.0


def fault_spec(pages: int = 96) -> ArenaSpec:
    """A small two-end arena (``full`` up, the id owner; ``swa`` down, window 8 tokens), 2-token pages of 64 B:
    ``pages`` page slots per end."""
    full = EndSpec("full", (LayerSpec.mha(2, 4),), page_size=2)
    swa = EndSpec("swa", (LayerSpec.mha(2, 4, window_tokens=8),), page_size=2, grow=Grow.DOWN, owner="full",
                  role=EndRole.SWA)
    return ArenaSpec((full, swa), arena_bytes=pages * 2 * 64)


class Clock:
    """The lease clock: seconds, advanced only by :meth:`advance` (a stall)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class PrefillSide:
    """One life of the prefill side: its arena, allocator and local backend pair to decode's arena."""

    def __init__(self, spec: ArenaSpec, pattern: KVPattern, decode: MultiEndedAllocator, clock: Clock) -> None:
        self.alloc = MultiEndedAllocator(Arena(spec, zero=False), compaction="lazy", clock=clock)
        self.pattern = pattern
        self.decode = decode
        self.src = get_backend("local")
        self.dst = get_backend("local")
        self.src.register(self.alloc.arena.regions())
        self.dst.register(decode.arena.regions())
        self.peer = self.src.connect(self.dst.metadata())

    def close(self) -> None:
        self.src.close()
        self.dst.close()


@dataclass
class Flight:
    """A request whose KV is on its way: decode's tokens, prefill's tokens, the plan (both leases)."""

    rid: int
    length: int
    dst_vt: torch.Tensor
    src_vt: torch.Tensor
    plan: TransferPlan


@dataclass
class FaultSoakResult:
    """What one :func:`fault_soak` run did and left."""

    seed: int
    requests: int = 0
    steps: int = 0
    seconds: float = 0.0
    completed: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)          # lost more than max_attempts times
    retries: int = 0
    injected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0))
    survived: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0))
    requests_hit: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0))
    prefill_lives: int = 1
    bytes_verified: int = 0
    mismatched_pages: int = 0                                   # on completed requests: must be 0
    stale_pages_seen: int = 0                                   # on lost requests (never decoded)
    leaks: dict[str, int] = field(default_factory=dict)


def _pages(spec: ArenaSpec, end: str, vt: torch.Tensor, length: int) -> tuple[np.ndarray, torch.Tensor]:
    """Sequence pages ``lo .. hi`` a request of ``length`` tokens holds on ``end`` and their virtual pages."""
    ps = spec.end(end).page_size
    lo, hi = first_kept_page(spec, end, length), pages_for_tokens(length, ps)
    sp = np.arange(lo, hi, dtype=np.int64)
    return sp, torch.div(vt[torch.from_numpy(sp * ps)], ps, rounding_mode="floor")


def _verify(dec: MultiEndedAllocator, pattern: KVPattern, f: Flight) -> tuple[int, int]:
    """(mismatched pages, checked bytes) of ``f``'s pages on decode against the pattern."""
    bad = checked = 0
    for e in dec.spec.ends:
        sp, vp = _pages(dec.spec, e.name, f.dst_vt, f.length)
        r = pattern.verify_pages(dec.arena, e.name, f.rid, sp, dec.translate_pages(vp, e.name))
        bad += r.mismatched_pages
        checked += r.checked_bytes
    return bad, checked


def _live(alloc: MultiEndedAllocator) -> tuple[int, int]:
    """(live + pending pages over every end, active leases)."""
    st = alloc.stats().values()
    return sum(s.live_pages + s.pending_pages for s in st), alloc.leases_active()


def fault_soak(num_requests: int, seed: int, *, p_kill: float = 0.04, p_stall: float = 0.04,
               p_cancel: float = 0.06, max_attempts: int = 4, max_batch: int = 4, max_prompt: int = 60,
               minutes: float | None = None, log=None) -> FaultSoakResult:
    """Run ``num_requests`` seeded requests (prompts 1 .. ``max_prompt`` tokens) through the hand-off with
    faults; ``p_*``: the chance that a step injects each fault; ``minutes``: stop admitting after that long.

    Raises:
        UmallocValueError: ``num_requests`` < 1, a probability outside [0, 1] or summing above 1,
            ``max_attempts`` < 1, ``max_batch`` < 1.
    """
    if num_requests < 1 or max_attempts < 1 or max_batch < 1:
        raise UmallocValueError(f"num_requests={num_requests}, max_attempts={max_attempts}, "
                                f"max_batch={max_batch}: allowed >= 1 each")
    if not all(0.0 <= p <= 1.0 for p in (p_kill, p_stall, p_cancel)) or p_kill + p_stall + p_cancel > 1.0:
        raise UmallocValueError(f"p_kill={p_kill}, p_stall={p_stall}, p_cancel={p_cancel}: allowed in [0, 1], "
                                "summing to at most 1")
    rng = random.Random(seed)
    res = FaultSoakResult(seed)
    spec = fault_spec()
    pattern = KVPattern(spec, seed)
    clock = Clock()
    dec = MultiEndedAllocator(Arena(spec, zero=False), compaction="lazy", clock=clock)
    base_dec = _live(dec)
    pre = PrefillSide(spec, pattern, dec, clock)
    base_pre = _live(pre.alloc)
    lengths = [rng.randint(1, max_prompt) for _ in range(num_requests)]
    waiting = list(range(num_requests))[::-1]     # a stack: pop() takes the lowest id; retries go back on top
    attempts = dict.fromkeys(range(num_requests), 0)
    t0 = time.perf_counter()
    deadline = None if minutes is None else t0 + 60 * minutes

    def lose(f: Flight, why: str, exc: BaseException) -> None:
        """Fail ``f``'s plan (both leases are released), count its stale pages, free decode's pages; retry or fail it."""
        f.plan.fail(exc)
        bad, _ = _verify(dec, pattern, f)      # read only to count: these pages are never decoded
        res.stale_pages_seen += bad
        dec.free(f.dst_vt)
        res.requests_hit[why] += 1
        if attempts[f.rid] >= max_attempts:
            res.failed.append(f.rid)
        else:
            res.retries += 1
            waiting.append(f.rid)

    while waiting:
        if deadline is not None and time.perf_counter() >= deadline and res.requests:
            # no new request; the ones already admitted once still finish (retries included)
            waiting[:] = [r for r in waiting if attempts[r] > 0]
            if not waiting:
                break
        # ---- admit: decode preallocates, prefill allocates, fills and plans
        step: list[Flight] = []
        while waiting and len(step) < max_batch:
            rid = waiting[-1]
            n = lengths[rid]
            dst_vt = alloc_sequence(dec, n)
            if dst_vt is None:
                break
            src_vt = alloc_sequence(pre.alloc, n)
            if src_vt is None:
                dec.free(dst_vt)
                break
            waiting.pop()
            if attempts[rid] == 0:
                res.requests += 1
            attempts[rid] += 1
            fill_sequence(pre.alloc, pattern, rid, src_vt, n)
            plan = build_plan(str(rid), pre.alloc, src_vt, dec, dst_vt, deadline_s=DEADLINE_S)
            step.append(Flight(rid, n, dst_vt, src_vt, plan))
        if not step:
            raise RuntimeError(f"step {res.steps}: nothing could be admitted with {len(waiting)} requests waiting "
                               "and nothing in flight (an arena too small for one request)")
        # ---- one fault at most, while the step's KV is in flight
        u = rng.random()
        fault = "prefill_killed" if u < p_kill else "peer_stalled" if u < p_kill + p_stall else \
            "decode_cancelled" if u < p_kill + p_stall + p_cancel else None
        if fault is not None:
            res.injected[fault] += 1
        if fault == "prefill_killed":
            dead = ConnectionError("prefill process died")
            for f in step:
                lose(f, fault, dead)
            step = []
            pre.close()                      # the dead side's objects go; nothing of it is reused
            pre = PrefillSide(spec, pattern, dec, clock)
            res.prefill_lives += 1
            base_pre = _live(pre.alloc)
        elif fault == "peer_stalled":
            clock.advance(DEADLINE_S + 1.0)
            kept = []
            for f in step:
                if f.plan.check_deadline():
                    lose(f, fault, TimeoutError(f"request {f.rid}: peer answered after the lease deadline"))
                    pre.alloc.free(f.src_vt)
                else:
                    kept.append(f)
            step = kept
        elif fault == "decode_cancelled":
            f = step.pop(rng.randrange(len(step)))
            f.plan.abort()
            dec.free(f.dst_vt)
            pre.alloc.free(f.src_vt)
            res.cancelled.append(f.rid)
            res.requests_hit[fault] += 1
        # ---- post and complete what is left; decode verifies every page, then frees
        for f in step:
            handle = pre.src.submit(f.plan, pre.peer)
            try:
                pre.src.wait(handle, 10.0)
            finally:
                pre.src.forget(handle)
            bad, checked = _verify(dec, pattern, f)
            res.mismatched_pages += bad
            res.bytes_verified += checked
            res.completed.append(f.rid)
            pre.alloc.free(f.src_vt)
            dec.free(f.dst_vt)
        dec.check_invariants()
        pre.alloc.check_invariants()
        res.steps += 1
        if fault is not None:
            res.survived[fault] += 1      # the step after the fault ended with both sides' invariants held
        if log is not None and res.steps % 1000 == 0:
            log(f"  step {res.steps}: {res.requests} requests, {len(res.completed)} completed, "
                f"faults {res.injected}")
    res.seconds = time.perf_counter() - t0
    pages, leases = _live(dec)
    res.leaks["decode_pages"] = pages - base_dec[0]
    res.leaks["decode_leases"] = leases - base_dec[1]
    pages, leases = _live(pre.alloc)
    res.leaks["prefill_pages"] = pages - base_pre[0]
    res.leaks["prefill_leases"] = leases - base_pre[1]
    pre.close()
    return res


def fault_table(res: FaultSoakResult) -> str:
    """A markdown table: per fault kind, injected, survived, and the requests it hit."""
    rows = ["| fault | injected | survived | requests hit | what happened to them |", "| --- | --- | --- | --- | --- |"]
    fate = {"prefill_killed": "plans failed, decode pages freed unread as KV, retried on the restarted prefill",
            "peer_stalled": "deadline passed: plans failed, retried",
            "decode_cancelled": "plan aborted, reported cancelled"}
    for k in FAULTS:
        rows.append(f"| {k} | {res.injected[k]} | {res.survived[k]} | {res.requests_hit[k]} | {fate[k]} |")
    return "\n".join(rows)


def summary(res: FaultSoakResult) -> str:
    return (f"seed={res.seed} requests={res.requests} steps={res.steps} seconds={res.seconds:.1f} "
            f"completed={len(res.completed)} cancelled={len(res.cancelled)} failed={len(res.failed)} "
            f"retries={res.retries} prefill lives={res.prefill_lives} faults injected={sum(res.injected.values())} "
            f"survived={sum(res.survived.values())} verified={res.bytes_verified} B "
            f"mismatched pages={res.mismatched_pages} stale pages seen (not decoded)={res.stale_pages_seen} "
            f"leaks={sum(res.leaks.values())}")


__all__ = ["DEADLINE_S", "FAULTS", "FaultSoakResult", "fault_soak", "fault_spec", "fault_table", "summary"]
