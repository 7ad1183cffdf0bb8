"""RequestTable: exact-order unit tests with hand-computed pages, misuse leaving every state unchanged, and the
three public bug classes (extent accounting F08, shared boundary page F07, sink reads F05), each shown failing on
the token-level API misuse pattern and passing through the table. Fault classes: F05, F07, F08, F09, F28.

Geometries (``_alloc``): ``full`` (up, id owner, 16 B per token) and optionally ``swa`` (down, bound to
``full``, the same bytes per token, a sliding window), in an arena of ``pages`` usable page slots shared by both.
Fresh pages of the up end come out ascending from physical page 1, so on a fresh ``full``-only arena virtual page
``v`` sits at physical page ``v``.
"""

from __future__ import annotations

import pytest
import torch

from umalloc.allocator.facade import MultiEndedAllocator, snapshots_equal
from umalloc.errors import (
    DoubleFreeError,
    InvalidIdError,
    InvariantError,
    NotAllocatedError,
    UmallocValueError,
)
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, KVDtype, LayerSpec
from umalloc.requests.table import RequestTable
from umalloc.testing import small_allocator


def _t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def _live(alloc: MultiEndedAllocator, end: str = "full") -> int:
    return alloc.stats()[end].live_pages


def _swa_bound(alloc: MultiEndedAllocator, vpages: torch.Tensor) -> list[bool]:
    return (alloc.translate_pages(vpages, "swa", strict=False) > 0).tolist()


# ---- construction ---------------------------------------------------------------------------------------------
def test_int32_refused_when_the_token_id_space_does_not_fit() -> None:
    """int32 req_to_token holds token ids up to 2**31 - 1: an owner with 32768 pages of 65536 tokens fits exactly,
    one more page does not (the arena is not touched: zero=False leaves its bytes unallocated)."""
    end = EndSpec("full", (LayerSpec.mla(1, 0, dtype=KVDtype.FP8_E4M3),), page_size=1 << 16)  # 1 B per token
    fits = MultiEndedAllocator(Arena(ArenaSpec((end,), arena_bytes=1 << 31), zero=False))
    assert fits.num_vpages() * (1 << 16) - 1 == 2**31 - 1
    table = RequestTable(fits, max_requests=1, max_tokens_per_request=1, zero_page=False)
    assert table.req_to_token.dtype == torch.int32
    over = MultiEndedAllocator(Arena(ArenaSpec((end,), arena_bytes=(1 << 31) + (1 << 16)), zero=False))
    with pytest.raises(UmallocValueError, match="int32"):
        RequestTable(over, max_requests=1, max_tokens_per_request=1, zero_page=False)
    assert RequestTable(over, max_requests=1, max_tokens_per_request=1, dtype=torch.int64,
                        zero_page=False).req_to_token.dtype == torch.int64


@pytest.mark.parametrize("kw", [{"max_requests": 0}, {"max_tokens_per_request": True}, {"dtype": torch.int16},
                                {"owner": "swa"}, {"on_evict": 3}])
def test_bad_construction_arguments_raise_typed(kv_allocator, kw: dict) -> None:
    args = {"max_requests": 2, "max_tokens_per_request": 8, **kw}
    with pytest.raises(UmallocValueError):
        RequestTable(kv_allocator(2, 8, window=4), **args)


def test_req_to_token_shape_dtype_and_padding(kv_allocator) -> None:
    alloc = kv_allocator(4, 8)
    table = RequestTable(alloc, max_requests=3, max_tokens_per_request=10)
    assert table.req_to_token.shape == (3, 10) and table.req_to_token.dtype == torch.int32
    assert table.zero_vpage == 1 and table.pad_read_vtoken == 4 and table.pad_write_vtoken == 0
    assert bool((table.req_to_token == 4).all())
    assert _live(alloc) == 1                        # the zero page
    table.check_invariants()


