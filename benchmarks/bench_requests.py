#!/usr/bin/env python3
"""Replay the peerbench op sequence through umalloc's RequestTable (not a timed test).

The op file is the one ``benchmarks/bench_allocator.py`` reads (peerbench's ``workload.py``: extend / decode / free
built from the Mooncake conversation trace, same fingerprint); this file reuses that module's loader, arena sizing
and checked page-form replay by import. The harness plays a scheduler that lets umalloc own its requests, as an
engine on vLLM's ``KVCacheManager`` does:

* an extend op opens its new requests with one ``new_requests(n)`` and calls one ``extend(slots, extend_lens)``
  for the whole batch; a decode op one ``decode(slots)``; a free op one ``free_requests(slots)``. The harness keeps
  only a request -> slot array (what the engine's scheduler keeps anyway); umalloc fills ``req_to_token``.

Modes:

* ``table`` -- prefix caching off (the like-for-like with ``KVCacheManager(enable_caching=False)``);
* ``table-swa`` -- with an SWA end (window 128 tokens after scaling): windows advance inside ``extend`` /
  ``decode`` (the same pages, frontiers and unbind order as ``bench_allocator.py --modes umalloc-swa``);
* ``table-apc`` -- prefix caching on: ``free_requests(cache=True)`` keeps every full page as cached, and
  allocation evicts them LRU first when the pool runs out (vLLM ``kvcm-apc``: no hits, prompts are unique);
* ``table-fork`` -- fork-heavy prefix caching: at its first decode every request is forked at its length
  (parallel sampling, n = 2); the fork decodes in the same batch (the shared partial page is copied on the first
  write) and is then freed with ``cache=True``; finished requests free with ``cache=True``. Request-ops and pages
  count the forks' work too (reported beside the base figures).

Each mode is checked once before timing (untimed): after every op the table's live pages equal the harness's
count (held by requests + the zero page, + cached in the caching modes), every 97 ops ``check_invariants()``,
nothing leaks at the end. The timed part is one ``perf_counter`` around the replay on a fresh allocator and table;
the figure is the median of the repeats.

``--peers`` runs ``../shared/peerbench/run_vllm.py --modes blockpool,kvcm,kvcm-apc`` (under ``$PEERS_VENV``) on
the same op file right after, and prints one table with ratios to vLLM's ``KVCacheManager`` (``kvcm``) and
``BlockPool`` measured in the same run. ``umalloc-pages`` (bench_allocator's page-level replay, no request
ownership) runs beside, to show what the ownership layer costs.

Usage (``UMALLOC_PEERBENCH`` names the peerbench folder when the tree is not beside ``shared/``; ``PEERS_VENV``
the peers' venv, default ``/tmp/peers/venv``)::

    python benchmarks/bench_requests.py --repeats 9 --peers --rounds 3
    python benchmarks/bench_requests.py --ops /tmp/peers/ops.json --modes table,table-apc --no-pages
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _peerbench as pb  # noqa: E402  (the harness shared with bench_allocator.py)
import bench_allocator as ba  # noqa: E402  (the arena sizing and page-form replay, reused)

from umalloc.requests.table import RequestTable  # noqa: E402

wl = pb.wl
MODES = ("table", "table-swa", "table-apc", "table-fork")
_E, _D, _F = 0, 1, 2


class _Op:
    __slots__ = ("forks", "kind", "new_rids", "rids", "lens")


class PreparedTable:
    """Per-op numpy arrays of request ids (untimed): ``new_rids`` opened by an extend, ``rids`` the batch,
    ``lens`` the extend lengths, ``forks`` (fork mode) the requests whose first decode this op is."""

    def __init__(self, w: wl.Workload, fork: bool) -> None:
        self.ops: list[_Op] = []
        self.n_forks = 0
        seen_decode: set[int] = set()
        live: set[int] = set()
        self.max_live = 0
        for kind, payload in w.ops:
            o = _Op()
            o.forks = None
            if kind == "E":
                o.kind = _E
                o.rids = np.array([it[0] for it in payload], np.int64)
                o.lens = np.array([it[2] for it in payload], np.int64)
                o.new_rids = np.array([it[0] for it in payload if it[1] == 0], np.int64)
                live.update(o.new_rids.tolist())
            elif kind == "D":
                o.kind = _D
                o.rids = np.array(payload, np.int64)
                if fork:
                    first = [r for r in payload if r not in seen_decode]
                    seen_decode.update(first)
                    o.forks = np.array(first, np.int64) if first else None
                    self.n_forks += len(first)
            else:
                o.kind = _F
                o.rids = np.array(payload, np.int64)
                live.difference_update(payload)
            self.max_live = max(self.max_live, len(live) + (len(o.forks) if o.forks is not None else 0))
            self.ops.append(o)
        self.n_rids = max(w.req_in) + 1


def make_table(w: wl.Workload, prep: PreparedTable, swa: bool, swa_window: int, swa_ratio: float
               ) -> RequestTable:
    alloc = ba.make_allocator(w, swa_window if swa else None, swa_ratio)
    return RequestTable(alloc, max_requests=prep.max_live, max_tokens_per_request=w.max_seq_len() + 1)


def replay(table: RequestTable, prep: PreparedTable, slot_of: np.ndarray, cache: bool) -> None:
    """The timed loop: one table call per op (plus the forks' calls in fork mode)."""
    new_requests, extend, decode, free_requests, fork = (table.new_requests, table.extend, table.decode,
                                                         table.free_requests, table.fork)
    for o in prep.ops:
        k = o.kind
        if k == _D:
            if o.forks is None:
                decode(slot_of[o.rids])
            else:
                kids = [fork(s) for s in slot_of[o.forks].tolist()]
                batch = np.concatenate([slot_of[o.rids], np.array(kids, np.int64)])
                decode(batch)
                free_requests(batch[o.rids.shape[0]:], cache=True)
        elif k == _E:
            if o.new_rids.shape[0]:
                slot_of[o.new_rids] = new_requests(o.new_rids.shape[0]).numpy()
            extend(slot_of[o.rids], o.lens)
        else:
            free_requests(slot_of[o.rids], cache=cache)


def checked_replay(table: RequestTable, prep: PreparedTable, slot_of: np.ndarray, cache: bool, ps: int) -> dict:
    """Untimed verification pass (module docstring). Returns peaks and cache counters."""
    alloc = table.alloc
    length: dict[int, int] = {}
    peak = 0
    for i, o in enumerate(prep.ops):
        if o.kind == _E:
            if o.new_rids.shape[0]:
                got = table.new_requests(o.new_rids.shape[0])
                assert got is not None, f"op {i}: no free slot"
                slot_of[o.new_rids] = got.numpy()
            out = table.extend(slot_of[o.rids], o.lens)
            assert out is not None and out.shape[0] == int(o.lens.sum()), f"op {i}: extend returned {out}"
            for r, n in zip(o.rids.tolist(), o.lens.tolist(), strict=True):
                length[r] = length.get(r, 0) + n
        elif o.kind == _D:
            batch = slot_of[o.rids]
            kids = np.zeros(0, np.int64)
            if o.forks is not None:
                kids = np.array([table.fork(s, length[r]) for r, s in
                                 zip(o.forks.tolist(), slot_of[o.forks].tolist(), strict=True)], np.int64)
                assert (kids >= 0).all(), f"op {i}: fork found no slot"
                batch = np.concatenate([batch, kids])
            out = table.decode(batch)
            assert out is not None and out.shape[0] == batch.shape[0], f"op {i}: decode returned {out}"
            assert np.unique(out.numpy()).shape[0] == out.shape[0], f"op {i}: a token handed out twice"
            for r in o.rids.tolist():
                length[r] += 1
            if kids.shape[0]:
                table.free_requests(kids, cache=True)
        else:
            for r in o.rids.tolist():
                assert int(table.num_tokens([int(slot_of[r])])[0]) == length.pop(r), f"op {i}: length differs"
            table.free_requests(slot_of[o.rids], cache=cache)
        want = sum(-(-n // ps) for n in length.values()) + 1
        st = table.stats()
        assert st.held_pages == want, (i, st.held_pages, want)
        live = alloc.stats()["full"].live_pages
        assert live == want + st.cached_pages, (i, live, want, st.cached_pages)
        peak = max(peak, live)
        if i % 97 == 0 or i == len(prep.ops) - 1:
            table.check_invariants()
    st = table.stats()
    assert not length and st.held_pages == 1 and st.live_requests == 0, "pages or requests leaked"
    table.check_invariants()
    return {"peak_pages": peak, "pages_cached": st.pages_cached, "pages_evicted": st.pages_evicted,
            "pages_copied": st.pages_copied}


def run_mode(mode: str, w: wl.Workload, args: argparse.Namespace) -> dict:
    swa, cache, fork = mode == "table-swa", mode in ("table-apc", "table-fork"), mode == "table-fork"
    prep = PreparedTable(w, fork)
    extra: dict = {"block_table": "req_to_token owned by umalloc (int32)"}
    if not args.no_verify:
        table = make_table(w, prep, swa, args.swa_window, args.swa_ratio)
        extra.update(checked_replay(table, prep, np.zeros(prep.n_rids, np.int64), cache, w.params.page_size))
        if swa:   # the windows advanced exactly as bench_allocator's explicit unbinds (same pages, same rule)
            unbound = table.alloc.stats()["swa"].pages_unbound
            want = ba.PreparedPages(w, args.swa_window).unbound_pages
            assert unbound == want, f"swa pages unbound {unbound}, bench_allocator unbinds {want}"
            extra["swa_pages_unbound"] = unbound
        extra["verified"] = True
    walls = []
    for _ in range(args.repeats):
        table = make_table(w, prep, swa, args.swa_window, args.swa_ratio)
        slot_of = np.zeros(prep.n_rids, np.int64)
        t0 = time.perf_counter()
        replay(table, prep, slot_of, cache)
        walls.append(time.perf_counter() - t0)
        assert table.stats().held_pages == 1, "pages leaked"
    med = statistics.median(walls)
    calls = sum(1 + (o.kind == _E and o.new_rids.shape[0] > 0) for o in prep.ops) + 2 * prep.n_forks
    res = {
        "allocator": f"umalloc-{mode}", "workload": w.fingerprint, "repeats": len(walls),
        "wall_s_median": round(med, 4), "wall_s_min": round(min(walls), 4), "wall_s_max": round(max(walls), 4),
        "req_ops_per_s": round(w.meta["req_ops"] / med), "api_calls": calls, "api_calls_per_s": round(calls / med),
        "pages_alloc_per_s": round(w.meta["pages_allocated"] / med),
    }
    if fork:
        res["forks"] = prep.n_forks
    res.update(extra)
    return res


def print_table(rows: list[dict], pages_allocated: int) -> None:
    """One row per allocator: pages allocated per second and the ratios of wall times to vLLM's KVCacheManager
    with prefix caching off (``kvcm``; from the medians and from the fastest repeats, the latter steadier on a busy
    host), with caching on (``kvcm-apc``) and to BlockPool, all measured in this run."""
    base = {r["allocator"]: r for r in rows}

    def ratio(ref: str, r: dict, key: str = "wall_s_median") -> str:
        return f"{base[ref][key] / r[key]:.2f}" if ref in base else "-"

    hdr = (f"{'allocator':<22} {'wall s med':>10} {'wall s min':>10} {'req-ops/s':>11} {'calls/s':>9} "
           f"{'pages/s (med)':>13} {'peak':>6} {'x kvcm':>7} {'(min)':>6} {'x apc':>6} {'x bpool':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        med = r["wall_s_median"]
        print(f"{r['allocator']:<22} {med:>10.4f} {r['wall_s_min']:>10.4f} {r['req_ops_per_s']:>11,} "
              f"{r['api_calls_per_s']:>9,} {round(pages_allocated / med):>13,} {r.get('peak_pages', -1):>6} "
              f"{ratio('vllm-kvcm', r):>7} {ratio('vllm-kvcm', r, 'wall_s_min'):>6} "
              f"{ratio('vllm-kvcm-apc', r):>6} {ratio('vllm-blockpool', r):>7}")


#: the vLLM adapter each mode is compared with per round: the same work (caching off / on)
PEER_OF = {"umalloc-table": "vllm-kvcm", "umalloc-table-swa": "vllm-kvcm", "umalloc-table-apc": "vllm-kvcm-apc",
           "umalloc-table-fork": "vllm-kvcm-apc", "umalloc-pages": "vllm-blockpool"}


def main(argv: list[str] | None = None) -> int:
    ap = pb.parser(__doc__, MODES, peers_help="also run peerbench's vLLM adapters on the same ops",
                   rounds_help="alternate umalloc's modes and the peers this many times (busy hosts); the table "
                               "takes the median of the rounds' medians and the minimum of their minima")
    ap.add_argument("--no-pages", action="store_true", help="skip bench_allocator's umalloc-pages beside")
    ap.add_argument("--peer-modes", default="blockpool,kvcm,kvcm-apc")
    a = ap.parse_args(argv)
    print(pb.fair.set_threads(a.threads))
    w = wl.from_args(a)
    print(f"# umalloc request-table bench  torch {torch.__version__}  workload {w.fingerprint}: "
          f"requests={w.meta['requests']} ops={w.meta['ops_total']} req_ops={w.meta['req_ops']} "
          f"pages_allocated={w.meta['pages_allocated']} peak_live_pages={w.meta['peak_live_pages']}")
    small = pb.warm_up_workload(a)
    for mode in MODES:   # warm the numba kernels (cache or compile) outside any timing
        run_mode(mode, small, argparse.Namespace(**{**vars(a), "no_verify": False, "repeats": 1}))
    runs = [] if a.no_pages else [("umalloc-pages", lambda m, w, args: ba.run_mode(
        m, w, argparse.Namespace(**{**vars(args), "no_verify": True})))]
    runs += [(m, run_mode) for m in pb.chosen_modes(a, MODES)]
    rounds = pb.run_rounds(a, w, runs, lambda ops: pb.run_peers(ops, a.peer_repeats, a.peer_modes, required=False),
                           ("wall_s_median", "req_ops_per_s", "pages_alloc_per_s"))
    if len(rounds) > 1 and all(len(r) == len(rounds[0]) for r in rounds):
        rows = pb.merge_rounds(rounds)
    else:
        rows = rounds[-1]
    if a.peers:
        pb.print_round_ratios(rounds, PEER_OF.get)
    print()
    print_table(rows, w.meta["pages_allocated"])
    print(f"# {pb.fair.load()} (at the end)")
    pb.append_json(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
