"""vLLM's own ``BlockPool`` against umalloc's (``umalloc.integrations.vllm``), side by side in one run.

Run it in the vLLM peer venv (``scripts/peer_suite_vllm.sh`` builds it)::

    PYTHONPATH=.peer/path .peer/vllm-venv/bin/python benchmarks/bench_vllm_pool.py [--rounds 7] [--seed 0]

Op mixes (every one is a fixed, seeded op sequence; each round runs it on a fresh stock pool, then on a fresh
umalloc pool, alternating, so both see the same machine load):

* ``caching``: the prefix-caching mix on a 4,096-block pool with prefix caching on: per request
  ``get_cached_block`` over its block hashes until the first miss, ``touch`` of the hits, ``get_new_blocks`` for
  the rest, ``cache_full_blocks`` of every full block, and, once 24 requests are live, ``free_blocks`` of the
  oldest request's blocks last first (as vLLM's KV-cache manager frees). Requests share prefixes from 32
  families (so hits, misses and LRU evictions all happen). Timed whole, and per op (``get_new_blocks`` alone,
  ``free_blocks`` alone: the time spent in those calls within the mix).
* ``k=10 / 100 / 1000``: ``get_new_blocks(k)`` + ``free_blocks`` on a 100,000-block pool: 64 allocations of
  ``k`` blocks stay live, each new one frees the oldest, so free lists are fragmented.

Checked, outside timing: both pools give the same prefix hits per request and hand out the same number of
blocks (the ids differ by design: umalloc hands out the lowest free id, vLLM the most recently freed);
umalloc's pool passes ``check_invariants`` after every run.

Prints one row per mix: the best-of-rounds seconds of each pool, the time ratio umalloc / stock and the speed
stock / umalloc (> 1: umalloc faster), then per mix each round's speed ratio and their median. torch and numba
run on ``--threads`` threads (default 1, set once and printed); the machine load is printed first and last.
``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _fair as fair  # noqa: E402

BLOCK_SIZE = 16


def caching_ops(seed: int, n_requests: int, families: int = 32) -> list[list[bytes]]:
    """Each request's block hashes: a shared prefix of 1-24 blocks from one of ``families`` (some prefixes are
    longer than others, so hits stop at different depths) and 1-12 blocks of its own."""
    rng = random.Random(seed)
    fam = [[f"f{f}-{j}".encode().ljust(32, b".") for j in range(24)] for f in range(families)]
    out = []
    for r in range(n_requests):
        f = rng.randrange(families)
        shared = fam[f][: rng.randint(1, 24)]
        own = [f"r{r}-{j}".encode().ljust(32, b".") for j in range(rng.randint(1, 12))]
        out.append(shared + own)
    return out


def run_caching(pool: Any, requests: list[list[bytes]], live: int = 24) -> tuple[float, float, float, list[int]]:
    """The prefix-caching mix on ``pool``: returns (total seconds, seconds in get_new_blocks, seconds in
    free_blocks, hits per request)."""
    from vllm.v1.core.kv_cache_utils import BlockHash

    clock = time.perf_counter
    held: collections.deque[list[Any]] = collections.deque()
    hits: list[int] = []
    t_new = t_free = 0.0
    prepared = [(SimpleNamespace(block_hashes=[BlockHash(h) for h in hs]), len(hs)) for hs in requests]
    get_cached, touch, get_new = pool.get_cached_block, pool.touch, pool.get_new_blocks
    cache_full, free = pool.cache_full_blocks, pool.free_blocks
    group = [0]
    t0 = clock()
    for req, n in prepared:
        if len(held) == live:
            blocks = held.popleft()
            a = clock()
            free(reversed(blocks))
            t_free += clock() - a
        found: list[Any] = []
        for h in req.block_hashes:
            got = get_cached(h, group)
            if got is None:
                break
            found.append(got[0])
        touch(found)
        a = clock()
        new = get_new(n - len(found))
        t_new += clock() - a
        blocks = found + new
        cache_full(req, blocks, len(found), n, BLOCK_SIZE, 0)
        held.append(blocks)
        hits.append(len(found))
    while held:
        blocks = held.popleft()
        a = clock()
        free(reversed(blocks))
        t_free += clock() - a
    return clock() - t0, t_new, t_free, hits


def run_k(pool: Any, k: int, steps: int, live: int = 64) -> tuple[float, int]:
    """``steps`` x (``get_new_blocks(k)``, then ``free_blocks`` of the oldest live allocation once ``live`` are
    held): returns (seconds, blocks handed out)."""
    clock = time.perf_counter
    held: collections.deque[list[Any]] = collections.deque()
    get_new, free = pool.get_new_blocks, pool.free_blocks
    handed = 0
    t0 = clock()
    for _ in range(steps):
        if len(held) == live:
            free(held.popleft())
        got = get_new(k)
        handed += len(got)
        held.append(got)
    while held:
        free(held.popleft())
    return clock() - t0, handed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="stock/umalloc alternations per mix (best is kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=4000, help="requests of the caching mix")
    ap.add_argument("--json", default=None, help="write the rows to this JSON file")
    ap.add_argument("--threads", type=int, default=fair.DEFAULT_THREADS,
                    help="CPU threads for torch and numba, both pools alike (set once, printed)")
    a = ap.parse_args()
    print(fair.set_threads(a.threads))
    print(f"# {fair.load()} (at the start)")

    from vllm.v1.core.block_pool import BlockPool

    from umalloc.integrations.vllm import UmallocBlockPool

    print(f"seed {a.seed}, {a.rounds} rounds, best of rounds per pool")
    pools: dict[str, Callable[..., Any]] = {"stock": BlockPool, "umalloc": UmallocBlockPool}
    requests = caching_ops(a.seed, a.requests)
    rows: list[dict[str, Any]] = []

    def record(mix: str, times: dict[str, list[float]]) -> None:
        s, u = min(times["stock"]), min(times["umalloc"])
        per_round = [x / y for x, y in zip(times["stock"], times["umalloc"], strict=True)]
        rows.append({"mix": mix, "stock_s": s, "umalloc_s": u, "ratio": u / s, "speed": s / u,
                     "speed_rounds": per_round, "speed_median": statistics.median(per_round)})

    # ---- the caching mix (one pool per round and per kind; the same requests)
    times: dict[str, dict[str, list[float]]] = {m: {"stock": [], "umalloc": []} for m in ("mix", "new", "free")}
    hits: dict[str, list[int]] = {}
    for _ in range(a.rounds):
        for name, cls in pools.items():
            pool = cls(4096, enable_caching=True, hash_block_size=BLOCK_SIZE)
            total, t_new, t_free, h = run_caching(pool, requests)
            times["mix"][name].append(total)
            times["new"][name].append(t_new)
            times["free"][name].append(t_free)
            if name == "umalloc":
                pool.check_invariants()
            if hits.setdefault(name, h) != h:
                raise SystemExit(f"{name}: prefix hits differ between rounds")
    if hits["stock"] != hits["umalloc"]:
        diff = next(i for i, (x, y) in enumerate(zip(hits["stock"], hits["umalloc"], strict=True)) if x != y)
        raise SystemExit(f"prefix hits differ at request {diff}: stock {hits['stock'][diff]}, umalloc "
                         f"{hits['umalloc'][diff]}")
    print(f"caching mix: {len(requests)} requests, {sum(hits['stock'])} prefix-hit blocks (equal in both pools)")
    record("prefix-caching mix, 4,096 blocks", times["mix"])
    record("... get_new_blocks alone", times["new"])
    record("... free_blocks alone", times["free"])

    # ---- get_new_blocks(k) + free_blocks on a 100k-block pool
    for k, steps in ((10, 20_000), (100, 4_000), (1000, 600)):
        kt: dict[str, list[float]] = {"stock": [], "umalloc": []}
        handed: dict[str, int] = {}
        for _ in range(a.rounds):
            for name, cls in pools.items():
                pool = cls(100_000, enable_caching=True, hash_block_size=BLOCK_SIZE)
                t, n = run_k(pool, k, steps)
                kt[name].append(t)
                handed[name] = n
                if name == "umalloc":
                    pool.check_invariants()
        if handed["stock"] != handed["umalloc"]:
            raise SystemExit(f"k={k}: blocks handed out differ: {handed}")
        record(f"get_new_blocks({k}) + free_blocks, 100k blocks", kt)

    print("\n| op mix | stock s | umalloc s | time ratio umalloc/stock | speed stock/umalloc |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mix']} | {r['stock_s']:.4f} | {r['umalloc_s']:.4f} | {r['ratio']:.2f} | {r['speed']:.2f}x |")
    print("\nspeed stock s / umalloc s per round (each round runs both pools back to back), then the median:")
    for r in rows:
        print(fair.round_ratios(r["mix"][:24], r["speed_rounds"]))
    print(f"# {fair.load()} (at the end)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"seed": a.seed, "rounds": a.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
