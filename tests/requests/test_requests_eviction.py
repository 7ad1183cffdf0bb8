"""The request table's eviction under a shortfall: exactly the pages the extend lacks, LRU first, once, and no
allocator trial when the owner alone is short (Note [Room] in :mod:`umalloc.requests.room`); a refusal changes
nothing.

The expected eviction counts come from the allocator alone: the fewest LRU-first cached pages whose freeing lets
``alloc_pages`` fit, found by trying every count in rolled-back allocator trials (never through the table's room
logic).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from umalloc.allocator.facade import MultiEndedAllocator, snapshots_equal
from umalloc.requests.table import RequestTable
from umalloc.testing import seed_from_env


def _snap(table: RequestTable) -> tuple[dict[str, Any], dict[str, Any]]:
    return table.alloc.snapshot(), table.snapshot()


def _same(a: tuple[dict[str, Any], dict[str, Any]], b: tuple[dict[str, Any], dict[str, Any]]) -> bool:
    return snapshots_equal(a[0], b[0]) and snapshots_equal(a[1], b[1])


@contextmanager
def _counting_trials(alloc: MultiEndedAllocator) -> Iterator[list[int]]:
    """Count the allocator trials run inside the block (the instance's ``trial`` wrapped)."""
    n = [0]
    inner = alloc.trial

    @contextmanager
    def counted(**kw: Any) -> Iterator[Any]:
        n[0] += 1
        with inner(**kw) as t:
            yield t

    alloc.trial = counted  # type: ignore[method-assign]
    try:
        yield n
    finally:
        del alloc.trial


def _fewest_evictions(table: RequestTable, k: int) -> int | None:
    """The fewest LRU-first cached pages whose freeing lets ``k`` fresh pages fit on every end of the table
    without compaction (``None``: not even all of them), tried count by count in rolled-back trials."""
    alloc, lru = table.alloc, table.cached_pages().numpy()
    for n in range(lru.size + 1):
        with alloc.trial(compaction=False):
            if n:
                alloc.free_pages(lru[:n])
            if alloc.alloc_pages(k) is not None:
                return n
    return None


def test_a_shortfall_of_the_owner_evicts_exactly_the_shortfall_without_a_trial(kv_allocator) -> None:
    """One full end, page_size 2, 12 usable pages (the zero page takes one). Six one-page requests freed with
    cache=True (LRU 2..7), 5 pages free; an extend of 9 pages lacks 4: pages 2, 3, 4, 5 are evicted in one
    on_evict call, 6 and 7 stay cached, and no allocator trial runs."""
    evicted: list[list[int]] = []
    table = RequestTable(kv_allocator(2, 12), max_requests=8, max_tokens_per_request=24,
                         on_evict=lambda vp: evicted.append(vp.tolist()))
    s = table.new_requests(7).tolist()
    for r in s[:6]:
        table.extend([r], [2])
    table.free_requests(s[:6], cache=True)
    assert table.cached_pages().tolist() == [2, 3, 4, 5, 6, 7]
    assert table.capacity()["full"]["free_pages"] == 5
    with _counting_trials(table.alloc) as trials:
        assert table.can_extend([s[6]], [18])
        out = table.extend([s[6]], [18])
    assert out is not None and out.shape[0] == 18
    assert evicted == [[2, 3, 4, 5]]
    assert table.cached_pages().tolist() == [6, 7]
    assert trials[0] == 0
    table.check_invariants()


def test_a_refused_extend_evicts_nothing_and_changes_nothing(kv_allocator) -> None:
    """Same arena: 5 free + 6 cached = 11 pages; an extend of 12 pages is refused: None, no on_evict, both
    snapshots equal (the cache and its LRU order included), and can_extend said so first."""
    evicted: list[list[int]] = []
    table = RequestTable(kv_allocator(2, 12), max_requests=8, max_tokens_per_request=24,
                         on_evict=lambda vp: evicted.append(vp.tolist()))
    s = table.new_requests(7).tolist()
    for r in s[:6]:
        table.extend([r], [2])
    table.free_requests(s[:6], cache=True)
    before = _snap(table)
    assert not table.can_extend([s[6]], [24])
    assert table.extend([s[6]], [24]) is None
    assert evicted == []
    assert _same(before, _snap(table))
    assert table.extend([s[6]], [22]) is not None and evicted == [[2, 3, 4, 5, 6, 7]]   # 11 pages: all of them
    table.check_invariants()


@pytest.mark.parametrize("shape", ["full", "full+swa"])
def test_random_shortfalls_evict_the_fewest_pages_and_refusals_change_nothing(kv_allocator, shape: str) -> None:
    """Seeded random extends and cached frees: every extend that evicts evicts, in one on_evict call, the LRU
    head of the length the allocator alone says is the fewest (when that count fits without compaction); every
    None leaves both snapshots equal with no on_evict; can_extend predicts every outcome."""
    seed = seed_from_env(3701)
    rng = random.Random(seed)
    checked = 0
    for _ in range(10):
        ps, pages = rng.choice([1, 2, 4]), rng.randint(10, 24)
        comp = rng.choice(["lazy", "off"])
        alloc = (kv_allocator(ps, pages, compaction=comp) if shape == "full"
                 else kv_allocator(ps, pages, rng.choice([2, 4, 8]), compaction=comp))
        evicted: list[list[int]] = []
        table = RequestTable(alloc, max_requests=5, max_tokens_per_request=8 * ps,
                             on_evict=lambda vp, ev=evicted: ev.append(vp.tolist()))
        live: list[int] = []
        for _step in range(40):
            if live and rng.random() < 0.35:
                r = live.pop(rng.randrange(len(live)))
                table.free_requests([r], cache=rng.random() < 0.8)
                continue
            if not live or (rng.random() < 0.4 and len(live) < 5):
                got = table.new_requests(1)
                if got is not None:
                    live.append(int(got[0]))
            if not live:
                continue
            r = rng.choice(live)
            have = int(table.num_tokens([r])[0])
            if have >= 8 * ps:
                continue
            n = rng.randint(1, 8 * ps - have)
            k = -(-(have + n) // ps) - -(-have // ps)            # fresh pages this extend takes
            want = _fewest_evictions(table, k) if shape == "full" and k else None
            lru = table.cached_pages().tolist()
            before, nev = _snap(table), len(evicted)
            can = table.can_extend([r], [n])
            assert _same(before, _snap(table)), f"seed={seed}: can_extend changed something"
            out = table.extend([r], [n])
            assert can == (out is not None), f"seed={seed}: can_extend said {can}"
            if out is None:
                assert len(evicted) == nev and _same(before, _snap(table)), f"seed={seed}"
            elif want is not None:
                got_ev = evicted[nev:]
                assert got_ev == ([lru[:want]] if want else []), f"seed={seed}: {got_ev} vs {want} of {lru}"
                checked += 1
            table.check_invariants()
    if shape == "full":
        assert checked > 50, f"seed={seed}: only {checked} extends compared"


def test_cached_pages_walks_the_lru_list_in_order(kv_allocator) -> None:
    """cached_pages lists the LRU order (reclaim removes from the middle, a later cached free appends)."""
    table = RequestTable(kv_allocator(1, 16), max_requests=4, max_tokens_per_request=8)
    a, b = table.new_requests(2).tolist()
    table.extend([a, b], np.array([3, 2]))               # a: 2, 3, 4; b: 5, 6
    table.free_requests([a], cache=True)                  # last page first: 4, 3, 2
    table.reclaim([3])
    table.free_requests([b], cache=True)
    assert table.cached_pages().tolist() == [4, 2, 6, 5]
    assert table.cached_pages().dtype == torch.int64
