"""One rank of the multi-rank replay: its geometry, its arena and the ``child_*`` functions its process runs.

Policy:

* Every rank is a :class:`umalloc.backends.worker.BackendWorker` child (the backends' one worker harness); the
  orchestrator (:mod:`umalloc_replay.multirank.ranks`) runs the ``child_*`` functions below inside it through
  :meth:`BackendWorker.run`. A rank owns its arena (its heads, its DCP rows: :func:`rank_ends`), its allocator,
  its backend (registered, its :class:`~umalloc.transfer.PeerLayout` carrying its TP and DCP rank) and its
  :class:`~umalloc_replay.multirank.headpattern.HeadPattern`. State lives in ``ctx.objects["rank"]`` (:class:`RankState`).
* Rows (Note [Which rows travel] in :mod:`umalloc.transfer.rows`): a rank holds, per end, its local rows below
  the request length (its DCP rows on a sharded end, logical rows on the draft) and on an SWA end only the pages
  from its window tail on (:func:`alloc_rows`). Prefill fills every row it holds; decode verifies every row it
  must have (:func:`must_have_positions`: the rows :func:`~umalloc.transfer.rows.rows_of_checked` names, on an
  SWA end only the positions inside the window).
* Per request (Note [One half per source rank]): decode allocates and builds one published receiver half per
  source rank that sends to it; prefill allocates, fills, builds one send plan per half and submits it to that
  decode rank's peer (no wait); prefill then waits for its plans and frees; decode completes its halves (the
  senders' terminal reports) and verifies, then frees.
* Errors raise in the rank and travel to the orchestrator with their umalloc type; the orchestrator ends every
  rank on any failure, so a rank does not try to settle halves its peers may still write.

Note [One half per source rank]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A decode rank that receives one request from several prefill ranks (TP P2->D1: heads 0-3 from source 0, 4-7
from source 1) builds one :class:`~umalloc.transfer.ReceiverHalf` per source over the same virtual ids; their
leases pin the same pages and nest, and each is completed when its own sender reports its plan finished. Each
sender builds its plan from its own half, so the halves never share state across processes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from umalloc import (
    ARENA_ALIGN_BYTES,
    Arena,
    ArenaSpec,
    EndRole,
    EndSpec,
    InvariantError,
    MultiEndedAllocator,
    PeerLayout,
    ReceiverHalf,
    TransferPlan,
    build_receiver_half,
    build_send_plan,
)
from umalloc.geometry.presets import preset_ends
from umalloc.geometry.spec import pages_for_tokens
from umalloc.transfer.rows import is_dcp_sharded, owned_count, rows_of_checked
from umalloc_replay.multirank.headpattern import HeadPattern, RowCheck

#: Arena bytes per rank: this many times what the step's requests hold at once (placement slack for the
#: floating draft band), plus two pages of every end.
ARENA_HEADROOM = 2


def rank_ends(model: str, *, page_size: int, draft: bool, tp_size: int, dcp_size: int,
              head_groups: int = 1) -> tuple[EndSpec, ...]:
    """The ends one rank holds: preset ``model`` at ``page_size`` with the heads of one TP rank of ``tp_size``,
    ``head_groups`` where an end can take it (:func:`~umalloc.geometry.presets.preset_ends`); under DCP (``dcp_size > 1``) a draft bound to the target
    becomes its own id owner, since the target is sharded by position and the draft keeps logical rows (Note
    [DCP rows]). O(layers).

    >>> [(e.name, e.owner) for e in rank_ends("gemma-3-12b-draft", page_size=16, draft=True, tp_size=1, dcp_size=2)]
    [('full', None), ('swa', 'full'), ('draft', None)]
    """
    ends = preset_ends(model, page_size=page_size, draft=draft, tp_size=tp_size, head_groups=head_groups,
                       draft_sliding="draft")
    if dcp_size == 1:
        return ends
    return tuple(replace(e, owner=None) if e.role is EndRole.DRAFT else e for e in ends)


def total_kv_heads(model: str, draft: bool) -> dict[str, tuple[int, ...]]:
    """``{end: (global KV heads of each layer)}`` of preset ``model`` (TP 1)."""
    return {e.name: tuple(x.num_kv_heads for x in e.layers) for e in preset_ends(model, draft=draft,
                                                                                   draft_sliding="draft")}


def _end_rows(end: EndSpec, L: int, dcp_size: int, dcp_rank: int) -> tuple[int, int]:
    """Local rows ``[lo, hi)`` of ``end`` a rank holds for a request of ``L`` tokens (``dcp_*`` already ``(1, 0)``
    for an unsharded end): every row below ``L``'s, from the window tail's page on an SWA end."""
    lo, hi = rows_of_checked(end, L, 0, dcp_size, dcp_rank)
    return (lo // end.page_size * end.page_size if end.window_tokens is not None else 0), hi


def rank_arena_bytes(ends: tuple[EndSpec, ...], max_tokens: int, batch: int, dcp_size: int, dcp_rank: int) -> int:
    """Arena bytes for ``batch`` requests of up to ``max_tokens`` tokens on one rank (:data:`ARENA_HEADROOM`
    times the pages they hold, every SWA page counted since :func:`alloc_rows` binds them before it unbinds the
    head, plus the floor and two pages per end), rounded up to :data:`ARENA_ALIGN_BYTES`. O(ends)."""
    floor = max(e.page_bytes for e in ends)
    need = rank_request_bytes(ends, max_tokens, dcp_size, dcp_rank) + sum(e.page_bytes for e in ends)
    total = floor + ARENA_HEADROOM * batch * need + 2 * sum(e.page_bytes for e in ends)
    return -(-total // ARENA_ALIGN_BYTES) * ARENA_ALIGN_BYTES


def rank_request_bytes(ends: tuple[EndSpec, ...], L: int, dcp_size: int, dcp_rank: int) -> int:
    """Bytes of the pages one rank binds for a request of ``L`` tokens: per end the pages of its local rows
    (its DCP rows on a sharded end), every SWA page counted since :func:`alloc_rows` binds them before it
    unbinds the head. O(ends).

    >>> e = rank_ends("gpt-oss-20b", page_size=16, draft=False, tp_size=1, dcp_size=1)
    >>> rank_request_bytes(e, 100, 1, 0) == 2 * 7 * 16 * 24576   # full and swa: 7 pages of 16 tokens each
    True
    """
    need = 0
    for e in ends:
        d, r = (dcp_size, dcp_rank) if is_dcp_sharded(e) else (1, 0)
        need += pages_for_tokens(owned_count(L, d, r), e.page_size) * e.page_bytes
    return need


def first_short(spec: ArenaSpec, dcp_size: int, dcp_rank: int, steps: list[list[int]],
                compaction: str) -> tuple[int, bool] | None:
    """Replay one rank's allocations in a probe allocator over an unzeroed arena of ``spec`` (the rank's warm-up
    request of one token, then per step ``alloc_rows`` of every request length in order and every free): the
    first index into the flattened ``steps`` whose request the arena cannot hold, with whether it fits in the
    arena alone, or ``None`` when every step fits. Deterministic, so the rank does the same; O(sum of lengths).
    Allocates the arena's bytes (virtual memory, never touched)."""
    arena = Arena(spec, zero=False)
    alloc = MultiEndedAllocator(arena, compaction=compaction)
    layout = PeerLayout.from_arena(arena, dcp_rank=dcp_rank, dcp_size=dcp_size)
    warm = alloc_rows(alloc, layout, 1)
    if warm is not None:
        free_rows(alloc, warm)
    k = 0
    for step in steps:
        held: list[dict[str, torch.Tensor]] = []
        for L in step:
            vt = alloc_rows(alloc, layout, L)
            if vt is None:
                for h in held:
                    free_rows(alloc, h)
                alone = alloc_rows(alloc, layout, L)
                if alone is not None:
                    free_rows(alloc, alone)
                return k, alone is not None
            held.append(vt)
            k += 1
        for h in held:
            free_rows(alloc, h)
    return None


