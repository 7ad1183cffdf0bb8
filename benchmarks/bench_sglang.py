"""SGLang's KV allocators vs umalloc's drop-ins (umalloc.integrations.sglang), same op sequence, same run.

    .peer/sglang-venv/bin/python benchmarks/bench_sglang.py [--n 1000] [--repeats 5] [--classes token,paged,swa]

(run it with PYTHONPATH=.peer/path after scripts/peer_suite_sglang.sh has built the venv.)

Workload (a pure function of the options and the conversation trace in umalloc_replay/data; the scheduler model of the
peer allocator benchmark, written here): the first ``--n`` trace rows, input and output lengths divided by
``--scale`` (ceil, at least 1). FCFS admission while a request's whole lifetime, ``ceil((in + out) / page_size)``
pages, fits next to the admitted ones in ``--pool-pages`` (so no allocation can fail, on either side). Each step:
one extend batch of chunked prefill (at most ``--max-prefill-tokens``; a prompt that does not fit continues next
step and extends its own tail page), one decode batch (one token for up to ``--max-decode-batch`` requests that
finished prefill earlier, round-robin), then the finished requests are freed inside ``free_group_begin/end``.

Each class is driven as SGLang's scheduler drives it: a ``req_to_token`` table, ``last_loc`` gathered from it,
batched ``alloc_extend``/``alloc_decode`` (the token class: ``alloc(n)``, SGLang's page-size-1 path). The SWA
class also releases pages that left the window (``free_swa_segment``) after every step and frees a finished
request's evicted head with ``free_full_segment``; so do the unified classes (one ``UnifiedKVPool`` of the peer
benchmark's geometry: full grows up, SWA down, room for ``--pool-pages`` pages a side), whose lazy variant calls
``flush_opportunistic`` after the frees and evictions of a step, as the peer benchmark's adapter does. Timing: a fresh allocator per repeat, the whole replay under
``time.perf_counter`` (op tensors prepared before, untimed), median of ``--repeats`` (the two sides alternate, and each
round's ratio is printed with their median and the machine load); torch and numba use ``--threads`` threads on both
sides (default 1, set once and printed). The
harness work (table gathers and scatters) is the same on both sides and inside the timing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _fair as fair  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "umalloc_replay" / "data" / "conversation_trace.jsonl"


@dataclass
class Workload:
    """Ops: ``("E", [(rid, prefix_len, extend_len), ...])``, ``("D", [rid, ...])``, ``("F", [rid, ...])``."""

    ops: list[tuple[str, list[Any]]]
    lengths: list[int]  # lifetime tokens per request
    request_ops: int
    peak_pages: int


def build_workload(n: int, scale: int, page_size: int, pool_pages: int, max_prefill: int,
                   max_decode: int) -> Workload:
    rows = []
    with open(TRACE) as f:
        for line in f:
            if len(rows) == n:
                break
            r = json.loads(line)
            rows.append((max(1, math.ceil(r["input_length"] / scale)), max(1, math.ceil(r["output_length"] / scale))))
    pending = deque(range(len(rows)))
    prefilling: deque[int] = deque()
    decoding: deque[int] = deque()
    done_prefill: dict[int, int] = {}
    out_left: dict[int, int] = {}
    held_pages = live_pages = peak = 0
    ops: list[tuple[str, list[Any]]] = []
    req_ops = 0
    while pending or prefilling or decoding:
        while pending:
            rid = pending[0]
            need = math.ceil(sum(rows[rid]) / page_size)
            if held_pages + need > pool_pages:
                break
            pending.popleft()
            held_pages += need
            prefilling.append(rid)
            done_prefill[rid] = 0
            out_left[rid] = rows[rid][1]
        batch, budget, ready = [], max_prefill, []
        while prefilling and budget > 0:
            rid = prefilling[0]
            take = min(rows[rid][0] - done_prefill[rid], budget)
            batch.append((rid, done_prefill[rid], take))
            done_prefill[rid] += take
            budget -= take
            if done_prefill[rid] == rows[rid][0]:
                prefilling.popleft()
                ready.append(rid)
            else:
                break
        if batch:
            ops.append(("E", batch))
            req_ops += len(batch)
        dec = [decoding.popleft() for _ in range(min(max_decode, len(decoding)))]
        finished = []
        if dec:
            ops.append(("D", dec))
            req_ops += len(dec)
            for rid in dec:
                out_left[rid] -= 1
                (finished if out_left[rid] == 0 else decoding).append(rid)
        live_pages = sum(math.ceil((done_prefill[r] + rows[r][1] - out_left[r]) / page_size)
                         for r in done_prefill if r not in finished and done_prefill[r] > 0)
        peak = max(peak, live_pages)
        if finished:
            ops.append(("F", finished))
            req_ops += len(finished)
            for rid in finished:
                held_pages -= math.ceil(sum(rows[rid]) / page_size)
                del done_prefill[rid]
        decoding.extend(ready)
    return Workload(ops, [a + b for a, b in rows], req_ops, peak)


class Replay:
    """One class's replay of a workload: SGLang's scheduler call shapes over a ``req_to_token`` table."""

    def __init__(self, w: Workload, make: Callable[[], Any], kind: str, page_size: int, window: int) -> None:
        self.w, self.make, self.kind, self.ps, self.window = w, make, kind, page_size, window
        self.rows = torch.zeros((len(w.lengths), max(w.lengths) + 1), dtype=torch.int64)
        self.prepared = [self._prepare(op, args) for op, args in w.ops]

    def _prepare(self, op: str, args: list[Any]) -> tuple[Any, ...]:
        if op == "E":
            rids = torch.tensor([r for r, _, _ in args])
            prefix = torch.tensor([p for _, p, _ in args])
            seq = prefix + torch.tensor([k for _, _, k in args])
            ridx = torch.cat([torch.full((k,), r) for r, _, k in args])
            pos = torch.cat([torch.arange(p, p + k) for _, p, k in args])
            has = prefix > 0
            return op, rids, prefix, seq, ridx, pos, has, int((seq - prefix).sum()), args
        if op == "D":
            return op, torch.tensor(args), args
        return op, args

    def run(self) -> float:
        alloc = self.make()
        lens = [0] * len(self.w.lengths)
        evicted = [0] * len(self.w.lengths)
        rows, ps = self.rows, self.ps
        swa, lazy = self.kind != "paged" and self.kind != "token", self.kind == "unified-lazy"
        empty = alloc.available_size()
        t0 = time.perf_counter()
        for p in self.prepared:
            if p[0] == "E":
                _, rids, prefix, seq, ridx, pos, has, total, args = p
                if self.kind == "token":
                    out = alloc.alloc(total)
                else:
                    last = torch.where(has, rows[rids, (prefix - 1).clamp(min=0)], -1)
                    out = alloc.alloc_extend(prefix, prefix, seq, seq, last, total)
                assert out is not None
                rows[ridx, pos] = out
                for r, _, k in args:
                    lens[r] += k
                touched = [r for r, _, _ in args]
            elif p[0] == "D":
                _, rids, args = p
                cur = torch.tensor([lens[r] for r in args])
                if self.kind == "token":
                    out = alloc.alloc(len(args))
                else:
                    out = alloc.alloc_decode(cur + 1, cur + 1, rows[rids, cur - 1])
                assert out is not None
                rows[rids, cur] = out
                for r in args:
                    lens[r] += 1
                touched = args
            else:
                alloc.free_group_begin()
                for r in p[1]:
                    row, done = rows[r, : lens[r]], evicted[r]
                    if done:
                        alloc.free_full_segment(row[:done], start_pos=0)
                    alloc.free(row[done:])
                    lens[r] = evicted[r] = 0
                alloc.free_group_end()
                touched = []
                if lazy:
                    alloc.flush_opportunistic()
            if swa:
                for r in touched:
                    tail = max(0, lens[r] - self.window) // ps * ps
                    if tail > evicted[r]:
                        alloc.free_swa_segment(rows[r, evicted[r]:tail], start_pos=evicted[r])
                        evicted[r] = tail
                if lazy and touched:
                    alloc.flush_opportunistic()
        dt = time.perf_counter() - t0
        if lazy:
            alloc.flush_opportunistic()
        assert alloc.available_size() == empty, "not everything returned"
        return dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--scale", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-pages", type=int, default=4096)
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--max-decode-batch", type=int, default=256)
    ap.add_argument("--swa-window", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--classes", default="token,paged,swa,unified-eager,unified-lazy")
    ap.add_argument("--threads", type=int, default=fair.DEFAULT_THREADS,
                    help="CPU threads for torch and numba, both sides alike (set once, printed; 1: a shared machine "
                         "oversubscribed by OpenMP spin-waits distorts torch timings)")
    ap.add_argument("--json", default=None, help="append one JSON line per result here")
    a = ap.parse_args(argv)
    print(fair.set_threads(a.threads))
    sys.path.insert(0, str(ROOT / "tests" / "peer"))
    import sglang_cpu_shims

    sglang_cpu_shims.prepare()
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    import umalloc.integrations.sglang as ums

    sys.path.insert(0, str(ROOT / "tests" / "integrations"))
    from sglang_differential import fake_swa_kv
    from sglang_unified_differential import prepare_unified_context

    prepare_unified_context()  # SGLang's runtime context and the CPU twins of its unified extend/decode kernels
    from sglang.srt.mem_cache.allocator.unified_hybrid_swa import UnifiedSWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.unified_memory_pool import MHASubPoolSpec, UnifiedKVPool
    from sglang.test.unified_allocator_fixtures import FakeUnifiedSWAKVPool

    # the peer benchmark's unified geometry: full grows up, SWA down, 1 layer x 1 head x 16 dims fp16, room for
    # pool_pages full + pool_pages SWA pages (+ 2: the sink floor and slack)
    specs = [MHASubPoolSpec(name=n, layer_num=1, head_num=1, head_dim=16, store_dtype=torch.float16,
                            grow_direction=g) for n, g in (("full", "up"), ("swa", "down"))]
    unified_pool = UnifiedKVPool(total_bytes=(2 * a.pool_pages + 2) * specs[0].entry_bytes() * a.page_size,
                                 sub_pool_specs=specs, device="cpu", enable_memory_saver=False,
                                 page_size=a.page_size)

    def unified(cls: Any, lazy: bool) -> Callable[[], Any]:
        return lambda: cls(unified_buffer=unified_pool, kvcache=FakeUnifiedSWAKVPool(unified_pool), device="cpu",
                           page_size=a.page_size, lazy_compaction=lazy)

    w = build_workload(a.n, a.scale, a.page_size, a.pool_pages, a.max_prefill_tokens, a.max_decode_batch)
    ps, size = a.page_size, a.pool_pages * a.page_size
    print(f"workload: {a.n} requests, {len(w.ops)} batched ops, {w.request_ops} request-ops, "
          f"peak {w.peak_pages} of {a.pool_pages} pages (page_size {ps}); repeats {a.repeats}")
    bf = torch.bfloat16
    pairs: dict[str, tuple[Callable[[], Any], Callable[[], Any], int]] = {
        "token": (lambda: TokenToKVPoolAllocator(size, bf, "cpu", None, False),
                  lambda: ums.UmallocTokenToKVPoolAllocator(size, bf, "cpu", None, False), 1),
        "paged": (lambda: PagedTokenToKVPoolAllocator(size, ps, bf, "cpu", None, False),
                  lambda: ums.UmallocPagedTokenToKVPoolAllocator(size, ps, bf, "cpu", None, False), ps),
        "swa": (lambda: SWATokenToKVPoolAllocator(size, size, ps, bf, "cpu", fake_swa_kv(), False),
                lambda: ums.UmallocSWATokenToKVPoolAllocator(size, size, ps, bf, "cpu", fake_swa_kv(), False), ps),
        "unified-eager": (unified(UnifiedSWATokenToKVPoolAllocator, False),
                          unified(ums.UmallocUnifiedSWATokenToKVPoolAllocator, False), ps),
        "unified-lazy": (unified(UnifiedSWATokenToKVPoolAllocator, True),
                         unified(ums.UmallocUnifiedSWATokenToKVPoolAllocator, True), ps),
    }
    round_lines: list[str] = []
    print("| class | SGLang s | umalloc s | SGLang request-ops/s | umalloc request-ops/s | umalloc / SGLang |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for kind in a.classes.split(","):
        make_sg, make_um, kps = pairs[kind]
        reps = {"sglang": Replay(w, make_sg, kind, kps, a.swa_window),
                "umalloc": Replay(w, make_um, kind, kps, a.swa_window)}
        samples: dict[str, list[float]] = {side: [] for side in reps}
        for rep in reps.values():
            rep.run()  # warm-up (numba kernels, torch dispatch), untimed
        loads = [fair.load()]
        for _ in range(a.repeats):  # the two sides alternate, so a shift in machine load hits both
            for side, rep in reps.items():
                samples[side].append(rep.run())
        loads.append(fair.load())
        times = {side: statistics.median(v) for side, v in samples.items()}
        ratio = times["sglang"] / times["umalloc"]
        per_round = [s_ / u for s_, u in zip(samples["sglang"], samples["umalloc"], strict=True)]
        round_lines.append(fair.round_ratios(kind, per_round) + f"   ({loads[0]} -> {loads[1]})")
        print(f"| {kind} | {times['sglang']:.3f} | {times['umalloc']:.3f} | {w.request_ops / times['sglang']:,.0f} | "
              f"{w.request_ops / times['umalloc']:,.0f} | {ratio:.2f}x |")
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps({"class": kind, "sglang_s": times["sglang"], "umalloc_s": times["umalloc"],
                                    "request_ops": w.request_ops, "ratio": ratio, "repeats": a.repeats,
                                    "page_size": kps, "n": a.n, "threads": a.threads,
                                    "rounds": per_round}) + "\n")
    print("\nSGLang s / umalloc s per round (each round runs both sides back to back), then the median:")
    print("\n".join(round_lines))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
