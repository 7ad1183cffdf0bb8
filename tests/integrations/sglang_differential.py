"""Differential runs: each umalloc-backed SGLang allocator class and SGLang's own class, driven by the same seeded
op sequences, compared after every op. Needs SGLang (the peer venv of scripts/peer_suite_sglang.sh).

    python tests/integrations/sglang_differential.py [--sequences N] [--ops M] [--seed S] [--classes token,paged]

prints one line per class and page size, ``<class> page_size=<ps>: N sequences identical, 0 differ``, and exits 1
if any sequence differs (the first difference of each is printed).

What is compared after every op (the equivalence):

* **refusals**: an allocating call returns ``None`` on one side iff on the other, else the same number of ids;
* **available sizes**: ``available_size()`` (and per pool where the class has several) are equal;
* **layout up to a relabelling of physical pages**: over every live token of every request, the pair (SGLang
  page, umalloc page) defines a bijection, and each token sits at the same offset in its page on both sides
  (``token % page_size``). So both sides agree on which tokens share a page and where a page boundary falls; only
  the page numbers differ (umalloc hands out the lowest free page, SGLang its free list front);
* umalloc's own invariants (``check_invariants``: its tables, and virtual = physical slot ids).

The op sequence is drawn from the logical state (which requests hold how many tokens), which is the same on both
sides as long as they agree, so one RNG drives both.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import umalloc.integrations.sglang as um_sglang

HERE = os.path.dirname(os.path.abspath(__file__))


def sglang_module(name: str) -> Any:
    """Import an SGLang module after the CPU shims (tests/peer/sglang_cpu_shims.py); SGLang is imported only here,
    so this file imports (pytest's doctest collection) without it."""
    import importlib

    if os.path.join(HERE, "..", "peer") not in sys.path:
        sys.path.insert(0, os.path.join(HERE, "..", "peer"))
    import sglang_cpu_shims

    sglang_cpu_shims.prepare()
    return importlib.import_module(name)


PAGE_SIZES = (1, 16, 64)


class Differ(AssertionError):
    """The two sides disagree (message: where and how)."""


@dataclass
class Side:
    """One allocator and the token rows its requests hold (request id -> int64 slot ids, position order)."""

    name: str
    alloc: Any
    rows: dict[int, torch.Tensor] = field(default_factory=dict)


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


def check_relabelling(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor], page_size: int, what: str) -> None:
    """Raise :class:`Differ` unless ``b``'s layout is ``a``'s under a bijection of pages (same offsets)."""
    if a.keys() != b.keys():
        raise Differ(f"{what}: live requests {sorted(a)} vs {sorted(b)}")
    pa, pb = [], []
    for rid, ta in a.items():
        tb = b[rid]
        if ta.numel() != tb.numel():
            raise Differ(f"{what}: request {rid} holds {ta.numel()} vs {tb.numel()} tokens")
        if ta.numel() == 0:
            continue
        if not torch.equal(ta % page_size, tb % page_size):
            raise Differ(f"{what}: request {rid}: page offsets differ")
        pa.append(ta // page_size)
        pb.append(tb // page_size)
    if not pa:
        return
    pairs = torch.unique(torch.stack([torch.cat(pa), torch.cat(pb)], 1), dim=0)
    for col, side in ((0, "SGLang"), (1, "umalloc")):
        if torch.unique(pairs[:, col]).numel() != pairs.shape[0]:
            raise Differ(f"{what}: not a bijection of pages: an {side} page maps to two pages on the other side")
    if (pairs[:, 1] < 1).any():
        raise Differ(f"{what}: umalloc handed out page 0")


class Scenario:
    """One seeded sequence against one pair of allocators (subclasses: the op set of one class)."""

    kind = ""

    def __init__(self, seed: int, page_size: int, n_ops: int) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.page_size = page_size
        self.n_ops = n_ops
        self.need_sort = self.rng.random() < 0.5
        self.sides = self.build()
        self.next_rid = 0
        self.stats: collections.Counter[str] = collections.Counter()
        self.lens: dict[int, int] = {}
        self.grouped = False

    def build(self) -> tuple[Side, Side]:
        raise NotImplementedError

    @property
    def ops(self) -> list[Callable[[], None]]:
        raise NotImplementedError

    # ---- shared helpers -----------------------------------------------------------------------------------
    def both(self, call: Callable[[Side], Any], what: str) -> list[Any]:
        out = [call(s) for s in self.sides]
        a, b = out
        self.stats["allocs"] += 1
        self.stats["refused"] += a is None
        if (a is None) != (b is None):
            raise Differ(f"{what}: refused by {'SGLang' if a is None else 'umalloc'} only")
        if a is not None and isinstance(a, torch.Tensor) and a.numel() != b.numel():
            raise Differ(f"{what}: {a.numel()} vs {b.numel()} ids")
        return out

    def live(self, min_len: int = 1) -> list[int]:
        return [r for r, n in self.lens.items() if n >= min_len]

    def new_rid(self) -> int:
        self.next_rid += 1
        return self.next_rid

    def compare(self, what: str) -> None:
        sg, um = self.sides
        if sg.alloc.available_size() != um.alloc.available_size():
            raise Differ(f"{what}: available_size {sg.alloc.available_size()} vs {um.alloc.available_size()}")
        check_relabelling(sg.rows, um.rows, self.page_size, what)
        um.alloc.check_invariants()

    def run(self) -> None:
        for i in range(self.n_ops):
            op = self.rng.choice(self.ops)
            what = f"seed {self.seed} op {i} {op.__name__}"
            op()
            self.compare(what)
        self.teardown()
        self.compare(f"seed {self.seed} teardown")

    def teardown(self) -> None:
        """Free every live request (in one group), then everything must be free on both sides."""
        self.free_requests(list(self.lens), grouped=True)
        sg, um = self.sides
        if um.alloc.available_size() != sg.alloc.available_size():
            raise Differ(f"seed {self.seed} teardown: available {sg.alloc.available_size()} vs "
                         f"{um.alloc.available_size()}")

    # ---- frees (token and paged) ----------------------------------------------------------------------------
    def free_requests(self, rids: list[int], grouped: bool) -> None:
        how = {rid: self.rng.choice(self.free_forms) for rid in rids}
        self.free_rows(rids, grouped, lambda side, rid: how[rid](side, side.rows[rid], 0))

    def free_rows(self, rids: list[int], grouped: bool, free_one: Callable[[Side, int], None]) -> None:
        """``free_one(side, rid)`` for every request of ``rids`` on each side in turn (inside a free group if
        ``grouped``); then the requests are gone."""
        self.stats["free groups"] += grouped
        for side in self.sides:
            if grouped:
                side.alloc.free_group_begin()
            for rid in rids:
                free_one(side, rid)
            if grouped:
                side.alloc.free_group_end()
        for side in self.sides:
            for rid in rids:
                del side.rows[rid]
        for rid in rids:
            del self.lens[rid]

    @staticmethod
    def _free_plain(side: Side, row: torch.Tensor, start: int) -> None:
        side.alloc.free(row)

    def _free_pages(self, side: Side, row: torch.Tensor, start: int) -> None:
        side.alloc.free_page_ids(torch.unique(row // self.page_size))

    @staticmethod
    def _free_segment(side: Side, row: torch.Tensor, start: int) -> None:
        side.alloc.free_segment(row, start_pos=start)

    @property
    def free_forms(self) -> list[Callable[[Side, torch.Tensor, int], None]]:
        return [self._free_plain, self._free_pages, self._free_segment]

    def op_free(self) -> None:
        live = list(self.lens)
        if not live:
            return
        rids = self.rng.sample(live, self.rng.randint(1, min(3, len(live))))
        self.free_requests(rids, grouped=self.rng.random() < 0.5)

    def op_truncate(self) -> None:
        """Free a page-aligned tail of one request (SGLang's kv-row segment free)."""
        ps = self.page_size
        cands = [r for r, n in self.lens.items() if n > ps]
        if not cands:
            return
        rid = self.rng.choice(cands)
        n = self.lens[rid]
        start = ps * self.rng.randint(1, (n - 1) // ps)
        form = self.rng.choice(self.free_forms)
        grouped = self.rng.random() < 0.3
        for side in self.sides:
            if grouped:
                side.alloc.free_group_begin()
            form(side, side.rows[rid][start:], start)
            if grouped:
                side.alloc.free_group_end()
            side.rows[rid] = side.rows[rid][:start]
        self.lens[rid] = start


class TokenScenario(Scenario):
    """``TokenToKVPoolAllocator`` (page size 1): alloc(n) into new or existing requests, frees, truncation."""

    kind = "token"

    def build(self) -> tuple[Side, Side]:
        self.size = self.rng.randint(24, 96)
        args = (self.size, torch.bfloat16, "cpu", None, self.need_sort)
        stock = sglang_module("sglang.srt.mem_cache.allocator.token").TokenToKVPoolAllocator
        return (Side("SGLang", stock(*args)),
                Side("umalloc", um_sglang.UmallocTokenToKVPoolAllocator(*args)))

    @property
    def ops(self) -> list[Callable[[], None]]:
        return [self.op_alloc, self.op_alloc, self.op_alloc, self.op_free, self.op_truncate]

    def op_alloc(self) -> None:
        n = self.rng.randint(0, self.size // 3)
        live = list(self.lens)
        rid = self.rng.choice(live) if live and self.rng.random() < 0.5 else None
        got = self.both(lambda s: s.alloc.alloc(n), f"alloc({n})")
        if got[0] is None or n == 0:
            return
        if rid is None:
            rid = self.new_rid()
            self.lens[rid] = 0
            for s in self.sides:
                s.rows[rid] = _empty()
        for s, t in zip(self.sides, got, strict=True):
            s.rows[rid] = torch.cat([s.rows[rid], t.to(torch.int64)])
        self.lens[rid] += n


class PagedScenario(Scenario):
    """``PagedTokenToKVPoolAllocator``: batched alloc_extend (new and continuing requests), alloc_decode (not at
    page size 1, where SGLang's paged decode is not a supported configuration), page-aligned alloc, frees in and
    out of groups, kv-row segment frees."""

    kind = "paged"

    def build(self) -> tuple[Side, Side]:
        self.num_pages = self.rng.randint(12, 40)
        size = self.num_pages * self.page_size
        args = (size, self.page_size, torch.bfloat16, "cpu", None, self.need_sort)
        stock = sglang_module("sglang.srt.mem_cache.allocator.paged").PagedTokenToKVPoolAllocator
        return (Side("SGLang", stock(*args)),
                Side("umalloc", um_sglang.UmallocPagedTokenToKVPoolAllocator(*args)))

    @property
    def ops(self) -> list[Callable[[], None]]:
        ops = [self.op_extend, self.op_extend, self.op_alloc, self.op_free, self.op_truncate]
        if self.page_size > 1:
            ops += [self.op_decode, self.op_decode, self.op_decode]
        return ops

    def call_extend(self, side: Side, prefix: torch.Tensor, seq: torch.Tensor, last: torch.Tensor,
                    total: int) -> Any:
        return side.alloc.alloc_extend(prefix, prefix, seq, seq, last, total)

    def call_decode(self, side: Side, seq: torch.Tensor, last: torch.Tensor) -> Any:
        return side.alloc.alloc_decode(seq, seq, last)

    def _last_locs(self, side: Side, rids: list[int]) -> torch.Tensor:
        return torch.tensor([int(side.rows[r][-1]) if self.lens.get(r, 0) else -1 for r in rids],
                            dtype=torch.int64)

    def _append(self, rids: list[int], adds: list[int], got: list[torch.Tensor]) -> None:
        for s, t in zip(self.sides, got, strict=True):
            for rid, piece in zip(rids, torch.split(t.to(torch.int64), adds), strict=True):
                s.rows[rid] = torch.cat([s.rows.get(rid, _empty()), piece])
        for rid, k in zip(rids, adds, strict=True):
            self.lens[rid] = self.lens.get(rid, 0) + k

    def op_extend(self) -> None:
        ps = self.page_size
        live = list(self.lens)
        rids: list[int] = []
        for _ in range(self.rng.randint(1, 3)):
            cont = [r for r in live if r not in rids]
            if cont and self.rng.random() < 0.5:
                rids.append(self.rng.choice(cont))
            else:
                rids.append(self.new_rid())
        prefix = [self.lens.get(r, 0) for r in rids]
        adds = [self.rng.randint(1, 3 * ps + 2) for _ in rids]
        pt = torch.tensor(prefix, dtype=torch.int64)
        st = pt + torch.tensor(adds, dtype=torch.int64)
        got = self.both(lambda s: self.call_extend(s, pt, st, self._last_locs(s, rids), sum(adds)),
                        f"alloc_extend(prefix={prefix}, adds={adds})")
        if got[0] is not None:
            self._append(rids, adds, got)

    def op_decode(self) -> None:
        live = self.live()
        if not live:
            return
        self.decode(self.rng.sample(live, self.rng.randint(1, min(8, len(live)))))

    def decode(self, rids: list[int]) -> None:
        st = torch.tensor([self.lens[r] + 1 for r in rids], dtype=torch.int64)
        got = self.both(lambda s: self.call_decode(s, st, self._last_locs(s, rids)), f"alloc_decode({st.tolist()})")
        if got[0] is not None:
            self._append(rids, [1] * len(rids), got)

    def op_alloc(self) -> None:
        ps = self.page_size
        n = ps * self.rng.randint(0, 4) + (self.rng.randint(0, ps - 1) if self.rng.random() < 0.3 else 0)
        got = self.both(lambda s: s.alloc.alloc(n), f"alloc({n})")
        if got[0] is None or got[0].numel() == 0:
            return
        rid = self.new_rid()
        self._append([rid], [got[0].numel()], got)


def fake_swa_kv() -> Any:
    """A ``BaseSWAKVPool`` without KV buffers for SGLang's SWA allocator (it asserts the type): it stores the
    registered full -> swa mapping and translates through it; nothing else of a KV pool is used by allocators."""
    base = sglang_module("sglang.srt.mem_cache.base_swa_memory_pool").BaseSWAKVPool

    class FakeSWAKV(base):  # type: ignore[misc, valid-type]
        full_kv_pool = None
        swa_kv_pool = None
        swa_req_ring_size = None

        def __init__(self) -> None:  # no KVCache.__init__: no buffers
            self.full_to_swa_index_mapping: torch.Tensor | None = None

        def register_mapping(self, mapping: torch.Tensor) -> None:
            self.full_to_swa_index_mapping = mapping

        def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
            assert self.full_to_swa_index_mapping is not None
            return self.full_to_swa_index_mapping[kv_indices]

    FakeSWAKV.__abstractmethods__ = frozenset()
    return FakeSWAKV()


# ---- the SWA classes' shared ops (SWAScenario and sglang_unified_differential.UnifiedScenario) ----------------
# ``sc`` is such a scenario: ``sides``, ``rng``, ``page_size``, ``lens``, ``stats``, its ``window`` and
# ``evicted`` (request -> tokens of its head whose SWA pages are freed).
def swa_evict(sc: Any) -> None:
    """Free the SWA pages wholly before ``seq_len - window`` of some requests on both sides
    (``free_swa_segment``, SGLang's ``free_swa_out_of_window_slots`` rule without prefix sharing)."""
    ps = sc.page_size
    for rid in list(sc.lens):
        n, done = sc.lens[rid], sc.evicted.get(rid, 0)
        tail = max(0, n - sc.window) // ps * ps
        if tail <= done or sc.rng.random() < 0.3:
            continue
        for side in sc.sides:
            side.alloc.free_swa_segment(side.rows[rid][done:tail], start_pos=done)
        sc.evicted[rid] = tail
        sc.stats["swa pages evicted"] += (tail - done) // ps


def swa_free_requests(sc: Any, rids: list[int], grouped: bool, use_free: Callable[[int, int], bool]) -> None:
    """Free ``rids`` on both sides (:meth:`Scenario.free_rows`): ``free_full_segment`` for the evicted head, then
    ``free`` where ``use_free(rid, evicted tokens)`` (asked per side, per request, in that order), else
    ``free_segment`` for the rest."""

    def free_one(side: Side, rid: int) -> None:
        row, done = side.rows[rid], sc.evicted.get(rid, 0)
        if done:
            side.alloc.free_full_segment(row[:done], start_pos=0)
        if use_free(rid, done):
            side.alloc.free(row[done:])
        else:
            side.alloc.free_segment(row[done:], start_pos=done)

    sc.free_rows(rids, grouped, free_one)
    for rid in rids:
        sc.evicted.pop(rid, None)


def swa_truncate(sc: Any) -> None:
    """Cut one request at a page boundary on both sides (``free_segment``). The cut stays past the evicted
    head: the last token keeps its SWA peer, as in every SGLang state."""
    ps = sc.page_size
    cands = [r for r, n in sc.lens.items() if n > max(ps, sc.evicted.get(r, 0) + ps)]
    if not cands:
        return
    rid = sc.rng.choice(cands)
    n, lo = sc.lens[rid], max(ps, sc.evicted.get(rid, 0) + ps)
    start = ps * sc.rng.randint(lo // ps, (n - 1) // ps)
    for side in sc.sides:
        side.alloc.free_segment(side.rows[rid][start:], start_pos=start)
        side.rows[rid] = side.rows[rid][:start]
    sc.lens[rid] = start


class SWAScenario(PagedScenario):
    """``SWATokenToKVPoolAllocator``: as the paged scenario on both pools (page size 1: alloc instead of
    extend/decode, SGLang's rule), plus SWA eviction of out-of-window pages (``free_swa_segment``, SGLang's
    ``free_swa_out_of_window_slots`` rule without prefix sharing: pages wholly before ``seq_len - window``), and
    split frees (``free_full_segment`` for the evicted head, ``free``/``free_segment`` for the rest). A decode is
    issued only where both pools agree on fitting it: SGLang runs both pools' decode and keeps the side that
    succeeded when the other refuses (docs/engines.md, "SGLang"), umalloc refuses atomically."""

    kind = "swa"

    def build(self) -> tuple[Side, Side]:
        ps = self.page_size
        self.num_pages = self.rng.randint(12, 40)
        self.swa_pages = self.rng.randint(6, self.num_pages)
        self.window = self.rng.randint(1, 3 * ps + 4)
        self.evicted: dict[int, int] = {}
        args = (self.num_pages * ps, self.swa_pages * ps, ps, torch.bfloat16, "cpu")
        stock = sglang_module("sglang.srt.mem_cache.allocator.swa").SWATokenToKVPoolAllocator
        return (Side("SGLang", stock(*args, fake_swa_kv(), self.need_sort)),
                Side("umalloc", um_sglang.UmallocSWATokenToKVPoolAllocator(*args, fake_swa_kv(), self.need_sort)))

    @property
    def ops(self) -> list[Callable[[], None]]:
        if self.page_size == 1:
            return [self.op_alloc, self.op_alloc, self.op_free, self.op_truncate, self.op_evict, self.op_evict]
        return [self.op_extend, self.op_extend, self.op_decode, self.op_decode, self.op_decode, self.op_free,
                self.op_truncate, self.op_evict, self.op_evict]

    def op_decode(self) -> None:
        ps = self.page_size
        live = self.live()
        if not live:
            return
        rids = self.rng.sample(live, self.rng.randint(1, min(8, len(live))))
        need = sum(1 for r in rids if self.lens[r] % ps == 0)
        sg = self.sides[0].alloc
        fits = [need <= sg.full_available_size() // ps, need <= sg.swa_available_size() // ps]
        if fits[0] != fits[1]:
            return
        self.decode(rids)

    def op_evict(self) -> None:
        swa_evict(self)

    def free_requests(self, rids: list[int], grouped: bool) -> None:
        # drawn per side: one side may free with ``free`` where the other uses ``free_segment``
        swa_free_requests(self, rids, grouped, lambda rid, done: self.rng.random() < 0.5
                          and (done == 0 or self.page_size > 1))

    def op_truncate(self) -> None:
        swa_truncate(self)

    def compare(self, what: str) -> None:
        super().compare(what)
        sg, um = self.sides
        for name in ("full_available_size", "swa_available_size"):
            a, b = getattr(sg.alloc, name)(), getattr(um.alloc, name)()
            if a != b:
                raise Differ(f"{what}: {name} {a} vs {b}")
        swa_rows = []
        for side in self.sides:
            rows = {}
            for rid, row in side.rows.items():
                done = self.evicted.get(rid, 0)
                peers = side.alloc.translate_loc_from_full_to_swa(row)
                if bool((peers[:done] != 0).any()) or bool((peers[done:] <= 0).any()):
                    raise Differ(f"{what}: {side.name}: request {rid}: SWA peers not exactly the window tail")
                rows[rid] = peers[done:]
            swa_rows.append(rows)
        check_relabelling(swa_rows[0], swa_rows[1], self.page_size, f"{what} (SWA pool)")


SCENARIOS: dict[str, type[Scenario]] = {"token": TokenScenario, "paged": PagedScenario, "swa": SWAScenario}
#: page sizes each class runs at (SGLang's token allocator has no page size: it is page size 1)
CLASS_PAGE_SIZES: dict[str, tuple[int, ...]] = {"token": (1,), "paged": PAGE_SIZES, "swa": PAGE_SIZES,
                                                "unified": PAGE_SIZES}


def scenario_class(kind: str) -> type[Scenario]:
    """The scenario of ``kind``; ``"unified"`` lives in sglang_unified_differential.py (imported on first use)."""
    if kind == "unified" and kind not in SCENARIOS:
        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        from sglang_unified_differential import UnifiedScenario

        SCENARIOS[kind] = UnifiedScenario
    return SCENARIOS[kind]


def run_class(kind: str, page_size: int, sequences: int, n_ops: int, seed: int,
              stats: collections.Counter[str] | None = None) -> tuple[int, list[str]]:
    """Run ``sequences`` seeded sequences; returns (identical count, first difference of each differing one).
    ``stats`` (if given) adds up what the sequences exercised (allocating calls, refusals, groups, evictions)."""
    same, diffs = 0, []
    for k in range(sequences):
        s = seed * 1_000_003 + k
        scenario = scenario_class(kind)(s, page_size, n_ops)
        try:
            scenario.run()
            same += 1
        except Differ as exc:
            diffs.append(str(exc))
        if stats is not None:
            stats.update(scenario.stats)
    return same, diffs


def describe(stats: collections.Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(stats.items()))


def main(argv: list[str] | None = None) -> int:
    sys.modules.setdefault("sglang_differential", sys.modules[__name__])  # one copy when run as a script
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=30)
    p.add_argument("--ops", type=int, default=50)
    p.add_argument("--seed", type=int, default=int(os.environ.get("UMALLOC_SEED", "25")))
    p.add_argument("--classes", default=",".join(CLASS_PAGE_SIZES))
    args = p.parse_args(argv)
    print(f"seed={args.seed} (override with --seed or UMALLOC_SEED); {args.sequences} sequences x {args.ops} ops")
    failed = False
    for kind in args.classes.split(","):
        for ps in CLASS_PAGE_SIZES[kind]:
            t0 = time.perf_counter()
            stats: collections.Counter[str] = collections.Counter()
            same, diffs = run_class(kind, ps, args.sequences, args.ops, args.seed, stats)
            print(f"{kind} page_size={ps}: {same} sequences identical, {len(diffs)} differ "
                  f"({describe(stats)}; {time.perf_counter() - t0:.1f} s)")
            for d in diffs[:3]:
                print(f"  first difference: {d}")
            failed |= bool(diffs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
