"""Conformance suite for every translator implementation (umalloc.translators).

Every test runs against each implementation that can run here: ``reference`` (torch), ``cpu`` (numba, small
batches on the caller's thread), ``cpu-chunked`` (numba with every batch split into 5 chunks, so the parallel
kernels and their chunk seams run even on tiny inputs) and ``cuda`` (skipped without cupy and a GPU).
Expected values come from hand computation or from brute-force Python loops written here, never from
another translator.
"""

from __future__ import annotations

import inspect
import random
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import umalloc.translators as tr
from umalloc.errors import InvalidIdError, TombstoneError, UmallocValueError
from umalloc.testing import seed_from_env
from umalloc.translators import cpu as cpu_impl
from umalloc.translators import cuda as cuda_impl
from umalloc.translators import reference as ref_impl

CUDA_OK = cuda_impl.available()
IMPL_PARAMS = [
    "reference",
    "cpu",
    "cpu-chunked",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not CUDA_OK, reason=f"cuda translator: {cuda_impl.unavailable_reason()}"),
    ),
]
HYP = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Impl:
    """An implementation under test plus the device its inputs live on."""

    def __init__(self, module, device: str) -> None:
        self.m = module
        self.device = device

    def t(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device)


@pytest.fixture(params=IMPL_PARAMS)
def impl(request, monkeypatch):
    name = request.param
    if name == "cpu-chunked":
        monkeypatch.setattr(cpu_impl, "_parallel_batch", lambda num_items: True)
        monkeypatch.setattr(cpu_impl, "_chunks", lambda: 5)
        return Impl(cpu_impl, "cpu")
    if name == "cuda":
        return Impl(cuda_impl, "cuda")
    return Impl({"reference": ref_impl, "cpu": cpu_impl}[name], "cpu")


def as_list(x) -> list:
    return x.cpu().tolist() if isinstance(x, torch.Tensor) else x.tolist()


# --- brute-force oracles (plain Python loops) ----------------------------------------------------------------


def bf_v2p_tokens(vtokens, v2p, ps):
    out = []
    for t in vtokens:
        page, off = divmod(t, ps)
        p = v2p[page]
        out.append((p if p >= 0 else 0) * ps + off)
    return out


def bf_runs(src, dst):
    runs = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return runs


def bf_descriptors(runs, src_regions, dst_regions):
    rows = []
    for (sb, item), (db, _) in zip(src_regions, dst_regions, strict=True):
        for s, d, n in runs:
            rows.append([sb + s * item, db + d * item, n * item])
    return rows


def bf_is_aligned_pages(tokens, ps):
    if len(tokens) % ps:
        return False
    for g in range(0, len(tokens), ps):
        base = tokens[g]
        if base < 0 or base % ps:
            return False
        for j in range(ps):
            if tokens[g + j] != base + j:
                return False
    return True


# --- the protocol ----------------------------------------------------------------------------------------------

PROTOCOL_FUNCS = [
    name for name, value in vars(tr.Translator).items() if callable(value) and not name.startswith("_")
]


def test_protocol_lists_the_contract_functions():
    assert set(PROTOCOL_FUNCS) >= {
        "virtual_to_physical",
        "virtual_to_physical_pages",
        "tokens_to_pages",
        "pages_to_runs",
        "runs_to_descriptors",
        "kernel_page_ids",
        "rank_local_positions",
    }


