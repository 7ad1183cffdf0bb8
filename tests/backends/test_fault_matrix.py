"""The fault matrix on the real engines (F11, F12, F16, F24, F27): the sender in this process, the receiver in a
worker process (``tests/backends/kv_worker.py``) that the tests pause (SIGSTOP) or kill (SIGKILL), and one-process runs.

For each fault: the destination bytes are compared with bytes computed independently (a brute-force loop
applying the plan's descriptors to a copy of the destination taken before the transfer, from a copy of the
source taken before the fault); a *reuser* allocates after the fault and writes a marker into its pages, which
must never reach the peer; after the engine settles, no page is pending, pinned or in doubt; every wait is
bounded. Each test prints one matrix row (``FAULT-ROW``: fault, backend, wrong bytes, leaked pages, in-doubt
pages until settle, seconds to the error).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from backend_helpers import (
    DEADLINE_S,
    ENGINES,
    L_TOKENS,
    SEED,
    W,
    alloc_request,
    brute_apply,
    kv_pair,
    kv_side,
    kv_spec,
    sender_to_worker,
    tbytes,
    worker,
)

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.errors import (
    BackendError,
    LeaseError,
    PeerDiedError,
    RegistrationError,
    TransferError,
    TransferTimeout,
    UmallocValueError,
)
from umalloc.geometry.arena import Arena
from umalloc.pool.pagestate import PAGE_PENDING
from umalloc.testing import FakeClock, require_or_skip
from umalloc.transfer import PeerLayout, build_plan, build_receiver_half, build_send_plan

ALL = ["local", "nixl", "mooncake"]
MARKER = 0xAB
pytestmark = pytest.mark.timeout(900)  # a hang guard: a loaded machine may take minutes


def _row(fault: str, name: str, wrong: int, leaked: int, in_doubt: int, t_err: float | None) -> None:
    t = "-" if t_err is None else f"{t_err:.3f}"
    print(f"FAULT-ROW | {fault} | {name} | {wrong} | {leaked} | {in_doubt} | {t}")


def _diff(a: bytes, b: bytes) -> int:
    return int(np.count_nonzero(np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8)))


def _sender(name, backend_workers, backend_factory, clock=None):
    """A fresh receiver state in the shared worker, a fresh sender here, connected (a fresh connection: NIXL's
    first WRITE of a connection needs the target), one request's plan with a 5 s source lease."""
    w, src_arena, src_alloc, a, peer = sender_to_worker(backend_workers, backend_factory, name, clock=clock)
    src_vt = alloc_request(src_alloc, L_TOKENS)
    half = w.run(W + "kv_receiver_half", "f-1", w.run(W + "kv_alloc", {"full": L_TOKENS, "draft": L_TOKENS}))
    plan = build_send_plan("f-1", src_alloc, src_vt, half, a.peer_layout(peer), deadline_s=5.0)
    before = w.run(W + "kv_arena_bytes")
    want = brute_apply(before, a.peer_layout(peer).arena_base_ptr, tbytes(src_arena.data), src_arena.base_ptr,
                       plan.descriptors())
    return w, src_arena, src_alloc, a, peer, src_vt, plan, want


def _free_and_reuse(src_arena, src_alloc, src_vt, leased) -> None:
    """The request goes away; a new request takes pages and writes the marker into them. No leased page may be
    among them (F11, F24)."""
    src_alloc.free(src_vt["full"], owner="full")
    src_alloc.free(src_vt["draft"], owner="draft")
    reuse = alloc_request(src_alloc, L_TOKENS)
    st = src_alloc.stats()
    data = src_arena.data.numpy()
    for end, owner, ps in (("full", "full", 4), ("swa", "full", 4), ("draft", "draft", 2)):
        vp = reuse[owner][::ps] // ps
        pages = src_alloc.translate_pages(vp, end, strict=False).numpy()
        pages = pages[pages > 0]
        assert not np.isin(pages, leased.get(end, [])).any(), end  # never a page in doubt
        pb = st[end].page_bytes
        for p in pages.tolist():
            data[p * pb:(p + 1) * pb] = MARKER
    src_alloc.compact()
    for end, p in leased.items():  # not moved, not reused
        assert (src_alloc.ends[end].state[p] == PAGE_PENDING).all(), end


def _settled(src_alloc) -> int:
    st = src_alloc.stats()
    return sum(st[e].pending_pages + st[e].in_doubt_pages for e in st)


