"""The request table under a refused extend, admission queries, chunked prefill, stale
handles and bad arguments. Every refusal is checked against snapshots taken before the
call (allocator and table: pages, windows, cache and LRU order) and against the on_evict calls it made (F29, F30).

Geometry (the ``kv_allocator`` fixture): ``full`` (up, id owner) and ``swa`` (down, bound, window ``window`` tokens), both 16 B per
token, sharing ``pages`` usable page slots; the table's zero page takes one slot on each end.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from umalloc.allocator.facade import snapshots_equal
from umalloc.errors import InvalidIdError, StaleHandleError, UmallocError, UmallocValueError
from umalloc.requests.table import RequestTable
from umalloc.testing import seed_from_env


def _snap(table: RequestTable) -> tuple[dict, dict]:
    return table.alloc.snapshot(), table.snapshot()


def _same(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    return snapshots_equal(a[0], b[0]) and snapshots_equal(a[1], b[1])


# ---- a refused extend changes nothing -----------------------------------------------------------------------------
def test_a_shortfall_the_cache_cannot_cover_evicts_nothing_and_calls_no_on_evict(kv_allocator) -> None:
    """9 slots; zero page (1 + 1), one cached full page: 6 gap slots left. An 8-token extend
    (page_size 2) needs 4 pages on each end = 8 slots: even evicting the cached page leaves 7. The call returns
    None, calls no on_evict, and both snapshots are unchanged (the cache and its LRU order included)."""
    evicted: list[list[int]] = []
    table = RequestTable(kv_allocator(2, 9, 4), max_requests=2, max_tokens_per_request=16,
                         on_evict=lambda vp: evicted.append(vp.tolist()))
    a, b = table.new_requests(2).tolist()
    table.extend([a], [2])
    table.free_requests([a], cache=True)
    assert table.cached_pages().tolist() == [2]
    before = _snap(table)
    assert table.extend([b], [8]) is None
    assert evicted == []
    assert _same(before, _snap(table))
    table.check_invariants()


def test_an_swa_window_release_is_not_made_by_a_refused_extend(kv_allocator) -> None:
    """F29: A request of 6 tokens (window 2, page_size 2) holds SWA page indices 1 and 2; its
    next extend would first release index 1 (the window tail of 6 tokens is token 4, page index 2). An extend too
    large for the arena returns None with that page still bound and the front unmoved."""
    table = RequestTable(kv_allocator(2, 12, 2), max_requests=2, max_tokens_per_request=40)
    (s,) = table.new_requests(1).tolist()
    table.extend([s], [4])
    table.extend([s], [2])                               # releases SWA page index 0 (tail of 4 is token 2)
    before = _snap(table)
    assert table.extend([s], [30]) is None               # would release index 1 first, then fall short
    assert _same(before, _snap(table))
    table.check_invariants()


def test_an_eviction_evicts_exactly_the_pages_the_extend_needs(kv_allocator) -> None:
    """Three cached full pages (LRU 2, 3, 4 by construction); a 6-token extend (3 pages on each
    end, page_size 2) in an arena with 4 gap slots left needs 2 more slots: exactly the two LRU-first pages are
    evicted, in one on_evict call, and the third stays cached. Expected values worked out by hand."""
    evicted: list[list[int]] = []
    table = RequestTable(kv_allocator(2, 13, 4), max_requests=4, max_tokens_per_request=16,
                         on_evict=lambda vp: evicted.append(vp.tolist()))
    s = table.new_requests(4).tolist()
    for r in s[:3]:
        table.extend([r], [2])                           # pages 2, 3, 4 on full, each bound on swa too
    table.free_requests(s[:3], cache=True)               # cached, LRU head first: 2, 3, 4 (swa released)
    assert table.cached_pages().tolist() == [2, 3, 4]
    # slots used: zero page 2 + 3 cached = 5 of 13 -> 8 free; the extend needs 6 (3 + 3): fits without eviction
    assert table.extend([s[3]], [6]) is not None and evicted == []
    table.free_requests([s[3]])
    (u,) = table.new_requests(1).tolist()
    # now 8 free again; an extend of 10 tokens needs 5 + 5 = 10: two evictions (2 slots), the LRU head first
    out = table.extend([u], [10])
    assert out is not None
    assert evicted == [[2, 3]]
    assert table.cached_pages().tolist() == [4]
    table.check_invariants()


def test_random_refusals_change_nothing_and_evictions_are_minimal(kv_allocator) -> None:
    """Random extends over random caches; every None leaves both snapshots equal with
    no on_evict, and can_extend (asked first, changing nothing) predicts every outcome."""
    seed = seed_from_env(2615)
    rng = random.Random(seed)
    for _ in range(12):
        ps, pages, window = rng.choice([1, 2]), rng.randint(8, 16), rng.choice([2, 3, 4])
        evicted: list[list[int]] = []
        table = RequestTable(kv_allocator(ps, pages, window, compaction=rng.choice(["lazy", "off"])), max_requests=4,
                             max_tokens_per_request=24, on_evict=lambda vp, ev=evicted: ev.append(vp.tolist()))
        live: list[int] = []
        for _step in range(25):
            if live and rng.random() < 0.3:
                r = live.pop(rng.randrange(len(live)))
                table.free_requests([r], cache=rng.random() < 0.7)
            else:
                if not live or (rng.random() < 0.3 and len(live) < 4):
                    got = table.new_requests(1)
                    if got is not None:
                        live.append(int(got[0]))
                if not live:
                    continue
                r = rng.choice(live)
                n = rng.randint(1, max(1, 24 - int(table.num_tokens([r])[0])))
                if int(table.num_tokens([r])[0]) + n > 24:
                    continue
                before, nev = _snap(table), len(evicted)
                can = table.can_extend([r], [n])
                assert _same(before, _snap(table)), "can_extend changed something"
                out = table.extend([r], [n])
                assert can == (out is not None), f"seed={seed}: can_extend said {can}"
                if out is None:
                    assert len(evicted) == nev and _same(before, _snap(table)), f"seed={seed}"
            table.check_invariants()


# ---- admission queries --------------------------------------------------------------------------------------------
def test_capacity_answers_per_end_and_can_extend_agrees_with_extend(kv_allocator) -> None:
    """After a long request the SWA end holds only its window while the full end holds
    everything: capacity() reports both ends (the fewest available pages bound an extend), and can_extend's
    answer for every length equals what extend then does (probed on the boundary; nothing changes while asking)."""
    table = RequestTable(kv_allocator(2, 20, 4), max_requests=2, max_tokens_per_request=64)
    a, b = table.new_requests(2).tolist()
    for _ in range(3):
        table.extend([a], [4])                           # a: 12 tokens; full 6 pages, swa the window tail only
    cap = table.capacity()
    assert set(cap) == {"full", "swa"}
    st = table.alloc.stats()
    assert cap["full"]["free_pages"] == table.alloc.available_pages("full")
    assert cap["swa"]["free_pages"] == table.alloc.available_pages("swa")
    assert st["full"].live_pages == 7 and st["swa"].live_pages == 1 + 4   # zero page + page indices 2..5
    before = _snap(table)
    answers = {n: table.can_extend([b], [n]) for n in range(0, 30)}
    assert _same(before, _snap(table))
    largest = max(n for n, ok in answers.items() if ok)
    assert all(answers[n] for n in range(largest + 1)) and not any(answers[n] for n in range(largest + 1, 30))
    assert table.max_extend_tokens(b) == largest
    assert table.extend([b], [largest + 1]) is None and _same(before, _snap(table))
    assert table.extend([b], [largest]) is not None
    # independently: (20 - 7 - 5) = 8 free slots, each fresh page takes one slot on each end -> 4 pages = 8 tokens
    assert largest == 8


# ---- chunked prefill ----------------------------------------------------------------------------------------------
def test_a_prompt_that_fits_by_decode_fits_by_chunked_prefill(kv_allocator) -> None:
    """Note [Chunked prefill]: A 40-token prompt (page_size 2, window 4) in 30 slots: one extend
    needs 20 + 20 slots and is refused (nothing changed), decode-by-decode needs 20 + 3; chunks of
    max_extend_tokens() each get through, and the request ends holding 20 full pages and only its window tail on
    the SWA end, as decode would leave it."""
    table = RequestTable(kv_allocator(2, 30, 4), max_requests=2, max_tokens_per_request=64)
    (s,) = table.new_requests(1).tolist()
    before = _snap(table)
    assert table.extend([s], [40]) is None and _same(before, _snap(table))
    done, chunks = 0, []
    while done < 40:
        n = min(40 - done, table.max_extend_tokens(s))
        assert n > 0, f"stuck after {done} tokens"
        assert table.extend([s], [n]) is not None
        chunks.append(n)
        done += n
        table.check_invariants()
    assert sum(chunks) == 40 and len(chunks) > 1
    table.decode([s])                                    # the next grow releases what the window left
    st = table.alloc.stats()
    assert st["full"].live_pages == 1 + 21               # zero page + ceil(41 / 2)
    swa_bound = (table.alloc.translate_pages(table.pages(s), "swa", strict=False) > 0).tolist()
    assert swa_bound == [False] * 18 + [True] * 3        # window tail of 40 = token 36 -> page index 18


# ---- stale handles ------------------------------------------------------------------------------------------------
def test_a_stale_handle_is_refused_and_frees_nothing(kv_allocator) -> None:
    """F30: A handle of a freed slot, after the slot is reused by another request, is refused
    by every call taking slots with StaleHandleError; the live request is untouched."""
    table = RequestTable(kv_allocator(2, 12, 4), max_requests=2, max_tokens_per_request=8)
    (h,) = table.new_requests(1, handles=True).tolist()
    assert h >> 32 == 1 and RequestTable.slot_of([h]).tolist() == [0]
    table.extend([h], [3])
    table.free_requests([h])
    (h2,) = table.new_requests(1, handles=True).tolist()
    assert h2 & 0xFFFFFFFF == 0 and h2 != h
    table.extend([h2], [2])
    before = _snap(table)
    for call in (lambda: table.free_requests([h]), lambda: table.extend([h], [1]), lambda: table.decode([h]),
                 lambda: table.truncate([h], [0]), lambda: table.fork(h), lambda: table.tokens(h),
                 lambda: table.pages(h), lambda: table.num_tokens([h]), lambda: table.can_extend([h], [1])):
        with pytest.raises(StaleHandleError):
            call()
    assert _same(before, _snap(table))
    assert table.num_tokens([h2]).tolist() == [2] and table.handles([0]).tolist() == [h2]
    table.free_requests([h2])
    table.check_invariants()


# ---- bad arguments ------------------------------------------------------------------------------------------------
def test_bad_arguments_raise_typed_and_change_nothing(kv_allocator) -> None:
    """An overflowing extend length on a request whose window would advance, a float tensor
    slot, slots at and above 2**63, and a huge max_requests: each a typed UmallocValueError, nothing changed (the
    huge table refused before any array is allocated)."""
    table = RequestTable(kv_allocator(2, 16, 2), max_requests=2, max_tokens_per_request=12)
    (s,) = table.new_requests(1).tolist()
    table.extend([s], [6])                               # the next extend would release SWA pages
    before = _snap(table)
    calls = [lambda: table.extend([s], [2**63 - 1]), lambda: table.extend([s], [2**62]),
             lambda: table.tokens(torch.tensor([0.7])), lambda: table.pages(torch.tensor(0.0)),
             lambda: table.tokens(2**63), lambda: table.pages(2**64), lambda: table.fork(2**63 + 5),
             lambda: table.fork(-1), lambda: table.tokens(np.float64(0.0)), lambda: table.tokens(np.bool_(True))]
    for call in calls:
        with pytest.raises(UmallocValueError):
            call()
        assert _same(before, _snap(table))
    for huge in (2**40, 2**31 + 1):
        with pytest.raises(UmallocValueError, match="max_requests"):
            RequestTable(kv_allocator(2, 4, 2), max_requests=huge, max_tokens_per_request=4, exclusive=False)
    with pytest.raises(UmallocValueError, match="max_requests"):
        RequestTable(kv_allocator(2, 4, 2), max_requests=2, max_tokens_per_request=2**40, exclusive=False)
    assert isinstance(InvalidIdError("x"), UmallocError)
    table.check_invariants()