def alloc_rows(alloc: MultiEndedAllocator, layout: PeerLayout, L: int) -> dict[str, torch.Tensor] | None:
    """Allocate a request of ``L`` logical tokens on one rank: per id owner its local rows (its DCP rows on a
    sharded owner), binding every bound end, then unbind each SWA end's pages wholly below its window tail.

    Returns:
        ``{owner end: int64 virtual token ids of its local rows}``, or ``None`` (nothing held) if the arena is
        short.
    """
    spec = layout.spec
    out: dict[str, torch.Tensor] = {}
    zero, none = torch.zeros(1, dtype=torch.int64), torch.tensor([-1])
    for o in (e for e in spec.ends if e.is_owner):
        n = owned_count(L, *layout.dcp_for(o.name))
        vt = alloc.alloc_extend(zero, torch.tensor([n]), none, owner=o.name) if n else \
            torch.zeros(0, dtype=torch.int64)
        if vt is None:
            free_rows(alloc, out)
            return None
        out[o.name] = vt.clone()
    for e in spec.ends:
        if e.is_owner or e.window_tokens is None:
            continue
        lo, _hi = _end_rows(e, L, *layout.dcp_for(e.name))
        if lo:
            alloc.unbind_end(e.name, out[spec.owner_of(e.name)][:lo])
    return out