@pytest.mark.parametrize("name", ENGINES)
def test_F24_lease_deadline_mid_flight_with_the_receiver_stalled(name, backend_workers, backend_factory):
    """The source lease's deadline passes while the engine holds the transfer (receiver SIGSTOPped): the lease
    goes in doubt — pages pinned, pending after the free, never reused — and settles on the engine's terminal
    report after the receiver resumes. The destination gets exactly the request's bytes."""
    clock = FakeClock()
    w, src_arena, src_alloc, a, peer, src_vt, plan, want = _sender(name, backend_workers, backend_factory, clock)
    leased = {e: p.copy() for e, p in plan.src_lease.pages.items() if p.size}
    n_leased = sum(p.size for p in leased.values())
    w.pause()
    try:
        h = a.submit(plan, peer)
        time.sleep(0.3)
        clock.now = 6.0  # past the lease deadline
        st = src_alloc.stats()
        in_doubt = sum(st[e].in_doubt_pages for e in st)
        if a.poll(h) == "pending":  # the engine holds the transfer: the lease must be in doubt
            assert plan.src_lease.state == "in_doubt" and in_doubt == n_leased
            _free_and_reuse(src_arena, src_alloc, src_vt, leased)
        else:  # the engine finished before the deadline passed: nothing in doubt
            assert in_doubt == 0
    finally:
        w.resume()
    a.wait(h, DEADLINE_S)
    a.forget(h)
    got = w.run(W + "kv_arena_bytes")
    wrong = _diff(got, want)
    assert wrong == 0
    assert plan.src_lease.state in ("settled", "released")
    leaked = _settled(src_alloc)
    assert leaked == 0 and src_alloc.leases_active() == 0
    assert w.run(W + "kv_finish_half", "f-1", True) == 0
    src_alloc.check_invariants()
    a.check_invariants()
    _row("lease deadline mid-flight, receiver stalled", name, wrong, leaked, in_doubt, None)


@pytest.mark.parametrize("name", ENGINES)
def test_F24_abort_mid_flight_fails_the_plan_at_once_and_keeps_the_pages(name, backend_workers, backend_factory):
    """``plan.abort()`` while the engine holds the transfer: the plan is aborted at once, its lease is in doubt
    until the engine lets go; no page is reused meanwhile, and the destination gets the request's bytes (the
    engine cannot take back what it was handed) and never the reuser's marker."""
    w, src_arena, src_alloc, a, peer, src_vt, plan, want = _sender(name, backend_workers, backend_factory)
    leased = {e: p.copy() for e, p in plan.src_lease.pages.items() if p.size}
    in_doubt = 0
    w.pause()
    try:
        h = a.submit(plan, peer)
        time.sleep(0.3)
        t0 = time.monotonic()
        assert plan.abort() is True and plan.state == "aborted"
        t_err = time.monotonic() - t0
        if a.poll(h) == "pending":
            assert plan.src_lease.state == "in_doubt"
            st = src_alloc.stats()
            in_doubt = sum(st[e].in_doubt_pages for e in st)
            _free_and_reuse(src_arena, src_alloc, src_vt, leased)
    finally:
        w.resume()
    try:
        a.wait(h, DEADLINE_S)
    except TransferError:
        pass
    assert a.drain(h, DEADLINE_S)
    a.forget(h)
    got = w.run(W + "kv_arena_bytes")
    wrong = _diff(got, want)
    assert wrong == 0
    leaked = _settled(src_alloc)
    assert leaked == 0 and plan.src_lease.state in ("settled", "released")
    assert w.run(W + "kv_finish_half", "f-1", False) == 0
    src_alloc.check_invariants()
    a.check_invariants()
    _row("abort() mid-flight", name, wrong, leaked, in_doubt, t_err)


