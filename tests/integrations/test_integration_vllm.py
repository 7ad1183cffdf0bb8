"""umalloc.integrations.vllm: the id allocator and the peer-suite comparer (any venv), and the vLLM pool itself
(skipped where vLLM is not importable: the main venv; scripts/peer_suite_vllm.sh runs this file in its vLLM venv).

Expected block ids are worked out by hand from the documented policy: umalloc hands out the lowest free ids in
ascending order; uncached blocks freed go back to umalloc; cached ones wait in LRU order and are evicted only
when umalloc has no free id left.
"""

from __future__ import annotations

import importlib.util
import pathlib
import random
import sys

import numpy as np
import pytest

from umalloc.errors import DoubleFreeError, InvariantError, UmallocError, UmallocValueError
from umalloc.integrations.vllm import END, id_allocator

PEER = pathlib.Path(__file__).resolve().parents[1] / "peer"


def _expectations():
    """tests/peer/vllm_expectations.py (a script beside the plugin, not a package module)."""
    if "vllm_expectations" not in sys.modules:
        spec = importlib.util.spec_from_file_location("vllm_expectations", PEER / "vllm_expectations.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules["vllm_expectations"]


# ---- without vLLM ---------------------------------------------------------------------------------------------
def test_id_allocator_hands_out_block_ids_lowest_first():
    alloc = id_allocator(6)                         # blocks 0..5, block 0 reserved
    assert alloc.alloc_pages(3).tolist() == [1, 2, 3]
    alloc.free_pages(np.array([2], np.int64))
    assert alloc.alloc_pages(2).tolist() == [2, 4]
    assert alloc.available_pages(END) == 1           # only id 5 is left
    assert alloc.translate_pages(alloc.alloc_pages(1), END).tolist() == [5]  # ids are the physical pages


def test_supported_versions_are_checked_with_the_shared_version_error():
    from umalloc.integrations import vllm as umalloc_vllm
    from umalloc.integrations.versions import EngineVersionError

    assert umalloc_vllm.SUPPORTED_VERSIONS == ("0.33.0", "0.34.0")
    assert [umalloc_vllm.check_version(v) for v in ("0.33.0", "0.34.0")] == ["0.33.0", "0.34.0"]
    for bad in ("0.32.1", "0.34.1", "0.35.0", "unknown"):
        with pytest.raises(EngineVersionError, match=f"vLLM {bad} is untested .*allowed 0.33.0, 0.34.0") as e:
            umalloc_vllm.check_version(bad)
        assert type(e.value) is umalloc_vllm.UnsupportedVLLMVersion and e.value.version == bad


@pytest.mark.parametrize("bad", [1, 0, -3, 2.0, True, "8"])
def test_id_allocator_refuses_bad_sizes(bad):
    with pytest.raises(UmallocValueError):
        id_allocator(bad)


@pytest.mark.parametrize("name", ["vllm_expected.txt", "vllm_expected_0.34.txt"])
def test_committed_expectation_file_parses(name):
    ex = _expectations()
    expected = ex.parse((PEER / name).read_text())
    assert expected, "the expectation file lists no test"
    for e in expected.values():
        assert e.nodeid.startswith("tests/v1/core/") and e.reason
        assert e.category in ("env", "by-design")
        assert e.runs == ("umalloc",) if e.category == "by-design" else e.runs == ("stock", "umalloc")


def test_expectations_compare_flags_new_failures_and_new_passes():
    ex = _expectations()
    expected = ex.parse("both t.py::a -- env: no hub\numalloc t.py::b -- by-design: reuse order\n")
    assert ex.compare(expected, "stock", {"t.py::a": "failed", "t.py::b": "passed"}) == ([], [])
    assert ex.compare(expected, "umalloc", {"t.py::a": "failed", "t.py::b": "failed"}) == ([], [])
    assert ex.compare(expected, "umalloc", {"t.py::a": "failed", "t.py::b": "passed", "t.py::c": "failed"}) == (
        ["t.py::c (failed)"], ["t.py::b (passed)"])
    assert ex.compare(expected, "stock", {"t.py::b": "passed"}) == ([], ["t.py::a (not run)"])
    assert ex.compare(expected, "stock", {"t.py::a": "skipped"}) == ([], ["t.py::a (skipped)"])


@pytest.mark.parametrize("text", ["both t.py::a env: x\n", "both t.py::a -- env\n", "both t.py::a -- other: x\n",
                                  "never t.py::a -- env: x\n", "both t.py::a -- env: x\nstock t.py::a -- env: y\n"])
def test_expectations_parse_refuses_malformed_lines(text):
    with pytest.raises(ValueError):
        _expectations().parse(text)


# ---- with vLLM ------------------------------------------------------------------------------------------------
@pytest.fixture
def vllm_pool():
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/peer_suite_vllm.sh runs these tests)")
    from umalloc.integrations.vllm import UmallocBlockPool

    return UmallocBlockPool


