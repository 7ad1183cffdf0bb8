"""vLLM's own ``BlockPool`` against umalloc's (``umalloc.integrations.vllm``), side by side in one run.

Run it in the vLLM peer venv (``scripts/peer_suite_vllm.sh`` builds it)::

    PYTHONPATH=.peer/path .peer/vllm-venv/bin/python benchmarks/bench_vllm_pool.py [--rounds 5] [--seed 0]

Each round runs a mix on a fresh stock pool, then on a fresh umalloc pool, so both see the same machine load;
every figure is a ratio within one round (speed = stock seconds / umalloc seconds, > 1: umalloc faster), and
the median of the rounds' ratios is the headline.

* Engine mixes (:func:`mixes`), prefix caching on, the calls vLLM's KV-cache managers make (:func:`run_mix`):
  one full-attention group, one sliding-window group, and a hybrid (full + sliding window groups on one pool, as
  vLLM's hybrid coordinator), at 4,096 and 65,536 blocks; requests share prefixes from a few families (hits,
  misses and LRU evictions all happen) and decode block by block, a sliding window freeing the block that leaves
  it each step. Timed whole and per op: ``lookup`` (``get_cached_block``, the stock code in both pools),
  ``touch``, ``get_new_blocks``, ``cache_full_blocks`` and ``free_blocks``.
* ``get_new_blocks(k) + free_blocks``, k = 1, 10, 100, 1000 on a 100,000-block pool: 64 allocations of ``k``
  blocks stay live, each new one frees the oldest, so free lists are fragmented.

Checked, outside timing: both pools give the same prefix hits and the same new-block counts per request (the ids
differ by design: umalloc hands out the lowest free id, vLLM the most recently freed); umalloc's pool passes
``check_invariants`` after every run.

Prints a table of the median speed ratio per op and mix, then every round's ratio and the median seconds. torch and
numba run on ``--threads`` threads (default 1, set once and printed, the same for both pools); the machine load is
printed at the start, after each mix and at the end. ``--only TEXT`` runs the mixes whose name contains it,
``--scale`` multiplies the request counts, ``--json PATH`` writes the rows.

``--lockstep`` times the engine mixes another way, for a loaded machine (:class:`Lockstep`): every pool call of a
mix is made on a stock pool and on a umalloc pool back to back, the order alternating call by call, and each
call is timed on its own; per op, each call's fastest of the rounds is kept (a preempted call loses to its other
rounds) and summed. Load then falls on both sides of each call alike: ``lookup``, the stock code in both pools,
reads 1.00x within a few percent where the default mode's rounds spread 0.5-1.5x.
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
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _fair as fair  # noqa: E402

BLOCK_SIZE = 16


#: the timed pool operations of the engine mixes, in the order a request meets them
OPS = ("lookup", "touch", "get_new_blocks", "cache_full_blocks", "free_blocks")


@dataclass(frozen=True)
class Mix:
    """One engine mix: the KV-cache groups sharing the pool (``"full"`` or ``"swa"``, vLLM's
    ``FullAttentionManager`` / ``SlidingWindowManager``), the pool size, the request shapes and how many requests run
    at once."""

    name: str
    num_blocks: int
    groups: tuple[str, ...]
    window: int           # sliding window in blocks (the swa groups)
    requests: int
    live: int             # requests running at once
    families: int         # shared-prefix families
    shared_max: int       # a request's shared prefix: 1..shared_max blocks of its family
    own_max: int          # then 1..own_max blocks of its own
    decode_max: int       # then 0..decode_max decoded blocks (one per step, all live requests in turn)


def mixes(scale: float) -> list[Mix]:
    """The engine mixes; ``scale`` multiplies the request counts."""
    n = lambda k: max(8, int(k * scale))  # noqa: E731
    return [
        Mix("full, prefill only, 4k", 4096, ("full",), 0, n(4000), 24, 32, 24, 12, 0),
        Mix("full + decode, 4k", 4096, ("full",), 0, n(2000), 24, 32, 24, 12, 24),
        Mix("swa, 4k", 4096, ("swa",), 8, n(2000), 24, 32, 24, 12, 24),
        Mix("hybrid full+swa, 4k", 4096, ("full", "swa"), 8, n(2000), 24, 32, 24, 12, 24),
        Mix("full + decode, 64k", 65536, ("full",), 0, n(1200), 96, 64, 256, 64, 48),
        Mix("swa, 64k", 65536, ("swa",), 32, n(1200), 96, 64, 256, 64, 48),
        Mix("hybrid full+swa, 64k", 65536, ("full", "swa"), 32, n(1200), 96, 64, 256, 64, 48),
    ]


def mix_requests(mix: Mix, seed: int) -> list[tuple[int, list[bytes]]]:
    """Each request's (prompt blocks, block hashes of prompt + decode): a shared prefix of its family (some
    prefixes longer than others, so hits stop at different depths), then blocks of its own."""
    rng = random.Random(seed)
    fam = [[f"f{f}-{j}".encode().ljust(32, b".") for j in range(mix.shared_max)] for f in range(mix.families)]
    out = []
    for r in range(mix.requests):
        shared = fam[rng.randrange(mix.families)][: rng.randint(1, mix.shared_max)]
        own = rng.randint(1, mix.own_max)
        dec = rng.randint(0, mix.decode_max)
        out.append((len(shared) + own, shared + [f"r{r}-{j}".encode().ljust(32, b".") for j in range(own + dec)]))
    return out


def run_mix(pool: Any, mix: Mix, requests: list[tuple[int, list[bytes]]]) -> tuple[float, dict[str, float], list]:
    """``mix`` on ``pool`` the way vLLM's KV-cache managers call a ``BlockPool``: returns (total seconds, seconds
    per op, outcome per request: its prefix-hit blocks per group and the ids' count handed out).

    Per request, per group: ``get_cached_block`` over the block hashes (a full group: from the first until a miss;
    a swa group: from the last back, until ``window`` contiguous hits, as ``SlidingWindowManager``; with a full
    group too the swa group searches only the full group's hit, and the hit is the shorter), ``touch`` of the hits
    (null blocks where a swa group skips), ``get_new_blocks`` for the prompt's rest (a swa group: only the last
    ``window`` blocks; the earlier ones are the null block), ``cache_full_blocks``. Then each step every live
    request decodes one block per group (``get_new_blocks(1)``, ``cache_full_blocks`` of it; a swa group frees the
    block leaving its window, replaced by the null block, as ``remove_skipped_blocks``); a request done decoding
    frees every group's blocks last first, group by group, and the next request is admitted."""
    from vllm.v1.core.kv_cache_utils import BlockHash

    clock = time.perf_counter
    t = dict.fromkeys(OPS, 0.0)
    get_cached, touch, get_new = pool.get_cached_block, pool.touch, pool.get_new_blocks
    cache_full, free, null = pool.cache_full_blocks, pool.free_blocks, pool.null_block
    groups = list(enumerate(mix.groups))
    gids = [[g] for g, _ in groups]
    window = mix.window
    outcome: list[tuple[int, ...]] = []
    pending = collections.deque((SimpleNamespace(block_hashes=[BlockHash(h) for h in hs]), p, len(hs))
                                for p, hs in requests)
    live: list[list[Any]] = []   # [request, blocks per group, blocks so far, blocks at the end]
    t0 = clock()

    def admit() -> None:
        req, prompt, total = pending.popleft()
        hashes = req.block_hashes
        a = clock()
        hit = prompt - 1   # vLLM leaves the last prompt block to compute
        found: list[list[Any]] = []
        for g, kind in groups:
            if kind == "full":
                got: list[Any] = []
                for h in hashes[:hit]:
                    c = get_cached(h, gids[g])
                    if c is None:
                        break
                    got.append(c[0])
                hit = len(got)
            else:
                got = [null] * hit
                run = 0
                match = False
                for i in range(hit - 1, -1, -1):
                    c = get_cached(hashes[i], gids[g])
                    if c is None:
                        run = 0
                        continue
                    got[i] = c[0]
                    run += 1
                    if run >= window:
                        del got[i + run:]
                        match = True
                        break
                if not match:
                    del got[run:]
                hit = len(got)
            found.append(got)
        b = clock()
        t["lookup"] += b - a
        for g, _ in groups:
            del found[g][hit:]
            touch(found[g])
        c = clock()
        t["touch"] += c - b
        per_group = []
        for g, kind in groups:
            blocks = found[g]
            if kind == "swa" and prompt - window > hit:
                blocks.extend([null] * (prompt - window - hit))
                blocks.extend(get_new(window))
            else:
                blocks.extend(get_new(prompt - hit))
            per_group.append(blocks)
        d = clock()
        t["get_new_blocks"] += d - c
        for g, _ in groups:
            cache_full(req, per_group[g], hit, prompt, BLOCK_SIZE, g)
        t["cache_full_blocks"] += clock() - d
        outcome.append((hit, prompt - hit))
        live.append([req, per_group, prompt, total])

    def finish(entry: list[Any]) -> None:
        a = clock()
        for blocks in entry[1]:
            free(reversed(blocks))
        t["free_blocks"] += clock() - a

    while pending or live:
        while pending and len(live) < mix.live:
            admit()
        still: list[list[Any]] = []
        for entry in live:
            req, per_group, n, total = entry
            if n == total:
                finish(entry)
                continue
            a = clock()
            for blocks in per_group:
                blocks.extend(get_new(1))
            b = clock()
            t["get_new_blocks"] += b - a
            for g, _ in groups:
                cache_full(req, per_group[g], n, n + 1, BLOCK_SIZE, g)
            c = clock()
            t["cache_full_blocks"] += c - b
            if window and n >= window:
                for g, kind in groups:
                    if kind == "swa":
                        blocks = per_group[g]
                        gone = blocks[n - window]
                        if gone is not null:
                            blocks[n - window] = null
                            free([gone])
            t["free_blocks"] += clock() - c
            entry[2] = n + 1
            still.append(entry)
        live[:] = still
    return clock() - t0, t, outcome


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