@pytest.mark.parametrize("name", ALL)
def test_F12_deadline_before_submit_reclaims_at_once_and_refuses_the_post(name, backend_factory):
    clock = FakeClock()
    src_arena, src_alloc, a, dst_arena, dst_alloc, b = kv_pair(backend_factory, name, clock=clock)
    peer = a.connect(b.metadata())
    svt, dvt = alloc_request(src_alloc, L_TOKENS), alloc_request(dst_alloc, L_TOKENS)
    plan = build_plan("f-2", src_alloc, svt, dst_alloc, dvt, deadline_s=1.0)
    before = tbytes(dst_arena.data)
    clock.now = 2.0
    src_alloc.free(svt["full"], owner="full")
    st = src_alloc.stats()
    assert plan.src_lease.state == "expired" and sum(st[e].pending_pages for e in st) == 0  # reclaimed at once
    t0 = time.monotonic()
    with pytest.raises(LeaseError):
        a.submit(plan, peer)
    t_err = time.monotonic() - t0
    assert tbytes(dst_arena.data) == before
    plan.abort()
    dst_alloc.stats()
    leaked = _settled(src_alloc) + _settled(dst_alloc)
    assert leaked == 0
    src_alloc.check_invariants()
    dst_alloc.check_invariants()
    _row("deadline before submit", name, 0, leaked, 0, t_err)


@pytest.mark.parametrize("name", ALL)
def test_F11_same_plan_submitted_twice_is_refused(name, backend_factory):
    src_arena, src_alloc, a, dst_arena, dst_alloc, b = kv_pair(backend_factory, name)
    peer = a.connect(b.metadata())
    plan = build_plan("f-3", src_alloc, alloc_request(src_alloc, L_TOKENS), dst_alloc,
                      alloc_request(dst_alloc, L_TOKENS))
    want = brute_apply(tbytes(dst_arena.data), dst_arena.base_ptr, tbytes(src_arena.data), src_arena.base_ptr,
                       plan.descriptors())
    h = a.submit(plan, peer)
    t0 = time.monotonic()
    with pytest.raises(UmallocValueError):
        a.submit(plan, peer)  # in flight, or already finished
    t_err = time.monotonic() - t0
    a.wait(h, DEADLINE_S)
    with pytest.raises(UmallocValueError):
        a.submit(plan, peer)  # done: nothing may be posted again
    a.forget(h)
    wrong = _diff(tbytes(dst_arena.data), want)
    assert wrong == 0 and plan.state == "done"
    leaked = _settled(src_alloc) + _settled(dst_alloc)
    assert leaked == 0 and src_alloc.leases_active() == 0 and dst_alloc.leases_active() == 0
    _row("same plan submitted twice", name, wrong, leaked, 0, t_err)


@pytest.mark.parametrize("name", ENGINES)
def test_F12_sender_killed_mid_transfer_the_receiver_learns_and_settles(name, backend_workers, backend_factory):
    """The sender (a worker process) is SIGKILLed right after it submitted: the receiver learns it through
    ``peer_state`` (the process is gone, so its engine can write no more) and settles its published half: the
    pages come free. Every destination byte is either its old value or the transfer's (never another one)."""
    w = worker(backend_workers, name, "victim")
    w.call("reset_backend")
    spec = kv_spec()
    dst_arena, dst_alloc = kv_side(spec, SEED + 1)
    b = backend_factory(name, layout=PeerLayout.from_arena(dst_arena))
    b.register(dst_arena.regions())
    w.run(W + "kv_setup", PeerLayout.from_arena(dst_arena).to_dict(), seed=SEED)
    sender = b.connect(w.call("metadata"))
    me = w.call("connect", b.metadata(), progress=b.progress)  # NIXL's handshake needs this side progressed
    src_vt = w.run(W + "kv_alloc", {"full": L_TOKENS, "draft": L_TOKENS})
    half = build_receiver_half("f-4", dst_alloc, alloc_request(dst_alloc, L_TOKENS))
    wire = half.publish()
    before = tbytes(dst_arena.data)
    assert b.peer_state(sender) == "alive" and b.fail_half_if_peer_died(half, sender) == "alive"
    w.run(W + "kv_send", "f-4", wire, me, src_vt, wait=False, progress=b.progress)
    t0 = time.monotonic()
    w.kill()
    deadline = time.monotonic() + DEADLINE_S
    while b.fail_half_if_peer_died(half, sender) == "alive":
        assert time.monotonic() < deadline, "the receiver never learned that its sender died"
        time.sleep(0.01)
    t_err = time.monotonic() - t0
    assert half.state == "failed" and isinstance(half.error, PeerDiedError)
    assert half.lease.state == "settled"
    got = np.frombuffer(tbytes(dst_arena.data), np.uint8)
    old = np.frombuffer(before, np.uint8)
    changed = np.flatnonzero(got != old)
    inside = np.zeros(got.size, bool)
    st = dst_alloc.stats()
    for end, pages in half.lease.pages.items():
        pb = st[end].page_bytes
        for p in pages.tolist():
            inside[p * pb:(p + 1) * pb] = True
    wrong = int(np.count_nonzero(~inside[changed]))  # a byte outside the half's pages changed
    assert wrong == 0
    b.disconnect(sender)
    leaked = _settled(dst_alloc)
    assert leaked == 0 and dst_alloc.leases_active() == 0
    dst_alloc.check_invariants()
    _row("sender SIGKILL mid-transfer (receiver side)", name, wrong, leaked, 0, t_err)


