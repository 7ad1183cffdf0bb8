"""Benchmark transfer plans on a real geometry against a same-run per-layer baseline (a plain script, not a test).

* Geometry: preset ``gemma-3-12b-draft`` (8 full layers, 40 sliding layers with window 1024, a 26-layer drafter
  on its own 32-token pages), target page_size 16. Arenas are sized by :func:`arena_bytes_for_limits` and never
  touched (``zero=False``), so only index work is timed.
* Each request of ``L`` tokens is prefilled on one allocator (SWA bound only on its window tail, as a prefill
  that drops out-of-window pages) and preallocated on the other (full + SWA tail + draft), with other requests
  allocated and freed around it so the pages are not one run.
* ``build_plan``: receiver half + sender plan + bounds check + both leases (then ``abort``), in-process.
  ``split``: the same through ``to_dict`` / JSON / ``from_dict`` (the two-process path).
  ``per-layer loop``: the baseline measured here: a Python loop emitting one descriptor per page per layer per
  K/V from the same physical page lists (what a non-envelope design posts), no bounds check.
* Columns ``desc`` and ``per-layer`` count descriptors; ``x fewer`` is their ratio; times are medians of
  this thread's CPU time (``time.thread_time``).
* ``same``: the descriptors (addresses relative to each arena, so independent of where the arenas landed) hash
  to the digest the code before the transfer-layer restructure produced for this geometry (:data:`BEFORE_DIGESTS`,
  default prefix share only); ``-`` where no digest was recorded. A mismatch stops the run.

* Hetero table (``--hetero``, on by default): the same request between ranks of different TP or page size, per
  destination rank summed over the ranks of the request: ``TP1->2`` (each decode rank takes half the heads of
  the one prefill rank), ``TP2->1`` (the decode rank gathers both prefill ranks), page size ``16->32``; each in
  the page-major envelope and in the head-group-outer one (Note [Head-group-outer envelope]: the side with more
  heads per rank holds them in 2 groups), beside the equal-TP envelope. ``desc`` counts the merged descriptors
  of every (prefill rank, decode rank) plan of the request; ``baseline`` what a per-layer design posts: one
  descriptor per (token, layer block, head slice) across TP or page sizes (SGLang's ``send_kvcache_slice``), one
  per (page, layer block) for the equal-TP row; ``build ms`` the CPU time of all the request's plans.

Run: ``python benchmarks/bench_plan.py [--lengths 512,2048,8192] [--prefix-frac 0.25] [--repeats 7]
[--no-hetero]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from umalloc import MultiEndedAllocator
from umalloc.geometry.arena import Arena
from umalloc.geometry.presets import preset_ends
from umalloc.geometry.spec import ArenaSpec, arena_bytes_for_limits, swa_tail_start
from umalloc.transfer import PeerLayout, build_plan, build_receiver_half, build_send_plan

#: SHA-256 (first 16 hex digits) of the relative descriptors at L (prefix share 0.25), as the code before the
#: transfer-layer restructure built them (same geometry, same allocations).
BEFORE_DIGESTS = {512: "a5a576c8b47fc03a", 2048: "86779f6664c1c75a", 8192: "0791360341432528"}


def descriptor_digest(plan) -> str:
    """Digest of a plan's descriptors with addresses taken relative to each side's arena."""
    d = plan.descriptors().astype(np.uint64, copy=True)
    d[:, 0] -= np.uint64(plan.src_layout.arena_base_ptr)
    d[:, 1] -= np.uint64(plan.dst_layout.arena_base_ptr)
    return hashlib.sha256(d.tobytes()).hexdigest()[:16]


def median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median CPU seconds of this thread per call (``time.thread_time``: on a shared machine load from other
    processes inflates it less than wall time), over ``repeats`` blocks of calls lasting about 20 ms each."""
    fn()
    t0 = time.thread_time()
    fn()
    calls = max(1, min(200, int(0.02 / max(time.thread_time() - t0, 1e-6))))
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        times.append((time.thread_time() - t0) / calls)
    return statistics.median(times)


