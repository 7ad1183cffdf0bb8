"""``benchmarks/bench_capacity.py --drift`` on a tiny six-request mix (gpt-oss-20b, token scale 16): every
policy's accounting closes, dynamic reaches the step bound no layout can beat, and the printed verdicts match
figures recomputed here from the runs' JSON lines."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_capacity.py"
#: (prompt, output) tokens before the bench's token scale 16 for gpt-oss-20b: three long, three short
ROWS = [(9600, 192), (8320, 144), (640, 320), (480, 256), (800, 224), (11200, 160)]
SCALE = 16


def test_drift_runs_close_their_accounting_and_dynamic_meets_the_step_bound(tmp_path) -> None:
    trace = tmp_path / "tiny.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": a, "output_length": b,
                                         "hash_ids": list(range(30 * i, 30 * i + math.ceil(a / 512)))}) + "\n"
                             for i, (a, b) in enumerate(ROWS)))
    results, table = tmp_path / "runs.jsonl", tmp_path / "table.md"
    res = subprocess.run([sys.executable, str(BENCH), "--drift", "--drift-trace", str(trace), "--presets",
                          "gpt-oss-20b", "--ratios", "0.25,1", "--results", str(results), "--markdown", str(table)],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = {r["layout"]: r for r in map(json.loads, results.read_text().splitlines())}
    assert sorted(runs) == sorted(["dynamic", "vllm", "padded", "static:0.8", "static:0.25", "static:1"])
    # one decode arena size for every policy (vllm's carrier arena is larger; its budget has these bytes)
    assert len({r["decode_arena_bytes"] for r in runs.values()}) == 1
    outputs = [math.ceil(b / SCALE) for _a, b in ROWS]
    for lay, r in runs.items():
        assert r["ok"], lay
        # accounting closes: every request finished, every preemption was restored
        assert r["requests_total"] == r["completed"] == len(ROWS), lay
        assert r["retractions"] == r["restores"], lay
        # no policy can finish before the longest request has decoded its output (admitted at step 1 at best)
        assert r["steps"] >= max(outputs) + 1, lay
    dyn = runs["dynamic"]
    # the arena holds every request at once under the dynamic split, so it finishes at the bound; the running
    # sum is the same work for every policy, so no static split can have a higher mean concurrency
    assert dyn["max_running"] == len(ROWS) and dyn["steps"] == max(outputs) + 1
    statics = {k: v["mean_running"] for k, v in runs.items() if k.startswith("static")}
    best = max(statics, key=statics.__getitem__)
    assert dyn["mean_running"] >= statics[best]
    want = f"{dyn['mean_running'] / statics[best]:.2f}x"
    line = next(ln for ln in res.stdout.splitlines() if re.search(r"dynamic vs oracle ", ln))
    assert f"oracle {best}" in line and want in line and line.rstrip().endswith("met"), line
    assert f"| {best} (oracle) |" in table.read_text()
    assert "every run verified its bytes: True; every run's accounting closed: True" in res.stdout
