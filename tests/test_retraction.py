"""Retraction to host and back: target, SWA and draft bytes survive a round trip (also under compaction),
the copy runs under a lease, tombstoned SWA pages stay unbound, failures change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from compaction_fixtures import (
    PAGE_SIZE,
    ByteModel,
    assert_no_ghost_pages,
    seed_from_env,
    three_end_allocator,
)

from umalloc.allocator import snapshots_equal
from umalloc.errors import InvalidIdError, NotAllocatedError
from umalloc.pagestate import TOMBSTONE
from umalloc.retraction import RetractedKV, restore, retract


def extend(alloc, seq_len: int) -> torch.Tensor:
    return alloc.alloc_extend(torch.tensor([0]), torch.tensor([seq_len]), torch.tensor([-1]))


def vpages_of(tokens: torch.Tensor) -> np.ndarray:
    return np.unique(tokens.numpy() // PAGE_SIZE)


def setup_request(alloc):
    """Two requests interleaved with a third; request R (9 tokens, 5 pages) has its first two SWA pages
    released (window 4: swa_tail_start(9, 4, 0, 2) = 4)."""
    model = ByteModel(alloc)
    other = extend(alloc, 6)
    req = extend(alloc, 9)
    third = extend(alloc, 3)
    for t in (other, req, third):
        model.write(vpages_of(t))
    tail = alloc.swa_tail_start(9, 4, 0, PAGE_SIZE)
    assert tail == 4
    alloc.release_end("swa", req[:tail])
    model.forget(vpages_of(req[:tail]), ["swa"])
    model.check()
    return model, other, req, third


def expected_bytes(model: ByteModel, vpages: np.ndarray) -> dict[str, list[torch.Tensor | None]]:
    return {end: [model.pages.get((end, int(v))) for v in vpages] for end in model.alloc.spec.end_names}


def check_restored(alloc, model, req, new_tokens, before) -> None:
    assert new_tokens.dtype == torch.int64 and new_tokens.shape == req.shape
    assert torch.equal(new_tokens % PAGE_SIZE, req % PAGE_SIZE)  # same offsets, same order
    # tokens of one old page map to one new page and vice versa
    old_pages, new_pages = (req // PAGE_SIZE).numpy(), (new_tokens // PAGE_SIZE).numpy()
    pairs = set(zip(old_pages.tolist(), new_pages.tolist(), strict=True))
    assert len(pairs) == len(set(old_pages.tolist())) == len(set(new_pages.tolist()))
    new_vp = np.array([n for _, n in sorted(pairs)])
    for end, datas in before.items():
        v2p = alloc.v2p(end).numpy()
        env = alloc.arena.envelopes(end)
        for v, data in zip(new_vp.tolist(), datas, strict=True):
            if data is None:
                assert v2p[v] == TOMBSTONE, f"{end}: unbound page {v} was bound by restore"
            else:
                assert v2p[v] != TOMBSTONE
                assert torch.equal(env[int(v2p[v])], data), f"{end}: bytes of page {v} differ after restore"
                model.pages[(end, v)] = data
    alloc.check_invariants()
    model.check()
    assert_no_ghost_pages(alloc)


def test_round_trip_target_swa_draft_bytes_identical() -> None:
    alloc = three_end_allocator(debug_checks=True)
    model, other, req, third = setup_request(alloc)
    old_vp = vpages_of(req)
    before = expected_bytes(model, old_vp)
    assert sum(d is not None for d in before["swa"]) == 3 and all(d is not None for d in before["draft"])
    taken = alloc.lease_table.leases_taken
    retracted = retract(alloc, req)
    assert isinstance(retracted, RetractedKV)
    assert retracted.pages_by_end() == {"full": 5, "draft": 5, "swa": 3}
    assert retracted.nbytes == 5 * 32 + 5 * 16 + 3 * 16
    assert alloc.lease_table.leases_taken == taken + 1 and alloc.leases_active() == 0
    # the request's pages are free on every end
    for end in ("full", "draft", "swa"):
        assert (alloc.v2p(end).numpy()[old_vp] == TOMBSTONE).all()
    model.forget(old_vp)
    model.check()
    # someone else takes the freed space meanwhile
    filler = extend(alloc, 4)
    model.write(vpages_of(filler))
    new = restore(alloc, retracted)
    assert new is not None
    check_restored(alloc, model, req, new, before)


def test_round_trip_under_compaction() -> None:
    seed = seed_from_env(5)
    rng = np.random.default_rng(seed)
    alloc = three_end_allocator(arena_bytes=32 * 40, compaction="lazy", move_budget_pages=2, debug_checks=True)
    model, other, req, third = setup_request(alloc)
    before = expected_bytes(model, vpages_of(req))
    retracted = retract(alloc, req)
    model.forget(vpages_of(req))
    live = [other, third]
    for _ in range(30):  # churn with compaction between retract and restore
        if live and rng.random() < 0.45:
            t = live.pop(int(rng.integers(len(live))))
            alloc.free(t)
            model.forget(vpages_of(t))
        else:
            t = extend(alloc, int(rng.integers(1, 7)))
            if t is not None:
                model.write(vpages_of(t))
                live.append(t)
        report = alloc.compact(budget_pages=int(rng.integers(0, 4)))
        assert report.pages_moved <= 3 * 3  # at most the budget per end
        model.check()
    moved = alloc.stats()
    assert sum(s.pages_moved for s in moved.values()) > 0, "the churn never compacted: the test lost its point"
    new = restore(alloc, retracted)
    assert new is not None
    check_restored(alloc, model, req, new, before)


def test_copy_runs_under_a_lease_naming_every_end() -> None:
    alloc = three_end_allocator()
    model, other, req, third = setup_request(alloc)
    old_vp = vpages_of(req)
    phys = {e: alloc.translate_pages(torch.from_numpy(old_vp), e, strict=False).numpy() for e in alloc.spec.end_names}
    phys["swa"] = phys["swa"][alloc.v2p("swa").numpy()[old_vp] != TOMBSTONE]
    seen_leases, pinned_during_copy = [], []
    real_lease, real_envelopes = alloc.lease, alloc.arena.envelopes

    def recording_lease(pages, **kw):
        lease = real_lease(pages, **kw)
        seen_leases.append({e: p.tolist() for e, p in lease.pages.items()})
        return lease

    def recording_envelopes(end):
        pins = alloc.lease_table.pin_count(end)
        pinned_during_copy.append((end, bool((pins[phys[end]] > 0).all())))
        return real_envelopes(end)

    alloc.lease = recording_lease
    alloc.arena.envelopes = recording_envelopes
    try:
        retract(alloc, req)
    finally:
        del alloc.lease
        del alloc.arena.envelopes
    assert seen_leases == [{e: sorted(phys[e].tolist()) for e in ("full", "draft", "swa")}]
    assert sorted(pinned_during_copy) == [("draft", True), ("full", True), ("swa", True)]
    assert alloc.leases_active() == 0 and not any(alloc.moves_blocked(e) for e in alloc.spec.end_names)


def test_restore_out_of_space_returns_none_and_changes_nothing() -> None:
    alloc = three_end_allocator(debug_checks=True)
    model, other, req, third = setup_request(alloc)
    retracted = retract(alloc, req)
    model.forget(vpages_of(req))
    while (t := extend(alloc, 2)) is not None:  # fill every end
        model.write(vpages_of(t))
    snap = alloc.snapshot()
    assert restore(alloc, retracted) is None
    assert snapshots_equal(snap, alloc.snapshot())
    model.check()


def test_retract_misuse_raises_and_changes_nothing() -> None:
    alloc = three_end_allocator()
    model, other, req, third = setup_request(alloc)
    alloc.free(third)
    snap = alloc.snapshot()
    with pytest.raises(NotAllocatedError, match="not live"):
        retract(alloc, torch.cat([req, third]))
    with pytest.raises(InvalidIdError, match="reserved"):
        retract(alloc, torch.tensor([0, 1], dtype=torch.int64))
    with pytest.raises(InvalidIdError, match="allowed"):
        retract(alloc, torch.tensor([10_000], dtype=torch.int64))
    with pytest.raises(InvalidIdError, match="int64"):
        retract(alloc, req.to(torch.int32))
    assert snapshots_equal(snap, alloc.snapshot())


def test_allocator_methods_delegate_to_retraction() -> None:
    alloc = three_end_allocator(debug_checks=True)
    model, other, req, third = setup_request(alloc)
    before = expected_bytes(model, vpages_of(req))
    retracted = alloc.retract(req)
    model.forget(vpages_of(req))
    new = alloc.restore(retracted)
    check_restored(alloc, model, req, new, before)
