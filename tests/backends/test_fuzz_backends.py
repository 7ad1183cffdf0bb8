"""Fuzzing the backends' public calls with bad inputs (hypothesis, local backend).

One world per module: backend ``a`` (the caller under test) with its source arena registered, connected to ``b``
(the real peer, its destination arena registered) and ``c`` (a peer of the same geometry over another arena), plus
real plans in every bad state (finished, lease past its deadline, built for another peer) and handles of every kind
(forgotten, another backend's). Each example draws a few calls with at least one bad argument each; every call must
raise a :mod:`umalloc.errors` type (not AttributeError, KeyError, TypeError, ...), and afterwards nothing may have
changed: no handle made or left open, no registration, peer, layout or counter changed, no destination byte
written, every ``check_invariants`` passing. The expected state is the snapshot taken before the call, not anything
the backend computes.
"""

from __future__ import annotations

import json
import os
import re
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.backends import get_backend
from umalloc.errors import UmallocError
from umalloc.geometry.arena import Arena
from umalloc.geometry.region import Region
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, LayerSpec
from umalloc.testing import FakeClock, seed_from_env
from umalloc.transfer import PeerLayout, build_plan

SEED = seed_from_env(20240607)
EXAMPLES = int(os.environ.get("UMALLOC_FUZZ_EXAMPLES", "1000"))

pytestmark = pytest.mark.timeout(600)  # a hang guard: a loaded machine may take minutes



def spec() -> ArenaSpec:
    full = EndSpec("full", (LayerSpec.mha(1, 8),), page_size=4)
    swa = EndSpec("swa", (LayerSpec.mha(1, 4, window_tokens=8),), page_size=4, grow=Grow.DOWN, owner="full",
                  role=EndRole.SWA)
    return ArenaSpec((full, swa), arena_bytes=8192)


def request(alloc: MultiEndedAllocator, tokens: int = 13) -> torch.Tensor:
    one = lambda x: torch.tensor([x], dtype=torch.int64)  # noqa: E731
    return alloc.alloc_extend(one(0), one(tokens), one(-1))


@pytest.fixture(scope="module")
def world():
    print(f"UMALLOC_SEED={SEED}")
    clock = FakeClock()
    arenas = {k: Arena(spec()) for k in "abc"}
    g = torch.Generator().manual_seed(SEED)
    arenas["a"].data.copy_(torch.randint(0, 256, (spec().arena_bytes,), generator=g, dtype=torch.uint8))
    allocs = {k: MultiEndedAllocator(arenas[k], clock=clock) for k in "ab"}
    backends = {k: get_backend("local", layout=PeerLayout.from_arena(arenas[k])) for k in "abc"}
    for k in "abc":
        backends[k].register(arenas[k].regions())
    a, b, c = backends["a"], backends["b"], backends["c"]
    peer_b, peer_c = a.connect(b.metadata()), a.connect(c.metadata())
    src, dst = arenas["a"].base_ptr, arenas["b"].base_ptr

    def plan(rid: str, **kw):
        return build_plan(rid, allocs["a"], request(allocs["a"]), allocs["b"], request(allocs["b"]), **kw)

    finished = plan("finished")
    finished.abort()
    expired = plan("expired", deadline_s=1.0)
    for_b = plan("for-b")  # pending and valid for b: submitted only to the wrong peer
    h_a = a.write_descriptors(np.array([[src, dst, 64]], np.uint64), peer_b)
    a.forget(h_a)
    h_b = b.write_descriptors(np.array([[dst, dst + 64, 64]], np.uint64), b.connect(b.metadata()))
    clock.now = 5.0  # ``expired`` is past its deadline from here on (no allocator call is made below)
    good_md = json.loads(b.metadata())
    yield {"a": a, "b": b, "c": c, "peers": [peer_b, peer_c], "peer_b": peer_b, "peer_c": peer_c,
           "arenas": arenas, "src": src, "dst": dst, "finished": finished, "expired": expired, "for_b": for_b,
           "h_a": h_a, "h_b": h_b, "md": good_md, "registered": arenas["a"].regions()[0]}
    for p in (expired, for_b):
        p.abort()
    b.forget(h_b)
    for x in backends.values():
        x.close()


# ---- strategies of bad arguments ------------------------------------------------------------------------------

_DEVICE_OK = re.compile(r"cpu|cuda(:\d+)?")
json_junk = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=4),
                      st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                                 max_size=2))
not_str = json_junk.filter(lambda v: not isinstance(v, str))
bad_timeouts = st.one_of(st.sampled_from([0, -1, 0.0, float("nan"), float("inf"), -float("inf"), True, False]),
                         st.floats(max_value=0.0), st.text(max_size=2), st.none())
