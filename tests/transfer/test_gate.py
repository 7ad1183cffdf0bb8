"""The write-completion gate (:class:`umalloc.WriteGate`): a post waits for every producer of the plan's vectors,
is refused with the missing producers when the caller asks, and a refused or bad call changes nothing (F29)."""

from __future__ import annotations

import pytest

from umalloc import UmallocValueError, WriteGate
from umalloc.errors import WriteIncompleteError

PRODUCERS = {"target": ("target",), "swa_tail": ("target",), "draft": ("draft",)}


def test_a_post_waits_for_the_last_producer_and_runs_once() -> None:
    gate = WriteGate(PRODUCERS)
    sent: list[str] = []
    assert gate.post_vectors("r", ["target", "swa_tail", "draft"], lambda: sent.append("r") or "h") is None
    assert gate.waiting() == ["r"] and gate.deferred_posts == 1
    assert gate.signal("r", "target") == [] and sent == []
    assert gate.signal("r", "draft") == ["h"] and sent == ["r"]
    assert gate.signal("r", "draft") == [] and sent == ["r"]  # idempotent: nothing posts twice
    assert gate.waiting() == []
    gate.check_invariants()


def test_a_complete_request_posts_at_once_and_a_vector_without_producers_needs_none() -> None:
    gate = WriteGate(PRODUCERS)
    gate.signal("r", "target")
    assert gate.post_vectors("r", ["target", "swa_tail", "state"], lambda: 7) == 7
    assert gate.deferred_posts == 0


def test_refuse_names_the_missing_producers_and_keeps_nothing() -> None:
    gate = WriteGate(PRODUCERS)
    gate.signal("r", "target")
    with pytest.raises(WriteIncompleteError) as info:
        gate.post_vectors("r", ["target", "draft"], lambda: pytest.fail("submitted"), refuse=True)
    assert info.value.missing == {"draft": ("draft",)} and "draft (by draft)" in str(info.value)
    assert gate.waiting() == [] and gate.deferred_posts == 0
    assert gate.signal("r", "draft") == []  # nothing was kept to post


def test_bad_calls_change_nothing() -> None:
    gate = WriteGate(PRODUCERS)
    assert gate.post_vectors("r", ["draft"], lambda: 1) is None
    with pytest.raises(UmallocValueError, match="already has a post waiting"):
        gate.post_vectors("r", ["draft"], lambda: 2)
    with pytest.raises(UmallocValueError, match="producer 'verifier'"):
        gate.signal("r", "verifier")
    with pytest.raises(UmallocValueError, match="has a post waiting"):
        gate.forget("r")
    assert gate.waiting() == ["r"] and gate.signal("r", "draft") == [1]
    gate.forget("r")
    assert gate.missing("r", ["draft"]) == {"draft": ("draft",)}  # forgotten: a reused id starts clean (F02)
    with pytest.raises(UmallocValueError):
        WriteGate({"draft": ("",)})