def _hashed(pool, block, key: bytes):
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    h = make_block_hash_with_group_id(BlockHash(key), 0)
    block.set_block_hash(h, num_tokens=16)
    pool.cached_block_hash_to_block.insert(h, block)
    return h


def _ids(blocks):
    return [b.block_id for b in blocks]


def test_pool_null_block_is_reserved_page_0_and_ids_come_lowest_first(vllm_pool):
    pool = vllm_pool(8, enable_caching=False, hash_block_size=16)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 7
    a = pool.get_new_blocks(5)
    assert _ids(a) == [1, 2, 3, 4, 5] and all(b.ref_cnt == 1 for b in a)
    pool.free_blocks([a[3], a[1]])                   # blocks 4 and 2 back to umalloc
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [2, 4, 6, 7]
    assert _ids(pool.get_new_blocks(3)) == [2, 4, 6]  # vLLM's own pool would give [2, 4, 6] only by LIFO luck
    assert pool.get_num_free_blocks() == 1
    pool.check_invariants()
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 1
    pool.check_invariants()


def test_pool_evicts_cached_blocks_lru_only_when_umalloc_is_empty(vllm_pool):
    pool = vllm_pool(6, enable_caching=True, hash_block_size=16)
    b = pool.get_new_blocks(4)                       # 1 2 3 4
    h1, h3 = _hashed(pool, b[0], b"one"), _hashed(pool, b[2], b"three")
    pool.free_blocks([b[2], b[0], b[1]])             # 3 then 1 cached (LRU: 3 first), 2 to umalloc
    assert pool.get_num_free_blocks() == 4           # umalloc: 2, 5; evictable: 3, 1
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [2, 5, 3, 1]
    pool.check_invariants()
    assert _ids(pool.get_new_blocks(2)) == [2, 5]    # no eviction while umalloc has ids
    assert pool.get_cached_block(b"three", [0]) == [b[2]]
    assert _ids(pool.get_new_blocks(1)) == [3]       # the LRU cached block is evicted first
    assert pool.get_cached_block(b"three", [0]) is None and pool.get_cached_block(b"one", [0]) == [b[0]]
    assert b[2].block_hash is None and b[0].block_hash == h1 and h3 != h1
    pool.check_invariants()


def test_pool_touch_revives_cached_blocks_and_adopts_never_allocated_ids(vllm_pool):
    pool = vllm_pool(8, enable_caching=True, hash_block_size=16)
    b = pool.get_new_blocks(2)                       # 1 2
    _hashed(pool, b[0], b"one")
    pool.free_blocks([b[0]])                         # 1 cached, ref_cnt 0
    pool.touch([b[0]])                               # a prefix hit revives it
    assert b[0].ref_cnt == 1 and pool.get_num_free_blocks() == 5
    fabricated = pool.blocks[5]                      # never allocated: free in umalloc
    _hashed(pool, fabricated, b"five")
    pool.touch([fabricated])
    assert fabricated.ref_cnt == 1 and pool.get_num_free_blocks() == 4
    assert _ids(pool.get_new_blocks(4)) == [3, 4, 6, 7]
    pool.check_invariants()
    with pytest.raises(UmallocValueError):
        pool.adopt(pool.blocks[3])                   # live: not free in umalloc
    with pytest.raises(UmallocValueError):
        pool.adopt(pool.null_block)
    pool.check_invariants()