@pytest.mark.parametrize("name", ALL)
def test_F25_receiver_deregisters_then_the_sender_writes(name, backend_factory):
    """Nothing lands in memory its owner deregistered: ``local`` re-checks the peer's registration at every
    copy (the handle fails); ``nixl`` refuses the deregistration while the sender is connected; ``mooncake``'s
    receiving engine serves writes into its registered buffers only (the write fails, nothing lands)."""
    src_arena, src_alloc, a, dst_arena, dst_alloc, b = kv_pair(backend_factory, name)
    peer = a.connect(b.metadata())
    plan = build_plan("f-5", src_alloc, alloc_request(src_alloc, L_TOKENS), dst_alloc,
                      alloc_request(dst_alloc, L_TOKENS))
    before = tbytes(dst_arena.data)
    t0 = time.monotonic()
    if name == "nixl":
        with pytest.raises(RegistrationError, match="F25"):
            b.deregister(dst_arena.regions())
        t_err = time.monotonic() - t0
        a.disconnect(peer)  # told first: the receiver may deregister now
        b.deregister(dst_arena.regions())
        plan.abort()
        wrong = _diff(tbytes(dst_arena.data), before)
    else:
        b.deregister(dst_arena.regions())
        h = a.submit(plan, peer)
        err = None
        try:
            a.wait(h, DEADLINE_S)
        except TransferError as e:
            err = e
        t_err = time.monotonic() - t0
        a.drain(h, DEADLINE_S)
        a.forget(h)
        wrong = _diff(tbytes(dst_arena.data), before)
        if name == "local":
            assert err is not None and plan.state == "failed"
    assert wrong == 0
    leaked = _settled(src_alloc) + _settled(dst_alloc)
    assert leaked == 0
    _row("receiver deregisters, sender writes", name, wrong, leaked, 0, t_err)


def _two_sides(name, backend_factory, clock):
    src_arena, src_alloc, a, dst_arena, dst_alloc, b = kv_pair(backend_factory, name, clock=clock)
    peer = a.connect(b.metadata())
    plan = build_plan("f-6", src_alloc, alloc_request(src_alloc, L_TOKENS), dst_alloc,
                      alloc_request(dst_alloc, L_TOKENS), deadline_s=5.0)
    return src_arena, dst_arena, src_alloc, dst_alloc, a, peer, plan


@pytest.mark.parametrize("name", ALL)
def test_F10_vectors_submitted_at_different_times_complete_the_plan_only_together(name, backend_factory):
    clock = FakeClock()
    src_arena, dst_arena, src_alloc, dst_alloc, a, peer, plan = _two_sides(name, backend_factory, clock)
    names = list(plan.vectors)
    assert "draft" in names and len(names) >= 2
    first = plan.split([n for n in names if n != "draft"])
    later = plan.split(["draft"])
    with pytest.raises(UmallocValueError, match="per vector"):
        a.submit(plan, peer)
    by_vec = plan.descriptors_by_vector()
    before = tbytes(dst_arena.data)
    want_first = brute_apply(before, dst_arena.base_ptr, tbytes(src_arena.data), src_arena.base_ptr,
                             np.concatenate([by_vec[n] for n in first.names]))
    h = a.submit(first, peer)
    a.wait(h, DEADLINE_S)
    a.forget(h)
    assert first.state == "done" and plan.state == "pending" and plan.missing_vectors() == ["draft"]
    assert plan.src_lease.active and plan.dst_lease.active  # the draft's pages are still held
    assert _diff(tbytes(dst_arena.data), want_first) == 0
    h = a.submit(later, peer)
    a.wait(h, DEADLINE_S)
    a.forget(h)
    want = brute_apply(before, dst_arena.base_ptr, tbytes(src_arena.data), src_arena.base_ptr,
                       np.concatenate([by_vec[n] for n in names]))
    wrong = _diff(tbytes(dst_arena.data), want)
    assert plan.state == "done" and wrong == 0 and not plan.src_lease.active
    leaked = _settled(src_alloc) + _settled(dst_alloc)
    assert leaked == 0 and src_alloc.leases_active() == 0 and dst_alloc.leases_active() == 0
    _row("vectors submitted at different times", name, wrong, leaked, 0, None)


