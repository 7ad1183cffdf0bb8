"""F12: a receiver that only *waits* on its published half learns that the sender died. The
sender (a worker process) is SIGKILLed right after it submitted; ``wait_half`` (which checks the sender's liveness
on every poll, Note [Published half liveness]) raises PeerDiedError, the half fails and, the process being gone,
its lease lets go of its pages (settled or released: pages free). Every engine runs for real (UCX on loopback, Mooncake over TCP)."""

from __future__ import annotations

import pytest
from backend_helpers import (
    DEADLINE_S,
    ENGINES,
    L_TOKENS,
    SEED,
    W,
    alloc_request,
    kv_side,
    kv_spec,
    worker,
)

from umalloc.errors import PeerDiedError, TransferTimeout, UmallocValueError
from umalloc.transfer import PeerLayout, build_receiver_half


@pytest.mark.parametrize("name", ENGINES)
def test_a_receiver_that_only_waits_gets_peer_died_when_its_sender_is_killed(
        name, backend_workers, backend_factory):
    """No fail_half_if_peer_died call anywhere; wait_half alone reports the death."""
    w = worker(backend_workers, name, "victim")
    w.call("reset_backend")
    dst_arena, dst_alloc = kv_side(kv_spec(), SEED + 1)
    b = backend_factory(name, layout=PeerLayout.from_arena(dst_arena))
    b.register(dst_arena.regions())
    w.run(W + "kv_setup", PeerLayout.from_arena(dst_arena).to_dict(), seed=SEED)
    sender = b.connect(w.call("metadata"))
    me = w.call("connect", b.metadata(), progress=b.progress)
    src_vt = w.run(W + "kv_alloc", {"full": L_TOKENS, "draft": L_TOKENS})
    half = build_receiver_half("w-23", dst_alloc, alloc_request(dst_alloc, L_TOKENS))
    with pytest.raises(UmallocValueError):
        b.publish_half(half, sender="nobody")
    wire = b.publish_half(half, sender=sender)
    with pytest.raises(TransferTimeout):
        b.wait_half(half, 0.05)               # alive and silent: a timeout, the half left pending
    assert half.state == "pending" and b.poll_half(half) == "pending"
    w.run(W + "kv_send", "w-23", wire, me, src_vt, wait=False, progress=b.progress)
    w.kill()
    with pytest.raises(PeerDiedError):
        b.wait_half(half, DEADLINE_S)
    assert half.state == "failed" and isinstance(half.error, PeerDiedError)
    assert half.lease.state in ("settled", "released")   # the process is gone: its pages come free
    b.disconnect(sender)
    assert dst_alloc.leases_active() == 0
    dst_alloc.check_invariants()
