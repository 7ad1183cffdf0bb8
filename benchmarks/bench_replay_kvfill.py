"""Throughput of the replay's KV pattern (umalloc_replay.single.kvfill) against a plain copy of the same bytes.

    .venv/bin/python benchmarks/bench_replay_kvfill.py [--mib 512] [--repeats 3]

For each end of the default preset (Gemma-3-12B full / SWA + Gemma-3-1B draft, 16-token pages) it times, on one
thread (as the replay runs): ``fill_pages`` and ``verify_pages`` over contiguous and shuffled physical pages,
``fill_tokens`` / ``verify_tokens`` for 32 decode steps of 64 requests, and the baseline ``torch.Tensor.copy_`` of the
same number of bytes between two arena-sized buffers, in the same run. Prints GB/s, seconds per GB (the
target for the replay's own pattern work is <= 0.3 s/GB, memcpy class) and the ratio to the baseline (best of
``--repeats``). Never part of the test run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from umalloc.geometry.arena import Arena
from umalloc.geometry.presets import DEFAULT_PRESET, preset_arena_spec
from umalloc_replay.single.kvfill import KVPattern


def best(fn, repeats: int) -> float:
    out = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512, help="bytes per end per measurement (MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    nbytes = args.mib << 20
    spec = preset_arena_spec(DEFAULT_PRESET, 3 * nbytes + (64 << 20), page_size=16)
    arena = Arena(spec)
    pat = KVPattern(spec, seed=0)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    base = nbytes / best(lambda: dst.copy_(src), args.repeats) / 1e9
    print(f"one thread; baseline copy_ of {args.mib} MiB: {base:.2f} GB/s ({1 / base:.3f} s/GB)")
    print(f"{'end':6} {'operation':30} {'GB/s':>7} {'s/GB':>7} {'x copy_':>8}  <= 0.3 s/GB")
    rng = np.random.default_rng(0)
    for e in spec.ends:
        bench_end(spec, arena, pat, e, nbytes, base, rng, args.repeats)


def bench_end(spec, arena: Arena, pat: KVPattern, e, nbytes: int, base: float, rng, repeats: int) -> None:
    pb = e.page_bytes
    first = spec.first_page(e.name)
    n = min(nbytes // pb, spec.top_page(e.name) - first)
    sp = torch.arange(n, dtype=torch.int64)
    runs = torch.arange(first, first + n, dtype=torch.int64)
    shuffled = torch.from_numpy(rng.permutation(n).astype(np.int64) + first)
    b = 64
    pos = np.arange(b, dtype=np.int64) * 37 + 5
    ptok = torch.from_numpy((np.arange(b, dtype=np.int64) + first) * e.page_size + pos % e.page_size)
    rids = np.arange(b, dtype=np.int64)
    rows = [
        ("fill_pages (one run)", n * pb, lambda: pat.fill_pages(arena, e.name, 1, sp, runs)),
        ("verify_pages (one run)", n * pb, lambda: pat.verify_pages(arena, e.name, 1, sp, runs)),
        ("fill_pages (shuffled)", n * pb, lambda: pat.fill_pages(arena, e.name, 1, sp, shuffled)),
        ("verify_pages (shuffled)", n * pb, lambda: pat.verify_pages(arena, e.name, 1, sp, shuffled)),
        # 32 decode steps of 64 tokens per measurement (one step alone is too short to time on a busy host)
        ("fill_tokens (64 tokens) x32", 32 * b * e.entry_bytes,
         lambda: [pat.fill_tokens(arena, e.name, rids, pos, ptok) for _ in range(32)]),
        ("verify_tokens (64 tokens) x32", 32 * b * e.entry_bytes,
         lambda: [pat.verify_tokens(arena, e.name, rids, pos, ptok) for _ in range(32)]),
    ]
    for name, size, fn in rows:
        fn()  # compile / warm once outside the timing
        gbs = size / best(fn, repeats) / 1e9
        print(f"{e.name:6} {name:30} {gbs:7.2f} {1 / gbs:7.3f} {gbs / base:8.2f}  {'yes' if 1 / gbs <= 0.3 else 'NO'}")

if __name__ == "__main__":
    main()