def make_side(spec: ArenaSpec, L: int, P: int, noise: int) -> tuple[MultiEndedAllocator, dict[str, torch.Tensor]]:
    alloc = MultiEndedAllocator(Arena(spec, zero=False))
    ext = alloc.alloc_extend
    junk = ext(torch.tensor([0]), torch.tensor([noise]), torch.tensor([-1]), owner="full", bind=[])
    junk_d = ext(torch.tensor([0]), torch.tensor([noise]), torch.tensor([-1]), owner="draft")
    vt = ext(torch.tensor([0]), torch.tensor([L]), torch.tensor([-1]), owner="full", bind=[])
    alloc.free(junk, owner="full")
    alloc.free(junk_d, owner="draft")
    tail = swa_tail_start(L, spec.end("swa").window_tokens, P, spec.end("swa").page_size)
    assert alloc.bind_end("swa", vt[tail:])
    vd = ext(torch.tensor([0]), torch.tensor([L]), torch.tensor([-1]), owner="draft")
    return alloc, {"full": vt, "draft": vd}


def per_layer_loop(plan) -> int:
    """Baseline: one descriptor per (page, layer, K/V) from the plan's page lists, in plain Python."""
    out = []
    for v in plan.vectors.values():
        src_end = plan.src_layout.end(v.src_end)
        sb, db = plan.src_layout.arena_base_ptr, plan.dst_layout.arena_base_ptr
        pb, ps = src_end.page_bytes, src_end.page_size
        offs = src_end.layer_offsets_bytes
        for sp, dp in zip(v.src_pages.tolist(), v.dst_pages.tolist(), strict=True):
            for (k_off, v_off), layer in zip(offs, src_end.layers, strict=True):
                out.append((sb + sp * pb + k_off, db + dp * pb + k_off, ps * layer.k_token_bytes))
                if layer.v_token_bytes:
                    out.append((sb + sp * pb + v_off, db + dp * pb + v_off, ps * layer.v_token_bytes))
    return len(np.array(out, dtype=np.uint64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--prefix-frac", type=float, default=0.25, help="share of tokens the receiver already holds")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--hetero", action=argparse.BooleanOptionalAction, default=True,
                    help="also the table of plans between different TP and page sizes")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    # the drafter whole in its own end (its own page size, its own ids): the shape the figures were taken on
    ends = preset_ends("gemma-3-12b-draft", page_size=16, draft_page_size=32, draft_sliding="draft")
    spec = ArenaSpec(ends, arena_bytes=arena_bytes_for_limits(ends, max_seq_len_tokens=max(lengths) + 512,
                                                               max_batch=1))
    print(f"preset gemma-3-12b-draft, arena {spec.arena_bytes / 2**20:.0f} MiB per side (untouched), "
          f"prefix = {args.prefix_frac:.0%} of L (+3 tokens, mid-page), median of {args.repeats}")
    hdr = (f"{'L':>6} {'P':>5} | {'pages t/d/swa':>14} {'desc':>6} {'per-layer':>9} {'x fewer':>7} {'same':>4} | "
           f"{'build_plan ms':>13} {'split ms':>8} {'per-layer loop ms':>17} {'loop/build':>10}")
    print(hdr)
    print("-" * len(hdr))
    for L in lengths:
        P = int(L * args.prefix_frac) + 3 if args.prefix_frac else 0
        print(bench_one(spec, L, P, args.repeats, BEFORE_DIGESTS.get(L) if args.prefix_frac == 0.25 else None))
    if args.hetero:
        hetero_table(lengths, args.prefix_frac, args.repeats)


def bench_one(spec: ArenaSpec, L: int, P: int, repeats: int, digest: str | None) -> str:
    src, vs = make_side(spec, L, 0, 37)
    dst, vd = make_side(spec, L, P, 91)
    dst_layout = PeerLayout.from_arena(dst.arena)

    def in_process() -> None:
        build_plan("b", src, vs, dst, vd, prefix_tokens=P).abort()

    def split() -> None:
        half = build_receiver_half("b", dst, vd, prefix_tokens=P)
        wire = json.loads(json.dumps(half.to_dict()))
        build_send_plan("b", src, vs, wire, dst_layout).abort()
        half.abort()

    plan = build_plan("b", src, vs, dst, vd, prefix_tokens=P)
    same = "-"
    if digest is not None:
        got = descriptor_digest(plan)
        if got != digest:
            raise SystemExit(f"L={L}: descriptors differ from the code before (digest {got}, expected {digest})")
        same = "yes"
    pages = "/".join(str(plan.vectors[n].num_pages) for n in ("target", "draft", "swa_tail"))
    assert per_layer_loop(plan) <= plan.per_layer_descriptor_equivalent
    t_build = median_s(in_process, repeats)
    t_split = median_s(split, repeats)
    t_loop = median_s(lambda: per_layer_loop(plan), repeats)
    plan.abort()
    return (f"{L:>6} {P:>5} | {pages:>14} {plan.num_descriptors:>6} {plan.per_layer_descriptor_equivalent:>9} "
            f"{plan.per_layer_descriptor_equivalent / max(plan.num_descriptors, 1):>7.1f} {same:>4} | "
            f"{t_build * 1e3:>13.2f} {t_split * 1e3:>8.2f} {t_loop * 1e3:>17.2f} {t_loop / t_build:>10.2f}")


# ==== different TP and page sizes ==============================================================================

#: (label, prefill (TP, page size, head groups), decode (TP, page size, head groups)).
HETERO_CASES = [
    ("TP1->1 envelope", (1, 16, 1), (1, 16, 1)),
    ("TP1->2 page-major", (1, 16, 1), (2, 16, 1)),
    ("TP1->2 head-group-outer", (1, 16, 2), (2, 16, 1)),
    ("TP2->1 page-major", (2, 16, 1), (1, 16, 1)),
    ("TP2->1 head-group-outer", (2, 16, 1), (1, 16, 2)),
    ("page 16->32 page-major", (1, 16, 1), (1, 32, 1)),
    ("page 16->32 head-group-outer", (1, 16, 2), (1, 32, 2)),
]


def rank_spec(tp: int, page_size: int, head_groups: int, max_len: int) -> ArenaSpec:
    """One TP rank's arena of the bench preset; ``head_groups`` on the ends whose heads divide by it (the drafter's
    one KV head stays page-major)."""
    ends = tuple(dataclasses.replace(e, head_groups=head_groups)
                 if all(x.num_kv_heads % head_groups == 0 for x in e.layers) else e
                 for e in preset_ends("gemma-3-12b-draft", page_size=page_size, draft_page_size=8, tp_size=tp,
                                      draft_sliding="draft"))
    return ArenaSpec(ends, arena_bytes=arena_bytes_for_limits(ends, max_seq_len_tokens=max_len, max_batch=1))


def hetero_table(lengths: list[int], prefix_frac: float, repeats: int) -> None:
    from umalloc.transfer.slices import sends_to

    print(f"\nplans between ranks of different TP / page size (gemma-3-12b-draft, draft on its own 8-token pages), per request, all "
          f"(prefill rank, decode rank) plans; median of {repeats}")
    hdr = (f"{'L':>6} {'case':<29} | {'pairs':>5} {'desc':>7} {'baseline':>9} {'x fewer':>7} {'MiB':>7} | "
           f"{'build ms':>8}")
    print(hdr)
    print("-" * len(hdr))
    for L in lengths:
        P = int(L * prefix_frac) + 3 if prefix_frac else 0
        for label, (sp, sps, sg), (dp, dps, dg) in HETERO_CASES:
            srcs = [(make_side(rank_spec(sp, sps, sg, L + 512), L, 0, 37), q) for q in range(sp)]
            dsts = [(make_side(rank_spec(dp, dps, dg, L + 512), L, P, 91), r) for r in range(dp)]
            pairs = []
            for (s_alloc, s_vt), q in srcs:
                s_lay = PeerLayout.from_arena(s_alloc.arena, tp_rank=q, tp_size=sp)
                for (d_alloc, d_vt), r in dsts:
                    d_lay = PeerLayout.from_arena(d_alloc.arena, tp_rank=r, tp_size=dp)
                    if sends_to(s_lay, d_lay):
                        pairs.append((s_alloc, s_vt, s_lay, d_alloc, d_vt, d_lay))

            def plans(pairs=pairs, P=P):
                return [build_plan("h", s, sv, d, dv, prefix_tokens=P, src_layout=sl, dst_layout=dl)
                        for s, sv, sl, d, dv, dl in pairs]

            made = plans()
            desc = sum(p.num_descriptors for p in made)
            per_slice = sum(p.per_layer_descriptor_equivalent for p in made)
            nbytes = sum(p.total_bytes for p in made)
            for p in made:
                p.abort()
            t = median_s(lambda: [p.abort() for p in plans()], repeats)
            print(f"{L:>6} {label:<29} | {len(pairs):>5} {desc:>7} {per_slice:>9} {per_slice / max(desc, 1):>7.1f} "
                  f"{nbytes / 2**20:>7.1f} | {t * 1e3:>8.2f}")


if __name__ == "__main__":
    main()
