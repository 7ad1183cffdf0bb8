"""Mooncake posts a chunk's FAILED descriptors again while the peer answers and the plan's leases hold (Note
[Mooncake retries] in :mod:`umalloc.backends.mooncake`), and gives up after ``max_retries``.

The engine cannot be made to fail a descriptor on demand, so the sender's engine is wrapped: the wrapper forwards
every call to the real engine and turns the first ``fail`` COMPLETED statuses it sees into FAILED, after zeroing
those descriptors' destination bytes (what a write that broke off part-way may leave). The descriptors really
were written and ended in the engine, as a FAILED one is; only a second post of each can restore its bytes."""

from __future__ import annotations

import ctypes

import pytest
from backend_helpers import DEADLINE_S, L_TOKENS, alloc_request, brute_apply, kv_pair, tbytes

from umalloc.errors import TransferError, UmallocValueError
from umalloc.transfer import build_plan


class FailingStatuses:
    """The real engine, except that the first ``fail`` descriptors it reports COMPLETED (1) are reported FAILED
    (-1), their destination bytes zeroed first (``fail=None``: every one)."""

    def __init__(self, engine: object, fail: int | None) -> None:
        self.engine = engine
        self.left = fail
        self.dst: dict[int, tuple[int, int]] = {}
        self.posts = 0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def transfer_submit_write(self, peer: str, src: int, dst: int, n: int) -> int:
        bid = self.engine.transfer_submit_write(peer, src, dst, n)
        self.posts += 1
        self.dst[bid] = (dst, n)
        return bid

    def transfer_check_status(self, bid: int) -> int:
        st = self.engine.transfer_check_status(bid)
        if st == 1 and (self.left is None or self.left > 0):
            if self.left is not None:
                self.left -= 1
            addr, n = self.dst[bid]
            ctypes.memset(addr, 0, n)
            return -1
        return st


def _transfer(backend_factory, fail: int | None, **backend_kw):
    """A plan from one in-process Mooncake backend to another with the sender's engine wrapped; returns what the
    test needs to judge the outcome."""
    src_arena, src_alloc, a, dst_arena, dst_alloc, b = kv_pair(
        lambda name, **kw: backend_factory(name, **kw, **backend_kw), "mooncake")
    src_vt, dst_vt = alloc_request(src_alloc, L_TOKENS), alloc_request(dst_alloc, L_TOKENS)
    peer = a.connect(b.metadata())
    plan = build_plan("req-retry", src_alloc, src_vt, dst_alloc, dst_vt)
    want = brute_apply(tbytes(dst_arena.data), dst_arena.base_ptr, tbytes(src_arena.data), src_arena.base_ptr,
                       plan.descriptors())
    sender = a._senders[peer]
    engine = FailingStatuses(sender.engine, fail)
    sender.engine = engine
    retried0 = a.retried_descriptors
    return a, b, peer, plan, engine, want, dst_arena, src_alloc, dst_alloc, retried0


def test_a_failed_descriptor_is_posted_again_and_its_bytes_land(backend_factory):
    a, b, peer, plan, engine, want, dst_arena, src_alloc, dst_alloc, retried0 = _transfer(backend_factory, 2)
    n = len(plan.descriptors())
    assert n > 2
    h = a.submit(plan, peer)
    try:
        a.wait(h, DEADLINE_S)
        assert h.state == "done" and plan.state == "done"
        assert tbytes(dst_arena.data) == want  # the zeroed descriptors were written again
        assert engine.posts == n + 2 and a.retried_descriptors - retried0 == 2
        assert src_alloc.leases_active() == 0 and dst_alloc.leases_active() == 0
    finally:
        a.forget(h)
    a.check_invariants()


@pytest.mark.parametrize("max_retries", [0, 2])
def test_a_descriptor_that_keeps_failing_fails_the_plan_after_max_retries(backend_factory, max_retries):
    a, b, peer, plan, engine, want, dst_arena, src_alloc, dst_alloc, retried0 = _transfer(
        backend_factory, None, max_retries=max_retries)
    n = len(plan.descriptors())
    h = a.submit(plan, peer)
    try:
        with pytest.raises(TransferError, match=f"{n} of {n} descriptors" + (" .*after 2 retries" if max_retries
                                                                                else r" to '[^']+' failed \(status -1\); peer")):
            a.wait(h, DEADLINE_S)
        assert h.state == "failed" and plan.state == "failed"
        assert engine.posts == n * (max_retries + 1) and a.retried_descriptors - retried0 == n * max_retries
        assert src_alloc.leases_active() == 0 and dst_alloc.leases_active() == 0
    finally:
        a.forget(h)
    a.check_invariants()


def test_max_retries_is_checked_before_the_engine_starts(backend_factory):
    for bad in (-1, 101, 1.5, True, "2"):
        with pytest.raises(UmallocValueError, match="max_retries"):
            backend_factory("mooncake", max_retries=bad)
