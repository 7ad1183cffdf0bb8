"""F30: NIXL refuses stale metadata. After connect -> disconnect -> the receiver deregisters ->
a reconnect with the *old* metadata is refused with RegistrationError (its hello quotes an old registration
generation), and nothing lands in the deregistered memory; the receiver's current metadata connects and writes.
A sender still connected when its target drops its registrations writes nothing.
The NIXL engine runs for real (UCX on loopback)."""

from __future__ import annotations

import pytest
from backend_helpers import (
    DEADLINE_S,
    L_TOKENS,
    alloc_request,
    kv_pair,
    tbytes,
)

from umalloc.errors import RegistrationError, TransferError
from umalloc.transfer import build_plan


def test_nixl_refuses_a_reconnect_with_metadata_older_than_a_deregistration(backend_factory):
    """The sequence of the report, in one process; the write that used to land 4,080 of 4,096
    bytes in the deregistered buffer is never posted (connect refuses), and after re-registering the receiver's
    fresh metadata works."""
    src_arena, src_alloc, a, dst_arena, dst_alloc, b = kv_pair(backend_factory, "nixl")
    old_md = b.metadata()
    peer = a.connect(old_md)
    a.disconnect(peer)
    b.deregister(dst_arena.regions())
    before = tbytes(dst_arena.data)
    with pytest.raises(RegistrationError, match="stale"):
        a.connect(old_md)
    assert a.peers() == [] and tbytes(dst_arena.data) == before
    b.register(dst_arena.regions())
    peer = a.connect(b.metadata())
    plan = build_plan("fresh", src_alloc, alloc_request(src_alloc, L_TOKENS), dst_alloc,
                      alloc_request(dst_alloc, L_TOKENS))
    h = a.submit(plan, peer)
    a.wait(h, DEADLINE_S)
    a.forget(h)
    assert plan.state == "done"
    a.disconnect(peer)


def test_nixl_writes_nothing_once_the_target_dropped_its_registrations_since_connect(
        backend_factory):
    """After connect: a sender connected at generation g; the target resets (every
    registration dropped: its generation moves and it says goodbye) while the sender still holds the peer. The
    submit is refused (RegistrationError, stale generation) or its handle fails (TransferError, closed peer):
    either way typed, and not one destination byte changes."""
    src_arena, src_alloc, a, dst_arena, dst_alloc, b = kv_pair(backend_factory, "nixl")
    peer = a.connect(b.metadata())
    plan = build_plan("late", src_alloc, alloc_request(src_alloc, L_TOKENS), dst_alloc,
                      alloc_request(dst_alloc, L_TOKENS))
    b.reset()
    before = tbytes(dst_arena.data)
    try:
        h = a.submit(plan, peer)
    except RegistrationError:
        plan.abort()
    else:
        with pytest.raises(TransferError):
            a.wait(h, DEADLINE_S)
        a.drain(h, DEADLINE_S)
        a.forget(h)
    assert plan.state in ("failed", "aborted") and tbytes(dst_arena.data) == before
    a.disconnect(peer)