@pytest.mark.parametrize("name", ALL)
def test_F10_a_vector_never_submitted_fails_the_plan_at_its_deadline(name, backend_factory):
    clock = FakeClock()
    src_arena, dst_arena, src_alloc, dst_alloc, a, peer, plan = _two_sides(name, backend_factory, clock)
    first = plan.split([n for n in plan.vectors if n != "draft"])
    later = plan.split(["draft"])
    h = a.submit(first, peer)
    a.wait(h, DEADLINE_S)
    a.forget(h)
    assert plan.check_deadline() is False and plan.state == "pending"
    clock.now = 6.0
    src_alloc.stats()
    dst_alloc.stats()  # the leases are reclaimed (nothing in an engine)
    t0 = time.monotonic()
    assert plan.check_deadline() is True
    t_err = time.monotonic() - t0
    assert plan.state == "failed" and "draft" in str(plan.error)
    with pytest.raises((UmallocValueError, LeaseError)):
        a.submit(later, peer)  # too late: its pages may be reused
    leaked = _settled(src_alloc) + _settled(dst_alloc)
    assert leaked == 0
    _row("vector never submitted", name, 0, leaked, 0, t_err)


@pytest.mark.parametrize("name", ENGINES)
def test_F24_replay_child_that_does_not_answer_keeps_its_half_until_it_is_confirmed_gone(name, monkeypatch):
    """The replay's prefill child is stalled (SIGSTOP) when the parent publishes a receiver half to it: the call
    times out, the half stays pending and held (the child may still write), its lease goes in doubt at the
    deadline instead of being reclaimed, and the freed pages stay pending; ``close`` ends the child and, once it
    is confirmed gone, settles the half: nothing pending, pinned or in doubt is left."""
    from umalloc.backends.worker import WorkerTimeout
    from umalloc.geometry.presets import preset_ends
    from umalloc.geometry.spec import ArenaSpec
    from umalloc_replay.report import PhaseTimer
    from umalloc_replay.single import remote
    from umalloc_replay.single.prefill import alloc_sequence
    from umalloc_replay.trace import TraceRequest
    from umalloc_replay.workload import RequestState

    require_or_skip(name)
    clock = FakeClock()
    spec = ArenaSpec(preset_ends("llama-3.1-8b", page_size=16, draft=False), arena_bytes=64 << 20)
    dec = MultiEndedAllocator(Arena(spec), clock=clock)
    rp = remote.RemotePrefill(name, spec, dec, PhaseTimer(), model="llama-3.1-8b", page_size=16, draft=False,
                              seed=SEED, compaction="lazy", padded=False, transfer_timeout_s=0.2,
                              lease_deadline_s=5.0)
    try:
        vt = alloc_sequence(dec, 40)  # 3 pages of 16 tokens
        monkeypatch.setattr(remote, "CALL_MARGIN_S", 0.3)  # bound the call that times out
        rp.worker.pause()
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeout):
            rp.start(RequestState(TraceRequest(0, 0.0, 40, 1, ())), vt)
        t_err = time.monotonic() - t0
        assert len(rp.kept_halves) == 1
        half = rp.kept_halves[0]
        assert half.state == "pending" and half.lease.state == "active"
        clock.now = 6.0  # the lease deadline passes: in doubt, never reclaimed (the child may still write)
        dec.free(vt)
        st = dec.stats()
        in_doubt = sum(st[e].in_doubt_pages for e in st)
        assert half.lease.state == "in_doubt" and in_doubt == 3
        assert sum(st[e].pending_pages for e in st) == 3
    finally:
        rp.close()
    assert not rp.worker.alive() and rp.kept_halves == []
    assert half.state == "failed" and half.lease.state == "settled"
    leaked = _settled(dec)
    assert leaked == 0 and dec.leases_active() == 0
    dec.check_invariants()
    _row("replay child does not answer (receiver half kept)", name, 0, leaked, in_doubt, t_err)


