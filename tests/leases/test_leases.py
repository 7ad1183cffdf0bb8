"""LeaseTable / Lease standalone: validation, counting, callbacks, deadlines with a fake clock, and a
hypothesis state machine against a brute-force model."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from compaction_helpers import PAGE_SIZE, ByteModel
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from umalloc.allocator.facade import snapshots_equal
from umalloc.errors import InvariantError, LeaseError
from umalloc.leases.table import Lease, LeaseTable
from umalloc.pool.pagestate import PAGE_PENDING
from umalloc.testing import FakeClock


def make_table(**kw):
    calls: list[tuple[str, list[int]]] = []
    clock = FakeClock()
    table = LeaseTable({"full": 10, "swa": 20, "draft": 6}, clock=clock,
                       on_unpinned=lambda end, pages: calls.append((end, pages.tolist())),
                       first_pages={"full": 1, "swa": 1, "draft": 1}, **kw)
    return table, clock, calls


def assert_untouched(table: LeaseTable) -> None:
    for end in table.ends:
        assert not table.pin_count(end).any()
        assert table.pins_current(end) == 0
    assert len(table) == 0 and table.leases_taken == 0 and table.version == 0
    table.check_invariants()


@pytest.mark.parametrize("pages, match", [
    ({"nope": [1]}, "end 'nope'"),
    ({"full": [0]}, r"physical page 0 of end 'full': allowed \[1, 9\]"),  # the sink
    ({"full": [10]}, r"allowed \[1, 9\]"),
    ({"full": [1], "swa": [25]}, r"physical page 25 of end 'swa'"),  # a later end fails: nothing pinned
    ({"full": [1.0]}, "integer dtype"),
    ({"full": [[1, 2]]}, "1-D"),
    ({"full": torch.tensor([1.5])}, "integer dtype"),
    ({"full": torch.tensor([True])}, "integer dtype"),
])
def test_bad_pages_raise_and_change_nothing(pages, match) -> None:
    table, _, calls = make_table()
    with pytest.raises(LeaseError, match=match):
        table.pin(pages, deadline_s=None, tag="t")
    assert_untouched(table)
    assert calls == []


@pytest.mark.parametrize("deadline", [0, -1.0, float("inf"), float("nan"), True, "5"])
def test_bad_deadline_raises_and_changes_nothing(deadline) -> None:
    table, _, _ = make_table()
    with pytest.raises(LeaseError, match="deadline_s"):
        table.pin({"full": [1]}, deadline_s=deadline, tag="t")
    assert_untouched(table)


def test_validator_refusal_changes_nothing() -> None:
    seen = []

    def validator(end: str, pages: np.ndarray) -> None:
        seen.append((end, pages.tolist()))
        if end == "swa":
            raise LeaseError(f"pages {pages.tolist()} of {end} are not live")

    table, _, _ = make_table(validator=validator)
    with pytest.raises(LeaseError, match="not live"):
        table.pin({"full": [3, 2], "swa": [4]}, deadline_s=None)
    assert seen == [("full", [2, 3]), ("swa", [4])]
    assert_untouched(table)


def test_pin_dedups_and_counts_overlapping_leases() -> None:
    table, _, calls = make_table()
    a = table.pin({"full": torch.tensor([3, 1, 3, 5]), "swa": np.array([7], np.int32)}, deadline_s=None, tag="a")
    b = table.pin({"full": [5, 6], "draft": [2]}, deadline_s=None, tag="b")
    assert a.pages["full"].tolist() == [1, 3, 5] and a.pages["full"].dtype == np.int64
    assert table.pin_count("full").tolist() == [0, 1, 0, 1, 0, 2, 1, 0, 0, 0]
    assert table.pins_current("full") == 4 and table.pins_current("swa") == 1 and table.pins_current("draft") == 1
    assert table.any_pinned("draft") and table.moves_blocked("swa")
    assert [lease.id for lease in table.active()] == [a.id, b.id]
    with pytest.raises(ValueError):
        table.pin_count("full")[1] = 0  # read-only view
    assert a.release() is True
    # page 5 is still pinned by b: not reported
    assert calls == [("full", [1, 3]), ("swa", [7])]
    assert table.pin_count("full").tolist() == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0]
    assert a.release() is False and a.state == "released"
    assert calls == [("full", [1, 3]), ("swa", [7])]
    b.release()
    assert calls[2:] == [("full", [5, 6]), ("draft", [2])]
    assert not any(table.any_pinned(e) for e in table.ends)
    assert (table.leases_taken, table.leases_released, table.leases_expired) == (2, 2, 0)
    table.check_invariants()


def test_exception_inside_with_releases_the_lease() -> None:
    table, _, calls = make_table()
    with pytest.raises(RuntimeError, match="transfer failed"):
        with table.pin({"full": [2], "swa": [3]}, deadline_s=None, tag="x") as lease:
            assert table.any_pinned("full")
            raise RuntimeError("transfer failed")
    assert lease.state == "released" and len(table) == 0
    assert not table.any_pinned("full") and not table.any_pinned("swa")
    assert calls == [("full", [2]), ("swa", [3])]
    table.check_invariants()


def test_deadline_reclaim_counts_logs_and_is_harmless_to_release(caplog) -> None:
    table, clock, calls = make_table()
    short = table.pin({"full": [1, 2]}, deadline_s=2.0, tag="peer-a")
    long = table.pin({"full": [2], "draft": [4]}, deadline_s=10.0, tag="peer-b")
    forever = table.pin({"swa": [9]}, deadline_s=None, tag="local")
    assert table.next_deadline() == 2.0
    clock.now = 1.9
    assert table.expire() == [] and not short.expired
    clock.now = 2.0
    assert short.expired and short.state == "active"  # past its deadline, not yet reclaimed
    assert table.pins_current("full") == 2
    with caplog.at_level(logging.WARNING, logger="umalloc.leases.table"):
        reclaimed = table.expire()
    assert reclaimed == [short] and short.state == "expired"
    assert "peer-a" in caplog.text and "expired" in caplog.text
    assert calls == [("full", [1])]  # page 2 still pinned by `long`
    assert (table.leases_expired, table.pages_expired) == (1, 2)
    assert short.release() is False  # harmless
    with short:
        pass
    assert table.leases_released == 0
    clock.now = 100.0
    assert table.expire() == [long]
    assert calls[1:] == [("full", [2]), ("draft", [4])]
    assert forever.active and not forever.expired
    assert table.stats()["leases_expired"] == 2
    table.check_invariants()


def test_expire_aggregates_callbacks_per_end() -> None:
    table, clock, calls = make_table()
    table.pin({"full": [1, 4]}, deadline_s=1.0)
    table.pin({"full": [4, 2]}, deadline_s=1.5)
    clock.now = 5.0
    assert len(table.expire()) == 2
    assert calls == [("full", [1, 2, 4])]


def test_release_of_expired_unreclaimed_lease_counts_as_release() -> None:
    table, clock, _ = make_table()
    lease = table.pin({"full": [1]}, deadline_s=1.0)
    clock.now = 3.0
    assert lease.expired
    assert lease.release() is True and lease.state == "released" and not lease.expired
    assert table.expire() == []
    assert (table.leases_released, table.leases_expired) == (1, 0)
    table.check_invariants()


def test_release_tagged_releases_a_dead_peers_leases() -> None:
    table, _, calls = make_table()
    a = table.pin({"full": [1]}, deadline_s=None, tag="peer-x")
    b = table.pin({"swa": [2]}, deadline_s=None, tag="peer-y")
    c = table.pin({"full": [1, 3]}, deadline_s=30.0, tag="peer-x")
    assert table.release_tagged("peer-x") == 2
    assert a.state == c.state == "released" and b.active
    assert calls == [("full", [1, 3])]
    assert table.release_tagged("peer-x") == 0
    table.check_invariants()


def test_version_changes_with_every_hold_change() -> None:
    table, clock, _ = make_table()
    v0 = table.version
    lease = table.pin({"full": [1]}, deadline_s=1.0)
    v1 = table.version
    assert v1 > v0
    clock.now = 2.0
    table.expire()
    assert table.version > v1
    lease.release()
    assert table.version == v1 + 1


def test_check_invariants_detects_a_corrupted_count() -> None:
    table, _, _ = make_table()
    table.pin({"full": [1, 2]}, deadline_s=None)
    table._pins["full"][2] = 0  # simulate a lost pin
    with pytest.raises(InvariantError, match="pin counts"):
        table.check_invariants()


def test_lease_of_another_table_is_refused() -> None:
    t1, _, _ = make_table()
    t2, _, _ = make_table()
    lease = t1.pin({"full": [1]}, deadline_s=None)
    with pytest.raises(LeaseError, match="another table"):
        t2._release(lease, "released")


# ---- state machine against a brute-force model ---------------------------------------------------------------
SLOTS = {"a": 6, "b": 4}


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.unpinned: list[tuple[str, list[int]]] = []
        self.table = LeaseTable(SLOTS, clock=self.clock,
                                on_unpinned=lambda e, p: self.unpinned.append((e, p.tolist())))
        self.model: dict[int, tuple[dict[str, set[int]], float | None, Lease]] = {}
        self.inactive: list[Lease] = []

    def counts(self) -> dict[str, list[int]]:
        out = {e: [0] * n for e, n in SLOTS.items()}
        for pages, _, _ in self.model.values():
            for e, ps in pages.items():
                for p in ps:
                    out[e][p] += 1
        return out

    def deactivate_in_model(self, lease_ids: list[int]) -> None:
        before = self.counts()
        for lid in lease_ids:
            self.inactive.append(self.model.pop(lid)[2])
        after = self.counts()
        expect = [(e, [p for p in range(SLOTS[e]) if before[e][p] > 0 and after[e][p] == 0]) for e in SLOTS]
        expect = [(e, ps) for e, ps in expect if ps]
        got = self.unpinned
        self.unpinned = []
        assert got == expect

    @rule(a=st.lists(st.integers(0, 5), max_size=5), b=st.lists(st.integers(0, 3), max_size=3),
          deadline=st.one_of(st.none(), st.sampled_from([0.5, 1.0, 2.0])))
    def pin(self, a, b, deadline) -> None:
        lease = self.table.pin({"a": a, "b": b}, deadline_s=deadline)
        self.model[lease.id] = ({"a": set(a), "b": set(b)},
                                None if deadline is None else self.clock.now + deadline, lease)
        assert self.unpinned == []

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data) -> None:
        lid = data.draw(st.sampled_from(sorted(self.model)))
        lease = self.model[lid][2]
        assert lease.release() is True
        self.deactivate_in_model([lid])

    @precondition(lambda self: self.inactive)
    @rule(data=st.data())
    def release_again(self, data) -> None:
        lease = data.draw(st.sampled_from(self.inactive))
        assert lease.release() is False
        assert self.unpinned == []

    @rule(dt=st.sampled_from([0.25, 0.5, 1.0]))
    def advance_and_expire(self, dt) -> None:
        self.clock.now += dt
        due = sorted((dl, lid) for lid, (_, dl, _) in self.model.items() if dl is not None and dl <= self.clock.now)
        got = self.table.expire()
        assert [lease.id for lease in got] == [lid for _, lid in due]
        self.deactivate_in_model([lid for _, lid in due])
        assert all(lease.state == "expired" for lease in got)

    @invariant()
    def counts_match_model(self) -> None:
        counts = self.counts()
        for e in SLOTS:
            assert self.table.pin_count(e).tolist() == counts[e]
            assert self.table.pins_current(e) == sum(1 for c in counts[e] if c)
        assert len(self.table) == len(self.model)
        self.table.check_invariants()


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# =============================================================================================================
# against the allocator: leases through MultiEndedAllocator
# =============================================================================================================
def extend(alloc, seq_len: int) -> torch.Tensor | None:
    return alloc.alloc_extend(torch.tensor([0]), torch.tensor([seq_len]), torch.tensor([-1]))


def vpages_of(tokens: torch.Tensor) -> np.ndarray:
    return np.unique(tokens.numpy() // PAGE_SIZE)


def phys_of(alloc, tokens: torch.Tensor, end: str) -> torch.Tensor:
    return alloc.translate_pages(torch.from_numpy(vpages_of(tokens)), end)


def fill(alloc, model: ByteModel, seq_len: int = 2) -> list[torch.Tensor]:
    out = []
    while (t := extend(alloc, seq_len)) is not None:
        model.write(vpages_of(t))
        out.append(t)
    return out


def handed_out(alloc, reqs: list[torch.Tensor], end: str) -> set[int]:
    return {p for t in reqs for p in phys_of(alloc, t, end).tolist()}


def test_lease_misuse_raises_and_changes_nothing(two_end_allocator) -> None:
    alloc = two_end_allocator(debug_checks=True)
    t = extend(alloc, 4)
    alloc.free(extend(alloc, 2))
    snap = alloc.snapshot()
    for pages, match in [({"full": torch.tensor([0])}, "allowed"),          # the sink
                         ({"full": torch.tensor([9])}, "not live"),         # never allocated
                         ({"nope": phys_of(alloc, t, "full")}, "nope"),
                         ({"full": phys_of(alloc, t, "full"), "swa": torch.tensor([99])}, "allowed")]:
        with pytest.raises(LeaseError, match=match):
            alloc.lease(pages)
    assert snapshots_equal(snap, alloc.snapshot())
    assert alloc.lease_table.leases_taken == 0


def test_abort_exception_inside_with_releases_and_pages_become_reusable(two_end_allocator) -> None:
    alloc = two_end_allocator(arena_bytes=32 * 8, debug_checks=True)
    model = ByteModel(alloc)
    t = extend(alloc, 4)
    model.write(vpages_of(t))
    phys = {e: phys_of(alloc, t, e) for e in ("full", "swa")}
    with pytest.raises(RuntimeError, match="peer vanished"):
        with alloc.lease(phys, tag="xfer") as lease:
            alloc.free(t)
            model.forget(vpages_of(t))
            assert alloc.stats()["full"].pending_pages == 2
            raise RuntimeError("peer vanished")
    assert lease.state == "released" and alloc.leases_active() == 0
    assert not alloc.moves_blocked("full") and not alloc.moves_blocked("swa")
    s = alloc.stats()
    assert s["full"].pending_pages == 0 and s["swa"].pending_pages == 0
    reqs = fill(alloc, model)
    assert phys["full"].tolist()[0] in handed_out(alloc, reqs, "full")  # reusable again
    assert lease.release() is False  # double release harmless
    model.check()
    alloc.check_invariants()


def test_deadline_reclaim_is_counted_logged_and_pages_become_reusable(two_end_allocator, caplog) -> None:
    clock = FakeClock()
    alloc = two_end_allocator(arena_bytes=32 * 8, clock=clock, debug_checks=True)
    model = ByteModel(alloc)
    reqs = fill(alloc, model)
    victim = reqs.pop(0)
    phys = {e: phys_of(alloc, victim, e) for e in ("full", "swa")}
    lease = alloc.lease(phys, deadline_s=5.0, tag="dead-peer")
    alloc.free(victim)
    model.forget(vpages_of(victim))
    assert extend(alloc, 2) is None  # the pinned pages are pending: not reusable, not available
    s = alloc.stats()["full"]
    assert (s.pending_pages, s.hole_pages, s.free_pages) == (1, 0, s.reachable_gap_pages)
    clock.now = 4.99
    assert extend(alloc, 2) is None and lease.state == "active"
    clock.now = 5.0
    assert lease.expired and lease.state == "active"  # due, reclaimed by the next allocator call
    with caplog.at_level(logging.WARNING, logger="umalloc.leases.table"):
        t = extend(alloc, 2)
    assert t is not None, "an expired lease's pages must be reusable"
    assert lease.state == "expired" and "dead-peer" in caplog.text
    assert phys_of(alloc, t, "full").tolist() == phys["full"].tolist()
    s = alloc.stats()
    assert s["full"].leases_expired == 1 and s["swa"].leases_expired == 1
    assert alloc.lease_table.leases_expired == 1
    assert lease.release() is False and alloc.lease_table.leases_released == 0  # harmless after expiry
    model.write(vpages_of(t))
    model.check()


def test_F11_page_freed_under_a_transfer_is_never_reused_or_moved_until_the_lease_is_released(three_end_allocator) -> None:
    alloc = three_end_allocator(arena_bytes=32 * 12, compaction="eager", debug_checks=True)
    model = ByteModel(alloc)
    reqs = fill(alloc, model)
    victim = reqs.pop(len(reqs) // 2)
    vp = vpages_of(victim)
    phys = {e: phys_of(alloc, victim, e) for e in alloc.spec.end_names}
    data = {e: alloc.arena.envelopes(e)[p].clone() for e, p in phys.items()}
    lease = alloc.lease(phys, tag="in-flight")
    alloc.free(victim)  # eager compaction runs on free; the pinned pages stay
    model.forget(vp)
    for _ in range(3):  # churn around the pinned pages
        t = reqs.pop(0)
        alloc.free(t)
        model.forget(vpages_of(t))
        reqs += fill(alloc, model)
        for e, p in phys.items():
            assert not (set(p.tolist()) & handed_out(alloc, reqs, e)), f"{e}: a pending page was reused"
            assert torch.equal(alloc.arena.envelopes(e)[p], data[e]), f"{e}: bytes under the transfer changed"
            assert (alloc.ends[e].state[p.numpy()] == PAGE_PENDING).all()
    model.check()
    lease.release()
    for e in alloc.spec.end_names:
        assert alloc.stats()[e].pending_pages == 0
    reqs += fill(alloc, model)
    assert set(phys["full"].tolist()) <= handed_out(alloc, reqs, "full")  # reusable after the lease
    model.check()


def test_F12_held_pages_have_a_deadline_a_dead_peer_releases_them_and_they_count_as_held(two_end_allocator) -> None:
    clock = FakeClock()
    alloc = two_end_allocator(arena_bytes=32 * 10, clock=clock, debug_checks=True)
    model = ByteModel(alloc)
    a, b = extend(alloc, 4), extend(alloc, 4)
    model.write(vpages_of(a))
    model.write(vpages_of(b))
    la = alloc.lease({"full": phys_of(alloc, a, "full")}, deadline_s=2.0, tag="peer-1")
    lb = alloc.lease({"swa": phys_of(alloc, b, "swa")}, deadline_s=None, tag="peer-2")
    for t in (a, b):
        alloc.free(t)
        model.forget(vpages_of(t))
    s = alloc.stats()
    # held, not leaked: every page is accounted for as pending (and pinned)
    assert (s["full"].pending_pages, s["full"].pinned_pages) == (2, 2)
    assert (s["swa"].pending_pages, s["swa"].pinned_pages) == (2, 2)
    for st_ in s.values():
        assert st_.live_pages + st_.hole_pages + st_.pending_pages + st_.gap_pages + st_.reserved_pages \
            == st_.num_page_slots
    clock.now = 3.0
    assert alloc.leases_active() == 1 and la.state == "expired"
    assert alloc.lease_table.release_tagged("peer-2") == 1 and lb.state == "released"  # the peer died
    s = alloc.stats()
    assert all((x.pending_pages, x.pinned_pages, x.live_pages, x.hole_pages) == (0, 0, 0, 0) for x in s.values())
    alloc.check_invariants()


def test_F16_every_terminal_path_lifts_the_hold_on_compaction(two_end_allocator) -> None:
    clock = FakeClock()
    alloc = two_end_allocator(arena_bytes=32 * 16, clock=clock, debug_checks=True)
    model = ByteModel(alloc)

    def scenario(end_the_lease) -> None:
        reqs = [extend(alloc, 4) for _ in range(3)]
        for t in reqs:
            model.write(vpages_of(t))
        far = reqs[2]
        lease = alloc.lease({e: phys_of(alloc, far, e) for e in ("full", "swa")}, deadline_s=10.0, tag="x")
        alloc.free(reqs[0])
        model.forget(vpages_of(reqs[0]))
        assert alloc.moves_blocked("full") and alloc.moves_blocked("swa")
        assert alloc.compact().pages_moved == 0  # the far pages are walls; nothing behind them moves
        end_the_lease(lease)
        assert alloc.leases_active() == 0
        assert not alloc.moves_blocked("full") and not alloc.moves_blocked("swa")
        assert alloc.compact().pages_moved > 0  # the hold is gone: compaction proceeds
        model.check()
        for t in reqs[1:]:
            alloc.free(t)
            model.forget(vpages_of(t))
        alloc.check_invariants()

    def with_block_success(lease):
        with lease:
            pass

    def with_block_failure(lease):
        with pytest.raises(ValueError):
            with lease:
                raise ValueError("transfer failed")

    def deadline(lease):
        clock.now += 11.0

    def peer_died(lease):
        alloc.lease_table.release_tagged("x")

    for path in (with_block_success, with_block_failure, lambda lease: lease.release(), deadline, peer_died):
        scenario(path)
