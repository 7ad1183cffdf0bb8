"""Hypothesis state machine over tiny arenas: random alloc_extend / alloc_decode / free / unbind_end / bind_end
(/ compact / misuse) on up+down, mixed page bytes and up+float+down geometries, every compaction mode.

After every step: ``check_invariants()``; the harness's own model of what each request holds equals the
allocator's live counts; and a data check -- every live (end, virtual page) holds, at its physical envelope, the
marker written when it was bound (so bytes follow every compaction move and float slide, and no page is handed
out twice). A ``None`` result or a misuse error must leave ``snapshot()`` unchanged.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from umalloc.allocator.facade import MultiEndedAllocator, snapshots_equal
from umalloc.errors import DoubleFreeError, InvalidIdError, NotAllocatedError
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, LayerSpec
from umalloc.pool.pagestate import TOMBSTONE

WINDOW = 3


def _geometry(kind: str, ps: int, pages: int) -> tuple[tuple[EndSpec, ...], int]:
    full = EndSpec("full", (LayerSpec.mha(1, 4),), page_size=ps)                       # 16 B per token
    swa_small = EndSpec("swa", (LayerSpec.mha(1, 2, window_tokens=WINDOW),), page_size=ps, grow=Grow.DOWN,
                        owner="full", role=EndRole.SWA)                                  # 8 B per token
    swa_same = EndSpec("swa", (LayerSpec.mha(1, 4, window_tokens=WINDOW),), page_size=ps, grow=Grow.DOWN,
                       owner="full", role=EndRole.SWA)
    draft = EndSpec("draft", (LayerSpec.mha(1, 2),), page_size=ps, grow=Grow.FLOAT, owner="full",
                    role=EndRole.DRAFT)
    pb = full.page_bytes
    if kind == "up+down":
        return (full, swa_same), pb * (pages + 1)
    if kind == "mixed-bytes":
        return (full, swa_small), pb * (pages + 1)
    return (full, draft, swa_small), pb * (pages + 1)


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(kind=st.sampled_from(["up+down", "mixed-bytes", "float"]), ps=st.sampled_from([1, 2, 4]),
                pages=st.integers(4, 16), mode=st.sampled_from(["lazy", "eager", "off"]),
                budget=st.sampled_from([None, 1, 3]))
    def setup(self, kind: str, ps: int, pages: int, mode: str, budget: int | None) -> None:
        ends, nbytes = _geometry(kind, ps, pages)
        self.alloc = MultiEndedAllocator(Arena(ArenaSpec(ends, arena_bytes=nbytes)), compaction=mode,
                                         move_budget_pages=budget)
        self.ps = ps
        self.ends = [e.name for e in ends]
        self.bound = [e for e in self.ends if e != "full"]
        self.reqs: dict[int, torch.Tensor] = {}          # request -> virtual token ids by position
        self.released: dict[int, int] = {}               # request -> swa released below this token
        self.freed: list[torch.Tensor] = []               # tokens of freed requests (for misuse)
        self.marks: dict[tuple[str, int], int] = {}       # (end, vpage) -> marker at its physical envelope
        self.counter = itertools.count(1)
        self.rid = itertools.count()

    # ---- helpers -------------------------------------------------------------------------------------------
    def _stamp(self, end: str, vpages: np.ndarray) -> None:
        if vpages.size == 0:
            return
        vals = np.array([next(self.counter) for _ in range(vpages.size)], dtype=np.int64)
        phys = self.alloc.translate_pages(torch.from_numpy(vpages), end)
        self.alloc.arena.envelopes(end)[phys, :8] = torch.from_numpy(vals).view(torch.uint8).view(-1, 8)
        for v, m in zip(vpages.tolist(), vals.tolist(), strict=True):
            assert (end, v) not in self.marks
            self.marks[(end, v)] = m

    def _new_pages(self, out: torch.Tensor, before: set[int], bind: list[str] | None) -> None:
        vps = np.unique(out.numpy() // self.ps)
        fresh = np.array([v for v in vps.tolist() if v not in before], dtype=np.int64)
        for end in ["full"] + (self.bound if bind is None else bind):
            self._stamp(end, fresh)

    def _live_vpages(self) -> set[int]:
        return {int(v) for t in self.reqs.values() for v in np.unique(t.numpy() // self.ps)}

    def _unchanged_on_none(self, snap: dict, res: object) -> None:
        if res is None:
            assert snapshots_equal(snap, self.alloc.snapshot()), "a failed allocation changed something"

    # ---- rules ---------------------------------------------------------------------------------------------
    @rule(data=st.data(), n_req=st.integers(1, 3))
    def extend(self, data, n_req: int) -> None:
        rids = data.draw(st.lists(st.sampled_from(sorted(self.reqs) + [-1, -2, -3]), min_size=n_req,
                                  max_size=n_req, unique=True))
        bind = data.draw(st.sampled_from([None, [], *[[b] for b in self.bound]]))
        pre, seq, last, keys = [], [], [], []
        for r in rids:
            t = self.reqs.get(r)
            p = 0 if t is None else int(t.numel())
            n = data.draw(st.integers(0, 6))
            if t is not None and p % self.ps and n and bind is not None:
                tail_vp = int(t[-1]) // self.ps                  # the tail page must be bound on every bind end
                if any(self.alloc.v2p(b)[tail_vp].item() == TOMBSTONE for b in bind):
                    continue
            elif t is not None and p % self.ps and n and bind is None:
                tail_vp = int(t[-1]) // self.ps
                if any(self.alloc.v2p(b)[tail_vp].item() == TOMBSTONE for b in self.bound):
                    continue
            pre.append(p)
            seq.append(p + n)
            last.append(-1 if t is None else int(t[-1]))
            keys.append(r)
        if not keys:
            return
        before = self._live_vpages()
        snap = self.alloc.snapshot()
        out = self.alloc.alloc_extend(torch.tensor(pre), torch.tensor(seq), torch.tensor(last), bind=bind)
        self._unchanged_on_none(snap, out)
        if out is None:
            return
        assert out.numel() == sum(seq) - sum(pre)
        off = 0
        for r, p, L in zip(keys, pre, seq, strict=True):
            part = out[off: off + L - p]
            off += L - p
            assert ((part % self.ps) == torch.arange(p, L) % self.ps).all(), "token not at its page offset"
            rid = next(self.rid) if r < 0 else r
            self.reqs[rid] = torch.cat([self.reqs.get(r, torch.zeros(0, dtype=torch.int64)), part])
            self.released.setdefault(rid, 0)
            if r < 0 and L == 0:
                del self.reqs[rid]
        self._new_pages(out, before, bind)

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def decode(self, data) -> None:
        rids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, max_size=4, unique=True))
        rids = [r for r in rids if self.reqs[r].numel() % self.ps == 0 or all(
            self.alloc.v2p(b)[int(self.reqs[r][-1]) // self.ps].item() != TOMBSTONE for b in self.bound)]
        if not rids:
            return
        seq = torch.tensor([self.reqs[r].numel() + 1 for r in rids])
        last = torch.tensor([int(self.reqs[r][-1]) for r in rids])
        before = self._live_vpages()
        snap = self.alloc.snapshot()
        out = self.alloc.alloc_decode(seq, last)
        self._unchanged_on_none(snap, out)
        if out is None:
            return
        for r, tok in zip(rids, out.tolist(), strict=True):
            pos = self.reqs[r].numel()
            assert tok % self.ps == pos % self.ps
            if pos % self.ps:
                assert tok == int(self.reqs[r][-1]) + 1, "decode did not continue the tail page"
            self.reqs[r] = torch.cat([self.reqs[r], torch.tensor([tok])])
        self._new_pages(out, before, None)

    @rule(data=st.data(), k=st.integers(0, 4))
    def alloc_pages(self, data, k: int) -> None:
        """Page-level allocation (vLLM style): a new request of ``k`` full pages; output to a fresh tensor, a torch
        ``out`` or a numpy ``out``."""
        how = data.draw(st.sampled_from(["new", "torch", "numpy"]))
        before = self._live_vpages()
        snap = self.alloc.snapshot()
        out = {"new": None, "torch": torch.full((k,), -7, dtype=torch.int64),
               "numpy": np.full(k, -7, dtype=np.int64)}[how]
        res = self.alloc.alloc_pages(k, out=out)
        self._unchanged_on_none(snap, res)
        if res is None:
            return
        assert res is out or how == "new"
        vps = torch.as_tensor(res)
        assert vps.numel() == k and not set(vps.tolist()) & before and len(set(vps.tolist())) == k
        if k:
            rid = next(self.rid)
            self.reqs[rid] = (vps[:, None] * self.ps + torch.arange(self.ps)).reshape(-1)
            self.released[rid] = 0
            self._new_pages(self.reqs[rid], before, None)

    def _ids(self, data, toks: torch.Tensor, pages: bool) -> torch.Tensor | np.ndarray:
        """The ids of ``toks`` as the page-level or token-level calls take them: page ids (repeated where
        tokens share a page: duplicates merge) or tokens; a torch tensor, a numpy array, or a strided numpy
        view."""
        ids = toks // self.ps if pages else toks
        form = data.draw(st.sampled_from(["torch", "numpy", "strided"]))
        if form == "torch":
            return ids
        if form == "numpy":
            return ids.numpy().copy()
        wide = np.zeros(2 * ids.numel(), np.int64)
        wide[::2] = ids.numpy()
        return wide[::2]

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def free(self, data) -> None:
        rids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, max_size=3, unique=True))
        toks = torch.cat([self.reqs.pop(r) for r in rids])
        if data.draw(st.booleans()):
            self.alloc.free_pages(self._ids(data, toks, True))
        else:
            self.alloc.free(self._ids(data, toks, False))
        self.freed.append(toks)
        for v in np.unique(toks.numpy() // self.ps).tolist():
            for end in self.ends:
                self.marks.pop((end, v), None)

    @precondition(lambda self: bool(self.reqs) and "swa" in self.ends)
    @rule(data=st.data())
    def slide_window(self, data) -> None:
        r = data.draw(st.sampled_from(sorted(self.reqs)))
        t = self.reqs[r]
        tail = self.alloc.swa_tail_start(int(t.numel()), WINDOW, 0, self.ps)
        if tail <= self.released[r]:
            return
        part = t[self.released[r]:tail]
        if data.draw(st.booleans()):
            self.alloc.unbind_pages("swa", self._ids(data, part, True), strict=False)
        else:
            self.alloc.unbind_end("swa", self._ids(data, part, False), strict=False)
        for v in np.unique(t[self.released[r]:tail].numpy() // self.ps).tolist():
            self.marks.pop(("swa", v), None)
        self.released[r] = tail

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def bind_tail(self, data) -> None:
        r = data.draw(st.sampled_from(sorted(self.reqs)))
        end = data.draw(st.sampled_from(self.bound))
        t = self.reqs[r]
        vps = np.unique(t.numpy() // self.ps)
        if end == "swa":
            vps = vps[vps >= self.alloc.swa_tail_start(int(t.numel()), WINDOW, 0, self.ps) // self.ps]
        unbound = vps[self.alloc.v2p(end).numpy()[vps] == TOMBSTONE]
        snap = self.alloc.snapshot()
        ok = self.alloc.bind_end(end, torch.from_numpy(unbound * self.ps))
        if not ok:
            assert snapshots_equal(snap, self.alloc.snapshot())
            return
        self._stamp(end, unbound)

    @rule(budget=st.sampled_from([None, 0, 1, 2]))
    def compact(self, budget: int | None) -> None:
        self.alloc.compact(budget_pages=budget)

    @precondition(lambda self: bool(self.freed))
    @rule(data=st.data())
    def misuse(self, data) -> None:
        toks = data.draw(st.sampled_from(self.freed))
        live = self._live_vpages()
        freed_vps = set(np.unique(toks.numpy() // self.ps).tolist())
        snap = self.alloc.snapshot()
        if not freed_vps & live:                          # every page of it is still free: a double free
            try:
                self.alloc.free(toks)
            except (DoubleFreeError, NotAllocatedError):
                pass
            else:
                raise AssertionError("a double free was accepted")
        if not freed_vps & live:                          # the same through the page-level call, numpy ids
            try:
                self.alloc.free_pages(np.array(sorted(freed_vps), dtype=np.int64))
            except (DoubleFreeError, NotAllocatedError):
                pass
            else:
                raise AssertionError("a double free_pages was accepted")
        for bad in (torch.tensor([self.alloc.num_vpages() * self.ps]), np.array([-1], dtype=np.int64)):
            try:
                self.alloc.free(bad)
            except InvalidIdError:
                pass
            else:
                raise AssertionError("an out-of-range free was accepted")
        try:
            self.alloc.free_pages(np.array([self.alloc.num_vpages()], dtype=np.int64))
        except InvalidIdError:
            pass
        else:
            raise AssertionError("an out-of-range free_pages was accepted")
        assert snapshots_equal(snap, self.alloc.snapshot())

    # ---- invariants ----------------------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "alloc"):
            return
        self.alloc.check_invariants()
        live = self._live_vpages()
        assert self.alloc.stats()["full"].live_pages == len(live)
        for (end, v), m in self.marks.items():
            phys = int(self.alloc.v2p(end)[v])
            assert phys > 0, f"{end} vpage {v} lost its page"
            got = int(self.alloc.arena.envelopes(end)[phys, :8].contiguous().view(torch.int64)[0])
            assert got == m, f"{end} vpage {v}: marker {got} != {m} (bytes did not follow, or page reused)"
        for end in self.ends:
            bound = np.flatnonzero(self.alloc.v2p(end).numpy()[1:] != TOMBSTONE) + 1
            assert set(bound.tolist()) == {v for (e, v) in self.marks if e == end}

    def teardown(self) -> None:
        if not hasattr(self, "alloc"):
            return
        for t in self.reqs.values():
            self.alloc.free(t)
        self.alloc.compact()
        self.alloc.check_invariants()
        for s in self.alloc.stats().values():
            assert (s.live_pages, s.hole_pages, s.pending_pages) == (0, 0, 0), s


AllocatorMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("UMALLOC_SM_EXAMPLES", 60)), stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestAllocatorMachine = AllocatorMachine.TestCase