@pytest.mark.parametrize("stop", ["close", "reset"])
@pytest.mark.parametrize("name", ALL)
def test_F24_backend_close_or_reset_settles_the_halves_published_through_it(name, stop, backend_factory):
    """A receiver half published through the receiving backend (``publish_half``) whose sender's report never
    arrives: the transfer lands, the lease deadline passes (in doubt, never reclaimed) and the request's pages
    stay pending after the free; ``disconnect`` proves nothing. ``close()`` / ``reset()`` — the engine released
    every registration — settle it where that stops every peer's writes (``local``, ``mooncake``); on NIXL,
    whose shared-memory WRITEs land in deregistered memory, it stays in doubt until the sender's report
    (``settle``). A half that completed is not touched."""
    clock = FakeClock()
    src_arena, src_alloc, a, dst_arena, dst_alloc, b = kv_pair(backend_factory, name, clock=clock)
    peer = a.connect(b.metadata())
    halves, wants = [], []
    dvts = [alloc_request(dst_alloc, L_TOKENS) for _ in range(2)]
    for i, dvt in enumerate(dvts):
        half = build_receiver_half(f"h-{i}", dst_alloc, dvt, deadline_s=5.0)
        wire = b.publish_half(half)
        assert b.publish_half(half) == wire  # idempotent
        plan = build_send_plan(f"h-{i}", src_alloc, alloc_request(src_alloc, L_TOKENS), wire, a.peer_layout(peer))
        want = brute_apply(tbytes(dst_arena.data), dst_arena.base_ptr, tbytes(src_arena.data), src_arena.base_ptr,
                           plan.descriptors())
        h = a.submit(plan, peer)
        a.wait(h, DEADLINE_S)
        a.forget(h)
        assert plan.state == "done" and _diff(tbytes(dst_arena.data), want) == 0
        halves.append(half)
        wants.append(want)
    done, lost = halves
    assert done.complete() and done.lease.state in ("released", "settled")  # the sender's report arrived
    assert b.published_halves() == 1
    clock.now = 6.0  # the report of the other one never arrives: its deadline passes
    for owner in ("full", "draft"):
        dst_alloc.free(dvts[1][owner], owner=owner)
    st = dst_alloc.stats()
    in_doubt = sum(st[e].in_doubt_pages for e in st)
    n_leased = sum(p.size for p in lost.lease.pages.values())
    assert lost.state == "pending" and lost.lease.state == "in_doubt" and in_doubt == n_leased > 0
    assert sum(st[e].pending_pages for e in st) == n_leased  # freed, never reusable while in doubt
    a.disconnect(peer)  # the sender forgets the receiver: proves nothing on the receiver's side
    assert lost.lease.state == "in_doubt" and b.published_halves() == 1
    t0 = time.monotonic()
    b.close() if stop == "close" else b.reset()
    t_err = time.monotonic() - t0
    assert b.published_halves() == 0 and done.state == "done"
    if b.fences_peer_writes:
        why = "engine stopped" if stop == "close" else "registrations were released"
        assert lost.state == "failed" and isinstance(lost.error, BackendError) and why in str(lost.error)
    else:
        assert name == "nixl" and lost.state == "pending" and lost.lease.state == "in_doubt"
        st = dst_alloc.stats()
        assert sum(st[e].in_doubt_pages for e in st) == n_leased  # still pinned, never reusable
        lost.settle()  # the sender's report (or its confirmed death) arrives
        assert lost.state == "failed"
    assert lost.lease.state == "settled"
    leaked = _settled(dst_alloc)
    assert leaked == 0 and dst_alloc.leases_active() == 0
    assert _diff(tbytes(dst_arena.data), wants[1]) == 0  # nothing but the transfers' bytes landed
    dst_alloc.check_invariants()
    _row(f"receiver backend {stop}() with a published half in doubt", name, 0, leaked, in_doubt, t_err)