# ---- exact orders -----------------------------------------------------------------------------------------------
def test_extend_and_decode_fill_the_partial_page_first_in_batch_order(kv_allocator) -> None:
    """page_size 4, zero page = virtual page 1. Request 0 extends 5 tokens (pages 2, 3), request 1 four (page 4),
    request 2 none; then a decode of requests 1, 0: request 1 starts page 5, request 0 fills page 3."""
    alloc = kv_allocator(4, 10)
    table = RequestTable(alloc, max_requests=4, max_tokens_per_request=12)
    slots = table.new_requests(3)
    assert slots.tolist() == [0, 1, 2]
    assert table.extend(slots, _t(5, 4, 0)).tolist() == [8, 9, 10, 11, 12, 16, 17, 18, 19]
    assert table.decode(_t(1, 0)).tolist() == [20, 13]
    assert table.num_tokens(slots).tolist() == [6, 5, 0]
    assert table.pages(0).tolist() == [2, 3] and table.pages(1).tolist() == [4, 5] and table.pages(2).tolist() == []
    assert table.tokens(0).tolist() == [8, 9, 10, 11, 12, 13]
    assert table.req_to_token[0].tolist() == [8, 9, 10, 11, 12, 13, 4, 4, 4, 4, 4, 4]
    assert table.req_to_token[1, :5].tolist() == [16, 17, 18, 19, 20]
    assert alloc.translate_pages(_t(2, 3, 4, 5), "full").tolist() == [2, 3, 4, 5]
    assert table.new_requests(1).tolist() == [3] and table.new_requests(1) is None
    table.free_requests(_t(1))
    assert table.new_requests(1).tolist() == [1]     # the lowest free slot again
    table.check_invariants()


def test_speculative_lookahead_then_rollback_frees_exactly_the_pages_past_the_kept_length_F09(kv_allocator) -> None:
    """F09: pages for k draft positions are reserved by one extend before drafts write; truncate to the accepted
    length frees exactly the pages past it. page_size 2: length 3 (pages 2, 3), 4 drafts -> length 7 (pages 2, 3,
    4, 5); 1 accepted -> length 4: page 4 and 5 freed, 2 and 3 kept."""
    alloc = kv_allocator(2, 10)
    table = RequestTable(alloc, max_requests=2, max_tokens_per_request=10)
    (s,) = table.new_requests(1).tolist()
    table.extend([s], [3])
    drafts = table.extend([s], [4])
    assert drafts.tolist() == [7, 8, 9, 10]
    assert table.pages(s).tolist() == [2, 3, 4, 5] and _live(alloc) == 5
    table.truncate([s], [4])
    assert table.pages(s).tolist() == [2, 3] and _live(alloc) == 3
    assert alloc.ends["full"].v2p[[4, 5]].tolist() == [-1, -1]
    assert table.req_to_token[s, :6].tolist() == [4, 5, 6, 7, 2, 2]
    table.truncate([s], [3])                          # inside page 3: nothing freed
    assert _live(alloc) == 3 and table.decode([s]).tolist() == [7]
    table.check_invariants()


def test_swa_window_releases_on_decode_and_shared_pages_wait_for_the_last_holder_F28(kv_allocator) -> None:
    """page_size 2, window 4. Before a request of length L grows, its swa pages wholly before
    swa_tail_start(L, 4) = floor2(L - 4) are released: at L = 6 page index 0 goes, at L = 8 index 1. A fork
    at 6 tokens shares pages [2, 3, 4] and holds on swa from tail(6) = token 2 (page index 1): page 2 leaves swa
    when the source releases it, page 3 only when both have."""
    alloc = kv_allocator(2, 24, window=4)
    table = RequestTable(alloc, max_requests=3, max_tokens_per_request=12)
    (a,) = table.new_requests(1).tolist()
    table.extend([a], [6])                            # pages 2, 3, 4 (window not advanced: L = 0 before)
    pages = table.pages(a)
    assert pages.tolist() == [2, 3, 4] and _swa_bound(alloc, pages) == [True, True, True]
    b = table.fork(a, 6)
    assert table.pages(b).tolist() == [2, 3, 4]
    table.decode([a])                                 # a: L = 6 -> page 2 left a's window; b never held it on swa
    assert _swa_bound(alloc, pages) == [False, True, True]
    table.decode([a])                                 # a: L = 7 -> tail 2: nothing new
    table.decode([a])                                 # a: L = 8 -> tail 4: page 3 leaves a's window, b holds it
    assert _swa_bound(alloc, pages) == [False, True, True]
    table.decode([b])                                 # b: L = 6, 7 -> tail 2: nothing
    table.decode([b])
    assert _swa_bound(alloc, pages) == [False, True, True]
    table.decode([b])                                 # b: L = 8 -> tail 4: page 3 leaves b's window too
    assert _swa_bound(alloc, pages) == [False, False, True]
    assert _live(alloc) == 1 + 3 + 2 + 2              # zero page, shared 2 3 4, a's 5 6, b's 7 8
    table.free_requests([a])
    assert alloc.ends["full"].v2p[[2, 3, 4]].tolist() == [2, 3, 4]     # still held by b
    table.free_requests([b])
    assert _live(alloc) == 1 and _live(alloc, "swa") == 1
    table.check_invariants()


