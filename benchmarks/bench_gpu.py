"""GPU benchmark: the card's copy ceiling, then translation, compaction moves and decode-step graph replay.

* Ceiling: one large device-to-device copy (bytes read + written per second) -- every other figure is a ratio
  to it, measured in the same run.
* Translate 1M / 16M tokens (page_size 16, a v2p table that is a random permutation): ``torch`` indexing
  (``v2p[t // ps] * ps + t % ps``), the capturable torch formulation and the one-kernel cupy path of
  :mod:`umalloc.translators.capture`, each eager and graph-replayed; and, to measure the cupy-or-Triton choice,
  a Triton kernel of the same Note [Capturable arithmetic] written here (benchmark only; checked for
  correctness in the table's ``ok`` column). Bytes counted: ids read + ids written
  (16 B per token; the table is small and cached). Targets: cupy graph-replayed >= 0.8x the ceiling at 16M.
* Compaction: :meth:`Arena.copy_pages` (the batched envelope move compaction issues) over random page pairs of
  a 2-end arena; bytes read + written. Target >= 0.7x the ceiling.
* Decode step: one captured translate of ``batch`` token ids (one per request), graph replay time in us for
  batch 1 / 64 / 256. Target <= 10 us at 256.
* Timing: CUDA events around many graph replays / calls after warm-up, median of repeats; on CPU
  (``--device cpu --tiny``, a smoke run of the same code paths, figures meaningless) perf_counter.
* SGLang's translate is not measured (its wheel is not carried); the table says so.

Run: ``python benchmarks/bench_gpu.py [--device cuda] [--tiny] [--out DIR] [--seed N]``; prints a table last and
writes ``DIR/bench_gpu.json`` when ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndSpec, Grow, LayerSpec
from umalloc.translators import capture as cap

PAGE_SIZE = 16

try:  # the Triton variant of the benchmark (the image has Triton; a CPU machine need not)
    import triton
    import triton.language as tl

    @triton.jit
    def _triton_v2p(ids_ptr, tab_ptr, out_ptr, flag_ptr, n, limit, ps, pmax, strict, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        t = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int64)
        inb = (t >= 0) & (t < limit)
        tc = tl.where(inb, t, 0)
        q = tc // ps
        r = tc - q * ps
        p = tl.load(tab_ptr + q, mask=m & inb, other=-1)
        tomb = p < 0
        over = p > pmax
        res = tl.where(tomb | over, 0, p) * ps + r
        tl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty), mask=m)
        bits = (tl.max(tl.where(m & ~inb, 1, 0), 0) + tl.max(tl.where(m & inb & tomb & (strict != 0), 2, 0), 0)
                + tl.max(tl.where(m & over, 4, 0), 0))
        if bits != 0:
            tl.atomic_or(flag_ptr, bits)

    def triton_translate(vt: torch.Tensor, v2p: torch.Tensor, ps: int, out: torch.Tensor, flag: cap.ErrorFlag,
                         strict: bool) -> None:
        n = vt.numel()
        block = 1024
        pmax = ((1 << 63) - 1 - (ps - 1)) // ps
        _triton_v2p[(triton.cdiv(n, block),)](vt, v2p, out, flag.word, n, v2p.numel() * ps, ps, pmax, int(strict),
                                              BLOCK=block)
except ImportError:
    triton_translate = None
TARGETS = {"translate_16M": 0.8, "compaction": 0.7, "decode_256_us": 10.0}


class Timer:
    """Median seconds per call of ``fn`` on ``device`` (events on CUDA, perf_counter on CPU)."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device = device
        self.repeats = repeats

    def __call__(self, fn: Callable[[], object], calls: int) -> float:
        fn()  # warm-up
        samples = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    fn()
                stop.record()
                stop.synchronize()
                samples.append(start.elapsed_time(stop) / 1e3 / calls)
            else:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples.append((time.perf_counter() - t0) / calls)
        return statistics.median(samples)


