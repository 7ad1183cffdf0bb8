"""One test per fault class of shared/FAULTS.md that belongs to the allocator (F01-F08, F15, F18-F20), plus the
allocator side of the shortfall ladder (compaction that would not help moves nothing; the float slide).

Each test fails if its class of bug comes back; expected values are worked out by hand in the comments.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_helpers import T, draft_end, full_end, pages, swa_end

from umalloc.allocator.facade import V_RESERVED, MultiEndedAllocator, snapshots_equal
from umalloc.errors import DoubleFreeError, InvalidIdError, LeaseError, TombstoneError
from umalloc.geometry.spec import Grow
from umalloc.pool.pagestate import PAGE_HOLE, PAGE_LIVE, PAGE_PENDING, PAGE_RESERVED, TOMBSTONE


def marker(alloc: MultiEndedAllocator, end: str, vpages: torch.Tensor) -> torch.Tensor:
    """The first 8 bytes of each page's envelope as int64, read through the virtual pages."""
    phys = alloc.translate_pages(vpages, end)
    return alloc.arena.envelopes(end)[phys, :8].contiguous().view(torch.int64).view(-1)


def stamp(alloc: MultiEndedAllocator, end: str, vpages: torch.Tensor, values: torch.Tensor) -> None:
    phys = alloc.translate_pages(vpages, end)
    alloc.arena.envelopes(end)[phys, :8] = values.view(torch.uint8).view(-1, 8)


def test_F01_releasing_one_token_retires_its_whole_page(checked_allocator) -> None:
    alloc = checked_allocator((full_end(ps=4), swa_end(ps=4)), 64 * 10)        # page_size 4
    t = alloc.alloc_extend(T(0), T(8), T(-1))                     # vpages 1, 2: tokens 4..11
    alloc.free(t[1:2])                                            # one token of vpage 1
    for tok in t[:4].tolist():                                    # every token of the page is retired at once
        with pytest.raises(TombstoneError):
            alloc.translate(T(tok), "full")
    assert alloc.translate(t[4:], "full").tolist() == [8, 9, 10, 11]
    with pytest.raises(DoubleFreeError):                          # no half-applied page left to free
        alloc.free(t[3:4])
    alloc.unbind_end("swa", t[6:7])                              # one token releases vpage 2 on swa, whole
    for tok in t[4:].tolist():
        with pytest.raises(TombstoneError):
            alloc.translate(T(tok), "swa")
    st = alloc.stats()
    assert (st["full"].live_pages, st["swa"].live_pages, st["full"].pages_freed, st["swa"].pages_unbound) == \
        (1, 0, 1, 1)


def test_F02_reused_virtual_ids_and_pages_start_clean(full_swa) -> None:
    alloc = full_swa()
    v = alloc.alloc_pages(2, bind=[])                             # vpages 1, 2 deliberately unbound on swa
    alloc.free(v * 2)
    w = alloc.alloc_pages(2, bind=[])
    assert w.tolist() == [1, 2]
    assert alloc.v2p("swa").tolist()[1:3] == [TOMBSTONE, TOMBSTONE]
    alloc.free(w * 2)
    x = alloc.alloc_pages(1)                                      # vpage 1, now bound on swa (page 9)
    assert pages(alloc, x, "swa") == [9]
    alloc.unbind_end("swa", x * 2)
    alloc.free(x * 2)
    y = alloc.alloc_pages(1, bind=[])                             # vpage 1 again, unbound on swa again
    assert y.tolist() == [1] and alloc.v2p("swa")[1].item() == TOMBSTONE
    assert (alloc.ends["swa"].p2v == TOMBSTONE).all()
    # a page freed under a lease and reused after it: its pin count starts at 0
    lease = alloc.lease({"full": alloc.translate_pages(y, "full")})
    alloc.free(y * 2)
    lease.release()
    z = alloc.alloc_pages(1)
    assert pages(alloc, z, "full") == [1] and alloc.lease_table.pin_count("full")[1] == 0
    alloc.free(z * 2)                                             # not pending: no stale pin
    assert alloc.stats()["full"].pending_pages == 0


