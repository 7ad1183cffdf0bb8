"""Hypothesis state machine over the RequestTable API (extend, decode, truncate, fork, free with and without the
cache, engine retain / release, reclaim of cached pages into a new request, eviction under pressure, compaction,
misuse) on tiny arenas (``full`` up + ``swa`` down with a small window, page sizes 1, 2, 4, 10-24 shared page
slots), against an independent Python model of who holds what. Fault classes: F07, F08, F09, F28.

The model keeps, per request, its pages by index, its length and its swa front (Note [Windows] of
:mod:`umalloc.requests.table`, recomputed here from ``swa_tail_start``'s formula), the engine's references per page,
the cached pages in LRU order, and the bytes of every page on every end (one fp32 value per token written). After
every step: ``check_invariants()``; each request's pages and length equal the model's; the allocator's live pages
of ``full`` are exactly the held, cached and zero pages, those of ``swa`` exactly the pages some request holds
there; the cache equals the model's LRU list; and every value the model knows reads back through the page's
physical address (so bytes follow copies, compaction moves and cache revivals). Copy-on-write is predicted by the
model (a shared partial last page changes, an exclusive one does not); evictions must take the model's LRU head.
"""

from __future__ import annotations

import itertools
import random

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from umalloc.allocator.facade import MultiEndedAllocator, snapshots_equal
from umalloc.errors import UmallocValueError
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, KVDtype, LayerSpec
from umalloc.requests.table import RequestTable

MT = 12          # max_tokens_per_request
R = 4            # max_requests


class _Req:
    def __init__(self, pages: list[int], length: int, front: int) -> None:
        self.pages, self.len, self.front = pages, length, front


