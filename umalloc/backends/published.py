"""Receiver halves a backend published to its senders, settled when its engine lets go of the memory (F24, F25).

Policy:

* A receiver publishes a :class:`~umalloc.transfer.plan.ReceiverHalf` through the backend its senders write
  with (:meth:`umalloc.backends.base.BackendBase.publish_half`): the half takes its publication hold
  (``half.publish()``), and the backend keeps it until it ended.
* Once its engine released every registration — ``close()`` (the engine stopped), ``reset()`` (every region
  deregistered) — a backend whose deregistration stops every peer's writes (``fences_peer_writes``: ``local``
  re-checks the receiver at every copy, Mooncake's receiving engine serves registered buffers only) settles
  every half still held: the pages are reusable (``half.settle(exc)``: a pending half fails with ``exc``, an
  in-doubt lease settles). NIXL does not fence (a UCX WRITE over shared memory lands in deregistered memory),
  so its halves stay held, and only the sender's report or its confirmed death ends them. Nothing else
  settles here: ``disconnect`` forgets a peer, but registered memory may still be written until the peer is
  confirmed gone, and a timeout proves nothing.
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
        """``half.publish()``, and keep ``half`` until it ended or :meth:`end_all`. Idempotent per half.
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

    def end_all(self, exc: BaseException, *, settle: bool) -> int:
        """Forget every half; with ``settle`` (no peer can write the memory any more) settle each one still held
        with ``exc`` first. Returns how many were still held. O(halves kept + their leased pages)."""
        halves, self._halves = self._halves, []
        held = [h for h in halves if _held(h)]
        if settle:
            for half in held:
                half.settle(exc)
        return len(held)


__all__ = ["PublishedHalves"]
