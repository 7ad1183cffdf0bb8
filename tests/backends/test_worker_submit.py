"""``BackendWorker.submit`` / ``poll`` / ``result`` / ``discard``: a request sent to the child without waiting
(Note [Submitted requests] of :mod:`umalloc.backends.worker`).

Ordering is made by the test, never by a clock: a submitted request blocks in the child until the test creates
a file (``kv_worker:echo_when``). The ``local`` backend serves (no engine needed); the child is real.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from umalloc import BackendError, UmallocValueError
from umalloc.backends.worker import BackendWorker, WorkerDied

W = "kv_worker:"


@pytest.fixture(scope="module")
def worker():
    w = BackendWorker("local")
    w.wait_ready(timeout_s=120)
    yield w
    w.close()


def test_a_submitted_request_is_answered_later_and_a_call_meanwhile_keeps_its_reply(worker, tmp_path: Path) -> None:
    gate = tmp_path / "go"
    seq = worker.submit(W + "echo_when", str(gate), {"rid": 7})
    assert worker.poll(seq) is False          # the child waits for the gate: no reply, and poll did not block
    with pytest.raises(BackendError, match="no reply"):
        worker.result(seq)                    # nothing taken before it arrived
    gate.touch()
    # a blocking call is answered after the submitted request (one at a time, in order): its reply is kept
    assert worker.call("stats", timeout_s=60) is not None
    assert worker.poll(seq) is True
    assert worker.result(seq) == {"rid": 7}
    with pytest.raises(BackendError, match="not a submitted request"):
        worker.poll(seq)                      # taken: no longer awaited


def test_replies_come_back_in_order_and_an_error_comes_back_typed(worker, tmp_path: Path) -> None:
    gate = tmp_path / "go"
    gate.touch()
    seqs = [worker.submit(W + "echo_when", str(gate), i) for i in range(3)]
    bad = worker.submit(W + "refuse", "no room for request 9")
    assert worker.poll(bad, timeout_s=60) is True   # the last one answered: every earlier one is kept too
    assert all(worker.poll(s) for s in seqs) and [worker.result(s) for s in seqs] == [0, 1, 2]
    with pytest.raises(UmallocValueError, match="no room for request 9"):
        worker.result(bad)


def test_a_discarded_request_drops_its_reply(worker, tmp_path: Path) -> None:
    gate = tmp_path / "go"
    seq = worker.submit(W + "echo_when", str(gate), "late")
    worker.discard(seq)
    worker.discard(seq)                               # idempotent
    gate.touch()
    assert worker.call("stats", timeout_s=60) is not None   # the discarded reply arrived before this one: dropped
    with pytest.raises(BackendError, match="not a submitted request"):
        worker.poll(seq)


def test_a_killed_child_fails_the_poll_with_worker_died(tmp_path: Path) -> None:
    w = BackendWorker("local")
    try:
        seq = w.submit(W + "echo_when", str(tmp_path / "never"), 1)
        os.kill(w.pid, signal.SIGKILL)
        w.process.join(60)                            # wait on its state, not on a clock
        with pytest.raises(WorkerDied):
            w.poll(seq)
        with pytest.raises(WorkerDied):
            w.submit(W + "echo_when", str(tmp_path / "never"), 2)
    finally:
        w.close()