def test_decode_on_a_full_arena_takes_the_page_its_window_releases_without_a_trial(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """small_allocator: 9 usable 32-byte slots shared by full (up) and swa (down), page_size 2, window 4. The zero
    page takes one slot on each end; a 6-token request pages 0, 1, 2 (three on each end): 8 slots used, 1 free.
    Its decode at L = 6 needs page 3 on both ends (2 slots) and releases page index 0 on swa (tail(6, 4) = 2):
    full takes the free slot, swa the released one, with no allocator trial (Note [Room], step 1b)."""
    alloc = small_allocator()
    table = RequestTable(alloc, max_requests=2, max_tokens_per_request=12)
    (a,) = table.new_requests(1).tolist()
    assert table.extend([a], [6]) is not None
    assert alloc.stats()["full"].live_pages == 4 and alloc.stats()["swa"].live_pages == 4

    def no_trial(*args: object, **kwargs: object) -> None:
        raise AssertionError("an allocator trial ran")

    monkeypatch.setattr(alloc, "trial", no_trial)
    assert table.can_extend([a], [1])
    assert table.decode([a]) is not None
    assert table.num_tokens([a]).tolist() == [7]
    assert alloc.stats()["full"].live_pages == 5 and alloc.stats()["swa"].live_pages == 4
    table.check_invariants()


def test_fork_shares_every_page_and_copies_a_shared_partial_page_on_first_write_F28(kv_allocator) -> None:
    """page_size 4: a holds 6 tokens (pages 2, 3; page 3 partial). fork(a, 6) shares both. a's decode finds page 3
    shared: it gets a copy (page 4, bytes copied) and its tokens 4, 5 move there; b then writes page 3 in place."""
    alloc = kv_allocator(4, 10)
    table = RequestTable(alloc, max_requests=3, max_tokens_per_request=12)
    (a,) = table.new_requests(1).tolist()
    toks = table.extend([a], [6])
    env = alloc.arena.envelopes("full")
    env[3] = 7                                        # a's KV in page 3
    b = table.fork(a, 6)
    assert table.tokens(b).tolist() == toks.tolist() and table.stats().shared_pages == 2
    assert table.decode([a, b]).tolist() == [18, 14]  # a: copy page 4, token 4*4 + 2; b: page 3 in place
    assert table.pages(a).tolist() == [2, 4] and table.pages(b).tolist() == [2, 3]
    assert table.tokens(a).tolist() == [8, 9, 10, 11, 16, 17, 18]
    assert bool((env[4] == 7).all()) and table.stats().pages_copied == 1
    c = table.fork(b, 2)                              # a partial prefix of a full page: shares page 2
    assert table.pages(c).tolist() == [2] and table.decode([c]).tolist() == [22]   # copy to page 5, offset 2
    table.free_requests([a])
    assert _live(alloc) == 1 + 3                      # page 2 (b), 3 (b), 5 (c)
    table.free_requests([b, c])
    assert _live(alloc) == 1
    table.check_invariants()


def test_cached_pages_lru_order_reclaim_and_eviction_with_on_evict(kv_allocator) -> None:
    """free_requests(cache=True) caches full pages, each request last page first; a partial last page is freed.
    Allocation evicts only when the allocator returns None, LRU first, telling on_evict before the ids are
    reused; reclaim revives a cached page (content intact) and attach_prefix builds a request on it."""
    evicted: list[list[int]] = []
    alloc = kv_allocator(2, 8)                              # 8 usable pages: zero page + 7
    table = RequestTable(alloc, max_requests=4, max_tokens_per_request=12,
                         on_evict=lambda vp: evicted.append(vp.tolist()))
    s = table.new_requests(2)
    table.extend(s, _t(4, 5))                         # r0: pages 2, 3; r1: pages 4, 5, 6 (6 partial)
    alloc.arena.envelopes("full")[3] = 9
    table.free_requests(s, cache=True)
    assert table.cached_pages().tolist() == [3, 2, 5, 4] and _live(alloc) == 5
    assert table.capacity()["full"] == {"free_pages": 3, "reclaimable_pages": 4, "available_pages": 7}
    assert table.stats().cached_pages == 4 and table.stats().pages_cached == 4
    table.reclaim(_t(2, 3))                           # a prefix hit on r0's prompt
    assert table.cached_pages().tolist() == [5, 4] and table.stats().engine_refs == 2
    (r,) = table.new_requests(1).tolist()
    assert table.attach_prefix(r, _t(2, 3))
    table.drop_refs(_t(2, 3))                         # the engine's references go; the request holds them
    assert table.tokens(r).tolist() == [4, 5, 6, 7] and bool((alloc.arena.envelopes("full")[3] == 9).all())
    assert table.extend([r], [6]).tolist()[:2] == [12, 13] and evicted == []   # pages 6, 7, 8: the free ones
    assert table.extend([r], [0]).tolist() == []
    toks = table.decode([r])                          # length 10 starts a page and nothing is free
    assert evicted == [[5]] and toks.tolist() == [5 * 2]        # LRU head 5 evicted, its id re-minted at once
    assert table.cached_pages().tolist() == [4]
    table.check_invariants()


def test_engine_references_hold_pages_after_the_request_and_drop_refs_can_cache(kv_allocator) -> None:
    alloc = kv_allocator(2, 8)
    table = RequestTable(alloc, max_requests=2, max_tokens_per_request=8)
    (s,) = table.new_requests(1).tolist()
    table.extend([s], [4])                            # pages 2, 3
    table.retain(_t(2, 3, 3))                         # the radix tree holds 2 once, 3 twice
    table.free_requests([s])
    assert _live(alloc) == 3 and table.stats().engine_refs == 3
    table.drop_refs(_t(3))
    assert _live(alloc) == 3
    table.drop_refs(_t(3, 2), cache=True)             # both reach 0: cached in the given order
    assert table.cached_pages().tolist() == [3, 2] and _live(alloc) == 3
    assert table.evict(1) == 1 and table.cached_pages().tolist() == [2] and _live(alloc) == 2
    table.check_invariants()


# ---- misuse: a typed error and nothing changed -------------------------------------------------------------------
def _misuse_table(kv_allocator) -> tuple[RequestTable, int, int]:
    alloc = kv_allocator(2, 12, window=4)
    table = RequestTable(alloc, max_requests=3, max_tokens_per_request=8)
    s = table.new_requests(2)
    table.extend(s, _t(5, 2))
    table.retain(table.pages(1))
    table.free_requests(_t(1), cache=False)
    return table, 0, 1


_MISUSE = [
    ("extend", lambda t: t.extend(_t(0, 0), _t(1, 1)), InvalidIdError),            # a slot twice
    ("extend", lambda t: t.extend(_t(1), _t(1)), NotAllocatedError),                # a freed slot
    ("extend", lambda t: t.extend(_t(3), _t(1)), InvalidIdError),                   # out of range
    ("extend", lambda t: t.extend(_t(0), _t(4)), UmallocValueError),                # past max_tokens
    ("extend", lambda t: t.extend(_t(0), _t(-1)), UmallocValueError),
    ("extend", lambda t: t.extend(_t(0), _t(1, 1)), InvalidIdError),                # shapes
    ("extend", lambda t: t.extend(torch.tensor([0.0]), _t(1)), InvalidIdError),     # dtype
    ("decode", lambda t: t.decode(_t(0, 1)), NotAllocatedError),                    # one bad slot in the batch
    ("truncate", lambda t: t.truncate(_t(0), _t(6)), UmallocValueError),            # beyond the length
    ("truncate", lambda t: t.truncate(_t(0), _t(-1)), UmallocValueError),
    ("free", lambda t: t.free_requests(_t(1)), DoubleFreeError),
    ("free", lambda t: t.free_requests(_t(0, 0)), InvalidIdError),
    ("free", lambda t: t.free_requests(_t(0), cache=1), UmallocValueError),
    ("fork", lambda t: t.fork(0, 6), UmallocValueError),
    ("fork", lambda t: t.fork(1, 0), NotAllocatedError),
    ("fork", lambda t: t.fork(0.0, 0), InvalidIdError),
    ("retain", lambda t: t.retain(_t(7)), NotAllocatedError),                       # never the table's
    ("retain", lambda t: t.retain(_t(1)), InvalidIdError),                          # the zero page
    ("drop_refs", lambda t: t.drop_refs(_t(5, 5)), NotAllocatedError),                  # one reference only
    ("drop_refs", lambda t: t.drop_refs(_t(2)), NotAllocatedError),                     # a request's, not the engine's
    ("reclaim", lambda t: t.reclaim(_t(7)), NotAllocatedError),
    ("attach", lambda t: t.attach_prefix(0, _t(4)), UmallocValueError),             # not empty
    ("num_tokens", lambda t: t.num_tokens(_t(1)), NotAllocatedError),
    ("evict", lambda t: t.evict(-1), UmallocValueError),
]


@pytest.mark.parametrize("name, call, error", _MISUSE, ids=[f"{m[0]}-{i}" for i, m in enumerate(_MISUSE)])
def test_misuse_raises_typed_and_changes_nothing(kv_allocator, name: str, call, error: type) -> None:
    table, _, _ = _misuse_table(kv_allocator)
    before = table.snapshot()
    with pytest.raises(error):
        call(table)
    assert snapshots_equal(before, table.snapshot()), name
    table.check_invariants()


def test_none_on_shortage_hands_out_nothing(kv_allocator) -> None:
    alloc = kv_allocator(2, 4)
    table = RequestTable(alloc, max_requests=2, max_tokens_per_request=12)
    s = table.new_requests(2)
    table.extend(s[:1], [4])
    before = table.snapshot()
    assert table.extend(s, _t(2, 4)) is None          # 3 pages needed, 1 free
    assert snapshots_equal(before, table.snapshot())


# ---- invariants that see leaks ---------------------------------------------------------------------------------
def test_check_invariants_reports_pages_freed_behind_the_table_and_pages_allocated_outside_it_F08(kv_allocator) -> None:
    alloc = kv_allocator(2, 8)
    table = RequestTable(alloc, max_requests=2, max_tokens_per_request=8)
    (s,) = table.new_requests(1).tolist()
    table.extend([s], [3])
    alloc.free_pages(_t(3))                           # the engine frees a table page through the allocator
    with pytest.raises(InvariantError, match="owner-live.*freed behind the table"):
        table.check_invariants()
    alloc2 = kv_allocator(2, 8)
    table2 = RequestTable(alloc2, max_requests=2, max_tokens_per_request=8)
    alloc2.alloc_pages(1)                             # a page outside the table: held by no one it knows
    with pytest.raises(InvariantError, match="owner-live.*held by no one"):
        table2.check_invariants()
    RequestTable(kv_allocator(2, 8), max_requests=1, max_tokens_per_request=2, exclusive=False).check_invariants()


def test_check_invariants_reports_a_bound_end_released_behind_the_table(kv_allocator) -> None:
    alloc = kv_allocator(2, 12, window=4)
    table = RequestTable(alloc, max_requests=2, max_tokens_per_request=8)
    (s,) = table.new_requests(1).tolist()
    table.extend([s], [4])
    table.check_invariants()
    alloc.unbind_pages("swa", table.pages(s)[:1])    # the engine's own window release, beside the table's
    with pytest.raises(InvariantError, match="bound.*on 'swa'"):
        table.check_invariants()


def test_on_evict_runs_while_the_pages_are_still_allocated(kv_allocator) -> None:
    """The engine hears of an eviction before the ids can be re-minted: inside on_evict the pages are still
    live on the allocator; right after, the allocation that needed them reuses the lowest one."""
    seen: list[tuple[list[int], list[int]]] = []
    alloc = kv_allocator(1, 4)                              # page_size 1: every page full
    table = RequestTable(alloc, max_requests=2, max_tokens_per_request=4, zero_page=False,
                         on_evict=lambda vp: seen.append((vp.tolist(),
                                                          alloc.translate_pages(vp, "full").tolist())))
    s = table.new_requests(2)
    table.extend(s[:1], [3])                          # pages 1, 2, 3
    table.free_requests(s[:1], cache=True)            # cached 3, 2, 1
    assert table.extend(s[1:], [2]).tolist() == [3, 4]   # id 4 free + LRU head 3 evicted, lowest first
    assert seen == [([3], [3])]
    assert table.cached_pages().tolist() == [2, 1]
    table.check_invariants()


# ---- the three public bug classes --------------------------------------------------------------------------------
def _everything_returned(alloc: MultiEndedAllocator, kept: int = 0) -> None:
    st = alloc.stats()["full"]
    assert st.live_pages == kept, f"{st.live_pages - kept} page(s) still allocated"


def test_extent_accounting_two_step_extend_freed_by_partial_ids_leaks_on_the_token_api_F08(kv_allocator) -> None:
    """sglang #13826 / #31616 (F08). A request extended by 5 then 4 tokens (page_size 4, 8 usable pages) and freed
    with only its first 7 ids: through the token-level API page 3 stays allocated (available 7 of 8) and
    check_invariants() passes -- the leak nothing sees. Through the table the request is freed by its slot:
    everything returns, and the same leak next to an exclusive table is reported."""
    alloc = kv_allocator(4, 8)
    t1 = alloc.alloc_extend(_t(0), _t(5), _t(-1))
    t2 = alloc.alloc_extend(_t(5), _t(9), t1[-1:])
    alloc.free(torch.cat([t1, t2])[:7])
    alloc.check_invariants()                          # passes: the allocator cannot know
    assert alloc.available_pages("full") == 7
    with pytest.raises(AssertionError, match="1 page"):
        _everything_returned(alloc)

    alloc = kv_allocator(4, 8)
    table = RequestTable(alloc, max_requests=1, max_tokens_per_request=16, zero_page=False)
    (s,) = table.new_requests(1).tolist()
    table.extend([s], [5])
    table.extend([s], [4])
    table.free_requests([s])
    _everything_returned(alloc)
    assert alloc.available_pages("full") == 8
    table.check_invariants()

    t1 = alloc.alloc_extend(_t(0), _t(5), _t(-1))    # the token-level leak beside the table is seen
    alloc.free(t1[:3])
    with pytest.raises(InvariantError, match="held by no one"):
        alloc.check_invariants()                      # the allocator runs the attached table's checks
    with pytest.raises(InvariantError, match="held by no one"):
        table.check_invariants()


def test_extent_accounting_split_frees_double_free_on_the_token_api_F08(kv_allocator) -> None:
    """Extending 5 -> 11 and freeing [:8] leaves page 3 allocated; freeing [:6] then [6:11] raises DoubleFreeError
    on the second call and page 3 stays. Truncate and free through the table return exactly what was handed out."""
    alloc = kv_allocator(4, 8)
    toks = torch.cat([alloc.alloc_extend(_t(0), _t(5), _t(-1))])
    toks = torch.cat([toks, alloc.alloc_extend(_t(5), _t(11), toks[-1:])])
    alloc.free(toks[:8])
    with pytest.raises(AssertionError):
        _everything_returned(alloc)
    alloc = kv_allocator(4, 8)
    toks = alloc.alloc_extend(_t(0), _t(5), _t(-1))
    toks = torch.cat([toks, alloc.alloc_extend(_t(5), _t(11), toks[-1:])])
    alloc.free(toks[:6])
    with pytest.raises(DoubleFreeError):
        alloc.free(toks[6:11])
    with pytest.raises(AssertionError):
        _everything_returned(alloc)

    alloc = kv_allocator(4, 8)
    table = RequestTable(alloc, max_requests=1, max_tokens_per_request=16, zero_page=False)
    (s,) = table.new_requests(1).tolist()
    table.extend([s], [5])
    table.extend([s], [6])
    table.truncate([s], [6])                          # pages of tokens 6..10 past the kept 6: page 3 only
    assert table.pages(s).tolist() == [1, 2] and _live(alloc) == 2
    table.free_requests([s])
    _everything_returned(alloc)
    table.check_invariants()


def test_shared_boundary_page_caller_arithmetic_hands_a_slot_out_twice_on_the_token_api_F07(kv_allocator) -> None:
    """F07. Two segments share a partial boundary page. With the caller computing last_loc (token API), both
    decodes are handed the same slot, and freeing both segments frees the page twice. Through the table (fork
    + decode) the slots differ, none is live elsewhere, and each page is freed once, by its last holder."""
    alloc = kv_allocator(4, 8)
    a = alloc.alloc_extend(_t(0), _t(5), _t(-1))      # pages 1, 2 (page 2 partial)
    b = a.clone()                                     # a second segment on the same pages (shared prefix)
    got = torch.cat([alloc.alloc_decode(_t(6), a[-1:]), alloc.alloc_decode(_t(6), b[-1:])])
    assert got[0] == got[1]                           # one slot handed out twice
    alloc.free(torch.cat([a, got[:1]]))
    with pytest.raises(DoubleFreeError):
        alloc.free(torch.cat([b, got[1:]]))

    alloc = kv_allocator(4, 8)
    table = RequestTable(alloc, max_requests=2, max_tokens_per_request=12, zero_page=False)
    (ra,) = table.new_requests(1).tolist()
    table.extend([ra], [5])
    rb = table.fork(ra, 5)
    got = table.decode([ra, rb])
    assert got.tolist() == [13, 9]                    # a copies page 2 to page 3 first; b then writes page 2
    assert table.tokens(ra).tolist() == [4, 5, 6, 7, 12, 13] and table.tokens(rb).tolist() == [4, 5, 6, 7, 8, 9]
    table.free_requests([ra])
    assert _live(alloc) == 2                          # pages 1 and 2, b's; a's copy 3 is freed
    table.free_requests([rb])
    _everything_returned(alloc)
    table.check_invariants()


def test_sink_reads_padded_lane_masked_read_is_finite_through_the_table_F05(kv_allocator) -> None:
    """sglang #36207 / #32477 (F05). A padded lane writes NaN into the sink; a masked read through the same sink
    (k[translate(0)] * 0) is NaN. Through the table padded writes go to pad_write_vtoken (the sink) and padded
    reads to pad_read_vtoken, the zero page no write maps to: the masked read is 0; so is a read of
    req_to_token past a request's length."""
    alloc = kv_allocator(2, 8, dtype=KVDtype.FP32)
    k, _ = alloc.arena.kv_views("full", 0)

    def at(vtokens: torch.Tensor) -> torch.Tensor:
        phys = alloc.translate(vtokens, "full")
        return k[phys // 2, phys % 2]

    def write(vtokens: torch.Tensor, value: float) -> None:
        phys = alloc.translate(vtokens, "full")
        k[phys // 2, phys % 2] = value

    write(_t(0), float("nan"))                        # a padded lane of the token API writes the sink
    assert bool(torch.isnan(at(_t(0)) * 0).all())     # and its masked read reads it back

    table = RequestTable(alloc, max_requests=2, max_tokens_per_request=6)
    (s,) = table.new_requests(1).tolist()
    write(table.extend([s], [3]), 1.0)
    write(_t(table.pad_write_vtoken), float("nan"))
    assert alloc.translate(_t(table.pad_write_vtoken), "full").tolist() == [0]
    assert torch.equal(at(_t(table.pad_read_vtoken)) * 0, torch.zeros(1, 1, 4))
    row = table.req_to_token[s].to(torch.int64)       # a kernel reading the whole row, past the length
    vals = at(row)
    assert bool(torch.isfinite(vals).all()) and vals[:3].eq(1).all() and vals[3:].eq(0).all()
    table.check_invariants()


def test_one_table_per_owner_end_on_an_allocator_with_two_id_owners() -> None:
    full = EndSpec("full", (LayerSpec.mha(1, 4),), page_size=2)                  # 32 B pages, grows up
    draft = EndSpec("draft", (LayerSpec.mha(1, 2),), page_size=4, grow=Grow.DOWN, role=EndRole.DRAFT)  # own ids
    alloc = MultiEndedAllocator(Arena(ArenaSpec((full, draft), arena_bytes=640)))
    with pytest.raises(UmallocValueError, match="ambiguous"):
        RequestTable(alloc, max_requests=2, max_tokens_per_request=8)
    target = RequestTable(alloc, max_requests=2, max_tokens_per_request=8, owner="full")
    drafts = RequestTable(alloc, max_requests=2, max_tokens_per_request=8, owner="draft")
    (t,) = target.new_requests(1).tolist()
    (d,) = drafts.new_requests(1).tolist()
    assert target.extend([t], [3]).tolist() == [4, 5, 6] and drafts.extend([d], [5]).tolist() == [8, 9, 10, 11, 12]
    assert alloc.stats()["full"].live_pages == 3 and alloc.stats()["draft"].live_pages == 3
    drafts.free_requests([d])
    assert alloc.stats()["draft"].live_pages == 1 and alloc.stats()["full"].live_pages == 3
    target.check_invariants()
    drafts.check_invariants()


def test_pages_freed_under_a_lease_stay_pending_and_are_nobody_s_leak(kv_allocator) -> None:
    """Every live page is held by a request or an engine reference; a page a lease pins when its request frees
    it is pending (not live, not reusable) until the lease is released, and no check calls it a leak."""
    alloc = kv_allocator(2, 8)
    table = RequestTable(alloc, max_requests=1, max_tokens_per_request=8)
    (s,) = table.new_requests(1).tolist()
    table.extend([s], [4])                            # pages 2, 3
    lease = alloc.lease({"full": alloc.translate_pages(table.pages(s), "full")})
    table.free_requests([s], cache=False)
    st = alloc.stats()["full"]
    assert (st.live_pages, st.pending_pages) == (1, 2)
    table.check_invariants()
    lease.release()
    assert alloc.stats()["full"].pending_pages == 0 and alloc.available_pages("full") == 7
    table.check_invariants()


# ---- compaction, devices ------------------------------------------------------------------------------------------
def test_compaction_moves_shared_pages_and_req_to_token_stays(kv_allocator) -> None:
    alloc = kv_allocator(2, 10)
    table = RequestTable(alloc, max_requests=3, max_tokens_per_request=8)
    s = table.new_requests(2)
    table.extend(s, _t(2, 4))                         # r0: page 2; r1: pages 3, 4
    r2 = table.fork(1, 4)
    env = alloc.arena.envelopes("full")
    env[3], env[4] = 33, 44
    table.free_requests(_t(0))                        # page 2 becomes a hole
    rows = table.req_to_token.clone()
    report = alloc.compact("full")
    assert report.pages_moved >= 1 and torch.equal(rows, table.req_to_token)
    phys = alloc.translate_pages(table.pages(r2), "full")
    assert env[phys[0]].eq(33).all() and env[phys[1]].eq(44).all()
    table.check_invariants()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_arena_keeps_the_device_req_to_token_equal_to_the_master() -> None:
    full = EndSpec("full", (LayerSpec.mha(1, 4),), page_size=2)
    swa = EndSpec("swa", (LayerSpec.mha(1, 4, window_tokens=4),), page_size=2, grow=Grow.DOWN, owner="full",
                  role=EndRole.SWA)
    alloc = MultiEndedAllocator(Arena(ArenaSpec((full, swa), arena_bytes=32 * 41), device="cuda"))
    table = RequestTable(alloc, max_requests=3, max_tokens_per_request=12)
    assert table.req_to_token.is_cuda
    s = table.new_requests(2)
    table.extend(s, _t(5, 3))
    b = table.fork(0, 5)
    table.decode(torch.tensor([0, 1, b]))
    table.truncate(_t(1), _t(2))
    table.free_requests(_t(0), cache=True)
    table.check_invariants()
    assert table.req_to_token[1, :2].cpu().tolist() == table.tokens(1).tolist()
    assert bool((table.req_to_token[1, 2:] == table.pad_read_vtoken).all())


def test_on_evict_may_call_back_into_the_table() -> None:
    """An ``on_evict`` that frees another request (a nested call reusing the table's scratch) frees exactly the
    evicted page, and every invariant holds."""
    alloc = small_allocator()
    table = RequestTable(alloc, max_requests=4, max_tokens_per_request=12)
    s = table.new_requests(3)
    table.extend(s, torch.tensor([2, 2, 2]))            # one page each
    table.free_requests(s[:1], cache=True)               # request 0's page cached
    cached = table.cached_pages().tolist()
    seen = []
    table.on_evict = lambda vp: (seen.append(vp.tolist()), table.free_requests(s[1:2]))
    assert table.evict(1) == 1
    assert seen == [cached]
    table.check_invariants()
    assert table.stats().held_pages == 2                 # request 2's page and the zero page


def test_a_second_exclusive_table_or_foreign_live_pages_are_refused() -> None:
    alloc = small_allocator()
    first = RequestTable(alloc, max_requests=2, max_tokens_per_request=4)
    with pytest.raises(UmallocValueError, match="already has a request table"):
        RequestTable(alloc, max_requests=2, max_tokens_per_request=4)
    other = small_allocator()
    other.alloc_pages(2)
    snap = other.snapshot()
    with pytest.raises(UmallocValueError, match="2 live pages"):
        RequestTable(other, max_requests=2, max_tokens_per_request=4)
    assert snapshots_equal(snap, other.snapshot())
    other.check_invariants()
    first.check_invariants()


def test_an_extend_that_cannot_fit_evicts_nothing() -> None:
    """3 usable pages are free + 1 cached; an extend needing 5 returns None, calls no on_evict, changes nothing."""
    evicted = []
    alloc = small_allocator()
    table = RequestTable(alloc, max_requests=4, max_tokens_per_request=12, on_evict=evicted.append)
    s = table.new_requests(3)
    table.extend(s, torch.tensor([2, 2, 2]))
    table.free_requests(s[:1], cache=True)
    before, tbefore = alloc.snapshot(), table.snapshot()
    assert table.extend(s[2:], torch.tensor([10])) is None
    assert evicted == []
    assert snapshots_equal(before, alloc.snapshot()) and snapshots_equal(tbefore, table.snapshot())


def test_huge_counts_and_ids_get_typed_errors_and_change_nothing() -> None:
    import numpy as np

    alloc = small_allocator()
    table = RequestTable(alloc, max_requests=4, max_tokens_per_request=12)
    slots = table.new_requests(2)
    table.extend(slots, torch.tensor([2, 2]))
    before, tbefore = alloc.snapshot(), table.snapshot()
    assert table.new_requests(5) is None                 # more than every slot
    for call, err in ((lambda: table.new_requests(2**70), UmallocValueError),
                      (lambda: table.evict(2**70), UmallocValueError),
                      (lambda: table.decode([2**70]), InvalidIdError),
                      (lambda: table.retain(np.array([2**64 - 1], np.uint64)), InvalidIdError)):
        with pytest.raises(err, match=r"2\*\*63"):
            call()
    assert snapshots_equal(before, alloc.snapshot()) and snapshots_equal(tbefore, table.snapshot())
    table.check_invariants()


def test_drop_refs_has_no_old_name(kv_allocator) -> None:
    """``drop_refs`` is the only name for dropping engine references (the name before it, listed in CHANGELOG.md, is
    gone, not aliased)."""
    table = RequestTable(kv_allocator(2, 8), max_requests=2, max_tokens_per_request=8)
    assert hasattr(table, "drop_refs") and not hasattr(table, "release")
