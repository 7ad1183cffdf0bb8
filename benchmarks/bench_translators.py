"""Benchmark the translators against same-run numpy baselines (a plain script, not a test).

* ``virtual_to_physical``: ns per token for every available implementation, and the ratio to ``numpy.take``
  gathering one int64 per token from the same v2p table with precomputed page indices (the bandwidth floor:
  what any translation has to read and write). Target: <= 1.2x at >= 1M tokens.
* ``pages_to_runs``: ns per page pair, and the speedup over a vectorized numpy ``diff`` implementation written
  here. Target: >= 3x at >= 1M pages.
* Inputs look like flattened block tables: pages in random order, tokens contiguous inside each page, a v2p
  table that is a random permutation with 1% tombstones; page pairs come in runs of 1-8 pages.
* Each figure is the median of several timed repeats after one warm-up call (which also pays numba's JIT).

Run: ``python benchmarks/bench_translators.py [--sizes 1k,64k,1M,16M] [--page-size 16]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numba
import numpy as np
import torch

from umalloc.translators import available_impls, load_impl
from umalloc.translators import cpu as cpu_mod
from umalloc.translators import cuda as cuda_mod

TARGET_V2P_RATIO = 1.2
TARGET_RUNS_SPEEDUP = 3.0


def parse_sizes(text: str) -> list[int]:
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = {"k": 1 << 10, "m": 1 << 20}.get(part[-1:], 1)
        sizes.append(int(part.rstrip("km")) * mult)
    return sizes


def label(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10}k"
    return str(n)


def measure(
    fns: dict[str, Callable[[], object]], n_items: int, sync: Callable[[], None] | None = None
) -> dict:
    """Median wall time of each function, timed round-robin (one call of each per round) so that load from
    other processes hits every variant alike. One warm-up call each (pays numba's JIT); 5 to 200 rounds."""
    for fn in fns.values():
        fn()
    if sync:
        sync()
    rounds = max(5, min(200, int(2e7 // max(n_items, 1))))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def with_threshold(fn: Callable[[], object], min_items: int) -> Callable[[], object]:
    """``fn`` with the numba translator's parallel threshold set to ``min_items`` (0: always parallel,
    ``NEVER_PARALLEL``: always on the calling thread)."""

    def run() -> object:
        saved = cpu_mod.PARALLEL_MIN_ITEMS
        cpu_mod.PARALLEL_MIN_ITEMS = min_items
        try:
            return fn()
        finally:
            cpu_mod.PARALLEL_MIN_ITEMS = saved

    return run


def numpy_runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The vectorized numpy baseline for pages_to_runs: diff, flag, flatnonzero, stack."""
    n = src.shape[0]
    if n == 0:
        return np.empty((0, 3), dtype=np.int64)
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    brk[1:] = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, n))
    return np.stack([src[starts], dst[starts], lengths], axis=1)


def make_v2p_inputs(num_tokens: int, ps: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    num_pages = max(1, num_tokens // ps)
    v2p = rng.permutation(num_pages).astype(np.int64) + 1
    v2p[rng.random(num_pages) < 0.01] = -1
    pages = rng.permutation(num_pages).astype(np.int64)
    vtokens = (pages[:, None] * ps + np.arange(ps, dtype=np.int64)).reshape(-1)[:num_tokens]
    return vtokens, v2p


def make_run_inputs(num_pages: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    lengths = rng.integers(1, 9, size=num_pages // 4 + 1)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), num_pages) + 1]
    starts_src = rng.integers(0, 1 << 30, size=lengths.shape[0])
    starts_dst = rng.integers(0, 1 << 30, size=lengths.shape[0])
    offsets = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    src = (np.repeat(starts_src, lengths) + offsets)[:num_pages].astype(np.int64)
    dst = (np.repeat(starts_dst, lengths) + offsets)[:num_pages].astype(np.int64)
    return src, dst


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="1k,64k,1M,16M", help="comma list of token/page counts (k, M suffixes)"
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    parser.add_argument("--seed", type=int, default=int(os.environ.get("UMALLOC_SEED", "0")))
    args = parser.parse_args()
    sizes = parse_sizes(args.sizes)
    ps = args.page_size
    rng = np.random.default_rng(args.seed)

    impls = available_impls()
    cuda = load_impl("cuda") if "cuda" in impls else None
    ref, cpu = load_impl("reference"), load_impl("cpu")
    load = os.getloadavg()
    print(
        f"machine: {os.cpu_count()} cores, load avg {load[0]:.1f}; numba {numba.__version__} "
        f"({numba.get_num_threads()} threads, layer {numba.config.THREADING_LAYER}, cpu.PARALLEL_MIN_ITEMS="
        f"{cpu_mod.PARALLEL_MIN_ITEMS}); torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); numpy {np.__version__}; page_size={ps}; seed={args.seed}"
    )
    print(f"cuda: {'cupy figures below' if cuda else f'not run ({cuda_mod.unavailable_reason()})'}")

    v2p_rows = [bench_v2p(n, ps, rng, ref, cpu, cuda) for n in sizes]
    run_rows = [bench_runs(n, rng, ref, cpu, cuda) for n in sizes]
    print_tables(v2p_rows, run_rows)


def bench_v2p(n: int, ps: int, rng: np.random.Generator, ref, cpu, cuda) -> dict:
    vt_np, v2p_np = make_v2p_inputs(n, ps, rng)
    page_idx = vt_np // ps
    take_out = np.empty_like(vt_np)
    vt, v2p = torch.from_numpy(vt_np), torch.from_numpy(v2p_np)
    v2p_bound = torch.from_numpy(np.abs(v2p_np))  # no tombstones, so strict mode succeeds
    out = torch.empty_like(vt)
    fns = {
        "take": lambda: np.take(v2p_np, page_idx, out=take_out),
        "reference": lambda: ref.virtual_to_physical(vt, v2p, ps, strict=False),
        "cpu": lambda: cpu.virtual_to_physical(vt, v2p, ps, strict=False),
        "cpu out=": lambda: cpu.virtual_to_physical(vt, v2p, ps, out=out, strict=False),
        "cpu out= 1 thread": with_threshold(
            lambda: cpu.virtual_to_physical(vt, v2p, ps, out=out, strict=False), cpu_mod.NEVER_PARALLEL
        ),
        f"cpu out= {numba.get_num_threads()} threads": with_threshold(
            lambda: cpu.virtual_to_physical(vt, v2p, ps, out=out, strict=False), 0
        ),
        "cpu strict out=": lambda: cpu.virtual_to_physical(vt, v2p_bound, ps, out=out, strict=True),
        # the host fast path an allocator takes: its numpy master table, out= a tensor
        "cpu numpy v2p out=": lambda: cpu.virtual_to_physical(vt, v2p_np, ps, out=out, strict=False),
    }
    row = {"n": n, **measure(fns, n)}
    if cuda is not None:
        vt_d, v2p_d = vt.cuda(), v2p.cuda()
        out_d = torch.empty_like(vt_d)
        fns = {"cuda out=": lambda: cuda.virtual_to_physical(vt_d, v2p_d, ps, out=out_d)}
        row.update(measure(fns, n, sync=torch.cuda.synchronize))
    return row


def bench_runs(n: int, rng: np.random.Generator, ref, cpu, cuda) -> dict:
    src_np, dst_np = make_run_inputs(n, rng)
    src, dst = torch.from_numpy(src_np), torch.from_numpy(dst_np)
    expect = numpy_runs(src_np, dst_np)
    assert np.array_equal(cpu.pages_to_runs(src, dst).numpy(), expect), (
        "cpu pages_to_runs disagrees with numpy"
    )
    fns = {
        "numpy": lambda: numpy_runs(src_np, dst_np),
        "reference": lambda: ref.pages_to_runs(src, dst),
        "cpu": lambda: cpu.pages_to_runs(src, dst),
        "cpu 1 thread": with_threshold(lambda: cpu.pages_to_runs(src, dst), cpu_mod.NEVER_PARALLEL),
        f"cpu {numba.get_num_threads()} threads": with_threshold(lambda: cpu.pages_to_runs(src, dst), 0),
    }
    row = {"n": n, "runs": expect.shape[0], **measure(fns, n)}
    if cuda is not None:
        src_d, dst_d = src.cuda(), dst.cuda()
        row.update(
            measure({"cuda": lambda: cuda.pages_to_runs(src_d, dst_d)}, n, sync=torch.cuda.synchronize)
        )
    return row


def print_tables(v2p_rows: list[dict], run_rows: list[dict]) -> None:
    def ns(t: float, n: int) -> str:
        return f"{t / n * 1e9:.2f}"

    v2p_cols = [k for k in v2p_rows[0] if k not in ("n", "take")]
    header = ["tokens", "np.take ns/tok"] + [f"{k} ns/tok (x take)" for k in v2p_cols] + ["target"]
    body = []
    for r in v2p_rows:
        n = r["n"]
        cells = [label(n), ns(r["take"], n)]
        cells += [f"{ns(r[k], n)} ({r[k] / r['take']:.2f}x)" for k in v2p_cols]
        if n >= 1 << 20:
            ok = r["cpu"] / r["take"] <= TARGET_V2P_RATIO
            cells.append(f"cpu <= {TARGET_V2P_RATIO}x: {'met' if ok else 'MISSED'}")
        else:
            cells.append("-")
        body.append(cells)
    emit("virtual_to_physical vs numpy.take over the same table", header, body)

    run_cols = [k for k in run_rows[0] if k not in ("n", "runs", "numpy")]
    header = (
        ["pages", "runs", "numpy diff ns/page"] + [f"{k} ns/page (speedup)" for k in run_cols] + ["target"]
    )
    body = []
    for r in run_rows:
        n = r["n"]
        cells = [label(n), str(r["runs"]), ns(r["numpy"], n)]
        cells += [f"{ns(r[k], n)} ({r['numpy'] / r[k]:.2f}x)" for k in run_cols]
        if n >= 1 << 20:
            ok = r["numpy"] / r["cpu"] >= TARGET_RUNS_SPEEDUP
            cells.append(f"cpu >= {TARGET_RUNS_SPEEDUP}x: {'met' if ok else 'MISSED'}")
        else:
            cells.append("-")
        body.append(cells)
    emit("pages_to_runs vs vectorized numpy diff", header, body)


def emit(title: str, header: list[str], body: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}")
        widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(header)]
        print(" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
        for row in body:
            print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
        return
    table = Table(title=title)
    for h in header:
        table.add_column(h, justify="right")
    for row in body:
        table.add_row(*row)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
