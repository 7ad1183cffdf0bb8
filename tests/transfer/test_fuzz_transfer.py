"""Fuzzing the transfer layer's public calls with bad inputs (hypothesis).

Every call either succeeds or raises a :mod:`umalloc.errors` type; either way both allocators end as they began
(snapshot equal, no lease left) once any plan or half that was made is finished. One pair of small allocators is
shared by every example (set up once); each example mutates one argument of a good call.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from umalloc.allocator.facade import MultiEndedAllocator, snapshots_equal
from umalloc.errors import InvariantError, UmallocError
from umalloc.geometry.arena import Arena
from umalloc.geometry.region import Region
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, LayerSpec
from umalloc.testing import seed_from_env
from umalloc.transfer import (
    IndexVector,
    PeerLayout,
    ReceiverHalf,
    TransferPlan,
    build_plan,
    build_receiver_half,
    build_send_plan,
    check_compatible,
    owned_count,
    source_ranks,
    vector_rows,
)

SEED = seed_from_env(4321)
_SETTINGS = settings(max_examples=60, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def FUZZ(test):  # noqa: N802 - a decorator named like the settings it applies
    """Hypothesis settings plus the printed seed (examples repeat run to run; UMALLOC_SEED picks others)."""
    return seed(SEED)(_SETTINGS(test))

L, P = 9, 3


def _spec() -> ArenaSpec:
    mha = LayerSpec.mha(1, 2)
    return ArenaSpec((EndSpec("full", (mha, mha), 2),
                      EndSpec("swa", (LayerSpec.mha(1, 2, window_tokens=3),), 2, Grow.DOWN, "full", EndRole.SWA),
                      EndSpec("draft", (LayerSpec.mha(1, 4),), 4, Grow.FLOAT, None, EndRole.DRAFT)),
                     arena_bytes=4096)


def _extend(alloc: MultiEndedAllocator, owner: str, n: int, bind=None) -> torch.Tensor:
    t = alloc.alloc_extend(torch.tensor([0]), torch.tensor([n]), torch.tensor([-1]), owner=owner, bind=bind)
    assert t is not None
    return t


class World:
    """A prefill and a decode allocator holding one request of L tokens (decode holds P of them already)."""

    def __init__(self) -> None:
        spec = _spec()
        self.src = MultiEndedAllocator(Arena(spec))
        self.dst = MultiEndedAllocator(Arena(spec))
        _extend(self.src, "full", 3)  # another request first: ids are not the trivial ones
        self.vt_src = {"full": _extend(self.src, "full", L), "draft": _extend(self.src, "draft", L)}
        self.vt_dst = {"full": _extend(self.dst, "full", L), "draft": _extend(self.dst, "draft", L + 2)}
        self.src_layout = PeerLayout.from_arena(self.src.arena)
        self.dst_layout = PeerLayout.from_arena(self.dst.arena)

    def state(self) -> list:
        return [(a.snapshot(), a.leases_active()) for a in (self.src, self.dst)]

    def assert_as(self, before: list) -> None:
        for (snap_a, n_a), (snap_b, n_b) in zip(before, self.state(), strict=True):
            assert snapshots_equal(snap_a, snap_b), "a failed or finished call changed an allocator"
            assert n_a == n_b, "a lease was left behind"


@pytest.fixture(scope="module")
def world() -> World:
    return World()


def _call(world: World, fn) -> None:
    """Run ``fn``; it must succeed or raise a umalloc error, and leave both allocators as they were (pins
    included: a plan it made is finished first)."""
    before = world.state()
    made = []
    try:
        made.append(fn())
    except InvariantError:
        raise
    except UmallocError:
        pass
    finally:
        for obj in made:
            if hasattr(obj, "abort"):
                obj.abort()
    world.assert_as(before)


# ---- id tensors ------------------------------------------------------------------------------------------------

def _bad_ids(draw, good: torch.Tensor) -> object:
    kind = draw(st.sampled_from(["dtype", "shape", "short", "poke", "dup", "meta", "sparse", "list", "numpy",
                                 "reverse", "empty", "int32"]))
    if kind == "dtype":
        return good.to(draw(st.sampled_from([torch.float32, torch.float64, torch.int16, torch.uint8, torch.bool])))
    if kind == "shape":
        return good.reshape(1, -1)
    if kind == "short":
        return good[: draw(st.integers(0, max(0, good.numel() - 1)))]
    if kind == "poke":
        t = good.clone()
        t[draw(st.integers(0, t.numel() - 1))] = draw(st.integers(-(1 << 62), 1 << 62) | st.integers(-3, 600))
        return t
    if kind == "dup":
        t = good.clone()
        t[-2:] = t[:2]
        return t
    if kind == "meta":
        return torch.empty(good.numel(), dtype=torch.int64, device="meta")
    if kind == "sparse":
        return good.to_sparse()
    if kind == "list":
        return good.tolist()
    if kind == "numpy":
        return good.numpy().astype(draw(st.sampled_from([np.int64, np.int32, np.uint64, np.float64, np.int8])))
    if kind == "reverse":
        return good.flip(0)
    if kind == "empty":
        return torch.zeros(0, dtype=torch.int64)
    return good.to(torch.int32)


@FUZZ
@given(side=st.sampled_from(["src", "dst"]), owner=st.sampled_from(["full", "draft", "missing", "extra", "bound"]),
       data=st.data())
def test_build_plan_with_bad_vtokens(world, side, owner, data):
    vs, vd = dict(world.vt_src), dict(world.vt_dst)
    target = vs if side == "src" else vd
    if owner == "missing":
        del target["draft"]
    elif owner == "extra":
        target["nope"] = target["full"]
    elif owner == "bound":
        target["swa"] = target["full"]
    else:
        target[owner] = _bad_ids(data.draw, target[owner])
    _call(world, lambda: build_plan("f", world.src, vs, world.dst, vd, prefix_tokens=P, seq_len_tokens=L))


_ANY = (st.integers(-5, 40) | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=True) | st.booleans()
        | st.none() | st.text(max_size=3))


@FUZZ
@given(prefix=_ANY, seq_len=_ANY, deadline=_ANY, owner=st.none() | st.text(max_size=6))
def test_build_plan_with_bad_lengths(world, prefix, seq_len, deadline, owner):
    _call(world, lambda: build_plan("f", world.src, world.vt_src, world.dst, world.vt_dst, prefix_tokens=prefix,
                                    seq_len_tokens=seq_len, deadline_s=deadline, dst_owner=owner))


# ---- the receiver's half on the wire ---------------------------------------------------------------------------

def _mutate(draw, d: object, depth: int = 0) -> object:
    """One random change somewhere in a JSON-like value: a key dropped, a value replaced, a list entry changed."""
    if isinstance(d, dict) and d and depth < 4:
        key = draw(st.sampled_from(sorted(d)))
        out = dict(d)
        if draw(st.integers(0, 4)) == 0:
            del out[key]
        else:
            out[key] = _mutate(draw, d[key], depth + 1)
        return out
    if isinstance(d, list) and d and depth < 4 and draw(st.booleans()):
        i = draw(st.integers(0, len(d) - 1))
        return d[:i] + [_mutate(draw, d[i], depth + 1)] + d[i + 1:]
    return draw(_ANY | st.lists(st.integers(-3, 300), max_size=4) | st.just({}) | st.just([1.5]))


@FUZZ
@given(data=st.data())
def test_send_plan_from_a_corrupted_half(world, data):
    half = build_receiver_half("h", world.dst, world.vt_dst, prefix_tokens=P, seq_len_tokens=L)
    try:
        wire = json.loads(json.dumps(half.to_dict()))
        bad = _mutate(data.draw, wire)
        _call(world, lambda: ReceiverHalf.from_dict(bad))  # type: ignore[arg-type]
        _call(world, lambda: build_send_plan("h", world.src, world.vt_src, bad, world.dst_layout))
    finally:
        half.abort()
    assert world.src.leases_active() == world.dst.leases_active() == 0


@FUZZ
@given(data=st.data())
def test_layout_from_a_corrupted_dict(world, data):
    bad = _mutate(data.draw, json.loads(json.dumps(world.dst_layout.to_dict())))

    def connect() -> None:
        check_compatible(world.src_layout, PeerLayout.from_dict(bad))  # type: ignore[arg-type]

    _call(world, connect)


# ---- hand-built vectors and plans, row arithmetic ---------------------------------------------------------------

_IDS = st.lists(st.integers(-2, 40) | st.integers(1 << 62, (1 << 64) - 1), max_size=5)


@FUZZ
@given(sp=_IDS, dp=_IDS, sr=_IDS, dr=_IDS, src_leased=_IDS, dst_leased=_IDS,
       as_type=st.sampled_from(["list", "numpy", "torch"]))
def test_hand_built_plans(world, sp, dp, sr, dr, src_leased, dst_leased, as_type):
    spec = ArenaSpec((EndSpec("full", (LayerSpec.mha(1, 4),), page_size=2),), arena_bytes=1024)
    src = PeerLayout(spec, (Region(1 << 20, 1024),), 1 << 20)
    dst = PeerLayout(spec, (Region(1 << 21, 1024),), 1 << 21)

    def conv(x: list[int]) -> object:
        big = any(v >= 1 << 63 for v in x)
        if as_type == "list" or (big and any(v < 0 for v in x)):  # no numpy integer dtype holds both
            return x
        arr = np.array(x, dtype=np.uint64 if big else np.int64)
        return torch.from_numpy(arr) if as_type == "torch" and not big else arr

    def make() -> TransferPlan:
        v = IndexVector("target", "full", "full", conv(sp), conv(dp), src.region_group("full"),
                        dst.region_group("full"), conv(sr), conv(dr))
        plan = TransferPlan("r", [v], src_layout=src, dst_layout=dst, src_leased_pages={"full": conv(src_leased)},
                            dst_leased_pages={"full": conv(dst_leased)})
        desc = plan.descriptors()  # every row lies inside both arenas' leased pages
        for col, lay, leased in ((0, src, src_leased), (1, dst, dst_leased)):
            off = desc[:, col].astype(object) - lay.arena_base_ptr
            assert all(0 <= o and o + n <= 1024 for o, n in zip(off, desc[:, 2].tolist(), strict=True))
            pages = {int(o) // 32 for o in off}
            assert pages <= set(leased)
        return plan

    _call(world, make)


@FUZZ
@given(a=_ANY, b=_ANY, c=_ANY)
def test_row_arithmetic_refuses_typed(world, a, b, c):
    end = _spec().end("swa")
    for fn in (lambda: owned_count(a, b, c), lambda: source_ranks(a, b, c),
               lambda: vector_rows(end, a, b, dcp_size=1 if c is None else c, dcp_rank=0)):
        try:
            fn()
        except InvariantError:
            raise
        except UmallocError:
            pass