def free_rows(alloc: MultiEndedAllocator, vt: dict[str, torch.Tensor]) -> None:
    """Free what :func:`alloc_rows` allocated."""
    for owner, ids in vt.items():
        if ids.numel():
            alloc.free(ids, owner=owner)


def _positions(layout: PeerLayout, end: EndSpec, rows: np.ndarray) -> np.ndarray:
    d, r = layout.dcp_for(end.name)
    return rows * d + r


def must_have_positions(layout: PeerLayout, end: EndSpec, L: int) -> tuple[np.ndarray, np.ndarray]:
    """``(local rows, logical positions)`` (int64) of ``end`` a receiver must hold after a request of ``L``
    tokens arrived: the rows :func:`~umalloc.transfer.rows.rows_of_checked` names, on an end whose every layer
    slides only those whose position lies inside the window (``>= L - W``; the page-floored tail may start
    before it, and those rows need not travel). O(rows)."""
    d, r = layout.dcp_for(end.name)
    lo, hi = rows_of_checked(end, L, 0, d, r)
    rows = np.arange(lo, hi, dtype=np.int64)
    pos = rows * d + r
    if end.window_tokens is not None:
        keep = pos >= L - end.window_tokens
        rows, pos = rows[keep], pos[keep]
    return rows, pos


@dataclass
class RankState:
    """What one rank's process keeps between calls (``ctx.objects["rank"]``): its geometry and pattern; prefill:
    ``peers`` (decode index -> peer id), ``inflight`` (request -> ``[(decode index, plan, handle)]``); decode:
    ``sources`` (prefill indexes sending to it), ``halves`` (request -> {source: half}); both: ``held`` (request
    -> ``(L, vtokens by owner)``)."""

    side: str
    index: int
    spec: ArenaSpec
    arena: Arena
    alloc: MultiEndedAllocator
    layout: PeerLayout
    pattern: HeadPattern
    deadline_s: float | None
    peers: dict[int, str] = field(default_factory=dict)
    sources: list[int] = field(default_factory=list)
    held: dict[int, tuple[int, dict[str, torch.Tensor]]] = field(default_factory=dict)
    halves: dict[int, dict[int, ReceiverHalf]] = field(default_factory=dict)
    inflight: dict[int, list[tuple[int, TransferPlan, Any]]] = field(default_factory=dict)


def _state(ctx) -> RankState:
    return ctx.objects["rank"]


