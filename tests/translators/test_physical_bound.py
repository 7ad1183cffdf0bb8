"""Issue 26 item 20: a v2p table holding a value that is not a physical page id (``2**62`` in a space of a few
pages) is refused with a typed error when the caller states the physical space (``num_physical_pages``), in every
translator implementation that runs here, for both translations, strict or not; nothing is written into ``out``.
Without the bound an entry looked up must still be a physical page id (below ``MAX_PHYSICAL_PAGES`` = ``2**48``)
whose ids fit the id dtype: ``2**62`` is refused on every path, fast or checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from umalloc.errors import InvalidIdError, UmallocValueError
from umalloc.translators import cpu as cpu_impl
from umalloc.translators import cuda as cuda_impl
from umalloc.translators import reference as ref_impl

IMPLS = [pytest.param(ref_impl, "cpu", id="reference"), pytest.param(cpu_impl, "cpu", id="cpu"),
         pytest.param(cuda_impl, "cuda", id="cuda", marks=pytest.mark.skipif(
             not cuda_impl.available(), reason=f"cuda translator: {cuda_impl.unavailable_reason()}"))]
NUM_PHYSICAL = 6  # the physical page space the tables below index: ids 0..5


def _calls(m, ids: torch.Tensor, v2p: torch.Tensor, out: torch.Tensor, strict: bool, bound: object):
    return [lambda: m.virtual_to_physical_pages(ids, v2p, out=out, strict=strict, num_physical_pages=bound),
            lambda: m.virtual_to_physical(ids * 2, v2p, 2, out=out, strict=strict, num_physical_pages=bound)]


@pytest.mark.parametrize(("m", "device"), IMPLS)
@pytest.mark.parametrize("entry", [2**62, NUM_PHYSICAL, 2**63 - 1])
@pytest.mark.parametrize("strict", [True, False])
def test_a_v2p_entry_that_is_no_physical_page_id_is_refused(m, device, entry, strict):
    ids = torch.tensor([0, 2], device=device)
    v2p = torch.tensor([3, -1, 5, entry], device=device)  # the bad entry is at index 3, not even looked up
    out = torch.full((2,), -7, dtype=torch.int64, device=device)
    for call in _calls(m, ids, v2p, out, strict, NUM_PHYSICAL):
        with pytest.raises(InvalidIdError, match=rf"v2p\[3\] = {entry} is not a physical page id"):
            call()
        assert out.tolist() == [-7, -7]  # nothing written
    assert v2p.tolist() == [3, -1, 5, entry]
    # the same table translates (as before) without a stated bound: its entries fit int64 pages
    assert m.virtual_to_physical_pages(ids, v2p, strict=strict).tolist() == [3, 5]


@pytest.mark.parametrize(("m", "device"), IMPLS)
def test_entries_inside_the_stated_space_translate_as_without_it(m, device):
    ids = torch.tensor([0, 1, 2], device=device)
    v2p = torch.tensor([3, -1, 5], device=device)
    want = [3, 0, 5]  # by hand: v2p[i], the tombstone to the sink page 0
    assert m.virtual_to_physical_pages(ids, v2p, strict=False, num_physical_pages=NUM_PHYSICAL).tolist() == want
    assert m.virtual_to_physical(ids * 2 + 1, v2p, 2, strict=False,
                                 num_physical_pages=NUM_PHYSICAL).tolist() == [7, 1, 11]
    if device == "cpu":  # a numpy table takes the same check
        with pytest.raises(InvalidIdError, match="not a physical page id"):
            m.virtual_to_physical_pages(ids, np.array([3, -1, 2**62]), num_physical_pages=NUM_PHYSICAL)


@pytest.mark.parametrize(("m", "device"), IMPLS)
@pytest.mark.parametrize("bound", [-1, True, 1.5, "6", 2**63, [6]])
def test_a_bad_bound_is_refused(m, device, bound):
    ids, v2p = torch.tensor([0], device=device), torch.tensor([1], device=device)
    with pytest.raises(UmallocValueError, match="num_physical_pages"):
        m.virtual_to_physical_pages(ids, v2p, num_physical_pages=bound)


@pytest.mark.parametrize(("m", "device"), IMPLS)
@pytest.mark.parametrize("entry", [2**62, 2**48, 2**63 - 1])
@pytest.mark.parametrize("strict", [True, False])
def test_an_entry_looked_up_beyond_any_physical_page_is_refused_without_a_bound(m, device, entry, strict):
    ids = torch.tensor([0, 3], device=device)
    v2p = torch.tensor([3, -1, 5, entry], device=device)
    out = torch.full((2,), -7, dtype=torch.int64, device=device)
    calls = [lambda: m.virtual_to_physical_pages(ids, v2p, out=out, strict=strict),
             lambda: m.virtual_to_physical(ids, v2p, 1, out=out, strict=strict)]
    if device == "cpu":  # numpy ids and tables, and a batch long enough for the parallel path
        many = np.full(70_000, 3, dtype=np.int64)
        calls += [lambda: m.virtual_to_physical_pages(ids.numpy(), v2p.numpy(), strict=strict),
                  lambda: m.virtual_to_physical_pages(many, v2p.numpy(), strict=strict)]
    for call in calls:
        with pytest.raises(InvalidIdError, match=rf"v2p entry {entry} is not a physical page id.*<= {2**48 - 1}"):
            call()
        assert out.tolist() == [-7, -7]
    # the largest physical page id translates: 2**48 - 1 pages
    top = torch.tensor([2**48 - 1], device=device)
    assert m.virtual_to_physical_pages(torch.tensor([0], device=device), top).tolist() == [2**48 - 1]
