"""Fuzzing the translators' and the arena's public calls with bad inputs (hypothesis).

Every call gets arguments drawn from a pool of good and bad values (wrong dtypes, floats, bools, huge ints,
strings, None, meta and sparse tensors, 2-D and 0-d tensors, non-contiguous views, numpy arrays, lists). A call
must either succeed or raise a typed umalloc error (:class:`UmallocValueError`); any other exception fails.
After a refused call nothing has changed: no input tensor, no ``out=`` tensor, no arena byte.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umalloc.errors import UmallocValueError
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, LayerSpec
from umalloc.translators import cpu as cpu_impl
from umalloc.translators import reference as ref_impl

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=True)


def _values() -> list[object]:
    """Good and bad argument values; tensors are rebuilt per call (``fresh``) so mutation is detectable."""
    return [
        ("t64", [0, 1, 2, 3]), ("t64", [5, -1, 2]), ("t64", [0]), ("t64", []), ("t64", [1 << 62, 3]),
        ("t64", [-5, 7]), ("t32", [0, 1, 3]), ("t32", [2147483647]), ("t16", [0, 1]), ("tf", [0.0, 1.5]),
        ("tb", [True, False]), ("t2d", [[0, 1], [2, 3]]), ("t0d", 1), ("strided", [0, 1, 2, 3, 4, 5]),
        ("meta", 3), ("sparse", [0, 1, 0]), ("np64", [0, 1, 2]), ("np32", [1, 2]), ("npf", [0.5]),
        ("npu64", [1, 2]), ("np_ro", [0, 2, 1]), ("list", [0, 1]), ("int", 2), ("int", 0), ("int", -3),
        ("int", 1 << 70), ("bool", True), ("float", 2.0), ("str", "no"), ("none", None), ("runs", [[1, 2, 3]]),
        ("runs", [[0, 0, 0]]), ("regions", [(0, 8)]), ("regions", [(1 << 64, 8)]), ("regions", [(0, 1 << 64)]),
        ("regions", [(0, 0)]), ("regions", "x"),
    ]


VALUES = _values()


def fresh(v: tuple[str, object]) -> object:
    kind, x = v
    if kind == "t64":
        return torch.tensor(x, dtype=torch.int64)
    if kind == "t32":
        return torch.tensor(x, dtype=torch.int32)
    if kind == "t16":
        return torch.tensor(x, dtype=torch.int16)
    if kind == "tf":
        return torch.tensor(x, dtype=torch.float32)
    if kind == "tb":
        return torch.tensor(x, dtype=torch.bool)
    if kind in ("t2d", "runs"):
        return torch.tensor(x, dtype=torch.int64)
    if kind == "t0d":
        return torch.tensor(x, dtype=torch.int64)
    if kind == "strided":
        return torch.tensor(x, dtype=torch.int64)[::2]
    if kind == "meta":
        return torch.zeros(x, dtype=torch.int64, device="meta")
    if kind == "sparse":
        return torch.tensor(x, dtype=torch.int64).to_sparse()
    if kind == "np64":
        return np.array(x, dtype=np.int64)
    if kind == "np32":
        return np.array(x, dtype=np.int32)
    if kind == "npf":
        return np.array(x, dtype=np.float64)
    if kind == "npu64":
        return np.array(x, dtype=np.uint64)
    if kind == "np_ro":
        a = np.array(x, dtype=np.int64)
        a.setflags(write=False)
        return a
    if kind == "list":
        return list(x)  # type: ignore[arg-type]
    return x


def snapshot(x: object) -> object:
    if isinstance(x, torch.Tensor):
        if x.device.type == "meta":
            return ("meta", tuple(x.shape))
        return x.to_dense().clone() if x.layout is not torch.strided else x.clone()
    if isinstance(x, np.ndarray):
        return x.copy()
    return x


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        if b is None or isinstance(b, tuple):
            return True
        dense = a.to_dense() if a.layout is not torch.strided else a
        return dense.dtype == b.dtype and torch.equal(dense, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return True


arg = st.sampled_from(VALUES)
strict_arg = st.sampled_from([True, False, 0, 1, "no", None, np.bool_(True)])


def call_and_check(fn, args: list[object], kwargs: dict[str, object]) -> None:
    before = [snapshot(a) for a in args] + [snapshot(v) for v in kwargs.values()]
    try:
        fn(*args, **kwargs)
    except UmallocValueError:
        after = list(args) + list(kwargs.values())
        for a, b in zip(after, before, strict=True):
            assert same(a, b), f"{fn.__module__}.{fn.__name__} changed an argument before refusing"
        return
    # success: only ``out`` may have changed; inputs never
    for a, b, name in zip(list(args), before, range(len(args)), strict=False):
        assert same(a, b), f"{fn.__name__} wrote its input argument {name}"


@pytest.mark.parametrize("module", [ref_impl, cpu_impl], ids=lambda m: m.NAME)
@FUZZ
@given(ids=arg, v2p=arg, ps=arg, out=st.one_of(st.none(), arg), strict=strict_arg, pages=st.booleans())
def test_fuzz_translate(module, ids, v2p, ps, out, strict, pages):
    ids_v, v2p_v, out_v = fresh(ids), fresh(v2p), (None if out is None else fresh(out))
    if out_v is not None and isinstance(ids_v, torch.Tensor) and ids_v is not out_v and ids_v.device.type != "meta":
        out_before = snapshot(out_v)
    else:
        out_before = None
    args = [ids_v, v2p_v] if pages else [ids_v, v2p_v, fresh(ps)]
    kwargs = {"out": out_v, "strict": strict}
    fn = module.virtual_to_physical_pages if pages else module.virtual_to_physical
    inputs_before = [snapshot(a) for a in args]
    try:
        fn(*args, **kwargs)
    except UmallocValueError:
        if out_before is not None:
            assert same(out_v, out_before), "a refused translate wrote into out"
        assert all(same(a, b) for a, b in zip(args, inputs_before, strict=True)), "a refused call changed an input"
        return
    assert isinstance(strict, (bool, np.bool_)), f"strict={strict!r} was accepted: only a bool may pick the mode"


@pytest.mark.parametrize("module", [ref_impl, cpu_impl], ids=lambda m: m.NAME)
@FUZZ
@given(a=arg, b=arg, c=arg, d=arg, which=st.sampled_from(["t2p", "runs", "desc", "kernel", "dcp"]))
def test_fuzz_other_translator_calls(module, a, b, c, d, which):
    if which == "t2p":
        call_and_check(module.tokens_to_pages, [fresh(a), fresh(b)], {})
    elif which == "runs":
        call_and_check(module.pages_to_runs, [fresh(a), fresh(b)], {})
    elif which == "desc":
        call_and_check(module.runs_to_descriptors, [fresh(a), fresh(b), fresh(c)], {})
    elif which == "kernel":
        call_and_check(module.kernel_page_ids, [fresh(a), fresh(b), fresh(c)], {})
    else:
        call_and_check(module.rank_local_positions, [fresh(a), fresh(b), fresh(d)], {})


#: full (up, owner) + swa (down, bound), page size 2, nine full pages past the floor
FULL_SWA = (EndSpec("full", (LayerSpec.mha(1, 4),), page_size=2),
            EndSpec("swa", (LayerSpec.mha(1, 2, window_tokens=4),), page_size=2, grow=Grow.DOWN, owner="full",
                    role=EndRole.SWA))
ARENA = Arena(ArenaSpec(FULL_SWA, arena_bytes=FULL_SWA[0].page_bytes * 10))  # one for every example: reset by each
ARENA.data.copy_(torch.randint(0, 256, ARENA.data.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
end_arg = st.sampled_from(["full", "swa", "nope", 3, None])


@FUZZ
@given(end=end_arg, a=arg, b=arg, which=st.sampled_from(["copy", "offset", "address", "envelope", "kv", "new"]))
def test_fuzz_arena_calls(end, a, b, which):
    before = ARENA.data.clone()
    try:
        if which == "copy":
            ARENA.copy_pages(end, fresh(a), fresh(b))  # type: ignore[arg-type]
            ARENA.data.copy_(before)  # a legal copy moved bytes: put them back for the next example
        elif which == "offset":
            ARENA.page_offset_bytes(end, fresh(a))  # type: ignore[arg-type]
        elif which == "address":
            ARENA.page_address(end, fresh(a))  # type: ignore[arg-type]
        elif which == "envelope":
            ARENA.envelope(end, fresh(a))  # type: ignore[arg-type]
        elif which == "kv":
            ARENA.kv_views(end, fresh(a))  # type: ignore[arg-type]
        else:
            Arena(ArenaSpec(FULL_SWA, arena_bytes=FULL_SWA[0].page_bytes * 10), device=fresh(a))  # type: ignore[arg-type]
    except UmallocValueError:
        assert torch.equal(ARENA.data, before), f"a refused {which} changed arena bytes"