def child_setup(ctx, side: str, index: int, model: str, page_size: int, head_groups: int, draft: bool,
                tp_rank: int, tp_size: int, dcp_rank: int, dcp_size: int, arena_bytes: int | None, max_tokens: int,
                batch: int, compaction: str, seed: int, deadline_s: float | None) -> dict:
    """Build the rank: its ends (:func:`rank_ends`), arena (``arena_bytes``, or :func:`rank_arena_bytes` for
    ``batch`` requests of ``max_tokens``), allocator and pattern; register the arena with the rank's backend and
    publish its layout. Returns ``{"pid", "layout" (dict), "metadata" (bytes), "arena_bytes"}``."""
    torch.set_num_threads(1)
    ends = rank_ends(model, page_size=page_size, draft=draft, tp_size=tp_size, dcp_size=dcp_size,
                     head_groups=head_groups)
    nbytes = arena_bytes or rank_arena_bytes(ends, max_tokens, batch, dcp_size, dcp_rank)
    spec = ArenaSpec(ends, arena_bytes=nbytes // ARENA_ALIGN_BYTES * ARENA_ALIGN_BYTES)
    arena = Arena(spec, zero=False)  # every byte read back is written first
    alloc = MultiEndedAllocator(arena, compaction=compaction)
    layout = PeerLayout.from_arena(arena, tp_rank=tp_rank, tp_size=tp_size, dcp_rank=dcp_rank, dcp_size=dcp_size)
    warm = alloc_rows(alloc, layout, 1)  # numba kernels load now, not inside the first timed request
    if warm is not None:
        free_rows(alloc, warm)
    b = ctx._b()
    b.register(arena.regions())
    b.set_layout(layout)
    pattern = HeadPattern(spec, total_kv_heads(model, draft), tp_rank, tp_size, seed)
    ctx.objects["rank"] = RankState(side, index, spec, arena, alloc, layout, pattern, deadline_s)
    return {"pid": os.getpid(), "layout": layout.to_dict(), "metadata": b.metadata(), "arena_bytes": spec.arena_bytes}


def child_connect(ctx, peers: dict[int, bytes]) -> dict[int, str]:
    """Prefill: connect to every decode rank it sends to (``{decode index: metadata}``; the layout check of F22
    runs here). Returns ``{decode index: peer id}``."""
    st = _state(ctx)
    b = ctx._b()
    for dst, meta in sorted(peers.items()):
        st.peers[dst] = b.connect(meta)
    return dict(st.peers)


def child_sources(ctx, sources: list[int]) -> None:
    """Decode: the prefill rank indexes that send to this rank (one receiver half each per request)."""
    _state(ctx).sources = sorted(sources)


def _short(st: RankState, L: int, step: int) -> InvariantError:
    """The rank's arena cannot hold a request of ``L`` tokens in a step of ``step`` requests (the orchestrator's
    preflight refuses this before any rank starts; this is its backstop)."""
    others, fewer = (" with the step's others", " or a smaller --max-batch") if step > 1 else ("", "")
    return InvariantError(f"{st.side} rank {st.index}: its arena ({st.spec.arena_bytes:,} B) cannot hold a request "
                          f"of {L} tokens{others}: allowed a larger --arena-bytes{fewer}")


def child_decode_prepare(ctx, requests: list[tuple[int, int]]) -> dict:
    """Decode: per ``(request id, L)`` allocate the rank's rows and build one published receiver half per source
    rank (Note [One half per source rank]). Returns ``{"halves": {rid: {source: half dict}}, "alloc_s",
    "half_s"}``."""
    st = _state(ctx)
    out: dict[int, dict[int, dict]] = {}
    t_alloc = t_half = 0.0
    for rid, L in requests:
        t0 = time.perf_counter()
        vt = alloc_rows(st.alloc, st.layout, L)
        t1 = time.perf_counter()
        if vt is None:
            raise _short(st, L, len(requests))
        st.held[rid] = (L, vt)
        halves = st.halves.setdefault(rid, {})
        out[rid] = {}
        for src in st.sources:
            half = build_receiver_half(str(rid), st.alloc, vt, seq_len_tokens=L, layout=st.layout,
                                       deadline_s=st.deadline_s)
            halves[src] = half
            out[rid][src] = half.publish()
        t_alloc += t1 - t0
        t_half += time.perf_counter() - t1
    return {"halves": out, "alloc_s": t_alloc, "half_s": t_half}


def _fill(st: RankState, rid: int, L: int, vt: dict[str, torch.Tensor]) -> int:
    """Prefill: write the pattern into every row the rank holds of every end; returns bytes written."""
    total = 0
    for e in st.spec.ends:
        lo, hi = _end_rows(e, L, *st.layout.dcp_for(e.name))
        if hi <= lo:
            continue
        rows = np.arange(lo, hi, dtype=np.int64)
        ptoks = st.alloc.translate(vt[st.spec.owner_of(e.name)][lo:hi], e.name)
        total += st.pattern.fill(st.arena, e.name, rid, _positions(st.layout, e, rows), ptoks)
    return total


def child_prefill_start(ctx, items: list[tuple[int, int, dict[int, dict]]]) -> dict:
    """Prefill: per ``(request id, L, {decode index: half dict})`` allocate, fill, build one send plan per half
    and submit it to that decode rank (no wait; an empty plan finishes at once). Returns ``{"plans": {rid: {dst:
    figures}}, "filled_bytes", "alloc_s", "fill_s", "plan_s"}``."""
    st = _state(ctx)
    b = ctx._b()
    out: dict[int, dict[int, dict]] = {}
    filled = 0
    t_alloc = t_fill = t_plan = 0.0
    for rid, L, halves in items:
        t0 = time.perf_counter()
        vt = alloc_rows(st.alloc, st.layout, L)
        t1 = time.perf_counter()
        if vt is None:
            raise _short(st, L, len(items))
        st.held[rid] = (L, vt)
        filled += _fill(st, rid, L, vt)
        t2 = time.perf_counter()
        sent = st.inflight.setdefault(rid, [])
        out[rid] = {}
        for dst, half in sorted(halves.items()):
            peer = st.peers[dst]
            plan = build_send_plan(str(rid), st.alloc, vt, half, b.peer_layout(peer), src_layout=st.layout,
                                   seq_len_tokens=L, deadline_s=st.deadline_s)
            out[rid][dst] = {"descriptors": plan.num_descriptors, "bytes": plan.total_bytes, "runs": plan.num_runs,
                             "baseline_descriptors": plan.per_layer_descriptor_equivalent,
                             "bytes_by_vector": {n: s.bytes for n, s in plan.stats_by_vector.items()}}
            if plan.num_descriptors == 0:
                plan.complete()
                continue
            sent.append((dst, plan, b.submit(plan, peer)))
        t_alloc += t1 - t0
        t_fill += t2 - t1
        t_plan += time.perf_counter() - t2
    return {"plans": out, "filled_bytes": filled, "alloc_s": t_alloc, "fill_s": t_fill, "plan_s": t_plan}


def child_prefill_finish(ctx, request_ids: list[int], timeout_s: float) -> dict:
    """Prefill: wait for every plan of ``request_ids`` (each bounded by ``timeout_s``) and forget it (its source
    lease is released with it), then free the requests' rows — every wait before any free. Returns ``{"elapsed_s": {rid:
    {dst: seconds from submit to done}}, "wait_s", "alloc_s"}``. The first failure is raised once every handle
    was forgotten and every request freed."""
    st = _state(ctx)
    b = ctx._b()
    first: BaseException | None = None
    elapsed: dict[int, dict[int, float]] = {}
    t0 = time.perf_counter()
    for rid in request_ids:
        elapsed[rid] = {}
        for dst, _plan, handle in st.inflight.pop(rid, []):
            try:
                b.wait(handle, timeout_s)
                elapsed[rid][dst] = float(handle.elapsed_s or 0.0)
            except BaseException as exc:
                first = first or exc
            finally:
                b.forget(handle)
    t1 = time.perf_counter()
    for rid in request_ids:
        free_rows(st.alloc, st.held.pop(rid)[1])
    if first is not None:
        raise first
    return {"elapsed_s": elapsed, "wait_s": t1 - t0, "alloc_s": time.perf_counter() - t1}


def child_decode_finish(ctx, request_ids: list[int]) -> dict:
    """Decode: every sender reported its plan finished: complete each half (its lease is released), verify every row the
    rank must have of every vector (:func:`must_have_positions`) against the pattern, free. Returns ``{"verify":
    {rid: {vector: RowCheck fields}}, "verify_s", "alloc_s"}``."""
    st = _state(ctx)
    out: dict[int, dict[str, dict]] = {}
    t_verify = t_alloc = 0.0
    for rid in request_ids:
        for half in st.halves.pop(rid).values():
            half.complete()
        L, vt = st.held.pop(rid)
        t0 = time.perf_counter()
        out[rid] = {}
        for name, end_name in st.layout.vector_names().items():
            e = st.spec.end(end_name)
            rows, pos = must_have_positions(st.layout, e, L)
            res = RowCheck()
            if rows.size:
                ptoks = st.alloc.translate(vt[st.spec.owner_of(end_name)][torch.from_numpy(rows)], end_name)
                res = st.pattern.verify(st.arena, end_name, rid, pos, ptoks)
            out[rid][name] = vars(res)
        t1 = time.perf_counter()
        free_rows(st.alloc, vt)
        t_verify += t1 - t0
        t_alloc += time.perf_counter() - t1
    return {"verify": out, "verify_s": t_verify, "alloc_s": t_alloc}


def child_check(ctx) -> dict:
    """``check_invariants`` of the rank's allocator and backend; returns its end state ``{"live_pages",
    "pending_pages", "leases_active", "leases_taken", "leases_expired"}`` (summed over ends)."""
    st = _state(ctx)
    st.alloc.check_invariants()
    ctx._b().check_invariants()
    stats = st.alloc.stats().values()
    t = st.alloc.lease_table
    if st.held or st.inflight or st.halves:
        raise InvariantError(f"{st.side} rank {st.index}: requests {sorted(st.held)} still held after the run")
    return {"live_pages": sum(s.live_pages for s in stats), "pending_pages": sum(s.pending_pages for s in stats),
            "leases_active": st.alloc.leases_active(), "leases_taken": t.leases_taken,
            "leases_expired": t.leases_expired}


__all__ = ["ARENA_HEADROOM", "RankState", "alloc_rows", "child_check", "child_connect",
           "child_decode_finish", "child_decode_prepare", "child_prefill_finish", "child_prefill_start",
           "child_setup", "child_sources", "first_short", "free_rows", "must_have_positions", "rank_arena_bytes",
           "rank_ends", "rank_request_bytes", "total_kv_heads"]