def test_pool_reset_prefix_cache_and_evict_blocks_return_ids_to_umalloc(vllm_pool):
    pool = vllm_pool(6, enable_caching=True, hash_block_size=16)
    b = pool.get_new_blocks(3)                       # 1 2 3
    for blk, key in zip(b, (b"a", b"b", b"c"), strict=True):
        _hashed(pool, blk, key)
    pool.free_blocks(b[:2])                          # 1, 2 cached; 3 still held
    pool.evict_blocks({2, 3})                        # 2: un-hashed and back to umalloc; 3: un-hashed, still held
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [2, 4, 5, 1]
    assert b[2].block_hash is None and b[2].ref_cnt == 1
    pool.check_invariants()
    assert pool.reset_prefix_cache() is False        # block 3 is held
    pool.free_blocks([b[2]])
    assert pool.reset_prefix_cache() is True
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [1, 2, 3, 4, 5]
    assert pool.free_block_queue.fake_free_list_head.next_free_block is pool.blocks[1]
    pool.check_invariants()


def test_pool_free_chain_snapshot_walks_every_free_block(vllm_pool):
    pool = vllm_pool(5, enable_caching=True, hash_block_size=16)
    b = pool.get_new_blocks(2)                       # 1 2
    _hashed(pool, b[1], b"two")
    pool.free_blocks([b[1]])                         # umalloc: 3, 4; evictable: 2
    q = pool.free_block_queue
    node, walked = q.fake_free_list_head.next_free_block, []
    while node.next_free_block is not None:
        walked.append(node.block_id)
        node = node.next_free_block
    assert walked == [3, 4, 2] and node is q.fake_free_list_tail
    assert _ids(q.iter_blocks_after(None)) == [3, 4, 2] and _ids(q.iter_blocks_after(pool.blocks[3])) == [4, 2]
    pool.get_new_blocks(3)                           # 3 4, then 2 evicted
    assert q.num_free_blocks == 0
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    assert all(blk.next_free_block is None for blk in pool.blocks[1:])
    pool.check_invariants()


def test_check_invariants_sees_a_block_nobody_holds(vllm_pool):
    pool = vllm_pool(64, enable_caching=False, hash_block_size=16)   # free ids left past the spares
    b = pool.get_new_blocks(1)
    b[0].ref_cnt = 0                                 # a leak: live in umalloc, held by no one
    with pytest.raises(InvariantError, match=r"\[held\]"):
        pool.check_invariants()
    b[0].ref_cnt = 1
    pool.check_invariants()
    pool.allocator.alloc_pages(1)                    # a block taken from umalloc behind the pool
    with pytest.raises(InvariantError, match="owner-live"):
        pool.check_invariants()


def test_keep_flags_are_the_block_hashes_and_a_hash_written_behind_them_is_reported(vllm_pool):
    pool = vllm_pool(6, enable_caching=True, hash_block_size=16)
    b = pool.get_new_blocks(3)                       # 1 2 3
    _hashed(pool, b[1], b"two")
    assert [pool.refs.keep_flags[i] for i in (1, 2, 3)] == [0, 1, 0]
    pool.free_blocks(b)                              # 2 cached (it has a hash), 1 and 3 back to umalloc
    assert pool.refs.cached().tolist() == [2] and _ids(pool.free_block_queue.get_all_free_blocks()) == [1, 3, 4, 5, 2]
    pool.check_invariants()
    from umalloc.integrations.vllm.pool import HASH_SLOT

    setattr(b[0], HASH_SLOT, b[1].block_hash)       # a hash written past set_block_hash: umalloc cannot see it
    with pytest.raises(InvariantError, match="keep-flags: block 1"):
        pool.check_invariants()
    setattr(b[0], HASH_SLOT, None)
    assert _ids(pool.get_new_blocks(5)) == [1, 3, 4, 5, 2]   # 2 evicted last: its hash leaves vLLM's map
    assert pool.get_cached_block(b"two", [0]) is None and pool.refs.keep_flags[2] == 0
    pool.check_invariants()


def test_without_prefix_caching_a_hashed_block_is_freed_not_kept(vllm_pool):
    pool = vllm_pool(4, enable_caching=False, hash_block_size=16)   # vLLM frees every block at 0 then
    b = pool.get_new_blocks(2)
    _hashed(pool, b[0], b"one")
    pool.free_blocks(b)
    assert pool.refs.num_cached == 0 and pool.refs.keep_flags[1] == 0 and pool.get_num_free_blocks() == 3
    pool.check_invariants()


