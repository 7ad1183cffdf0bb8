#!/usr/bin/env python3
"""Replay the peerbench op sequence through umalloc's MultiEndedAllocator (not a timed test).

The op sequence (extend / decode / free, built from the Mooncake conversation trace) is the one
``../shared/peerbench/workload.py`` writes and replays through SGLang's and vLLM's allocators, with the same
fingerprint. The harness plays an SGLang-style scheduler:

* it keeps a ``req_to_token`` block table (a torch int64 tensor with one row per live request, rows recycled as
  SGLang's ``ReqToTokenPool`` does; the harness reads and writes it through its numpy view), gathers
  ``last_loc`` from it into persistent staging tensors, calls the batched ``alloc_extend`` / ``alloc_decode``
  with ``out=`` staging tensors and writes the returned virtual token ids back;
* it frees every request finished in one op with one ``free`` call (page granular: the first token of each
  page, gathered from the block table);
* mode ``umalloc-swa`` adds an SWA end (grows down, bound to ``full``) and, before each op, unbinds the SWA
  pages that left the window (``unbind_end``; frontier from ``swa_tail_start``, SGLang's
  ``free_swa_out_of_window_slots`` rule without prefix sharing, window 128 tokens after scaling).

Modes ``umalloc-pages`` / ``umalloc-pages-swa`` replay the same ops as a vLLM-style scheduler does (see
:class:`PreparedPages`): a ``req_to_page`` block table of virtual page ids in numpy (as vLLM's ``BlockTable``
keeps it), one ``alloc_pages(k, out=table, index=slots)`` per op for the pages its requests newly need, one
``free_pages(table, index=slots)`` per op for the finished requests, one ``unbind_pages`` per op for the pages
that left the SWA window. This is the
like-for-like comparison with vLLM's BlockPool, which is itself a page-level allocator (``get_new_blocks``,
``free_blocks``); the token modes are the like-for-like comparison with SGLang's token-level allocators.

Per-op index arrays are prepared before timing (as the peers' harnesses do); the timed part is one
``perf_counter`` around the whole replay on a fresh allocator, and the figure is the median of the repeats.
Before timing, one checked pass verifies every op: the allocator's live counts equal the harness's, every live
page's data marker (written through its physical envelope) reads back, ``check_invariants()`` holds, and nothing
leaks at the end.

``--peers`` runs ``../shared/peerbench/run_vllm.py --modes blockpool`` on the same op file right after and prints
one table with ratios to vLLM's BlockPool measured in the same run.

Usage::

    python benchmarks/bench_allocator.py                      # builds the default workload (1000 req, /8, ps 16)
    python benchmarks/bench_allocator.py --ops /tmp/peers/ops.json --repeats 15 --peers --peer-repeats 15
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _peerbench as pb  # noqa: E402  (the harness shared with bench_requests.py)

wl = pb.wl

from umalloc import MultiEndedAllocator  # noqa: E402
from umalloc.geometry.arena import Arena  # noqa: E402
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, KVDtype, LayerSpec  # noqa: E402

MODES = ("umalloc", "umalloc-swa", "umalloc-pages", "umalloc-pages-swa")
_E, _D, _F = 0, 1, 2


class _Op:
    __slots__ = ("ev", "ev_buf", "ev_t", "kind", "last_buf", "last_flat", "last_t", "n_pages", "n_req", "no_prefix",
                 "out_np", "out_t", "pre_t", "runs", "seq_t", "target", "target_buf", "target_t", "write_flat")


def _buffer(n: int) -> tuple[np.ndarray, torch.Tensor]:
    """A persistent int64 torch tensor and its numpy view (the harness's reusable staging buffers)."""
    t = torch.zeros(n, dtype=torch.int64)
    return t.numpy(), t


class _Rows:
    """Block-table rows, one per *live* request, recycled when a request finishes (as SGLang's
    ``ReqToTokenPool`` does): the lowest free row goes to each newly admitted request."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.n_rows = 0                    # rows in the table (the most requests live at once)
        self._base: dict[int, int] = {}    # request -> flat offset of its row
        self._free: list[int] = []

    def base(self, r: int) -> int:
        if r not in self._base:
            if self._free:
                self._base[r] = heapq.heappop(self._free) * self.width
            else:
                self._base[r] = self.n_rows * self.width
                self.n_rows += 1
        return self._base[r]

    def recycle(self, r: int) -> None:
        heapq.heappush(self._free, self._base.pop(r) // self.width)


class _SwaUnbinds:
    """The SWA pages that leave the window before an op, as flat slots of the block table: per request, pages
    from its last frontier up to ``swa_tail_start`` (SGLang's ``free_swa_out_of_window_slots`` rule without prefix
    sharing). A token table (``tokens_per_slot = 1``) names each page by its first token's slot, a page table
    (``tokens_per_slot = page_size``) by its page's slot."""

    def __init__(self, window: int | None, page_size: int, tokens_per_slot: int) -> None:
        self.window, self.ps, self.per_slot = window, page_size, tokens_per_slot
        self.frontier: dict[int, int] = {}  # request -> first token still bound on the SWA end
        self.n_calls = 0
        self.n_pages = 0

    def __call__(self, rows: _Rows, rids: list[int], lens: list[int]) -> np.ndarray | None:
        if self.window is None:
            return None
        chunks = []
        for r, n in zip(rids, lens, strict=True):
            first = self.frontier.get(r, 0)
            tail = MultiEndedAllocator.swa_tail_start(n, self.window, 0, self.ps)
            if tail > first:
                chunks.append(rows.base(r) + np.arange(first, tail, self.ps, dtype=np.int64) // self.per_slot)
                self.frontier[r] = tail
        if not chunks:
            return None
        flat = np.concatenate(chunks)
        self.n_calls += 1
        self.n_pages += flat.size
        return flat


class Prepared:
    """Per-op numpy index arrays into the flat block table (untimed), and the SWA unbind lists.

    The block table has one row per *live* request, recycled when a request finishes (as SGLang's
    ``ReqToTokenPool`` does): the lowest free row goes to each newly admitted request.
    """

    def __init__(self, w: wl.Workload, swa_window: int | None) -> None:
        ps = self.ps = w.params.page_size
        self.width = w.max_seq_len() + ps
        self.ops: list[_Op] = []
        length: dict[int, int] = {}
        rows_ = _Rows(self.width)
        row = rows_.base
        unbinds = _SwaUnbinds(swa_window, ps, 1)

        def stage(o: _Op) -> None:
            o.ev_buf, o.ev_t = _buffer(o.ev.size) if o.ev is not None else (None, None)

        for kind, payload in w.ops:
            o = _Op()
            if kind == "E":
                rids = np.array([it[0] for it in payload], np.int64)
                pre = np.array([it[1] for it in payload], np.int64)
                ext = np.array([it[2] for it in payload], np.int64)
                o.kind = _E
                rows = np.array([row(r) for r in rids.tolist()], np.int64)
                o.ev = unbinds(rows_, rids.tolist(), pre.tolist())
                o.pre_t = torch.from_numpy(pre)
                o.seq_t = torch.from_numpy(pre + ext)
                o.last_flat = rows + np.maximum(pre - 1, 0)
                nop = np.flatnonzero(pre == 0)
                o.no_prefix = nop if nop.size else None
                o.write_flat = np.concatenate([b + np.arange(p, p + e, dtype=np.int64)
                                               for b, p, e in zip(rows.tolist(), pre.tolist(), ext.tolist(),
                                                                  strict=True)])
                # per request: (table start, table stop, out start, out stop) -- contiguous row slices
                ends_ = np.cumsum(ext)
                o.runs = [(b + p, b + p + e, c - e, c)
                          for b, p, e, c in zip(rows.tolist(), pre.tolist(), ext.tolist(), ends_.tolist(),
                                                strict=True) if e]
                o.last_buf, o.last_t = _buffer(len(payload))
                o.out_np, o.out_t = _buffer(int(ext.sum()))
                stage(o)
                o.n_req = len(payload)
                for r, p, e in zip(rids.tolist(), pre.tolist(), ext.tolist(), strict=True):
                    length[r] = p + e
            elif kind == "D":
                rows = np.array([row(r) for r in payload], np.int64)
                cur = np.array([length[r] for r in payload], np.int64)
                o.kind = _D
                o.ev = unbinds(rows_, list(payload), cur.tolist())
                o.seq_t = torch.from_numpy(cur + 1)
                o.last_flat = rows + cur - 1
                o.write_flat = rows + cur
                o.last_buf, o.last_t = _buffer(len(payload))
                o.out_np, o.out_t = _buffer(len(payload))
                stage(o)
                o.n_req = len(payload)
                for r in payload:
                    length[r] += 1
            else:
                o.kind = _F
                o.ev = None
                o.target = np.concatenate([row(r) + np.arange(0, length[r], ps, dtype=np.int64)
                                           for r in payload])
                for r in payload:                 # the finished requests' rows are recycled
                    rows_.recycle(r)
                o.target_buf, o.target_t = _buffer(o.target.size)
                stage(o)
                o.n_req = len(payload)
            self.ops.append(o)
        self.n_req = rows_.n_rows
        self.n_unbind_calls, self.unbound_pages = unbinds.n_calls, unbinds.n_pages

    def api_calls(self, swa: bool) -> int:
        return len(self.ops) + (self.n_unbind_calls if swa else 0)


class PreparedPages:
    """The page-table form (vLLM style) of the same op sequence: the engine keeps a ``req_to_page`` block table
    of virtual page ids (one row per live request, rows recycled like :class:`Prepared`'s) and asks for pages,
    not tokens: per op one ``alloc_pages(k)`` for all the pages its requests newly need (``k = 0``: no call,
    as peerbench's BlockPool adapter skips ``get_new_blocks(0)``), one scatter of them into the table, one
    ``free_pages`` for every request finished in the op, and (SWA) one ``unbind_pages`` of the pages that left
    the window -- the same pages, frontiers (``swa_tail_start``) and call order as the token form.
    """

    def __init__(self, w: wl.Workload, swa_window: int | None) -> None:
        ps = self.ps = w.params.page_size
        self.width = -(-w.max_seq_len() // ps) + 1    # pages per table row
        self.ops: list[_Op] = []
        self.n_alloc_calls = 0
        length: dict[int, int] = {}
        rows_ = _Rows(self.width)
        row = rows_.base
        unbinds = _SwaUnbinds(swa_window, ps, ps)

        def new_pages(items: list[tuple[int, int, int]]) -> None:
            slots = [row(r) + np.arange(-(-pre // ps), -(-(pre + n) // ps), dtype=np.int64) for r, pre, n in items]
            o.write_flat = np.concatenate(slots) if slots else np.empty(0, np.int64)
            o.n_pages = int(o.write_flat.size)
            self.n_alloc_calls += o.n_pages > 0

        for kind, payload in w.ops:
            o = _Op()
            o.ev = None
            if kind == "E":
                o.kind = _E
                o.ev = unbinds(rows_, [it[0] for it in payload], [it[1] for it in payload])
                new_pages([(r, pre, n) for r, pre, n in payload])
                for r, pre, n in payload:
                    length[r] = pre + n
            elif kind == "D":
                o.kind = _D
                o.ev = unbinds(rows_, list(payload), [length[r] for r in payload])
                new_pages([(r, length[r], 1) for r in payload])
                for r in payload:
                    length[r] += 1
            else:
                o.kind = _F
                o.target = np.concatenate([row(r) + np.arange(-(-length[r] // ps), dtype=np.int64)
                                           for r in payload])
                for r in payload:
                    rows_.recycle(r)
            o.n_req = len(payload)
            self.ops.append(o)
        self.n_req = rows_.n_rows
        self.n_unbind_calls, self.unbound_pages = unbinds.n_calls, unbinds.n_pages

    def api_calls(self, swa: bool) -> int:
        n_free = sum(1 for o in self.ops if o.kind == _F)
        return self.n_alloc_calls + n_free + (self.n_unbind_calls if swa else 0)


def tiny_ends(page_size: int, swa_window: int | None) -> tuple[EndSpec, ...]:
    """One fp16 layer, 1 KV head x 16 dims: 64 B per token (1 KiB pages at page_size 16), as the peers' fake
    pools; the SWA end has the same geometry with a sliding window."""
    full = EndSpec("full", (LayerSpec.mha(1, 16, dtype=KVDtype.FP16),), page_size=page_size)
    if swa_window is None:
        return (full,)
    swa = EndSpec("swa", (LayerSpec.mha(1, 16, dtype=KVDtype.FP16, window_tokens=swa_window),),
                  page_size=page_size, grow=Grow.DOWN, owner="full", role=EndRole.SWA)
    return full, swa


def make_allocator(w: wl.Workload, swa_window: int | None, swa_ratio: float) -> MultiEndedAllocator:
    """Arena = floor (one page) + P pages (+ S = swa_ratio * P pages for the SWA end), like the peers'
    unified pools: the ``full`` end can take all P pages, and both ends share the rest dynamically."""
    ends = tiny_ends(w.params.page_size, swa_window)
    pb = ends[0].page_bytes
    pages = w.params.pool_pages + (max(1, int(w.params.pool_pages * swa_ratio)) if swa_window else 0)
    return MultiEndedAllocator(Arena(ArenaSpec(ends, arena_bytes=(1 + pages) * pb)), compaction="lazy")


def replay(alloc: MultiEndedAllocator, prep: Prepared, table: np.ndarray, swa: bool) -> None:
    """The timed loop: SGLang-scheduler-style calls, block-table gathers and scatters through persistent
    staging tensors (``out=`` keeps the output pointers stable, as a CUDA-graph engine would)."""
    take = table.take
    alloc_extend, alloc_decode, free, unbind_end = (alloc.alloc_extend, alloc.alloc_decode, alloc.free,
                                                    alloc.unbind_end)
    for o in prep.ops:
        if swa and o.ev is not None:
            take(o.ev, out=o.ev_buf, mode="clip")
            unbind_end("swa", o.ev_t)
        k = o.kind
        if k == _D:
            take(o.last_flat, out=o.last_buf, mode="clip")
            alloc_decode(o.seq_t, o.last_t, out=o.out_t)
            table[o.write_flat] = o.out_np
        elif k == _E:
            last = o.last_buf
            take(o.last_flat, out=last, mode="clip")
            if o.no_prefix is not None:
                last[o.no_prefix] = -1
            alloc_extend(o.pre_t, o.seq_t, o.last_t, out=o.out_t)
            out = o.out_np
            for a, b, c, d in o.runs:
                table[a:b] = out[c:d]
        else:
            take(o.target, out=o.target_buf, mode="clip")
            free(o.target_t)


def replay_pages(alloc: MultiEndedAllocator, prep: PreparedPages, table: np.ndarray, swa: bool) -> None:
    """The timed loop of the page-table form (see :class:`PreparedPages`): the block table is a flat numpy int64
    array (as vLLM's ``BlockTable.block_table_np``); umalloc writes new pages straight into its slots and reads
    the pages to free or unbind from them (``index=``), so the harness does no gather or scatter of its own.
    The checked pass does the gathers and scatters itself, so the two forms check each other."""
    alloc_pages, free_pages, unbind_pages = alloc.alloc_pages, alloc.free_pages, alloc.unbind_pages
    for o in prep.ops:
        if swa and o.ev is not None:
            unbind_pages("swa", table, index=o.ev)
        if o.kind == _F:
            free_pages(table, index=o.target)
        elif o.n_pages:
            alloc_pages(o.n_pages, out=table, index=o.write_flat)


def checked_replay_pages(alloc: MultiEndedAllocator, prep: PreparedPages, table: np.ndarray, swa: bool) -> dict:
    """Untimed verification pass of the page-table form: after every op the allocator's live pages equal the
    harness's, every allocation is fresh, every page freed or unbound is one the harness holds; every 97 ops
    ``check_invariants()`` and a data marker written through each live page's envelope on every end reads back;
    nothing leaks at the end."""
    live: set[int] = set()
    swa_live: set[int] = set()
    peak_full = peak_swa = 0
    marks = {end: alloc.arena.envelopes(end) for end in (("full", "swa") if swa else ("full",))}
    n_ops = len(prep.ops)
    for i, o in enumerate(prep.ops):
        if swa and o.ev is not None:
            ev = table[o.ev]
            assert set(ev.tolist()) <= swa_live, f"op {i}: unbind of a page not bound on swa"
            alloc.unbind_pages("swa", torch.from_numpy(ev))
            swa_live.difference_update(ev.tolist())
        if o.kind == _F:
            vps = table[o.target]
            assert set(vps.tolist()) <= live and len(set(vps.tolist())) == vps.size, f"op {i}: bad free"
            alloc.free_pages(torch.from_numpy(vps))
            live.difference_update(vps.tolist())
            swa_live.difference_update(vps.tolist())
        elif o.n_pages:
            out = alloc.alloc_pages(o.n_pages)
            assert out is not None, f"op {i}: allocation returned None"
            got = out.numpy()
            assert not (set(got.tolist()) & live) and len(set(got.tolist())) == got.size, f"op {i}: page reused"
            table[o.write_flat] = got
            live.update(got.tolist())
            if swa:
                swa_live.update(got.tolist())
            for end, env in marks.items():
                phys = alloc.translate_pages(out, end)
                env[phys, :8] = torch.from_numpy(got.astype("<i8").view(np.uint8).reshape(-1, 8))
        st = alloc.stats()
        assert st["full"].live_pages == len(live), (i, st["full"].live_pages, len(live))
        peak_full = max(peak_full, st["full"].live_pages)
        if swa:
            assert st["swa"].live_pages == len(swa_live), (i, st["swa"].live_pages, len(swa_live))
            peak_swa = max(peak_swa, st["swa"].live_pages)
        if i % 97 == 0 or i == n_ops - 1:
            alloc.check_invariants()
            for end, env in marks.items():
                held = sorted(live if end == "full" else swa_live)
                if held:
                    lv = torch.tensor(held, dtype=torch.int64)
                    phys = alloc.translate_pages(lv, end)
                    assert torch.equal(env[phys, :8].contiguous().view(torch.int64).view(-1), lv), \
                        f"op {i}: data marker lost on end {end}"
    st = alloc.stats()
    assert not live and all(s.live_pages == 0 and s.pending_pages == 0 for s in st.values()), "pages leaked"
    alloc.check_invariants()
    return {"peak_pages": peak_full, "swa_peak_pages": peak_swa if swa else None}


def checked_replay(alloc: MultiEndedAllocator, prep: Prepared, table: np.ndarray, swa: bool) -> dict:
    """Untimed verification pass (see the module docstring). Returns peaks."""
    ps = prep.ps
    live_v: set[int] = set()
    peak_full = peak_swa = 0
    env_full = alloc.arena.envelopes("full")
    marks = torch.zeros(alloc.num_vpages(), dtype=torch.int64)
    n_ops = len(prep.ops)

    def stamp(vps: np.ndarray) -> None:
        for end in alloc.ends:
            if end == "swa" or end == "full":
                env = alloc.arena.envelopes(end)
                phys = alloc.translate_pages(torch.from_numpy(vps), end).numpy()
                env[torch.from_numpy(phys), :8] = torch.from_numpy(vps.astype("<i8").view(np.uint8).reshape(-1, 8))

    for i, o in enumerate(prep.ops):
        if swa and o.ev is not None:
            alloc.unbind_end("swa", torch.from_numpy(table[o.ev]))
        if o.kind == _F:
            vps = np.unique(table[o.target] // ps)
            assert set(vps.tolist()) <= live_v, "free of a page the harness does not hold"
            live_v.difference_update(vps.tolist())
            alloc.free(torch.from_numpy(table[o.target]))
        else:
            if o.kind == _D:
                last = table[o.last_flat]
                out = alloc.alloc_decode(o.seq_t, torch.from_numpy(last))
            else:
                last = table[o.last_flat]
                if o.no_prefix is not None:
                    last[o.no_prefix] = -1
                out = alloc.alloc_extend(o.pre_t, o.seq_t, torch.from_numpy(last))
            assert out is not None, f"op {i}: allocation returned None"
            table[o.write_flat] = out.numpy()
            assert np.all(out.numpy() % ps == (o.write_flat % prep.width) % ps), "token not at its page offset"
            vps = np.unique(out.numpy() // ps)
            new = np.array(sorted(set(vps.tolist()) - live_v), np.int64)
            live_v.update(new.tolist())
            if new.size:
                stamp(new)
                marks[torch.from_numpy(new)] = torch.from_numpy(new)
        st = alloc.stats()
        assert st["full"].live_pages == len(live_v), (i, st["full"].live_pages, len(live_v))
        peak_full = max(peak_full, st["full"].live_pages)
        if swa:
            peak_swa = max(peak_swa, st["swa"].live_pages)
        if i % 97 == 0 or i == n_ops - 1:
            alloc.check_invariants()
            if live_v:
                lv = torch.tensor(sorted(live_v), dtype=torch.int64)
                for end in ("full", "swa") if swa else ("full",):
                    phys = alloc.translate_pages(lv, end, strict=False)
                    bound = phys > 0
                    env = alloc.arena.envelopes(end) if end == "swa" else env_full
                    got = env[phys[bound], :8].contiguous().view(torch.int64).view(-1)
                    assert torch.equal(got, lv[bound]), f"op {i}: data marker lost on end {end}"
    st = alloc.stats()
    assert not live_v and all(s.live_pages == 0 and s.pending_pages == 0 for s in st.values()), "pages leaked"
    alloc.check_invariants()
    return {"peak_pages": peak_full, "swa_peak_pages": peak_swa if swa else None}


def run_mode(mode: str, w: wl.Workload, args: argparse.Namespace) -> dict:
    swa = mode.endswith("-swa")
    pages = mode.startswith("umalloc-pages")
    window = args.swa_window if swa else None
    prep: Prepared | PreparedPages = PreparedPages(w, window) if pages else Prepared(w, window)
    timed, checked = (replay_pages, checked_replay_pages) if pages else (replay, checked_replay)
    extra: dict = {"block_table": "req_to_page (vLLM style)" if pages else "req_to_token (SGLang style)"}
    if not args.no_verify:
        table = np.zeros(prep.n_req * prep.width, np.int64)
        extra.update(checked(make_allocator(w, window, args.swa_ratio), prep, table, swa))
        extra["verified"] = True
    walls = []
    for _ in range(args.repeats):
        alloc = make_allocator(w, window, args.swa_ratio)
        table_t = torch.zeros(prep.n_req * prep.width, dtype=torch.int64)  # the block table, flat
        table = table_t.numpy()
        t0 = time.perf_counter()
        timed(alloc, prep, table, swa)
        walls.append(time.perf_counter() - t0)
        st = alloc.stats()
        assert st["full"].live_pages == 0, "pages leaked"
    med = statistics.median(walls)
    calls = prep.api_calls(swa)
    res = {
        "allocator": mode, "workload": w.fingerprint, "repeats": len(walls),
        "wall_s_median": round(med, 4), "wall_s_min": round(min(walls), 4), "wall_s_max": round(max(walls), 4),
        "req_ops_per_s": round(w.meta["req_ops"] / med), "api_calls": calls,
        "api_calls_per_s": round(calls / med), "pages_alloc_per_s": round(w.meta["pages_allocated"] / med),
        "workload_peak_pages": w.meta["peak_live_pages"],
    }
    if swa:
        res.update({"swa_window": window, "swa_unbind_calls": prep.n_unbind_calls,
                    "swa_pages_unbound": prep.unbound_pages})
    res.update(extra)
    return res


def print_table(rows: list[dict], baseline: dict | None, pages_allocated: int) -> None:
    """One row per allocator; ratios of pages allocated per second to the baseline (vLLM BlockPool measured in
    the same run), from the medians and from the fastest repeats (the latter is steadier on a busy machine)."""
    hdr = (f"{'allocator':<16} {'wall s med':>10} {'wall s min':>10} {'req-ops/s':>11} {'calls/s':>9} "
           f"{'pages/s (med)':>13} {'peak pages':>16} {'x bp (med)':>10} {'x bp (min)':>10}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        med, best = r["wall_s_median"], r["wall_s_min"]
        if baseline:
            x_med = f"{baseline['wall_s_median'] / med:.2f}"
            x_min = f"{baseline['wall_s_min'] / best:.2f}"
        else:
            x_med = x_min = "-"
        peak = r.get("peak_pages", -1)
        if r.get("swa_peak_pages"):
            peak = f"{peak} (swa {r['swa_peak_pages']})"
        print(f"{r['allocator']:<16} {med:>10.4f} {best:>10.4f} {r['req_ops_per_s']:>11,} "
              f"{r['api_calls_per_s']:>9,} {round(pages_allocated / med):>13,} {str(peak):>16} {x_med:>10} "
              f"{x_min:>10}")


def main(argv: list[str] | None = None) -> int:
    ap = pb.parser(__doc__, MODES, peers_help="also run peerbench's vLLM BlockPool on the same ops",
                   rounds_help="alternate umalloc's modes and the peers this many times (noisy hosts); the table "
                               "takes the median of the rounds' medians and the minimum of their minima")
    a = ap.parse_args(argv)
    print(pb.fair.set_threads(a.threads))
    w = wl.from_args(a)
    print(f"# umalloc bench  torch {torch.__version__}  workload {w.fingerprint}: requests={w.meta['requests']} "
          f"steps={w.meta['steps']} ops={w.meta['ops_total']} req_ops={w.meta['req_ops']} "
          f"pages_allocated={w.meta['pages_allocated']} peak_live_pages={w.meta['peak_live_pages']}")
    # warm the numba kernels (loaded from cache or compiled) outside any timing
    run_mode(MODES[1], pb.warm_up_workload(a),
             argparse.Namespace(swa_window=a.swa_window, swa_ratio=a.swa_ratio, no_verify=False, repeats=1))
    modes = pb.chosen_modes(a, MODES)
    rounds = pb.run_rounds(a, w, [(m, run_mode) for m in modes],
                           lambda ops: pb.run_peers(ops, a.peer_repeats, "blockpool", required=True),
                           ("wall_s_median", "req_ops_per_s", "api_calls_per_s", "pages_alloc_per_s"))
    rows = pb.merge_rounds(rounds)
    baseline = next((r for r in rows if r["allocator"] == "vllm-blockpool"), None)
    if baseline is not None:
        pb.print_round_ratios(rounds, lambda name: "vllm-blockpool")
    print()
    print_table(rows, baseline, w.meta["pages_allocated"])
    print(f"# {pb.fair.load()} (at the end)")
    pb.append_json(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
