"""The ``umalloc replay`` driver: a real trace through a prefill arena and a decode arena, every byte verified.

Policy (docs/architecture.md, "The main job"; the scheduler is a simplified SGLang-style PD loop):

* **Arrival.** Requests are admitted strictly in trace order (head of line), as soon as memory allows and the
  decode batch has room (``max_batch``). Trace timestamps do not pace the replay: it runs as fast as the
  machine allows, so memory, not time, decides concurrency.
* **Prefill** (one arena, one allocator; in a second process for ``nixl`` / ``mooncake``) allocates the prompt
  on the target and draft ends and only the SWA window tail on the SWA end (``bind=`` + ``bind_end``, the one
  SWA formula, F19), and fills every page with the deterministic pattern (:mod:`umalloc_replay.single.kvfill`).
* **Decode preallocates** the same shape (full + SWA tail + draft) before the transfer. A plan
  (:func:`umalloc.transfer.plan.build_plan`) leases both sides and goes through the backend. Every page of every vector
  (``target``, ``swa_tail``, ``draft``) is then read back through decode's own block table and compared with
  the pattern; the leases are released; prefill frees.
* **Decode step.** Every running request grows one token per step: SWA pages that left the window are
  tombstoned first (``unbind_end``), then one ``alloc_decode`` call covers the whole batch, then the new
  token's rows are written on every end. A request that produced ``output_tokens`` tokens is re-verified
  (every live page of every end: the bytes survived compaction moves and retraction) and freed.
* **Memory pressure** (Note [Shortfall in the replay]): the allocator runs its shortfall ladder (lazy compaction
  within its move budget) inside each allocation. If a decode step is still short while transfers are in
  flight, the step first waits for them (a *lease wait*: their leases pin pages compaction may not move).
  If still short, the most recently admitted request is retracted to host memory (SGLang's retraction) and
  restored, ahead of new admissions, when memory frees. Admission waits when either arena is short. The
  replay never crashes for lack of memory and never drops a request; a request that cannot fit even in an
  empty arena is refused up front with a clear error.
* **Transfers overlap the decode step:** a step submits the admitted requests' plans, runs the decode step for
  the running batch while their leases are held, then completes and verifies them. (The ``local`` backend copies
  inside ``submit``, so its plans finish before the decode step; ``nixl`` and ``mooncake`` really overlap.)

Note [Admission reserve]
~~~~~~~~~~~~~~~~~~~~~~~~
Admission and restore keep back, per end, ``ratio x`` the pages every admitted request still needs to reach its
peak (its prompt plus ``output_tokens``; SWA capped at the window), the way SGLang's scheduler reserves
``new_token_ratio x`` the remaining new tokens. The ratio starts at :data:`RATIO_INIT`, decays by
:data:`RATIO_DECAY` per decode step down to :data:`RATIO_MIN`, and rises by :data:`RATIO_RETRACT_STEP` per
retraction, so admission becomes cautious after memory ran short and bold again while it does not.

Note [Stranded space]
~~~~~~~~~~~~~~~~~~~~~
A float end (the SWA end between the full end growing up and the draft end growing down, or the draft end
under an SWA end at the top) sits where its band was placed, so free bytes on one side of it cannot serve the
end on the other side: a lone request whose end runs into the float band is short although the arena has room
(seen with Gemma-3-12B, whose SWA pages are 5x the full end's). Unless the allocator's ladder relocates the band, the replay re-places the request: retract it
(host copy, free) and restore it into the emptied arena, where every end is placed afresh (``replacements``).

Note [Shortfall in the replay]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
::

    decode step short ──> allocator ladder (lazy compaction, in alloc_decode)
         │ still short
         ├─ transfers in flight? ──> wait for them (lease wait), retry
         │ still short
         ├─ retract the newest running request (host copy, free) ──> retry ...
         │ one request left, still short
         └─ re-place it: retract + restore into the emptied arena (Note [Stranded space]) ──> retry once
    admission short ──> wait (admission wait); retracted requests are restored before any new admission
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from umalloc import (
    ARENA_ALIGN_BYTES,
    Arena,
    ArenaSpec,
    InvariantError,
    MultiEndedAllocator,
    SpecError,
    UmallocValueError,
)
from umalloc.geometry.presets import preset_ends
from umalloc.geometry.spec import pages_for_tokens
from umalloc_replay import DEFAULT_REQUESTS, DEFAULT_TOKEN_SCALE
from umalloc_replay.preflight import check_host_memory
from umalloc_replay.report import SCHEMA_VERSION, PhaseTimer, Timeline, check_report
from umalloc_replay.signals import cleanup_shielded
from umalloc_replay.single.config import ReplayConfig, default_arena_bytes
from umalloc_replay.single.fit import (
    check_slice_fits,
    decode_peak_pages,
    request_peak_bytes,
    request_prompt_bytes,
    slice_needs_bytes,
)
from umalloc_replay.single.kvfill import KVPattern, VerifyResult
from umalloc_replay.single.layouts import (
    byte_accounting,
    padded_ends,
    parse_layout,
    sglang_swa_evicted_to,
    static_budget_pages,
    vllm_blocks,
)
from umalloc_replay.single.prefill import LocalPrefill, alloc_sequence, swa_ends, warm_up
from umalloc_replay.trace import check_slice_rows, load_trace
from umalloc_replay.workload import (
    DONE,
    RETRACTED,
    RUNNING,
    TRANSFERRING,
    BlockTable,
    RequestState,
    first_kept_page,
    pages_held,
)

#: vllm layout: the carrier arena's bytes over the decode bytes vLLM's count is taken on (large enough that the
#: carrier never binds before the count: Note [vLLM's block accounting] in umalloc_replay.single.layouts).
VLLM_CARRIER_FACTOR = 4

#: Note [Admission reserve]: initial, minimum, per-step decay and per-retraction rise of the reserve ratio.
RATIO_INIT = 0.5
RATIO_MIN = 0.1
RATIO_DECAY = 0.005
RATIO_RETRACT_STEP = 0.25


# ==== the replay ================================================================================================


class Replay:
    """One replay run. Build it, call :meth:`run`, get the report dict."""

    def __init__(self, cfg: ReplayConfig, *, on_progress: Callable[[dict], None] | None = None) -> None:
        asked = cfg.requests
        self.cfg = cfg = cfg.resolved()
        token_scale = cfg.token_scale
        assert token_scale is not None, "ReplayConfig.resolved() fills token_scale"
        self.trace = load_trace(cfg.trace, token_scale=token_scale, max_requests=cfg.requests,
                                fmt=cfg.trace_format, skip=cfg.skip)
        check_slice_rows(self.trace, asked, cfg.skip)
        self.layout = parse_layout(cfg.layout)
        natural = preset_ends(cfg.model, page_size=cfg.page_size, draft=cfg.draft, draft_sliding=cfg.draft_sliding)
        ends = padded_ends(natural) if self.layout.name == "padded" else natural
        self.natural_page_bytes = {e.name: e.page_bytes for e in natural}
        owners = [e.name for e in ends if e.is_owner]
        if len(owners) != 1:
            raise UmallocValueError(f"model={cfg.model!r} with page_size={cfg.page_size}: the replay drives one "
                                    f"id owner, the preset has {owners}")
        pre_b, dec_b = default_arena_bytes(natural, self.trace)  # one size for every layout
        pre_b = cfg.prefill_arena_bytes or pre_b
        dec_b = cfg.decode_arena_bytes or dec_b
        self.prefill_arena_bytes = pre_b // ARENA_ALIGN_BYTES * ARENA_ALIGN_BYTES
        self.decode_arena_bytes = dec_b // ARENA_ALIGN_BYTES * ARENA_ALIGN_BYTES
        self.pre_spec = self._arena_spec(ends, "prefill", self.prefill_arena_bytes, pre_b)
        #: vllm layout: vLLM's block pool over the decode bytes (Note [vLLM's block accounting] in
        #: umalloc_replay.single.layouts), enforced as a block budget over a carrier arena of
        #: VLLM_CARRIER_FACTOR times the bytes, which never binds first; None for the other layouts.
        self.vllm = (vllm_blocks(natural, self._arena_spec(ends, "decode", self.decode_arena_bytes,
                                                           dec_b).usable_bytes())
                     if self.layout.name == "vllm" else None)
        carrier = VLLM_CARRIER_FACTOR * self.decode_arena_bytes if self.vllm is not None else self.decode_arena_bytes
        self.dec_spec = self._arena_spec(ends, "decode", carrier, dec_b)
        #: Static layout: pages each end may hold (Note [SGLang's static SWA split]); None: no budget.
        self.budget = (static_budget_pages(self.dec_spec, self.layout.swa_full_tokens_ratio)  # type: ignore[arg-type]
                       if self.layout.name == "static" else None)
        max_tokens = max(r.input_tokens + r.output_tokens for r in self.trace)
        # at most max_batch requests, and never more than the slice, hold a row of the block table
        self.table_rows = min(cfg.max_batch, len(self.trace))
        self._check_vllm_fits(token_scale)
        self._check_memory(max_tokens)
        self.on_progress = on_progress
        self.timer = PhaseTimer()
        self.pattern = KVPattern(self.dec_spec, cfg.seed)
        self.dec_arena = Arena(self.dec_spec, zero=False)  # every byte read back is written first
        self.dec = MultiEndedAllocator(self.dec_arena, compaction=cfg.compaction)
        warm_up(self.dec)
        check_slice_fits(self.trace, self.dec_spec, self.pre_spec, compaction=cfg.compaction,
                         token_scale=token_scale, budget=self.budget,
                         layout_label=self.layout.label)
        self.prefill = self._make_prefill()
        self.owner = owners[0]
        self.swa = swa_ends(self.dec_spec)
        self.table = BlockTable(self.table_rows, max_tokens)
        self.states = [RequestState(r) for r in self.trace]
        self.waiting: deque[RequestState] = deque(self.states)
        self.retracted: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.inflight: list[tuple[RequestState, object]] = []
        self.step = 0
        self.done = 0
        self.timeline = Timeline(tuple(self.pre_spec.end_names), tuple(self.dec_spec.end_names))
        self.c = dict.fromkeys((
            "bytes_moved", "bytes_verified", "bytes_verified_final", "bytes_decode_written", "mismatch_pages",
            "mismatch_bytes", "descriptors", "runs", "per_layer", "plans", "desc_max", "admission_waits",
            "lease_waits", "retractions", "restores", "alloc_retries", "max_running", "tokens_generated",
            "max_leases", "replacements", "wrong_pool_bytes", "wrong_pool_waits"), 0)
        self._short_ends: list[str] = []
        self._step_waits = 0
        self._step_retractions = 0
        self._step_restores = 0
        self.cap = {"running_sum": 0, "steps": 0, "held_bytes_sum": 0, "held_bytes_peak": 0,
                    "padding_bytes_sum": 0, "padding_bytes_peak": 0}
        self.bytes_by_vector: dict[str, int] = {}
        self.new_token_ratio = RATIO_INIT
        self._moves_seen = {"prefill": 0, "decode": 0}
        self._pre_live_mid: dict[str, int] | None = None
        self._step_leases = 0
        self._events = {"prefill": 0, "decode": 0}

    # ---- setup ---------------------------------------------------------------------------------------------
    def _arena_spec(self, ends: tuple, side: str, nbytes: int, asked: int) -> ArenaSpec:
        """The ``side`` arena's spec of ``nbytes``; an arena too small to hold even its floor is refused naming
        the option, the side, the bytes passed (``asked``, before rounding down to :data:`ARENA_ALIGN_BYTES`)
        and the bytes this slice needs there."""
        try:
            return ArenaSpec(ends, arena_bytes=nbytes)
        except SpecError as exc:
            if exc.field != "arena_bytes":
                raise
            need = slice_needs_bytes(ends, self.trace, side)
            probe = ArenaSpec(ends, arena_bytes=1 << 40)
            least = probe.floor_bytes + sum(e.page_bytes for e in ends)
            raise UmallocValueError(
                f"--arena-bytes: the {side} arena of {asked:,} bytes is too small (its floor and one page per "
                f"end alone take {least:,} bytes); this slice needs at least {need:,} bytes on the {side} side: "
                f"allowed --arena-bytes PREFILL,DECODE with {side.upper()} >= {need:,}") from None

    def _make_prefill(self) -> LocalPrefill:
        cfg = self.cfg
        if cfg.backend == "local":
            return LocalPrefill(self.pre_spec, self.pattern, self.dec, self.timer, compaction=cfg.compaction,
                                transfer_timeout_s=cfg.transfer_timeout_s, lease_deadline_s=cfg.lease_deadline_s)
        from umalloc_replay.single.remote import RemotePrefill

        return RemotePrefill(cfg.backend, self.pre_spec, self.dec, self.timer, model=cfg.model,  # type: ignore
                             page_size=cfg.page_size, draft=cfg.draft, seed=cfg.seed, compaction=cfg.compaction,
                             padded=self.layout.name == "padded", draft_sliding=cfg.draft_sliding,
                             transfer_timeout_s=cfg.transfer_timeout_s, lease_deadline_s=cfg.lease_deadline_s)

    def _check_memory(self, max_tokens: int) -> None:
        """Refuse, before anything is allocated, arenas and a block table larger than the host's available
        memory (:func:`umalloc_replay.preflight.check_host_memory`)."""
        big = max(self.trace, key=lambda r: r.input_tokens + r.output_tokens)
        hint = ("smaller --arena-bytes, a larger --token-scale, fewer --requests, or a slice without request "
                f"{big.request_id} ({big.input_tokens} prompt + {big.output_tokens} output tokens, the longest)")
        # the vllm layout's carrier is allocated unzeroed (pages the OS commits on first write) and its bands
        # write about the bytes vLLM's count admits: it is counted at twice the decode bytes, not its whole span
        decode = min(self.dec_spec.arena_bytes, 2 * self.decode_arena_bytes)
        check_host_memory({"prefill arena": self.prefill_arena_bytes, "decode arena": decode,
                           "block table": self.table_rows * max_tokens * 8}, hint)

    # ---- scheduler pieces ----------------------------------------------------------------------------------
    def _held_pages(self) -> dict[str, int]:
        """Pages every decode end holds now (live and pending: both occupy the end's pool)."""
        return {n: st.live_pages + st.pending_pages for n, st in self.dec.stats().items()}

    def _within_budget(self, need: dict[str, int], held: dict[str, int] | None = None) -> bool:
        """Static layout: whether ``need`` more pages per end stay inside every end's budget (always true for
        the other layouts). ``held``: pages held now (default: :meth:`_held_pages`)."""
        if self.budget is None:
            return True
        held = self._held_pages() if held is None else held
        short = [e for e, n in need.items() if held.get(e, 0) + n > self.budget[e]]
        if short:
            self._short_ends = short
        return not short

    def _vllm_fits(self, extra_blocks: int, tokens: dict[int, int] | None = None) -> bool:
        """vllm layout: whether the requests holding decode memory (running and in flight, at ``tokens[rid]``
        slots or their ``seq_len``) plus ``extra_blocks`` fit vLLM's pool (always true for the other layouts)."""
        if self.vllm is None:
            return True
        tokens = tokens or {}
        held = sum(self.vllm.held(tokens.get(rs.rid, rs.seq_len))
                   for rs in [*self.running, *(r for r, _ in self.inflight)])
        return held + extra_blocks <= self.vllm.free_at_start

    def _vllm_reserve(self) -> int:
        """vllm layout: Note [Admission reserve] in vLLM blocks: ``ratio x`` the blocks every admitted request
        may still add up to its peak."""
        if self.vllm is None:
            return 0
        return sum(math.ceil(self.new_token_ratio * max(0, self.vllm.peak(rs.req.input_tokens, rs.req.output_tokens)
                                                        - self.vllm.held(rs.seq_len)))
                   for rs in [*self.running, *(r for r, _ in self.inflight)])

    def _check_vllm_fits(self, token_scale: int) -> None:
        """vllm layout: refuse a slice with a request whose peak blocks exceed vLLM's whole pool."""
        if self.vllm is None:
            return
        big = max(self.trace, key=lambda r: self.vllm.peak(r.input_tokens, r.output_tokens))  # type: ignore[union-attr]
        need = self.vllm.peak(big.input_tokens, big.output_tokens)
        if need > self.vllm.free_at_start:
            raise UmallocValueError(
                f"request {big.request_id} ({big.input_tokens} prompt + {big.output_tokens} output tokens after "
                f"token scale {token_scale}) needs {need} vLLM blocks of {self.vllm.block_bytes:,} B at its peak; "
                f"the decode arena of {self.decode_arena_bytes:,} bytes holds {self.vllm.free_at_start} (--layout "
                "vllm): allowed a larger decode --arena-bytes or a larger --token-scale")

    def _reserve_pages(self) -> dict[str, int]:
        """Pages per end held back for the growth of admitted requests (Note [Admission reserve])."""
        out = dict.fromkeys(self.dec_spec.end_names, 0)
        ratio = self.new_token_ratio
        for rs in [*self.running, *(r for r, _ in self.inflight)]:
            for e in self.dec_spec.ends:
                grow = decode_peak_pages(self.dec_spec, e.name, rs.req.input_tokens, rs.req.output_tokens,
                                         sglang=self.budget is not None) - \
                    pages_held(self.dec_spec, e.name, rs.seq_len)
                out[e.name] += math.ceil(ratio * max(0, grow))
        return out

    def _admit(self) -> None:
        """Restore retracted requests, then admit waiting ones in trace order, while memory allows with the
        reserve of Note [Admission reserve]."""
        cfg = self.cfg
        while self.retracted:
            rs = self.retracted[0]
            if len(self.running) + len(self.inflight) >= cfg.max_batch:
                return
            kv = rs.retracted
            assert kv is not None, "a request in the retracted queue holds its host copy"
            reserve = self._reserve_pages()
            need = {e: n + reserve[e] for e, n in kv.pages_by_end().items()}
            with self.timer.phase("allocator"):
                ok = self._vllm_fits(self._vllm_reserve() + (self.vllm.held(rs.seq_len) if self.vllm else 0)) and \
                    self.dec.can_alloc(need) and self._within_budget(need)
                new_vt = self.dec.restore(kv) if ok else None
            if new_vt is None:
                self._admission_wait(need)
                return
            self.retracted.popleft()
            rs.slot = self.table.acquire()
            self.table.write(rs.slot, 0, new_vt.cpu())
            rs.retracted = None
            rs.state = RUNNING
            self.running.append(rs)
            self.c["restores"] += 1
            self._step_restores += 1
        while self.waiting and len(self.running) + len(self.inflight) < cfg.max_batch:
            rs = self.waiting[0]
            L = rs.req.input_tokens
            reserve = self._reserve_pages()
            need = {e.name: pages_held(self.dec_spec, e.name, L) + reserve[e.name] for e in self.dec_spec.ends}
            with self.timer.phase("allocator"):
                ok = self._vllm_fits(self._vllm_reserve() + (self.vllm.held(L) if self.vllm else 0)) and \
                    self.dec.can_alloc(need) and self._within_budget(need)
                vt = alloc_sequence(self.dec, L) if ok else None
            if vt is None:
                self._admission_wait(need)
                return
            ticket = self.prefill.start(rs, vt)
            if ticket is None:  # prefill arena short: undo decode's preallocation, wait
                with self.timer.phase("allocator"):
                    self.dec.free(vt)
                self._admission_wait({})
                return
            self.waiting.popleft()
            rs.slot = self.table.acquire()
            self.table.write(rs.slot, 0, vt)
            rs.seq_len = L
            rs.swa_lo_page = {e: first_kept_page(self.dec_spec, e, L) for e in self.swa}
            rs.state = TRANSFERRING
            rs.admitted_step = self.step
            self.inflight.append((rs, ticket))
            self.c["max_leases"] = max(self.c["max_leases"], self.prefill.max_leases)

    def _admission_wait(self, need: dict[str, int]) -> None:
        """Count an admission wait; under static pools, add the free bytes of the pools that were not short
        (bytes lost to the wrong pool) when the arena as a whole had room for ``need``."""
        self.c["admission_waits"] += 1
        self._step_waits += 1
        if self.budget is None or not need or not self.dec.can_alloc(need):
            return
        held = self._held_pages()
        short = set(self._short_ends)
        self.c["wrong_pool_bytes"] += sum((self.budget[e] - held[e]) * self.dec_spec.end(e).page_bytes
                                          for e in self.budget if e not in short and self.budget[e] > held[e])
        self.c["wrong_pool_waits"] += 1

    def _complete_inflight(self) -> None:
        """Wait for every submitted transfer, verify every page of every vector on decode, free prefill."""
        figs = self.prefill.finish_all([ticket for _rs, ticket in self.inflight])
        for (rs, _ticket), fig in zip(self.inflight, figs, strict=True):
            res = self._verify_received(rs)
            self.c["bytes_moved"] += fig.bytes_total
            self.c["bytes_verified"] += res.checked_bytes
            self.c["mismatch_pages"] += res.mismatched_pages
            self.c["mismatch_bytes"] += res.mismatched_bytes
            self.c["descriptors"] += fig.descriptors
            self.c["desc_max"] = max(self.c["desc_max"], fig.descriptors)
            self.c["runs"] += fig.runs
            self.c["per_layer"] += fig.per_layer_per_page
            self.c["plans"] += 1
            for n, b in fig.bytes_by_vector.items():
                self.bytes_by_vector[n] = self.bytes_by_vector.get(n, 0) + b
            rs.state = RUNNING
            self.running.append(rs)
        self.inflight.clear()

    def _verify_received(self, rs: RequestState) -> VerifyResult:
        """Every page the transfer wrote, read through decode's block table, against the pattern."""
        L = rs.req.input_tokens
        total = VerifyResult(0)
        with self.timer.phase("verify"):
            for e in self.dec_spec.ends:
                ps = e.page_size
                lo = first_kept_page(self.dec_spec, e.name, L)
                hi = pages_for_tokens(L, ps)
                vp = self.table.vpages(rs.slot, ps, lo, hi)
                pp = self.dec.translate_pages(vp, e.name)
                total = total + self.pattern.verify_pages(self.dec_arena, e.name, rs.rid,
                                                          np.arange(lo, hi, dtype=np.int64), pp)
        return total

    def _verify_final(self, rs: RequestState) -> VerifyResult:
        """Every live page of every end of a finished request: whole pages the prompt filled or decode completed,
        token by token for a partial last decode page."""
        L, n = rs.req.input_tokens, rs.seq_len
        total = VerifyResult(0)
        with self.timer.phase("verify"):
            for e in self.dec_spec.ends:
                ps = e.page_size
                lo = rs.swa_lo_page.get(e.name, 0)
                whole_hi = max(pages_for_tokens(L, ps), n // ps)
                if whole_hi > lo:
                    vp = self.table.vpages(rs.slot, ps, lo, whole_hi)
                    total = total + self.pattern.verify_pages(
                        self.dec_arena, e.name, rs.rid, np.arange(lo, whole_hi, dtype=np.int64),
                        self.dec.translate_pages(vp, e.name))
                tail_lo = max(whole_hi * ps, lo * ps)
                if tail_lo < n:
                    pos = np.arange(tail_lo, n, dtype=np.int64)
                    pt = self.dec.translate(self.table.row(rs.slot, n)[tail_lo:n].clone(), e.name)
                    total = total + self.pattern.verify_tokens(self.dec_arena, e.name, rs.rid, pos, pt)
        return total

    def _unbind_swa(self, batch: list[RequestState], new_lens: np.ndarray) -> None:
        """Tombstone the pages of every SWA end that leave its window at the new lengths (before allocating: F18);
        each end has its own window and its own first bound page per request."""
        for end in self.swa:
            e = self.dec_spec.end(end)
            ps, w = e.page_size, e.window_tokens
            toks = []
            for rs, n in zip(batch, new_lens.tolist(), strict=True):
                was = rs.swa_lo_page[end]
                if self.budget is not None:  # SGLang's pools free out-of-window tokens in batches of 128
                    lo = sglang_swa_evicted_to(n, was * ps, w, ps, decoded=rs.generated) // ps  # type: ignore[arg-type]
                else:
                    lo = self.dec.swa_tail_start(n, w, 0, ps) // ps  # type: ignore[arg-type]
                if lo > was:
                    toks.append(self.table.table[rs.slot, was * ps: lo * ps: ps])
                    rs.swa_lo_page[end] = lo
            if toks:
                with self.timer.phase("allocator"):
                    self.dec.unbind_end(end, torch.cat(toks))

    def _retract_one(self) -> bool:
        """Retract the most recently admitted running request (host copy + free); raise the admission reserve.
        False if at most one request runs."""
        if len(self.running) <= 1:
            return False
        self.new_token_ratio = min(1.0, self.new_token_ratio + RATIO_RETRACT_STEP)
        victim = max(self.running, key=lambda r: (r.admitted_step, r.rid))
        self.running.remove(victim)
        with self.timer.phase("allocator"):
            victim.retracted = self.dec.retract(self.table.row(victim.slot, victim.seq_len).clone())
        self.table.release(victim.slot)
        victim.slot = -1
        victim.state = RETRACTED
        self.retracted.append(victim)
        self.c["retractions"] += 1
        self._step_retractions += 1
        return True

    def _replace_alone(self) -> None:
        """The one running request is short although its peak fits the empty arena: free space is stranded
        between bands (Note [Stranded space]). Retract it and restore it at once into the emptied arena, which
        places every end afresh."""
        (rs,) = self.running
        with self.timer.phase("allocator"):
            kv = self.dec.retract(self.table.row(rs.slot, rs.seq_len).clone())
            new_vt = self.dec.restore(kv)
        if new_vt is None:
            raise InvariantError(f"decode step {self.step}: request {rs.rid} cannot be restored into an empty "
                                 "decode arena it fit before")
        self.table.write(rs.slot, 0, new_vt.cpu())
        self.c["replacements"] += 1

    def _decode_step(self) -> None:
        """One token for every running request (Note [Shortfall in the replay])."""
        if not self.running:
            return
        replaced = False
        while True:
            batch = list(self.running)
            seq = np.array([r.seq_len for r in batch], dtype=np.int64)
            self._unbind_swa(batch, seq + 1)  # idempotent: only pages not unbound yet
            slots = np.array([r.slot for r in batch], dtype=np.int64)
            last = self.table.gather(slots, seq - 1)
            step_need = self._step_need(seq)
            with self.timer.phase("allocator"):
                fits = self._within_budget(step_need) and \
                    self._vllm_fits(0, {r.rid: n + 1 for r, n in zip(batch, seq.tolist(), strict=True)})
                out = self.dec.alloc_decode(torch.from_numpy(seq + 1), last) if fits else None
            if out is not None:
                break
            self.c["alloc_retries"] += 1
            if self.inflight:
                # in-flight transfers pin pages (their leases): wait for them, they join this step's batch
                self.c["lease_waits"] += 1
                self._complete_inflight()
                continue
            if self._retract_one():
                continue
            if replaced:
                raise InvariantError(f"decode step {self.step}: request {batch[0].rid} cannot grow even alone in a "
                                     "freshly placed arena (the up-front fit check should have refused it)")
            self._replace_alone()
            replaced = True
        self.new_token_ratio = max(RATIO_MIN, self.new_token_ratio - RATIO_DECAY)
        out = out.clone()
        for rs, slot, s, vt in zip(batch, slots.tolist(), seq.tolist(), out.tolist(), strict=True):
            self.table.table[slot, s] = vt
            rs.seq_len = s + 1
            rs.generated += 1
        rids = np.array([r.rid for r in batch], dtype=np.int64)
        with self.timer.phase("fill"):
            for e in self.dec_spec.ends:
                with self.timer.phase("translate_plan"):
                    pt = self.dec.translate(out, e.name)
                self.c["bytes_decode_written"] += self.pattern.fill_tokens(self.dec_arena, e.name, rids, seq, pt)
        self.c["tokens_generated"] += len(batch)

    def _step_need(self, seq: np.ndarray) -> dict[str, int]:
        """Pages one decode step adds per end: one for each request whose next token starts a page."""
        if self.budget is None:
            return {}
        return {e.name: int((seq % e.page_size == 0).sum()) for e in self.dec_spec.ends}

    def _finish_requests(self) -> None:
        still = []
        for rs in self.running:
            if not rs.finished:
                still.append(rs)
                continue
            if self.cfg.verify_final:
                res = self._verify_final(rs)
                self.c["bytes_verified_final"] += res.checked_bytes
                self.c["mismatch_pages"] += res.mismatched_pages
                self.c["mismatch_bytes"] += res.mismatched_bytes
            with self.timer.phase("allocator"):
                self.dec.free(self.table.row(rs.slot, rs.seq_len).clone())
            self.table.release(rs.slot)
            rs.slot = -1
            rs.state = DONE
            self.done += 1
        self.running = still

    def _sample_mid_step(self) -> None:
        """After admission: the prefill side holds this step's prompts and the plans' leases are taken (the
        end-of-step sample would see both back at zero)."""
        self._pre_live_mid = {k: v.live_pages for k, v in self.prefill.stats().items()}
        self._step_leases = max(self._step_leases, self.prefill.step_leases,
                                self.dec.leases_active() + self.prefill.leases_active())
        self.prefill.step_leases = 0

    def _sample(self) -> None:
        """One timeline point per step: decode occupancy at the end of the step, prefill occupancy and the most
        leases held during the step (:meth:`_sample_mid_step`), compaction moves so far on both sides."""
        ds = self.dec.stats()
        ps = self.prefill.stats()
        t = self.timer.total()
        moves_total = 0
        for side, st in (("prefill", ps), ("decode", ds)):
            moved = sum(s.pages_moved for s in st.values())
            if moved > self._moves_seen[side]:
                self.timeline.add_compaction_event(self.step, t, side, moved - self._moves_seen[side])
                self._events[side] += 1
                self._moves_seen[side] = moved
            moves_total += moved
        leases = max(self._step_leases, self.dec.leases_active() + self.prefill.leases_active())
        self._step_leases = 0
        self.c["max_leases"] = max(self.c["max_leases"], leases)
        self.c["max_running"] = max(self.c["max_running"], len(self.running))
        pre_live = self._pre_live_mid or {k: v.live_pages for k, v in ps.items()}
        self._pre_live_mid = None
        self.timeline.add(self.step, t, self.done, leases, moves_total, pre_live,
                          {k: v.live_pages for k, v in ds.items()})
        self.timeline.add_scheduler_events(self.step, self._step_waits, self._step_retractions, self._step_restores)
        self._step_waits = self._step_retractions = self._step_restores = 0
        acc = byte_accounting(self.dec_spec, ds, self.natural_page_bytes)
        if self.vllm is not None:  # what vLLM's pool holds, not the carrier
            acc["held_bytes"] = self.vllm.block_bytes * sum(
                self.vllm.held(rs.seq_len) for rs in [*self.running, *(r for r, _ in self.inflight)])
        cap = self.cap
        cap["steps"] += 1
        cap["running_sum"] += len(self.running)
        cap["held_bytes_sum"] += acc["held_bytes"]
        cap["held_bytes_peak"] = max(cap["held_bytes_peak"], acc["held_bytes"])
        cap["padding_bytes_sum"] += acc["padding_bytes"]
        cap["padding_bytes_peak"] = max(cap["padding_bytes_peak"], acc["padding_bytes"])

    # ---- the loop ------------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Run the replay to the end and return the report (see :mod:`umalloc_replay.report`).

        Raises:
            InvariantError: a broken invariant of either allocator, or a replay that stopped making progress.
        """
        total = len(self.states)
        idle_steps = 0
        interrupted = False
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # Note [Token loop] in umalloc_replay.single.kvfill: many mid-sized ops, one thread
        try:
            self._sample()
            while self.done < total:
                self.step += 1
                self._admit()
                self._sample_mid_step()
                self._decode_step()
                self._complete_inflight()
                self._finish_requests()
                self._sample()
                if self.cfg.check_every and self.step % self.cfg.check_every == 0:
                    self.dec.check_invariants()
                    self.prefill.check_invariants()
                if self.on_progress is not None:
                    self.on_progress(self.progress_figures())
                idle_steps = idle_steps + 1 if not (self.running or self.inflight) else 0
                if idle_steps > 2:
                    head = self.retracted[0] if self.retracted else self.waiting[0]
                    if self.cfg.compaction == "off":  # freed space is never compacted: bands need not retreat
                        raise UmallocValueError(
                            f"step {self.step}: nothing runs and request {head.rid} cannot be admitted into the "
                            "emptied arenas with --compaction off (freed pages are never compacted away): allowed "
                            "--compaction lazy, or larger --arena-bytes")
                    raise InvariantError(f"step {self.step}: nothing runs and request {head.rid} cannot be "
                                         "admitted into empty arenas")
            self.dec.check_invariants()
            self.prefill.check_invariants()
            return self.report()
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            torch.set_num_threads(threads)
            with cleanup_shielded():  # a second Ctrl-C or SIGTERM does not cut the cleanup short
                # after Ctrl-C nothing of the run is kept: the second process is ended at once, not asked to
                # finish its transfers and close its engine
                self.prefill.close(interrupted=interrupted)

    def progress_figures(self) -> dict:
        t = self.timer.total()
        tokens = sum(r.req.input_tokens for r in self.states if r.state in (RUNNING, RETRACTED, DONE)) + \
            self.c["tokens_generated"]
        return {"done": self.done, "total": len(self.states), "moved_bytes": self.c["bytes_moved"],
                "tokens": tokens, "tokens_per_s": tokens / t if t > 0 else 0.0, "running": len(self.running),
                "step": self.step}

    # ---- report --------------------------------------------------------------------------------------------
    def _capacity(self) -> dict:
        """The layout comparison's figures (decode side), see :data:`umalloc_replay.report.REPORT_SCHEMA`."""
        cap, n = self.cap, max(1, self.cap["steps"])
        waits = self.c["wrong_pool_waits"]
        return {"layout": self.layout.label, "steps": self.step, "max_running": self.c["max_running"],
                "mean_running": cap["running_sum"] / n, "admission_waits": self.c["admission_waits"],
                "retractions": self.c["retractions"], "peak_held_bytes": cap["held_bytes_peak"],
                "mean_held_bytes": cap["held_bytes_sum"] / n, "peak_padding_bytes": cap["padding_bytes_peak"],
                "mean_padding_bytes": cap["padding_bytes_sum"] / n,
                "wrong_pool_waits": waits, "mean_wrong_pool_bytes": self.c["wrong_pool_bytes"] / max(1, waits),
                "budget_pages": dict(self.budget or {})}

    def report(self) -> dict:
        cfg, c = self.cfg, self.c
        split = self.timer.split()
        total_s = split["total"]
        prompt = sum(r.input_tokens for r in self.trace)
        generated = c["tokens_generated"]
        plans = max(1, c["plans"])
        ds, ps = self.dec.stats(), self.prefill.stats()

        def occ(stats: dict, spec: ArenaSpec) -> dict:
            return {n: {"capacity_pages": spec.num_page_slots(n) - spec.first_page(n),
                        "peak_live_pages": s.peak_live_pages, "peak_live_bytes": s.peak_live_bytes,
                        "page_bytes": s.page_bytes} for n, s in stats.items()}

        def comp(stats: dict, side: str) -> dict:
            return {"moves_pages": sum(s.pages_moved for s in stats.values()),
                    "moved_bytes": sum(s.bytes_moved for s in stats.values()), "events": self._events[side]}

        def final(stats: dict) -> dict:
            return {n: {"live_pages": s.live_pages, "pending_pages": s.pending_pages} for n, s in stats.items()}

        dlt, plt = self.dec.lease_table, self.prefill.lease_counts()
        report = {
            "schema": SCHEMA_VERSION,
            "ok": True,
            "config": {
                "trace": self.trace.path, "trace_format": self.trace.format, "model": cfg.model,
                "page_size": cfg.page_size, "prefill_arena_bytes": self.prefill_arena_bytes,
                "decode_arena_bytes": self.decode_arena_bytes, "backend": cfg.backend,
                "requests": len(self.trace), "token_scale": cfg.token_scale, "draft": cfg.draft, "seed": cfg.seed,
                "max_batch": cfg.max_batch, "compaction": cfg.compaction, "skip": cfg.skip,
                "layout": self.layout.label, "draft_sliding": cfg.draft_sliding,
                "ends": [{"name": e.name, "role": e.role.value, "grow": e.grow.value, "owner": e.owner,
                          "layers": len(e.layers), "page_size": e.page_size, "entry_bytes": e.entry_bytes,
                          "page_bytes": e.page_bytes, "window_tokens": e.window_tokens} for e in self.dec_spec.ends],
            },
            "requests": {"total": len(self.states), "completed": self.done, "retracted": c["retractions"],
                         "restored": c["restores"], "admission_waits": c["admission_waits"],
                         "max_running": c["max_running"]},
            "tokens": {"prompt": prompt, "generated": generated, "total": prompt + generated,
                       "zero_prompts_as_1": self.trace.zero_prompts, "zero_outputs_as_1": self.trace.zero_outputs},
            "bytes": {"moved": c["bytes_moved"], "verified": c["bytes_verified"],
                      "moved_by_vector": dict(self.bytes_by_vector),
                      "filled": self.prefill.bytes_filled, "verified_final": c["bytes_verified_final"],
                      "decode_written": c["bytes_decode_written"]},
            "mismatches": {"pages": c["mismatch_pages"], "bytes": c["mismatch_bytes"]},
            "descriptors": {
                "total": c["descriptors"], "runs_total": c["runs"], "per_layer_per_page_total": c["per_layer"],
                "plans": c["plans"], "per_request_mean": c["descriptors"] / plans, "per_request_max": c["desc_max"],
                "runs_per_request_mean": c["runs"] / plans,
                "per_layer_per_page_per_request_mean": c["per_layer"] / plans,
                "reduction_x": c["per_layer"] / max(1, c["descriptors"])},
            "compaction": {"prefill": comp(ps, "prefill"), "decode": comp(ds, "decode")},
            "leases": {"taken": dlt.leases_taken + plt["leases_taken"], "waits": c["lease_waits"],
                       "expired": dlt.leases_expired + plt["leases_expired"], "max_active": c["max_leases"],
                       "in_doubt": dlt.leases_in_doubt + plt["leases_in_doubt"]},
            "shortfall": {"alloc_retries": c["alloc_retries"], "lease_waits": c["lease_waits"],
                          "retractions": c["retractions"], "replacements": c["replacements"]},
            "occupancy": {"prefill": occ(ps, self.pre_spec), "decode": occ(ds, self.dec_spec)},
            "capacity": self._capacity(),
            "time_s": {k: float(v) for k, v in split.items()},
            "throughput": {"requests_per_s": self.done / total_s if total_s else 0.0,
                           "tokens_per_s": (prompt + generated) / total_s if total_s else 0.0,
                           "moved_gb_per_s": c["bytes_moved"] / 1e9 / total_s if total_s else 0.0},
            "end_state": {"prefill": {"ends": final(ps), "leases_active": self.prefill.leases_active()},
                          "decode": {"ends": final(ds), "leases_active": self.dec.leases_active()}},
            "timeline": self.timeline.to_dict(),
        }
        report["ok"] = not check_report({**report, "ok": True})
        return report


def run_replay(cfg: ReplayConfig, *, progress: bool = False, console: object | None = None) -> dict:
    """Run ``umalloc replay`` with ``cfg``; show a rich progress bar when ``progress``. Returns the report.

    Raises:
        UmallocValueError: bad configuration, a bad trace, or a request that cannot fit an empty arena.
    """
    if not progress:
        return Replay(cfg).run()
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (TextColumn("[bold]replay[/bold]"), BarColumn(), TextColumn("{task.completed}/{task.total} requests"),
            TextColumn("{task.fields[gb]:.2f} GB moved"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
            TextColumn("{task.fields[running]} running"), TimeElapsedColumn())

    def update(f: dict) -> None:
        bar.update(task, completed=f["done"], gb=f["moved_bytes"] / 1e9, tps=f["tokens_per_s"],
                   running=f["running"])

    replay_obj = Replay(cfg, on_progress=update)  # bad arguments raise here, before the bar is drawn
    with Progress(*cols, console=console, transient=False) as bar:  # type: ignore[arg-type]
        task = bar.add_task("replay", total=len(replay_obj.states), gb=0.0, tps=0.0, running=0)
        return replay_obj.run()


__all__ = ["DEFAULT_REQUESTS", "DEFAULT_TOKEN_SCALE", "Replay", "ReplayConfig", "default_arena_bytes",
           "request_peak_bytes", "request_prompt_bytes", "run_replay"]
