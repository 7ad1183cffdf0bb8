"""The replay's figures: phase timers, the occupancy timeline, the JSON report (fixed schema) and the final table.

Policy:

* The report is a plain JSON-ready ``dict`` with a fixed schema (:data:`REPORT_SCHEMA`, version
  :data:`SCHEMA_VERSION`); :func:`check_report` checks the schema *and* the replay's invariants and returns
  every problem found (empty list = a good run): verified bytes equal moved bytes, zero mismatches, every
  request completed, zero live pages and zero active leases at the end on both sides.
* Units are in the key names (``*_bytes``, ``*_pages``, ``*_s``, ``*_tokens``); counts are ints, times floats.
* Time is split into disjoint phases measured with ``time.perf_counter``: ``allocator`` (every allocator call:
  alloc / bind / free / unbind / retract / restore / compaction), ``translate_plan`` (address translation and
  plan building, leases included), ``transfer`` (backend submit + wait), ``verify`` (recomputing the pattern and
  comparing), ``fill`` (writing the pattern: what a model's forward pass would do) and ``other`` (the rest).
* The timeline samples one point per scheduler step (downsampled to at most :data:`MAX_TIMELINE_POINTS` in the
  report) so the plot can show every end's occupancy, compaction events and lease counts over time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

SCHEMA_VERSION = "umalloc.replay.report/3"

#: Phases of :class:`PhaseTimer`, in report order.
PHASES = ("allocator", "translate_plan", "transfer", "verify", "fill", "other")

#: Most timeline points kept in the JSON report.
MAX_TIMELINE_POINTS = 2000

_NUM = (int, float)

#: Key -> type (or nested schema). ``dict`` entries keyed by end or side are checked as mappings of the given
#: leaf schema via the ``"*"`` key.
_END_OCC = {"capacity_pages": int, "peak_live_pages": int, "peak_live_bytes": int, "page_bytes": int}
_END_FINAL = {"live_pages": int, "pending_pages": int}
_SIDE_COMPACTION = {"moves_pages": int, "moved_bytes": int, "events": int}
REPORT_SCHEMA: dict = {
    "schema": str,
    "ok": bool,
    "config": {
        "trace": str, "trace_format": str, "model": str, "page_size": int, "prefill_arena_bytes": int,
        "decode_arena_bytes": int, "backend": str, "requests": int, "token_scale": int, "draft": bool,
        "seed": int, "max_batch": int, "compaction": str, "skip": int, "layout": str, "draft_sliding": str,
        "ends": list,
    },
    "requests": {"total": int, "completed": int, "retracted": int, "restored": int, "admission_waits": int,
                 "max_running": int},
    "tokens": {"prompt": int, "generated": int, "total": int},
    "bytes": {"moved": int, "verified": int, "moved_by_vector": {"*": int}, "filled": int,
              "verified_final": int, "decode_written": int},
    "mismatches": {"pages": int, "bytes": int},
    "descriptors": {"total": int, "runs_total": int, "per_layer_per_page_total": int, "plans": int,
                    "per_request_mean": float, "per_request_max": int, "runs_per_request_mean": float,
                    "per_layer_per_page_per_request_mean": float, "reduction_x": float},
    "compaction": {"prefill": _SIDE_COMPACTION, "decode": _SIDE_COMPACTION},
    "leases": {"taken": int, "waits": int, "expired": int, "max_active": int},
    "shortfall": {"alloc_retries": int, "lease_waits": int, "retractions": int, "replacements": int},
    "occupancy": {"prefill": {"*": _END_OCC}, "decode": {"*": _END_OCC}},
    # the layout comparison (decode arena): means are over scheduler steps; held = live + padding + pending
    # bytes; wrong-pool bytes are the free bytes of the static pools that were not short, at the admission waits
    # the whole arena had room for
    "capacity": {"layout": str, "steps": int, "max_running": int, "mean_running": float, "admission_waits": int,
                 "retractions": int, "peak_held_bytes": int, "mean_held_bytes": float,
                 "peak_padding_bytes": int, "mean_padding_bytes": float, "wrong_pool_waits": int,
                 "mean_wrong_pool_bytes": float, "budget_pages": {"*": int}},
    "time_s": {"total": float, **{p: float for p in PHASES}},
    "throughput": {"requests_per_s": float, "tokens_per_s": float, "moved_gb_per_s": float},
    "end_state": {"prefill": {"ends": {"*": _END_FINAL}, "leases_active": int},
                  "decode": {"ends": {"*": _END_FINAL}, "leases_active": int}},
    "timeline": {"step": list, "time_s": list, "requests_done": list, "leases_active": list,
                 "compaction_moves": list, "prefill_live_pages": {"*": list}, "decode_live_pages": {"*": list},
                 "compaction_events": list, "admission_wait_events": list, "retraction_events": list},
}


class PhaseTimer:
    """Accumulates wall seconds per phase (:data:`PHASES`); phases nest by *pausing* the outer one, so the
    split is disjoint and sums to the measured total.

    >>> t = PhaseTimer()
    >>> with t.phase("allocator"):
    ...     with t.phase("verify"):
    ...         pass
    >>> sorted(k for k, v in t.seconds.items() if v > 0) in (['allocator', 'verify'], ['verify'], [])
    True
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._stack: list[tuple[str, float]] = []
        self.started = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.seconds:
            raise ValueError(f"phase {name!r}: allowed one of {PHASES}")
        now = time.perf_counter()
        if self._stack:
            outer, t0 = self._stack[-1]
            self.seconds[outer] += now - t0
        self._stack.append((name, now))
        try:
            yield
        finally:
            end = time.perf_counter()
            _, t0 = self._stack.pop()
            self.seconds[name] += end - t0
            if self._stack:
                outer, _ = self._stack[-1]
                self._stack[-1] = (outer, end)

    def reassign(self, from_phase: str, to_phase: str, seconds: float) -> None:
        """Move ``seconds`` already counted in ``from_phase`` to ``to_phase`` (at most what ``from_phase`` holds):
        a call measured as one phase whose callee reported its own split (the remote prefill worker)."""
        for name in (from_phase, to_phase):
            if name not in self.seconds:
                raise ValueError(f"phase {name!r}: allowed one of {PHASES}")
        moved = min(max(0.0, float(seconds)), self.seconds[from_phase])
        self.seconds[from_phase] -= moved
        self.seconds[to_phase] += moved

    def total(self) -> float:
        return time.perf_counter() - self.started

    def split(self) -> dict[str, float]:
        """Seconds per phase plus ``total``; ``other`` = total minus the measured phases."""
        total = self.total()
        out = dict(self.seconds)
        out["other"] = max(0.0, total - sum(v for k, v in self.seconds.items() if k != "other"))
        out["total"] = total
        return out