def test_ref_cnt_is_umallocs_count_and_a_double_free_changes_nothing(vllm_pool):
    pool = vllm_pool(6, enable_caching=True, hash_block_size=16)
    b = pool.get_new_blocks(2)                       # 1 2
    assert [pool.refs.ref_counts[i] for i in (1, 2)] == [1, 1]
    b[0].ref_cnt += 1                                # vLLM's CoW path takes an extra reference this way
    assert pool.refs.ref_counts[1] == 2 and b[0].ref_cnt == 2
    pool.free_blocks([b[0], b[1]])
    assert b[0].ref_cnt == 1 and pool.get_num_free_blocks() == 4
    with pytest.raises(DoubleFreeError):
        pool.free_blocks([b[0], b[1]])               # block 2 is already free
    assert b[0].ref_cnt == 1 and pool.get_num_free_blocks() == 4
    pool.check_invariants()
    pool.free_blocks([b[0]])
    assert pool.get_num_free_blocks() == 5
    pool.check_invariants()


def test_a_refused_free_of_mixed_blocks_leaves_a_bare_blocks_count(vllm_pool):
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    pool = vllm_pool(6, enable_caching=True, hash_block_size=16)
    b = pool.get_new_blocks(2)                       # 1 2
    pool.free_blocks([b[1]])                         # block 2 back to umalloc
    bare = KVCacheBlock(99)                          # not one of this pool's blocks: it keeps its own count
    bare.ref_cnt = 1
    with pytest.raises(DoubleFreeError):
        pool.free_blocks([b[0], bare, b[1]])         # block 2 is already free: the whole call is refused
    assert bare.ref_cnt == 1 and b[0].ref_cnt == 1 and pool.get_num_free_blocks() == 4
    pool.check_invariants()
    pool.free_blocks([b[0], bare])
    assert bare.ref_cnt == 0 and pool.get_num_free_blocks() == 5
    pool.check_invariants()


def test_random_prefix_caching_matches_vllms_pool(vllm_pool):
    """vLLM's own pool is the oracle: the same requests (shared prefixes, evictions) give the same prefix
    hits and free counts at every step (block ids differ by design)."""
    from types import SimpleNamespace

    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash

    seed = 7
    print(f"seed {seed}")
    rng = random.Random(seed)
    pools = [BlockPool(64, enable_caching=True, hash_block_size=16),
             vllm_pool(64, enable_caching=True, hash_block_size=16)]
    live: list[list[list]] = [[], []]
    for step in range(300):
        fam = rng.randrange(6)
        hashes = [BlockHash(f"f{fam}-{j}".encode()) for j in range(rng.randint(1, 8))]
        hashes += [BlockHash(f"r{step}-{j}".encode()) for j in range(rng.randint(0, 3))]
        free_first = len(live[0]) > 4 or rng.random() < 0.3
        results = []
        for p, pool in enumerate(pools):
            if free_first and live[p]:
                pool.free_blocks(reversed(live[p].pop(0)))
            found = []
            for h in hashes:
                got = pool.get_cached_block(h, [0])
                if got is None:
                    break
                found.append(got[0])
            pool.touch(found)
            need = len(hashes) - len(found)
            if need > pool.get_num_free_blocks():
                pool.free_blocks(found)
                results.append((len(found), None, pool.get_num_free_blocks()))
                continue
            blocks = found + pool.get_new_blocks(need)
            pool.cache_full_blocks(SimpleNamespace(block_hashes=hashes), blocks, len(found), len(hashes), 16, 0)
            live[p].append(blocks)
            results.append((len(found), len(blocks), pool.get_num_free_blocks()))
        assert results[0] == results[1], f"step {step}"
        pools[1].check_invariants()