def test_F03_a_deferred_reclaim_keeps_the_page_it_captured(full_swa) -> None:
    alloc = full_swa()
    v = alloc.alloc_pages(2)                                      # full 1, 2
    stamp(alloc, "full", v, T(111, 222))
    lease = alloc.lease({"full": T(1)})
    alloc.free(v[:1] * 2)                                         # vpage 1: full page 1 pending (captured)
    w = alloc.alloc_pages(1)                                      # vpage 1 re-minted -> full page 3
    assert w.tolist() == [1] and pages(alloc, w, "full") == [3]
    stamp(alloc, "full", w, T(333))
    lease.release()                                               # the deferred reclaim of page 1 resolves now
    assert alloc.ends["full"].state[1] == PAGE_HOLE               # page 1, not vpage 1's current page 3
    assert alloc.ends["full"].state[3] == PAGE_LIVE and pages(alloc, w, "full") == [3]
    assert alloc.compact("full").pages_moved == 1                 # 3 -> 1, bytes follow
    assert pages(alloc, w, "full") == [1] and marker(alloc, "full", T(1, 2)).tolist() == [333, 222]


def test_F04_the_sink_never_enters_a_release_path(full_swa) -> None:
    alloc = full_swa()
    t = alloc.alloc_extend(T(0), T(4), T(-1))
    for call in (lambda: alloc.free(T(0)), lambda: alloc.free(T(1)), lambda: alloc.unbind_end("swa", T(1)),
                 lambda: alloc.bind_end("swa", T(0))):
        before = alloc.snapshot()
        with pytest.raises(InvalidIdError):
            call()
        assert snapshots_equal(before, alloc.snapshot())
    with pytest.raises(LeaseError):
        alloc.lease({"swa": T(0)})
    alloc.free(t)
    rng = np.random.default_rng(4)
    live: list[int] = []
    for _ in range(200):
        if live and rng.random() < 0.5:
            alloc.free(T(live.pop(int(rng.integers(len(live))))) * 2)
        else:
            v = alloc.alloc_pages(int(rng.integers(1, 3)))
            if v is not None:
                assert 0 not in v.tolist() and 0 not in pages(alloc, v, "full") + pages(alloc, v, "swa")
                live += v.tolist()
        for end in ("full", "swa"):
            view = alloc.ends[end]
            assert view.state[0] == PAGE_RESERVED and view.v2p[0] == 0
            assert alloc.available_pages(end) <= view.top_page - view.first_page + 1
        assert alloc.snapshot()["owners"]["full"]["vstate"][0] == V_RESERVED
    if live:
        alloc.free(T(*live) * 2)
    assert alloc.available_pages("full") == 9 and alloc.available_pages("swa") == 9


