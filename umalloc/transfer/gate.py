"""The write-completion gate: a transfer plan is posted only once every producer that writes its index vectors has
signalled that it wrote them, never with stale rows.

Policy:

* A :class:`WriteGate` is built with the producers of each index vector name, e.g. ``{"target": ("target",),
  "swa_tail": ("target",), "draft": ("draft",)}``: the target's forward writes the target and SWA-tail pages,
  the drafter's forward the draft pages. A vector the gate does not name needs no producer.
* Per request (the plan's ``request_id``), :meth:`WriteGate.signal` records that a producer wrote that
  request's rows (idempotent).
* :meth:`WriteGate.post` submits a plan at once when every producer of every vector of the plan has signalled;
  otherwise it defers the submission (keeps the callable, returns ``None``) until the :meth:`~WriteGate.signal`
  that completes the set runs it — or, with ``refuse=True``, raises :class:`WriteIncompleteError` naming the
  missing producers per vector and keeps nothing. So a save issued after the target's forward but before the
  drafter's (vLLM #35158) waits for the drafter instead of sending the draft pages' old bytes (F10).
* :meth:`WriteGate.forget` drops a request's signals once its transfer has finished (refused while a post waits).

Threading: one thread (the scheduler's); no locks. Complexity: O(vectors x producers) per call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from umalloc.errors import InvariantError, UmallocValueError, WriteIncompleteError


class WriteGate:
    """Posts a plan only after its vectors' producers signalled (module docstring).

    Args:
        producers: index vector name -> the producers (non-empty names) that must write it.

    Raises:
        UmallocValueError: an empty or non-string producer or vector name.

    >>> gate = WriteGate({"target": ("target",), "draft": ("draft",)})
    >>> sent = []
    >>> gate.post_vectors("r1", ["target", "draft"], lambda: sent.append("r1") or "handle") is None
    True
    >>> gate.signal("r1", "target"), sent
    ([], [])
    >>> gate.signal("r1", "draft"), sent
    (['handle'], ['r1'])
    """

    def __init__(self, producers: Mapping[str, Iterable[str]]) -> None:
        table: dict[str, tuple[str, ...]] = {}
        for vector, names in producers.items():
            got = tuple(names)
            if not isinstance(vector, str) or not vector or any(not isinstance(p, str) or not p for p in got):
                raise UmallocValueError(f"WriteGate: vector {vector!r} with producers {got!r}: allowed non-empty "
                                        "names")
            table[vector] = got
        self.producers = table
        self._signalled: dict[str, set[str]] = {}
        self._waiting: dict[str, tuple[tuple[str, ...], Callable[[], Any]]] = {}
        self.deferred_posts = 0  # posts that had to wait for a producer (cumulative)

    def missing(self, request_id: str, vectors: Iterable[str]) -> dict[str, tuple[str, ...]]:
        """Vector name -> producers that have not signalled for ``request_id`` (only vectors missing some)."""
        done = self._signalled.get(request_id, set())
        out = {}
        for v in vectors:
            lack = tuple(p for p in self.producers.get(v, ()) if p not in done)
            if lack:
                out[v] = lack
        return out

    def post(self, plan: Any, submit: Callable[[], Any], *, refuse: bool = False) -> Any:
        """:meth:`post_vectors` for ``plan`` (its ``request_id`` and the names of its ``vectors``)."""
        return self.post_vectors(str(plan.request_id), list(plan.vectors), submit, refuse=refuse)

    def post_vectors(self, request_id: str, vectors: Iterable[str], submit: Callable[[], Any], *,
                     refuse: bool = False) -> Any:
        """Run ``submit()`` now and return its result if every producer of ``vectors`` signalled for
        ``request_id``; else keep it for the completing :meth:`signal` and return ``None``.

        Raises:
            WriteIncompleteError: ``refuse`` and a producer missing (nothing kept).
            UmallocValueError: a post of ``request_id`` already waits (nothing changes).
        """
        names = tuple(vectors)
        if request_id in self._waiting:
            raise UmallocValueError(f"WriteGate: request {request_id!r} already has a post waiting")
        lack = self.missing(request_id, names)
        if not lack:
            return submit()
        if refuse:
            raise WriteIncompleteError(f"request {request_id!r}: not posted, vectors not yet written: "
                                       + ", ".join(f"{v} (by {', '.join(p)})" for v, p in lack.items()), lack)
        self._waiting[request_id] = (names, submit)
        self.deferred_posts += 1
        return None

    def signal(self, request_id: str, producer: str) -> list[Any]:
        """Record that ``producer`` wrote ``request_id``'s rows; returns the results of the posts this completes
        (``[]`` or one). Idempotent.

        Raises:
            UmallocValueError: ``producer`` produces no vector of this gate (nothing changes).
        """
        if not any(producer in ps for ps in self.producers.values()):
            raise UmallocValueError(f"WriteGate: producer {producer!r}: allowed one of "
                                    f"{sorted({p for ps in self.producers.values() for p in ps})}")
        self._signalled.setdefault(request_id, set()).add(producer)
        waiting = self._waiting.get(request_id)
        if waiting is None or self.missing(request_id, waiting[0]):
            return []
        del self._waiting[request_id]
        return [waiting[1]()]

    def waiting(self) -> list[str]:
        """Request ids whose post waits for a producer."""
        return list(self._waiting)

    def forget(self, request_id: str) -> None:
        """Drop ``request_id``'s signals (its transfer finished). Raises :class:`UmallocValueError` while its post
        waits (nothing changes)."""
        if request_id in self._waiting:
            raise UmallocValueError(f"WriteGate: request {request_id!r} has a post waiting; signal its producers "
                                    "first")
        self._signalled.pop(request_id, None)

    def check_invariants(self) -> None:
        """Every waiting post still misses a producer (a complete one would have been submitted). O(waiting)."""
        for rid, (names, _submit) in self._waiting.items():
            if not self.missing(rid, names):
                raise InvariantError(f"WriteGate: request {rid!r} waits although every producer signalled")


__all__ = ["WriteGate"]
