"""Receiver halves a backend published to its senders, settled when its engine lets go of the memory (F24, F25).

Policy:

* A receiver publishes a :class:`~umalloc.transfer.plan.ReceiverHalf` through the backend its senders write
  with (:meth:`umalloc.backends.base.BackendBase.publish_half`): the half takes its publication hold
  (``half.publish()``), and the backend keeps it until it finished.
* Once its engine released every registration — ``close()`` (the engine stopped), ``reset()`` (every region
  deregistered) — a backend whose deregistration stops every peer's writes (``fences_peer_writes``: ``local``
  re-checks the receiver at every copy, Mooncake's receiving engine serves registered buffers only) settles
  every half still held: the pages are reusable (``half.settle(exc)``: a pending half fails with ``exc``, an
  in-doubt lease settles). NIXL does not fence (a UCX WRITE over shared memory lands in deregistered memory),
  so its halves stay held, and only the sender's report or its confirmed death finishes them. Nothing else
  settles here: ``disconnect`` forgets a peer, but registered memory may still be written until the peer is
  confirmed gone, and a timeout proves nothing.
* Held means: the half is pending, or it finished while its publication hold kept its lease in doubt. Halves
  that finished otherwise (done, or settled) are dropped at the next publication.
* Threading: owned by the backend's thread (like the backend); a half may finish on any thread meanwhile — only
  its ``state`` and its lease's ``in_doubt`` are read here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from umalloc.errors import RegistrationError


def _held(half: Any) -> bool:
    return half.state == "pending" or bool(getattr(half.lease, "in_doubt", False))


class PublishedHalves:
    """The halves one backend published that may still be written (see the module policy)."""

    __slots__ = ("_halves", "_senders")

    def __init__(self) -> None:
        self._halves: list[Any] = []
        self._senders: dict[int, tuple[Any, str]] = {}   # id(half) -> (half, its sender peer), halves held

    def publish(self, half: Any, sender: str | None = None) -> dict:
        """``half.publish()``, and keep ``half`` (with the peer ``sender`` that writes it, if named) until it finished
        or :meth:`forget_all`. Idempotent per half. O(halves held).

        Raises:
            LeaseError, UmallocValueError: from ``half.publish()`` (its lease is no longer active, or the half finished); nothing
                is kept then.
        """
        wire = half.publish()
        kept = [h for h in self._halves if h is not half and _held(h)]
        kept.append(half)
        self._halves = kept
        self._senders = {k: v for k, v in self._senders.items() if _held(v[0])}
        if sender is not None:
            self._senders[id(half)] = (half, sender)
        return wire

    def sender_of(self, half: Any) -> str | None:
        """The sender named when ``half`` was published (``None``: none, or not published here). O(1)."""
        got = self._senders.get(id(half))
        return got[1] if got is not None and got[0] is half else None

    def held(self) -> int:
        """How many published halves may still be written. O(halves kept)."""
        return sum(1 for h in self._halves if _held(h))

    def forget_all(self, exc: BaseException, *, settle: bool) -> int:
        """Forget every half; with ``settle`` (no peer can write the memory any more) settle each one still held
        with ``exc`` first. Returns how many were still held. O(halves kept + their leased pages)."""
        halves, self._halves = self._halves, []
        self._senders.clear()
        held = [h for h in halves if _held(h)]
        if settle:
            for half in held:
                half.settle(exc)
        return len(held)


def check_half_registered(half: Any, lay: Any, registered: Sequence[Any], backend: str) -> None:
    """Raise RegistrationError unless every page of ``half`` lies inside one of the ``registered`` regions of
    backend ``backend`` (named in messages), placed by its PeerLayout ``lay`` (F25: memory the engine never
    registered cannot be fenced by its close). O(pages + regions log regions)."""
    if lay is None:
        raise RegistrationError(f"publish_half: this {backend} backend has no layout (set_layout) to place "
                                f"the half's pages with; allowed a backend built with the receiver's layout")
    if half.layout_digest != lay.digest:
        raise RegistrationError(f"publish_half: the half refers to layout {half.layout_digest[:12]}, this "
                                f"backend's is {lay.digest[:12]}; allowed a half of the memory registered here")
    regions = sorted(registered, key=lambda r: r.base_ptr)
    bases = np.array([r.base_ptr for r in regions], dtype=np.uint64)
    ends = np.array([r.base_ptr + r.nbytes for r in regions], dtype=np.uint64)
    for end, pages in half.pages_by_end().items():
        pb = lay.end(end).page_bytes
        lo = np.uint64(lay.arena_base_ptr) + np.asarray(pages, dtype=np.uint64) * np.uint64(pb)
        i = np.searchsorted(bases, lo, side="right").astype(np.int64) - 1
        ok = (i >= 0) & (lo + np.uint64(pb) <= ends[np.maximum(i, 0)]) if regions else np.zeros(lo.shape, bool)
        if not ok.all():
            bad = int(np.asarray(pages)[np.flatnonzero(~ok)[0]])
            raise RegistrationError(f"publish_half: page {bad} of end {end!r} lies outside every region "
                                    f"registered on this {backend} backend; allowed a half of registered "
                                    f"memory")


__all__ = ["PublishedHalves", "check_half_registered"]
