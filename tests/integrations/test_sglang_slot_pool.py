"""umalloc.integrations.sglang.pools.SlotPool without SGLang (the main suite): SGLang's slot-id semantics with
values worked out by hand from SGLang's rules (pages 1..num_pages, token = page * page_size + offset)."""

from __future__ import annotations

import pytest
import torch

from umalloc.errors import DoubleFreeError, InvalidIdError, UmallocValueError
from umalloc.integrations.sglang import UnsupportedSGLangVersion, check_version
from umalloc.integrations.sglang.pools import SlotPool


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def test_alloc_floors_to_whole_pages_and_refuses_without_change() -> None:
    pool = SlotPool(3, 4)
    assert pool.alloc_tokens(6).tolist() == [4, 5, 6, 7]  # 6 // 4 = one page (page 1)
    assert pool.alloc_tokens(12) is None  # 3 pages asked, 2 free
    assert pool.available_tokens() == 8
    assert pool.alloc_tokens(8).tolist() == list(range(8, 16))
    assert pool.available_tokens() == 0
    pool.check_invariants()


def test_extend_fills_the_tail_page_then_fresh_pages() -> None:
    pool = SlotPool(4, 4)
    first = pool.alloc_extend(t(0, 0), t(5, 2), t(-1, -1), 7)
    assert first.tolist() == [4, 5, 6, 7, 8, 12, 13]  # request 0: pages 1, 2; request 1: page 3
    # request 0 grows 5 -> 9: slots 9, 10, 11 of page 2, then page 4
    assert pool.alloc_extend(t(5), t(9), t(8), 4).tolist() == [9, 10, 11, 16]
    assert pool.alloc_decode(t(3), t(13)).tolist() == [14]  # position 2 of page 3
    assert pool.alloc_decode(t(5), t(15)) is None  # position 4 needs a fifth page
    assert pool.available_tokens() == 0
    pool.check_invariants()


def test_extend_token_count_must_match() -> None:
    pool = SlotPool(4, 4)
    with pytest.raises(InvalidIdError, match="extend_num_tokens"):
        pool.alloc_extend(t(0), t(5), t(-1), 4)
    assert pool.available_pages() == 4


def test_free_group_defers_until_end_and_frees_in_one_call() -> None:
    pool = SlotPool(4, 2)
    a = pool.alloc_tokens(4)  # pages 1, 2
    pool.begin_group()
    pool.free_tokens(a[:1])
    pool.free_pages(t(2))
    pool.free_pages(t(1))  # page 1 named twice in one group: freed once
    assert pool.available_pages() == 2  # deferred
    with pytest.raises(UmallocValueError, match="already open"):
        pool.begin_group()
    pool.end_group()
    assert pool.available_pages() == 4
    with pytest.raises(UmallocValueError, match="no free group"):
        pool.end_group()
    with pytest.raises(DoubleFreeError):
        pool.free_pages(t(1))


def test_lowest_free_page_first_after_frees() -> None:
    pool = SlotPool(5, 1)
    assert pool.alloc_tokens(5).tolist() == [1, 2, 3, 4, 5]
    pool.free_tokens(t(4, 2))
    assert pool.free_page_ids().tolist() == [2, 4]
    assert pool.alloc_tokens(2).tolist() == [2, 4]


def test_clear_and_bad_sizes() -> None:
    pool = SlotPool(2, 8)
    pool.alloc_tokens(16)
    pool.clear()
    assert pool.available_tokens() == 16
    for bad in (0, -1, True, 1.5):
        with pytest.raises(UmallocValueError):
            SlotPool(bad, 1)  # type: ignore[arg-type]
    with pytest.raises(UmallocValueError):
        pool.alloc_tokens(-1)


def test_version_check_names_the_untested_version() -> None:
    with pytest.raises(UnsupportedSGLangVersion, match="SGLang 0.6.0 is untested") as info:
        check_version("0.6.0")
    assert info.value.version == "0.6.0"