bad_item_bytes = st.one_of(st.sampled_from([True, False, 0, -1, 1.5, "64"]), st.integers(max_value=0))


def bad_regions(w):
    host = w["registered"]
    devices = st.text(max_size=8).filter(lambda d: _DEVICE_OK.fullmatch(d) is None)
    one_bad = st.one_of(
        devices.map(lambda dev: Region(host.base_ptr, 64, dev)),  # no such device ("meta" among them)
        st.just(Region(host.base_ptr, 64, "meta")),
        st.integers(1, 1 << 20).map(lambda n: Region(0, n)),  # null pointer
        st.just(Region(host.base_ptr, 64, "cuda:0", "VRAM")),  # the local backend copies host memory only
        json_junk,  # not a Region at all
    )
    return st.one_of(
        st.lists(one_bad, min_size=1, max_size=3).flatmap(
            lambda bad: st.permutations([*bad, host])),  # a good region beside bad ones: the whole call refused
        st.sampled_from([None, 5, 1.5]),
    )


def bad_descriptors(w):
    src, dst = w["src"], w["dst"]
    n = spec().arena_bytes
    row = st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), st.integers(1, n))
    inside = st.lists(row, min_size=1, max_size=4).map(
        lambda rows: np.array([[src + s, dst + d, k] for s, d, k in rows], np.uint64))
    # out of bounds: one row's range leaves its region (too long, or moved past the end on either side)
    oob = inside.flatmap(lambda d: st.tuples(st.just(d), st.integers(0, len(d) - 1), st.sampled_from([0, 1, 2]))).map(
        lambda t: _push_out(*t, n))
    return st.one_of(
        oob,
        inside.map(lambda d: d.astype(np.float64)),
        inside.map(lambda d: d[:, :2]),
        inside.map(lambda d: d.reshape(-1)),
        inside.map(lambda d: d.tolist()),
        inside.map(lambda d: np.concatenate([d, [[src, dst, 0]]]).astype(np.uint64)),  # nbytes 0
        inside.map(lambda d: np.concatenate([d.astype(np.int64), [[-1, dst, 1]]])),  # negative
        json_junk,
    )


def _push_out(d: np.ndarray, row: int, col: int, n: int) -> np.ndarray:
    """``d`` with row ``row`` out of its region: ``col`` 2 makes it longer than any region, 0/1 moves that side's
    address past the end of its region."""
    d = d.copy()
    if col == 2:
        d[row, 2] = np.uint64(n + 1)
    else:
        d[row, col] += np.uint64(n)
    return d


def bad_metadata(w):
    good = w["md"]

    def drop(key):
        return {k: v for k, v in good.items() if k != key}

    mutations = st.one_of(
        st.sampled_from(sorted(good)).map(drop),
        not_str.map(lambda v: {**good, "backend": v}),
        st.sampled_from(["nixl", "mooncake", "", "LOCAL"]).map(lambda v: {**good, "backend": v}),
        st.one_of(not_str, st.just("")).map(lambda v: {**good, "peer_id": v}),
        st.text(min_size=1, max_size=8).map(lambda v: {**good, "peer_id": v}),  # no such live backend
        json_junk.filter(lambda v: isinstance(v, bool) or not isinstance(v, int) or v <= 0).map(
            lambda v: {**good, "pid": v}),
        st.integers(1, 1 << 30).filter(lambda v: v != os.getpid()).map(lambda v: {**good, "pid": v}),  # elsewhere
        not_str.map(lambda v: {**good, "host": v}),
        json_junk.filter(lambda v: v is not None and not isinstance(v, dict)).map(lambda v: {**good, "layout": v}),
        st.dictionaries(st.text(max_size=4), json_junk, max_size=3).map(lambda v: {**good, "layout": v}),
        st.just({**good, "layout": None}),  # a side with a layout refuses a peer without one
        json_junk.filter(lambda v: not isinstance(v, list)).map(lambda v: {**good, "regions": v}),
        st.lists(json_junk, min_size=1, max_size=2).map(lambda v: {**good, "regions": v}),
        json_junk.filter(lambda v: not isinstance(v, dict)).map(lambda v: {**good, "engine": v}),
        json_junk.filter(lambda v: v != good["format"]).map(lambda v: {**good, "format": v}),
    )
    return st.one_of(mutations.map(lambda d: json.dumps(d).encode()), st.binary(max_size=16), json_junk)


def bad_layouts():
    return st.one_of(json_junk.filter(lambda v: v is not None),
                     st.dictionaries(st.text(max_size=6), json_junk, max_size=4))


