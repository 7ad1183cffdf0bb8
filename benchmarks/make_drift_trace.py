"""Write the drifting request mix of ``bench_capacity.py --drift`` (``benchmarks/data/drift_trace.jsonl``) from
the two shipped public traces. Never part of the test run; the bench reads the written file, not the traces.

    PYTHONPATH=. .venv/bin/python benchmarks/make_drift_trace.py [--requests 48] [--seed 0]
        [--traces-dir ../shared/data/traces] [--out benchmarks/data/drift_trace.jsonl]

Method (seeded, printed): request ``i`` of ``N`` is *long* with probability ``p(i) = (1 + cos(2 pi i / N)) / 2``
(1 at the start, 0 in the middle, back to 1 at the end), else *short*. A long request is a uniformly drawn row of
the Mooncake conversation trace with ``--long-min <= input_length <= --long-max`` (long-context: full attention holds the
whole prompt, a sliding or chunked layer only its window); a short one a uniformly drawn row of the Azure
conversation trace with ``ContextTokens <= --short-max`` (short: sliding layers hold every token too, so their
bytes dominate). Each drawn row keeps its own prompt and output lengths. The output is Mooncake JSONL: arrival
``timestamp`` = the row index (ms; the replay admits in file order and does not pace by time), one fresh
``hash_ids`` entry per 512 prompt tokens (no prefix sharing).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "data" / "drift_trace.jsonl"


def drift_rows(mooncake: Path, azure: Path, n: int, seed: int, long_min: int, long_max: int,
               short_max: int) -> list[dict]:
    """The ``n`` rows of the drifting mix (see the module docstring), each ``{"timestamp", "input_length",
    "output_length", "hash_ids", "kind"}``; the same arguments give the same rows."""
    longs = [(r["input_length"], r["output_length"]) for r in map(json.loads, mooncake.open())
             if long_min <= r["input_length"] <= long_max and r["output_length"] >= 1]
    with azure.open() as f:
        shorts = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)
                  if 1 <= int(r["ContextTokens"]) <= short_max and int(r["GeneratedTokens"]) >= 1]
    rng = random.Random(seed)
    rows, next_hash = [], 0
    for i in range(n):
        long = rng.random() < (1 + math.cos(2 * math.pi * i / n)) / 2
        inp, out = rng.choice(longs if long else shorts)
        blocks = -(-inp // 512)
        rows.append({"timestamp": i, "input_length": inp, "output_length": out,
                     "hash_ids": list(range(next_hash, next_hash + blocks)), "kind": "long" if long else "short"})
        next_hash += blocks
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-min", type=int, default=8192, help="least prompt tokens of a long (Mooncake) row")
    ap.add_argument("--long-max", type=int, default=32768, help="most prompt tokens of a long (Mooncake) row")
    ap.add_argument("--short-max", type=int, default=1024, help="most prompt tokens of a short (Azure) row")
    ap.add_argument("--traces-dir", type=Path, default=ROOT.parent / "shared" / "data" / "traces")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    rows = drift_rows(args.traces_dir / "conversation_trace.jsonl",
                      args.traces_dir / "AzureLLMInferenceTrace_conv.csv", args.requests, args.seed,
                      args.long_min, args.long_max, args.short_max)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for r in rows:
            f.write(json.dumps({k: r[k] for k in ("timestamp", "input_length", "output_length", "hash_ids")}) + "\n")
    kinds = "".join("L" if r["kind"] == "long" else "s" for r in rows)
    print(f"seed {args.seed}: {len(rows)} requests -> {args.out}\n{kinds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