def test_F05_padding_lanes_hit_the_sink_which_is_never_handed_out_or_moved(full_swa) -> None:
    alloc = full_swa(compaction="eager")
    t = alloc.alloc_extend(T(0, 0), T(4, 4), T(-1, -1))           # vpages 1, 2 | 3, 4
    lanes = torch.cat([t, torch.zeros(4, dtype=torch.int64)])     # a padded block-table row
    phys = alloc.translate(lanes, "full")
    assert phys[-4:].tolist() == [0, 0, 0, 0]                     # padding writes land in the sink
    vps = torch.unique(t // 2)
    stamp(alloc, "full", vps, vps * 10)
    alloc.arena.envelopes("full")[0] = 0xEE                       # a padded lane scribbles on the sink
    alloc.free(t[:4])                                             # eager compaction moves 3, 4 down
    assert alloc.stats()["full"].pages_moved == 2
    assert marker(alloc, "full", T(3, 4)).tolist() == [30, 40]    # nothing read the sink's bytes
    assert (alloc.arena.envelopes("full")[0] == 0xEE).all()       # and nothing moved into it
    for _ in range(20):
        v = alloc.alloc_pages(1)
        if v is None:
            break
        assert 0 not in pages(alloc, v, "full") + pages(alloc, v, "swa")


def test_F06_the_same_page_twice_in_one_batch_is_freed_once(full_swa) -> None:
    alloc = full_swa()
    t = alloc.alloc_extend(T(0), T(4), T(-1))                     # vpages 1, 2: tokens 2 3 4 5
    alloc.free(torch.cat([t[:2], t[:2], t[1:2]]))                 # vpage 1 five times
    st = alloc.stats()["full"]
    assert (st.pages_freed, st.hole_pages, st.live_pages) == (1, 1, 1)
    v = alloc.alloc_pages(3)
    got = pages(alloc, v, "full") + pages(alloc, t[2:3] // 2, "full")
    assert sorted(got) == sorted(set(got)) == [1, 2, 3, 4]       # no physical page handed out twice
    st = alloc.stats()["full"]
    assert st.live_pages + st.free_pages == 9 - alloc.stats()["swa"].live_pages   # free + live = capacity
    alloc.check_invariants()


def test_F07_two_segments_sharing_a_page_free_it_once(checked_allocator) -> None:
    alloc = checked_allocator((full_end(ps=4), swa_end(ps=4)), 64 * 10)
    t = alloc.alloc_extend(T(0), T(6), T(-1))                     # positions 0..5: vpage 1 (0-3), vpage 2 (4-5)
    seg1, seg2 = t[:4], t[3:]                                     # both touch vpage 1 (position 3)
    before = alloc.snapshot()
    alloc.free(seg1)
    with pytest.raises(DoubleFreeError):                          # seg2 still names the shared page: rejected
        alloc.free(seg2)
    assert alloc.stats()["full"].live_pages == 1                  # ... and not half-applied: vpage 2 is live
    alloc2 = checked_allocator((full_end(ps=4), swa_end(ps=4)), 64 * 10)
    t2 = alloc2.alloc_extend(T(0), T(6), T(-1))
    assert torch.equal(t, t2) and snapshots_equal(before, alloc2.snapshot())
    alloc2.free(torch.cat([t2[:4], t2[3:]]))                      # one batch: the shared page once
    assert alloc2.stats()["full"].pages_freed == 2
    # page arithmetic uses absolute positions: a last_loc at the wrong offset is refused
    t3 = alloc2.alloc_extend(T(0), T(5), T(-1))                   # positions 0..4, last token at offset 0
    with pytest.raises(InvalidIdError, match="page offset"):
        alloc2.alloc_decode(T(6), t3[3:4])                        # claims position 4 is t3[3] (offset 3)


def test_F08_freeing_a_request_returns_exactly_what_it_holds(checked_allocator) -> None:
    alloc = checked_allocator((full_end(), swa_end()), 32 * 30)                # page_size 2, pages 1..29
    lens = [5, 3, 8]
    t = alloc.alloc_extend(T(0, 0, 0), T(*lens), T(-1, -1, -1))
    reqs = list(torch.split(t, lens))
    for r, n in zip(reqs, lens, strict=True):                     # page-aligned extents: offset == position % ps
        assert ((r % 2) == torch.arange(n) % 2).all()
    assert alloc.stats()["full"].live_pages == 3 + 2 + 4
    # decode one token onto request 0 (position 5 starts no page: offset 1 of vpage 3)
    d = alloc.alloc_decode(T(6), reqs[0][-1:])
    reqs[0] = torch.cat([reqs[0], d])
    alloc.free(reqs[1])
    st = alloc.stats()["full"]
    assert (st.pages_freed, st.live_pages) == (2, 7)
    assert alloc.translate(reqs[0], "full").numel() == 6 and alloc.translate(reqs[2], "full").numel() == 8
    alloc.free(reqs[0])
    assert alloc.stats()["full"].pages_freed == 2 + 3 and alloc.stats()["full"].live_pages == 4


def test_F15_bound_tables_are_sized_and_checked_by_the_owner_id_space(checked_allocator) -> None:
    # full: 32 B pages, 10 slots (its virtual id space); swa: 16 B pages, 20 physical slots
    alloc = checked_allocator((full_end(), swa_end(head_dim=2)), 320)
    assert alloc.num_vpages() == 10
    assert alloc.v2p("swa").numel() == 10 and alloc.p2v("swa").numel() == 20
    v = alloc.alloc_pages(3)
    assert pages(alloc, v, "swa") == [17, 18, 19]
    with pytest.raises(InvalidIdError, match=r"allowed \[0, 20\)"):
        alloc.translate(T(20), "swa", strict=False)               # token 20 = vpage 10: outside the owner's ids
    with pytest.raises(InvalidIdError):
        alloc.translate_pages(T(12), "swa", strict=False)         # a valid *physical* swa page, not a vpage
    with pytest.raises(TombstoneError):
        alloc.translate_pages(T(9), "swa")
    with pytest.raises(InvalidIdError):
        alloc.free(T(24))


@pytest.mark.parametrize("page_size, window", [(2, 4), (4, 3), (8, 3), (1, 5), (4, 4)])
def test_F18_pages_overlapping_the_window_are_never_released(checked_allocator, page_size: int, window: int) -> None:
    alloc = checked_allocator((full_end(ps=page_size), swa_end(ps=page_size)), 16 * page_size * 40)
    ps = page_size
    toks = alloc.alloc_extend(T(0), T(1), T(-1))
    released = 0
    for L in range(2, 30):
        toks = torch.cat([toks, alloc.alloc_decode(T(L), toks[-1:])])
        tail = alloc.swa_tail_start(L, window, 0, ps)             # first token whose swa page must exist
        assert tail % ps == 0 and tail <= max(0, L - window)
        if tail > released:
            alloc.unbind_end("swa", toks[released:tail:ps])
            released = tail
        window_toks = toks[max(0, L - window):L]
        alloc.translate(window_toks, "swa")                       # strict: every token in the window is bound
        assert alloc.stats()["swa"].live_pages == -(-L // ps) - tail // ps
    alloc.free(toks)
    assert alloc.stats()["swa"].live_pages == 0


def test_F19_swa_is_priced_by_the_window_tail(checked_allocator) -> None:
    # full: 32 B pages; swa: 32 B pages; page_size 2; window 4. A 12-token sequence needs 6 full pages and
    # only the tail [floor_to_page(12 - 4), 12) = [8, 12) on swa: 2 pages. Arena: floor + exactly 8 pages.
    alloc = checked_allocator((full_end(), swa_end()), 32 * 9)
    L, W, ps = 12, 4, 2
    assert not alloc.can_alloc({"full": 6, "swa": 6})            # pricing swa by the whole sequence fails
    tail = alloc.swa_tail_start(L, W, 0, ps)
    assert tail == 8
    assert alloc.can_alloc({"full": 6, "swa": (L - tail) // ps})
    t = alloc.alloc_extend(T(0), T(L), T(-1), bind=[])
    assert alloc.bind_end("swa", t[tail:])
    st = alloc.stats()
    assert (st["full"].live_pages, st["swa"].live_pages, st["full"].free_pages) == (6, 2, 0)
    assert alloc.translate(t[tail:], "swa").numel() == 4
    with pytest.raises(TombstoneError):
        alloc.translate(t[:tail], "swa")


def _f20_setup(full_swa, **kw) -> tuple[MultiEndedAllocator, torch.Tensor]:
    alloc = full_swa(**kw)
    v = alloc.alloc_pages(7, bind=[])                             # full 1..7
    alloc.free(v[:3] * 2)                                         # holes 1, 2, 3 (4..7 live)
    return alloc, v[3:]


def test_F20_each_end_is_reported_and_driven_by_its_own_deficit(full_swa) -> None:
    alloc, live = _f20_setup(full_swa, compaction="off")
    assert alloc.shortfall_pages({"swa": 4}) == {"swa": 2}       # swa reaches pages 8, 9 only
    assert alloc.shortfall_pages({"full": 3, "swa": 4}) == {"swa": 2}   # full's holes serve full
    assert not alloc.bind_end("swa", live * 2)
    assert alloc.last_shortfall == {"swa": 2}
    # lazy: the ladder compacts full, the end that bounds swa, by swa's deficit (budget 2 suffices)
    alloc, live = _f20_setup(full_swa, compaction="lazy", move_budget_pages=2)
    stamp(alloc, "full", live, live * 7)
    assert alloc.bind_end("swa", live * 2)
    assert alloc.stats()["full"].pages_moved == 2                 # order-preserving: 6 -> 1, 7 -> 2
    assert pages(alloc, live, "full") == [4, 5, 1, 2] and alloc.band("full") == (1, 6)
    assert pages(alloc, live, "swa") == [6, 7, 8, 9]
    assert marker(alloc, "full", live).tolist() == (live * 7).tolist()


def test_compaction_that_would_not_help_moves_nothing(full_swa) -> None:
    alloc, live = _f20_setup(full_swa, compaction="lazy", move_budget_pages=1)   # one move frees 1 page, swa needs 2
    before = alloc.snapshot()
    assert not alloc.bind_end("swa", live * 2)
    assert snapshots_equal(before, alloc.snapshot())


def test_float_slide_lets_the_walled_in_end_grow(float3) -> None:
    alloc = float3()
    v = alloc.alloc_pages(2)                                      # full 1 2, draft 21 22, swa 18 19
    stamp(alloc, "draft", v, T(5, 6))
    alloc.alloc_pages(7, bind=[])                                 # full 3..9: bytes < 320, draft starts at 336
    assert alloc.available_pages("full") == 0
    w = alloc.alloc_pages(1, bind=[])                             # needs byte 352: the draft slides up one page
    assert pages(alloc, w, "full") == [10]
    assert pages(alloc, v, "draft") == [23, 22] and alloc.band("draft") == (22, 24)
    assert marker(alloc, "draft", v).tolist() == [5, 6]           # bytes followed the move
    assert alloc.stats()["draft"].pages_moved == 1


def test_float_slide_never_moves_a_pinned_page(float3) -> None:
    alloc = float3()
    v = alloc.alloc_pages(2)
    alloc.alloc_pages(7, bind=[])
    with alloc.lease({"draft": T(21)}):
        before = alloc.snapshot()
        assert alloc.alloc_pages(1, bind=[]) is None
        assert snapshots_equal(before, alloc.snapshot())
        assert alloc.ends["draft"].state[21] == PAGE_LIVE
    assert pages(alloc, alloc.alloc_pages(1, bind=[]), "full") == [10]
    assert pages(alloc, v, "draft") == [23, 22]


def test_pending_pages_are_walls_for_the_ladder(full_swa) -> None:
    alloc, live = _f20_setup(full_swa, compaction="lazy")
    lease = alloc.lease({"full": alloc.translate_pages(live[-1:], "full")})   # pin page 7
    alloc.free(live[-1:] * 2)                                     # page 7 pending: the band cannot retreat
    assert alloc.ends["full"].state[7] == PAGE_PENDING
    assert not alloc.bind_end("swa", live[:3] * 2)                # needs 3 swa pages, only 8, 9 reachable
    lease.release()
    assert alloc.bind_end("swa", live[:3] * 2)


def test_draft_end_page_bytes_differ_from_owner(checked_allocator) -> None:
    alloc = checked_allocator((full_end(), draft_end(grow=Grow.DOWN)), 320)
    v = alloc.alloc_pages(2)
    assert pages(alloc, v, "draft") == [18, 19] and alloc.v2p("draft").numel() == 10