def test_touch_and_free_paths_end_as_the_kernel_path_does(vllm_pool):
    """Note [Touch and free paths]: ``touch`` / ``free_blocks`` (null blocks leading or trailing, held and cached
    blocks, lists on both sides of ``TOUCH_IN_PYTHON``, one-block frees, a touch of a never-allocated id) leave
    the same counts, cached LRU order and free ids as a twin pool fed the same calls as int64 numpy ids, which
    always take ``PageRefs``' kernels."""
    from umalloc.integrations.vllm.pool import TOUCH_IN_PYTHON

    seed = 2029
    print(f"seed {seed}")
    rng = random.Random(seed)
    pools = [vllm_pool(48, enable_caching=True, hash_block_size=16) for _ in range(2)]
    fast, twin = pools
    live: list[list[int]] = []                        # each allocation's ids (the same in both pools)
    kinds = set()
    for step in range(1500):
        held = [i for i in range(1, 48) if fast.refs.ref_counts[i] > 0]
        cached = fast.refs.cached().tolist()
        op = rng.random()
        if op < 0.3:
            k = min(rng.randint(1, 4), fast.get_num_free_blocks())
            got = [_ids(p.get_new_blocks(k)) for p in pools]
            assert got[0] == got[1]
            for i in got[0]:
                if rng.random() < 0.7:
                    for p in pools:
                        _hashed(p, p.blocks[i], f"s{step}-{i}".encode())
            live.append(got[0])
        elif op < 0.6:
            picks = rng.sample(held + cached, min(len(held + cached), rng.randint(0, 2 * TOUCH_IN_PYTHON)))
            if picks and rng.random() < 0.3:
                picks.insert(rng.randrange(len(picks)), rng.choice(picks[:2]))   # listed twice
            if rng.random() < 0.1:
                picks.append(rng.choice([i for i in range(1, 48) if i not in held and i not in cached] or [0]))
            ids = [0] * rng.choice([0, 0, 3]) + picks
            if ids and rng.random() < 0.1:
                ids.insert(rng.randrange(len(ids)), 0)
            kinds.add(("touch", len(ids) > TOUCH_IN_PYTHON, any(i in cached for i in picks),
                       len(set(picks)) < len(picks)))
            fast.touch([fast.blocks[i] for i in ids])
            twin.refs.ref(np.array(ids, np.int64))
            live.append([i for i in ids if i])
        elif live:
            ids = live.pop(rng.randrange(len(live)))
            if len(ids) > 1 or rng.random() < 0.5:
                ids = ids + [0] * rng.choice([0, 2])
                fast.free_blocks(reversed([fast.blocks[i] for i in ids]))
                kinds.add(("free", len(ids)))
            else:
                fast.free_blocks([fast.blocks[i] for i in ids])
                kinds.add(("free1",))
            twin.refs.unref(np.array(ids[::-1], np.int64))
        for p in pools:
            p.check_invariants()
        assert fast.refs.ref_counts.tolist() == twin.refs.ref_counts.tolist(), f"step {step}"
        assert fast.refs.cached().tolist() == twin.refs.cached().tolist(), f"step {step}"
        assert fast.refs.free_ids().tolist() == twin.refs.free_ids().tolist(), f"step {step}"
        assert (fast.refs.num_free, fast.refs.num_cached) == (twin.refs.num_free, twin.refs.num_cached)
    assert {("touch", False, False, False), ("touch", False, True, False), ("touch", True, True, False),
            ("touch", True, True, True), ("free1",)} <= kinds, kinds


def test_a_short_touch_listing_a_cached_block_twice_revives_it_once_with_two_references(vllm_pool):
    pool = vllm_pool(8, enable_caching=True, hash_block_size=16)
    b = pool.get_new_blocks(3)                       # 1 2 3
    _hashed(pool, b[0], b"one")
    _hashed(pool, b[1], b"two")
    pool.free_blocks([b[0], b[1]])                   # cached, LRU: 1 then 2
    pool.touch([pool.null_block, b[1], b[2], b[1]])  # 2 revived with two references, 3 raised to 2
    assert [x.ref_cnt for x in b] == [0, 2, 2] and pool.refs.cached().tolist() == [1]
    assert pool.get_num_free_blocks() == 5
    pool.check_invariants()
    pool.free_blocks([b[1], b[1], b[2]])
    assert [x.ref_cnt for x in b] == [0, 0, 1] and pool.refs.cached().tolist() == [1, 2]
    pool.check_invariants()