def _one_process_fault(name, backend_factory, fault: str):
    """Sender and receiver backends in this process; one request's plan (5 s leases); right after ``submit``,
    before the engine's terminal report reached the lease, ``fault`` happens: ``"deadline"`` (the clock passes
    the leases' deadlines) or ``"abort"`` (``plan.abort()``). The report is held back by holding the lease
    table's lock meanwhile: Mooncake's sender thread reports (and checks the leases before it posts a queued
    chunk) under it (Note [Lease threading]); ``local`` copies inside ``submit`` and NIXL over loopback may
    finish there too, so nothing is held then.

    A held lease must go in doubt (pages pinned, pending after the free, never reused: the reuser's marker
    never reaches the peer) and settle once the engine let go; every destination byte is its old value or the
    transfer's, all of them the transfer's if the transfer completed; nothing leaks. Returns the matrix row's
    ``(wrong, leaked, in_doubt, t_err)``."""
    clock = FakeClock()
    src_arena, src_alloc, a, dst_arena, dst_alloc, b = kv_pair(backend_factory, name, clock=clock)
    peer = a.connect(b.metadata())
    src_vt = alloc_request(src_alloc, L_TOKENS)
    plan = build_plan("o-1", src_alloc, src_vt, dst_alloc, alloc_request(dst_alloc, L_TOKENS), deadline_s=5.0)
    before = tbytes(dst_arena.data)
    want = brute_apply(before, dst_arena.base_ptr, tbytes(src_arena.data), src_arena.base_ptr, plan.descriptors())
    leased = {e: p.copy() for e, p in plan.src_lease.pages.items() if p.size}
    n_leased = sum(p.size for p in leased.values())
    in_doubt, t_err = 0, None
    with src_alloc.lease_table.lock:
        h = a.submit(plan, peer)
        held = plan.src_lease.engine_holds > 0
        assert held or name != "mooncake"  # its sender thread cannot report without the lock
        t0 = time.monotonic()
        if fault == "deadline":
            clock.now = 6.0
            src_alloc.stats()  # the allocator expires its leases
        elif plan.state == "pending":
            assert plan.abort() is True and plan.state == "aborted"  # at once, whatever the engine holds
        t_err = time.monotonic() - t0
        st = src_alloc.stats()
        in_doubt = sum(st[e].in_doubt_pages for e in st)
        if held:
            assert plan.src_lease.state == "in_doubt" and in_doubt == n_leased
            _free_and_reuse(src_arena, src_alloc, src_vt, leased)
        else:
            assert in_doubt == 0
    err = None
    try:
        a.wait(h, DEADLINE_S)
    except TransferError as e:  # e.g. Mooncake withdrew the queued chunk: its leases were released first (F11)
        err = e
    assert a.drain(h, DEADLINE_S)
    a.forget(h)
    got = np.frombuffer(tbytes(dst_arena.data), np.uint8)
    old, new = np.frombuffer(before, np.uint8), np.frombuffer(want, np.uint8)
    wrong = int(np.count_nonzero((got != old) & (got != new)))
    assert wrong == 0 and (err is not None or got.tobytes() == want)
    assert plan.src_lease.state in ("settled", "released", "expired")
    leaked = _settled(src_alloc) + _settled(dst_alloc)
    assert leaked == 0 and src_alloc.leases_active() == 0 and dst_alloc.leases_active() == 0
    src_alloc.check_invariants()
    dst_alloc.check_invariants()
    return wrong, leaked, in_doubt, (t_err if err is not None or fault == "abort" else None)


@pytest.mark.parametrize("name", ALL)
def test_F24_lease_deadline_before_the_engine_reported_in_one_process(name, backend_factory):
    """The one-process form of the stalled-receiver deadline row (:func:`_one_process_fault`)."""
    _row("lease deadline before the engine's report (1 proc)", name,
         *_one_process_fault(name, backend_factory, "deadline"))


@pytest.mark.parametrize("name", ALL)
def test_F24_abort_before_the_engine_reported_in_one_process(name, backend_factory):
    """The one-process form of the ``abort()`` mid-flight row (:func:`_one_process_fault`)."""
    _row("abort() before the engine's report (1 proc)", name, *_one_process_fault(name, backend_factory, "abort"))


