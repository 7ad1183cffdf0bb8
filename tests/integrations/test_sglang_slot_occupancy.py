"""Slot occupancy of the SGLang token API (SlotPool at page_size > 1): no live slot handed out twice, a page
released only when all its slots are free, refused calls change nothing. Expected values are worked out by hand
from SGLang's id rules (pages 1..num_pages, slot = page * page_size + offset) or from an independent model."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from umalloc.errors import DoubleFreeError, InvalidIdError, NotAllocatedError
from umalloc.integrations.sglang.occupancy import LiveSlotError
from umalloc.integrations.sglang.pools import SlotPool
from umalloc.testing import seed_from_env


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def state(pool: SlotPool) -> tuple[object, ...]:
    assert pool.slots is not None
    return pool.available_pages(), pool.free_page_ids().tolist(), pool.slots.tags.copy().tolist()


def test_decode_into_a_live_slot_is_refused_naming_slot_and_holder() -> None:
    pool = SlotPool(4, 4)
    row = pool.alloc_extend(t(0), t(6), t(-1), 6)
    assert row.tolist() == [4, 5, 6, 7, 8, 9]  # pages 1, 2
    before = state(pool)
    with pytest.raises(LiveSlotError) as info:
        pool.alloc_decode(t(2), row[:1])  # last_loc is token 0 of the request: slot 5 is its token 1
    assert info.value.slot == 5 and info.value.request == 0
    assert info.value.owner == "request 0 of alloc_extend call 1"
    assert "slot 5 is live" in str(info.value)
    assert state(pool) == before
    assert pool.slots is not None and pool.slots.holder(5) == "request 0 of alloc_extend call 1"
    assert pool.slots.holder(10) is None
    assert pool.alloc_decode(t(7), row[-1:]).tolist() == [10]  # the request's own next slot
    assert pool.slots.holder(10) == "request 0 of alloc_decode call 2"
    pool.check_invariants()


def test_extend_over_a_live_tail_slot_is_refused() -> None:
    pool = SlotPool(4, 4)
    a = pool.alloc_extend(t(0, 0), t(2, 3), t(-1, -1), 5)
    assert a.tolist() == [4, 5, 8, 9, 10]
    before = state(pool)
    with pytest.raises(LiveSlotError) as info:  # request 1 claims prefix 1 ending at slot 8: slots 9, 10 live
        pool.alloc_extend(t(2, 1), t(3, 3), t(5, 8), 3)
    assert (info.value.request, info.value.slot) == (1, 9)
    assert info.value.owner == "request 1 of alloc_extend call 1"
    assert state(pool) == before
    assert pool.alloc_extend(t(2, 3), t(3, 5), t(5, 10), 3).tolist() == [6, 11, 12]
    pool.check_invariants()


def test_two_decodes_into_one_slot_are_refused() -> None:
    pool = SlotPool(4, 4)
    a = pool.alloc_extend(t(0), t(1), t(-1), 1)
    before = state(pool)
    with pytest.raises(InvalidIdError, match="another request of the batch"):
        pool.alloc_decode(t(2, 2), t(int(a[0]), int(a[0])))
    assert state(pool) == before


def test_a_page_is_released_when_its_last_live_slot_is_freed() -> None:
    pool = SlotPool(4, 4)
    row = pool.alloc_extend(t(0), t(6), t(-1), 6)  # slots 4..9 on pages 1, 2
    dec = pool.alloc_decode(t(7), row[-1:])  # slot 10
    assert pool.available_pages() == 2
    pool.free_tokens(dec)  # slots 8, 9 still live: page 2 stays
    assert pool.free_page_ids().tolist() == [3, 4]
    pool.free_tokens(row[4:5])
    assert pool.free_page_ids().tolist() == [3, 4]
    pool.free_tokens(row[5:])  # page 2 empty now
    assert pool.free_page_ids().tolist() == [2, 3, 4]
    before = state(pool)
    with pytest.raises(DoubleFreeError):
        pool.free_tokens(row)  # slots 8, 9 are free now: the whole call is refused
    assert state(pool) == before
    pool.free_tokens(row[:4])
    assert pool.available_pages() == 4
    pool.check_invariants()


def test_refused_frees_change_nothing() -> None:
    pool = SlotPool(4, 4)
    row = pool.alloc_extend(t(0), t(6), t(-1), 6)
    before = state(pool)
    with pytest.raises(DoubleFreeError, match="slot 10 is not live"):
        pool.free_tokens(t(4, 10))  # slot 10 was never handed out; its page 2 is live
    with pytest.raises(NotAllocatedError):
        pool.free_tokens(t(4, 12))  # page 3 was never handed out
    with pytest.raises(InvalidIdError, match=r"free_index\[1\]=2 is out of range"):
        pool.free_tokens(t(4, 2))  # page 0
    with pytest.raises(InvalidIdError, match="out of range"):
        pool.free_tokens(t(4, 20))
    assert state(pool) == before
    pool.free_tokens(torch.cat([row, row[:2]]))  # duplicates merge
    assert pool.available_pages() == 4


def test_group_frees_tokens_and_pages_together() -> None:
    pool = SlotPool(4, 4)
    a = pool.alloc_extend(t(0, 0), t(2, 6), t(-1, -1), 8)  # request 0: 4, 5; request 1: 8..11, 12, 13
    pool.begin_group()
    pool.free_tokens(a[:1])  # slot 4: slot 5 keeps page 1
    pool.free_pages(t(2))  # page 2 whole
    pool.free_tokens(a[2:3])  # slot 8 again, inside page 2: merged with it
    pool.free_tokens(a[6:8])  # slots 12, 13: page 3 empty
    pool.end_group()
    assert pool.free_page_ids().tolist() == [2, 3, 4]
    pool.free_tokens(a[1:2])
    assert pool.available_pages() == 4
    pool.check_invariants()


def test_whole_page_alloc_and_page_frees_keep_tags_consistent() -> None:
    pool = SlotPool(3, 2)
    a = pool.alloc_tokens(4)  # pages 1, 2 whole
    pool.free_tokens(a[1:2])
    assert pool.available_pages() == 1
    pool.free_pages(t(1))  # a page free frees every slot of the page
    assert pool.available_pages() == 2
    with pytest.raises(DoubleFreeError):
        pool.free_tokens(a[:1])
    pool.free_tokens(a[2:])
    assert pool.available_pages() == 3
    pool.check_invariants()


def test_page_size_one_keeps_no_occupancy() -> None:
    pool = SlotPool(4, 1)
    assert pool.slots is None
    assert pool.alloc_tokens(2).tolist() == [1, 2]


@pytest.mark.parametrize("page_size", [2, 4])
def test_random_requests_match_a_slot_model(page_size: int) -> None:
    """Seeded requests that extend, decode, free some tail tokens and free everything, against a model that keeps
    each request's slot list: a page is live iff some request holds one of its slots."""
    rng = random.Random(seed_from_env(1234) + page_size)
    num_pages = 12
    pool = SlotPool(num_pages, page_size)
    rows: dict[int, list[int]] = {}
    next_rid = 0
    for step in range(400):
        op = rng.random()
        live_rids = [r for r, row in rows.items() if row]
        if op < 0.35 or not live_rids:
            rid = next_rid
            next_rid += 1
            n = rng.randint(1, 3 * page_size)
            got = pool.alloc_extend(t(0), t(n), t(-1), n)
            if got is not None:
                rows[rid] = got.tolist()
        elif op < 0.7:
            rid = rng.choice(live_rids)
            row = rows[rid]
            got = pool.alloc_decode(t(len(row) + 1), t(row[-1]))
            if got is not None:
                row.append(int(got[0]))
        elif op < 0.8:  # a wrong last_loc (another position of a request) must never hand out a live slot
            rid = rng.choice(live_rids)
            row = rows[rid]
            pos = rng.randrange(len(row))
            if pos != len(row) - 1 and (pos + 1) % page_size:
                before = state(pool)
                with pytest.raises(LiveSlotError):
                    pool.alloc_decode(t(pos + 2), t(row[pos]))
                assert state(pool) == before
        elif op < 0.9:  # free a tail of some tokens (not page-aligned)
            rid = rng.choice(live_rids)
            row = rows[rid]
            k = rng.randint(1, len(row))
            pool.free_tokens(t(*row[-k:]))
            del row[-k:]
        else:
            rid = rng.choice(live_rids)
            pool.free_tokens(t(*rows.pop(rid)))
        held = {s // page_size for row in rows.values() for s in row}
        assert pool.free_page_ids().tolist() == [p for p in range(1, num_pages + 1) if p not in held], step
        pool.check_invariants()
    for row in rows.values():
        if row:
            pool.free_tokens(t(*row))
    assert pool.available_pages() == num_pages
    assert pool.slots is not None and not (pool.slots.tags >= 0).any()
    assert np.all(pool.free_page_ids().numpy() == np.arange(1, num_pages + 1))
