"""Compaction throughput and pause per flush, against a plain torch copy of the same bytes in the same run.

For each size N (moved pages per flush) and layout it builds an up-end band whose survivor walk moves exactly
N pages, then times one flush = plan (:func:`umalloc.pool.compaction.plan_up`) + apply (:func:`apply_plan`: one
batched envelope copy + table rewrite). Baseline: ``torch.Tensor.copy_`` of N * page_bytes contiguous bytes
between two ranges of the same arena. Layouts:

* ``contiguous``: band pages ``[1, N]`` are holes, ``[N+1, 2N]`` live: one run on both sides.
* ``fragmented``: N holes scattered at random among the lowest 2N pages, N live pages above them: N
  destination runs (the copy cannot be one memcpy).

Usage::

    python benchmarks/bench_compaction.py [--sizes 1024,65536] [--page-bytes 4096] [--device cpu|cuda]
        [--repeats 9] [--seed 0] [--threads 1,2]

For each thread count (set once for torch and numba alike, printed) it prints a table: per-flush pause (plan +
apply, best of the rounds, and the median), plan time, moved GB/s over the best pause, torch copy GB/s,
``ratio`` = the median over the rounds of (torch copy time / flush pause) in the same round (target >= 0.9;
``best`` = best copy / best pause), ``move-only`` = the same against the flush's batched envelope copy alone
(:func:`copy_moves`), ``x rows`` = the median of (torch's own move of the same pages, ``index_select`` +
``index_copy_``, / the flush's byte move): the like-for-like baseline where the pages are scattered, then each
round's ratio. The machine load (``os.getloadavg``) is printed first and last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numba
import numpy as np
import torch

from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndSpec, LayerSpec
from umalloc.pool.compaction import apply_plan, copy_moves, plan_up
from umalloc.pool.pagestate import PAGE_GAP, PAGE_HOLE, PAGE_LIVE, PAGE_RESERVED, TOMBSTONE


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(num_moved: int, layout: str, page_bytes: int, device: str, rng: np.random.Generator):
    end = EndSpec("full", (LayerSpec.mha(1, page_bytes // 4),), page_size=1)  # bf16 K+V: 4 B per head_dim
    assert end.page_bytes == page_bytes
    low = num_moved if layout == "contiguous" else 2 * num_moved
    wm = 1 + low + num_moved
    slots = wm + 1
    arena = Arena(ArenaSpec((end,), arena_bytes=page_bytes * slots), device=device, zero=False)
    state = np.full(slots, PAGE_GAP, np.int8)
    state[0] = PAGE_RESERVED
    state[1:wm] = PAGE_LIVE
    if layout == "contiguous":
        holes = np.arange(1, 1 + num_moved)
    else:
        holes = 1 + np.sort(rng.choice(low, num_moved, replace=False))
    state[holes] = PAGE_HOLE
    p2v = np.full(slots, TOMBSTONE, np.int64)
    live = np.flatnonzero(state == PAGE_LIVE)
    p2v[live] = np.arange(live.size)
    v2p = np.full(slots, TOMBSTONE, np.int64)
    v2p[: live.size] = live
    return arena, state, p2v, v2p, wm


def timed(fn, dev: torch.device) -> float:
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t0


def bench(num_moved: int, layout: str, page_bytes: int, device: str, repeats: int, seed: int) -> dict:
    """``repeats`` rounds (after one warm-up round), each timing in turn: a torch copy of the same bytes, one
    flush (plan + apply on fresh tables) and the flush's byte move alone; each round's ratios come from its own
    three times (a load spike hits one round, not one side)."""
    rng = np.random.default_rng(seed)
    arena, state0, p2v0, v2p0, wm = build(num_moved, layout, page_bytes, device, rng)
    dev = arena.device
    pins = np.zeros(state0.size, np.int32)
    nbytes = num_moved * page_bytes
    plan0 = plan_up(state0.copy(), pins, 1, wm)
    src = arena.data[page_bytes: page_bytes + nbytes]          # baseline: the same bytes, one contiguous copy
    dst = arena.data[arena.arena_bytes - nbytes:]
    env = arena.envelopes("full")
    src_t = torch.from_numpy(plan0.src_pages).to(dev)
    dst_t = torch.from_numpy(plan0.dst_pages).to(dev)
    pauses, plans, moves, copies, rowcopies = [], [], [], [], []
    for _ in range(repeats + 1):  # the first round warms numba / caches
        copies.append(timed(lambda: dst.copy_(src), dev))
        rowcopies.append(timed(lambda: env.index_copy_(0, dst_t, env.index_select(0, src_t)), dev))
        state, p2v, v2p = state0.copy(), p2v0.copy(), v2p0.copy()
        sync(dev)
        t0 = time.perf_counter()
        plan = plan_up(state, pins, 1, wm)
        t1 = time.perf_counter()
        moved = apply_plan(arena, "full", plan, state=state, p2v=p2v, v2p=v2p)
        sync(dev)
        t2 = time.perf_counter()
        assert plan.num_moves == num_moved and moved == nbytes, (plan.num_moves, moved)
        pauses.append(t2 - t0)
        plans.append(t1 - t0)
        moves.append(timed(lambda: copy_moves(arena, "full", plan0.src_pages, plan0.dst_pages), dev))
    pauses, plans, moves, copies, rowcopies = pauses[1:], plans[1:], moves[1:], copies[1:], rowcopies[1:]
    ratios = [c / p for c, p in zip(copies, pauses, strict=True)]
    move_ratios = [c / m for c, m in zip(copies, moves, strict=True)]
    return {"pages": num_moved, "layout": layout, "pause_ms": min(pauses) * 1e3, "plan_ms": min(plans) * 1e3,
            "median_pause_ms": statistics.median(pauses) * 1e3,
            "gbps": nbytes / min(pauses) / 1e9, "copy_gbps": nbytes / min(copies) / 1e9,
            "ratio_best": min(copies) / min(pauses), "ratio": statistics.median(ratios),
            "move_ratio": statistics.median(move_ratios), "move_ratio_best": min(copies) / min(moves),
            "rows_ratio": statistics.median(r / m for r, m in zip(rowcopies, moves, strict=True)),
            "rounds": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,65536", help="moved pages per flush, comma separated")
    ap.add_argument("--page-bytes", type=int, default=4096)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--layouts", default="contiguous,fragmented")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("UMALLOC_SEED", "0")))
    ap.add_argument("--threads", default="1,2",
                    help="comma list of CPU thread counts, each set for BOTH torch and numba before its table")
    args = ap.parse_args()
    print(f"device={args.device} page_bytes={args.page_bytes} repeats={args.repeats} seed={args.seed} "
          f"load={'/'.join(f'{x:.2f}' for x in os.getloadavg())} cpus={os.cpu_count()}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        print(f"\n# threads: torch={torch.get_num_threads()} numba={numba.get_num_threads()} (umalloc and the torch "
              f"copy alike)")
        header = (f"{'pages':>7} {'layout':>11} {'MiB':>8} {'pause ms':>9} {'median':>8} {'plan ms':>8} "
                  f"{'GB/s':>7} {'copy GB/s':>9} {'ratio':>6} {'(best)':>6} {'move-only':>9} {'(best)':>6} "
                  f"{'x rows':>6}")
        print(header)
        print("-" * len(header))
        for size in (int(s) for s in args.sizes.split(",")):
            for layout in args.layouts.split(","):
                r = bench(size, layout, args.page_bytes, args.device, args.repeats, args.seed)
                mib = size * args.page_bytes / 2**20
                print(f"{r['pages']:>7} {layout:>11} {mib:>8.1f} {r['pause_ms']:>9.3f} {r['median_pause_ms']:>8.3f} "
                      f"{r['plan_ms']:>8.3f} {r['gbps']:>7.2f} {r['copy_gbps']:>9.2f} {r['ratio']:>6.2f} "
                      f"{r['ratio_best']:>6.2f} {r['move_ratio']:>9.2f} {r['move_ratio_best']:>6.2f} "
                      f"{r['rows_ratio']:>6.2f}")
                print("        rounds (torch copy / flush): " + " ".join(f"{x:.2f}" for x in r["rounds"]))
    print(f"\nload={'/'.join(f'{x:.2f}' for x in os.getloadavg())} (os.getloadavg at the end)")


if __name__ == "__main__":
    main()
