"""The prefill side of ``umalloc generate --decode cb`` as an asynchronous feed: a request is handed over and the
decode loop learns, between its steps, which requests' KV has landed.

Policy:

* The interface (:class:`PrefillFeed`): ``submit(request, decode vtokens)`` returns at once; ``in_flight()``
  lists what was submitted and not reported yet; ``arrived(allowed, wait_s)`` reports finished requests (each an
  :class:`~umalloc_replay.single.prefill.Arrival` whose ``extra`` is :func:`arrival_extra`'s dict), in
  submission order, up to the first one outside ``allowed``. NIXL and Mooncake:
  :class:`~umalloc_replay.single.remote.RemotePrefill` itself (the child prefills, plans, posts and waits while
  this process decodes). ``local``: :class:`LocalFeed`.
* :class:`LocalFeed` runs each prompt's prefill forward on one worker thread (Note [Local prefill on a thread]);
  once a forward is done, this thread allocates, fills, plans and submits over the local backend
  (:class:`~umalloc_replay.single.prefill.LocalPrefill`, whose allocators are single-threaded), then runs
  ``on_started`` (the late drafter), and reports the request once its transfer finished.

Note [Local prefill on a thread]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With the local backend the prefill forward runs in the decode process. A whole prompt's forward between two
decode steps stalls the running batch for the forward's duration (Gemma-3-270M's longer prompts: several steps).
Two ways keep the stall to about one step: chunking the forward (a part of the prompt per gap between steps, the
KV of earlier chunks as its cache) or running the forward on a second thread while the decode loop keeps
stepping. The thread is used: a chunked forward computes the KV only up to float reordering (its attention and
matmuls see other shapes), and the one-process reference is one forward, so its tokens could differ; the thread
runs the reference's very forward. torch releases the GIL inside each op and runs it on the calling thread (one
intra-op thread each), so the forward and the decode steps share the cores; the allocators, the plan and the
backend stay on the decode thread (the worker thread touches only the model and the prompt, and its result,
:meth:`~umalloc_replay.generate.kv.ModelKV.forward`, is adopted on the decode thread), and while a batch runs
one finished forward is planned and posted per gap. Measured (``umalloc generate``, Gemma-3-270M, 8 requests, the
shared 2-core CPU at load 4-8): longest stall 0.26 median steps (104 ms against 394 ms steps), every token
equal to one process; but the steps run beside the forward, so PD decode tokens/s is 0.85x the one-process
continuous batching run's (NIXL and Mooncake, whose forward runs in the second process: 1.04x, and 0.88x to
0.98x). A chunked forward would put the prefill's time in the gaps between steps instead; it is not built.

Threading: ``submit``/``arrived``/``close`` on the decode loop's thread; the forwards on one worker thread.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from umalloc_replay.single.prefill import Arrival, LocalPrefill
from umalloc_replay.workload import RequestState


class PrefillFeed(Protocol):
    """An asynchronous prefill side (module docstring)."""

    def submit(self, rs: RequestState, dst_vtokens: torch.Tensor | dict[str, torch.Tensor]) -> None: ...

    def in_flight(self) -> list[int]: ...

    def arrived(self, allowed: Collection[int] | None = None, wait_s: float = 0.0) -> list[Arrival]: ...


def arrival_extra(outputs: dict[int, dict], weights_digest: str, prefill_s: float) -> dict:
    """What rides an arrival of ``umalloc generate``: ``{"outputs": {rid: {"first_token", "digests"}},
    "weights_digest", "prefill_s"}`` (the prefill side's seconds of prefill forwards so far)."""
    return {"outputs": outputs, "weights_digest": weights_digest, "prefill_s": prefill_s}


@dataclass
class _Entry:
    rs: RequestState
    vt: torch.Tensor | dict[str, torch.Tensor]
    future: cf.Future
    started: bool = False
    ticket: Any = None


class LocalFeed:
    """:class:`PrefillFeed` over a :class:`~umalloc_replay.single.prefill.LocalPrefill` whose pattern is ``kv``
    (a :class:`~umalloc_replay.generate.kv.ModelKV`): forwards on one worker thread (Note [Local prefill on a
    thread]), everything else on the caller's thread.

    Args:
        prefill: the local prefill side. kv: its pattern. weights_digest: this process's weights digest.
        on_started: ``on_started(request_id, ticket)`` after a request's plan was submitted (the late drafter).
    """

    def __init__(self, prefill: LocalPrefill, kv: Any, weights_digest: str,
                 on_started: Callable[[int, Any], None] | None = None) -> None:
        self.prefill, self.kv, self.weights_digest, self.on_started = prefill, kv, weights_digest, on_started
        self.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="umalloc-prefill")
        self._q: deque[_Entry] = deque()

    def submit(self, rs: RequestState, dst_vtokens: torch.Tensor | dict[str, torch.Tensor]) -> None:
        """Queue ``rs``'s prefill forward on the worker thread; returns at once. O(1)."""
        self._q.append(_Entry(rs, dst_vtokens, self.pool.submit(self.kv.forward, rs.rid)))

    def in_flight(self) -> list[int]:
        """Submitted requests not reported yet, in submission order."""
        return [e.rs.rid for e in self._q]

    def _advance(self, most: int | None) -> None:
        """Plan and submit the requests whose forward is done (the worker runs them in order), at most ``most``
        (``None``: all)."""
        for e in self._q:
            if e.started:
                continue
            if not e.future.done() or most == 0:
                break
            most = None if most is None else most - 1
            self.kv.adopt(e.rs.rid, *e.future.result())   # the forward's error, if any, is raised here
            e.ticket = self.prefill.start(e.rs, e.vt)
            e.started = True
            if e.ticket is not None and self.on_started is not None:
                self.on_started(e.rs.rid, e.ticket)

    def arrived(self, allowed: Collection[int] | None = None, wait_s: float = 0.0) -> list[Arrival]:
        """Requests whose transfer finished, in submission order, up to the first outside ``allowed`` (``None``:
        any); waits up to ``wait_s`` seconds for the first one's forward. With ``wait_s`` 0 (a batch is running)
        one finished forward is planned and posted per call (the gap between two steps holds one); otherwise
        every finished one. A request short of prefill room comes back with ``figures`` None (nothing sent).
        Raises the forward's or the transfer's error."""
        if wait_s > 0 and self._q and not self._q[0].started:
            cf.wait([self._q[0].future], timeout=wait_s)
        self._advance(None if wait_s > 0 else 1)
        out: list[Arrival] = []
        while self._q and self._q[0].started and (allowed is None or self._q[0].rs.rid in allowed):
            e = self._q.popleft()
            rid = e.rs.rid
            if e.ticket is None:
                out.append(Arrival(rid, None, None))
                continue
            figures = self.prefill.finish_all([e.ticket])[0]
            out.append(Arrival(rid, figures, arrival_extra(self.kv.outputs([rid]), self.weights_digest,
                                                           self.kv.prefill_s)))
        return out

    def close(self) -> None:
        """Stop the worker thread (a forward under way is waited for; queued ones are dropped). Idempotent."""
        self.pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["LocalFeed", "PrefillFeed", "arrival_extra"]
