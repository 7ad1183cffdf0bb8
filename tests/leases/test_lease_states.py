"""Lease states (active -> released | expired | in_doubt -> settled), engine holds and generations (F24, F27),
on the lease table alone and through the allocator and plans. Expected page sets are written out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from umalloc.backends.protocol import EngineHold
from umalloc.errors import LeaseError, StaleLeaseError
from umalloc.leases.table import LeaseTable
from umalloc.pool.pagestate import PAGE_LIVE, PAGE_PENDING
from umalloc.testing import FakeClock, small_allocator


def test_deadline_with_an_engine_hold_goes_in_doubt_and_settles_on_the_engine_report() -> None:
    clock = FakeClock()
    alloc = small_allocator(clock=clock)
    vp = alloc.alloc_pages(3)  # full pages 1, 2, 3
    lease = alloc.lease({"full": np.array([1, 2])}, deadline_s=5.0, tag="xfer")
    gen = lease.hold_engine()  # a part is in an engine
    alloc.free_pages(vp[:2].numpy())  # the request goes away: its pages 1, 2 stay pending
    free_before = alloc.stats()["full"].free_pages
    clock.now = 6.0
    st = alloc.stats()["full"]  # the call reclaims nothing: the engine may still write pages 1, 2
    assert lease.state == "in_doubt" and lease.engine_holds == 1
    assert (st.in_doubt_pages, st.leases_in_doubt, st.pending_pages, st.leases_expired) == (2, 1, 2, 0)
    assert st.free_pages == free_before  # pages 1, 2 did not come free at the deadline
    snap = alloc.snapshot()
    assert [(d["id"], d["state"], d["pages"]["full"].tolist()) for d in snap["leases"]] == [
        (lease.id, "in_doubt", [1, 2])]
    assert alloc.alloc_pages(2).tolist() and (alloc.ends["full"].state[[1, 2]] == PAGE_PENDING).all()
    alloc.check_invariants()
    assert lease.release() is False  # a plain release does not settle an in-doubt lease
    assert lease.unhold_engine(gen) is True  # the engine's terminal report
    st = alloc.stats()["full"]
    assert lease.state == "settled" and (st.in_doubt_pages, st.pending_pages) == (0, 0)
    alloc.check_invariants()


def test_deadline_before_anything_was_posted_still_reclaims_at_once() -> None:
    clock = FakeClock()
    alloc = small_allocator(clock=clock)
    vp = alloc.alloc_pages(2)
    lease = alloc.lease({"full": np.array([1, 2])}, deadline_s=1.0)
    alloc.free_pages(vp.numpy())
    clock.now = 2.0
    st = alloc.stats()["full"]
    assert lease.state == "expired" and (st.in_doubt_pages, st.pending_pages, st.leases_expired) == (0, 0, 1)
    with pytest.raises(LeaseError, match="expired"):
        lease.hold_engine()  # nothing may be handed to an engine any more
    alloc.check_invariants()


def test_release_while_an_engine_holds_a_part_defers_the_pages() -> None:
    alloc = small_allocator()
    vp = alloc.alloc_pages(2)
    lease = alloc.lease({"full": np.array([1, 2])})
    hold_a, hold_b = lease.hold_engine(), lease.hold_engine()  # two engine parts
    assert lease.release() is True and lease.state == "in_doubt"
    alloc.free_pages(vp.numpy())
    assert alloc.stats()["full"].pending_pages == 2
    assert lease.unhold_engine(hold_a) is False  # one part still in the engine
    assert alloc.stats()["full"].in_doubt_pages == 2
    assert lease.unhold_engine(hold_b) is True
    assert alloc.stats()["full"].pending_pages == 0
    with pytest.raises(StaleLeaseError):
        lease.unhold_engine(hold_b)  # no hold left: a duplicate report is refused
    alloc.check_invariants()


def test_settle_is_for_in_doubt_leases_and_checks_the_generation() -> None:
    table = LeaseTable({"full": 8})
    lease = table.pin({"full": [3]}, deadline_s=None)
    with pytest.raises(StaleLeaseError, match="active"):
        lease.settle()
    lease.hold_engine()
    lease.release()
    with pytest.raises(StaleLeaseError, match="generation"):
        lease.settle(lease.generation + 1)
    assert lease.settle(lease.generation) is True and lease.settle() is False
    assert int(table.pin_count("full")[3]) == 0
    table.check_invariants()
    assert table.stats()["leases_settled"] == 1 and table.stats()["leases_in_doubt"] == 1


def test_F27_a_stale_release_never_touches_the_new_owner() -> None:
    clock = FakeClock()
    alloc = small_allocator(clock=clock)
    vp = alloc.alloc_pages(1)  # page 1
    old = alloc.lease({"full": np.array([1])}, deadline_s=1.0)
    token = (old.id, old.generation)
    alloc.free_pages(vp.numpy())
    clock.now = 2.0
    assert alloc.leases_active() == 0 and old.state == "expired"
    again = alloc.alloc_pages(1)
    assert alloc.translate_pages(again, "full").tolist() == [1]  # page 1 has a new owner
    new = alloc.lease({"full": np.array([1])})
    with pytest.raises(StaleLeaseError):
        alloc.lease_table.lookup(*token)  # a late report quoting the old generation
    assert old.release() is False
    with pytest.raises(StaleLeaseError):
        old.unhold_engine(old.generation)
    assert int(alloc.lease_table.pin_count("full")[1]) == 1 and new.active
    assert alloc.lease_table.lookup(new.id, new.generation) is new
    alloc.free_pages(again.numpy())
    assert alloc.ends["full"].state[1] == PAGE_PENDING  # still protected by the new owner's lease
    new.release()
    assert alloc.stats()["full"].pending_pages == 0
    alloc.check_invariants()


def test_plan_abort_with_a_part_in_the_engine_fails_at_once_and_keeps_the_pages() -> None:
    """The plan reports its finish at once; its leases wait for the engine (F24, priority 2 of the issue)."""
    import torch

    from umalloc.allocator.facade import MultiEndedAllocator
    from umalloc.geometry.arena import Arena
    from umalloc.testing import tiny_spec
    from umalloc.transfer import build_plan

    src = MultiEndedAllocator(Arena(tiny_spec()))
    dst = MultiEndedAllocator(Arena(tiny_spec()))
    one = lambda x: torch.tensor([x], dtype=torch.int64)  # noqa: E731
    svt = src.alloc_extend(one(0), one(6), one(-1))
    dvt = dst.alloc_extend(one(0), one(6), one(-1))
    plan = build_plan("r", src, {"full": svt}, dst, {"full": dvt})
    hold = EngineHold(plan)  # what a backend takes before it hands the first part to an engine
    assert plan.abort() is True and plan.state == "aborted"
    assert plan.src_lease.state == "in_doubt" and plan.dst_lease.state == "in_doubt"
    src.free(svt)
    dst.free(dvt)
    assert src.stats()["full"].pending_pages == 3 and dst.stats()["full"].in_doubt_pages == 3
    hold.drop()  # the engine let go of every part
    hold.drop()  # idempotent
    assert plan.src_lease.state == "settled" and plan.dst_lease.state == "settled"
    assert src.stats()["full"].pending_pages == 0 and dst.stats()["full"].pending_pages == 0
    src.check_invariants()
    dst.check_invariants()


def test_receiver_half_published_to_a_peer_stays_in_doubt_until_the_sender_reports() -> None:
    import torch

    from umalloc.allocator.facade import MultiEndedAllocator
    from umalloc.geometry.arena import Arena
    from umalloc.testing import tiny_spec
    from umalloc.transfer import build_receiver_half

    clock = FakeClock()
    dst = MultiEndedAllocator(Arena(tiny_spec()), clock=clock)
    one = lambda x: torch.tensor([x], dtype=torch.int64)  # noqa: E731
    dvt = dst.alloc_extend(one(0), one(6), one(-1))
    half = build_receiver_half("r", dst, {"full": dvt}, deadline_s=5.0)
    wire = half.publish()  # the pages leave the process: a sender may write them from now on
    assert wire == half.to_dict()
    clock.now = 6.0
    assert dst.leases_active() == 0 and half.lease.state == "in_doubt"
    st = dst.stats()
    assert st["full"].in_doubt_pages == 3 and st["swa"].in_doubt_pages == 2
    dst.free(dvt)
    assert dst.stats()["full"].pending_pages == 3
    assert (dst.ends["full"].state[half.lease.pages["full"]] == PAGE_PENDING).all()
    half.fail(None)  # the receiver gives up: still in doubt
    assert half.state == "failed" and half.lease.state == "in_doubt"
    half.settle()  # the sender's terminal report (or its confirmed death) arrived
    assert half.lease.state == "settled" and dst.stats()["full"].pending_pages == 0
    dst.check_invariants()
    # an unpublished half keeps today's behaviour: finishing it releases the pages at once
    dvt2 = dst.alloc_extend(one(0), one(6), one(-1))
    half2 = build_receiver_half("r2", dst, {"full": dvt2})
    assert half2.lease.deadline is not None  # a finite default deadline
    half2.abort()
    assert half2.lease.state == "released"
    assert (dst.ends["full"].state[half2.lease.pages["full"]] == PAGE_LIVE).all()
    dst.check_invariants()


def test_a_published_half_completed_normally_never_goes_in_doubt(caplog) -> None:
    import logging

    import torch

    from umalloc.allocator.facade import MultiEndedAllocator
    from umalloc.geometry.arena import Arena
    from umalloc.testing import tiny_spec
    from umalloc.transfer import build_receiver_half

    dst = MultiEndedAllocator(Arena(tiny_spec()))
    one = lambda x: torch.tensor([x], dtype=torch.int64)  # noqa: E731
    dvt = dst.alloc_extend(one(0), one(6), one(-1))
    half = build_receiver_half("r", dst, {"full": dvt})
    half.publish()
    with caplog.at_level(logging.WARNING, logger="umalloc"):
        half.complete()  # the sender's report: done
    assert half.lease.state == "released"  # straight from active: the hold was let go first
    assert dst.lease_table.leases_in_doubt == 0 and not caplog.records
    dst.free(dvt)
    dst.check_invariants()