def graphed(fn: Callable[[], object], device: torch.device) -> Callable[[], object] | None:
    """``fn`` captured in a CUDA graph (its replay), or None off CUDA."""
    if device.type != "cuda":
        return None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def copy_ceiling(timer: Timer, device: torch.device, nbytes: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src), 5)
    return 2 * nbytes / t / 1e9


def translate_rows(timer: Timer, device: torch.device, n: int, ceiling: float, rng: np.random.Generator,
                   cupy_ok: bool) -> list[dict]:
    nv = max(2, n // PAGE_SIZE)
    v2p = torch.from_numpy(rng.permutation(nv).astype(np.int64)).to(device)
    vt = torch.from_numpy(rng.integers(0, nv * PAGE_SIZE, n)).to(device)
    out = torch.empty_like(vt)
    flag = cap.ErrorFlag(device)
    want = v2p[vt // PAGE_SIZE] * PAGE_SIZE + vt % PAGE_SIZE
    variants: dict[str, Callable[[], object]] = {
        "torch indexing": lambda: out.copy_(v2p[vt // PAGE_SIZE] * PAGE_SIZE + vt % PAGE_SIZE),
        "capture torch": lambda: cap.virtual_to_physical(vt, v2p, PAGE_SIZE, out=out, flag=flag, strict=False,
                                                         impl="torch"),
    }
    if cupy_ok:
        variants["capture cupy"] = lambda: cap.virtual_to_physical(vt, v2p, PAGE_SIZE, out=out, flag=flag,
                                                                   strict=False, impl="cupy")
    if triton_translate is not None and device.type == "cuda":
        variants["triton (bench only)"] = lambda: triton_translate(vt, v2p, PAGE_SIZE, out, flag, False)
    rows = []
    calls = 3 if n >= 1 << 22 else 20
    for name, fn in variants.items():
        for mode, f in (("eager", fn), ("graph", graphed(fn, device))):
            if f is None:
                continue
            out.fill_(-1)
            try:
                t = timer(f, calls)
            except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
                rows.append({"what": f"{name} {mode}: FAILED {type(exc).__name__}: {str(exc)[:60]}",
                             "time_us": None, "GB/s": None, "x_ceiling": None, "correct": False})
                continue
            ok = bool(torch.equal(out, want)) and flag.value() == 0
            gbs = 16 * n / t / 1e9
            rows.append({"what": f"translate {n >> 20 or n}{'M' if n >= 1 << 20 else ''} {name} {mode}",
                         "time_us": t * 1e6, "GB/s": gbs, "x_ceiling": gbs / ceiling, "correct": ok})
    return rows


def compaction_row(timer: Timer, device: torch.device, num_pages: int, ceiling: float,
                   rng: np.random.Generator) -> dict:
    full = EndSpec("full", (LayerSpec.mha(8, 128),) * 4, page_size=PAGE_SIZE)  # 4 layers x 8 heads x 128, fp16
    swa = EndSpec("swa", (LayerSpec.mha(8, 128),), page_size=PAGE_SIZE, grow=Grow.DOWN)
    page_bytes = full.page_bytes
    arena = Arena(ArenaSpec((full, swa), arena_bytes=(2 * num_pages + 4) * page_bytes), device=device, zero=False)
    lo, hi = arena.first_page("full"), arena.top_page("full")
    pages = rng.permutation(np.arange(lo, hi + 1))
    k = min(num_pages, (hi - lo + 1) // 2)
    src = torch.from_numpy(pages[:k].copy()).to(device)
    dst = torch.from_numpy(pages[k:2 * k].copy()).to(device)
    arena.data.random_(0, 256)
    env = arena.envelopes("full")
    before = env[src].clone()
    t = timer(lambda: arena.copy_pages("full", dst, src), 3)
    ok = bool(torch.equal(env[dst], before))
    gbs = 2 * k * page_bytes / t / 1e9
    return {"what": f"compaction copy_pages {k} x {page_bytes} B", "time_us": t * 1e6, "GB/s": gbs,
            "x_ceiling": gbs / ceiling, "correct": ok}


def decode_rows(timer: Timer, device: torch.device, batches: list[int], rng: np.random.Generator,
                cupy_ok: bool) -> list[dict]:
    nv = 1 << 16
    v2p = torch.from_numpy(rng.permutation(nv).astype(np.int64)).to(device)
    rows = []
    for b in batches:
        vt = torch.from_numpy(rng.integers(0, nv * PAGE_SIZE, b)).to(device)
        out = torch.empty_like(vt)
        flag = cap.ErrorFlag(device)
        want = v2p[vt // PAGE_SIZE] * PAGE_SIZE + vt % PAGE_SIZE
        impls = ["cupy", "torch"] if cupy_ok else ["torch"]
        for impl in impls:
            def fn(impl=impl, vt=vt, out=out, flag=flag):
                return cap.virtual_to_physical(vt, v2p, PAGE_SIZE, out=out, flag=flag, strict=False, impl=impl)
            f = graphed(fn, device) or fn
            mode = "graph replay" if f is not fn else "eager (no graph on cpu)"
            t = timer(f, 200)
            ok = bool(torch.equal(out, want)) and flag.value() == 0
            rows.append({"what": f"decode batch {b} {impl} {mode}", "time_us": t * 1e6, "GB/s": None,
                         "x_ceiling": None, "correct": ok})
    return rows


def environment(device: torch.device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
           "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    if device.type == "cuda":
        env["card"] = torch.cuda.get_device_name(device)
        env["cuda_runtime"] = torch.version.cuda
        try:
            import cupy
            env["cupy"] = cupy.__version__
            env["driver"] = cupy.cuda.runtime.driverGetVersion()
        except ImportError:
            env["cupy"] = None
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small sizes (a smoke run; CPU figures are meaningless)")
    ap.add_argument("--out", type=Path, default=None, help="folder for bench_gpu.json")
    ap.add_argument("--seed", type=int, default=16)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    print(f"seed={args.seed} (override with --seed)")
    rng = np.random.default_rng(args.seed)
    timer = Timer(device, 3 if args.tiny else 7)
    cupy_ok = device.type == "cuda" and cap.cupy_unavailable_reason() is None
    env = environment(device)
    print(json.dumps(env))
    ceiling = copy_ceiling(timer, device, (8 << 20) if args.tiny else (2 << 30))
    rows: list[dict] = [{"what": "copy ceiling (d2d, read+write)", "time_us": None, "GB/s": ceiling,
                         "x_ceiling": 1.0, "correct": True}]
    for n in ([1 << 16] if args.tiny else [1 << 20, 1 << 24]):
        rows += translate_rows(timer, device, n, ceiling, rng, cupy_ok)
    rows.append(compaction_row(timer, device, 64 if args.tiny else 4096, ceiling, rng))
    rows += decode_rows(timer, device, [1, 64, 256], rng, cupy_ok)
    rows.append({"what": "sglang translate: not measured (wheel not carried)", "time_us": None, "GB/s": None,
                 "x_ceiling": None, "correct": None})
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_gpu.json").write_text(json.dumps({"env": env, "targets": TARGETS, "rows": rows},
                                                            indent=1))
    print(f"\n{'what':<52} {'us':>10} {'GB/s':>9} {'x ceil':>7} ok")
    for r in rows:
        def fmt(v, spec):
            return format(v, spec) if v is not None else "-"
        print(f"{r['what']:<52} {fmt(r['time_us'], '10.2f'):>10} {fmt(r['GB/s'], '9.1f'):>9} "
              f"{fmt(r['x_ceiling'], '7.2f'):>7} {r['correct']}")
    return 0 if all(r["correct"] is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
