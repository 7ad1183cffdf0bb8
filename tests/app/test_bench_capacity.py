"""``benchmarks/bench_capacity.py`` ran 17 minutes silently, then died with ``KeyError:
'decode_arena_bytes'`` when a layout's replay was refused, losing every result. A refused run is a row saying
why, every run's row and JSON line are written as it completes, progress goes to stderr, and the summary gives
the spread of each layout's concurrency over disjoint slices."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_capacity.py"


def _bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    traces = tmp_path / "traces"
    traces.mkdir(exist_ok=True)
    (traces / "tiny.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(
        f"2023-11-16 18:15:4{i}.0,{60 + 20 * i},{8 + i}" for i in range(8)) + "\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(BENCH), "--traces-dir", str(traces), "--presets", "gpt-oss-20b",
                           "--requests", "4", "--slices", "2", "--ratios", "0.5", *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)


def test_every_run_is_written_as_it_completes_with_progress_and_the_spread(tmp_path) -> None:
    results = tmp_path / "runs.jsonl"
    res = _bench(tmp_path, "--results", str(results))
    assert res.returncode == 0, res.stdout + res.stderr
    runs = [json.loads(line) for line in results.read_text().splitlines()]
    layouts = ["dynamic", "vllm", "padded", "static:0.8", "static:0.5"]
    assert sorted((r["layout"], r["slice"]) for r in runs) == sorted((lay, k) for lay in layouts for k in (0, 1))
    assert {r["skip"] for r in runs} == {0, 4}  # two disjoint slices of 4 rows
    progress = [ln for ln in res.stderr.splitlines() if re.match(r"\[\d+/10\] tiny\.csv gpt-oss-20b ", ln)]
    assert len(progress) == 10, res.stderr
    # the summary's spread, recomputed here from the JSON lines
    for lay in layouts:
        vals = [r["mean_running"] for r in runs if r["layout"] == lay and "refused" not in r]
        line = next(ln for ln in res.stdout.splitlines() if ln.startswith("tiny.csv") and f" {lay} " in ln
                    and "(" in ln and "slice" not in ln and ln.split()[2] == lay and len(ln.split()) <= 6)
        if vals:
            want = f"{sum(vals) / len(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})"
            assert line.split(None, 3)[3].startswith(want), (line, want)


def test_a_refused_layout_is_a_row_saying_why_and_nothing_is_lost(tmp_path) -> None:
    """A decode arena of 1 MiB refuses every layout, dynamic included (the case that raised KeyError)."""
    results = tmp_path / "runs.jsonl"
    res = _bench(tmp_path, "--decode-arena-bytes", str(1 << 20), "--results", str(results))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and "KeyError" not in res.stderr
    rows = [ln for ln in res.stdout.splitlines() if "refused: " in ln and "n/a:" not in ln]
    assert len(rows) == 10, res.stdout
    for ln in rows:
        assert "--arena-bytes" in ln.split("refused: ", 1)[1], ln  # the replay's own reason, whole
    runs = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(runs) == 10 and all("--arena-bytes" in r["refused"] for r in runs)
    assert "n/a: dynamic refused" in res.stdout
