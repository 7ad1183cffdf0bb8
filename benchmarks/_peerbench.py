"""The peerbench harness ``bench_allocator.py`` and ``bench_requests.py`` share (not a benchmark itself).

* The workload module: ``../shared/peerbench/workload.py`` (the peers' op sequence, reused, not copied), found
  through ``UMALLOC_PEERBENCH`` when the tree is not beside ``shared/``.
* One argument parser (the workload options plus the modes, repeats, SWA, verification, peers, rounds, JSON and
  thread options both take), one warm-up workload, one rounds loop (ours, then the peers, per round; the machine
  load printed at each round's start), the peers' run through ``run_vllm.py`` (under the thread count
  :mod:`_fair` set: same for umalloc and the peers), each round's ratio to the matched peer with the median, and
  the merge of rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERBENCH = Path(os.environ.get("UMALLOC_PEERBENCH", HERE.parent.parent / "shared" / "peerbench"))
sys.path.insert(0, str(PEERBENCH))
sys.path.insert(0, str(HERE))
import _fair as fair  # noqa: E402
import workload as wl  # noqa: E402  (the peers' workload module, reused, not copied)


def parser(doc: str, modes: Sequence[str], *, peers_help: str, rounds_help: str) -> argparse.ArgumentParser:
    """The options both benchmarks take: the workload's (``--ops FILE`` or its build options, the peers'
    defaults), ``--modes`` (comma list of ``modes``), ``--repeats``, ``--swa-window``, ``--swa-ratio``,
    ``--no-verify``, ``--peers``, ``--peer-repeats``, ``--rounds``, ``--json`` and ``--threads``."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    wl.add_args(ap)
    ap.add_argument("--modes", default=",".join(modes), help=f"comma list of {tuple(modes)}")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--swa-window", type=int, default=128, help="sliding window in tokens (after scaling)")
    ap.add_argument("--swa-ratio", type=float, default=1.0, help="extra arena pages for SWA / pool pages")
    ap.add_argument("--no-verify", action="store_true", help="skip the checked (untimed) pass")
    ap.add_argument("--peers", action="store_true", help=peers_help)
    ap.add_argument("--peer-repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help=rounds_help)
    ap.add_argument("--json", default=None, help="append one JSON line per result here")
    ap.add_argument("--threads", type=int, default=fair.DEFAULT_THREADS,
                    help="CPU threads for torch and numba, umalloc and the peers alike (set once, printed)")
    return ap


def warm_up_workload(a: argparse.Namespace) -> wl.Workload:
    """An 8-request workload of the same trace, to warm the numba kernels (cache or compile) outside timing."""
    return wl.build(wl.Params(n_requests=8), wl.load_trace(wl.trace_path(a.trace), 8))


def chosen_modes(a: argparse.Namespace, modes: Sequence[str]) -> list[str]:
    """``--modes`` as a list; an unknown mode exits naming the allowed ones."""
    chosen = [m for m in a.modes.split(",") if m]
    for mode in chosen:
        if mode not in modes:
            raise SystemExit(f"unknown mode {mode!r}: allowed {tuple(modes)}")
    return chosen


def run_peers(ops_path: str, repeats: int, modes: str, *, required: bool) -> list[dict]:
    """peerbench's vLLM adapters (``run_vllm.py --modes modes``) on the same op file, one dict per adapter.
    ``required``: a failed run raises; otherwise it prints a note and returns ``[]``. The peers run under
    :func:`_fair.peer_env`: the thread count :func:`_fair.set_threads` set here."""
    out = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False).name
    exe = sys.executable if os.path.exists(sys.executable) else "python3"
    cmd = [exe, str(PEERBENCH / "run_vllm.py"), "--ops", ops_path, "--modes", modes,
           "--repeats", str(repeats), "--json", out]
    print("#", " ".join(cmd), f"(PEERS_VENV={os.environ.get('PEERS_VENV', '/tmp/peers/venv')})", flush=True)
    if subprocess.run(cmd, check=required, env=fair.peer_env()).returncode != 0:
        print("# the vLLM peers did not run (build their venv: ../shared/peerbench/setup_peers.sh)")
        return []
    with open(out) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_rounds(a: argparse.Namespace, w: wl.Workload, runs: Sequence[tuple[str, Callable]],
               peers: Callable[[str], list[dict]], shown: Sequence[str]) -> list[list[dict]]:
    """``a.rounds`` rounds; in each, every ``(mode, run)`` in order (``run(mode, w, args)``, verified in the
    first round unless ``--no-verify``), a line per result (``allocator`` and the ``shown`` keys, then its JSON),
    then with ``--peers`` the peers on the same op file (``peers(ops_path)``, their rows first; a peer that
    replayed another workload exits). Ours then the peers per round: both see the same phases of a busy host."""
    ops_path = a.ops
    if a.peers and ops_path is None:
        ops_path = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
        wl.save(w, ops_path)
    rounds: list[list[dict]] = []
    for rnd in range(a.rounds):
        print(f"[round {rnd + 1}/{a.rounds}] {fair.load()}")
        rows = []
        for mode, run in runs:
            res = run(mode, w, argparse.Namespace(**{**vars(a), "no_verify": a.no_verify or rnd > 0}))
            rows.append(res)
            print(f"[round {rnd + 1}/{a.rounds}] " + "  ".join(f"{k}={res[k]}" for k in ("allocator", *shown)))
            print("    " + json.dumps({k: v for k, v in res.items() if k != "allocator"}))
        if a.peers:
            found = peers(ops_path)
            for p in found:
                if p["workload"] != w.fingerprint:
                    raise SystemExit(f"peer replayed workload {p['workload']}, we replayed {w.fingerprint}")
            rows = found + rows
        rounds.append(rows)
    return rounds


