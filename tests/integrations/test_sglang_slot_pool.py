"""umalloc.integrations.sglang.pools.SlotPool without SGLang (the main suite): SGLang's slot-id semantics with
values worked out by hand from SGLang's rules (pages 1..num_pages, token = page * page_size + offset)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from umalloc.errors import DoubleFreeError, InvalidIdError, UmallocValueError
from umalloc.integrations.sglang import UnsupportedSGLangVersion, check_version
from umalloc.integrations.sglang.pools import SlotPool
from umalloc.integrations.sglang.tokens import TokenSlotPool


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


# ---- the page-size-1 pool (index vectors) ----------------------------------------------------------------------
def test_token_pool_hands_out_slots_in_order_then_freed_slots_oldest_first() -> None:
    pool = TokenSlotPool(6)
    assert pool.alloc_tokens(4).tolist() == [1, 2, 3, 4]
    pool.free_tokens(t(3, 1))
    assert pool.available_tokens() == 4 and pool.live_pages() == 2
    assert pool.free_page_ids().tolist() == [1, 3, 5, 6]
    assert pool.alloc_tokens(3).tolist() == [5, 6, 3]       # the never-used slots, then the freed ones in order
    assert pool.alloc_tokens(2) is None                       # one free
    assert pool.alloc_tokens(1).tolist() == [1]
    assert pool.available_tokens() == 0
    pool.free_tokens(t(2, 2, 4))                              # slot 2 named twice: freed once
    assert pool.alloc_tokens(2).tolist() == [2, 4]            # the ring wrapped around
    pool.check_invariants()


def test_token_pool_refuses_misuse_and_changes_nothing() -> None:
    pool = TokenSlotPool(4)
    a = pool.alloc_tokens(3)
    before = (pool.available_tokens(), pool.free_page_ids().tolist())
    for bad, err in ((t(0), InvalidIdError), (t(5), InvalidIdError), (t(-1), InvalidIdError),
                     (t(1, 4), DoubleFreeError), (t(2, 9), InvalidIdError)):
        with pytest.raises(err):
            pool.free_tokens(bad)
        assert (pool.available_tokens(), pool.free_page_ids().tolist()) == before
    pool.free_tokens(a[:1])
    with pytest.raises(DoubleFreeError):
        pool.free_pages(t(1))
    with pytest.raises(UmallocValueError):
        pool.alloc_tokens(-1)
    with pytest.raises(InvalidIdError):
        pool.free_tokens([2])  # type: ignore[arg-type]
    pool.check_invariants()


def test_token_pool_group_defers_and_a_bad_group_changes_nothing() -> None:
    pool = TokenSlotPool(4)
    a = pool.alloc_tokens(4)
    pool.begin_group()
    pool.free_tokens(a[:2])
    pool.free_pages(t(1))                                     # named twice in the group: freed once
    assert pool.available_tokens() == 0
    pool.end_group()
    assert pool.available_tokens() == 2 and pool.free_page_ids().tolist() == [1, 2]
    pool.begin_group()
    pool.free_tokens(t(3))
    pool.free_tokens(t(1))                                    # already free: the whole group is refused
    with pytest.raises(DoubleFreeError):
        pool.end_group()
    assert not pool.group_open and pool.available_tokens() == 2 and pool.live_pages() == 2
    pool.free_tokens(t(3, 4, 4))
    assert pool.alloc_tokens(4).tolist() == [1, 2, 3, 4]
    pool.clear()
    assert pool.alloc_tokens(2).tolist() == [1, 2]
    pool.check_invariants()


def test_token_pool_matches_a_reference_free_list_on_a_seeded_sequence() -> None:
    """A plain Python deque (alloc from the front, frees appended in order, a repeat within one call or group
    once, a group's frees appended at its end, a group with a bad free dropped whole) as the reference: same ids,
    same refusals, same free set, on random alloc / free / group sequences."""
    import collections
    import random

    from umalloc.testing import seed_from_env

    seed = seed_from_env(3703)
    rng = random.Random(seed)
    n = 40
    pool, ref = TokenSlotPool(n), collections.deque(range(1, n + 1))
    live: list[int] = []
    group: list[int] | None = None     # the open group's frees, in order (None: no group open)
    group_bad = False
    for _ in range(4000):   # over 5,000 frees: past the end of the first log buffer (4,096 positions)
        r = rng.random()
        if r < 0.4:
            k = rng.randint(0, 12)
            got = pool.alloc_tokens(k)
            if k > len(ref):
                assert got is None, f"seed={seed}"
                continue
            want = [ref.popleft() for _ in range(k)]
            assert got is not None and got.tolist() == want, f"seed={seed}"
            live += want
        elif r < 0.5:
            if group is None:
                pool.begin_group()
                group, group_bad = [], False
                continue
            if group_bad:
                with pytest.raises(DoubleFreeError):
                    pool.end_group()
            else:
                pool.end_group()
                for s in dict.fromkeys(group):
                    live.remove(s)
                    ref.append(s)
            group = None
        elif r < 0.52 and ref and group is not None:
            pool.free_tokens(torch.tensor([ref[0]]))   # a free slot: the whole group is refused at its end
            group_bad = True
        elif live:
            pick = rng.sample(live, rng.randint(1, min(6, len(live))))   # in a group: maybe freed in it already
            ids = pick + pick[:1] if rng.random() < 0.2 else pick
            pool.free_tokens(torch.tensor(ids, dtype=torch.int64))
            if group is not None:
                group += ids
            else:
                for s in dict.fromkeys(ids):
                    live.remove(s)
                    ref.append(s)
        assert pool.available_tokens() == len(ref), f"seed={seed}"
        assert pool.free_page_ids().tolist() == sorted(ref), f"seed={seed}"
        pool.check_invariants()


def test_token_pool_ids_handed_out_never_change_across_log_buffers() -> None:
    """Ids are views of the write-once log: after enough frees to fill several log buffers, every earlier result
    still holds what it held when returned."""
    pool = TokenSlotPool(50_000)
    kept: list[tuple[torch.Tensor, list[int]]] = []
    for i in range(400):
        got = pool.alloc_tokens(700)
        assert got is not None
        kept.append((got, got.tolist()))
        pool.free_tokens(got[: 700 - i % 3])
    assert all(ids.tolist() == seen for ids, seen in kept)
    pool.check_invariants()


def test_token_pool_takes_numpy_integer_counts_and_stays_on_python_ints() -> None:
    pool = TokenSlotPool(8)
    assert pool.alloc_tokens(np.int64(2)).tolist() == [1, 2]
    assert pool.alloc_tokens(np.uint64(1)).tolist() == [3]   # np.int64 + np.uint64 is a float64 in numpy 2
    assert pool.alloc_tokens(np.int32(2)).tolist() == [4, 5]
    assert type(pool.available_tokens()) is int and pool.available_tokens() == 3
    pool.free_tokens(t(1))
    assert pool.alloc_tokens(4).tolist() == [6, 7, 8, 1]
    pool.check_invariants()
