"""RequestTable.share_page: a request's full page replaced by another page of the same content (de-duplication
after a forward, as transformers' allocator does it). Counts are checked against the allocator's own live pages
and the table's invariants; every refusal leaves the table and the allocator exactly as they were (F29)."""

from __future__ import annotations

import pytest
import torch

from umalloc import ArenaSpec, EndSpec, LayerSpec, RequestTable
from umalloc.allocator.observe import snapshots_equal
from umalloc.errors import InvalidIdError, NotAllocatedError, UmallocValueError
from umalloc.testing import small_allocator

PS = 4


#: one full end, page size PS, 64 pages of 64 B
ONE_END = ArenaSpec((EndSpec("full", (LayerSpec.mha(1, 4),), page_size=PS),), arena_bytes=64 * 64)


def live(table: RequestTable) -> int:
    return table.alloc.stats()["full"].live_pages


def test_a_duplicate_page_is_freed_and_the_row_rewritten(make_table) -> None:
    table = make_table(ONE_END, zero_page=False)
    a, b = table.new_requests(2).tolist()
    table.extend([a, b], [2 * PS + 1, 2 * PS + 3])
    before = live(table)
    pa, pb = table.pages(a).tolist(), table.pages(b).tolist()
    table.share_page(b, 1, pa[1])
    assert table.pages(b).tolist() == [pb[0], pa[1], pb[2]]
    assert table.tokens(b)[PS:2 * PS].tolist() == [pa[1] * PS + i for i in range(PS)]
    assert table.req_to_token[b, PS:2 * PS].tolist() == [pa[1] * PS + i for i in range(PS)]
    assert live(table) == before - 1   # b's own page 1 had no other holder
    assert table.stats().shared_pages == 1
    table.check_invariants()
    table.free_requests([a])
    assert pa[1] in table.pages(b).tolist() and live(table) == before - 1 - 2   # a's pages 0 and 2 only
    table.free_requests([b])
    assert live(table) == 0
    table.check_invariants()


def test_a_cached_page_is_revived_and_a_forked_old_page_stays(make_table) -> None:
    table = make_table(ONE_END, zero_page=False)
    (a,) = table.new_requests(1).tolist()
    table.extend([a], [2 * PS])
    pa = table.pages(a).tolist()
    table.free_requests([a], cache=True)
    assert sorted(table.cached_pages().tolist()) == sorted(pa)
    (b,) = table.new_requests(1).tolist()
    table.extend([b], [2 * PS + 1])
    c = table.fork(b)
    assert c is not None
    pb = table.pages(b).tolist()
    before = live(table)
    table.share_page(b, 0, pa[0])
    assert table.cached_pages().tolist() == [pa[1]]
    assert table.pages(c).tolist() == pb   # the fork keeps b's old page: it is not freed
    assert live(table) == before
    assert table.stats().pages_reclaimed == 1
    table.check_invariants()


@pytest.mark.parametrize("case", ["partial page", "page past the end", "vpage free", "vpage zero",
                                  "vpage own", "free slot", "bound ends"])
def test_refusals_change_nothing(make_table, case: str) -> None:
    table = make_table(ONE_END, zero_page=False)
    a, b = table.new_requests(2).tolist()
    table.extend([a, b], [2 * PS, PS + 2])
    pa = table.pages(a).tolist()
    args: tuple[int, int, int]
    err: type[Exception] = UmallocValueError
    if case == "partial page":
        args = (b, 1, pa[0])
    elif case == "page past the end":
        args = (b, 5, pa[0])
    elif case == "vpage free":
        args, err = (b, 0, max(pa) + 20), NotAllocatedError
    elif case == "vpage zero":
        args, err = (b, 0, 0), InvalidIdError
    elif case == "vpage own":
        args, err = (a, 0, pa[1]), InvalidIdError
    elif case == "free slot":
        table.free_requests([b])
        args, err = (b, 0, pa[0]), NotAllocatedError
    else:
        table = RequestTable(small_allocator(), max_requests=2, max_tokens_per_request=8)
        x, y = table.new_requests(2).tolist()
        table.extend([x, y], [2, 2])
        args = (y, 0, int(table.pages(x)[0]))
    snap = table.snapshot()
    with pytest.raises(err, match="share_page"):
        table.share_page(*args)
    assert snapshots_equal(snap, table.snapshot())
    table.check_invariants()


def test_bad_page_index_types_refused(make_table) -> None:
    table = make_table(ONE_END, zero_page=False)
    (a,) = table.new_requests(1).tolist()
    table.extend([a], [2 * PS])
    snap = table.snapshot()
    for bad in (-1, 1.0, True, torch.tensor([0, 1])):
        with pytest.raises(UmallocValueError):
            table.share_page(a, bad, 3)  # type: ignore[arg-type]
    assert snapshots_equal(snap, table.snapshot())


def test_attach_prefix_revives_cached_pages_in_one_call(make_table) -> None:
    """attach_prefix(revive=True) takes cached pages directly: they leave the LRU, the request holds them, and the
    table ends exactly as after reclaim + attach_prefix + drop_refs (compared array by array)."""
    def prepared() -> tuple[RequestTable, list[int], int]:
        table = make_table(ONE_END, zero_page=False)
        (a,) = table.new_requests(1).tolist()
        table.extend([a], [3 * PS])
        pages = table.pages(a).tolist()
        table.free_requests([a], cache=True)
        (b,) = table.new_requests(1).tolist()
        return table, pages, b

    one, pages, b = prepared()
    held_page = pages[:2]
    snap = one.snapshot()
    with pytest.raises(NotAllocatedError, match="revive=True"):
        one.attach_prefix(b, held_page)
    assert snapshots_equal(snap, one.snapshot())
    assert one.attach_prefix(b, held_page, revive=True)
    one.check_invariants()
    three, pages3, b3 = prepared()
    three.reclaim(pages3[:2])
    assert three.attach_prefix(b3, pages3[:2])
    three.drop_refs(pages3[:2], cache=True)
    assert snapshots_equal(one.snapshot(), three.snapshot())
    assert one.cached_pages().tolist() == [pages[2]] and one.stats().pages_reclaimed == 2
    with pytest.raises(UmallocValueError, match="revive=1"):
        one.attach_prefix(b, held_page, revive=1)  # type: ignore[arg-type]