def print_round_ratios(rounds: list[list[dict]], peer_of: Callable[[str], str | None]) -> None:
    """Per umalloc allocator, each round's ratio of its matched peer's median wall time (``peer_of(name)``, None:
    no peer) to its own in the same round, then the median over the rounds."""
    print("\npeer wall s / umalloc wall s (medians of the same round) per round:")
    for name in [r["allocator"] for r in rounds[0] if r["allocator"].startswith("umalloc")]:
        peer = peer_of(name)
        if peer is None or not all(any(r["allocator"] == peer for r in rows) for rows in rounds):
            continue
        xs = [next(r for r in rows if r["allocator"] == peer)["wall_s_median"]
              / next(r for r in rows if r["allocator"] == name)["wall_s_median"] for rows in rounds]
        print(fair.round_ratios(f"{name} vs {peer}", xs))


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per allocator over all rounds: ``wall_s_median`` = median of the rounds' medians, ``wall_s_min`` =
    the fastest repeat of any round (rates recomputed from the merged median)."""
    merged = []
    for rows in zip(*rounds, strict=True):
        r = dict(rows[-1])
        r["wall_s_median"] = round(statistics.median(x["wall_s_median"] for x in rows), 4)
        r["wall_s_min"] = min(x["wall_s_min"] for x in rows)
        r["rounds"] = len(rows)
        for x in rows:                      # the checked pass ran in the first round only
            for k in ("peak_pages", "swa_peak_pages", "verified"):
                if k in x:
                    r.setdefault(k, x[k])
        med = r["wall_s_median"]
        r["req_ops_per_s"] = round(r["req_ops_per_s"] * rows[-1]["wall_s_median"] / med)
        r["api_calls_per_s"] = round(r["api_calls_per_s"] * rows[-1]["wall_s_median"] / med)
        merged.append(r)
    return merged


def append_json(path: str | None, rows: list[dict]) -> None:
    """Append one JSON line per row to ``path`` (nothing for ``None``)."""
    if path:
        with open(path, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