class Lockstep:
    """Two pools driven as one by :func:`run_mix`: each call goes to a stock ``BlockPool`` and a
    ``UmallocBlockPool`` back to back (which goes first alternates call by call), each side timed alone; blocks are
    (stock block, umalloc block) pairs. :attr:`calls` holds every call's seconds per op and side, in call order.
    Raises ``SystemExit`` where the two pools' prefix hits differ."""

    def __init__(self, stock: Any, umalloc: Any) -> None:
        self.pools = (stock, umalloc)
        self.null_block = (stock.null_block, umalloc.null_block)
        self.calls: dict[str, tuple[list[float], list[float]]] = {o: ([], []) for o in OPS}
        self.flip = 0

    def _call(self, op: str, f: Callable[..., Any], *args: tuple[Any, ...]) -> list[Any]:
        clock = time.perf_counter
        self.flip ^= 1
        out: list[Any] = [None, None]
        for side in ((0, 1) if self.flip else (1, 0)):
            a = clock()
            out[side] = f(self.pools[side], *args[side])
            self.calls[op][side].append(clock() - a)
        return out

    def get_cached_block(self, block_hash: Any, group_ids: list[int]) -> list[Any] | None:
        got = self._call("lookup", lambda p, h, g: p.get_cached_block(h, g), (block_hash, group_ids),
                         (block_hash, group_ids))
        if (got[0] is None) != (got[1] is None):
            raise SystemExit("lockstep: prefix hits differ between the pools")
        return None if got[0] is None else list(zip(got[0], got[1], strict=True))

    def touch(self, blocks: list[Any]) -> None:
        self._call("touch", lambda p, x: p.touch(x), ([b[0] for b in blocks],), ([b[1] for b in blocks],))

    def get_new_blocks(self, n: int) -> list[Any]:
        got = self._call("get_new_blocks", lambda p, k: p.get_new_blocks(k), (n,), (n,))
        return list(zip(got[0], got[1], strict=True))

    def cache_full_blocks(self, request: Any, blocks: list[Any], *rest: Any) -> None:
        self._call("cache_full_blocks", lambda p, x: p.cache_full_blocks(request, x, *rest),
                   ([b[0] for b in blocks],), ([b[1] for b in blocks],))

    def free_blocks(self, blocks: Any) -> None:
        pairs = list(blocks)
        # run_mix passes reversed(list) (an iterator) or [block]: each pool gets the same shape
        self._call("free_blocks", lambda p, x: p.free_blocks(x if len(x) == 1 else reversed(x[::-1])),
                   ([b[0] for b in pairs],), ([b[1] for b in pairs],))


