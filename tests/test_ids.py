"""``umalloc.ids``: the one id validator. Each case states its expected result by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from umalloc.errors import InvalidIdError, LeaseError
from umalloc.ids import check_id_dtype, check_id_tensor, host_ids, id_batch

I64_MAX = (1 << 63) - 1


def test_int64_inputs_come_back_without_a_copy() -> None:
    a = np.array([3, 4], dtype=np.int64)
    assert host_ids(a, "ids") is a
    t = torch.tensor([5, 6])
    got = host_ids(t, "ids")
    assert got.tolist() == [5, 6] and np.shares_memory(got, t.numpy())


@pytest.mark.parametrize("x", [np.array([7, 8], dtype=np.uint8), np.array([7, 8], dtype=np.int32),
                               torch.tensor([7, 8], dtype=torch.int16), [7, 8], (7, np.int32(8))])
def test_other_integers_are_converted_once(x: object) -> None:
    got = host_ids(x, "ids", lists=True)
    assert got.dtype == np.int64 and got.tolist() == [7, 8]


def test_accept_names_the_dtypes_taken() -> None:
    with pytest.raises(InvalidIdError, match=r"ids: dtype torch.int32; allowed int64$"):
        host_ids(torch.tensor([1], dtype=torch.int32), "ids", accept="int64")
    with pytest.raises(InvalidIdError, match="numpy dtype int16; allowed int64 or int32"):
        host_ids(np.array([1], dtype=np.int16), "ids", accept="int32")
    assert host_ids(np.array([1], dtype=np.int32), "ids", accept="int32").tolist() == [1]
    check_id_dtype(torch.int32, "ids", "int32")
    with pytest.raises(InvalidIdError, match="integer dtype"):
        check_id_dtype(np.float32, "ids")


@pytest.mark.parametrize("x, match", [
    (torch.tensor([1.0]), "integer dtype"),
    (torch.tensor([True]), "integer dtype"),
    (np.array([1.5]), "integer dtype"),
    (np.array([1], dtype=">i8"), ">i8; allowed native int64"),
    (np.array([[1, 2]]), r"shape \(1, 2\); allowed 1-D"),
    (torch.zeros(2, 2, dtype=torch.int64), "allowed 1-D"),
    (torch.empty(2, dtype=torch.int64, device="meta"), "allowed a strided CPU or CUDA tensor"),
    (torch.tensor([1, 2]).to_sparse(), "allowed a strided CPU or CUDA tensor"),
    (np.array([1 << 63], dtype=np.uint64), r"does not fit int64 \(2\*\*63 or more\)"),
    ([1, 1 << 63], "does not fit int64"),
    ([1, 2.0], "integer dtype"),
    ([[1, 2]], "1-D list"),
    ("12", "got str"),
])
def test_refusals_are_typed_and_name_what_is_allowed(x: object, match: str) -> None:
    with pytest.raises(InvalidIdError, match=match):
        host_ids(x, "ids", lists=True)


def test_lists_only_where_taken_and_the_callers_error_class() -> None:
    with pytest.raises(InvalidIdError, match="allowed a 1-D integer torch tensor or numpy array$"):
        host_ids([1, 2], "ids")
    with pytest.raises(LeaseError, match=r"pages\['full'\]: numpy dtype float64"):
        host_ids([1.0], "pages['full']", lists=True, error=LeaseError)
    with pytest.raises(LeaseError):
        check_id_tensor(torch.tensor([0.5]), "pages", error=LeaseError)
    assert host_ids([], "ids", lists=True).dtype == np.int64


def test_nonnegative_and_id_batch() -> None:
    with pytest.raises(InvalidIdError, match=rf"negative id -1; allowed \[0, {I64_MAX}\]"):
        host_ids(np.array([2, -1]), "ids", nonnegative=True)
    with pytest.raises(InvalidIdError, match=rf"value -3 is negative; allowed \[0, {I64_MAX}\]"):
        host_ids([-3], "ids", lists=True, nonnegative=True)
    with pytest.raises(InvalidIdError, match=rf"allowed \[0, {I64_MAX}\]"):
        host_ids(np.array([1 << 63], dtype=np.uint64), "ids", nonnegative=True)
    assert id_batch([-4, 5], "slots").tolist() == [-4, 5]          # signs kept: callers check their ranges
    assert id_batch(torch.tensor([1], dtype=torch.int32), "slots").tolist() == [1]
