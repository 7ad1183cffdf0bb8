"""Retraction to host and back: target, SWA and draft bytes survive a round trip (also under compaction),
the copy runs under a lease, tombstoned SWA pages stay unbound, failures change nothing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from compaction_helpers import (
    PAGE_SIZE,
    ByteModel,
    assert_no_ghost_pages,
    draft_end,
    full_end,
    seed_from_env,
    swa_end,
)

from umalloc.allocator.facade import snapshots_equal
from umalloc.allocator.retraction import RetractedKV, restore, retract
from umalloc.errors import InvalidIdError, NotAllocatedError, UmallocValueError
from umalloc.geometry.spec import EndRole, EndSpec, Grow, LayerSpec
from umalloc.pool.pagestate import TOMBSTONE


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
    alloc.unbind_end("swa", req[:tail])
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


def test_round_trip_target_swa_draft_bytes_identical(three_end_allocator) -> None:
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


def test_round_trip_under_compaction(three_end_allocator) -> None:
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


def test_copy_runs_under_a_lease_naming_every_end(three_end_allocator) -> None:
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


def test_restore_out_of_space_returns_none_and_changes_nothing(three_end_allocator) -> None:
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


def test_retract_misuse_raises_and_changes_nothing(three_end_allocator) -> None:
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
    with pytest.raises(InvalidIdError, match="dtype"):
        retract(alloc, req.to(torch.float32))
    with pytest.raises(InvalidIdError, match="allowed"):
        retract(alloc, [int(v) for v in req])  # type: ignore[arg-type]
    assert snapshots_equal(snap, alloc.snapshot())


@pytest.mark.parametrize("form", ["int32", "int16", "numpy-int32", "numpy-uint16"])
def test_retract_takes_any_integer_dtype_like_every_id_call(three_end_allocator, form: str) -> None:
    """The same request retracted from int64 ids and from another integer dtype frees the same pages and keeps
    the same bytes (both allocators built alike, the int64 run is the reference)."""
    got = {}
    for which in ("int64", form):
        alloc = three_end_allocator()
        model, other, req, third = setup_request(alloc)
        ids: object = {"int64": req, "int32": req.to(torch.int32), "int16": req.to(torch.int16),
                       "numpy-int32": req.numpy().astype(np.int32),
                       "numpy-uint16": req.numpy().astype(np.uint16)}[which]
        kv = retract(alloc, ids)  # type: ignore[arg-type]
        got[which] = (kv.pages_by_end(), kv.old_vpages.tolist(), {e: r.data.clone() for e, r in kv.ends.items()},
                      alloc.snapshot())
    ref, other_form = got["int64"], got[form]
    assert ref[0] == other_form[0] and ref[1] == other_form[1]
    assert all(torch.equal(ref[2][e], other_form[2][e]) for e in ref[2])
    assert snapshots_equal(ref[3], other_form[3])


def test_allocator_methods_delegate_to_retraction(three_end_allocator) -> None:
    alloc = three_end_allocator(debug_checks=True)
    model, other, req, third = setup_request(alloc)
    before = expected_bytes(model, vpages_of(req))
    retracted = alloc.retract(req)
    model.forget(vpages_of(req))
    new = alloc.restore(retracted)
    check_restored(alloc, model, req, new, before)


# ---------------------------------------------------------------------------------------------------------------
# restore() of a record that does not fit the allocator: refused before anything is allocated
# ---------------------------------------------------------------------------------------------------------------
def _other_geometry(make_allocator, kind: str):
    """A source allocator whose geometry differs from three_end_allocator() in one way."""
    if kind == "page_bytes":      # full: 32 B/token -> 64 B pages instead of 32 B
        full = EndSpec("full", (LayerSpec.mha(1, 8),), page_size=PAGE_SIZE)
        return make_allocator((full, draft_end(), swa_end()), 64 * 24)
    if kind == "page_size":       # every end 4 tokens a page with the same page_bytes (32/16/16 B)
        full = EndSpec("full", (LayerSpec.mha(1, 2),), page_size=4)
        draft = EndSpec("draft", (LayerSpec.mha(1, 1),), page_size=4, grow=Grow.FLOAT, owner="full",
                        role=EndRole.DRAFT)
        swa = EndSpec("swa", (LayerSpec.mha(1, 1, window_tokens=4),), page_size=4, grow=Grow.DOWN,
                      owner="full", role=EndRole.SWA)
        return make_allocator((full, draft, swa), 32 * 24)
    if kind == "layout":          # same 32 B full pages, but 2 KV heads of dim 2 instead of 1 of dim 4
        full = EndSpec("full", (LayerSpec.mha(2, 2),), page_size=PAGE_SIZE)
        return make_allocator((full, draft_end(), swa_end()), 32 * 24)
    if kind == "missing_end":     # no draft end: the record lacks a bound end of the target
        return make_allocator((full_end(), swa_end()), 32 * 16)
    if kind == "extra_end":       # a record with an end ('draft2') the target does not have
        draft2 = EndSpec("draft2", (LayerSpec.mha(1, 2),), page_size=PAGE_SIZE, grow=Grow.FLOAT, owner="full",
                         role=EndRole.DRAFT)
        return make_allocator((full_end(), draft_end(), draft2, swa_end()), 32 * 32)
    if kind == "owner_name":      # the id owner is called 'target'
        target = EndSpec("target", (LayerSpec.mha(1, 4),), page_size=PAGE_SIZE)
        swa = EndSpec("swa", (LayerSpec.mha(1, 2, window_tokens=4),), page_size=PAGE_SIZE, grow=Grow.DOWN,
                      owner="target", role=EndRole.SWA)
        draft = EndSpec("draft", (LayerSpec.mha(1, 2),), page_size=PAGE_SIZE, grow=Grow.FLOAT, owner="target",
                        role=EndRole.DRAFT)
        return make_allocator((target, draft, swa), 32 * 24)
    raise AssertionError(kind)


def _record_from(src) -> RetractedKV:
    ps = src.spec.end(src.spec.ends[0].name).page_size
    t = src.alloc_extend(torch.tensor([0]), torch.tensor([3 * ps]), torch.tensor([-1]))  # 3 pages on every end
    return retract(src, t)


GEOMETRY_DIFFERENCES = {  # kind -> a difference the error must name
    "page_bytes": "end 'full': page_bytes 64 in the record, 32 here",
    "page_size": "end 'swa': page_size 4 in the record, 2 here",
    "layout": "end 'full': layers 'mha(heads=2, k=2, v=2",
    "missing_end": "ends ['draft'] of owner 'full' are missing from the record",
    "extra_end": "ends ['draft2'] are not ends of owner 'full' here",
    "owner_name": "owner 'target' is not an id-owner end of this allocator",
}


@pytest.mark.parametrize("kind", sorted(GEOMETRY_DIFFERENCES))
def test_restore_of_a_record_from_another_geometry_is_refused_and_changes_nothing(three_end_allocator, make_allocator, kind: str) -> None:
    """A record from an allocator of another geometry used to be bound and written half-way (or restored with
    a foreign layout / without its draft): now it is refused before any page is allocated."""
    record = _record_from(_other_geometry(make_allocator, kind))
    alloc = three_end_allocator(arena_bytes=32 * 40, debug_checks=True)  # room for 3 pages on every end
    model, other, req, third = setup_request(alloc)
    assert alloc.can_alloc({"full": 3, "draft": 3, "swa": 3})
    snap = alloc.snapshot()
    with pytest.raises(UmallocValueError, match="does not fit this allocator") as err:
        restore(alloc, record)
    assert GEOMETRY_DIFFERENCES[kind] in str(err.value)
    assert snapshots_equal(snap, alloc.snapshot()), f"{kind}: a refused restore changed the allocator"
    with pytest.raises(UmallocValueError, match="does not fit this allocator"):
        alloc.restore(record)  # the allocator's method delegates to the same checks
    assert snapshots_equal(snap, alloc.snapshot())
    alloc.check_invariants()
    model.check()


def test_record_restores_into_another_allocator_of_the_same_geometry(three_end_allocator) -> None:
    """Geometry, not identity, is what restore checks: a record moves to a bigger arena of the same ends."""
    src = three_end_allocator()
    model, other, req, third = setup_request(src)
    before = expected_bytes(model, vpages_of(req))
    record = retract(src, req)
    dst = three_end_allocator(arena_bytes=32 * 40, debug_checks=True)
    dst_model = ByteModel(dst)
    dst_model.write(vpages_of(extend(dst, 5)))  # something already lives there
    new = restore(dst, record)
    assert new is not None
    check_restored(dst, dst_model, req, new, before)


def test_restore_of_a_foreign_record_into_a_full_allocator_raises_rather_than_returning_none(three_end_allocator, make_allocator) -> None:
    """The record is checked before space: a record that can never fit is misuse, not a shortage."""
    record = _record_from(_other_geometry(make_allocator, "page_bytes"))
    alloc = three_end_allocator()
    setup_request(alloc)
    assert not alloc.can_alloc({"full": 3, "draft": 3, "swa": 3})
    snap = alloc.snapshot()
    with pytest.raises(UmallocValueError, match="page_bytes 64 in the record, 32 here"):
        restore(alloc, record)
    assert snapshots_equal(snap, alloc.snapshot())


def _tampered(record: RetractedKV, what: str) -> RetractedKV:
    """A record from the same geometry with one field made inconsistent (as a caller could build one)."""
    ends = dict(record.ends)
    if what == "data_dtype":
        ends["draft"] = dataclasses.replace(ends["draft"], data=ends["draft"].data.to(torch.int16))
    elif what == "data_rows":
        ends["swa"] = dataclasses.replace(ends["swa"], data=ends["swa"].data[:-1])
    elif what == "data_width":
        ends["swa"] = dataclasses.replace(ends["swa"], data=torch.zeros(3, 32, dtype=torch.uint8))
    elif what == "bound_len":
        ends["swa"] = dataclasses.replace(ends["swa"], bound=np.ones(4, dtype=bool))
    elif what == "owner_unbound":
        bound = np.array([True, False, True])
        ends["full"] = dataclasses.replace(ends["full"], bound=bound, data=ends["full"].data[bound])
    elif what == "page_index":
        return dataclasses.replace(record, page_index=record.page_index + 1)
    elif what == "token_offset":
        return dataclasses.replace(record, token_offset=record.token_offset + PAGE_SIZE)
    elif what == "num_pages":
        return dataclasses.replace(record, num_pages=record.num_pages + 1)
    elif what == "owner":
        return dataclasses.replace(record, owner="swa")
    else:
        raise AssertionError(what)
    return dataclasses.replace(record, ends=ends)


RECORD_DIFFERENCES = {  # field made inconsistent -> a difference the error must name
    "data_dtype": "end 'draft': data torch.int16 (3, 16), allowed torch.uint8 (3, 16)",
    "data_rows": "end 'swa': data torch.uint8 (2, 16), allowed torch.uint8 (3, 16)",
    "data_width": "end 'swa': data torch.uint8 (3, 32), allowed torch.uint8 (3, 16)",
    "bound_len": "end 'swa': bound must be a numpy bool array of shape (3,)",
    "owner_unbound": "end 'full': the owner's pages must all be bound",
    "page_index": "page_index: values in [1, 3], allowed [0, 2]",
    "token_offset": "token_offset: values in [2, 3], allowed [0, 1]",
    "num_pages": "page_index: pages [3] of [0, 4) hold no token",
    "owner": "owner 'swa' is not an id-owner end",
}


@pytest.mark.parametrize("what", sorted(RECORD_DIFFERENCES))
def test_restore_of_an_inconsistent_record_is_refused_and_changes_nothing(three_end_allocator, what: str) -> None:
    """A record of the right geometry whose fields disagree (as a caller could build one) used to fail in the
    middle of restore, after pages were allocated."""
    record = _tampered(_record_from(three_end_allocator()), what)
    alloc = three_end_allocator(arena_bytes=32 * 40, debug_checks=True)
    model, other, req, third = setup_request(alloc)
    assert alloc.can_alloc({"full": 4, "draft": 4, "swa": 4})
    snap = alloc.snapshot()
    with pytest.raises(UmallocValueError, match="does not fit this allocator") as err:
        restore(alloc, record)
    assert RECORD_DIFFERENCES[what] in str(err.value)
    assert snapshots_equal(snap, alloc.snapshot()), f"{what}: a refused restore changed the allocator"
    alloc.check_invariants()
    model.check()


def _live_tables(alloc) -> dict:
    """What 'allocated' means, per end: the v2p/p2v tables and the live/pending counts."""
    stats = alloc.stats()
    return {e: (alloc.v2p(e).numpy().copy(), alloc.p2v(e).numpy().copy(), stats[e].live_pages,
                stats[e].pending_pages) for e in alloc.spec.end_names}


def _same_live_tables(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(a[e][0], b[e][0]) and np.array_equal(a[e][1], b[e][1]) and a[e][2:] == b[e][2:] for e in a)


@pytest.mark.parametrize("compaction", ["lazy", "eager"])
def test_restore_short_on_the_second_end_leaves_nothing_allocated(three_end_allocator, compaction: str) -> None:
    """The owner (and the fully bound draft) get their pages, then binding the partly bound SWA end comes up
    short (as bind_end reports it: False, nothing changed on that end): restore returns None and every page it
    took is free again."""
    alloc = three_end_allocator(arena_bytes=32 * 40, compaction=compaction, debug_checks=True)
    model, other, req, third = setup_request(alloc)
    before_bytes = expected_bytes(model, vpages_of(req))
    record = retract(alloc, req)
    model.forget(vpages_of(req))
    assert record.pages_by_end() == {"full": 5, "draft": 5, "swa": 3}  # swa partly bound: bound on its own
    live = _live_tables(alloc)
    calls = []

    def short_bind_end(end, vtokens):
        calls.append(end)
        return False

    alloc.bind_end = short_bind_end
    try:
        assert restore(alloc, record) is None
    finally:
        del alloc.bind_end
    assert calls == ["swa"]
    assert _same_live_tables(live, _live_tables(alloc)), "a failed restore left pages allocated"
    alloc.check_invariants()
    assert_no_ghost_pages(alloc)
    model.check()
    new = restore(alloc, record)  # the same record still restores whole
    assert new is not None
    check_restored(alloc, model, req, new, before_bytes)


def test_restore_failing_while_writing_bytes_frees_what_it_took_and_reraises(three_end_allocator) -> None:
    """A device error while the bytes go back (after every end is bound) is re-raised with every new page
    freed; before the fix the pages stayed allocated."""
    alloc = three_end_allocator(arena_bytes=32 * 40, debug_checks=True)
    model, other, req, third = setup_request(alloc)
    record = retract(alloc, req)
    model.forget(vpages_of(req))
    live = _live_tables(alloc)
    real_envelopes = alloc.arena.envelopes

    def failing_envelopes(end):
        if end == "swa":
            raise RuntimeError("injected device error")
        return real_envelopes(end)

    alloc.arena.envelopes = failing_envelopes
    try:
        with pytest.raises(RuntimeError, match="injected device error"):
            restore(alloc, record)
    finally:
        del alloc.arena.envelopes
    assert _same_live_tables(live, _live_tables(alloc)), "a failed restore left pages allocated"
    alloc.check_invariants()
    assert_no_ghost_pages(alloc)
    model.check()