def lockstep_mix(mix: Mix, requests: list[tuple[int, list[bytes]]], rounds: int) -> dict[str, tuple[float, float]]:
    """``mix`` through :class:`Lockstep` ``rounds`` times (fresh pools each): per op, (stock s, umalloc s), each the
    sum over calls of the call's fastest round. umalloc's pool passes ``check_invariants`` after every round."""
    import gc

    from vllm.v1.core.block_pool import BlockPool

    from umalloc.integrations.vllm import UmallocBlockPool

    runs = []
    for _ in range(rounds):
        pair = Lockstep(BlockPool(mix.num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE),
                        UmallocBlockPool(mix.num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE))
        gc.collect()
        gc.disable()
        try:
            run_mix(pair, mix, requests)
        finally:
            gc.enable()
        pair.pools[1].check_invariants()
        runs.append(pair.calls)
    return {o: (sum(map(min, zip(*(r[o][0] for r in runs), strict=True))),
                sum(map(min, zip(*(r[o][1] for r in runs), strict=True)))) for o in OPS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="stock/umalloc alternations per mix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every engine mix's request count")
    ap.add_argument("--only", default=None, help="run only the mixes whose name contains this text")
    ap.add_argument("--json", default=None, help="write the rows to this JSON file")
    ap.add_argument("--threads", type=int, default=fair.DEFAULT_THREADS,
                    help="CPU threads for torch and numba, both pools alike (set once, printed)")
    ap.add_argument("--lockstep", action="store_true",
                    help="engine mixes only, each call on both pools back to back (module docstring)")
    a = ap.parse_args()
    print(fair.set_threads(a.threads))
    print(f"# {fair.load()} (at the start)")

    from vllm.v1.core.block_pool import BlockPool

    from umalloc.integrations.vllm import UmallocBlockPool
    from umalloc.integrations.vllm.pool import VLLM_VERSION

    print(f"vLLM {VLLM_VERSION}, seed {a.seed}, {a.rounds} rounds "
          + ("(fresh pools each, every call on both back to back)" if a.lockstep
             else "(stock then umalloc in each, fresh pools)"))
    pools: dict[str, Callable[..., Any]] = {"stock": BlockPool, "umalloc": UmallocBlockPool}
    rows: list[dict[str, Any]] = []
    if a.lockstep:
        print("lockstep: per op, stock s / umalloc s of each call's fastest round, summed (> 1: umalloc faster); "
              "pool ops = touch + get_new_blocks + free_blocks")
        cols = ("touch", "get_new_blocks", "free_blocks", "lookup", "cache_full_blocks")
        print("| mix | " + " | ".join(cols) + " | pool ops |")
        print("|---" * (len(cols) + 2) + "|")
        for mix in mixes(a.scale):
            if a.only and a.only not in mix.name:
                continue
            secs = lockstep_mix(mix, mix_requests(mix, a.seed), a.rounds)
            ops = ("touch", "get_new_blocks", "free_blocks")
            pool_ops = sum(secs[o][0] for o in ops) / sum(secs[o][1] for o in ops)
            print(f"| {mix.name} | " + " | ".join(f"{secs[c][0] / secs[c][1]:.2f}x" for c in cols)
                  + f" | {pool_ops:.2f}x |   # {fair.load()}", flush=True)
            rows.append({"mix": mix.name, "seconds": {o: list(secs[o]) for o in OPS}})
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"seed": a.seed, "rounds": a.rounds, "vllm": VLLM_VERSION, "lockstep": rows}, f, indent=1)
        return

    def record(mix: str, op: str, times: dict[str, list[float]]) -> None:
        per_round = [x / y if y else 1.0 for x, y in zip(times["stock"], times["umalloc"], strict=True)]
        rows.append({"mix": mix, "op": op, "stock_s": statistics.median(times["stock"]),
                     "umalloc_s": statistics.median(times["umalloc"]), "speed_rounds": per_round,
                     "speed_median": statistics.median(per_round)})

    # ---- the engine mixes (one pool per round and per kind; the same requests)
    for mix in mixes(a.scale):
        if a.only and a.only not in mix.name:
            continue
        requests = mix_requests(mix, a.seed)
        times: dict[str, dict[str, list[float]]] = {o: {"stock": [], "umalloc": []} for o in ("total", *OPS)}
        outcomes: dict[str, list[Any]] = {}
        for _ in range(a.rounds):
            for name, cls in pools.items():
                pool = cls(mix.num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE)
                total, per_op, outcome = run_mix(pool, mix, requests)
                times["total"][name].append(total)
                for o in OPS:
                    times[o][name].append(per_op[o])
                if name == "umalloc":
                    pool.check_invariants()
                if outcomes.setdefault(name, outcome) != outcome:
                    raise SystemExit(f"{mix.name}: {name}: prefix hits differ between rounds")
        if outcomes["stock"] != outcomes["umalloc"]:
            i = next(i for i, (x, y) in enumerate(zip(outcomes["stock"], outcomes["umalloc"], strict=True)) if x != y)
            raise SystemExit(f"{mix.name}: prefix hits differ at request {i}: stock {outcomes['stock'][i]}, "
                             f"umalloc {outcomes['umalloc'][i]}")
        hits = sum(h for h, _ in outcomes["stock"])
        print(f"{mix.name}: {mix.num_blocks} blocks, groups {'+'.join(mix.groups)}"
              f"{f', window {mix.window} blocks' if mix.window else ''}, {len(requests)} requests ({mix.live} at "
              f"once), {hits} prefix-hit blocks per group (equal in both pools)   # {fair.load()}")
        for o in ("total", *OPS):
            record(mix.name, o, times[o])

    # ---- get_new_blocks(k) + free_blocks on a 100k-block pool
    if not a.only or "k=" in a.only:
        for k, steps in ((1, 40_000), (10, 20_000), (100, 4_000), (1000, 600)):
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
            record(f"get_new_blocks({k}) + free_blocks, 100k", "total", kt)

    print("\nspeed stock s / umalloc s (> 1: umalloc faster), the median of the rounds' ratios, per op and mix:")
    by_mix: dict[str, dict[str, float]] = {}
    for r in rows:
        by_mix.setdefault(r["mix"], {})[r["op"]] = r["speed_median"]
    cols = ("total", *OPS)
    print("| mix | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for m, ops in by_mix.items():
        print(f"| {m} | " + " | ".join(f"{ops[c]:.2f}x" if c in ops else "" for c in cols) + " |")
    print("\neach round's speed ratio, then the median (stock s, umalloc s: medians of the rounds):")
    for r in rows:
        print(fair.round_ratios(f"{r['mix'][:22]} {r['op'][:17]}", r["speed_rounds"])
              + f"   ({r['stock_s']:.4f} s / {r['umalloc_s']:.4f} s)")
    print(f"# {fair.load()} (at the end)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"seed": a.seed, "rounds": a.rounds, "vllm": VLLM_VERSION, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
