"""The multi-rank transfer replay: one process per rank on each side, every byte of every rank verified.

``umalloc replay --prefill-tp P --decode-tp D [--prefill-dcp M] [--decode-dcp N] [--prefill-page-size S]
--backend nixl|mooncake`` (or ``--multi-rank`` at 1 -> 1) runs this instead of the single-pair replay.

Policy:

* **Ranks.** ``P * M`` prefill ranks and ``D * N`` decode ranks, rank ``c * tp + t`` holding TP rank ``t`` and
  DCP rank ``c``; each is a :class:`~umalloc.backends.worker.BackendWorker` process with its own arena (its
  heads, its DCP rows), allocator, backend and pattern (:mod:`umalloc_replay.multirank.rankside`). This process only
  orchestrates: it holds no arena and no backend while the ranks run.
* **Preflight.** Before any process starts (:meth:`RanksConfig.resolved`, :meth:`MultiRankReplay._preflight`):
  at most :data:`MAX_RANKS_PER_SIDE` ranks a side; the arenas plus :data:`RANK_PROCESS_BYTES` per rank within the
  host's available memory; a given arena replayed once per side and DCP rank in a probe allocator (unzeroed,
  released before the ranks start) so a request it cannot hold is refused naming the side, rank, request, bytes
  and the size to pass. Errors name the side and its console option.
* **Routes.** After setup every rank's :class:`~umalloc.transfer.PeerLayout` is known here; a (prefill, decode)
  pair is a route iff :func:`~umalloc.transfer.slices.sends_to` says the source can carry bytes to it. Each
  prefill rank connects to the decode ranks of its routes (the layout check, F22, runs at connect); each decode
  rank learns its sources.
* **Requests** come from the real trace (the packaged Mooncake conversation trace by default), their prompts
  divided by ``token_scale`` and capped at ``max_prompt_tokens`` so a 2-core machine copes; output tokens are
  not decoded (this is a transfer replay). Up to ``max_batch`` requests go per step: decode prepares (rows,
  one published half per source), prefill allocates, fills, plans and submits, prefill waits and frees, decode
  completes and verifies every byte it must have (Note [One half per source rank] in
  :mod:`umalloc_replay.multirank.rankside`).
* **Verification.** A decode rank compares every byte of its slice with the head pattern
  (:mod:`umalloc_replay.multirank.headpattern`); this process checks the verified bytes against a count made here from the
  request lengths and the ranks' geometry alone (:func:`expected_bytes`), and the report
  (:mod:`umalloc_replay.multirank.ranks_report`) holds every figure per rank, per route and in total.
* Importing this module stays light (the console script imports it for its defaults): the transfer layer and
  the rank side are imported where they are used.
* **Failures end every rank.** Each call to a rank is bounded; while it runs, every other rank is watched: a
  rank that died (a SIGKILL) raises :class:`RankError` naming it, at once. Ctrl-C (SIGINT reaches only this
  process: the ranks are spawned with it ignored, :mod:`umalloc_replay.signals`) raises ``KeyboardInterrupt``.
  Either way every rank is closed (exit, then terminate, then kill) before the error leaves :meth:`run`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from umalloc import (
    ARENA_ALIGN_BYTES,
    DEFAULT_PRESET,
    PRESETS,
    ArenaSpec,
    BackendError,
    EndRole,
    InvariantError,
    UmallocValueError,
)
from umalloc_replay import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_RANK_REQUESTS, DEFAULT_RANK_TOKEN_SCALE
from umalloc_replay.multirank.ranks_report import RANKS_SCHEMA_VERSION, check_ranks_report
from umalloc_replay.preflight import is_multi_rank
from umalloc_replay.signals import cleanup_shielded, sigint_ignored
from umalloc_replay.trace import load_trace

if TYPE_CHECKING:
    from umalloc import PeerLayout

_HERE = "umalloc_replay.multirank.rankside:"
#: Seconds a rank may take to start (spawn, imports, engine) and, beyond the transfer timeout, to answer a call.
START_TIMEOUT_S = 180.0
CALL_MARGIN_S = 120.0
#: How often the other ranks are checked for life while one call runs (seconds).
WATCH_S = 0.005
#: Seconds a failed call waits for a rank to show up dead (its death may be what made the call fail).
DEATH_GRACE_S = 2.0
#: Seconds each rank gets to exit when the run ends, before it is terminated.
CLOSE_TIMEOUT_S = 10.0
#: Base address of the layouts :meth:`RanksConfig.resolved` checks (geometry only: nothing is addressed).
_PROBE_BASE = 1 << 20
#: Most ranks (processes) one side may have.
MAX_RANKS_PER_SIDE = 64
#: Host memory counted per rank process beyond its arena (interpreter, torch, the transfer engine), in bytes.
RANK_PROCESS_BYTES = 512 << 20


@dataclass(frozen=True)
class RanksConfig:
    """Everything the multi-rank replay takes.

    Attributes:
        backend: ``"nixl"`` or ``"mooncake"`` (ranks are processes; ``local`` cannot cross them).
        trace, trace_format, model, draft, seed, skip, compaction: as :class:`umalloc_replay.single.run.ReplayConfig`
            (``draft`` on a preset without a drafter means none).
        page_size: the decode ranks' page size; prefill_page_size: the prefill ranks' (``None``: the same).
        prefill_tp, decode_tp, prefill_dcp, decode_dcp: each side's TP and DCP sizes (ranks = TP x DCP).
        prefill_head_groups, decode_head_groups: each side's head groups (1: the page-major envelope; ``G > 1``
            the head-group-outer one on every end that can take it, :func:`~umalloc.geometry.presets.preset_ends`).
        prefill_arena_bytes, decode_arena_bytes: every rank's arena of that side (``None``: sized for the step,
            :func:`~umalloc_replay.multirank.rankside.rank_arena_bytes`).
        requests: trace rows replayed (``None``: :data:`DEFAULT_RANK_REQUESTS`); token_scale: prompt tokens
            divided by it (``None``: :data:`DEFAULT_RANK_TOKEN_SCALE`); max_prompt_tokens: prompts capped at it.
        max_batch: requests in flight per step.
        check_every: ``check_invariants()`` on every rank every N steps (0: at the end only).
        transfer_timeout_s: bound of each transfer wait; lease_deadline_s: deadline of both sides' leases.
    """

    backend: str = "nixl"
    trace: str | None = None
    trace_format: str | None = None
    model: str = DEFAULT_PRESET
    page_size: int = 16
    prefill_page_size: int | None = None
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_dcp: int = 1
    decode_dcp: int = 1
    prefill_head_groups: int = 1
    decode_head_groups: int = 1
    prefill_arena_bytes: int | None = None
    decode_arena_bytes: int | None = None
    requests: int | None = None
    skip: int = 0
    token_scale: int | None = None
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    draft: bool = True
    seed: int = 0
    max_batch: int = 64
    compaction: str = "lazy"
    check_every: int = 0
    transfer_timeout_s: float = 120.0
    lease_deadline_s: float | None = 600.0

    def resolved(self) -> RanksConfig:
        """Validate every field and fill the defaults. Every rank's ends and layout are built here once and
        every (prefill, decode) pair is checked compatible, so heads that do not split by a TP size, page sizes
        that do not divide, or an arena too small are refused before any process starts. A geometry error names
        the side and its option (``decode side (--decode-tp 3): invalid tp_size=3: ...``); an incompatible pair
        names both ranks, local being the prefill rank and remote the decode rank.

        Raises:
            UmallocValueError: naming the bad field and the allowed values (SpecError for the geometry,
                IncompatiblePeerError listing every difference of a pair that cannot be mapped); more than
                :data:`MAX_RANKS_PER_SIDE` ranks on a side.
        """
        if self.backend not in ("nixl", "mooncake"):
            raise UmallocValueError(f"backend={self.backend!r}: the multi-rank replay runs one process per rank; "
                                    "allowed 'nixl' or 'mooncake'")
        if self.model not in PRESETS:
            raise UmallocValueError(f"model={self.model!r}: allowed one of {sorted(PRESETS)}")
        for name in ("page_size", "prefill_tp", "decode_tp", "prefill_dcp", "decode_dcp", "prefill_head_groups",
                     "decode_head_groups", "max_prompt_tokens", "max_batch"):
            _check_int(name, getattr(self, name), 1)
        for name in ("prefill_page_size", "requests", "token_scale", "prefill_arena_bytes", "decode_arena_bytes"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        for name in ("skip", "check_every"):
            _check_int(name, getattr(self, name), 0)
        if self.compaction not in ("lazy", "eager", "off"):
            raise UmallocValueError(f"compaction={self.compaction!r}: allowed 'lazy', 'eager', 'off'")
        from umalloc import PeerLayout, Region, check_compatible
        from umalloc_replay.multirank.rankside import rank_arena_bytes, rank_ends

        d = asdict(self)
        d["prefill_page_size"] = self.page_size if self.prefill_page_size is None else self.prefill_page_size
        d["requests"] = DEFAULT_RANK_REQUESTS if self.requests is None else self.requests
        d["token_scale"] = DEFAULT_RANK_TOKEN_SCALE if self.token_scale is None else self.token_scale
        d["draft"] = self.draft and PRESETS[self.model].draft is not None
        cfg = RanksConfig(**d)
        for side in ("prefill", "decode"):
            tp, dcp, _ps, _groups = cfg.side(side)
            if tp * dcp > MAX_RANKS_PER_SIDE:
                raise UmallocValueError(f"{side} side: --{side}-tp {tp} x --{side}-dcp {dcp} = {tp * dcp} ranks: "
                                        f"allowed at most {MAX_RANKS_PER_SIDE} ranks (one process each) per side")
        probes: dict[str, list[PeerLayout]] = {}
        for side in ("prefill", "decode"):
            tp, dcp, ps, groups = cfg.side(side)
            try:
                ends = rank_ends(cfg.model, page_size=ps, draft=cfg.draft, tp_size=tp, dcp_size=dcp,
                                 head_groups=groups)
            except UmallocValueError as exc:
                raise _named(exc, f"{side} side ({cfg.side_option(side, getattr(exc, 'field', ''))})") from None
            arena = cfg.prefill_arena_bytes if side == "prefill" else cfg.decode_arena_bytes
            # an arena that cannot hold a page of every end is refused here, not in a rank
            try:
                spec = ArenaSpec(ends, arena_bytes=(arena or rank_arena_bytes(ends, 1, 1, dcp, 0))
                                 // ARENA_ALIGN_BYTES * ARENA_ALIGN_BYTES)
            except UmallocValueError as exc:
                where = f"the {side} value of --arena-bytes ({arena:,} bytes)" if arena else f"{side} side"
                raise _named(exc, where) from None
            probes[side] = [PeerLayout(spec, (Region(_PROBE_BASE, spec.arena_bytes),), _PROBE_BASE, r.tp_rank, tp,
                                       r.dcp_rank, dcp) for r in rank_ids(side, tp, dcp)]
        # the connect-time check (F22) of every pair, before any process starts
        for src, s_id in zip(probes["prefill"], cfg.ranks("prefill"), strict=True):
            for dst, d_id in zip(probes["decode"], cfg.ranks("decode"), strict=True):
                try:
                    check_compatible(src, dst)
                except UmallocValueError as exc:
                    raise _named(exc, f"{s_id.label} -> {d_id.label} (local: the prefill rank, remote: the "
                                      "decode rank)") from None
        return cfg

    def side(self, side: str) -> tuple[int, int, int, int]:
        """``(tp, dcp, page_size, head_groups)`` of ``"prefill"`` or ``"decode"`` (after :meth:`resolved`)."""
        if side == "prefill":
            return self.prefill_tp, self.prefill_dcp, self.prefill_page_size or self.page_size, \
                self.prefill_head_groups
        return self.decode_tp, self.decode_dcp, self.page_size, self.decode_head_groups

    def ranks(self, side: str) -> list[RankId]:
        """Every rank of ``side`` (:func:`rank_ids`)."""
        tp, dcp, _ps, _groups = self.side(side)
        return rank_ids(side, tp, dcp)

    def side_option(self, side: str, field: str = "") -> str:
        """The console options (with values) of ``side`` that set ``field`` (``tp_size``, ``dcp_size``,
        ``page_size``, ``head_groups``), every option of the side for another field.

        >>> RanksConfig(decode_tp=3).side_option("decode", "tp_size")
        '--decode-tp 3'
        """
        tp, dcp, ps, groups = self.side(side)
        page = "--page-size" if side == "decode" else "--prefill-page-size"
        opts = {"tp_size": f"--{side}-tp {tp}", "dcp_size": f"--{side}-dcp {dcp}", "page_size": f"{page} {ps}",
                "head_groups": f"--{side}-head-groups {groups}"}
        hit = [v for k, v in opts.items() if k in field]
        return ", ".join(hit or opts.values())


def _named(exc: UmallocValueError, where: str) -> UmallocValueError:
    """``exc`` (its type and attributes kept) with its message prefixed by ``where``."""
    exc.args = (f"{where}: {exc}",)
    return exc


def _check_int(name: str, v: object, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise UmallocValueError(f"{name}={v!r}: allowed an int >= {lo}")


@dataclass(frozen=True)
class RankId:
    """One rank: its side, index (``dcp_rank * tp_size + tp_rank``) and parallel coordinates."""

    side: str
    index: int
    tp_rank: int
    tp_size: int
    dcp_rank: int
    dcp_size: int

    @property
    def label(self) -> str:
        """``"decode rank 1 (tp 1/2, dcp 0/1)"``."""
        return (f"{self.side} rank {self.index} (tp {self.tp_rank}/{self.tp_size}, dcp {self.dcp_rank}/"
                f"{self.dcp_size})")


def rank_ids(side: str, tp_size: int, dcp_size: int) -> list[RankId]:
    """Every rank of one side, by index.

    >>> [(r.index, r.tp_rank, r.dcp_rank) for r in rank_ids("decode", 2, 2)]
    [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    """
    return [RankId(side, c * tp_size + t, t, tp_size, c, dcp_size) for c in range(dcp_size) for t in range(tp_size)]


class RankError(BackendError):
    """A rank died, did not answer in time, or failed a call; ``rank`` is its label. Every rank has been (or is
    being) ended when it propagates out of :meth:`MultiRankReplay.run`."""

    def __init__(self, rank: str, message: str) -> None:
        super().__init__(f"{rank}: {message}")
        self.rank = rank


class RankPool:
    """The rank processes of one run: spawned together, called one at a time with every other rank watched,
    closed together.

    Args:
        backend: the backend every rank runs.
        ranks: the ranks, in the order they are kept.

    Threading: the orchestrator's thread only (closing uses a thread per rank).
    """

    def __init__(self, backend: str, ranks: list[RankId]) -> None:
        from umalloc import BackendWorker

        self.ranks = list(ranks)
        self.workers: dict[RankId, BackendWorker] = {}
        try:
            with sigint_ignored():  # the ranks inherit SIGINT ignored: Ctrl-C is this process's (replay.signals)
                for r in self.ranks:
                    self.workers[r] = BackendWorker(backend)
        except BaseException:
            self.close()
            raise

    def pid(self, rank: RankId) -> int:
        return self.workers[rank].pid

    def _dead(self) -> RankId | None:
        return next((r for r in self.ranks if not self.workers[r].alive()), None)

    def _died(self, rank: RankId) -> RankError:
        w = self.workers[rank]
        code = w.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return RankError(rank.label, f"died (pid {w.pid}, {how}); every rank was ended")

    def _watch(self) -> None:
        time.sleep(WATCH_S)
        dead = self._dead()
        if dead is not None:
            raise self._died(dead)

    def wait_ready(self) -> None:
        """Block until every rank's backend is up (bounded by :data:`START_TIMEOUT_S` each)."""
        for r in self.ranks:
            self._guard(r, lambda w: w.wait_ready(timeout_s=START_TIMEOUT_S))

    def call(self, rank: RankId, fn: str, *args: object, timeout_s: float = CALL_MARGIN_S) -> Any:
        """Run ``umalloc_replay.multirank.rankside.<fn>(ctx, *args)`` in ``rank`` and return its result.

        Raises:
            RankError: ``rank`` or any other rank died, ``rank`` did not answer within ``timeout_s``, or the call
                raised in the rank (its type and message kept in the message).
        """
        return self._guard(rank, lambda w: w.run(_HERE + fn, *args, timeout_s=timeout_s, progress=self._watch))

    def _guard(self, rank: RankId, op: Callable) -> Any:
        from umalloc import WorkerDied, WorkerTimeout

        try:
            return op(self.workers[rank])
        except RankError:
            raise
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            # a failure caused by a dead peer names the dead rank; a peer may notice the disconnect before the
            # killed process can be reaped, so wait a moment for it
            dead, until = self._dead(), time.monotonic() + DEATH_GRACE_S
            while dead is None and time.monotonic() < until:
                time.sleep(WATCH_S)
                dead = self._dead()
            if dead is not None:
                raise self._died(dead) from exc
            if isinstance(exc, WorkerDied):
                raise self._died(rank) from exc
            if isinstance(exc, WorkerTimeout):
                raise RankError(rank.label, f"did not answer: {exc}; every rank was ended") from exc
            raise RankError(rank.label, f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """End every rank (``exit``, then terminate, then kill), all at once; idempotent."""
        with cleanup_shielded(), ThreadPoolExecutor(max(1, len(self.workers))) as pool:
            list(pool.map(lambda w: w.close(timeout_s=CLOSE_TIMEOUT_S), self.workers.values()))


def expected_bytes(spec: ArenaSpec, dcp_size: int, dcp_rank: int, lengths: list[int]) -> int:
    """Bytes a decode rank must hold after requests of ``lengths`` tokens, counted from the geometry alone: per end
    the positions ``x`` in ``[0, L)`` (``[L - W, L)`` where every layer slides with window ``W``) the rank keeps
    (``x % dcp_size == dcp_rank`` on a sharded end, every one on the draft), times the end's bytes per token.
    O(sum of lengths).

    >>> from umalloc_replay.multirank.rankside import rank_ends
    >>> spec = ArenaSpec(rank_ends("gpt-oss-20b", page_size=16, draft=False, tp_size=1, dcp_size=2), 1 << 24)
    >>> expected_bytes(spec, 2, 1, [200]) == (100 + 64) * 24576     # full: 100 odd positions; swa: 64 of 128
    True
    """
    total = 0
    for L in lengths:
        for e in spec.ends:
            w = e.window_tokens
            pos = np.arange(max(0, L - w) if w is not None else 0, L, dtype=np.int64)
            if e.role in (EndRole.TARGET, EndRole.SWA):
                pos = pos[pos % dcp_size == dcp_rank]
            total += int(pos.shape[0]) * e.entry_bytes
    return total


def _zero_figures() -> dict:
    return {"plans": 0, "descriptors": 0, "bytes": 0, "runs": 0, "baseline_descriptors": 0, "bytes_by_vector": {}}


def _add_plan(acc: dict, fig: dict) -> None:
    acc["plans"] += 1
    for k in ("descriptors", "bytes", "runs", "baseline_descriptors"):
        acc[k] += fig[k]
    for name, n in fig["bytes_by_vector"].items():
        acc["bytes_by_vector"][name] = acc["bytes_by_vector"].get(name, 0) + n


class MultiRankReplay:
    """One multi-rank run. Build it (validates, loads the trace slice; starts nothing), call :meth:`run`.

    Args:
        cfg: the configuration.
        on_start: called once the ranks are up, with ``[(label, pid)]``.
        on_progress: called after every step with ``(requests done, requests total)``.

    Raises:
        UmallocValueError: a bad configuration or trace.
    """

    def __init__(self, cfg: RanksConfig, *, on_start: Callable[[list[tuple[str, int]]], None] | None = None,
                 on_progress: Callable[[int, int], None] | None = None) -> None:
        self.cfg = cfg = cfg.resolved()
        requests, scale = int(cfg.requests or 0), int(cfg.token_scale or 0)  # filled by resolved()
        self.trace = load_trace(cfg.trace, token_scale=scale, max_requests=requests, fmt=cfg.trace_format,
                                skip=cfg.skip)
        if len(self.trace) < requests:
            raise UmallocValueError(f"requests={cfg.requests}: the trace {self.trace.path} holds only "
                                    f"{len(self.trace)} requests after skip={cfg.skip}: allowed "
                                    f"1..{len(self.trace)}")
        self.lengths = [min(r.input_tokens, cfg.max_prompt_tokens) for r in self.trace]
        self.prefill = rank_ids("prefill", cfg.prefill_tp, cfg.prefill_dcp)
        self.decode = rank_ids("decode", cfg.decode_tp, cfg.decode_dcp)
        self._preflight()
        self.on_start = on_start
        self.on_progress = on_progress
        #: Wall seconds of this process per phase (``total`` once the run ended).
        self.times = dict.fromkeys(("setup", "prepare", "start", "transfer", "verify", "check"), 0.0)

    def _steps(self) -> list[list[int]]:
        """The request lengths of every step, in order."""
        n = min(self.cfg.max_batch, len(self.lengths))
        return [self.lengths[lo:lo + n] for lo in range(0, len(self.lengths), n)]

    def _preflight(self) -> None:
        """Refuse, before any process starts, ranks whose arenas (plus :data:`RANK_PROCESS_BYTES` each) exceed the
        host's available memory (:func:`umalloc_replay.preflight.check_host_memory`), and a given arena that
        cannot hold a step's requests: each side's allocations are replayed once per DCP rank in a probe
        allocator (:func:`~umalloc_replay.multirank.rankside.first_short`; the TP ranks of a side share its geometry), the
        decode side first as the run does.

        Raises:
            UmallocValueError: one line naming the side, the rank, the request, the bytes it needs and what to
                pass.
        """
        from umalloc_replay.multirank.rankside import (
            first_short,
            rank_arena_bytes,
            rank_ends,
            rank_request_bytes,
        )
        from umalloc_replay.preflight import check_host_memory

        c = self.cfg
        max_tokens, batch = max(self.lengths), min(c.max_batch, len(self.lengths))
        ends: dict[str, tuple] = {}
        auto: dict[str, list[int]] = {}
        given: dict[str, int | None] = {}
        for side in ("prefill", "decode"):
            tp, dcp, ps, groups = c.side(side)
            ends[side] = rank_ends(c.model, page_size=ps, draft=c.draft, tp_size=tp, dcp_size=dcp,
                                   head_groups=groups)
            auto[side] = [rank_arena_bytes(ends[side], max_tokens, batch, dcp, r) for r in range(dcp)]
            arena = c.prefill_arena_bytes if side == "prefill" else c.decode_arena_bytes
            given[side] = None if arena is None else arena // ARENA_ALIGN_BYTES * ARENA_ALIGN_BYTES
        needs: dict[str, int] = {}
        for side in ("prefill", "decode"):
            tp, dcp, _ps, _groups = c.side(side)
            per = [given[side] or a for a in auto[side]]
            needs[f"{side} arenas ({tp * dcp} rank{'s' if tp * dcp > 1 else ''})"] = tp * sum(per)
        n = len(self.prefill) + len(self.decode)
        needs[f"rank processes ({n} x {RANK_PROCESS_BYTES:,})"] = n * RANK_PROCESS_BYTES
        hint = "smaller --arena-bytes" if c.prefill_arena_bytes or c.decode_arena_bytes else \
            "a smaller --max-prompt-tokens or --max-batch"
        check_host_memory(needs, f"{hint}, or fewer ranks (--prefill-tp/--decode-tp/--prefill-dcp/--decode-dcp)")
        steps = self._steps()
        for side in ("decode", "prefill"):
            have = given[side]
            if have is None:
                continue
            tp, dcp, _ps, _groups = c.side(side)
            spec = ArenaSpec(ends[side], arena_bytes=have)
            for r in range(dcp):
                short = first_short(spec, dcp, r, steps, c.compaction)
                if short is None:
                    continue
                k, alone = short
                req = self.trace.requests[k]
                rank = self.cfg.ranks(side)[r * tp]
                L = self.lengths[k]
                many = c.max_batch > 1
                why = (" with the step's others" if alone else " even alone") if many else ""
                smaller = ", a smaller --max-batch (it fits alone)" if alone and many else ""
                value = "DECODE" if side == "decode" else "PREFILL"
                raise UmallocValueError(
                    f"{side} side: request {req.request_id} ({L} prompt tokens after token scale {c.token_scale} "
                    f"and the cap of {c.max_prompt_tokens}) needs {rank_request_bytes(ends[side], L, dcp, r):,} "
                    f"bytes of pages on {rank.label}, whose arena of {have:,} bytes (--arena-bytes) cannot "
                    f"hold it{why}: allowed --arena-bytes "
                    f"PREFILL,DECODE with {value} >= {max(auto[side]):,} (or no --arena-bytes: sized for the "
                    f"step){smaller}, a larger --token-scale or a smaller --max-prompt-tokens")

    def describe(self) -> str:
        """One line naming what runs (sides, backend, trace slice, scale, cap and the prompt lengths used)."""
        c = self.cfg

        def side(name: str) -> str:
            tp, dcp, ps, groups = c.side(name)
            layout = f", {groups} head groups" if groups > 1 else ""
            return f"{name} TP {tp} x DCP {dcp} ({tp * dcp} ranks, {ps}-token pages{layout})"

        n = len(self.lengths)
        used = str(self.lengths) if n <= 12 else \
            f"{min(self.lengths)}-{max(self.lengths)} (mean {sum(self.lengths) / n:.0f})"
        return (f"multi-rank replay: {side('prefill')} -> {side('decode')}, backend {c.backend}, model {c.model}; "
                f"{n} requests of {Path(self.trace.path).name} rows {c.skip}-{c.skip + n - 1}, token scale "
                f"{c.token_scale}, prompts capped at {c.max_prompt_tokens} tokens: {used} tokens; seed {c.seed}")

    # ---- the run -------------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Start every rank, replay the slice, check every rank, end every rank; return the report
        (:mod:`umalloc_replay.multirank.ranks_report`).

        Raises:
            RankError: a rank died, timed out or failed (every rank is ended first). KeyboardInterrupt: Ctrl-C
                (every rank is ended first).
        """
        t_start = time.perf_counter()
        pool = RankPool(self.cfg.backend, self.prefill + self.decode)
        try:
            self._setup(pool)
            if self.on_start is not None:
                self.on_start([(r.label, pool.pid(r)) for r in pool.ranks])
            step_size = min(self.cfg.max_batch, len(self.lengths))
            done = 0
            for step, lo in enumerate(range(0, len(self.lengths), step_size), start=1):
                batch = [(rid, self.lengths[rid]) for rid in range(lo, min(lo + step_size, len(self.lengths)))]
                self._step(pool, batch)
                done += len(batch)
                if self.cfg.check_every and step % self.cfg.check_every == 0:
                    self._check(pool)
                if self.on_progress is not None:
                    self.on_progress(done, len(self.lengths))
            self._check(pool)
            self.times["total"] = time.perf_counter() - t_start
            return self._report(pool, done)
        finally:
            pool.close()

    def _setup(self, pool: RankPool) -> None:
        from umalloc import PeerLayout, sends_to

        t0 = time.perf_counter()
        c = self.cfg
        pool.wait_ready()
        max_tokens = max(self.lengths)
        batch = min(c.max_batch, len(self.lengths))
        self.setups: dict[RankId, dict] = {}
        for r in pool.ranks:
            tp, dcp, ps, groups = c.side(r.side)
            arena = c.prefill_arena_bytes if r.side == "prefill" else c.decode_arena_bytes
            self.setups[r] = pool.call(r, "child_setup", r.side, r.index, c.model, ps, groups, c.draft, r.tp_rank, tp,
                                       r.dcp_rank, dcp, arena, max_tokens, batch, c.compaction, c.seed,
                                       c.lease_deadline_s, timeout_s=START_TIMEOUT_S)
        self.layouts = {r: PeerLayout.from_dict(self.setups[r]["layout"]) for r in pool.ranks}
        self.routes = [(p, d) for p in self.prefill for d in self.decode if sends_to(self.layouts[p], self.layouts[d])]
        for d in self.decode:
            if not any(dd == d for _p, dd in self.routes):
                raise InvariantError(f"{d.label}: no prefill rank sends to it")
        for p in self.prefill:
            peers = {d.index: self.setups[d]["metadata"] for pp, d in self.routes if pp == p}
            pool.call(p, "child_connect", peers, timeout_s=START_TIMEOUT_S)
        for d in self.decode:
            pool.call(d, "child_sources", [p.index for p, dd in self.routes if dd == d])
        self.per_rank = {r: {**_zero_figures(), "filled_bytes": 0, "verified_bytes": 0, "mismatch_bytes": 0,
                             "mismatch_rows": 0, "verified_by_vector": {},
                             "time_s": dict.fromkeys(("alloc", "fill", "plan", "transfer", "wait", "half", "verify"),
                                                     0.0)}
                         for r in pool.ranks}
        self.per_route = {(p, d): _zero_figures() for p, d in self.routes}
        self.times["setup"] += time.perf_counter() - t0

    def _step(self, pool: RankPool, batch: list[tuple[int, int]]) -> None:
        """One step's requests through the four phases, each timed."""
        t0 = time.perf_counter()
        halves = self._prepare(pool, batch)
        t1 = time.perf_counter()
        self._start(pool, batch, halves)
        t2 = time.perf_counter()
        self._finish(pool, batch)
        t3 = time.perf_counter()
        self._verify(pool, batch)
        t4 = time.perf_counter()
        for k, dt in (("prepare", t1 - t0), ("start", t2 - t1), ("transfer", t3 - t2), ("verify", t4 - t3)):
            self.times[k] += dt

    def _prepare(self, pool: RankPool, batch: list[tuple[int, int]]) -> dict[RankId, dict]:
        """Decode: rows and published halves; returns ``{decode rank: {rid: {source index: half dict}}}``."""
        halves: dict[RankId, dict] = {}
        for d in self.decode:
            res = pool.call(d, "child_decode_prepare", batch)
            halves[d] = res["halves"]
            self.per_rank[d]["time_s"]["alloc"] += res["alloc_s"]
            self.per_rank[d]["time_s"]["half"] += res["half_s"]
        return halves

    def _start(self, pool: RankPool, batch: list[tuple[int, int]], halves: dict[RankId, dict]) -> None:
        """Prefill: allocate, fill, one plan per half, submit; the plans' figures per rank and route."""
        by_index = {d.index: d for d in self.decode}
        for p in self.prefill:
            items = [(rid, L, {d.index: halves[d][rid][p.index] for pp, d in self.routes if pp == p})
                     for rid, L in batch]
            res = pool.call(p, "child_prefill_start", items)
            fig = self.per_rank[p]
            fig["filled_bytes"] += res["filled_bytes"]
            for k in ("alloc", "fill", "plan"):
                fig["time_s"][k] += res[f"{k}_s"]
            for per_dst in res["plans"].values():
                for dst, plan in per_dst.items():
                    d = by_index[dst]
                    for acc in (fig, self.per_rank[d], self.per_route[(p, d)]):
                        _add_plan(acc, plan)

    def _finish(self, pool: RankPool, batch: list[tuple[int, int]]) -> None:
        """Prefill: wait for every plan (the senders' terminal reports), free."""
        c = self.cfg
        bound = 2 * c.transfer_timeout_s * max(1, len(batch)) + CALL_MARGIN_S
        for p in self.prefill:
            res = pool.call(p, "child_prefill_finish", [rid for rid, _L in batch], c.transfer_timeout_s,
                            timeout_s=bound)
            times = self.per_rank[p]["time_s"]
            times["transfer"] += sum(s for per in res["elapsed_s"].values() for s in per.values())
            times["wait"] += res["wait_s"]
            times["alloc"] += res["alloc_s"]

    def _verify(self, pool: RankPool, batch: list[tuple[int, int]]) -> None:
        """Decode: complete the halves, verify every byte each rank must hold, free."""
        for d in self.decode:
            res = pool.call(d, "child_decode_finish", [rid for rid, _L in batch])
            fig = self.per_rank[d]
            fig["time_s"]["verify"] += res["verify_s"]
            fig["time_s"]["alloc"] += res["alloc_s"]
            for per_vec in res["verify"].values():
                for name, chk in per_vec.items():
                    fig["verified_bytes"] += chk["checked_bytes"]
                    fig["mismatch_bytes"] += chk["mismatched_bytes"]
                    fig["mismatch_rows"] += chk["mismatched_rows"]
                    fig["verified_by_vector"][name] = fig["verified_by_vector"].get(name, 0) + chk["checked_bytes"]

    def _check(self, pool: RankPool) -> None:
        t0 = time.perf_counter()
        self.end_state = {r: pool.call(r, "child_check") for r in pool.ranks}
        self.times["check"] += time.perf_counter() - t0

    # ---- report --------------------------------------------------------------------------------------------
    def _report(self, pool: RankPool, done: int) -> dict:
        c = self.cfg
        ranks = []
        for r in pool.ranks:
            lay = self.layouts[r]
            fig = self.per_rank[r]
            exp = expected_bytes(lay.spec, r.dcp_size, r.dcp_rank, self.lengths) if r.side == "decode" else 0
            peers = sorted(d.index for p, d in self.routes if p == r) if r.side == "prefill" else \
                sorted(p.index for p, d in self.routes if d == r)
            ranks.append({
                "side": r.side, "index": r.index, "tp_rank": r.tp_rank, "tp_size": r.tp_size,
                "dcp_rank": r.dcp_rank, "dcp_size": r.dcp_size, "pid": self.setups[r]["pid"],
                "page_size": lay.spec.ends[0].page_size, "arena_bytes": lay.spec.arena_bytes,
                "kv_heads": {e.name: e.layers[0].num_kv_heads for e in lay.spec.ends}, "peers": peers,
                **{k: fig[k] for k in ("plans", "descriptors", "bytes", "runs", "baseline_descriptors",
                                       "bytes_by_vector", "filled_bytes",
                                       "verified_bytes", "mismatch_bytes", "mismatch_rows", "verified_by_vector")},
                "expected_bytes": exp, "time_s": dict(fig["time_s"]), "end_state": self.end_state[r]})
        sent = [x for x in ranks if x["side"] == "prefill"]
        got = [x for x in ranks if x["side"] == "decode"]
        by_vector: dict[str, int] = {}
        for x in sent:
            for name, n in x["bytes_by_vector"].items():
                by_vector[name] = by_vector.get(name, 0) + n
        totals = {k: sum(x[k] for x in sent) for k in ("plans", "descriptors", "bytes", "runs", "baseline_descriptors",
                                                       "filled_bytes")}
        totals.update({k: sum(x[k] for x in got) for k in ("verified_bytes", "expected_bytes", "mismatch_bytes",
                                                            "mismatch_rows")})
        # per vector, bytes moved to the decode ranks that no rank reads (whole pages travel: see the table)
        verified_by_vector: dict[str, int] = {}
        for x in got:
            for name, n in x["verified_by_vector"].items():
                verified_by_vector[name] = verified_by_vector.get(name, 0) + n
        totals["unread_by_vector"] = {n: b - verified_by_vector.get(n, 0) for n, b in sorted(by_vector.items())
                                      if b != verified_by_vector.get(n, 0)}
        totals["bytes_by_vector"] = by_vector
        total_s = self.times["total"]
        moving_s = self.times["start"] + self.times["transfer"]

        def side_cfg(side: str) -> dict:
            tp, dcp, ps, groups = c.side(side)
            arena = c.prefill_arena_bytes if side == "prefill" else c.decode_arena_bytes
            return {"tp": tp, "dcp": dcp, "ranks": tp * dcp, "page_size": ps, "head_groups": groups,
                    "arena_bytes": arena or 0}

        report = {
            "schema": RANKS_SCHEMA_VERSION, "ok": True,
            "config": {"trace": str(self.trace.path), "trace_format": self.trace.format, "model": c.model,
                       "backend": c.backend, "requests": len(self.lengths), "skip": c.skip,
                       "token_scale": c.token_scale, "max_prompt_tokens": c.max_prompt_tokens, "draft": c.draft,
                       "seed": c.seed, "max_batch": c.max_batch, "compaction": c.compaction,
                       "prefill": side_cfg("prefill"), "decode": side_cfg("decode")},
            "requests": {"total": len(self.lengths), "completed": done, "prompt_tokens": list(self.lengths),
                         "trace_input_tokens": [r.input_tokens for r in self.trace],
                         "zero_prompts_as_1": self.trace.zero_prompts},
            "ranks": ranks,
            "routes": [{"src": p.index, "dst": d.index, **{k: v for k, v in self.per_route[(p, d)].items()
                                                             if k != "bytes_by_vector"}} for p, d in self.routes],
            "totals": totals,
            "time_s": {k: float(v) for k, v in self.times.items()},
            "throughput": {"requests_per_s": done / total_s if total_s else 0.0,
                           "moved_gb_per_s": totals["bytes"] / 1e9 / moving_s if moving_s else 0.0},
        }
        report["ok"] = not check_ranks_report({**report, "ok": True})
        return report


def run_ranks(cfg: RanksConfig, *, progress: bool = False, console: Any = None) -> dict:
    """Run the multi-rank replay; print what runs and the ranks' pids on ``console`` (rich), and a progress bar
    when ``progress``. Returns the report.

    Raises:
        UmallocValueError: bad configuration. RankError / KeyboardInterrupt: as :meth:`MultiRankReplay.run`.
    """
    from rich.console import Console
    from rich.markup import escape

    out = console if console is not None else Console()

    def started(pids: list[tuple[str, int]]) -> None:
        out.print("ranks: " + ", ".join(f"{escape(label)} pid {pid}" for label, pid in pids), soft_wrap=True)

    rep = MultiRankReplay(cfg, on_start=started)  # bad arguments raise here, before any bar is drawn
    out.print(escape(rep.describe()), soft_wrap=True)
    if not progress:
        return rep.run()
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (TextColumn("[bold]multi-rank replay[/bold]"), BarColumn(),
            TextColumn("{task.completed}/{task.total} requests"), TimeElapsedColumn())
    with Progress(*cols, console=out, transient=False) as bar:  # type: ignore[arg-type]
        task = bar.add_task("ranks", total=len(rep.lengths))
        rep.on_progress = lambda done, _total: bar.update(task, completed=done)
        return rep.run()


__all__ = ["DEFAULT_MAX_PROMPT_TOKENS", "DEFAULT_RANK_REQUESTS", "DEFAULT_RANK_TOKEN_SCALE", "MAX_RANKS_PER_SIDE",
           "MultiRankReplay", "RANK_PROCESS_BYTES", "RankError", "RankId", "RankPool", "RanksConfig",
           "expected_bytes", "is_multi_rank", "rank_ids", "run_ranks"]