def bad_handles(w):
    return st.one_of(json_junk, st.just(w["h_b"]), st.just(object()))


def bad_peers(w):
    return st.one_of(st.text(max_size=8).filter(lambda p: p not in w["peers"]), not_str)


class DuckPlan:
    """A plan by its members (PlanLike) whose ``descriptors()`` returns ``junk``; it must never be finished."""

    state = "pending"
    src_lease = dst_lease = None

    def __init__(self, junk: object) -> None:
        self.junk = junk

    def descriptors(self) -> object:
        return self.junk

    def complete(self, *exc: object) -> bool:
        raise AssertionError("a refused plan was finished")

    fail = abort = complete


def calls(w):
    """``(label, thunk)`` pairs: every thunk must raise a umalloc error and change nothing."""
    a = w["a"]
    good_d = np.array([[w["src"], w["dst"], 64]], np.uint64)
    bad_plans = st.one_of(st.sampled_from([w["finished"], w["expired"]]), json_junk.filter(lambda v: v is not None),
                          st.just(object()))
    return st.one_of(
        bad_regions(w).map(lambda r: ("register", lambda: a.register(r))),
        bad_regions(w).map(lambda r: ("deregister", lambda: a.deregister(r))),
        st.integers(2, 4).map(lambda k: ("deregister-more", lambda: a.deregister([w["registered"]] * k))),
        bad_metadata(w).map(lambda md: ("connect", lambda: a.connect(md))),
        bad_peers(w).map(lambda p: ("disconnect", lambda: a.disconnect(p))),
        bad_peers(w).map(lambda p: ("peer_info", lambda: a.peer_info(p))),
        bad_peers(w).map(lambda p: ("peer_layout", lambda: a.peer_layout(p))),
        bad_layouts().map(lambda x: ("set_layout", lambda: a.set_layout(x))),
        bad_descriptors(w).map(lambda d: ("write_descriptors", lambda: a.write_descriptors(d, w["peer_b"]))),
        bad_peers(w).map(lambda p: ("write_descriptors-peer", lambda: a.write_descriptors(good_d, p))),
        bad_item_bytes.map(lambda ib: ("write_descriptors-item_bytes",
                                       lambda: a.write_descriptors(good_d, w["peer_b"], item_bytes=ib))),
        bad_plans.map(lambda p: ("write_descriptors-plan", lambda: a.write_descriptors(good_d, w["peer_b"], plan=p))),
        bad_plans.map(lambda p: ("submit", lambda: a.submit(p, w["peer_b"]))),
        st.just(("submit-other-peer", lambda: a.submit(w["for_b"], w["peer_c"]))),
        st.one_of(json_junk, st.sampled_from([np.zeros((1, 3), np.int64), np.zeros((2, 2), np.uint64),
                                              np.zeros(3, np.uint64)])).map(
            lambda j: ("submit-duck-plan", lambda: a.submit(DuckPlan(j), w["peer_b"]))),
        bad_peers(w).map(lambda p: ("submit-peer", lambda: a.submit(w["for_b"], p))),
        bad_handles(w).map(lambda h: ("poll", lambda: a.poll(h))),
        bad_handles(w).map(lambda h: ("forget", lambda: a.forget(h))),
        bad_handles(w).map(lambda h: ("wait", lambda: a.wait(h, 1.0))),
        bad_handles(w).map(lambda h: ("drain", lambda: a.drain(h, 1.0))),
        bad_timeouts.map(lambda t: ("wait-timeout", lambda: a.wait(w["h_a"], t))),
        bad_timeouts.map(lambda t: ("drain-timeout", lambda: a.drain(w["h_a"], t))),
    )


def snapshot(w) -> tuple:
    a, b = w["a"], w["b"]
    for x in (a, b, w["c"]):
        x.check_invariants()
    digest = tuple(zlib.crc32(w["arenas"][k].data.numpy().tobytes()) for k in "abc")
    return (a.stats(), b.stats(), a.registration_counts(), a.registered_regions(), a.peers(), a.layout,
            a.open_handles(), a.draining_handles(), w["for_b"].state, w["expired"].state, digest)


@seed(SEED)
@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_bad_calls_raise_typed_errors_and_change_nothing(world, data):
    strategy = world.setdefault("calls", calls(world))  # built once: building it costs more than drawing
    for _ in range(data.draw(st.integers(1, 4), label="calls")):
        label, thunk = data.draw(strategy, label="call")
        before = snapshot(world)
        with pytest.raises(UmallocError):
            thunk()
        assert snapshot(world) == before, label
