"""The decode side of ``umalloc generate``: transformers' continuous batching on the umalloc integration,
attending over the received KV in place.

Policy:

* The decode engine is :class:`~umalloc.integrations.transformers.admit.DecodeEngine` over its own copy of the
  model (the engine switches the copy to paged attention); its cache's allocator is the transfer's receiving
  side, so the prefill side's plan writes each prompt's KV straight into the pages the engine's attention reads
  (Note [Admission seam] of :mod:`umalloc.integrations.transformers.admit`); a model with sliding layers gets
  its window tail into its rings (Note [Ring landing] there: destination ids per end from ``reserve_ends``).
* Admission: while requests wait and fewer than ``max_batch`` requests are in the batch or in flight, the next
  request's pages are reserved in the cache (a request that finds no room waits for a running one to finish: its
  KV is not sent before its pages exist) and it is handed to the prefill side without waiting
  (:mod:`umalloc_replay.generate.feed`: the prefill side computes, plans and posts while this side decodes).
  Between two engine steps the loop asks which requests' transfers finished (never blocking while requests
  run); each such request's pages are digested (read in place, compared with the prefill side's digest) and it
  is admitted into the running batch with its prompt computed and the prefill's first token — each as soon as
  its own transfer finished, no round waited for. Then the engine runs one step (one forward over every running
  request). With nothing running, the loop waits for the next arrival.
* Decoded tokens are every token after the prefill's first; "decode compute" is the seconds of the engine's
  steps, its memory-layer share the cache's own counter.

Threading: the caller's thread only.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from umalloc import InvariantError, UmallocValueError
from umalloc_replay.trace import TraceRequest
from umalloc_replay.workload import RequestState


def cb_min_page_size() -> int:
    """The smallest page (tokens) transformers' continuous batching accepts (its ``page_size`` bound, checked when
    it builds its cache), 1 where the installed release has none. O(1)."""
    try:
        from transformers.generation.continuous_batching.initialization import BOUNDS
    except ImportError:
        return 1
    return int(BOUNDS.get("page_size", (1,))[0])


def engine_for(model: Any, reqs: list[TraceRequest], page_size: int, max_batch: int, check: bool = False,
               draft_layers: int = 0, num_blocks: int | None = None, speculative_tokens: int = 0) -> Any:
    """A :class:`~umalloc.integrations.transformers.admit.DecodeEngine` over a copy of ``model`` whose cache
    holds the ``max_batch`` (at most ``len(reqs)``) longest requests (prompt and output) at once, twice over; greedy, no end-of-sequence
    stop, no prefix sharing (a finished request frees its pages). ``check``: invariants after every step.
    ``draft_layers``: the cache's arena has a ``draft`` end of that many layers (an early-exit drafter's KV,
    Note [Draft end] of :mod:`umalloc.integrations.transformers.speculate`). ``num_blocks``: the cache's pages
    instead (a decode arena under pressure: the cache compacts at every step). ``speculative_tokens``: the
    draft tokens of the speculative rounds the engine will run (its sliding rings are built to roll them back,
    Note [Sliding ring] of :mod:`umalloc.integrations.transformers.rings`, and one forward holds a round of
    every request in the batch); 0: none.

    Raises:
        UmallocValueError: the cache refuses the model (the integration's typed error, reworded), or its
            ``num_blocks`` pages need more bytes than transformers finds available (its ``MemoryError``,
            reworded naming ``--decode-blocks``).
    """
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from umalloc.integrations.transformers import CacheOptions, UnsupportedCacheError
    from umalloc.integrations.transformers.admit import DecodeEngine

    max_batch = min(max_batch, len(reqs))   # never more requests in the engine at once than there are
    big = sorted(reqs, key=lambda r: r.input_tokens + r.output_tokens, reverse=True)[:max_batch]
    blocks = num_blocks or 2 * sum(-(-(r.input_tokens + r.output_tokens) // page_size) + 1 for r in big)
    gcfg = transformers.GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                         max_new_tokens=max(r.output_tokens for r in reqs))
    cbcfg = ContinuousBatchingConfig(page_size=page_size, num_blocks=blocks, max_batch_tokens=max(64, max_batch * (speculative_tokens + 1)),
                                     use_async_batching=False, auto_switch_to_flash=False, allow_block_sharing=False,
                                     max_memory_percent=0.9)
    cb_log = logging.getLogger("ContinuousBatchingLogger")
    level = cb_log.level
    cb_log.setLevel(logging.CRITICAL)  # its CPU-memory notes (psutil) do not concern a cache sized in blocks
    try:
        return DecodeEngine(copy.deepcopy(model), gcfg, cbcfg,
                            CacheOptions(check_every_step=check, draft_layers=draft_layers,
                                         compact_every_step=num_blocks is not None,
                                         speculative_tokens=speculative_tokens))
    except UnsupportedCacheError as exc:
        raise UmallocValueError(f"the decode side: {exc}") from exc
    except MemoryError as exc:
        given = f"--decode-blocks {num_blocks}" if num_blocks is not None else f"--max-batch {max_batch}"
        raise UmallocValueError(f"{given}: a decode cache of {blocks} pages of {page_size} tokens with batches of "
                                f"up to {cbcfg.max_batch_tokens} tokens does not fit in this machine's memory "
                                f"({exc}); allowed fewer --decode-blocks or a smaller --max-batch") from exc
    finally:
        cb_log.setLevel(level)


def received_digests(cache: Any, vtokens: dict[str, torch.Tensor], prompt_tokens: int) -> dict[str, str]:
    """Per end, the blake2b digest of the pages a plan wrote for a ``prompt_tokens``-token prompt into
    ``vtokens`` (:meth:`~umalloc.integrations.transformers.admit.DecodeEngine.reserve_ends`), in sequence-page
    order (``full`` and ``draft``: every page; ``swa``: the window tail's, ring and staging pages): what the prefill side's
    :class:`~umalloc_replay.generate.kv.ModelKV` digested of what it wrote. Read in place. O(pages)."""
    from umalloc.geometry.spec import swa_tail_start
    from umalloc_replay.generate.kv import digest_pages

    ps = cache.page_size
    out = {}
    for end in cache.alloc.spec.end_names:
        vt = vtokens[cache.alloc.owner_of(end)] if end not in vtokens else vtokens[end]
        lo = swa_tail_start(prompt_tokens, cache.window, 0, ps) if end == "swa" else 0
        vpages = torch.div(vt[lo:prompt_tokens:ps], ps, rounding_mode="floor")
        out[end] = digest_pages(cache.arena, end, cache.alloc.translate_pages(vpages, end))
    return out


@dataclass
class InPlaceResult:
    """What the in-place decode produced: tokens per request, figures per request, digests that differed, the
    transfers' figures, decode seconds and the cache's memory-layer seconds, requests per step. ``step_log``: per
    engine step, the requests in the engine and the requests submitted and not admitted then (transfers in
    flight); ``admitted_at``: request -> steps taken before its admission."""

    generated: dict[int, list[int]] = field(default_factory=dict)
    digest_bad: list[int] = field(default_factory=list)
    figures: list[Any] = field(default_factory=list)
    decode_s: float = 0.0
    memory_s: float = 0.0
    digest_s: float = 0.0   # reading the received pages in place and digesting them (the transfer check)
    weights_ok: bool = True
    prefill_child_s: float = 0.0
    step_requests: list[int] = field(default_factory=list)
    ttft_s: dict[int, float] = field(default_factory=dict)
    itl_s: list[float] = field(default_factory=list)
    stamps: dict[int, dict[str, float]] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    stalls_s: list[float] = field(default_factory=list)
    steps_in_flight: int = 0
    pages_moved_in_flight: int = 0
    waits_for_room: int = 0
    pages_moved: int = 0
    step_log: list[tuple[frozenset[int], int]] = field(default_factory=list)
    admitted_at: dict[int, int] = field(default_factory=dict)


#: Seconds one wait for an arrival lasts while nothing runs (the loop then checks again).
ARRIVAL_WAIT_S = 0.05


def decode_in_place(engine: Any, feed: Any, reqs: list[TraceRequest], prompts: dict[int, list[int]], weights: str,
                    max_batch: int, on_done: Callable[[int], None] | None = None, stepper: Any = None,
                    budget_pages: int | None = None, steps_in_flight: int = 1) -> InPlaceResult:
    """Run every request of ``reqs`` through ``feed`` into ``engine`` and decode them in one continuous batch
    (module docstring). ``feed``: the asynchronous prefill side (:class:`~umalloc_replay.generate.feed.PrefillFeed`;
    each arrival's ``extra`` is :func:`~umalloc_replay.generate.feed.arrival_extra`'s dict); ``weights`` is this
    side's weights digest. ``on_done(rid)`` runs when a request finished. ``stepper``: an object whose ``step()``
    replaces the engine's (a :class:`~umalloc.integrations.transformers.speculate.SpeculativeDecoder`). The digest
    of every end the prefill side wrote (``full``, ``swa``, and ``draft`` with an early-exit drafter) is
    compared, read in place. ``budget_pages``: the cache's pages when it is smaller than the load; a request is
    then reserved only when the lifetimes (prompt and output pages) of the requests in the engine and its own
    fit them, so a running request never starves for a page. ``steps_in_flight``: the fewest steps the running
    batch takes between a request's submission and its admission (its transfer is collected only then); with
    nothing running, the first request in flight is waited for.

    Raises:
        InvariantError: the decode arena cannot hold one request with no other running, a request failed in the
            engine, or a prefill arena was short.
    """
    res = InPlaceResult()
    cache = engine.cache
    ps = cache.page_size
    waiting = deque(reqs)
    t_run = time.perf_counter()
    last_tok: dict[int, float] = {}
    t_step_end: float | None = None
    committed: dict[int, int] = {}   # request -> pages of its prompt and output (with budget_pages)
    held: dict[int, tuple[TraceRequest, dict[str, torch.Tensor]]] = {}   # submitted, not admitted yet
    sent_at: dict[int, int] = {}   # request -> steps taken when it was submitted
    steps = 0

    def lifetime(r: TraceRequest) -> int:
        return -(-(r.input_tokens + r.output_tokens) // ps)

    def stamp(rid: int, what: str) -> None:
        res.stamps.setdefault(rid, {"queued": 0.0})[what] = time.perf_counter() - t_run

    def run_step() -> bool:
        nonlocal t_step_end
        t0 = time.perf_counter()
        if t_step_end is not None and engine.running():
            res.stalls_s.append(t0 - t_step_end)   # the running batch waited this long since its last step
        in_engine = frozenset(int(k) for k in engine.states)
        ran = engine.step() if stepper is None else stepper.step()
        t1 = time.perf_counter()
        res.decode_s += t1 - t0
        if ran:
            res.step_log.append((in_engine, len(held)))
            res.step_s.append(t1 - t0)
            res.step_requests.append(engine.step_requests[-1])
        t_step_end = t1 if ran else None
        return ran

    def admit(a: Any) -> None:
        r, vt = held.pop(a.request_id)
        if a.figures is None:
            engine.release(str(r.request_id))
            raise InvariantError(f"prefill arena short for request {r.request_id} ({r.input_tokens} tokens)")
        stamp(r.request_id, "received")
        res.figures.append(a.figures)
        out = a.extra["outputs"][r.request_id]
        res.prefill_child_s = a.extra["prefill_s"]
        res.weights_ok = res.weights_ok and a.extra["weights_digest"] == weights
        t_digest = time.perf_counter()
        if received_digests(cache, vt, r.input_tokens) != out["digests"]:
            res.digest_bad.append(r.request_id)
        res.digest_s += time.perf_counter() - t_digest
        engine.admit(str(r.request_id), prompts[r.request_id], out["first_token"], r.output_tokens)
        now = time.perf_counter()
        res.ttft_s[r.request_id] = now - t_run
        last_tok[r.request_id] = now
        res.admitted_at[r.request_id] = steps
        stamp(r.request_id, "admitted")

    while waiting or engine.running() or held:
        handed = 0
        # while a batch runs, one hand-over and one admission per gap between two steps (each costs about a small
        # model's step); with none running, as many as there is room for
        while waiting and engine.running() + len(held) < max_batch and not (engine.running() and handed):
            r = waiting[0]
            fits = budget_pages is None or sum(committed.values()) + lifetime(r) <= budget_pages
            vt = engine.reserve_ends(str(r.request_id), r.input_tokens) if fits else None
            if vt is None:
                res.waits_for_room += 1
                break
            waiting.popleft()
            committed[r.request_id] = lifetime(r)
            stamp(r.request_id, "reserved")
            feed.submit(RequestState(r), vt)
            stamp(r.request_id, "sent")
            held[r.request_id] = (r, vt)
            sent_at[r.request_id] = steps
            handed += 1
        running = engine.running() > 0
        # each request joins as soon as its own transfer finished, after steps_in_flight steps of a running batch;
        # with none running, the first one in flight is waited for, and every one finished by then joins with it
        allowed = [rid for rid in held if not running or steps - sent_at[rid] >= steps_in_flight][:1 if running else None]
        for a in feed.arrived(allowed, wait_s=0.0 if running else ARRIVAL_WAIT_S):
            admit(a)
        if not engine.running():
            if held:
                continue   # nothing to step: wait for the next arrival
            if waiting:
                r = waiting[0]
                raise InvariantError(f"decode cache of {cache.arena.arena_bytes:,} bytes cannot hold request "
                                     f"{r.request_id} ({r.input_tokens} prompt tokens) with no other request "
                                     "running")
            break
        moved = cache.counters.pages_moved
        if run_step():
            steps += 1
            if held:   # transfers in flight (their pages leased) while the batch stepped
                res.steps_in_flight += 1
                res.pages_moved_in_flight += cache.counters.pages_moved - moved
        collect(res, engine, last_tok, stamp, on_done, committed)
    res.memory_s = cache.counters.memory_seconds
    res.pages_moved = cache.counters.pages_moved
    return res


def collect(res: InPlaceResult, engine: Any, last_tok: dict[int, float], stamp: Callable[[int, str], None],
            on_done: Callable[[int], None] | None, committed: dict[int, int]) -> None:
    """Record every request the engine finished: its tokens, inter-token gaps and ``done`` stamp; forget its
    pages in ``committed``.

    Raises:
        InvariantError: a request failed in the engine.
    """
    for rid, state in engine.finished():
        i = int(rid)
        if state.error is not None or state.generated_len() < 1:
            raise InvariantError(f"request {i} failed in the decode engine: {state.error}")
        res.generated[i] = list(state.generated_tokens)
        prev = last_tok.pop(i, None)
        for s in state.timestamps or []:
            if prev is not None:
                res.itl_s.append(s - prev)
            prev = s
        stamp(i, "done")
        committed.pop(i, None)
        if on_done is not None:
            on_done(i)


__all__ = ["ARRIVAL_WAIT_S", "InPlaceResult", "cb_min_page_size", "collect", "decode_in_place", "engine_for", "received_digests"]
