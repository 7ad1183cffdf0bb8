"""The GPU run's entry points work on a CPU machine: ``benchmarks/gpu/run.sh --dry-run`` and
``benchmarks/bench_gpu.py --device cpu --tiny`` (a smoke run of every code path; its figures mean nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_run_sh_dry_run_prints_its_steps_and_exits_0(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    res = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/run.sh"), "--dry-run"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    for step in ("would run (env", "would run (tests", "would run (bench", "tests/translators/test_gpu_capture.py",
                 "benchmarks/bench_gpu.py --out"):
        assert step in res.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_bench_gpu_cpu_tiny_smoke_run_is_correct_and_writes_json(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_gpu.py"), "--device", "cpu", "--tiny",
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((tmp_path / "bench_gpu.json").read_text())
    whats = [r["what"] for r in data["rows"]]
    assert whats[0].startswith("copy ceiling")
    assert any(w.startswith("translate 65536 torch indexing") for w in whats)
    assert any(w.startswith("compaction copy_pages") for w in whats)
    assert sum(w.startswith("decode batch") for w in whats) == 3
    assert all(r["correct"] is not False for r in data["rows"])
    assert res.stdout.rstrip().splitlines()[-1].startswith("sglang translate")  # the table is printed last
