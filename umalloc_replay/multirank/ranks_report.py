"""The multi-rank replay's report: its fixed JSON schema, its invariants and its table.

Policy (as :mod:`umalloc_replay.report` for the single-pair replay):

* A plain JSON-ready ``dict`` with a fixed schema (:data:`RANKS_REPORT_SCHEMA`, version
  :data:`RANKS_SCHEMA_VERSION`); units are in key names (``*_bytes``, ``*_s``); counts ints, times floats.
* :func:`check_ranks_report` checks the schema and the run's invariants and returns every problem (empty: a good
  run): every request completed; bytes moved; zero mismatched bytes; every decode rank verified exactly the
  bytes its geometry says it must hold (counted independently, :func:`umalloc_replay.multirank.ranks.expected_bytes`), and
  more than none; bytes received per decode rank equal bytes sent to it; every rank ends with no live or pending
  page and no active lease.
* Figures: per rank (a prefill rank's plans, descriptors, bytes and runs are what it sent; a decode rank's what
  it received), per route (source, destination) and in total (sent by the prefill side, verified by the decode
  side). ``baseline_descriptors``: what a per-layer-per-page design posts for the same plans, or between different
  TP / page size / head groups one per (token row, head slice), what a per-token slice sender (SGLang's
  ``send_kvcache_slice``) posts (``TransferPlan.per_layer_descriptor_equivalent``). ``time_s`` per rank: ``alloc`` (allocator calls), ``fill`` (writing the pattern), ``plan`` (send plans
  built and submitted), ``transfer`` (each plan's submit-to-done, summed), ``wait`` (waiting for them), ``half``
  (receiver halves built and published), ``verify`` (comparing).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from rich import box
from rich.table import Table

from umalloc_replay.report import check_schema

RANKS_SCHEMA_VERSION = "umalloc.replay.ranks/1"

_SIDE = {"tp": int, "dcp": int, "ranks": int, "page_size": int, "head_groups": int, "arena_bytes": int}
_FIGURES = {"plans": int, "descriptors": int, "bytes": int, "runs": int, "baseline_descriptors": int}
_RANK_TIMES = ("alloc", "fill", "plan", "transfer", "wait", "half", "verify")
RANKS_REPORT_SCHEMA: dict = {
    "schema": str,
    "ok": bool,
    "config": {"trace": str, "trace_format": str, "model": str, "backend": str, "requests": int, "skip": int,
               "token_scale": int, "max_prompt_tokens": int, "draft": bool, "seed": int, "max_batch": int,
               "compaction": str, "prefill": _SIDE, "decode": _SIDE},
    "requests": {"total": int, "completed": int, "prompt_tokens": list, "trace_input_tokens": list},
    "ranks": list,
    "routes": list,
    "totals": {**_FIGURES, "bytes_by_vector": {"*": int}, "filled_bytes": int, "verified_bytes": int,
               "expected_bytes": int, "mismatch_bytes": int, "mismatch_rows": int},
    "time_s": {"total": float, "setup": float, "prepare": float, "start": float, "transfer": float,
               "verify": float, "check": float},
    "throughput": {"requests_per_s": float, "moved_gb_per_s": float},
}
RANK_SCHEMA: dict = {
    "side": str, "index": int, "tp_rank": int, "tp_size": int, "dcp_rank": int, "dcp_size": int, "pid": int,
    "page_size": int, "arena_bytes": int, "kv_heads": {"*": int}, "peers": list, **_FIGURES,
    "bytes_by_vector": {"*": int}, "filled_bytes": int, "verified_bytes": int, "expected_bytes": int,
    "mismatch_bytes": int, "mismatch_rows": int, "verified_by_vector": {"*": int},
    "time_s": {k: float for k in _RANK_TIMES},
    "end_state": {"live_pages": int, "pending_pages": int, "leases_active": int, "leases_taken": int,
                  "leases_expired": int},
}
ROUTE_SCHEMA: dict = {"src": int, "dst": int, **_FIGURES}


def check_ranks_report(report: Mapping) -> list[str]:
    """Every schema violation and broken invariant of a multi-rank report (see the module policy), one line
    each; empty for a good run.

    >>> check_ranks_report({"schema": RANKS_SCHEMA_VERSION})[:1]
    ['report.ok: missing']
    """
    problems: list[str] = []
    check_schema(report, RANKS_REPORT_SCHEMA, "report", problems)
    for i, r in enumerate(report.get("ranks", []) if isinstance(report.get("ranks"), list) else []):
        check_schema(r, RANK_SCHEMA, f"report.ranks[{i}]", problems)
    for i, r in enumerate(report.get("routes", []) if isinstance(report.get("routes"), list) else []):
        check_schema(r, ROUTE_SCHEMA, f"report.routes[{i}]", problems)
    if problems:
        return problems
    if report["schema"] != RANKS_SCHEMA_VERSION:
        problems.append(f"report.schema: {report['schema']!r}, expected {RANKS_SCHEMA_VERSION!r}")
    req, tot = report["requests"], report["totals"]
    if req["completed"] != req["total"]:
        problems.append(f"requests: completed {req['completed']} of {req['total']}")
    if tot["bytes"] <= 0:
        problems.append("totals: nothing moved")
    if tot["mismatch_bytes"] or tot["mismatch_rows"]:
        problems.append(f"mismatches: {tot['mismatch_bytes']} bytes in {tot['mismatch_rows']} rows differ")
    sent_to: dict[int, int] = {}
    for rt in report["routes"]:
        sent_to[rt["dst"]] = sent_to.get(rt["dst"], 0) + rt["bytes"]
    for r in report["ranks"]:
        name = f"{r['side']} rank {r['index']}"
        if r["side"] == "decode":
            if r["verified_bytes"] != r["expected_bytes"]:
                problems.append(f"{name}: verified {r['verified_bytes']} B, its geometry says {r['expected_bytes']} B")
            if r["verified_bytes"] <= 0:
                problems.append(f"{name}: verified nothing")
            if r["bytes"] != sent_to.get(r["index"], 0):
                problems.append(f"{name}: received {r['bytes']} B, its routes sent {sent_to.get(r['index'], 0)} B")
        st = r["end_state"]
        if st["live_pages"] or st["pending_pages"] or st["leases_active"]:
            problems.append(f"{name}: {st['live_pages']} live / {st['pending_pages']} pending pages, "
                            f"{st['leases_active']} active leases at the end")
    if report["ok"] != (not problems):
        problems.append(f"report.ok is {report['ok']} but the invariants say {not problems}")
    return problems


def _mb(x: int) -> str:
    return f"{x / 1e6:,.2f}"


def ranks_title(report: Mapping) -> str:
    """One line naming what ran.

    >>> side = {"tp": 2, "dcp": 1, "ranks": 2, "page_size": 16, "head_groups": 2, "arena_bytes": 0}
    >>> cfg = {"trace": "/x/conv.jsonl", "skip": 0, "requests": 4, "token_scale": 64, "max_prompt_tokens": 256,
    ...        "model": "m", "backend": "nixl", "prefill": side, "decode": {**side, "tp": 1, "head_groups": 1}}
    >>> ranks_title({"config": cfg})
    'umalloc replay (multi-rank) — conv.jsonl rows 0-3, token scale 64, cap 256, m, prefill TP2 DCP1 16-token pages 2 head groups -> decode TP1 DCP1 16-token pages, backend nixl'
    """
    c = report["config"]

    def side(name: str) -> str:
        s = c[name]
        groups = f" {s['head_groups']} head groups" if s["head_groups"] > 1 else ""
        return f"{name} TP{s['tp']} DCP{s['dcp']} {s['page_size']}-token pages{groups}"

    return (f"umalloc replay (multi-rank) — {Path(c['trace']).name} rows {c['skip']}-{c['skip'] + c['requests'] - 1}, "
            f"token scale {c['token_scale']}, cap {c['max_prompt_tokens']}, {c['model']}, {side('prefill')} -> "
            f"{side('decode')}, backend {c['backend']}")


#: Table columns: (header, justify).
_COLUMNS = (("rank", "left"), ("tp", "right"), ("dcp", "right"), ("heads", "right"),
            ("peers", "left"), ("plans", "right"), ("desc", "right"), ("MB", "right"), ("runs", "right"),
            ("s", "right"), ("ver MB", "right"), ("bad B", "right"))


def _moved_vs_verified(tot: Mapping) -> str:
    """Why MB moved exceeds MB verified, per index vector: pages travel whole, so the rows of a request's last
    page past its end (and, on an SWA end, of the window's first page before the window) are moved but hold
    nothing any rank reads.

    >>> _moved_vs_verified({"bytes": 3_000_000, "verified_bytes": 2_500_000, "unread_by_vector": {"draft": 500_000}})
    'moved - verified = 0.50 MB (draft 0.50): rows of whole pages past a request (never read)'
    >>> _moved_vs_verified({"bytes": 2_000_000, "verified_bytes": 2_000_000, "unread_by_vector": {}})
    'moved = verified'
    """
    diff = tot["bytes"] - tot["verified_bytes"]
    if diff == 0:
        return "moved = verified"
    parts = ", ".join(f"{n} {_mb(b)}" for n, b in tot.get("unread_by_vector", {}).items())
    return f"moved - verified = {_mb(diff)} MB ({parts}): rows of whole pages past a request (never read)"


def ranks_table(report: Mapping) -> Table:
    """The final table (rich): one row per rank (``P<i>`` prefill, ``D<i>`` decode), then the totals; what the
    columns mean, the run's time and the result in the caption."""
    t = Table(title=ranks_title(report), box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0), show_lines=False)
    for col, just in _COLUMNS:
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in report["ranks"]:
        ts = r["time_s"]
        prefill = r["side"] == "prefill"
        secs = ts["fill"] + ts["plan"] + ts["wait"] if prefill else ts["half"] + ts["verify"]
        t.add_row(f"{'P' if prefill else 'D'}{r['index']}", f"{r['tp_rank']}/{r['tp_size']}",
                  f"{r['dcp_rank']}/{r['dcp_size']}", str(next(iter(r["kv_heads"].values()))),
                  ",".join(f"{'D' if prefill else 'P'}{i}" for i in r["peers"]), f"{r['plans']:,}",
                  f"{r['descriptors']:,}", _mb(r["bytes"]), f"{r['runs']:,}", f"{secs:.2f}",
                  "-" if prefill else _mb(r["verified_bytes"]), "-" if prefill else f"{r['mismatch_bytes']:,}")
    tot, ts = report["totals"], report["time_s"]
    t.add_row("[bold]total[/bold]", "", "", "", "", f"{tot['plans']:,}", f"{tot['descriptors']:,}",
              _mb(tot["bytes"]), f"{tot['runs']:,}", f"{ts['total']:.2f}", _mb(tot["verified_bytes"]),
              f"{tot['mismatch_bytes']:,}")
    by_vec = ", ".join(f"{n} {_mb(b)}" for n, b in sorted(tot["bytes_by_vector"].items()))
    ok = "[green]OK[/green]" if report["ok"] else "[red]FAILED[/red]"
    zero = report["requests"].get("zero_prompts_as_1", 0)
    t.caption = (f"{report['requests']['completed']}/{report['requests']['total']} requests ({zero} 0-token "
                 "prompts counted as 1 token); MB moved by vector: "
                 f"{by_vec}; verified {_mb(tot['verified_bytes'])} of {_mb(tot['expected_bytes'])} MB expected; "
                 f"{_moved_vs_verified(tot)}; "
                 f"{tot['baseline_descriptors']:,} descriptors without merging. "
                 f"Time: setup {ts['setup']:.2f} s, transfers {ts['start'] + ts['transfer']:.2f} s "
                 f"({report['throughput']['moved_gb_per_s']:.3f} GB/s), verify {ts['verify']:.2f} s. heads: KV "
                 f"heads per layer of the first end; desc: descriptors; ver MB: verified; s: fill + plan + wait (prefill), half + "
                 f"verify (decode), the run (total). {ok}")
    return t


__all__ = ["RANKS_REPORT_SCHEMA", "RANKS_SCHEMA_VERSION", "RANK_SCHEMA", "ROUTE_SCHEMA", "check_ranks_report",
           "ranks_table", "ranks_title"]
