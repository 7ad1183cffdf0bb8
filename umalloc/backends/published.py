"""Receiver halves a backend published to its senders, settled when its engine lets go of the memory (F24, F25).

Policy:

* A receiver publishes a :class:`~umalloc.transfer.plan.ReceiverHalf` through the backend its senders write
  with (:meth:`umalloc.backends.base.BackendBase.publish_half`): the half takes its publication hold
  (``half.publish()``), and the backend keeps it until it ended.
* The backend settles every half still held once its engine released every registration — ``close()`` (the
  engine stopped), ``reset()`` (every region deregistered): no sender can write memory this engine no longer
  has registered, so the pages are reusable (``half.settle(exc)``: a pending half fails with ``exc``, an
  in-doubt lease settles). Nothing else settles here: ``disconnect`` forgets a peer, but memory that is still
  registered may still be written until the peer is confirmed gone, and a timeout proves nothing.
* Held means: the half is pending, or it ended while its publication hold kept its lease in doubt. Halves
  that ended otherwise (done, or settled) are dropped at the next publication.
* Threading: owned by the backend's thread (like the backend); a half may end on any thread meanwhile — only
  its ``state`` and its lease's ``in_doubt`` are read here.
"""

from __future__ import annotations

from typing import Any


def _held(half: Any) -> bool:
    return half.state == "pending" or bool(getattr(half.lease, "in_doubt", False))


class PublishedHalves:
    """The halves one backend published that may still be written (see the module policy)."""

    __slots__ = ("_halves",)

    def __init__(self) -> None:
        self._halves: list[Any] = []

    def publish(self, half: Any) -> dict:
        """``half.publish()``, and keep ``half`` until it ended or :meth:`settle_all`. Idempotent per half.
        O(halves held).

        Raises:
            LeaseError, UmallocValueError: from ``half.publish()`` (its lease ended, or the half ended); nothing
                is kept then.
        """
        wire = half.publish()
        kept = [h for h in self._halves if h is not half and _held(h)]
        kept.append(half)
        self._halves = kept
        return wire

    def held(self) -> int:
        """How many published halves may still be written. O(halves kept)."""
        return sum(1 for h in self._halves if _held(h))

    def settle_all(self, exc: BaseException) -> int:
        """Settle every half still held with ``exc`` (the engine let go of the memory it was published in) and
        forget every half. Returns how many were settled. O(halves kept + their leased pages)."""
        halves, self._halves = self._halves, []
        held = [h for h in halves if _held(h)]
        for half in held:
            half.settle(exc)
        return len(held)


__all__ = ["PublishedHalves"]
