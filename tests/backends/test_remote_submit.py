"""The replay's prefill child started asynchronously: ``RemotePrefill.submit`` / ``arrived`` / ``close`` over real
NIXL and Mooncake (module docstring of :mod:`umalloc_replay.single.remote`).

Oracle: the synchronous path (``start`` + ``finish_all``) of the same child for the same request sizes; the
decode allocator's own lease count. Ordering is made by the test (SIGSTOP, SIGKILL), never by a clock.
"""

from __future__ import annotations

import os
import signal

import pytest

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.geometry.arena import Arena
from umalloc.testing import require_or_skip, seed_from_env

SEED = seed_from_env(0)
REMOTE = [pytest.param("nixl", marks=pytest.mark.backend), pytest.param("mooncake", marks=pytest.mark.backend)]
SIZES = (40, 17, 64)   # prompt tokens of the three requests


def _prefill(name: str):  # type: ignore[no-untyped-def]
    from umalloc.geometry.presets import preset_ends
    from umalloc.geometry.spec import ArenaSpec
    from umalloc_replay.report import PhaseTimer
    from umalloc_replay.single.remote import RemotePrefill

    require_or_skip(name)
    spec = ArenaSpec(preset_ends("llama-3.1-8b", page_size=16, draft=False), arena_bytes=64 << 20)
    dec = MultiEndedAllocator(Arena(spec))
    rp = RemotePrefill(name, spec, dec, PhaseTimer(), model="llama-3.1-8b", page_size=16, draft=False, seed=SEED,
                       compaction="lazy", padded=False, transfer_timeout_s=30.0, lease_deadline_s=None)
    return rp, dec


def _request(rid: int, tokens: int):  # type: ignore[no-untyped-def]
    from umalloc_replay.trace import TraceRequest
    from umalloc_replay.workload import RequestState

    return RequestState(TraceRequest(rid, 0.0, tokens, 1, ()))


@pytest.mark.parametrize("name", REMOTE)
def test_submitted_requests_arrive_in_order_with_the_synchronous_paths_figures_as_allowed(name: str) -> None:
    from umalloc_replay.single.prefill import alloc_sequence

    rp, dec = _prefill(name)
    try:
        vts = [alloc_sequence(dec, n) for n in SIZES]
        sync = rp.finish_all([rp.start(_request(i, n), vt) for i, (n, vt) in enumerate(zip(SIZES, vts, strict=True))])
        for i, (n, vt) in enumerate(zip(SIZES, vts, strict=True)):
            rp.submit(_request(10 + i, n), vt)
        assert rp.in_flight() == [10, 11, 12] and dec.leases_active() == 3   # each half leased until it arrives
        got = []
        while rp.in_flight():
            got += rp.arrived(wait_s=1.0)
        assert [a.request_id for a in got] == [10, 11, 12]
        assert [a.figures for a in got] == sync and all(a.extra is None for a in got)
        assert dec.leases_active() == 0 and rp.leases_active() == 0
        # a request outside ``allowed`` stays in flight and leased, and so does every one behind it
        for i, (n, vt) in enumerate(zip(SIZES[:2], vts, strict=False)):
            rp.submit(_request(20 + i, n), vt)
        assert rp.arrived(allowed=[21], wait_s=1.0) == []
        assert rp.in_flight() == [20, 21] and dec.leases_active() == 2
        while rp.in_flight():
            got += rp.arrived(allowed=[20, 21], wait_s=1.0)
        assert [a.request_id for a in got[3:]] == [20, 21] and dec.leases_active() == 0
        rp.check_invariants()
        dec.check_invariants()
    finally:
        rp.close()
    assert rp.kept_halves == []


@pytest.mark.parametrize("name", REMOTE)
def test_a_child_killed_with_requests_in_flight_settles_every_half(name: str) -> None:
    from umalloc.backends.worker import WorkerDied
    from umalloc_replay.single.prefill import alloc_sequence

    rp, dec = _prefill(name)
    try:
        rp.worker.pause()                      # it cannot answer: both requests are still in flight when it dies
        for i, n in enumerate(SIZES[:2]):
            rp.submit(_request(i, n), alloc_sequence(dec, n))
        os.kill(rp.worker.pid, signal.SIGKILL)
        rp.worker.process.join(60)
        with pytest.raises(WorkerDied):
            rp.arrived(wait_s=1.0)
        assert rp.in_flight() == [] and rp.kept_halves == [] and dec.leases_active() == 0
    finally:
        rp.close()
    dec.check_invariants()


@pytest.mark.parametrize("name", REMOTE)
def test_close_with_requests_in_flight_settles_them_once_the_child_is_gone(name: str) -> None:
    from umalloc_replay.single.prefill import alloc_sequence

    rp, dec = _prefill(name)
    try:
        for i, n in enumerate(SIZES):
            rp.submit(_request(i, n), alloc_sequence(dec, n))
    finally:
        rp.close()
    assert not rp.worker.alive() and rp.in_flight() == [] and rp.kept_halves == []
    assert dec.leases_active() == 0
    dec.check_invariants()