def test_a_refused_touch_changes_nothing(vllm_pool):
    """A touch naming an id outside the pool raises (InvalidIdError) after held blocks before it were counted on
    the Python path (Note [Touch and free paths]), and one of something that is not a block fails in the loop:
    their counts go back, nothing changed."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from umalloc.errors import InvalidIdError

    pool = vllm_pool(8, enable_caching=True, hash_block_size=16)
    b = pool.get_new_blocks(3)
    _hashed(pool, b[2], b"two")
    pool.free_blocks([b[2]])                         # cached
    before = (pool.refs.ref_counts.tolist(), pool.refs.cached().tolist(), pool.refs.free_ids().tolist())
    for blocks, error in (([pool.null_block, b[0], b[1], KVCacheBlock(block_id=99)], InvalidIdError),
                          ([b[0], b[2], KVCacheBlock(block_id=99)], InvalidIdError),
                          ([b[0], b[2], b[0], b[2], KVCacheBlock(block_id=-3)], InvalidIdError),
                          ([b[1], b[0], object(), b[2]], AttributeError)):
        with pytest.raises(error):
            pool.touch(blocks)
        assert (pool.refs.ref_counts.tolist(), pool.refs.cached().tolist(), pool.refs.free_ids().tolist()) == before
        pool.check_invariants()


def test_a_touch_of_another_pools_blocks_counts_them_in_their_own_pool(vllm_pool):
    """A block keeps its pool: touching another pool's blocks raises their counts there (vLLM's touch raises the
    block's own ``ref_cnt``) and leaves this pool's same ids alone, on the Python path and on the long one; a
    touch then a free of such a block (free_blocks hands it to its own pool) leaves both pools as before."""
    from umalloc.integrations.vllm.pool import TOUCH_IN_PYTHON

    pools = [vllm_pool(12, enable_caching=True, hash_block_size=16) for _ in range(2)]
    p, q = pools
    mine, theirs = p.get_new_blocks(10), q.get_new_blocks(10)        # ids 1..10 held once in each pool
    _hashed(q, theirs[9], b"ten")
    q.free_blocks([theirs[9]])                                       # q's block 10: cached, count 0

    def counts():
        return [pl.refs.ref_counts.tolist() for pl in pools], [pl.refs.cached().tolist() for pl in pools]

    before = counts()
    assert before[0] == [[0] + [1] * 10 + [0], [0] + [1] * 9 + [0, 0]] and before[1] == [[], [10]]
    for blocks in ([theirs[0]], [mine[1], theirs[1], p.null_block, theirs[2]],
                   [theirs[9]], [mine[0]] * TOUCH_IN_PYTHON + [theirs[3], theirs[3]]):
        p.touch(blocks)
        want = [[0] * 12, [0] * 12]                                 # touches per pool and id, by hand
        for b in blocks:
            if not b.is_null:
                want[any(b is t for t in theirs)][b.block_id] += 1
        got, cached = counts()
        assert [[x - y for x, y in zip(g, o, strict=True)] for g, o in zip(got, before[0], strict=True)] == want
        assert cached == [[], [] if any(b is theirs[9] for b in blocks) else [10]]
        p.free_blocks(list(blocks))
        assert counts() == before
        for pl in pools:
            pl.check_invariants()


def test_evicting_shared_and_extra_hashes_leaves_the_map_as_vllms_pool_does(vllm_pool):
    """Blocks evicted by get_new_blocks drop exactly their own map entries, as vLLM's pool: two blocks under one
    hash (the map's dict case), a block with an extra hash (``cached_block_hashes_by_block``), a plain one; one
    block at a time (the one-page take) and in a batch. vLLM's own pool is the oracle (positions, not ids)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    def key(name: str):
        return make_block_hash_with_group_id(BlockHash(name.encode()), 0)

    def entries(pool, held):
        pos = {b.block_id: i for i, b in enumerate(held)}
        out = {}
        table = pool.cached_block_hash_to_block
        dup_ids = getattr(table, "_dup_ids", {})     # 0.34: ids of keys cached by several blocks, kept apart
        for k, v in table._cache.items():
            # 0.33 maps a key to a block or a dict {block id: block}; 0.34 to a block id
            ids = dup_ids[k] if k in dup_ids else v if isinstance(v, dict) else [v if isinstance(v, int) else v.block_id]
            out[k] = sorted(pos[i] for i in ids)
        return out, sorted(pos[i] for i in pool.cached_block_hashes_by_block), \
            [(b.block_hash, b.block_hash_num_tokens) for b in held]

    seen = []
    for cls in (BlockPool, vllm_pool):
        pool = cls(8, enable_caching=True, hash_block_size=16)
        held = pool.get_new_blocks(7)
        for i, name in ((0, "shared"), (1, "shared"), (2, "extra"), (3, "plain"), (4, "plain2")):
            pool._insert_block_hash(key(name), held[i], num_tokens=16)
        pool._insert_block_hash(key("extra-partial"), held[2], num_tokens=8)
        pool.free_blocks(held)      # cached in this order (the hashed ones), the others free
        steps = [entries(pool, held)]
        for n in (1, 1, 1, 1, 2):   # held[5], held[6] free first, then the LRU: held[0], held[1], ...
            pool.get_new_blocks(n)
            steps.append(entries(pool, held))
        if cls is vllm_pool:
            pool.check_invariants()
        seen.append(steps)
    assert seen[0] == seen[1]


def test_evict_first_frees_cached_blocks_to_the_eviction_end_as_vllm_does(vllm_pool):
    """vLLM 0.34's ``free_blocks(blocks, evict_first=True)``: the blocks it caches are evicted before other
    cached blocks. vLLM's own pool is the oracle: with every block cached, the next allocations evict the same
    hashes in the same order in both pools."""
    import inspect

    from vllm.v1.core.block_pool import BlockPool

    if "evict_first" not in inspect.signature(BlockPool.free_blocks).parameters:
        pytest.skip("this vLLM's free_blocks has no evict_first (0.34 and later)")
    pools = [BlockPool(6, enable_caching=True, hash_block_size=16),
             vllm_pool(6, enable_caching=True, hash_block_size=16)]
    keys = [b"a", b"b", b"c", b"d", b"e"]
    gone = []
    for pool in pools:
        blocks = pool.get_new_blocks(5)
        for block, key in zip(blocks, keys, strict=True):
            _hashed(pool, block, key)
        pool.free_blocks(blocks[:3])                     # a b c: cached, LRU tail in that order
        pool.free_blocks(blocks[3:], evict_first=True)   # d e: cached, evicted first, d before e
        order = []
        for _ in range(5):
            pool.get_new_blocks(1)
            order.append(next(k for k in keys if k not in order and pool.get_cached_block(k, [0]) is None))
        gone.append(order)
    assert gone[0] == gone[1] == [b"d", b"e", b"a", b"b", b"c"]
    pools[1].check_invariants()


def test_install_makes_the_kv_cache_manager_build_the_umalloc_pool(vllm_pool, monkeypatch):
    import torch
    import vllm.v1.core.block_pool as block_pool
    import vllm.v1.core.kv_cache_coordinator as coordinator
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    from umalloc.integrations import vllm as umalloc_vllm

    monkeypatch.setattr(block_pool, "BlockPool", block_pool.BlockPool)  # restored after the test
    monkeypatch.setattr(coordinator, "BlockPool", coordinator.BlockPool)
    assert umalloc_vllm.install() is vllm_pool and umalloc_vllm.install() is vllm_pool  # idempotent
    assert coordinator.BlockPool is vllm_pool and block_pool.BlockPool is vllm_pool

    init_none_hash(sha256)
    config = KVCacheConfig(num_blocks=11, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    manager = KVCacheManager(config, max_model_len=8192, enable_caching=True, hash_block_size=16,
                             scheduler_block_size=16)
    assert type(manager.block_pool) is vllm_pool

    def request(rid: str, tokens: list[int]) -> Request:
        params = SamplingParams(max_tokens=17)
        params.update_from_generation_config({}, eos_token_id=100)
        return Request(request_id=rid, prompt_token_ids=tokens, mm_features=None, sampling_params=params,
                       pooling_params=None, block_hasher=get_request_block_hasher(16, sha256))

    common = [i for i in range(3) for _ in range(16)]      # 3 full blocks
    r0 = request("0", common + [3] * 7)                    # 55 tokens: 4 blocks
    blocks = manager.allocate_slots(r0, 55, 0, manager.get_computed_blocks(r0)[0])
    assert blocks.get_block_ids() == ([1, 2, 3, 4],)
    manager.free(r0)                                        # 1-3 cached, 4 back to umalloc
    r1 = request("1", common + [3] * 5)
    hit, num_hit_tokens, _ = manager.get_computed_blocks(r1)
    assert hit.get_block_ids() == ([1, 2, 3],) and num_hit_tokens == 48
    assert manager.allocate_slots(r1, 5, 48, hit).get_block_ids() == ([4],)
    manager.block_pool.check_invariants()


def test_install_refuses_an_untested_vllm(vllm_pool, monkeypatch):
    import vllm
    from vllm.v1.core import block_pool

    from umalloc.integrations import vllm as umalloc_vllm
    from umalloc.integrations.versions import EngineVersionError

    monkeypatch.setattr(vllm, "__version__", "0.0.1")
    stock = block_pool.BlockPool
    with pytest.raises(umalloc_vllm.UnsupportedVLLMVersion, match=r"vLLM 0.0.1 is untested .*allowed 0.33.0"):
        umalloc_vllm.install()
    assert issubclass(umalloc_vllm.UnsupportedVLLMVersion, EngineVersionError)
    assert issubclass(umalloc_vllm.UnsupportedVLLMVersion, UmallocError)
    assert block_pool.BlockPool is stock   # refused: nothing rebound


def test_uninstall_and_installed_restore_the_stock_pool(vllm_pool, monkeypatch):
    import vllm.v1.core.kv_cache_coordinator as coordinator
    from vllm.v1.core import block_pool

    from umalloc.integrations import vllm as umalloc_vllm

    monkeypatch.setattr(block_pool, "BlockPool", block_pool.BlockPool)  # restored after the test
    monkeypatch.setattr(coordinator, "BlockPool", coordinator.BlockPool)
    umalloc_vllm.uninstall()   # whatever an earlier test left installed
    stock = block_pool.BlockPool
    with umalloc_vllm.installed() as pool:
        assert pool is vllm_pool and coordinator.BlockPool is vllm_pool and block_pool.BlockPool is vllm_pool
    assert coordinator.BlockPool is stock and block_pool.BlockPool is stock
    umalloc_vllm.uninstall()   # a second time: no-op
    assert block_pool.BlockPool is stock


def _bench_hybrid():
    """benchmarks/bench_hybrid_pages.py (a script, not a package module)."""
    path = PEER.parent.parent / "benchmarks" / "bench_hybrid_pages.py"
    if "bench_hybrid_pages" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_hybrid_pages", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_hybrid_pages"]


def test_hybrid_demo_block_rule_by_hand():
    bench = _bench_hybrid()
    # Nemotron-H-8B per layer: attention 8 heads x (128 + 128) x 2 B = 4096 B/token; Mamba2 conv (10240, 3) bf16
    # = 61,440 B plus ssm 128 x 64 x 128 = 1,048,576 elements (x 4 B float32, x 2 B bf16)
    assert bench.attention_token_bytes() == 4096
    assert bench.mamba_state_bytes(4) == 61_440 + 4_194_304 and bench.mamba_state_bytes(2) == 61_440 + 2_097_152
    # 16 * cdiv(state, 16 * 4096): float32 cdiv(4,255,744, 65,536) = 65 -> 1040; bf16 cdiv(2,158,592, 65,536) = 33
    # -> 528, the block the vLLM issues about Mamba hybrids report
    assert bench.vllm_block_tokens(4096, 4_255_744) == 1040 and bench.vllm_block_tokens(4096, 2_158_592) == 528
    assert bench.vllm_block_tokens(4096, 1000) == 16                     # never below the configured block
    lay = bench.layouts("bfloat16")
    assert lay.attn_end.page_bytes == 16 * 4 * 4096 and lay.state_end.page_bytes == 24 * 2_158_592


def test_hybrid_demo_sizes_match_vllms_specs(vllm_pool):
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    bench = _bench_hybrid()
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1, intermediate_size=128 * 64, n_groups=8, num_heads=128, head_dim=64, state_size=128,
        conv_kernel=4)
    for ssm_dtype, itemsize in ((torch.float32, 4), (torch.bfloat16, 2)):
        page = MambaSpec(shapes=shapes, dtypes=(torch.bfloat16, ssm_dtype), block_size=-1).page_size_bytes
        assert bench.mamba_state_bytes(itemsize) == page
    attn = FullAttentionSpec(block_size=1, num_kv_heads=8, head_size=128, dtype=torch.bfloat16).page_size_bytes
    assert bench.attention_token_bytes() == attn
