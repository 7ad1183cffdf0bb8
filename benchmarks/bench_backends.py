"""Transfer backends side by side: GB/s of WRITEs between two processes, as a ratio to in-process memcpy.

What it measures (not a test; nothing is asserted, the targets are printed as PASS/MISS):

* ``--total-mib`` (default 256) of host memory moved as pages of 4 KiB, 64 KiB and 1 MiB, in three page layouts:
  ``contiguous`` (page i -> page i), ``replay`` (mostly contiguous: runs of geometric length, mean
  ``--mean-run-pages``, placed in shuffled order, as an allocator with holes hands them out) and ``scattered``
  (a random permutation).
* Each layout posted two ways: ``per-page`` (one descriptor per page) and ``coalesced`` (one descriptor per run
  contiguous on both sides; a random permutation has almost none).
* ``nixl`` and ``mooncake``: the sender is this process, the receiver a second process
  (:class:`umalloc.backends.worker.BackendWorker`); NIXL per-page batches are posted both one-shot and as prepared
  lists. ``local`` copies between two buffers of this process (it has no second process by definition).
* Baseline: an in-process ``memcpy`` (``ctypes.memmove``) of the same number of bytes between two warm buffers,
  measured in the same run (best of ``--repeat + 2``); ``x memcpy`` = backend GB/s / memcpy GB/s. Every timed transfer is the best of ``--repeat`` after one
  warm-up; after each row a sample of destination pages is checked against the source.

* ``plan overhead`` (``--plan-repeats``, local backend, in-process): the backend's own cost per plan, for a
  2048-token request over a small KV spec (a few KiB of bytes, fragmented: one descriptor per hole page plus
  the contiguous rest): ``submit`` + ``wait`` + ``forget`` of a fresh plan (building it is not timed), against
  the same descriptors posted raw (``write_descriptors`` + ``wait`` + ``forget``) in the same run; median us.

* ``hetero`` (``--hetero``, on by default): one request of ``--hetero-tokens`` (default 1024) of Llama-3.1-8B (32
  layers, 8 KV heads of 128, bf16, page size 16) from a prefill rank to decode rank 0, between ranks of different
  TP: TP1 -> 1 (the page envelope), TP1 -> 2 page-major (one run per token, layer and K/V: strided), TP1 -> 2
  head-group-outer (the prefill page in 2 head groups: one run per page), the per-token head-slice baseline
  (the page-major plan's runs unmerged, one per token, layer and K/V: what SGLang's ``send_kvcache_slice``
  posts) and page size 16 -> 32. The plans are built in this process between two allocators, their destination
  addresses moved onto the receiver's buffer, and posted raw; bounded batches cut them (Note [Bounded batches]).
  GB/s = the plan's bytes / best time; a sample of descriptors is checked at the receiver.

Targets (issue 7): NIXL >= 0.8x memcpy for runs >= 64 KiB; Mooncake coalesced >= 10x its per-page rate on the
replay-shaped layout. A second reference, the kernel's cross-process copy (``process_vm_writev``, which UCX's CMA
transport uses between two processes on one host), shows how much of memcpy any two-process engine can reach.

Run: ``python benchmarks/bench_backends.py [--total-mib 256] [--backends local,nixl,mooncake] [--json out.json]
[--no-hetero | --hetero-only]``
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import time

import numpy as np
import torch

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.backends import backend_available, get_backend
from umalloc.backends.worker import BackendWorker
from umalloc.geometry.arena import Arena
from umalloc.geometry.presets import preset_ends
from umalloc.geometry.region import Region
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, LayerSpec, arena_bytes_for_limits
from umalloc.transfer import PeerLayout, build_plan
from umalloc.transfer.slices import pair_pieces, slice_descriptors

PAGE_SIZES = {"4KiB": 4 << 10, "64KiB": 64 << 10, "1MiB": 1 << 20}
LAYOUTS = ("contiguous", "replay", "scattered")


def page_map(layout: str, num_pages: int, mean_run_pages: int, rng: np.random.Generator) -> np.ndarray:
    """Destination page of each source page."""
    if layout == "contiguous":
        return np.arange(num_pages)
    if layout == "scattered":
        return rng.permutation(num_pages)
    lens = []
    left = num_pages
    while left:
        n = min(left, int(rng.geometric(1.0 / mean_run_pages)))
        lens.append(n)
        left -= n
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    order = rng.permutation(len(lens))  # runs keep their source order but land shuffled
    dst_starts = np.empty(len(lens), dtype=np.int64)
    dst_starts[order] = np.concatenate([[0], np.cumsum(np.asarray(lens)[order])[:-1]])
    out = np.empty(num_pages, dtype=np.int64)
    for s, d, n in zip(starts, dst_starts, lens, strict=True):
        out[s:s + n] = np.arange(d, d + n)
    return out


def descriptors(src_base: int, dst_base: int, dst_pages: np.ndarray, page_bytes: int, coalesce: bool) -> np.ndarray:
    """``(N, 3)`` uint64 descriptors; with ``coalesce`` one per run contiguous on both sides (vectorised)."""
    k = dst_pages.size
    src_pages = np.arange(k)
    if coalesce:
        brk = np.flatnonzero(np.diff(dst_pages) != 1) + 1
        starts = np.concatenate([[0], brk])
        lens = np.diff(np.concatenate([starts, [k]]))
        s, d, n = src_pages[starts], dst_pages[starts], lens
    else:
        s, d, n = src_pages, dst_pages, np.ones(k, dtype=np.int64)
    out = np.empty((s.size, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(src_base) + s.astype(np.uint64) * np.uint64(page_bytes)
    out[:, 1] = np.uint64(dst_base) + d.astype(np.uint64) * np.uint64(page_bytes)
    out[:, 2] = n.astype(np.uint64) * np.uint64(page_bytes)
    return out


def memcpy_gbps(total: int, repeat: int) -> float:
    """In-process ``memcpy`` (``ctypes.memmove``, one thread) of ``total`` bytes between two warm buffers."""
    a = torch.randint(0, 256, (total,), dtype=torch.uint8)
    b = torch.empty_like(a)
    ctypes.memmove(b.data_ptr(), a.data_ptr(), total)  # warm: fault the pages in
    best = min(_timed(lambda: ctypes.memmove(b.data_ptr(), a.data_ptr(), total)) for _ in range(repeat + 2))
    return total / best / 1e9


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def cma_gbps(pid: int, remote_addr: int, src: torch.Tensor, repeat: int) -> float | None:
    """Kernel ceiling of a cross-process copy: ``process_vm_writev`` (what UCX's CMA transport uses) of ``src``
    into ``pid``'s memory at ``remote_addr``, 1 MiB per call; ``None`` where the kernel refuses (ptrace policy)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "process_vm_writev", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_ssize_t
    total, chunk = src.numel(), 1 << 20
    base = src.data_ptr()

    def once() -> bool:
        for off in range(0, total, chunk):
            n = min(chunk, total - off)
            loc, rem = _IoVec(base + off, n), _IoVec(remote_addr + off, n)
            if fn(pid, ctypes.byref(loc), 1, ctypes.byref(rem), 1, 0) != n:
                return False
        return True

    if not once():
        return None
    return total / min(_timed(once) for _ in range(repeat)) / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Sample:
    """Spot-check destination pages against the source."""

    def __init__(self, src: torch.Tensor, rng: np.random.Generator, count: int = 32) -> None:
        self.src = src
        self.rng = rng
        self.count = count

    def offsets(self, dst_pages: np.ndarray, page_bytes: int) -> tuple[list[int], list[int]]:
        pick = self.rng.choice(dst_pages.size, size=min(self.count, dst_pages.size), replace=False)
        return [int(p) * page_bytes for p in pick], [int(dst_pages[p]) * page_bytes for p in pick]

    def expected(self, src_offsets: list[int], nbytes: int) -> bytes:
        return b"".join(bytes(self.src[o:o + nbytes].numpy().tobytes()) for o in src_offsets)


def run(args: argparse.Namespace) -> list[dict]:
    total = args.total_mib << 20
    rng = np.random.default_rng(args.seed)
    print(f"seed={args.seed} total={args.total_mib} MiB repeat={args.repeat}")
    base = memcpy_gbps(total, args.repeat)
    print(f"in-process memcpy baseline: {base:.2f} GB/s")
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(args.seed))
    sample = Sample(src, rng)
    rows: list[dict] = []
    cma = None
    maps = {(ps, lay): page_map(lay, total // pb, args.mean_run_pages, rng)
            for ps, pb in PAGE_SIZES.items() for lay in LAYOUTS}

    for name in args.backends:
        ok, why = backend_available(name)
        if not ok:
            print(f"{name}: unavailable ({why})")
            continue
        w = None
        senders = {"": get_backend(name)}
        if name == "nixl":
            senders = {"oneshot": get_backend(name, mode="oneshot"), "prepped": get_backend(name, mode="prepped")}
        if name == "local":
            recv = get_backend("local")
            dst = torch.zeros(total, dtype=torch.uint8)
            recv.register([Region(dst.data_ptr(), total)])
            md, dst_base = recv.metadata(), dst.data_ptr()

            def read_many(offsets: list[int], nbytes: int, dst=dst) -> bytes:
                return b"".join(bytes(dst[o:o + nbytes].numpy().tobytes()) for o in offsets)
        else:
            w = BackendWorker(name)
            buf_id, dst_base = w.call("alloc", total, timeout_s=120)
            w.call("register", [Region(dst_base, total).to_dict()])
            md = w.call("metadata")
            if cma is None:
                cma = cma_gbps(w.pid, dst_base, src, args.repeat)
                if cma is not None:
                    print(f"cross-process copy ceiling (process_vm_writev): {cma:.2f} GB/s = {cma / base:.2f}x memcpy")

            def read_many(offsets: list[int], nbytes: int, w=w, buf_id=buf_id) -> bytes:
                return w.call("read_many", buf_id, offsets, nbytes, timeout_s=60)
        try:
            for mode, b in senders.items():
                b.register([Region(src.data_ptr(), total)])
                peer = b.connect(md)
                for ps, pb in PAGE_SIZES.items():
                    for lay in LAYOUTS:
                        dmap = maps[(ps, lay)]
                        for coalesce in (False, True):
                            if mode == "prepped" and coalesce:
                                continue  # prepared lists are per page; coalesced posts go one-shot
                            d = descriptors(src.data_ptr(), dst_base, dmap, pb, coalesce)
                            times = []
                            for _ in range(args.repeat + 1):
                                t0 = time.perf_counter()
                                h = b.write_descriptors(d, peer, item_bytes=pb)
                                b.wait(h, args.timeout_s)
                                times.append(time.perf_counter() - t0)
                                b.forget(h)
                            best = min(times[1:])
                            so, do = sample.offsets(dmap, pb)
                            nb = min(pb, 4096)
                            verified = read_many(do, nb) == sample.expected(so, nb)
                            gbps = total / best / 1e9
                            rows.append({"backend": name + (f"-{mode}" if mode else ""), "page": ps, "layout": lay,
                                         "descriptors": "coalesced" if coalesce else "per-page",
                                         "num_descriptors": int(d.shape[0]), "ms": best * 1e3, "gbps": gbps,
                                         "x_memcpy": gbps / base, "verified": verified,
                                         "two_process": name != "local"})
                            r = rows[-1]
                            print(f"{r['backend']:14s} {ps:>6s} {lay:10s} {r['descriptors']:9s} "
                                  f"{r['num_descriptors']:7d} {r['ms']:9.1f} ms {gbps:7.2f} GB/s "
                                  f"{r['x_memcpy']:5.2f}x {'ok' if verified else 'MISMATCH'}", flush=True)
                b.disconnect(peer)
                b.close()
        finally:
            if w is not None:
                w.close()
            if name == "local":
                recv.close()
    return rows, base, cma


def plan_overhead(repeats: int, seq_len_tokens: int = 2048) -> dict[str, float]:
    """Median microseconds per plan on the local backend: ``submit`` path vs the raw path of the same descriptors
    (see the module docstring). Returns ``{"submit_us", "raw_us", "descriptors"}``."""
    full = EndSpec("full", (LayerSpec.mha(1, 8),), page_size=16)
    swa = EndSpec("swa", (LayerSpec.mha(1, 4, window_tokens=512),), page_size=16, grow=Grow.DOWN, owner="full",
                  role=EndRole.SWA)
    spec = ArenaSpec((full, swa), arena_bytes=1 << 20)
    one = lambda x: torch.tensor([x], dtype=torch.int64)  # noqa: E731
    sides = []
    for _ in range(2):
        alloc = MultiEndedAllocator(Arena(spec))
        junk = [alloc.alloc_extend(one(0), one(16), one(-1)) for _ in range(64)]
        for j in junk[::2]:  # 32 one-page holes below the request
            alloc.free(j)
        b = get_backend("local", layout=PeerLayout.from_arena(alloc.arena))
        b.register(alloc.arena.regions())
        sides.append((alloc, b))
    (src, a), (dst, b) = sides
    peer = a.connect(b.metadata())
    vs, vd = src.alloc_extend(one(0), one(seq_len_tokens), one(-1)), dst.alloc_extend(one(0), one(seq_len_tokens),
                                                                                      one(-1))
    submit_s, raw_s = [], []
    n = 0
    for _ in range(repeats + 1):
        plan = build_plan("bench", src, vs, dst, vd)
        d = plan.descriptors().copy()
        n = d.shape[0]
        t0 = time.perf_counter()
        h = a.submit(plan, peer)
        a.wait(h, 10.0)
        a.forget(h)
        submit_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        h = a.write_descriptors(d, peer)
        a.wait(h, 10.0)
        a.forget(h)
        raw_s.append(time.perf_counter() - t0)
    a.close()
    b.close()
    return {"submit_us": float(np.median(submit_s[1:])) * 1e6, "raw_us": float(np.median(raw_s[1:])) * 1e6,
            "descriptors": n}


def targets(rows: list[dict], base: float, cma: float | None) -> list[str]:
    out = []
    nixl = [r for r in rows if r["backend"].startswith("nixl") and r["descriptors"] == "coalesced"
            and r["page"] in ("64KiB", "1MiB") and r["layout"] in ("contiguous", "replay")]
    if nixl:
        worst = min(r["x_memcpy"] for r in nixl)
        out.append(f"NIXL coalesced runs >= 64 KiB: worst {worst:.2f}x memcpy (target >= 0.8x): "
                   f"{'PASS' if worst >= 0.8 else 'MISS'}")
        if cma:
            best = max(r["gbps"] for r in nixl)
            out.append(f"  NIXL best {best:.2f} GB/s = {best / cma:.2f}x the cross-process copy ceiling "
                       f"({cma:.2f} GB/s = {cma / base:.2f}x memcpy)")
    mc = {(r["page"], r["descriptors"]): r["gbps"] for r in rows if r["backend"] == "mooncake"
          and r["layout"] == "replay"}
    for ps in PAGE_SIZES:
        if (ps, "per-page") in mc and (ps, "coalesced") in mc:
            ratio = mc[(ps, "coalesced")] / mc[(ps, "per-page")]
            if ps == "4KiB":  # the target: page-sized descriptors are where per-descriptor cost dominates
                out.append(f"Mooncake replay {ps} pages: coalesced / per-page = {ratio:.1f}x (target >= 10x): "
                           f"{'PASS' if ratio >= 10 else 'MISS'}")
            else:  # per-page descriptors of this size already run near the link rate
                out.append(f"  Mooncake replay {ps} pages: coalesced / per-page = {ratio:.1f}x (info)")
    return out


# ==== different TP and page sizes ==============================================================================

#: (label, prefill (TP, page size, head groups), decode (TP, page size, head groups), merged).
HETERO_CASES = [
    ("TP1->1 envelope", (1, 16, 1), (1, 16, 1), True),
    ("TP1->2 page-major", (1, 16, 1), (2, 16, 1), True),
    ("TP1->2 head-group-outer", (1, 16, 2), (2, 16, 1), True),
    ("TP1->2 per-token slice", (1, 16, 1), (2, 16, 1), False),
    ("page 16->32", (1, 16, 1), (1, 32, 1), True),
]


def _hetero_side(tp: int, page_size: int, head_groups: int, tokens: int, *, fill: bool):
    ends = tuple(dataclasses.replace(e, head_groups=head_groups)
                 for e in preset_ends("llama-3.1-8b", page_size=page_size, tp_size=tp))
    spec = ArenaSpec(ends, arena_bytes=arena_bytes_for_limits(ends, max_seq_len_tokens=tokens + 256, max_batch=1))
    arena = Arena(spec, zero=False)
    if fill:
        arena.data.copy_(torch.randint(0, 256, (spec.arena_bytes,), dtype=torch.uint8,
                                       generator=torch.Generator().manual_seed(3)))
    alloc = MultiEndedAllocator(arena)
    ext = alloc.alloc_extend
    junk = ext(torch.tensor([0]), torch.tensor([37]), torch.tensor([-1]), owner="full")
    vt = ext(torch.tensor([0]), torch.tensor([tokens]), torch.tensor([-1]), owner="full")
    alloc.free(junk, owner="full")
    return arena, alloc, vt


def hetero_descriptors(case: tuple, tokens: int, src_side: tuple) -> tuple[np.ndarray, int]:
    """The request's descriptors of ``case`` from prefill rank 0 to decode rank 0 (destination addresses relative
    to the decode arena) and the decode arena's size."""
    _label, (sp, _sps, _sg), (dp, dps, dg), merged = case
    s_arena, s_alloc, s_vt = src_side
    d_arena, d_alloc, d_vt = _hetero_side(dp, dps, dg, tokens, fill=False)
    s_lay = PeerLayout.from_arena(s_arena, tp_size=sp)
    d_lay = PeerLayout.from_arena(d_arena, tp_size=dp)
    plan = build_plan("h", s_alloc, s_vt, d_alloc, d_vt, src_layout=s_lay, dst_layout=d_lay)
    if merged:
        d = plan.descriptors().copy()
    else:  # the same token pairs, one descriptor per (token, layer block, head slice)
        v = plan.vectors["target"]
        d, _ = slice_descriptors(v.src_rows, v.dst_rows, pair_pieces(s_lay, "full", d_lay, "full"), s_lay, "full",
                                 d_lay, "full", merge=False)
        d = d.copy()
    plan.abort()
    d[:, 1] -= np.uint64(d_arena.base_ptr)
    return d, d_arena.spec.arena_bytes


def run_hetero(args: argparse.Namespace) -> list[dict]:
    tokens = args.hetero_tokens
    rows: list[dict] = []
    sides: dict[tuple, tuple] = {}
    cases = []
    for c in HETERO_CASES:
        if c[1] not in sides:
            sides[c[1]] = _hetero_side(*c[1], tokens, fill=True)
        cases.append((c, *hetero_descriptors(c, tokens, sides[c[1]])))
    rng = np.random.default_rng(args.seed)
    print(f"\nhetero: one {tokens}-token llama-3.1-8b request, prefill rank 0 -> decode rank 0, best of {args.repeat}")
    for name in args.backends:
        ok, why = backend_available(name)
        if not ok:
            print(f"{name}: unavailable ({why})")
            continue
        for (label, src_key, _dst, _m), d_rel, dst_bytes in cases:
            s_arena = sides[src_key][0]
            w = None
            if name == "local":
                recv = get_backend("local")
                dst = torch.zeros(dst_bytes, dtype=torch.uint8)
                recv.register([Region(dst.data_ptr(), dst_bytes)])
                md, dst_base = recv.metadata(), dst.data_ptr()

                def read_many(offsets, nbytes, dst=dst):
                    return b"".join(bytes(dst[o:o + nbytes].numpy().tobytes()) for o in offsets)
            else:
                w = BackendWorker(name)
                buf_id, dst_base = w.call("alloc", dst_bytes, timeout_s=120)
                w.call("register", [Region(dst_base, dst_bytes).to_dict()])
                md = w.call("metadata")

                def read_many(offsets, nbytes, w=w, buf_id=buf_id):
                    return w.call("read_many", buf_id, offsets, nbytes, timeout_s=60)
            b = get_backend(name)
            try:
                b.register(s_arena.regions())
                peer = b.connect(md)
                d = d_rel.copy()
                d[:, 1] += np.uint64(dst_base)
                times = []
                parts = 0
                for _ in range(args.repeat + 1):
                    t0 = time.perf_counter()
                    h = b.write_descriptors(d, peer)
                    b.wait(h, args.timeout_s)
                    times.append(time.perf_counter() - t0)
                    parts = h.num_parts
                    b.forget(h)
                best = min(times[1:])
                pick = rng.choice(d.shape[0], size=min(16, d.shape[0]), replace=False)
                nb = int(min(64, d[pick, 2].min()))
                src_bytes = s_arena.data.numpy()
                want = b"".join(src_bytes[int(d[i, 0]) - s_arena.base_ptr:][:nb].tobytes() for i in pick)
                verified = read_many([int(d_rel[i, 1]) for i in pick], nb) == want
                total = int(d[:, 2].sum())
                rows.append({"backend": name, "case": label, "descriptors": int(d.shape[0]), "parts": parts,
                             "bytes": total, "ms": best * 1e3, "gbps": total / best / 1e9, "verified": verified})
                r = rows[-1]
                print(f"{name:9s} {label:26s} {r['descriptors']:7d} desc {parts:4d} parts {total / 2**20:7.1f} MiB "
                      f"{r['ms']:8.2f} ms {r['gbps']:6.2f} GB/s {'ok' if verified else 'MISMATCH'}", flush=True)
                b.disconnect(peer)
            finally:
                b.close()
                if w is not None:
                    w.close()
                if name == "local":
                    recv.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--total-mib", type=int, default=256, help="bytes moved per transfer (MiB)")
    ap.add_argument("--backends", default="local,nixl,mooncake")
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions after one warm-up (best kept)")
    ap.add_argument("--mean-run-pages", type=int, default=32, help="mean run length of the replay layout")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=int(os.environ.get("UMALLOC_SEED", "7")))
    ap.add_argument("--plan-repeats", type=int, default=300, help="plans timed by the plan-overhead section")
    ap.add_argument("--json", default=None, help="write rows and baseline here")
    ap.add_argument("--hetero", action=argparse.BooleanOptionalAction, default=True,
                    help="also the plans between ranks of different TP / page size")
    ap.add_argument("--hetero-only", action="store_true", help="only the hetero section")
    ap.add_argument("--hetero-tokens", type=int, default=1024)
    args = ap.parse_args()
    args.backends = [b for b in args.backends.split(",") if b]
    if args.hetero_only:
        run_hetero(args)
        return
    over = plan_overhead(args.plan_repeats)
    print(f"plan overhead (local, L=2048, {over['descriptors']} descriptors, median of {args.plan_repeats}): "
          f"submit {over['submit_us']:.1f} us, raw write_descriptors {over['raw_us']:.1f} us, "
          f"submit / raw {over['submit_us'] / over['raw_us']:.2f}")
    rows, base, cma = run(args)
    print()
    print(f"{'backend':14s} {'page':>6s} {'layout':10s} {'descs':9s} {'count':>7s} {'ms':>9s} "
          f"{'GB/s':>10s} {'x memcpy':>8s}")
    for r in rows:
        print(f"{r['backend']:14s} {r['page']:>6s} {r['layout']:10s} {r['descriptors']:9s} "
              f"{r['num_descriptors']:7d} {r['ms']:9.1f} {r['gbps']:10.2f} {r['x_memcpy']:8.2f}"
              + ("" if r["verified"] else "  MISMATCH"))
    print(f"\nmemcpy baseline {base:.2f} GB/s ({args.total_mib} MiB, in-process, same run)")
    for line in targets(rows, base, cma):
        print(line)
    hetero = run_hetero(args) if args.hetero else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"memcpy_gbps": base, "cma_gbps": cma, "rows": rows, "plan_overhead": over, "hetero": hetero,
                       "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