@dataclass
class Timeline:
    """One point per scheduler step: occupancy of every end of both sides, leases, compaction."""

    prefill_ends: tuple[str, ...]
    decode_ends: tuple[str, ...]
    step: list[int] = field(default_factory=list)
    time_s: list[float] = field(default_factory=list)
    requests_done: list[int] = field(default_factory=list)
    leases_active: list[int] = field(default_factory=list)
    compaction_moves: list[int] = field(default_factory=list)
    prefill_live_pages: dict[str, list[int]] = field(default_factory=dict)
    decode_live_pages: dict[str, list[int]] = field(default_factory=dict)
    #: ``[step, time_s, side, pages_moved]`` per compaction that moved pages.
    compaction_events: list[list] = field(default_factory=list)
    #: ``[step, count]`` per step in which admission waited / requests were retracted.
    admission_wait_events: list[list] = field(default_factory=list)
    retraction_events: list[list] = field(default_factory=list)
    #: ``[step, count]`` per step in which retracted requests were restored.
    restore_events: list[list] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefill_live_pages = {e: [] for e in self.prefill_ends}
        self.decode_live_pages = {e: [] for e in self.decode_ends}

    def add(self, step: int, time_s: float, requests_done: int, leases_active: int, compaction_moves: int,
            prefill_live: Mapping[str, int], decode_live: Mapping[str, int]) -> None:
        self.step.append(step)
        self.time_s.append(round(time_s, 4))
        self.requests_done.append(requests_done)
        self.leases_active.append(leases_active)
        self.compaction_moves.append(compaction_moves)
        for e in self.prefill_ends:
            self.prefill_live_pages[e].append(int(prefill_live[e]))
        for e in self.decode_ends:
            self.decode_live_pages[e].append(int(decode_live[e]))

    def add_compaction_event(self, step: int, time_s: float, side: str, pages_moved: int) -> None:
        self.compaction_events.append([step, round(time_s, 4), side, int(pages_moved)])

    def add_scheduler_events(self, step: int, admission_waits: int, retractions: int, restores: int = 0) -> None:
        if admission_waits:
            self.admission_wait_events.append([step, int(admission_waits)])
        if retractions:
            self.retraction_events.append([step, int(retractions)])
        if restores:
            self.restore_events.append([step, int(restores)])

    def to_dict(self, max_points: int = MAX_TIMELINE_POINTS) -> dict:
        """The timeline, downsampled to at most ``max_points`` points (every k-th point, the last kept)."""
        n = len(self.step)
        k = max(1, -(-n // max_points))
        idx = list(range(0, n, k))
        if n and idx[-1] != n - 1:
            idx.append(n - 1)

        def pick(xs: list) -> list:
            return [xs[i] for i in idx]

        return {
            "step": pick(self.step), "time_s": pick(self.time_s), "requests_done": pick(self.requests_done),
            "leases_active": pick(self.leases_active), "compaction_moves": pick(self.compaction_moves),
            "prefill_live_pages": {e: pick(v) for e, v in self.prefill_live_pages.items()},
            "decode_live_pages": {e: pick(v) for e, v in self.decode_live_pages.items()},
            "compaction_events": list(self.compaction_events[:max_points]),
            "admission_wait_events": _thin(self.admission_wait_events, max_points),
            "retraction_events": _thin(self.retraction_events, max_points),
            "restore_events": _thin(self.restore_events, max_points),
        }


def _thin(events: list[list], max_points: int) -> list[list]:
    """``[step, count]`` events merged into at most ``max_points`` (counts summed, each at its first step)."""
    if len(events) <= max_points:
        return [list(e) for e in events]
    k = -(-len(events) // max_points)
    return [[events[i][0], sum(e[1] for e in events[i:i + k])] for i in range(0, len(events), k)]


def check_schema(value: object, schema: object, path: str, problems: list[str]) -> None:
    """Append to ``problems`` every place where ``value`` does not match ``schema`` (a dict of key -> schema,
    ``{"*": schema}`` for any keys, or a type; ``int``/``float`` refuse bools). O(size of ``value``)."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected an object, got {type(value).__name__}")
            return
        if "*" in schema:
            for k, v in value.items():
                check_schema(v, schema["*"], f"{path}.{k}", problems)
            return
        for k, sub in schema.items():
            if k not in value:
                problems.append(f"{path}.{k}: missing")
                continue
            check_schema(value[k], sub, f"{path}.{k}", problems)
        return
    if schema is float:
        ok = isinstance(value, _NUM) and not isinstance(value, bool)
    elif schema is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, schema)  # type: ignore[arg-type]
    if not ok:
        problems.append(f"{path}: expected {getattr(schema, '__name__', schema)}, got {type(value).__name__}")


def check_report(report: Mapping) -> list[str]:
    """Every schema violation and broken invariant of a replay report, as human-readable lines.

    Invariants: ``bytes.verified == bytes.moved > 0``; ``mismatches.pages == mismatches.bytes == 0``;
    ``requests.completed == requests.total``; every end of both sides has ``live_pages == pending_pages == 0``
    at the end; ``leases_active == 0`` on both sides; ``ok`` is true iff there is no other problem.

    >>> check_report({"schema": SCHEMA_VERSION})[:1]
    ['report.ok: missing']
    """
    problems: list[str] = []
    check_schema(report, REPORT_SCHEMA, "report", problems)
    if problems:
        return problems
    if report["schema"] != SCHEMA_VERSION:
        problems.append(f"report.schema: {report['schema']!r}, expected {SCHEMA_VERSION!r}")
    b = report["bytes"]
    if b["verified"] != b["moved"]:
        problems.append(f"bytes: verified {b['verified']} != moved {b['moved']}")
    if b["moved"] <= 0:
        problems.append("bytes: nothing moved")
    m = report["mismatches"]
    if m["pages"] or m["bytes"]:
        problems.append(f"mismatches: {m['pages']} pages / {m['bytes']} bytes differ")
    r = report["requests"]
    if r["completed"] != r["total"]:
        problems.append(f"requests: completed {r['completed']} of {r['total']}")
    for side in ("prefill", "decode"):
        st = report["end_state"][side]
        for end, e in st["ends"].items():
            if e["live_pages"] or e["pending_pages"]:
                problems.append(f"end_state.{side}.{end}: {e['live_pages']} live / {e['pending_pages']} pending "
                                "pages at the end")
        if st["leases_active"]:
            problems.append(f"end_state.{side}: {st['leases_active']} leases still active")
    if report["ok"] != (not problems):
        problems.append(f"report.ok is {report['ok']} but the invariants say {not problems}")
    return problems


def _gb(x: int) -> str:
    return f"{x / 1e9:,.2f} GB"


def report_title(report: Mapping) -> str:
    """One line naming what ran: trace, slice, token scale, model, page size, layout, backend.

    >>> cfg = {"trace": "/x/conv.jsonl", "skip": 10, "requests": 5, "token_scale": 8, "model": "m",
    ...        "page_size": 16, "layout": "static:0.8", "backend": "local"}
    >>> report_title({"config": cfg})
    'umalloc replay — conv.jsonl rows 10-14, token scale 8, m, 16-token pages, layout static:0.8, backend local'
    """
    c = report["config"]
    lo = c.get("skip", 0)
    return (f"umalloc replay — {Path(c['trace']).name} rows {lo}-{lo + c['requests'] - 1}, token scale "
            f"{c['token_scale']}, {c['model']}, {c['page_size']}-token pages, layout {c.get('layout', 'dynamic')}, "
            f"backend {c['backend']}")


def report_table(report: Mapping) -> Table:
    """The final table (rich) of a report: one row per figure, with a short meaning."""
    t = Table(title=report_title(report), show_lines=False)
    t.add_column("figure", style="bold")
    t.add_column("value", justify="right")
    t.add_column("meaning")
    r, tok, b, d = report["requests"], report["tokens"], report["bytes"], report["descriptors"]
    ts, thr, m = report["time_s"], report["throughput"], report["mismatches"]
    t.add_row("requests", f"{r['completed']:,} / {r['total']:,}", "completed / in the trace slice")
    t.add_row("max running", f"{r['max_running']:,}", "most requests decoding at once")
    t.add_row("tokens", f"{tok['prompt']:,} + {tok['generated']:,}", "prompt (prefilled, moved) + generated")
    t.add_row("0-token rows", f"{tok.get('zero_prompts_as_1', 0):,} prompts, {tok.get('zero_outputs_as_1', 0):,} "
              "outputs", "0 tokens in the trace, counted as 1 token each")
    t.add_row("tokens/s", f"{thr['tokens_per_s']:,.0f}", "all tokens / wall time")
    t.add_row("moved", _gb(b["moved"]), "bytes the backend wrote prefill -> decode")
    for name, nbytes in sorted(b["moved_by_vector"].items()):
        t.add_row(f"  {name}", _gb(nbytes), "index vector " + name)
    t.add_row("verified", _gb(b["verified"]), "moved bytes recomputed and compared on decode")
    t.add_row("verified at finish", _gb(b["verified_final"]), "every live page re-checked when a request ends")
    t.add_row("mismatches", f"{m['pages']} pages / {m['bytes']} B", "must be 0")
    t.add_row("descriptors / request", f"{d['per_request_mean']:,.1f} (max {d['per_request_max']:,})",
              "coalesced (src, dst, nbytes) rows per plan")
    t.add_row("runs / request", f"{d['runs_per_request_mean']:,.1f}", "page runs contiguous on both sides")
    t.add_row("per-layer-per-page / request", f"{d['per_layer_per_page_per_request_mean']:,.0f}",
              f"descriptors without envelopes and runs ({d['reduction_x']:,.0f}x more)")
    for side in ("prefill", "decode"):
        c = report["compaction"][side]
        t.add_row(f"compaction {side}", f"{c['moves_pages']:,} pages / {_gb(c['moved_bytes'])}",
                  f"{c['events']:,} compactions that moved pages")
    lz, sf = report["leases"], report["shortfall"]
    t.add_row("leases", f"{lz['taken']:,} taken, {lz['expired']} expired, {lz.get('in_doubt', 0)} in doubt",
              f"at most {lz['max_active']} at once; in doubt: released or expired while an engine might still write its pages")
    t.add_row("lease waits", f"{sf['lease_waits']:,}", "allocations that waited for in-flight transfers")
    t.add_row("admission waits", f"{r['admission_waits']:,}", "steps a request waited for memory")
    t.add_row("retractions", f"{r['retracted']:,} ({r['restored']:,} restored)", "requests parked in host memory")
    t.add_row("re-placements", f"{sf['replacements']:,}", "lone requests moved to unstrand free space")
    cap = report["capacity"]
    t.add_row("concurrency", f"{cap['mean_running']:,.2f} mean, {cap['max_running']:,} max",
              f"requests decoding per step, over {cap['steps']:,} scheduler steps")
    t.add_row("decode bytes held", f"{_gb(int(cap['mean_held_bytes']))} mean, {_gb(cap['peak_held_bytes'])} peak",
              "live + padding + pending bytes of the decode arena")
    if cap["mean_padding_bytes"] or cap["wrong_pool_waits"]:
        t.add_row("lost bytes", f"{_gb(int(cap['mean_padding_bytes']))} padding, "
                  f"{_gb(int(cap['mean_wrong_pool_bytes']))} wrong pool",
                  "mean padding held; mean free bytes of other pools when admission waited")
    for side in ("prefill", "decode"):
        arena = report["config"][f"{side}_arena_bytes"]
        for end, o in report["occupancy"][side].items():
            pct = 100.0 * o["peak_live_bytes"] / max(1, arena)
            t.add_row(f"peak {side}.{end}", f"{o['peak_live_pages']:,} pages, {_gb(o['peak_live_bytes'])}",
                      f"{pct:.0f}% of the {side} arena ({_gb(arena)}), {o['page_bytes'] / 2**20:.2f} MiB pages")
    split = ", ".join(f"{p} {ts[p]:.1f}" for p in PHASES)
    t.add_row("time", f"{ts['total']:.1f} s", split)
    live = sum(e["live_pages"] + e["pending_pages"] for s in ("prefill", "decode")
               for e in report["end_state"][s]["ends"].values())
    leases = sum(report["end_state"][s]["leases_active"] for s in ("prefill", "decode"))
    t.add_row("at the end", f"{live} pages, {leases} leases", "live pages and active leases left (must be 0)")
    t.add_row("result", "[green]OK[/green]" if report["ok"] else "[red]FAILED[/red]", "all invariants hold")
    return t


__all__ = ["MAX_TIMELINE_POINTS", "PHASES", "REPORT_SCHEMA", "SCHEMA_VERSION", "PhaseTimer", "Timeline", "check_schema",
           "check_report", "report_table", "report_title"]