@pytest.mark.parametrize("name", ENGINES)
def test_F12_peer_disconnects_during_wait(name, backend_workers, backend_factory):
    """The receiver (a worker process that stays alive) closes its backend while the sender waits on a transfer
    of about 14 MiB that the engine holds (NIXL: the target is not progressed, so the first WRITE of the fresh
    connection stalls; Mooncake: the receiver is paused, then resumed right before it closes, with most of the
    bytes still to come): ``wait`` returns within the bound — a TransferError that is not a timeout, or done if
    the engine finished before the peer went — the source lease is released once the engine let go, no page leaks,
    and every destination byte is either its old value or the transfer's."""
    import threading

    from umalloc.geometry.spec import ArenaSpec

    spec = ArenaSpec(kv_spec().ends, arena_bytes=32 << 20)
    tokens = 300_000  # 32 + 16 B per token on full and draft: about 14 MiB (SWA: the 8-token window)
    w, src_arena, src_alloc, a, peer = sender_to_worker(backend_workers, backend_factory, name, spec=spec)
    src_vt = alloc_request(src_alloc, tokens)
    half = w.run(W + "kv_receiver_half", "g-1", w.run(W + "kv_alloc", {"full": tokens, "draft": tokens}))
    plan = build_send_plan("g-1", src_alloc, src_vt, half, a.peer_layout(peer))
    before = w.run(W + "kv_arena_bytes")
    want = brute_apply(before, a.peer_layout(peer).arena_base_ptr, tbytes(src_arena.data), src_arena.base_ptr,
                       plan.descriptors())
    went: list[float] = []

    def peer_goes() -> None:
        time.sleep(0.3)
        if name == "mooncake":
            w.resume()
        w.call("close_backend")
        went.append(time.monotonic())

    if name == "nixl":
        w.call("set_progress", False)
    else:
        w.pause()
    goes = threading.Thread(target=peer_goes)
    outcome = "done"
    try:
        h = a.submit(plan, peer)
        goes.start()
        t0 = time.monotonic()
        try:
            a.wait(h, DEADLINE_S)
        except TransferError as e:
            assert not isinstance(e, TransferTimeout), e
            outcome = type(e).__name__
        t_err = time.monotonic() - t0
    finally:
        goes.join(DEADLINE_S)
        w.resume()
    w.call("set_progress", True)
    assert went and t_err < DEADLINE_S  # DEADLINE_S is a hang guard (60 s): the wait ended on the peer's exit
    st = src_alloc.stats()
    in_doubt = sum(st[e].in_doubt_pages for e in st)  # a failed plan whose engine still held a part
    assert a.drain(h, DEADLINE_S)
    a.forget(h)
    assert plan.state == ("done" if outcome == "done" else "failed")
    got = np.frombuffer(w.run(W + "kv_arena_bytes"), np.uint8)
    old, new = np.frombuffer(before, np.uint8), np.frombuffer(want, np.uint8)
    wrong = int(np.count_nonzero((got != old) & (got != new)))
    assert wrong == 0 and (outcome != "done" or got.tobytes() == want)
    leaked = _settled(src_alloc)
    assert leaked == 0 and src_alloc.leases_active() == 0
    a.disconnect(peer)
    w.call("new_backend")
    src_alloc.check_invariants()
    landed = int(np.count_nonzero((got != old) & (got == new)))
    print(f"disconnect during wait on {name}: {outcome} after {t_err:.3f} s; {landed} changed bytes landed")
    _row(f"peer disconnects during wait ({outcome})", name, wrong, leaked, in_doubt,
         t_err if outcome != "done" else None)


@pytest.mark.parametrize("name", ENGINES)
def test_F12_receiver_killed_mid_transfer_fails_the_handle_and_settles(name, backend_workers, backend_factory):
    """The receiver (SIGSTOPped, the transfer in the engine) is SIGKILLed: the handle fails with a
    TransferError within the bound, the source lease settles once the engine reports the part finished, and no
    page of it was reused meanwhile. Runs last (keep it at the end of the file): it kills the shared worker."""
    clock = FakeClock()
    w, src_arena, src_alloc, a, peer, src_vt, plan, want = _sender(name, backend_workers, backend_factory, clock)
    leased = {e: p.copy() for e, p in plan.src_lease.pages.items() if p.size}
    w.pause()
    h = a.submit(plan, peer)
    time.sleep(0.3)
    clock.now = 6.0  # the lease deadline passes too: in doubt, not reclaimed
    st = src_alloc.stats()
    in_doubt = sum(st[e].in_doubt_pages for e in st)
    if a.poll(h) == "pending":
        _free_and_reuse(src_arena, src_alloc, src_vt, leased)
    t0 = time.monotonic()
    w.kill()
    with pytest.raises(TransferError):
        a.wait(h, DEADLINE_S)
    t_err = time.monotonic() - t0
    assert a.drain(h, DEADLINE_S)
    a.forget(h)
    leaked = _settled(src_alloc)
    assert leaked == 0 and plan.src_lease.state in ("settled", "expired", "released")
    a.disconnect(peer)
    src_alloc.check_invariants()
    _row("receiver SIGKILL mid-transfer (sender side)", name, 0, leaked, in_doubt, t_err)
