"""Benchmark ``MultiEndedAllocator.translate`` / ``translate_pages`` on the host (a plain script, not a test).

* One allocator (full + SWA ends, page_size 16) with pages allocated in shuffled order, so the v2p tables are a
  permutation; ids are valid, contiguous inside each page, pages in random order (a flattened block table).
* Per-call cost: microseconds per call at 16 tokens (``translate``, ``out=`` given and not, ``translate_pages``
  at 16 pages, numpy ids); throughput: ns per token at the ``--sizes`` (default 64k, 1M).
* Times are CPU time of this thread (``time.thread_time``), so load from other processes on a shared machine
  inflates them less than wall time; each figure is the median of ``--repeats`` blocks after a warm-up.
* Only the public API is used, so the same script times any tree: run it once per tree, same machine, same run,
  e.g. ``PYTHONPATH=<tree> python benchmarks/bench_alloc_translate.py --json`` for each and compare.

Run: ``python benchmarks/bench_alloc_translate.py [--sizes 64k,1M] [--repeats 15] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from umalloc import MultiEndedAllocator
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, LayerSpec

PAGE_SIZE = 16
SEED = 20261201


def parse_sizes(text: str) -> list[int]:
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = {"k": 1 << 10, "m": 1 << 20}.get(part[-1:], 1)
        sizes.append(int(part.rstrip("km")) * mult)
    return sizes


def make(num_pages: int, rng: np.random.Generator) -> tuple[MultiEndedAllocator, np.ndarray]:
    """An allocator with ``num_pages`` live virtual pages bound on both ends, minted in shuffled order."""
    full = EndSpec("full", (LayerSpec.mha(1, 2),), page_size=PAGE_SIZE)
    swa = EndSpec("swa", (LayerSpec.mha(1, 1, window_tokens=4 * PAGE_SIZE),), page_size=PAGE_SIZE,
                  grow=Grow.DOWN, owner="full", role=EndRole.SWA)
    alloc = MultiEndedAllocator(Arena(ArenaSpec((full, swa), arena_bytes=(full.page_bytes + swa.page_bytes) * (num_pages * 2 + 64)),
                                      zero=False))
    got = alloc.alloc_pages(2 * num_pages)
    assert got is not None
    keep = rng.permutation(got.numpy())[:num_pages]
    drop = np.setdiff1d(got.numpy(), keep)
    alloc.free_pages(torch.from_numpy(drop))
    return alloc, keep


def cpu_median(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median thread CPU seconds per call over ``repeats`` blocks of ``calls`` calls (one warm-up block)."""
    for _ in range(calls):
        fn()
    per = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        per.append((time.thread_time() - t0) / calls)
    return statistics.median(per)


def run(sizes: list[int], repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(SEED)
    results: dict[str, float] = {}
    alloc, vpages = make(max(sizes) // PAGE_SIZE + 8, rng)

    def tokens_of(n: int) -> torch.Tensor:
        pages = vpages[rng.integers(0, vpages.size, size=(n + PAGE_SIZE - 1) // PAGE_SIZE)]
        return torch.from_numpy((pages[:, None] * PAGE_SIZE + np.arange(PAGE_SIZE)).reshape(-1)[:n].copy())

    small = tokens_of(16)
    out = torch.empty(16, dtype=torch.int64)
    small_np = small.numpy().copy()
    small_pages = torch.from_numpy(vpages[:16].copy())
    calls = 2000
    results["translate 16 tok (us/call)"] = 1e6 * cpu_median(lambda: alloc.translate(small, "full"), calls, repeats)
    results["translate 16 tok out= (us/call)"] = 1e6 * cpu_median(
        lambda: alloc.translate(small, "swa", out=out), calls, repeats)
    results["translate 16 tok numpy (us/call)"] = 1e6 * cpu_median(
        lambda: alloc.translate(small_np, "full"), calls, repeats)
    results["translate_pages 16 (us/call)"] = 1e6 * cpu_median(
        lambda: alloc.translate_pages(small_pages, "swa"), calls, repeats)
    results["translate 16 tok strict=False (us/call)"] = 1e6 * cpu_median(
        lambda: alloc.translate(small, "full", strict=False), calls, repeats)
    for n in sizes:
        toks = tokens_of(n)
        big_out = torch.empty(n, dtype=torch.int64)
        reps = max(3, min(50, (1 << 22) // n))
        results[f"translate {n} tok (ns/tok)"] = 1e9 * cpu_median(
            lambda t=toks: alloc.translate(t, "full"), reps, repeats) / n
        results[f"translate {n} tok out= (ns/tok)"] = 1e9 * cpu_median(
            lambda t=toks, o=big_out: alloc.translate(t, "full", out=o), reps, repeats) / n
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64k,1M")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"seed={SEED}", flush=True)
    results = run(parse_sizes(args.sizes), args.repeats)
    if args.json:
        print(json.dumps(results))
        return
    for key, value in results.items():
        print(f"{key:42s} {value:10.3f}")


if __name__ == "__main__":
    main()