class RequestMachine(RuleBasedStateMachine):
    @initialize(ps=st.sampled_from([1, 2, 4]), pages=st.integers(10, 24), window=st.sampled_from([2, 3, 5]),
                mode=st.sampled_from(["lazy", "eager"]), seed=st.integers(0, 2**16))
    def setup(self, ps: int, pages: int, window: int, mode: str, seed: int) -> None:
        full = EndSpec("full", (LayerSpec.mha(1, 4, dtype=KVDtype.FP32),), page_size=ps)
        swa = EndSpec("swa", (LayerSpec.mha(1, 4, dtype=KVDtype.FP32, window_tokens=window),), page_size=ps,
                      grow=Grow.DOWN, owner="full", role=EndRole.SWA)
        self.alloc = MultiEndedAllocator(Arena(ArenaSpec((full, swa), arena_bytes=full.page_bytes * (pages + 1))),
                                         compaction=mode)
        self.evicted: list[list[int]] = []
        self.table = RequestTable(self.alloc, max_requests=R, max_tokens_per_request=MT,
                                  on_evict=lambda vp: self.evicted.append(vp.tolist()))
        self.ps, self.W = ps, window
        self.rng = random.Random(seed)
        self.zero = self.table.zero_vpage
        self.reqs: dict[int, _Req] = {}
        self.eng: dict[int, int] = {}
        self.cached: list[int] = []
        self.data: dict[str, dict[int, dict[int, float]]] = {"full": {}, "swa": {}}   # end -> vpage -> off -> v
        self.counter = itertools.count(1)
        self.views = {end: self.alloc.arena.kv_views(end, 0)[0] for end in ("full", "swa")}

    # ---- model helpers ---------------------------------------------------------------------------------------
    def refs(self, vp: int) -> int:
        return sum(r.pages.count(vp) for r in self.reqs.values()) + self.eng.get(vp, 0) + (vp == self.zero)

    def held(self) -> set[int]:
        return {p for r in self.reqs.values() for p in r.pages} | {p for p, n in self.eng.items() if n} | {self.zero}

    def on_swa(self) -> set[int]:
        return {p for r in self.reqs.values() for p in r.pages[r.front:]} | {self.zero}

    def tail_page(self, length: int) -> int:
        return max(0, length - self.W) // self.ps

    def kp(self, length: int) -> int:
        return -(-length // self.ps)

    def take_evictions(self) -> set[int]:
        gone: set[int] = set()
        for batch in self.evicted:
            assert batch == self.cached[: len(batch)], f"evicted {batch}, LRU head {self.cached[:len(batch)]}"
            del self.cached[: len(batch)]
            gone.update(batch)
            for vp in batch:
                self.data["full"].pop(vp, None)
        self.evicted.clear()
        return gone

    def write(self, slot: int, positions: range, vtokens: list[int]) -> None:
        r = self.reqs[slot]
        for pos, t in zip(positions, vtokens, strict=True):
            j = pos // self.ps
            assert t // self.ps == r.pages[j] and t % self.ps == pos % self.ps, "token not at its page offset"
            for end in ("full", "swa") if j >= r.front else ("full",):
                v = float(next(self.counter))
                phys = int(self.alloc.translate(torch.tensor([t]), end)[0])
                self.views[end][phys // self.ps, phys % self.ps, 0, 0] = v
                self.data[end].setdefault(r.pages[j], {})[pos % self.ps] = v

    def forget(self, vp: int) -> None:
        for end in ("full", "swa"):
            self.data[end].pop(vp, None)

    def grow(self, slots: list[int], lens: list[int], decode: bool) -> None:
        table = self.table
        fresh_before = self.held() | set(self.cached)
        fronts = {s: self.reqs[s].front for s in slots}
        before = (self.alloc.snapshot(), table.snapshot())
        for s, e in zip(slots, lens, strict=True):             # windows advance before anything is allocated
            if e:
                r = self.reqs[s]
                r.front = max(r.front, min(self.tail_page(r.len), self.kp(r.len)))
        bound_swa = self.on_swa()
        # copy-on-write prediction, in batch order
        cow, refs = {}, {}
        for s, e in zip(slots, lens, strict=True):
            r = self.reqs[s]
            if e and r.len % self.ps:
                last = r.pages[-1]
                refs.setdefault(last, self.refs(last))
                cow[s] = refs[last] > 1
                refs[last] -= cow[s]
        out = table.decode(slots) if decode else table.extend(slots, lens)
        gone = self.take_evictions()
        fresh_before -= gone
        if out is None:   # (F29) refused, nothing changed: no window advanced, nothing evicted
            assert not gone, f"a refused extend evicted {sorted(gone)}"
            assert snapshots_equal(before[0], self.alloc.snapshot()) and snapshots_equal(before[1], table.snapshot())
            for s in slots:
                self.reqs[s].front = fronts[s]
                assert table.pages(s).tolist() == self.reqs[s].pages
            return
        out = out.tolist()
        assert len(out) == sum(lens)
        o = 0
        for s, e in zip(slots, lens, strict=True):
            r = self.reqs[s]
            got = table.pages(s).tolist()
            kp_old = len(r.pages)
            if cow.get(s):
                old, new = r.pages[-1], got[kp_old - 1]
                assert new != old and new not in fresh_before, f"copy-on-write page {new} is not fresh"
                self.data["full"][new] = dict(self.data["full"].get(old, {}))
                if old in bound_swa and kp_old - 1 >= r.front:
                    self.data["swa"][new] = dict(self.data["swa"].get(old, {}))
                fresh_before.add(new)
            else:
                assert got[:kp_old] == r.pages, "an exclusive or full page changed"
            for vp in got[kp_old:]:
                assert vp not in fresh_before, f"page {vp} handed out while held or cached"
                fresh_before.add(vp)
                self.forget(vp)
            r.pages = got
            self.write(s, range(r.len, r.len + e), out[o: o + e])
            r.len += e
            o += e

    # ---- rules -------------------------------------------------------------------------------------------
    @precondition(lambda self: len(self.reqs) < R)
    @rule(n=st.integers(1, 2))
    def new(self, n: int) -> None:
        n = min(n, R - len(self.reqs))
        slots = self.table.new_requests(n).tolist()
        assert slots == sorted(set(range(R)) - set(self.reqs))[:n], "not the lowest free slots"
        for s in slots:
            self.reqs[s] = _Req([], 0, 0)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        slots = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, max_size=3, unique=True))
        lens = [data.draw(st.integers(0, min(4, MT - self.reqs[s].len))) for s in slots]
        self.grow(slots, lens, decode=False)

    @precondition(lambda self: any(r.len < MT for r in self.reqs.values()))
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        ok = sorted(s for s, r in self.reqs.items() if r.len < MT)
        slots = data.draw(st.lists(st.sampled_from(ok), min_size=1, max_size=3, unique=True))
        self.grow(slots, [1] * len(slots), decode=True)

    @precondition(lambda self: any(r.len for r in self.reqs.values()))
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(s for s, r in self.reqs.items() if r.len)))
        r = self.reqs[s]
        n = data.draw(st.integers(0, r.len))
        self.table.truncate([s], [n])
        gone = r.pages[self.kp(n):]
        r.pages, r.len, r.front = r.pages[: self.kp(n)], n, min(r.front, self.kp(n))
        for vp in gone:
            if self.refs(vp) == 0:
                self.forget(vp)

    def fork_at(self, src: int, n: int) -> int:
        c = self.table.fork(src, n)
        assert c == min(set(range(R)) - set(self.reqs))
        r, kp = self.reqs[src], self.kp(n)
        self.reqs[c] = _Req(r.pages[:kp], n, min(kp, max(r.front, self.tail_page(n))))
        return c

    @precondition(lambda self: self.reqs and len(self.reqs) < R)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        src = data.draw(st.sampled_from(sorted(self.reqs)))
        self.fork_at(src, data.draw(st.integers(0, self.reqs[src].len)))

    @precondition(lambda self: any(0 < r.len < MT for r in self.reqs.values()) and len(self.reqs) < R)
    @rule(data=st.data())
    def fork_and_decode(self, data: st.DataObject) -> None:
        """Parallel sampling: fork a request at its length, then decode both in one batch (a shared partial page
        is copied by the first writer only)."""
        src = data.draw(st.sampled_from(sorted(s for s, r in self.reqs.items() if 0 < r.len < MT)))
        c = self.fork_at(src, self.reqs[src].len)
        self.grow(data.draw(st.permutations([src, c])), [1, 1], decode=True)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), cache=st.sampled_from([True, True, False]))
    def free(self, data: st.DataObject, cache: bool) -> None:
        self.free_model(data.draw(st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, max_size=2, unique=True)),
                        cache)

    def free_model(self, slots: list[int], cache: bool) -> None:
        self.table.free_requests(slots, cache=cache)
        for s in slots:
            r = self.reqs.pop(s)
            for j in range(len(r.pages) - 1, -1, -1):
                vp = r.pages[j]
                if self.refs(vp) == 0:
                    if cache and j < r.len // self.ps:
                        self.cached.append(vp)
                        self.data["swa"].pop(vp, None)
                    else:
                        self.forget(vp)

    @precondition(lambda self: len(self.reqs) < R)
    @rule(n=st.integers(1, MT))
    def prefill_then_cache(self, n: int) -> None:
        """A request that prefills and finishes at once, its full pages kept as cached (prefix caching)."""
        (s,) = self.table.new_requests(1).tolist()
        self.reqs[s] = _Req([], 0, 0)
        self.grow([s], [n], decode=False)
        self.free_model([s], True)

    @precondition(lambda self: any(r.pages for r in self.reqs.values()))
    @rule(data=st.data())
    def retain(self, data: st.DataObject) -> None:
        pool = sorted({p for r in self.reqs.values() for p in r.pages})
        vps = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))
        self.table.retain(vps)
        for vp in vps:
            self.eng[vp] = self.eng.get(vp, 0) + 1

    @precondition(lambda self: any(self.eng.values()))
    @rule(data=st.data(), cache=st.booleans())
    def drop_refs(self, data: st.DataObject, cache: bool) -> None:
        vps = data.draw(st.lists(st.sampled_from(sorted(p for p, n in self.eng.items() if n)), min_size=1,
                                 max_size=2, unique=True))
        self.table.drop_refs(vps, cache=cache)
        for vp in vps:
            self.eng[vp] -= 1
            if self.refs(vp) == 0:
                if cache:
                    self.cached.append(vp)
                    self.data["swa"].pop(vp, None)
                else:
                    self.forget(vp)

    @precondition(lambda self: self.cached and len(self.reqs) < R)
    @rule(data=st.data())
    def reclaim_into_new_request(self, data: st.DataObject) -> None:
        """A prefix hit on cached pages: reclaim, attach to a new request, drop the engine's references."""
        n = data.draw(st.integers(1, min(len(self.cached), MT // self.ps)))
        vps = data.draw(st.permutations(self.cached))[:n]
        table = self.table
        table.reclaim(vps)
        for vp in vps:
            self.cached.remove(vp)
            self.eng[vp] = self.eng.get(vp, 0) + 1
        (s,) = table.new_requests(1).tolist()
        front = min(n, self.tail_page(n * self.ps))
        if table.attach_prefix(s, vps):
            self.reqs[s] = _Req(list(vps), n * self.ps, front)
            for vp in vps[front:]:
                self.data["swa"][vp] = {}                       # bound fresh: bytes unknown
            table.drop_refs(vps)
            for vp in vps:
                self.eng[vp] -= 1
        else:
            table.free_requests([s])
            table.drop_refs(vps, cache=True)
            for vp in vps:
                self.eng[vp] -= 1
                self.cached.append(vp)

    @rule()
    def compact(self) -> None:
        self.alloc.compact()

    @precondition(lambda self: self.cached)
    @rule(n=st.integers(1, 3))
    def evict(self, n: int) -> None:
        got = self.table.evict(n)
        assert got == min(n, len(self.cached))
        self.take_evictions()

    @rule(which=st.integers(0, 5))
    def misuse(self, which: int) -> None:
        table = self.table
        free_slots = sorted(set(range(R)) - set(self.reqs))
        calls = [
            lambda: table.extend([R], [1]),
            lambda: table.free_requests([free_slots[0]]) if free_slots else table.evict(-1),
            lambda: table.truncate([next(iter(self.reqs))], [MT + 1]) if self.reqs else table.retain([0]),
            lambda: table.drop_refs([self.zero]),
            lambda: table.extend([next(iter(self.reqs))] * 2, [1, 1]) if self.reqs else table.decode([-1]),
            lambda: table.fork(next(iter(self.reqs)), MT + 1) if self.reqs else table.num_tokens([R]),
        ]
        before = table.snapshot()
        try:
            calls[which]()
        except UmallocValueError:
            pass
        else:
            raise AssertionError(f"misuse {which} accepted")
        assert snapshots_equal(before, table.snapshot())

    # ---- checks after every step ---------------------------------------------------------------------------
    @invariant()
    def agrees_with_the_model(self) -> None:
        if not hasattr(self, "table"):
            return
        table, alloc = self.table, self.alloc
        table.check_invariants()
        for s, r in self.reqs.items():
            assert table.pages(s).tolist() == r.pages and int(table.num_tokens([s])[0]) == r.len
        live_full = set((alloc.ends["full"].v2p >= 0).nonzero()[0].tolist()) - {0}
        assert live_full == self.held() | set(self.cached), (sorted(live_full), sorted(self.held()), self.cached)
        live_swa = set((alloc.ends["swa"].v2p >= 0).nonzero()[0].tolist()) - {0}
        assert live_swa == self.on_swa()
        assert table.cached_pages().tolist() == self.cached
        stats = table.stats()
        assert stats.engine_refs == sum(self.eng.values())
        assert stats.shared_pages == sum(1 for p in self.held() if self.refs(p) > 1)
        live = {"full": self.held() | set(self.cached), "swa": self.on_swa()}
        for end, pages in self.data.items():
            toks, want = [], []
            for vp, offs in pages.items():
                if vp not in live[end]:
                    continue
                for off, v in offs.items():
                    toks.append(vp * self.ps + off)
                    want.append(v)
            if toks:
                phys = alloc.translate(torch.tensor(toks), end)
                got = self.views[end][phys // self.ps, phys % self.ps, 0, 0]
                assert got.tolist() == want, f"bytes lost on {end}"


RequestMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.filter_too_much])
TestRequestMachine = RequestMachine.TestCase