@pytest.mark.parametrize("module", [ref_impl, cpu_impl, cuda_impl], ids=lambda m: m.NAME)
def test_every_module_conforms_to_protocol(module):
    """Every implementation module (cuda included: it must import without cupy) has every protocol member
    with the protocol's parameter names, kinds and defaults."""
    assert isinstance(module, tr.Translator)
    assert module.NAME in tr.IMPL_NAMES
    for name in PROTOCOL_FUNCS:
        want = list(inspect.signature(getattr(tr.Translator, name)).parameters.values())[1:]  # drop self
        got = list(inspect.signature(getattr(module, name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in got] == [(p.name, p.kind, p.default) for p in want], name


# --- virtual_to_physical ----------------------------------------------------------------------------------------


def test_v2p_hand_example(impl):
    v2p = impl.t([5, tr.TOMBSTONE, 2])
    # token 3 is page 1 (tombstoned) offset 1 -> sink page 0, offset 1 -> 1
    got = impl.m.virtual_to_physical(impl.t([0, 1, 3, 4, 5]), v2p, 2, strict=False)
    assert as_list(got) == [10, 11, 1, 4, 5]
    assert got.dtype == torch.int64 and got.device.type == impl.device


def test_v2p_keeps_shape_and_handles_empty(impl):
    v2p = impl.t([3, 1])
    got = impl.m.virtual_to_physical(impl.t([[0, 3], [2, 1]]), v2p, 2)
    assert as_list(got) == [[6, 3], [2, 7]]
    empty = impl.m.virtual_to_physical(impl.t([]), v2p, 2)
    assert empty.shape == (0,) and empty.dtype == torch.int64


def test_v2p_non_power_of_two_page_size(impl):
    v2p = impl.t([4, 0, 7])
    got = impl.m.virtual_to_physical(impl.t([0, 2, 3, 5, 8]), v2p, 3)
    assert as_list(got) == [12, 14, 0, 2, 23]


def test_v2p_strict_tombstone_raises_and_names_token(impl):
    v2p = impl.t([5, -1, 2])
    with pytest.raises(TombstoneError, match=r"vtokens\[1\] = 3"):
        impl.m.virtual_to_physical(impl.t([0, 3]), v2p, 2, strict=True)
    # strict without tombstones hit is fine
    assert as_list(impl.m.virtual_to_physical(impl.t([0, 4]), v2p, 2, strict=True)) == [10, 4]


@pytest.mark.parametrize("bad", [-1, 6, 1 << 62])
def test_v2p_out_of_range_raises_in_both_modes(impl, bad):
    v2p = impl.t([5, -1, 2])
    for strict in (False, True):
        with pytest.raises(InvalidIdError, match=r"out of range.*\[0, 6\)") as info:
            impl.m.virtual_to_physical(impl.t([0, bad]), v2p, 2, strict=strict)
        assert not isinstance(info.value, TombstoneError)


def test_v2p_out_in_place_and_aliasing(impl):
    v2p = impl.t([5, -1, 2])
    out = impl.t([99, 99, 99])
    res = impl.m.virtual_to_physical(impl.t([0, 3, 5]), v2p, 2, out=out, strict=False)
    assert res is out
    assert as_list(out) == [10, 1, 5]
    buf = impl.t([0, 3, 5])
    res = impl.m.virtual_to_physical(buf, v2p, 2, out=buf, strict=False)
    assert res is buf and as_list(buf) == [10, 1, 5]


def test_v2p_out_partial_overlap_and_strided(impl):
    v2p = impl.t([1, 3, 0, 2])
    buf = impl.t([0, 1, 2, 3, 4, 5, 6, 7, 0])
    expect = bf_v2p_tokens([0, 1, 2, 3, 4, 5, 6, 7], [1, 3, 0, 2], 2)
    impl.m.virtual_to_physical(buf[:-1], v2p, 2, out=buf[1:])
    assert as_list(buf[1:]) == expect
    strided = impl.t([0] * 8)[::2]
    impl.m.virtual_to_physical(impl.t([7, 6, 1, 0]), v2p, 2, out=strided)
    assert as_list(strided) == bf_v2p_tokens([7, 6, 1, 0], [1, 3, 0, 2], 2)


def test_v2p_error_leaves_aliased_out_unchanged(impl):
    v2p = impl.t([5, -1, 2])
    buf = impl.t([0, 1, 6])
    with pytest.raises(InvalidIdError):
        impl.m.virtual_to_physical(buf, v2p, 2, out=buf)
    assert as_list(buf) == [0, 1, 6]
    buf = impl.t([0, 1, 2])
    with pytest.raises(TombstoneError):
        impl.m.virtual_to_physical(buf, v2p, 2, out=buf, strict=True)
    assert as_list(buf) == [0, 1, 2]


def test_v2p_bad_out_and_bad_inputs(impl):
    v2p = impl.t([5, -1, 2])
    vt = impl.t([0, 1])
    with pytest.raises(InvalidIdError, match="dtype"):
        impl.m.virtual_to_physical(vt, v2p, 2, out=torch.zeros(2, dtype=torch.int32, device=impl.device))
    with pytest.raises(InvalidIdError, match="shape"):
        impl.m.virtual_to_physical(vt, v2p, 2, out=impl.t([0, 0, 0]))
    with pytest.raises(UmallocValueError):
        impl.m.virtual_to_physical(vt, v2p, 2, out=[0, 0])
    with pytest.raises(InvalidIdError, match="dtype"):
        impl.m.virtual_to_physical(vt.to(torch.int16), v2p, 2)
    with pytest.raises(InvalidIdError, match="dtype"):
        impl.m.virtual_to_physical(vt, v2p.to(torch.int32), 2)
    with pytest.raises(InvalidIdError, match="1-D"):
        impl.m.virtual_to_physical(vt, v2p.reshape(1, 3), 2)
    with pytest.raises(InvalidIdError):
        impl.m.virtual_to_physical([0, 1], v2p, 2)
    for ps in (0, -2, 2.0, True):
        with pytest.raises(UmallocValueError, match="page_size"):
            impl.m.virtual_to_physical(vt, v2p, ps)


def test_v2p_pages(impl):
    v2p = impl.t([5, -1, 2])
    assert as_list(impl.m.virtual_to_physical_pages(impl.t([2, 1, 0]), v2p, strict=False)) == [2, tr.SINK_PAGE, 5]
    with pytest.raises(TombstoneError, match=r"vpages\[1\] = 1"):
        impl.m.virtual_to_physical_pages(impl.t([2, 1]), v2p, strict=True)
    with pytest.raises(InvalidIdError, match=r"\[0, 3\)"):
        impl.m.virtual_to_physical_pages(impl.t([3]), v2p)
    buf = impl.t([0, 2])
    assert impl.m.virtual_to_physical_pages(buf, v2p, out=buf) is buf
    assert as_list(buf) == [5, 2]


@HYP
@given(
    data=st.data(),
    num_pages=st.integers(1, 16),
    ps=st.sampled_from([1, 2, 3, 4, 8]),
    strict=st.booleans(),
)
def test_v2p_matches_brute_force(impl, data, num_pages, ps, strict):
    v2p = data.draw(st.lists(st.integers(-1, 40), min_size=num_pages, max_size=num_pages))
    limit = num_pages * ps
    vt = data.draw(st.lists(st.integers(-3, limit + 3), max_size=40))
    use_out = data.draw(st.booleans())
    out = impl.t([-7] * len(vt)) if use_out else None
    in_range = all(0 <= t < limit for t in vt)
    hits_tomb = in_range and any(v2p[t // ps] < 0 for t in vt)
    if not in_range:
        with pytest.raises(InvalidIdError) as info:
            impl.m.virtual_to_physical(impl.t(vt), impl.t(v2p), ps, out=out, strict=strict)
        assert not isinstance(info.value, TombstoneError)
    elif strict and hits_tomb:
        with pytest.raises(TombstoneError):
            impl.m.virtual_to_physical(impl.t(vt), impl.t(v2p), ps, out=out, strict=strict)
    else:
        got = impl.m.virtual_to_physical(impl.t(vt), impl.t(v2p), ps, out=out, strict=strict)
        assert as_list(got) == bf_v2p_tokens(vt, v2p, ps)
        if out is not None:
            assert got is out
        pages = [t // ps for t in vt]
        got_pages = impl.m.virtual_to_physical_pages(impl.t(pages), impl.t(v2p), strict=strict)
        assert as_list(got_pages) == [v2p[p] if v2p[p] >= 0 else 0 for p in pages]
        return
    if out is not None:
        assert as_list(out) == [-7] * len(vt)  # nothing written on error


# --- tokens_to_pages --------------------------------------------------------------------------------------------


def test_tokens_to_pages_hand_examples(impl):
    assert as_list(impl.m.tokens_to_pages(impl.t([8, 9, 10, 11, 0, 1, 2, 3]), 4)) == [2, 0]
    assert as_list(impl.m.tokens_to_pages(impl.t([6, 7, 8, 0, 1, 2]), 3)) == [2, 0]
    assert as_list(impl.m.tokens_to_pages(impl.t([5, 0, 5]), 1)) == [5, 0, 5]
    empty = impl.m.tokens_to_pages(impl.t([]), 4)
    assert empty.shape == (0,) and empty.dtype == torch.int64


@pytest.mark.parametrize(
    ("tokens", "ps", "match"),
    [
        ([1, 2], 2, r"tokens\[0:2\]"),  # crosses a page boundary
        ([0, 1, 4, 6], 2, r"tokens\[2:4\]"),  # gap inside a segment
        ([0, 1, 3, 2], 2, r"tokens\[2:4\]"),  # reversed inside a segment
        ([0, 1, 2], 2, "multiple"),  # trailing partial page: never truncated
        ([-2, -1], 2, r"tokens\[0:2\]"),  # negative page
        ([-1], 1, r"tokens\[0:1\]"),
    ],
)
def test_tokens_to_pages_misaligned_raises(impl, tokens, ps, match):
    with pytest.raises(InvalidIdError, match=match):
        impl.m.tokens_to_pages(impl.t(tokens), ps)


def test_tokens_to_pages_bad_args(impl):
    with pytest.raises(InvalidIdError, match="1-D"):
        impl.m.tokens_to_pages(impl.t([[0, 1]]), 2)
    with pytest.raises(UmallocValueError, match="page_size"):
        impl.m.tokens_to_pages(impl.t([0, 1]), 0)


@HYP
@given(data=st.data(), ps=st.sampled_from([1, 2, 3, 4]), pages=st.lists(st.integers(0, 30), max_size=12))
def test_tokens_to_pages_matches_brute_force(impl, data, ps, pages):
    tokens = [p * ps + j for p in pages for j in range(ps)]
    assert as_list(impl.m.tokens_to_pages(impl.t(tokens), ps)) == pages
    if tokens:
        i = data.draw(st.integers(0, len(tokens) - 1))
        tokens[i] += data.draw(st.sampled_from([-ps, -1, 1, ps]))
        if bf_is_aligned_pages(tokens, ps):
            assert as_list(impl.m.tokens_to_pages(impl.t(tokens), ps)) == [
                tokens[g] // ps for g in range(0, len(tokens), ps)
            ]
        else:
            with pytest.raises(InvalidIdError):
                impl.m.tokens_to_pages(impl.t(tokens), ps)


# --- pages_to_runs ---------------------------------------------------------------------------------------------


def test_pages_to_runs_hand_examples(impl):
    got = impl.m.pages_to_runs(impl.t([3, 4, 5, 9]), impl.t([7, 8, 2, 3]))
    assert as_list(got) == [[3, 7, 2], [5, 2, 1], [9, 3, 1]]
    # contiguous on the source only, or on the destination only, breaks the run
    assert as_list(impl.m.pages_to_runs(impl.t([1, 2, 3]), impl.t([5, 6, 8]))) == [[1, 5, 2], [3, 8, 1]]
    assert as_list(impl.m.pages_to_runs(impl.t([1, 3, 4]), impl.t([5, 6, 7]))) == [[1, 5, 1], [3, 6, 2]]
    # repeats and descending pages are runs of one
    assert as_list(impl.m.pages_to_runs(impl.t([2, 2, 1]), impl.t([0, 1, 2]))) == [
        [2, 0, 1],
        [2, 1, 1],
        [1, 2, 1],
    ]
    assert as_list(impl.m.pages_to_runs(impl.t(list(range(10))), impl.t(list(range(20, 30))))) == [
        [0, 20, 10]
    ]


def test_pages_to_runs_empty_and_errors(impl):
    empty = impl.m.pages_to_runs(impl.t([]), impl.t([]))
    assert tuple(empty.shape) == (0, 3) and empty.dtype == torch.int64
    with pytest.raises(UmallocValueError, match="equal lengths"):
        impl.m.pages_to_runs(impl.t([1, 2]), impl.t([1]))
    with pytest.raises(InvalidIdError, match=r"dst_pages\[1\] = -1"):
        impl.m.pages_to_runs(impl.t([1, 2]), impl.t([0, -1]))
    with pytest.raises(InvalidIdError, match=r"src_pages\[0\] = -4"):
        impl.m.pages_to_runs(impl.t([-4, 2]), impl.t([0, 1]))
    with pytest.raises(InvalidIdError, match="dtype"):
        impl.m.pages_to_runs(impl.t([1]).to(torch.int32), impl.t([1]))


run_segments = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(1, 6)), max_size=10)


@HYP
@given(segments=run_segments)
def test_pages_to_runs_matches_brute_force(impl, segments):
    src = [s + j for s, _, n in segments for j in range(n)]
    dst = [d + j for _, d, n in segments for j in range(n)]
    got = impl.m.pages_to_runs(impl.t(src), impl.t(dst))
    assert tuple(got.shape) == (len(bf_runs(src, dst)), 3)
    assert as_list(got) == bf_runs(src, dst)


# --- runs_to_descriptors ----------------------------------------------------------------------------------------


def test_two_adjacent_pages_make_one_descriptor(impl):
    """Pages [3, 4] -> [7, 8], 64-byte items, bases 1000 and 2000: one descriptor (1192, 2448, 128)."""
    runs = impl.m.pages_to_runs(impl.t([3, 4]), impl.t([7, 8]))
    desc = impl.m.runs_to_descriptors(runs, [(1000, 64)], [(2000, 64)])
    assert isinstance(desc, np.ndarray) and desc.dtype == np.uint64 and desc.shape == (1, 3)
    assert desc.tolist() == [[1192, 2448, 128]]


def test_descriptors_region_major_order(impl):
    runs = np.array([[0, 5, 2], [9, 1, 1]], dtype=np.int64)
    src = np.array([[100, 10], [10_000, 4]])
    dst = [(200, 10), (20_000, 4)]
    desc = impl.m.runs_to_descriptors(runs, src, dst)
    assert desc.tolist() == [
        [100, 250, 20],
        [190, 210, 10],
        [10_000, 20_020, 8],
        [10_036, 20_004, 4],
    ]


def test_descriptors_large_addresses_are_exact(impl):
    base = (1 << 63) + 12345  # above int64: must stay exact in uint64
    desc = impl.m.runs_to_descriptors(impl.t([[2, 3, 4]]), [(base, 4096)], [(7, 4096)])
    assert desc.tolist() == [[base + 2 * 4096, 7 + 3 * 4096, 4 * 4096]]


def test_descriptors_empty_and_errors(impl):
    assert impl.m.runs_to_descriptors(np.zeros((0, 3), np.int64), [(0, 8)], [(0, 8)]).shape == (0, 3)
    assert impl.m.runs_to_descriptors(impl.t([[1, 1, 1]]), [], []).shape == (0, 3)
    with pytest.raises(UmallocValueError, match="item_bytes"):
        impl.m.runs_to_descriptors(impl.t([[1, 1, 1]]), [(0, 64)], [(0, 32)])
    with pytest.raises(UmallocValueError, match="2 regions"):
        impl.m.runs_to_descriptors(impl.t([[1, 1, 1]]), [(0, 64), (9, 8)], [(0, 64)])
    with pytest.raises(InvalidIdError, match="num_pages"):
        impl.m.runs_to_descriptors(impl.t([[1, 1, 0]]), [(0, 8)], [(0, 8)])
    with pytest.raises(InvalidIdError, match=r"runs\[1\]"):
        impl.m.runs_to_descriptors(impl.t([[1, 1, 1], [-1, 0, 1]]), [(0, 8)], [(0, 8)])
    with pytest.raises(InvalidIdError, match="overflows"):
        impl.m.runs_to_descriptors(impl.t([[1 << 40, 0, 1]]), [(0, 1 << 30)], [(0, 1 << 30)])
    with pytest.raises(InvalidIdError, match="shape"):
        impl.m.runs_to_descriptors(impl.t([1, 1, 1]), [(0, 8)], [(0, 8)])
    with pytest.raises(UmallocValueError, match="item_bytes=0"):
        impl.m.runs_to_descriptors(impl.t([[1, 1, 1]]), [(0, 0)], [(0, 0)])
    with pytest.raises(UmallocValueError, match="base_addr"):
        impl.m.runs_to_descriptors(impl.t([[1, 1, 1]]), [(-5, 8)], [(0, 8)])


@HYP
@given(
    segments=run_segments,
    regions=st.lists(
        st.tuples(st.integers(0, 1 << 48), st.integers(0, 1 << 48), st.integers(1, 1 << 20)), max_size=3
    ),
)
def test_descriptors_match_brute_force(impl, segments, regions):
    src = [s + j for s, _, n in segments for j in range(n)]
    dst = [d + j for _, d, n in segments for j in range(n)]
    src_regions = [(sb, item) for sb, _, item in regions]
    dst_regions = [(db, item) for _, db, item in regions]
    runs = impl.m.pages_to_runs(impl.t(src), impl.t(dst))
    desc = impl.m.runs_to_descriptors(runs, src_regions, dst_regions)
    assert desc.dtype == np.uint64
    assert desc.reshape(-1, 3).tolist() == bf_descriptors(bf_runs(src, dst), src_regions, dst_regions)


# --- kernel_page_ids ---------------------------------------------------------------------------------------------


def test_kernel_page_ids_hand_example(impl):
    # ps=4, L=3: page p starts at row 12p; token 5 = page 1 offset 1 -> 13; token 9 = page 2 offset 1 -> 25
    assert as_list(impl.m.kernel_page_ids(impl.t([0, 5, 9]), 4, 3)) == [0, 13, 25]
    # ps=3, L=2: token 7 = page 2 offset 1 -> 13; token 3 = page 1 offset 0 -> 6
    assert as_list(impl.m.kernel_page_ids(impl.t([[7, 3]]), 3, 2)) == [[13, 6]]
    assert impl.m.kernel_page_ids(impl.t([]), 4, 3).shape == (0,)


def test_v2p_zero_dim_ids_translate_and_leave_the_table_alone(impl):
    """A 0-d id tensor is one id: translated like any other, and the v2p table is never written."""
    v2p = impl.t([5, -1, 2])
    got = impl.m.virtual_to_physical(impl.t(5), v2p, 2)  # page 2 -> 2, offset 1: 2 * 2 + 1
    assert got.shape == () and int(got) == 5
    assert int(impl.m.virtual_to_physical(impl.t(2), v2p, 2, strict=False)) == 0  # tombstoned -> sink, offset 0
    assert int(impl.m.virtual_to_physical_pages(impl.t(1), v2p, strict=False)) == tr.SINK_PAGE
    assert int(impl.m.virtual_to_physical_pages(impl.t(0), v2p)) == 5
    assert as_list(v2p) == [5, -1, 2]


def test_v2p_id_space_beyond_int64_is_refused(impl):
    """len(v2p) * page_size virtual tokens must fit int64; otherwise a typed error, not wrapped ids."""
    v2p = impl.t([5, -1, 2])
    with pytest.raises(UmallocValueError, match="page_size <= 3074457345618258602"):
        impl.m.virtual_to_physical(impl.t([0, 1]), v2p, 1 << 62)
    ps = 1 << 61  # 3 pages of 2**61 tokens fit; entries below 2**63 // ps = 4
    assert as_list(impl.m.virtual_to_physical(impl.t([0, 1, 2 * ps + 7]), impl.t([1, -1, 3]), ps)) == [
        ps, ps + 1, 3 * ps + 7]


def test_kernel_page_ids_errors(impl):
    with pytest.raises(InvalidIdError, match="negative"):
        impl.m.kernel_page_ids(impl.t([0, -4]), 4, 3)
    with pytest.raises(InvalidIdError, match="overflow"):
        impl.m.kernel_page_ids(impl.t([1 << 61]), 4, 8)
    with pytest.raises(UmallocValueError, match="layers_per_page"):
        impl.m.kernel_page_ids(impl.t([0]), 4, 0)
    # a page envelope of more than 2**63 - 1 kernel rows: refused up front, whatever the tokens
    for tokens in ([0], []):
        with pytest.raises(UmallocValueError, match="times layers_per_page=4294967296 overflows"):
            impl.m.kernel_page_ids(impl.t(tokens), 1 << 32, 1 << 32)


@HYP
@given(
    tokens=st.lists(st.integers(0, 10_000), max_size=30),
    ps=st.sampled_from([1, 2, 3, 16]),
    layers=st.integers(1, 5),
)
def test_kernel_page_ids_match_brute_force(impl, tokens, ps, layers):
    expect = [(t // ps) * (ps * layers) + t % ps for t in tokens]
    assert as_list(impl.m.kernel_page_ids(impl.t(tokens), ps, layers)) == expect


# --- rank_local_positions -----------------------------------------------------------------------------------------


def test_rank_local_positions_hand_example(impl):
    idx, rows = impl.m.rank_local_positions(impl.t([4, 5, 6, 7, 9]), 2, 1)
    assert as_list(idx) == [1, 3, 4] and as_list(rows) == [2, 3, 4]
    idx, rows = impl.m.rank_local_positions(impl.t([4, 5, 6, 7, 9]), 2, 0)
    assert as_list(idx) == [0, 2] and as_list(rows) == [2, 3]
    idx, rows = impl.m.rank_local_positions(impl.t([]), 4, 3)
    assert idx.shape == (0,) and rows.shape == (0,)


def test_rank_local_positions_errors(impl):
    pos = impl.t([0, 1])
    for dcp_size, rank in [(2, 2), (2, -1), (0, 0), (2, True)]:
        with pytest.raises(UmallocValueError):
            impl.m.rank_local_positions(pos, dcp_size, rank)
    with pytest.raises(InvalidIdError, match=r"positions\[1\] = -3"):
        impl.m.rank_local_positions(impl.t([0, -3]), 2, 0)


@HYP
@given(positions=st.lists(st.integers(0, 200), max_size=30), dcp_size=st.integers(1, 5), data=st.data())
def test_rank_local_positions_match_brute_force(impl, positions, dcp_size, data):
    rank = data.draw(st.integers(0, dcp_size - 1))
    idx, rows = impl.m.rank_local_positions(impl.t(positions), dcp_size, rank)
    expect_idx = [i for i, p in enumerate(positions) if p % dcp_size == rank]
    assert as_list(idx) == expect_idx
    assert as_list(rows) == [positions[i] // dcp_size for i in expect_idx]


# --- bigger seeded batches: the real parallel threshold ------------------------------------------------------


def test_seeded_batches_through_real_dispatch(impl, monkeypatch):
    """Batches above a lowered parallel threshold, through the real chunk-per-thread dispatch of ``cpu``."""
    monkeypatch.setattr(cpu_impl, "PARALLEL_MIN_ITEMS", 1000)
    seed = seed_from_env(20240611)
    rng = random.Random(seed)
    ps, num_pages = 4, 3_000
    v2p = [rng.randrange(1, 50_000) if rng.random() > 0.1 else -1 for _ in range(num_pages)]
    n = 9_999
    vt = [rng.randrange(num_pages * ps) for _ in range(n)]
    got = impl.m.virtual_to_physical(impl.t(vt), impl.t(v2p), ps, strict=False)
    assert as_list(got) == bf_v2p_tokens(vt, v2p, ps)
    with pytest.raises(TombstoneError):
        impl.m.virtual_to_physical(impl.t(vt), impl.t(v2p), ps, strict=True)
    segments = [(rng.randrange(10**6), rng.randrange(10**6), rng.randrange(1, 9)) for _ in range(n // 4)]
    src = [s + j for s, _, k in segments for j in range(k)]
    dst = [d + j for _, d, k in segments for j in range(k)]
    assert as_list(impl.m.pages_to_runs(impl.t(src), impl.t(dst))) == bf_runs(src, dst)
    pages = [rng.randrange(10**6) for _ in range(n // ps)]
    tokens = [p * ps + j for p in pages for j in range(ps)]
    assert as_list(impl.m.tokens_to_pages(impl.t(tokens), ps)) == pages


# --- numpy inputs and devices ---------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [ref_impl, cpu_impl], ids=lambda m: m.NAME)
def test_numpy_inputs_are_accepted(module):
    v2p = np.array([5, -1, 2], dtype=np.int64)
    got = module.virtual_to_physical(np.array([0, 3, 5], dtype=np.int64), v2p, 2, strict=False)
    assert isinstance(got, torch.Tensor) and got.tolist() == [10, 1, 5]
    with pytest.raises(InvalidIdError, match="int64"):
        module.virtual_to_physical(np.array([0], dtype=np.int16), v2p, 2)


def test_cpu_impl_rejects_other_devices():
    meta = torch.empty(3, dtype=torch.int64, device="meta")
    with pytest.raises(UmallocValueError, match="CPU tensors"):
        cpu_impl.virtual_to_physical(meta, meta, 2)
    with pytest.raises(UmallocValueError, match="CPU tensors"):
        cpu_impl.pages_to_runs(meta, meta)


def test_mixed_devices_rejected():
    with pytest.raises(UmallocValueError, match="device|on meta"):
        ref_impl.virtual_to_physical(
            torch.zeros(2, dtype=torch.int64), torch.empty(3, dtype=torch.int64, device="meta"), 2
        )


@pytest.mark.skipif(CUDA_OK, reason="checks behaviour without a usable GPU")
def test_cuda_module_imports_and_refuses_without_gpu():
    assert not cuda_impl.available()
    assert cuda_impl.unavailable_reason()
    with pytest.raises(UmallocValueError, match="unavailable"):
        cuda_impl.virtual_to_physical(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 1)
    with pytest.raises(UmallocValueError, match="unavailable"):
        cuda_impl.pages_to_runs(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))


# --- dispatch ----------------------------------------------------------------------------------------------------


def test_get_translator_auto(monkeypatch):
    monkeypatch.delenv(tr.ENV_VAR, raising=False)
    assert tr.get_translator() is cpu_impl
    assert tr.get_translator("cpu") is cpu_impl
    assert tr.get_translator(torch.device("cpu")) is cpu_impl
    assert tr.get_translator("meta") is ref_impl
    assert tr.get_translator("cuda") is (cuda_impl if CUDA_OK else ref_impl)
    assert "reference" in tr.available_impls() and "cpu" in tr.available_impls()


def test_get_translator_forced(monkeypatch):
    monkeypatch.delenv(tr.ENV_VAR, raising=False)
    assert tr.get_translator("cpu", impl="reference") is ref_impl
    assert tr.get_translator("cpu", impl=" CPU ") is cpu_impl
    with pytest.raises(UmallocValueError, match="not a translator"):
        tr.get_translator(impl="numba")
    with pytest.raises(UmallocValueError, match="cannot run on device cuda"):
        tr.get_translator("cuda", impl="cpu")
    if not CUDA_OK:
        with pytest.raises(UmallocValueError, match="'cuda' is unavailable"):
            tr.get_translator("cuda", impl="cuda")
    monkeypatch.setenv(tr.ENV_VAR, "reference")
    assert tr.get_translator() is ref_impl
    assert tr.get_translator(impl="cpu") is cpu_impl  # the argument wins over the environment
    monkeypatch.setenv(tr.ENV_VAR, "auto")
    assert tr.get_translator() is cpu_impl
    monkeypatch.setenv(tr.ENV_VAR, "bogus")
    with pytest.raises(UmallocValueError, match="UMALLOC_TRANSLATOR"):
        tr.get_translator()


def test_cpu_parallel_threshold_env(monkeypatch):
    monkeypatch.delenv(cpu_impl.PARALLEL_ENV_VAR, raising=False)
    assert cpu_impl._parallel_min_items_from_env(7) == 7
    monkeypatch.setenv(cpu_impl.PARALLEL_ENV_VAR, "0")
    assert cpu_impl._parallel_min_items_from_env(7) == 0
    for bad in ("-1", "many"):
        monkeypatch.setenv(cpu_impl.PARALLEL_ENV_VAR, bad)
        with pytest.raises(UmallocValueError, match=cpu_impl.PARALLEL_ENV_VAR):
            cpu_impl._parallel_min_items_from_env(7)


# --- strict is a bool with one default; overflow, int32 ids, meta/sparse, named ranges ------------------------


def test_strict_default_is_true_everywhere(impl):
    """One default in every implementation (and the protocol): a tombstone raises unless strict=False."""
    assert tr.STRICT_DEFAULT is True
    v2p = impl.t([5, -1, 2])
    with pytest.raises(TombstoneError):
        impl.m.virtual_to_physical(impl.t([3]), v2p, 2)
    with pytest.raises(TombstoneError):
        impl.m.virtual_to_physical_pages(impl.t([1]), v2p)
    for fn in (impl.m.virtual_to_physical, impl.m.virtual_to_physical_pages):
        assert inspect.signature(fn).parameters["strict"].default is True


@pytest.mark.parametrize("bad", [0, 1, "no", "yes", None, 1.0])
def test_strict_must_be_a_bool(impl, bad):
    v2p = impl.t([5, 3, 2])
    out = impl.t([-7, -7])
    with pytest.raises(UmallocValueError, match="strict must be True or False"):
        impl.m.virtual_to_physical(impl.t([0, 1]), v2p, 2, out=out, strict=bad)
    with pytest.raises(UmallocValueError, match="strict must be True or False"):
        impl.m.virtual_to_physical_pages(impl.t([0, 1]), v2p, out=out, strict=bad)
    assert as_list(out) == [-7, -7]
    assert as_list(impl.m.virtual_to_physical_pages(impl.t([0]), v2p, strict=np.bool_(True))) == [5]


def test_entry_overflow_is_refused_never_wrapped(impl):
    """A v2p entry whose physical ids p * page_size + offset do not fit int64 raises; it used to wrap (to 0)."""
    ps = 1 << 61  # 3 pages of 2**61 tokens; the largest entry whose ids fit is (2**63 - 1 - (ps - 1)) // ps = 3
    for strict in (False, True):
        out = impl.t([-7, -7])
        with pytest.raises(InvalidIdError, match=r"vtokens\[1\] = 2305843009213693952 .*allowed v2p entries <= 3"):
            impl.m.virtual_to_physical(impl.t([0, ps]), impl.t([1, 4, 3]), ps, out=out, strict=strict)
        assert as_list(out) == [-7, -7]
    # the named bound is exactly what is allowed: entry 3 translates, its last token is 2**63 - 1
    assert as_list(impl.m.virtual_to_physical(impl.t([ps - 1]), impl.t([3]), ps)) == [(1 << 63) - 1]


def test_range_error_leaves_out_untouched_also_when_later_ids_are_fine(impl):
    v2p = impl.t([5, 3, 2])
    out = impl.t([-7] * 6)
    with pytest.raises(InvalidIdError, match=r"vtokens\[4\] = 6 is out of range.*\[0, 6\)"):
        impl.m.virtual_to_physical(impl.t([0, 1, 2, 3, 6, 0]), v2p, 2, out=out)
    assert as_list(out) == [-7] * 6
    with pytest.raises(TombstoneError):
        impl.m.virtual_to_physical(impl.t([0, 1, 2, 3, 4, 5]), impl.t([5, 3, -1]), 2, out=out)
    assert as_list(out) == [-7] * 6


def test_int32_ids_are_accepted_like_int64(impl):
    """vLLM's and SGLang's block tables are int32: accepted, results keep int32, values that do not fit are
    refused (and out stays untouched)."""
    v2p = impl.t([5, -1, 2])
    i32 = impl.t([0, 1, 4, 5]).to(torch.int32)
    got = impl.m.virtual_to_physical(i32, v2p, 2)
    assert got.dtype == torch.int32 and as_list(got) == [10, 11, 4, 5]
    pages = impl.t([2, 0]).to(torch.int32)
    got = impl.m.virtual_to_physical_pages(pages, v2p, out=pages)
    assert got is pages and pages.dtype == torch.int32 and as_list(pages) == [2, 5]
    # entry 2**27 of 16-token pages: physical ids reach 2**31 + 15, beyond int32 (the int64 call is fine)
    big = impl.t([1 << 27])
    out = torch.full((1,), -7, dtype=torch.int32, device=impl.device)
    with pytest.raises(InvalidIdError, match=r"does not fit torch.int32: allowed v2p entries <= 134217727"):
        impl.m.virtual_to_physical(impl.t([15]).to(torch.int32), big, 16, out=out)
    assert as_list(out) == [-7]
    assert as_list(impl.m.virtual_to_physical(impl.t([15]), big, 16)) == [(1 << 31) + 15]
    # the named bound is allowed: entry 134217727 -> its last id is 2**31 - 1
    top = impl.m.virtual_to_physical(impl.t([15]).to(torch.int32), impl.t([134217727]), 16)
    assert as_list(top) == [(1 << 31) - 1]
    with pytest.raises(InvalidIdError, match="allowed v2p entries <= 2147483647"):
        impl.m.virtual_to_physical_pages(impl.t([0]).to(torch.int32), impl.t([1 << 31]))
    # the other functions take int32 as well
    tok = impl.t([8, 9, 10, 11]).to(torch.int32)
    got = impl.m.tokens_to_pages(tok, 4)
    assert got.dtype == torch.int32 and as_list(got) == [2]
    runs = impl.m.pages_to_runs(impl.t([3, 4]).to(torch.int32), impl.t([7, 8]).to(torch.int32))
    assert runs.dtype == torch.int64 and as_list(runs) == [[3, 7, 2]]
    got = impl.m.kernel_page_ids(impl.t([0, 5, 9]).to(torch.int32), 4, 3)
    assert got.dtype == torch.int32 and as_list(got) == [0, 13, 25]
    with pytest.raises(InvalidIdError, match=r"allowed tokens in \[0, 1073741823\]"):
        impl.m.kernel_page_ids(impl.t([1 << 30]).to(torch.int32), 1, 2)
    assert as_list(impl.m.kernel_page_ids(impl.t([(1 << 30) - 1]).to(torch.int32), 1, 2)) == [(1 << 31) - 2]
    idx, rows = impl.m.rank_local_positions(impl.t([4, 5, 6, 7, 9]).to(torch.int32), 2, 1)
    assert idx.dtype == torch.int64 and rows.dtype == torch.int32
    assert as_list(idx) == [1, 3, 4] and as_list(rows) == [2, 3, 4]


def test_kernel_ids_bound_in_message_is_the_allowed_one(impl):
    """'allowed tokens in [0, top]': top is accepted, top + 1 refused."""
    ps, layers = 4, 8
    with pytest.raises(InvalidIdError, match=r"allowed tokens in \[0, (\d+)\]") as info:
        impl.m.kernel_page_ids(impl.t([1 << 61]), ps, layers)
    top = int(re.search(r"allowed tokens in \[0, (\d+)\]", str(info.value)).group(1))
    assert (top // ps) * ps * layers + top % ps <= (1 << 63) - 1
    assert as_list(impl.m.kernel_page_ids(impl.t([top]), ps, layers)) == [(top // ps) * ps * layers + top % ps]
    with pytest.raises(InvalidIdError):
        impl.m.kernel_page_ids(impl.t([top + 1]), ps, layers)


@pytest.mark.parametrize("module", [ref_impl, cpu_impl], ids=lambda m: m.NAME)
def test_meta_and_sparse_tensors_raise_typed_errors(module):
    meta = torch.zeros(3, dtype=torch.int64, device="meta")
    sparse = torch.tensor([0, 1, 0]).to_sparse()
    dense = torch.tensor([0, 1, 2])
    for bad in (meta, sparse):
        for call in (
            lambda b: module.virtual_to_physical(b, dense, 1),
            lambda b: module.virtual_to_physical(dense, b, 1),
            lambda b: module.virtual_to_physical_pages(dense, dense, out=b),
            lambda b: module.tokens_to_pages(b, 1),
            lambda b: module.pages_to_runs(b, b),
            lambda b: module.kernel_page_ids(b, 1, 1),
            lambda b: module.rank_local_positions(b, 2, 0),
            lambda b: module.runs_to_descriptors(b[None, :] if b.layout is torch.strided else
                                                 torch.tensor([[0, 1, 1]]).to_sparse(), [(0, 8)], [(0, 8)]),
        ):
            with pytest.raises(InvalidIdError):
                call(bad)


def test_page_size_beyond_int64_is_refused_with_the_allowed_range(impl):
    with pytest.raises(UmallocValueError, match=r"page_size must be an int in \[1, 9223372036854775807\]"):
        impl.m.virtual_to_physical(impl.t([]), impl.t([]), 1 << 70)
    with pytest.raises(UmallocValueError, match=r"item_bytes=18446744073709551616 must lie in \[1, 2\*\*64\)"):
        impl.m.runs_to_descriptors(impl.t([[1, 1, 1]]), [(0, 1 << 64)], [(0, 1 << 64)])
