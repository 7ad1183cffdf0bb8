"""umalloc.requests.pagerefs.PageRefs (the holders of an id allocator's pages) and the allocator's exact-id entry
``claim_pages``. Expected ids are worked out by hand from the documented policy; the random test checks every
step against a plain-Python model of the same rules (counts, an LRU list, lowest free id first)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from umalloc import EndSpec, LayerSpec
from umalloc.errors import DoubleFreeError, InvalidIdError, InvariantError, UmallocValueError
from umalloc.integrations.vllm import END, ID_PAGE_BYTES, id_allocator
from umalloc.requests.pagerefs import PAGE_CACHED, PAGE_HELD, PAGE_NOT_MANAGED, PageRefs
from umalloc.testing import small_allocator


def _a(*ids: int) -> np.ndarray:
    return np.array(ids, np.int64)


#: the geometry of :func:`id_allocator`: one end of one-token pages of ID_PAGE_BYTES
ID_ENDS = (EndSpec(END, (LayerSpec.mha(1, 4),), page_size=1),)
#: :func:`id_allocator`'s allocator with ``debug_checks=True``: every PageRefs call takes the allocator's public
#: path (Note [Fused kernels]), and the allocator checks every invariant, the holder's too, after each of its calls
CHECKED = {"compaction": "off", "debug_checks": True}


# ---- claim_pages ------------------------------------------------------------------------------------------------
def test_claim_pages_takes_exact_ids_on_their_own_physical_pages():
    alloc = id_allocator(16)                         # ids 1..15
    alloc.claim_pages([5])                           # past the band: 1..4 become holes
    assert alloc.alloc_pages(3).tolist() == [1, 2, 3]
    alloc.free_pages(_a(2))
    alloc.claim_pages(_a(2, 9))                      # a hole, and past the band again
    assert alloc.alloc_pages(3).tolist() == [4, 6, 7]
    v2p = alloc.v2p(END).numpy()
    assert v2p.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, -1, 9] + [-1] * 6
    assert alloc.available_pages(END) == 7           # 8 and 10..15
    alloc.check_invariants()


@pytest.mark.parametrize("bad", [[0], [16], [-1], [3], [8, 8]])
def test_claim_pages_refuses_bad_ids_and_changes_nothing(bad):
    alloc = id_allocator(16)
    alloc.alloc_pages(3)                             # 1 2 3 live
    before = alloc.snapshot()
    with pytest.raises(InvalidIdError):
        alloc.claim_pages(bad)
    from umalloc.allocator.facade import snapshots_equal

    assert snapshots_equal(before, alloc.snapshot())
    alloc.check_invariants()


def test_claim_pages_refuses_an_allocator_that_is_not_an_id_allocator():
    with pytest.raises(UmallocValueError, match="id allocator"):
        small_allocator().claim_pages([3])


# ---- PageRefs ------------------------------------------------------------------------------------------------------
def test_take_hands_out_free_ids_first_then_evicts_cached_lru_first():
    refs = PageRefs(id_allocator(8))                 # pages 1..7
    assert refs.take(5).tolist() == [1, 2, 3, 4, 5]
    refs.unref(_a(-3, -1, 2))                        # 3 then 1 cached (LRU: 3 first), 2 free
    assert (refs.num_free, refs.num_cached) == (3, 2)
    assert refs.cached().tolist() == [3, 1] and refs.free_ids().tolist() == [2, 6, 7]
    assert refs.take(3).tolist() == [2, 6, 7] and refs.evicted().tolist() == []   # no eviction while free
    assert refs.take(1).tolist() == [3] and refs.evicted().tolist() == [3]         # the LRU cached page
    assert refs.state(3) == PAGE_HELD and refs.state(1) == PAGE_CACHED and refs.ref_counts[3] == 1
    refs.check_invariants()
    with pytest.raises(UmallocValueError):
        refs.take(2)                                 # 1 page left (cached 1)
    assert (refs.num_free, refs.num_cached) == (0, 1)
    refs.check_invariants()


def test_ref_revives_cached_pages_and_claims_free_ones_by_id():
    refs = PageRefs(id_allocator(8))
    refs.take(2)                                     # 1 2
    refs.unref(_a(-1))                               # 1 cached
    assert refs.ref(_a(1, 5, 5, 0)) == 1             # 1 revived; 5 claimed from the allocator, twice; 0 skipped
    assert refs.ref_counts[1] == 1 and refs.ref_counts[5] == 2 and refs.state(5) == PAGE_HELD
    assert refs.free_ids().tolist() == [3, 4, 6, 7] and refs.num_free == 4
    assert refs.take(2).tolist() == [3, 4]
    refs.check_invariants()
    with pytest.raises(InvalidIdError):
        refs.ref(_a(2, 8))
    assert refs.ref_counts[2] == 1                   # nothing changed
    refs.check_invariants()


def test_unref_is_all_or_nothing_and_refuses_a_double_free():
    refs = PageRefs(id_allocator(6))
    refs.take(3)                                     # 1 2 3
    refs.unref(_a(2))
    with pytest.raises(DoubleFreeError, match="double"):
        refs.unref(_a(1, 3, 2))                      # 2 has no reference left
    assert [refs.ref_counts[i] for i in (1, 2, 3)] == [1, 0, 1] and refs.num_free == 3
    with pytest.raises(InvalidIdError):
        refs.unref(_a(1, -9))
    assert refs.ref_counts[1] == 1
    refs.check_invariants()


def test_check_invariants_reports_a_leak_and_pages_moved_behind_its_back():
    refs = PageRefs(id_allocator(6))
    refs.take(2)
    refs.ref_counts[1] = 0                           # dropped outside unref: held by no one (a leak)
    with pytest.raises(InvariantError, match=r"\[held\]"):
        refs.check_invariants()
    refs.ref_counts[1] = 1
    refs.check_invariants()
    refs.alloc.alloc_pages(1)                        # id 3, allocated behind the owner
    with pytest.raises(InvariantError, match=r"\[owner-live\] page refs: page 3"):
        refs.alloc.check_invariants()                # the allocator's check runs the owner's too


def test_uncache_returns_only_cached_pages():
    refs = PageRefs(id_allocator(6))
    refs.take(3)
    refs.unref(_a(-1, -2))
    assert refs.uncache(_a(2, 3)) == 1               # 3 is held: untouched
    assert refs.cached().tolist() == [1] and refs.state(2) == PAGE_NOT_MANAGED
    assert refs.uncache_all() == 1 and refs.num_free == 4
    refs.check_invariants()


def test_cache_first_moves_cached_pages_to_the_lru_head_in_their_order():
    refs = PageRefs(id_allocator(8))                 # pages 1..7
    refs.take(7)
    refs.unref(_a(-1, -2, -3, -4))                   # LRU 1 2 3 4; 5..7 held
    assert refs.cache_first(_a(3, 5, 4)) == 2        # 5 is held: untouched
    assert refs.cached().tolist() == [3, 4, 1, 2]
    assert refs.cache_first([2]) == 1 and refs.cached().tolist() == [2, 3, 4, 1]
    refs.check_invariants()
    assert refs.take(3).tolist() == [2, 3, 4] and refs.evicted().tolist() == [2, 3, 4]   # evicted head first
    refs.check_invariants()


def test_pagerefs_refuses_a_used_or_multi_end_allocator():
    alloc = id_allocator(4)
    alloc.alloc_pages(1)
    with pytest.raises(UmallocValueError, match="live pages"):
        PageRefs(alloc)
    with pytest.raises(UmallocValueError, match="id allocator"):
        PageRefs(small_allocator())


def test_direct_kernel_args_only_where_a_call_is_its_kernel_alone(make_allocator):
    root, owner, mask, lease_work = id_allocator(4).direct_kernel_args()
    assert type(root) is int and root != 0 and (owner, mask) == (0, mask) and not lease_work
    assert make_allocator(ID_ENDS, 4 * ID_PAGE_BYTES, **CHECKED).direct_kernel_args() is None


def test_keep_flags_decide_cached_or_free_and_take_lists_the_kept_pages_it_hands_out():
    refs = PageRefs(id_allocator(8))                 # pages 1..7
    refs.take(4)                                     # 1 2 3 4
    refs.keep_flags[2] = refs.keep_flags[4] = 1      # 2 and 4 hold content worth keeping
    refs.unref([4, 3, 2, 1])                         # 4 then 2 cached; 3 and 1 free
    assert refs.cached().tolist() == [4, 2] and refs.free_ids().tolist() == [1, 3, 5, 6, 7]
    assert refs.take(5).tolist() == [1, 3, 5, 6, 7] and refs.num_taken_kept == 0
    refs.keep_flags[4] = 0                           # the engine dropped 4's content (still cached)
    assert refs.take(2).tolist() == [4, 2] and refs.taken_kept().tolist() == [2]
    assert refs.evicted().tolist() == [4, 2]
    refs.check_invariants()
    refs.keep_flags[6] = 1
    refs.unref([-1, 6])                              # -1: cached this once (flag clear); 6: by its flag
    assert refs.cached().tolist() == [1, 6] and refs.num_free == 0
    refs.check_invariants()


def test_a_flagged_free_page_is_listed_when_handed_out():
    refs = PageRefs(id_allocator(5))
    refs.keep_flags[2] = 1                           # flagged while free (a hash put on a free vLLM block)
    assert refs.take(3).tolist() == [1, 2, 3] and refs.taken_kept().tolist() == [2]
    assert refs.evicted().tolist() == []


@pytest.mark.parametrize("bad", [[1.0], [1, "2"], [2**63], [None]])
def test_list_ids_refuse_non_ints_and_change_nothing(bad):
    refs = PageRefs(id_allocator(6))
    refs.take(2)
    for call in (refs.ref, refs.unref):
        with pytest.raises(InvalidIdError):
            call(bad)
    assert [refs.ref_counts[i] for i in (1, 2)] == [1, 1] and refs.num_free == 3
    refs.check_invariants()


def test_the_public_path_checks_the_holder_only_once_a_call_is_done(make_allocator):
    # debug_checks: the allocator runs every check, PageRefs' holder check too, after alloc_pages / free_pages;
    # mid-take the allocator has the pages and PageRefs does not yet: that check must wait for the call's end
    refs = PageRefs(make_allocator(ID_ENDS, 6 * ID_PAGE_BYTES, **CHECKED))
    assert refs.take(3).tolist() == [1, 2, 3]
    refs.keep_flags[1] = 1
    refs.unref([1, 2])
    assert refs.take(3).tolist() == [2, 4, 5] and refs.ref([5, 3]) == 0
    assert refs.take(1).tolist() == [1] and refs.evicted().tolist() == [1]
    refs.unref(_a(1, 2))
    assert refs.uncache_all() == 1 and refs.num_free == 2   # 1 (cached by its flag) and 2
    refs.ref_counts[3] = 0                           # a leak: the next call's check reports it
    with pytest.raises(InvariantError, match=r"\[held\]"):
        refs.unref([5])


@pytest.mark.parametrize("one_page", [False, True], ids=["batches", "one-page"])
@pytest.mark.parametrize("checked", [False, True], ids=["fused", "public"])
def test_random_ops_match_a_model_of_the_rules(make_allocator, checked, one_page):
    # one_page: every take, ref and unref moves at most one page and takes outrun frees, so the free ids run out
    # and the one-page paths (Note [One-page calls]) run: take(1) off the LRU head, unref to the LRU, ref of a
    # held or cached page
    seed = 1234
    print(f"seed {seed}")
    rng = random.Random(seed)
    n = 40
    refs = PageRefs(make_allocator(ID_ENDS, n * ID_PAGE_BYTES, **CHECKED) if checked else id_allocator(n))
    count = [0] * n
    keep = [False] * n                               # the keep flags, as the model sees them
    lru: list[int] = []                              # cached pages, LRU first
    bounds = (0.45, 0.7, 0.85) if one_page else (0.35, 0.65, 0.8)
    for _step in range(1500 if one_page else 600):
        free = [i for i in range(1, n) if count[i] == 0 and i not in lru]
        op = rng.random()
        if op < bounds[0]:
            k = rng.randint(0, min(1, len(free) + len(lru)) if one_page else len(free) + len(lru))
            want = free[:k] + lru[: max(0, k - len(free))]
            del lru[: max(0, k - len(free))]
            got = refs.take(k).tolist()
            assert got == want
            assert refs.taken_kept().tolist() == [i for i in want if keep[i]]
            for i in got:
                count[i] = 1
        elif op < bounds[1]:
            held = [i for i in range(1, n) if count[i] > 0]
            if not held:
                continue
            pick = rng.sample(held, 1 if one_page else rng.randint(1, len(held)))
            once = {i: rng.random() < 0.3 for i in pick}  # -i: cached this once whatever the flag
            entries = [-i if once[i] else i for i in pick]
            refs.unref(entries if rng.random() < 0.5 else np.array(entries, np.int64))
            for i in pick:
                count[i] -= 1
                if count[i] == 0 and (once[i] or keep[i]):
                    lru.append(i)
        elif op < bounds[2]:
            i = rng.randrange(1, n)
            keep[i] = not keep[i]
            refs.keep_flags[i] = int(keep[i])
        else:
            pick = [rng.randrange(1, n) for _ in range(1 if one_page else rng.randint(1, 4))]
            refs.ref(pick if rng.random() < 0.5 else np.array(pick, np.int64))
            for i in pick:
                if i in lru:
                    lru.remove(i)
                count[i] += 1
        assert [refs.ref_counts[i] for i in range(1, n)] == count[1:]
        assert refs.cached().tolist() == lru
        assert refs.num_free == sum(1 for i in range(1, n) if count[i] == 0 and i not in lru)
        refs.check_invariants()


def test_spare_ids_keep_the_lowest_free_id_order_through_every_call():
    # Note [Spare ids]: take(1) mints spares; takes longer than the spares, frees below and above the floor, a
    # claim of a spare (ref of a free page) and an uncache all keep take's order: the lowest free ids first
    seed = 4321
    print(f"seed {seed}")
    rng = random.Random(seed)
    n = 200
    refs = PageRefs(id_allocator(n))
    count = [0] * n
    lru: list[int] = []
    spare_steps = 0                                  # steps with spares: free here, live in the allocator
    for _step in range(3000):
        free = [i for i in range(1, n) if count[i] == 0 and i not in lru]
        op = rng.random()
        if op < 0.45:
            k = 1 if rng.random() < 0.7 else rng.randint(0, len(free) + len(lru))
            k = min(k, len(free) + len(lru))
            want = free[:k] + lru[: max(0, k - len(free))]
            del lru[: max(0, k - len(free))]
            one = k == 1 and rng.random() < 0.5
            assert ([refs.take_one()] if one else refs.take(k).tolist()) == want
            for i in want:
                count[i] = 1
        elif op < 0.8:
            held = [i for i in range(1, n) if count[i] > 0]
            if not held:
                continue
            pick = rng.sample(held, 1 if rng.random() < 0.6 else rng.randint(1, len(held)))
            for i in pick:
                refs.keep_flags[i] = int(rng.random() < 0.2)
            if len(pick) == 1 and rng.random() < 0.5:
                refs.unref_one(pick[0])
            else:
                refs.unref(pick)
            for i in pick:
                count[i] -= 1
                if count[i] == 0 and refs.keep_flags[i]:
                    lru.append(i)
        elif op < 0.95:
            i = rng.randrange(1, n)   # often a spare: claimed by id
            times = rng.randint(1, 2)
            refs.ref([i] * times)
            if i in lru:
                lru.remove(i)
            count[i] += times
        else:
            assert refs.uncache_all() == len(lru)
            lru.clear()
        assert [refs.ref_counts[i] for i in range(1, n)] == count[1:]
        assert refs.cached().tolist() == lru
        assert refs.free_ids().tolist() == [i for i in range(1, n) if count[i] == 0 and i not in lru]
        spare_steps += refs.alloc.available_pages(END) < refs.num_free
        refs.check_invariants()
    assert spare_steps > 100
