"""A fuzzer over the allocator's and the lease table's public calls (hypothesis, derandomized: one fixed set of
examples per run).

Each example builds a small arena of one of several shapes and plays a sequence of calls whose arguments are
drawn from good ids (live tokens and pages, real physical pages) and bad ones (wrong dtypes and shapes, floats,
bools, negative, huge, duplicates, meta and sparse tensors, int32 and numpy forms, lists, strings). The contract
checked after every call: it either succeeds, returns ``None`` (a shortfall), or raises an
:class:`~umalloc.errors.UmallocError` -- and then ``snapshot()`` is exactly what it was before the call; in every
case ``check_invariants()`` passes. Anything else (an untyped exception, an invariant broken) fails the test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umalloc.allocator.facade import MultiEndedAllocator, snapshots_equal
from umalloc.errors import InvariantError, UmallocError
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, LayerSpec
from umalloc.testing import FakeClock


def _end(name: str, ps: int, head_dim: int, grow: Grow = Grow.UP, owner: str | None = None,
         role: EndRole = EndRole.TARGET) -> EndSpec:
    window = 4 if role is EndRole.SWA else None
    return EndSpec(name, (LayerSpec.mha(1, head_dim, window_tokens=window),), page_size=ps, grow=grow, owner=owner,
                   role=role)


SHAPES = {  # name -> (ends, arena_bytes)
    "up-down": ((_end("full", 2, 4), _end("swa", 2, 4, Grow.DOWN, "full", EndRole.SWA)), 320),
    "mixed-bytes": ((_end("full", 2, 4), _end("swa", 2, 2, Grow.DOWN, "full", EndRole.SWA)), 32 * 12),
    "up-float-down": ((_end("full", 2, 4), _end("draft", 2, 2, Grow.FLOAT, "full", EndRole.DRAFT),
                       _end("swa", 2, 4, Grow.DOWN, "full", EndRole.SWA)), 640),
    "page-size-3": ((_end("full", 3, 4), _end("swa", 3, 4, Grow.DOWN, "full", EndRole.SWA)), 48 * 10),
    "owner-only": ((_end("full", 1, 4),), 16 * 12),
}


class _World:
    def __init__(self, shape: str, compaction: str) -> None:
        ends, arena_bytes = SHAPES[shape]
        self.clock = FakeClock()  # never advanced: no lease expires behind a call's back
        self.alloc = MultiEndedAllocator(Arena(ArenaSpec(ends, arena_bytes=arena_bytes)), compaction=compaction,
                                         clock=self.clock)
        self.ps = ends[0].page_size
        self.names = [e.name for e in ends]
        self.bound = self.names[1:]
        self.leases: list = []


def _ids(draw, w: _World, kind: str):
    """An id argument: mostly good (live virtual tokens/pages), sometimes bad in one of many ways."""
    alloc = w.alloc
    live = np.flatnonzero(alloc.v2p("full").numpy() > 0)
    nv = alloc.num_vpages()
    lim = nv * (1 if kind == "pages" else w.ps)
    good = [int(v) if kind == "pages" else int(v) * w.ps + draw(st.integers(0, w.ps - 1)) for v in live]
    vals = draw(st.lists(st.one_of(st.sampled_from(good) if good else st.integers(1, lim - 1),
                                   st.integers(-3, lim + 3), st.sampled_from([0, 2**62, -(2**62)])),
                         min_size=0, max_size=5))
    form = draw(st.sampled_from(["torch", "torch", "numpy", "numpy", "int32", "np-int32", "float", "bool", "2d",
                                 "meta", "sparse", "list", "strided", "uint64", "str", "0d", "cuda-missing"]))
    arr = np.array(vals, dtype=np.int64)
    if form == "torch":
        return torch.from_numpy(arr)
    if form == "numpy":
        return arr
    if form == "int32":
        return torch.from_numpy(np.clip(arr, -(2**31), 2**31 - 1).astype(np.int32))
    if form == "np-int32":
        return np.clip(arr, -(2**31), 2**31 - 1).astype(np.int32)
    if form == "float":
        return torch.from_numpy(arr.astype(np.float64) + 0.5)
    if form == "bool":
        return torch.from_numpy(arr > 0)
    if form == "2d":
        return torch.from_numpy(arr).reshape(1, -1)
    if form == "meta":
        return torch.from_numpy(arr).to("meta")
    if form == "sparse":
        return torch.from_numpy(arr).to_sparse()
    if form == "list":
        return vals
    if form == "strided":
        return np.repeat(arr, 2)[::2]
    if form == "uint64":
        return arr.astype(np.uint64) | np.uint64(1 << 63) if arr.size else arr.astype(np.uint64)
    if form == "0d":
        return torch.tensor(vals[0] if vals else 1)
    if form == "str":
        return "1,2"
    return torch.from_numpy(arr)


def _end_name(draw, w: _World):
    return draw(st.one_of(st.sampled_from(w.names), st.sampled_from(["nope", "", 0, None])))


def _count(draw):
    return draw(st.one_of(st.integers(0, 6), st.sampled_from([-1, 2**63, 2**70, 1.5, True, "2", np.int32(2)])))


def _call(draw, w: _World):
    alloc = w.alloc
    op = draw(st.sampled_from(["alloc_pages", "alloc_pages_out", "extend", "decode", "free", "free_pages",
                               "free_pages_index", "unbind_end", "unbind_pages", "bind_end", "translate",
                               "translate_pages", "translate_out", "lease", "lease_release", "can_alloc",
                               "shortfall", "compact", "available", "runs", "pin_table"]))
    strict = draw(st.sampled_from([True, False, True, 0, "no"]))
    bind = draw(st.sampled_from([None, None, [], w.bound, iter(w.bound), "swa", ["full"], [3]]))
    if op == "alloc_pages":
        return lambda: alloc.alloc_pages(_count(draw), bind=bind)
    if op == "alloc_pages_out":
        k = draw(st.integers(0, 4))
        out = draw(st.sampled_from([np.empty(k, np.int64), torch.empty(k, dtype=torch.int64), np.empty(k, np.int32),
                                    np.empty(k + 1, np.int64), alloc.v2p("full")[:k]]))
        return lambda: alloc.alloc_pages(k, out=out)
    if op in ("extend", "decode"):
        live = alloc.v2p("full").numpy()
        B = draw(st.integers(0, 3))
        seq = draw(st.lists(st.integers(-1, 9), min_size=B, max_size=B))
        last = [-1 if draw(st.booleans()) else int(draw(st.integers(-1, live.size * w.ps))) for _ in range(B)]
        if op == "extend":
            pre = [draw(st.integers(-1, max(s, 0))) for s in seq]
            return lambda: alloc.alloc_extend(torch.tensor(pre, dtype=torch.int64), torch.tensor(seq, dtype=torch.int64),
                                              torch.tensor(last, dtype=torch.int64))
        return lambda: alloc.alloc_decode(torch.tensor(seq, dtype=torch.int64), torch.tensor(last, dtype=torch.int64))
    if op == "free":
        return lambda: alloc.free(_ids(draw, w, "tokens"))
    if op == "free_pages":
        return lambda: alloc.free_pages(_ids(draw, w, "pages"))
    if op == "free_pages_index":
        table = _ids(draw, w, "pages")
        n = len(table) if hasattr(table, "__len__") and not isinstance(table, str) and getattr(table, "ndim", 1) else 1
        idx = draw(st.lists(st.integers(-1, n + 1), max_size=3))
        index = draw(st.sampled_from([np.array(idx, np.int64), torch.tensor(idx, dtype=torch.int64),
                                      np.array(idx, np.int32), np.array(idx, np.float64)]))
        return lambda: alloc.free_pages(table, index=index)
    if op == "unbind_end":
        return lambda: alloc.unbind_end(_end_name(draw, w), _ids(draw, w, "tokens"), strict=strict)
    if op == "unbind_pages":
        return lambda: alloc.unbind_pages(_end_name(draw, w), _ids(draw, w, "pages"), strict=strict)
    if op == "bind_end":
        return lambda: alloc.bind_end(_end_name(draw, w), _ids(draw, w, "tokens"))
    if op == "translate":
        return lambda: alloc.translate(_ids(draw, w, "tokens"), _end_name(draw, w), strict=strict)
    if op == "translate_pages":
        return lambda: alloc.translate_pages(_ids(draw, w, "pages"), _end_name(draw, w), strict=strict)
    if op == "translate_out":
        ids = _ids(draw, w, "tokens")
        n = draw(st.integers(0, 5))
        out = draw(st.sampled_from([torch.full((n,), -7, dtype=torch.int64), np.full(n, -7, np.int64),
                                    alloc.v2p("full")[:n], torch.full((n,), -7, dtype=torch.int32)]))
        return lambda: alloc.translate(ids, "full", strict=strict, out=out)
    if op == "lease":
        end = _end_name(draw, w)
        phys = draw(st.sampled_from([_ids(draw, w, "pages"), [1, 1], [0], [99], [1.5], "x"]))
        deadline = draw(st.sampled_from([None, 5.0, -1.0, float("nan"), "1"]))

        def lease():
            got = alloc.lease({end: phys}, deadline_s=deadline)
            w.leases.append(got)
            return got
        return lease
    if op == "lease_release":
        return lambda: w.leases.pop(draw(st.integers(0, len(w.leases) - 1))).release() if w.leases else None
    if op in ("can_alloc", "shortfall"):
        need = {_end_name(draw, w): _count(draw)}
        f = alloc.can_alloc if op == "can_alloc" else alloc.shortfall_pages
        return lambda: f(draw(st.sampled_from([need, need, [("full", 1)], None])))
    if op == "compact":
        return lambda: alloc.compact(draw(st.sampled_from([None, *w.names, "nope"])),
                                     budget_pages=draw(st.sampled_from([None, 0, 2, -1, 1.5])))
    if op == "available":
        return lambda: alloc.available_pages(_end_name(draw, w))
    if op == "runs":
        return lambda: alloc.num_contiguous_runs(_ids(draw, w, "pages"), _end_name(draw, w))
    return lambda: alloc.lease_table.pin({_end_name(draw, w): _ids(draw, w, "pages")}, deadline_s=None)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@settings(max_examples=25, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_every_call_succeeds_or_raises_typed_and_changes_nothing(shape, data) -> None:
    w = _World(shape, data.draw(st.sampled_from(["lazy", "eager", "off"])))
    for step in range(data.draw(st.integers(5, 25))):
        call = _call(data.draw, w)
        before = w.alloc.snapshot()
        try:
            call()
        except InvariantError:
            raise
        except UmallocError:
            assert snapshots_equal(before, w.alloc.snapshot()), f"step {step}: a refused call changed the state"
        w.alloc.check_invariants()
    for lease in w.leases:
        lease.release()
    w.alloc.check_invariants()
