"""``umalloc.translators.coalesce_runs``: the translators' ``pages_to_runs`` as host numpy, optionally bounded to
pages. Expected values come from hand computation or a brute-force loop written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from umalloc.errors import InvalidIdError, UmallocValueError
from umalloc.translators import coalesce_runs
from umalloc.translators import cpu as cpu_impl
from umalloc.translators import cuda as cuda_impl
from umalloc.translators import reference as ref_impl

TRANSLATORS = [None, ref_impl, cpu_impl, pytest.param(cuda_impl, marks=pytest.mark.skipif(
    not cuda_impl.available(), reason=f"cuda translator: {cuda_impl.unavailable_reason()}"))]
I64_MAX = (1 << 63) - 1


def bf_runs(src: list[int], dst: list[int], page_size: int | None) -> list[list[int]]:
    """Runs by a plain loop: a pair extends the open run when both ids step by one and, with a page size,
    neither id starts a new page."""
    runs: list[list[int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            crosses = page_size is not None and (s % page_size == 0 or d % page_size == 0)
            if s == s0 + n and d == d0 + n and not crosses:
                runs[-1][2] += 1
                continue
        runs.append([s, d, 1])
    return runs


def _inputs(src: list[int], dst: list[int], translator: object) -> tuple[object, object]:
    if translator is cuda_impl:
        return torch.tensor(src, dtype=torch.int64).cuda(), torch.tensor(dst, dtype=torch.int64).cuda()
    if translator is ref_impl:
        return torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)


def test_hand_examples() -> None:
    src, dst = np.array([3, 4, 5, 9]), np.array([7, 8, 2, 3])
    assert coalesce_runs(src, dst).tolist() == [[3, 7, 2], [5, 2, 1], [9, 3, 1]]
    # pages of 4 tokens: 2 3 | 4 5 on the source, 6 7 | 8 9 on the destination
    assert coalesce_runs(np.array([2, 3, 4, 5]), np.array([6, 7, 8, 9]), page_size=4).tolist() == [
        [2, 6, 2], [4, 8, 2]]
    # a boundary on one side only still cuts: source 5 6 7 8 (page 4 = tokens 4..7), destination 9 10 11 12 (8..11)
    assert coalesce_runs(np.array([5, 6, 7, 8]), np.array([9, 10, 11, 12]), page_size=4).tolist() == [
        [5, 9, 3], [8, 12, 1]]
    assert coalesce_runs(np.array([5, 6, 7, 8]), np.array([1, 2, 3, 4]), page_size=4).tolist() == [
        [5, 1, 3], [8, 4, 1]]
    # int32 tensors and CPU tensors give host int64 runs
    got = coalesce_runs(torch.tensor([2, 3], dtype=torch.int32), torch.tensor([6, 7], dtype=torch.int32), page_size=2)
    assert got.dtype == np.int64 and got.tolist() == [[2, 6, 2]]
    for ps in (None, 3):
        empty = coalesce_runs(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), page_size=ps)
        assert empty.shape == (0, 3) and empty.dtype == np.int64


@pytest.mark.parametrize("translator", TRANSLATORS)
@settings(max_examples=60, deadline=None)
@given(segments=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(1, 9)), max_size=8),
       page_size=st.one_of(st.none(), st.integers(1, 9)))
def test_matches_brute_force(translator: object, segments: list[tuple[int, int, int]], page_size: int | None) -> None:
    src = [s + j for s, _, n in segments for j in range(n)]
    dst = [d + j for _, d, n in segments for j in range(n)]
    got = coalesce_runs(*_inputs(src, dst, translator), page_size=page_size, translator=translator)
    assert isinstance(got, np.ndarray) and got.dtype == np.int64
    assert got.reshape(-1, 3).tolist() == bf_runs(src, dst, page_size)


def test_bad_input_raises_typed_errors() -> None:
    ok = np.array([1, 2])
    with pytest.raises(InvalidIdError, match="negative"):
        coalesce_runs(np.array([1, -2]), ok)
    with pytest.raises(InvalidIdError, match=r"dst\[0\] = -1 is negative"):
        coalesce_runs(ok, np.array([-1, 2]), page_size=4)
    with pytest.raises(InvalidIdError, match="too large to coalesce in pages of 4"):
        coalesce_runs(np.array([1, I64_MAX]), ok, page_size=4)
    with pytest.raises(InvalidIdError, match="dtype"):
        coalesce_runs(np.array([1.0, 2.0]), ok, page_size=4)
    with pytest.raises(InvalidIdError, match="1-D"):
        coalesce_runs(np.array([[1, 2]]), np.array([[1, 2]]), page_size=4)
    with pytest.raises(UmallocValueError, match="equal lengths"):
        coalesce_runs(ok, np.array([1]), page_size=4)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(UmallocValueError, match="page_size"):
            coalesce_runs(ok, ok, page_size=bad)  # type: ignore[arg-type]
    # the largest page size: no id reaches a boundary but the last one, which leaves no room to spread
    assert coalesce_runs(np.array([7, 8]), ok, page_size=I64_MAX).tolist() == [[7, 1, 2]]
    limit = I64_MAX - 1
    assert coalesce_runs(np.array([limit]), np.array([0]), page_size=I64_MAX).tolist() == [[limit, 0, 1]]
