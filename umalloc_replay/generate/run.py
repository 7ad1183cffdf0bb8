"""The driver of ``umalloc generate``: a trace slice through a transformers model (Gemma-3-270M's or
SmolLM2-135M's real weights, or a tiny random-weight one), its KV moved from a prefill side to a decode side on umalloc pages, every request's
tokens compared with one process.

Policy:

* The slice: ``requests`` rows of the trace after ``skip`` (a trace with fewer rows is refused); prompt lengths
  divided by ``token_scale`` (ceiling, at least 1, :func:`~umalloc_replay.trace.scale_tokens`), output lengths
  by ``output_scale`` (ceiling, at least :data:`MIN_OUTPUT_TOKENS`: the prefill's first token and one token
  decoded over the received KV, so every request's token check reads the transferred KV). Every request must fit
  the model's context (:data:`~umalloc_replay.generate.models.MAX_CONTEXT_TOKENS`), else the run is refused
  naming the request and the smallest ``token_scale`` (or ``output_scale``) that fits, computed in O(rows) —
  before any process starts. Prompt token ids are seeded per request (:func:`prompt_tokens`), the same in every
  process; any int seed is accepted (the weights' through :func:`~umalloc_replay.seed64`).
* The reference: per request, in this process, :func:`~umalloc_replay.generate.kv.reference_tokens` (prefill
  forward, a cache built from its K/V, greedy decoding); no umalloc, no transfer.
* The PD run: the replay's prefill side (:class:`~umalloc_replay.single.prefill.LocalPrefill` for ``local``,
  :class:`~umalloc_replay.single.remote.RemotePrefill` for ``nixl`` / ``mooncake``, which runs the prefill side
  in a second process over the real engine) with a :class:`~umalloc_replay.generate.kv.ModelKV` as its pattern:
  the decode side is transformers' continuous batching on the umalloc integration
  (:func:`~umalloc_replay.generate.inplace.decode_in_place`): each request's pages are reserved in the decode
  cache (full end: every page; swa end: the window tail, on its ring; draft end: every page), leased and
  published (receiver half), the prefill side runs the model forward, writes the KV into its own pages, plans
  (its lease) and posts; once received, the pages' digest is checked in place against the prefill side's and
  the request joins the running batch, its attention reading the received pages where they landed (no copy out
  of the arena, no cache rebuilt). With a drafter every step is a speculative round in place
  (:mod:`~umalloc_replay.generate.speculate_cb`; a model with sliding layers gets rings built for its rounds).
  "Decoded tokens" are the tokens after the prefill's first one: each comes from a forward over the received
  KV, so it is what the token check compares the transferred KV by; decoded tokens/s divides them by the
  decode steps' seconds alone.
* The check (:func:`check_generate_report`): every request's tokens equal the reference's (else its first
  differing position is listed), every request decoded at least one token from the received KV, every digest
  matches, both models' weights digest match, and no page or lease is left on either side after
  ``check_invariants``.
* The report (:data:`GENERATE_SCHEMA`) holds what reproduces the run: every option of ``umalloc generate``
  (``config``), the umalloc version, and per request its prompt, output and decoded token counts.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from umalloc import ArenaSpec, UmallocValueError
from umalloc import __version__ as umalloc_version
from umalloc.backends.worker import WorkerDied
from umalloc.geometry.spec import pages_for_tokens
from umalloc_replay import (
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_GENERATE_MODEL,
    DEFAULT_GENERATE_OUTPUT_SCALE,
    DEFAULT_GENERATE_REQUESTS,
    DEFAULT_GENERATE_TOKEN_SCALE,
)
from umalloc_replay.report import PhaseTimer
from umalloc_replay.signals import cleanup_shielded
from umalloc_replay.trace import TraceRequest, check_slice_rows, load_trace, scale_tokens, trace_label
from umalloc_replay.workload import pages_held

#: The report's schema version (:func:`check_generate_report` reads this layout).
GENERATE_SCHEMA = "umalloc-generate/6"
#: Fewest tokens a request generates: the prefill's first token and one decoded over the received KV.
MIN_OUTPUT_TOKENS = 2


@dataclass(frozen=True)
class GenerateConfig:
    """One ``umalloc generate`` run (the CLI options; see ``umalloc generate --help``).

    ``draft``: a drafter (:func:`~umalloc_replay.generate.models.build_drafter`) whose KV rides the same plan
    (its own ``draft`` end and index vector); the decode side decodes in speculative rounds in place
    (:func:`~umalloc_replay.generate.speculate_cb.speculative_stepper`, ``draft_tokens`` per round) and must
    still equal the target-only reference, its acceptance per round the one-process speculative run's. On the local backend the drafter's forward runs after the target's pages are
    planned (the order in which vLLM #35158 sent stale draft pages): the post goes through a
    :class:`~umalloc.WriteGate` (target and SWA-tail vectors by the target, the draft vector by the drafter) and
    waits for the drafter; ``write_gate=False`` (tests only) posts at once, with the draft pages' old bytes.
    ``draft_method``: ``early-exit`` (the drafter above) or ``ngram``
    (:mod:`~umalloc_replay.generate.ngram`: prompt lookup over the request's own tokens; no model, no KV, so no
    ``draft`` end, no ``draft`` vector, no write gate); ``draft_layers`` only with ``early-exit``.
    ``decode_blocks``: the decode cache's pages (an arena smaller than the load: arrivals wait for room, the
    cache compacts at every step). ``steps_in_flight``: the fewest decode steps the running batch takes between a
    request's hand-over and its admission (tests: a transfer that lasts several steps).
    ``fault``: a wrong KV written on the prefill side (:data:`~umalloc_replay.generate.kv.FAULTS`), for the
    tests that show the token check catches it; ``None`` in every real run.
    """

    model: str = DEFAULT_GENERATE_MODEL
    backend: str = "local"
    trace: str | None = None
    trace_format: str | None = None
    requests: int = DEFAULT_GENERATE_REQUESTS
    skip: int = 0
    token_scale: int = DEFAULT_GENERATE_TOKEN_SCALE
    output_scale: int = DEFAULT_GENERATE_OUTPUT_SCALE
    page_size: int = 16
    seed: int = 0
    max_batch: int = 4
    compaction: str = "lazy"
    transfer_timeout_s: float = 120.0
    lease_deadline_s: float | None = 600.0
    fault: str | None = None
    draft: bool = False
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    write_gate: bool = True
    draft_layers: int = 0
    draft_method: str = "early-exit"
    decode_blocks: int | None = None
    steps_in_flight: int = 1


def scale_output(num_tokens: int, output_scale: int) -> int:
    """Tokens a request of ``num_tokens`` trace output tokens generates: ``ceil(num_tokens / output_scale)``, at
    least :data:`MIN_OUTPUT_TOKENS`. O(1).

    >>> scale_output(500, 16), scale_output(3, 16), scale_output(0, 1)
    (32, 2, 2)
    """
    return max(MIN_OUTPUT_TOKENS, scale_tokens(num_tokens, output_scale))


def load_slice(cfg: GenerateConfig, max_context_tokens: int) -> list[TraceRequest]:
    """The scaled trace slice (module docstring). O(rows of the slice), the hint included.

    Raises:
        UmallocValueError: the trace's own errors, fewer rows than ``cfg.requests``, or a request longer than
            the context, naming it and the smallest ``--token-scale`` (``--output-scale`` where an output alone
            is too long) under which every request of the slice fits.
    """
    trace = load_trace(cfg.trace, token_scale=1, max_requests=cfg.requests, fmt=cfg.trace_format, skip=cfg.skip)
    check_slice_rows(trace, cfg.requests, cfg.skip)
    out = [TraceRequest(r.request_id, r.arrival_s, scale_tokens(r.input_tokens, cfg.token_scale),
                        scale_output(r.output_tokens, cfg.output_scale), r.hash_ids) for r in trace]
    over = [r for r in out if r.input_tokens + r.output_tokens > max_context_tokens]
    if over:
        r = over[0]
        long_output = [t for t in out if t.output_tokens + 1 > max_context_tokens]
        if long_output:
            r = long_output[0]
            # an output alone leaves no room for a 1-token prompt: ceil(n / k) <= context - 1
            fit = max(-(-t.output_tokens // (max_context_tokens - 1)) for t in trace)
            given, hint = f"--output-scale {cfg.output_scale}", f"--output-scale >= {fit}"
        else:
            # request t fits when ceil(prompt / k) <= context - output, i.e. k >= ceil(prompt / room)
            fit = max(max(1, -(-t.input_tokens // (max_context_tokens - s.output_tokens)))
                      for t, s in zip(trace, out, strict=True))
            given, hint = f"--token-scale {cfg.token_scale}", f"--token-scale >= {fit}"
        raise UmallocValueError(f"{given}: request {r.request_id} has {r.input_tokens} "
                                f"prompt + {r.output_tokens} output tokens, over the model's context of "
                                f"{max_context_tokens} ({len(over)} of {len(out)} requests are): allowed {hint}")
    return out


def prompt_tokens(seed: int, request_id: int, num_tokens: int, vocab_size: int) -> list[int]:
    """Prompt token ids of one request: uniform in ``[3, vocab_size)`` from a generator seeded by 64 bits of the
    blake2b digest of ``(seed, request_id)`` (any ints; ids 0-2 are pad, bos, eos). O(num_tokens)."""
    key = hashlib.blake2b(f"{int(seed)}/{request_id}".encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key, "little"))
    return torch.randint(3, vocab_size, (num_tokens,), generator=g).tolist()


def arena_bytes_for(spec_ends: tuple, reqs: list[TraceRequest], max_batch: int) -> int:
    """Arena bytes that hold the ``max_batch`` largest prompts at once on every end (their pages, one spare
    page per request and end), twice over (slack for placement), plus the reserved floor; 16-aligned."""
    probe = ArenaSpec(spec_ends, arena_bytes=1 << 40)
    big = sorted(reqs, key=lambda r: r.input_tokens, reverse=True)[:max_batch]
    need = sum((pages_held(probe, e.name, r.input_tokens) + 1) * e.page_bytes for r in big for e in spec_ends)
    total = probe.floor_bytes + 2 * need
    return total + (-total) % 16


def _live_pages(stats: dict) -> int:
    return sum(int(s.live_pages) + int(s.pending_pages) for s in stats.values())


def _prefill_died(worker: Any) -> WorkerDied:
    """The error naming a dead (reaped) prefill process: its pid and how it ended (signal or exit code)."""
    code = worker.process.exitcode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return WorkerDied(f"the prefill process (pid {worker.pid}) died ({how})")


def compare_request(r: TraceRequest, toks: list[int], want: list[int], per_request: list[dict],
                    differ: list[dict]) -> None:
    """Record request ``r``'s row (prompt, output and decoded token counts) in ``per_request`` and, when its
    tokens ``toks`` differ from the one-process ``want``, the first difference in ``differ``. O(len(toks))."""
    from umalloc_replay.generate.kv import first_difference  # kv imports torch: not at the CLI's start-up
    per_request.append({"request": r.request_id, "prompt_tokens": r.input_tokens,
                        "output_tokens": r.output_tokens, "decoded": max(0, len(toks) - 1)})
    pos = first_difference(toks, want)
    if pos is not None:
        differ.append({"request": r.request_id, "position": pos, "got": toks[pos] if pos < len(toks) else None,
                       "want": want[pos] if pos < len(want) else None})


def run_generate(cfg: GenerateConfig, *, progress: bool = False, console: Any = None,
                 on_finished: Callable[[int, Any], None] | None = None) -> dict:
    """Run ``cfg`` (module docstring); returns the JSON-ready report. ``on_finished(index, prefill_side)`` runs
    each time a request finished decoding (``index``: 0 for the first to finish, then 1, ...; tests end the
    second process or raise ``KeyboardInterrupt`` there, at a point of their choosing). With ``--backend nixl|mooncake`` and a ``console`` (rich), prints
    ``prefill process: pid N (BACKEND)`` on it once the second process is up with its model, before any batch.

    Raises:
        UmallocValueError: bad configuration (nothing started).
        BackendError: the transfer engine or the second process failed; a dead prefill process is a
            ``WorkerDied`` naming its pid and its signal or exit code.
    """
    from umalloc_replay.generate.kv import (
        FAULTS,
        ModelKV,
        reference_speculative,
        reference_tokens,
    )
    from umalloc_replay.generate.models import (
        MAX_CONTEXT_TOKENS,
        REAL_MODELS,
        VOCAB_SIZE,
        arena_ends,
        build_drafter,
        build_model,
        chat_prompts,
        geometry_of,
        weights_digest,
    )
    from umalloc_replay.single.prefill import LocalPrefill

    if cfg.fault is not None and cfg.fault not in FAULTS:
        raise UmallocValueError(f"fault {cfg.fault!r}: allowed None or one of {FAULTS}")
    if cfg.backend not in ("local", "nixl", "mooncake"):
        raise UmallocValueError(f"--backend {cfg.backend!r}: allowed local, nixl, mooncake")
    reqs = load_slice(cfg, MAX_CONTEXT_TOKENS)
    t_start = time.perf_counter()
    model = build_model(cfg.model, cfg.seed)
    geo = geometry_of(model)
    if cfg.fault == "stale_draft" and not cfg.draft:
        raise UmallocValueError("fault stale_draft: allowed with draft=True")
    if cfg.fault == "swa_tail_start" and geo.window_tokens is None:
        raise UmallocValueError(f"fault swa_tail_start: model {cfg.model!r} has no sliding layer")
    if cfg.draft_tokens < 1:
        raise UmallocValueError(f"--draft-tokens {cfg.draft_tokens}: allowed >= 1")
    from umalloc_replay.generate.inplace import decode_in_place, engine_for
    if cfg.draft_layers and not cfg.draft:
        raise UmallocValueError(f"--draft-layers {cfg.draft_layers}: allowed with --draft")
    from umalloc_replay.generate.ngram import DRAFT_METHODS, reference_ngram

    if cfg.draft and cfg.draft_method not in DRAFT_METHODS:
        raise UmallocValueError(f"--draft-method {cfg.draft_method!r}: allowed one of {', '.join(DRAFT_METHODS)}")
    ngram = cfg.draft and cfg.draft_method == "ngram"
    if ngram and cfg.draft_layers:
        raise UmallocValueError(f"--draft-layers {cfg.draft_layers}: the n-gram drafter has no layers; allowed "
                                "with --draft-method early-exit")
    if ngram and cfg.fault == "stale_draft":
        raise UmallocValueError("fault stale_draft: the n-gram drafter has no KV; allowed with early-exit")
    drafter = build_drafter(model, cfg.seed, cfg.draft_layers) if cfg.draft and not ngram else None
    ends = arena_ends(geo, cfg.page_size, None if drafter is None else geometry_of(drafter))
    nbytes = arena_bytes_for(ends, reqs, cfg.max_batch)
    spec = ArenaSpec(ends, arena_bytes=nbytes)
    if cfg.model in REAL_MODELS:   # the shipped chat prompts; the trace gives the output lengths
        chats = chat_prompts(cfg.model, len(reqs))
        reqs = [TraceRequest(r.request_id, r.arrival_s, len(c), r.output_tokens, r.hash_ids)
                for r, c in zip(reqs, chats, strict=True)]
        prompts = {r.request_id: c for r, c in zip(reqs, chats, strict=True)}
        nbytes = arena_bytes_for(ends, reqs, cfg.max_batch)
        spec = ArenaSpec(ends, arena_bytes=nbytes)
    else:
        prompts = {r.request_id: prompt_tokens(cfg.seed, r.request_id, r.input_tokens, VOCAB_SIZE) for r in reqs}

    from umalloc_replay.generate.inplace import cb_min_page_size  # before any reference or second process

    if cfg.page_size < cb_min_page_size():
        raise UmallocValueError(f"--page-size {cfg.page_size}: transformers' continuous batching (the decode side) "
                                f"takes pages of at least {cb_min_page_size()} tokens; allowed --page-size >= "
                                f"{cb_min_page_size()}")
    #: draft tokens the decode cache's sliding rings are built to roll back (Note [Sliding ring] of the integration)
    speculative_tokens = cfg.draft_tokens if cfg.draft else 0
    if geo.window_tokens is not None:
        from umalloc.integrations.transformers.admit import ring_landing_refusal
        from umalloc.integrations.transformers.rings import ring_tokens

        ring = ring_tokens(geo.window_tokens, cfg.page_size, speculative_tokens)
        for r in reqs:
            why = ring_landing_refusal(geo.window_tokens, cfg.page_size, r.input_tokens, ring)
            if why is not None:
                raise UmallocValueError(f"--page-size {cfg.page_size}: request {r.request_id}: {why}")
    if cfg.decode_blocks is not None and cfg.decode_blocks < 1:
        raise UmallocValueError(f"--decode-blocks {cfg.decode_blocks}: allowed >= 1")
    if cfg.steps_in_flight < 1:
        raise UmallocValueError(f"steps_in_flight={cfg.steps_in_flight}: allowed >= 1")
    if cfg.decode_blocks is not None:
        need = max(-(-(r.input_tokens + r.output_tokens) // cfg.page_size) for r in reqs)
        # with a drafter's KV the floor is higher: the refusal below names it once the engine knows its page bytes
        if drafter is None and cfg.decode_blocks < need:
            raise UmallocValueError(f"--decode-blocks {cfg.decode_blocks}: the longest request needs {need} pages "
                                    f"of {cfg.page_size} tokens; allowed >= {need}")
    engine = engine_for(model, reqs, cfg.page_size, cfg.max_batch, draft_layers=0 if drafter is None else int(
        drafter.config.num_hidden_layers), num_blocks=cfg.decode_blocks, speculative_tokens=speculative_tokens)
    budget_pages = cfg.decode_blocks
    if cfg.decode_blocks is not None and drafter is not None:
        # --decode-blocks sizes the cache in target pages; the drafter's end takes one page per target page from
        # the same bytes, so the cache holds fewer target pages (each with its draft page) than it was given
        budget_pages = min(cfg.decode_blocks, engine.cache.tokens_alone // cfg.page_size)
        if budget_pages < need:
            per = engine.cache.full_page_bytes / engine.cache.arena.page_bytes("full")
            enough = cfg.decode_blocks + math.ceil((need - budget_pages) * per)
            engine.close()
            raise UmallocValueError(
                f"--decode-blocks {cfg.decode_blocks}: the cache holds {budget_pages} pages of {cfg.page_size} "
                f"tokens once each has its drafter's page beside it ({per:.2f} target pages' bytes a page), and the "
                f"longest request needs {need}; allowed a larger --decode-blocks ({enough} holds it)")
    t0 = time.perf_counter()
    reference = {r.request_id: reference_tokens(model, geo, prompts[r.request_id], r.output_tokens, cfg.page_size)
                 for r in reqs}
    greedy_s = time.perf_counter() - t0
    #: request -> drafts accepted per verification round in the one-process speculative run
    reference_rounds = {r.request_id: reference_speculative(model, drafter, geo, prompts[r.request_id],
                                                            r.output_tokens, cfg.draft_tokens, cfg.page_size)[1]
                        .per_round for r in reqs} if drafter is not None else {}
    if ngram:
        reference_rounds = {r.request_id: reference_ngram(model, geo, prompts[r.request_id], r.output_tokens,
                                                          cfg.draft_tokens, cfg.page_size)[1].per_round
                            for r in reqs}
    reference_s = time.perf_counter() - t0

    timer = PhaseTimer()
    dec = engine.cache.alloc
    kv_local: ModelKV | None = None
    gate: Any = None
    if cfg.backend == "local":
        from umalloc import WriteGate

        gate = WriteGate({"target": ("target",), "swa_tail": ("target",), "draft": ("draft",)}) \
            if drafter is not None and cfg.write_gate else None
        kv_local = ModelKV(model, geo, spec, prompts, cfg.fault, drafter, late_draft=drafter is not None,
                           gate=gate)
        prefill: Any = LocalPrefill(spec, kv_local, dec, timer, compaction=cfg.compaction,
                                    transfer_timeout_s=cfg.transfer_timeout_s, lease_deadline_s=cfg.lease_deadline_s,
                                    gate=gate)
    else:
        from umalloc_replay.generate.child import OUTPUTS_TARGET, SETUP_TARGET
        from umalloc_replay.single.remote import RemotePrefill

        if progress and console is not None:  # the second process's start (engine, model) takes seconds
            console.print(f"starting the prefill process ({cfg.backend}) ...", soft_wrap=True)
        setup = (SETUP_TARGET, (cfg.model, cfg.seed, cfg.page_size, nbytes, cfg.compaction, prompts, cfg.fault,
                                drafter is not None, cfg.draft_layers))
        prefill = RemotePrefill(cfg.backend, spec, dec, timer, model=cfg.model, page_size=cfg.page_size,
                                draft=False, seed=cfg.seed, compaction=cfg.compaction, padded=False,
                                transfer_timeout_s=cfg.transfer_timeout_s, lease_deadline_s=cfg.lease_deadline_s,
                                setup=setup, after=OUTPUTS_TARGET)
        if console is not None:  # the second process is up, its model built: the run's batches come next
            console.print(f"prefill process: pid {prefill.worker.pid} ({cfg.backend})", soft_wrap=True)
    generated: dict[int, list[int]] = {}
    differ: list[dict] = []
    digest_bad: list[int] = []
    figures: list[Any] = []
    decode_s = 0.0
    per_request: list[dict] = []
    prefill_child_s = 0.0
    weights_ok = True
    spec_fig = {"rounds": 0, "proposed": 0, "accepted": 0}
    gate_figs = {"deferred_posts": 0, "posted_before_draft": 0}
    in_place: Any = None
    feed: Any = None
    baseline: dict = {}
    rounds_pd: dict[int, list[int]] = {}
    bar = None
    interrupted = False
    startup_s = time.perf_counter() - t_start - reference_s
    baseline_s = 0.0
    try:
        if progress and console is not None:
            from rich.progress import Progress

            bar = Progress(console=console, transient=True)
            bar.start()
            task = bar.add_task(f"generate {cfg.model} over {cfg.backend}", total=len(reqs))
        wd_here = weights_digest(model) + ("" if drafter is None else "/" + weights_digest(drafter))

        stepper = None
        if cfg.draft:
            from umalloc_replay.generate.speculate_cb import speculative_stepper

            stepper = speculative_stepper(engine, cfg.draft_tokens, drafter, prompts)

        def late_draft(rid: int, ticket: Any) -> None:   # the drafter's forward, after the target's plan
            if kv_local is not None and kv_local.late_draft:
                deferred = gate is not None and ticket[1] is None
                kv_local.write_late_draft(rid)
                gate_figs["deferred_posts"] += int(deferred)
                gate_figs["posted_before_draft"] += int(not deferred)

        from umalloc_replay.generate.feed import LocalFeed

        finished = 0

        def done(_rid: int) -> None:   # a request finished decoding
            nonlocal finished
            if bar is not None:
                bar.advance(task)
            if on_finished is not None:
                on_finished(finished, prefill)
            finished += 1

        feed = prefill if kv_local is None else LocalFeed(prefill, kv_local, wd_here, on_started=late_draft)
        ip = decode_in_place(engine, feed, reqs, prompts, wd_here, cfg.max_batch, on_done=done,
                             stepper=stepper, budget_pages=budget_pages, steps_in_flight=cfg.steps_in_flight)
        if stepper is not None:
            rounds_pd = {int(rid): rs for rid, rs in stepper.figures.per_round.items()}
            spec_fig = {"rounds": stepper.figures.rounds, "proposed": stepper.figures.proposed,
                        "accepted": stepper.figures.accepted}
        generated, digest_bad, figures, decode_s = ip.generated, ip.digest_bad, ip.figures, ip.decode_s
        weights_ok, prefill_child_s = ip.weights_ok, ip.prefill_child_s
        in_place = ip
        from umalloc_replay.generate.timeline import one_process_cb, timeline_rows

        t_base = time.perf_counter()
        baseline = one_process_cb(model, reqs, prompts, cfg.page_size, cfg.max_batch)
        baseline_s = time.perf_counter() - t_base
        for r in reqs:
            toks = generated[r.request_id]
            compare_request(r, toks, reference[r.request_id], per_request, differ)
        prefill.check_invariants()
        dec.check_invariants()
        engine.cache.check_invariants()
        pages_left = {"prefill": _live_pages(prefill.stats()), "decode": _live_pages(dec.stats())}
        leases_left = {"prefill": int(prefill.leases_active()), "decode": int(dec.leases_active())}
    except KeyboardInterrupt:
        interrupted = True  # the second process is killed at once, not asked to finish its transfers
        raise
    except WorkerDied as exc:
        if kv_local is not None:
            raise
        prefill.close(interrupted=True)  # reaps the dead child (idempotent): its exit status is known after
        raise _prefill_died(prefill.worker) from exc
    finally:
        if bar is not None:
            bar.stop()
        with cleanup_shielded():  # a second Ctrl-C or SIGTERM does not cut the cleanup short
            if feed is not None and feed is not prefill:
                feed.close()   # the local prefill's worker thread
            prefill.close(interrupted=interrupted)
            engine.close()
    total_s = time.perf_counter() - t_start
    sec = timer.seconds
    prefill_compute_s = kv_local.prefill_s if kv_local is not None else prefill_child_s
    tokens = sum(len(t) for t in generated.values())
    decoded = sum(p["decoded"] for p in per_request)
    n = len(reqs)
    bytes_by_vector: dict[str, int] = {}
    for f in figures:
        for name, b in f.bytes_by_vector.items():
            bytes_by_vector[name] = bytes_by_vector.get(name, 0) + int(b)
    return {
        "schema": GENERATE_SCHEMA,
        "umalloc_version": umalloc_version,
        "config": {"model": cfg.model, "backend": cfg.backend, "trace": cfg.trace,
                   "trace_name": trace_label(cfg.trace), "trace_format": cfg.trace_format, "requests": cfg.requests, "skip": cfg.skip,
                   "token_scale": cfg.token_scale, "output_scale": cfg.output_scale, "page_size": cfg.page_size,
                   "max_batch": cfg.max_batch, "seed": cfg.seed, "draft": cfg.draft,
                   "draft_tokens": cfg.draft_tokens if cfg.draft else None,
                   "draft_layers": cfg.draft_layers if drafter is not None else None,
                   "draft_method": cfg.draft_method if cfg.draft else None, "compaction": cfg.compaction,
                   "decode_blocks": cfg.decode_blocks, "steps_in_flight": cfg.steps_in_flight},
        "serving": serving_figures(in_place, decoded, baseline, reference),
        "timeline": timeline_rows(in_place, reqs),
        "model": cfg.model, "backend": cfg.backend, "seed": cfg.seed, "page_size": cfg.page_size,
        "layer_types": list(geo.layer_types), "window_tokens": geo.window_tokens,
        "token_scale": cfg.token_scale, "output_scale": cfg.output_scale, "fault": cfg.fault,
        "arena_bytes": nbytes,
        "requests": n,
        "prompt_tokens": sum(r.input_tokens for r in reqs),
        "tokens_generated": tokens,
        "decoded_tokens": decoded,
        "decoded_tokens_min": min((p["decoded"] for p in per_request), default=0),
        "per_request": per_request,
        "identical": n - len(differ),
        "differing": differ,
        "digest_mismatches": digest_bad,
        "weights_match": weights_ok,
        "bytes_moved": sum(int(f.bytes_total) for f in figures),
        "bytes_by_vector": bytes_by_vector,
        "descriptors": sum(int(f.descriptors) for f in figures),
        "descriptors_per_request": sum(int(f.descriptors) for f in figures) / max(n, 1),
        "per_layer_per_page_descriptors": sum(int(f.per_layer_per_page) for f in figures),
        "pages_per_request": {e.name: sum(pages_held(spec, e.name, r.input_tokens) for r in reqs) / max(n, 1)
                              for e in ends},
        "seconds": {"total": total_s, "startup": startup_s, "one_process_cb": baseline_s, "reference": reference_s, "reference_greedy": greedy_s,
                    "reference_speculative": reference_s - greedy_s, "prefill_compute": prefill_compute_s,
                    "transfer": sec["transfer"], "decode_compute": decode_s,
                    "memory_layer": sec["allocator"] + sec["translate_plan"]
                    + in_place.memory_s, "kv_read_verify": in_place.digest_s},
        "decoded_tokens_per_s": decoded / decode_s if decode_s > 0 else 0.0,
        "pages_left": pages_left, "leases_left": leases_left,
        "draft": cfg.draft, "draft_tokens": cfg.draft_tokens if cfg.draft else 0, "speculative": spec_fig,
        "write_gate": gate_figs,
        "draft_acceptance": spec_fig["accepted"] / spec_fig["proposed"] if spec_fig["proposed"] else None,
        "acceptance_length": acceptance_lengths(rounds_pd, reference_rounds) if cfg.draft else None,
        "tokens": {str(k): v for k, v in generated.items()},
        "max_prompt_pages": max(pages_for_tokens(r.input_tokens, cfg.page_size) for r in reqs),
    }


def acceptance_lengths(pd: dict[int, list[int]], ref: dict[int, list[int]]) -> dict:
    """Acceptance length (tokens emitted per target verification: drafts accepted + 1) of the PD run and of the
    one-process speculative run: mean, distribution (AL -> rounds, in increasing AL), and the requests whose per-round acceptance
    differs between the two (a stale or misplaced draft KV; greedy tokens cannot show it)."""
    def summary(rounds: dict[int, list[int]]) -> dict:
        als = [a + 1 for rs in rounds.values() for a in rs]
        dist: dict[str, int] = {}
        for a in als:
            dist[str(a)] = dist.get(str(a), 0) + 1
        return {"mean": sum(als) / len(als) if als else 0.0, "rounds": len(als),
                "distribution": dict(sorted(dist.items(), key=lambda kv: int(kv[0])))}

    return {"pd": summary(pd), "one_process": summary(ref),
            "differing": sorted(rid for rid in ref if pd.get(rid) != ref[rid])}


def _pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs`` by nearest rank; 0.0 for none."""
    if not xs:
        return 0.0
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, -int(-q * len(ys) // 1) - 1))]


def serving_figures(ip: Any, decoded: int, baseline: dict, reference: dict[int, list[int]]) -> dict:
    """TTFT (run start to the request's admission with its first token), inter-token latency, decoded tokens/s
    over the engine's steps and the mean requests per step of an in-place decode, and the targets against the
    one-process baseline (:func:`~umalloc_replay.generate.timeline.serving_targets`)."""
    from umalloc_replay.generate.timeline import serving_targets

    ttft = list(ip.ttft_s.values())
    return {**serving_targets(ip, decoded, baseline, reference), "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99), "itl_p50_s": _pct(ip.itl_s, 0.5),
            "itl_p99_s": _pct(ip.itl_s, 0.99), "steps": len(ip.step_requests),
            "mean_batch": sum(ip.step_requests) / max(1, len(ip.step_requests)),
            "decode_tokens_per_s": decoded / ip.decode_s if ip.decode_s > 0 else 0.0}


def serving_rows(sv: dict) -> list[tuple[str, str]]:
    """The table rows of the serving targets (:func:`~umalloc_replay.generate.timeline.serving_targets`)."""
    return [
        ("PD / one-process CB decode tokens/s", f"{sv['speed_ratio']:.2f}x ({sv['pd_decode_tokens_per_s']:,.0f} "
         f"against {sv['one_process_cb_tokens_per_s']:,.0f}; target >= {sv['speed_target']}x)"),
        ("longest stall of the running batch", f"{sv['longest_stall_s'] * 1e3:.2f} ms = "
         f"{sv['longest_stall_steps']:.2f} median steps ({sv['median_step_s'] * 1e3:.2f} ms)"),
        ("memory layer / decode step time", f"{sv['memory_layer_share']:.2%} (target <= "
         f"{sv['memory_share_target']:.0%})"),
        ("steps with transfers in flight, pages moved", f"{sv['steps_with_transfers_in_flight']}, "
         f"{sv['pages_moved_with_transfers_in_flight']} (admissions waiting for room: {sv['waits_for_room']})"),
    ]


def check_generate_report(report: dict) -> list[str]:
    """Every failed check of a :func:`run_generate` report, one line each (empty: the run passed)."""
    out = []
    for d in report["differing"]:
        out.append(f"request {d['request']}: tokens differ from one process at position {d['position']} "
                   f"(got {d['got']}, want {d['want']})")
    al = report.get("acceptance_length")
    if al is not None and al["differing"]:
        out.append(f"requests {al['differing']}: acceptance lengths differ from the one-process speculative run "
                   f"(mean {al['pd']['mean']:.3f} against {al['one_process']['mean']:.3f}): "
                   + ("the target KV received changed the target's verification"
                      if (report.get("config") or {}).get("draft_method") == "ngram"
                      else "the draft KV received is not the drafter's"))
    sv = report.get("serving")
    if sv is not None and sv["one_process_cb_identical"] != report["requests"]:
        out.append(f"the one-process continuous-batching baseline equals the reference for "
                   f"{sv['one_process_cb_identical']} of {report['requests']} requests")
    blind = [p["request"] for p in report["per_request"] if p["decoded"] < 1]
    if blind:
        out.append(f"requests {blind} decoded no token from the received KV: their token check cannot see the "
                   "transferred KV")
    if report["digest_mismatches"]:
        out.append(f"received KV digest differs from the prefill side's for requests {report['digest_mismatches']}")
    if not report["weights_match"]:
        out.append("the prefill process's model weights differ from the decode process's")
    for side in ("prefill", "decode"):
        if report["pages_left"][side]:
            out.append(f"{report['pages_left'][side]} pages left on the {side} side")
        if report["leases_left"][side]:
            out.append(f"{report['leases_left'][side]} leases left on the {side} side")
    return out


def generate_table(report: dict) -> Any:
    """The result as a rich table: one figure per row."""
    from rich.table import Table

    s = report["seconds"]
    t = Table(title=f"umalloc generate: {report['model']} over {report['backend']}", show_header=True)
    t.add_column("figure")
    t.add_column("value", justify="right")
    n = report["requests"]
    rows = [
        ("requests", f"{n}"),
        ("identical to one process", f"{report['identical']} of {n} ({report['decoded_tokens']:,} decoded tokens "
         f"compared, at least {report['decoded_tokens_min']} per request)"),
        ("differing (request@position)", ", ".join(f"{d['request']}@{d['position']}" for d in report["differing"])
         or "none"),
        ("KV digest mismatches", f"{len(report['digest_mismatches'])}"),
        ("prompt tokens", f"{report['prompt_tokens']:,}"),
        ("tokens generated", f"{report['tokens_generated']:,}"),
        ("decoded tokens/s (decode forwards only)", f"{report['decoded_tokens_per_s']:,.0f}"),
        ("bytes moved", f"{report['bytes_moved']:,}"),
        ("posts deferred by the write gate", "no drafter" if not report["draft"] else
         "no draft KV (n-gram drafter)" if report["config"]["draft_method"] == "ngram" else
         f"{report['write_gate']['deferred_posts']} (posted before the drafter wrote: "
         f"{report['write_gate']['posted_before_draft']})"),
        ("draft acceptance", "no drafter" if not report["draft"] else
         f"{report['config']['draft_method']}: "
         f"{report['speculative']['accepted']} of {report['speculative']['proposed']} proposed "
         f"({report['draft_acceptance'] or 0:.0%}, {report['speculative']['rounds']} target verifications)"),
        ("one-process speculative vs target only", "no drafter" if not report["draft"] else
         f"{s['reference_greedy'] / max(s['reference_speculative'], 1e-9):.2f}x speed-up "
         f"({s['reference_speculative']:.3f} s against {s['reference_greedy']:.3f} s, prefill included)"),
        ("acceptance length (PD, one process)", "no drafter" if report.get("acceptance_length") is None else
         f"{report['acceptance_length']['pd']['mean']:.3f}, {report['acceptance_length']['one_process']['mean']:.3f}"
         f" (distribution {report['acceptance_length']['pd']['distribution']})"),
        ("bytes by vector", ", ".join(f"{k} {v:,}" for k, v in sorted(report["bytes_by_vector"].items()))),
        ("descriptors per request", f"{report['descriptors_per_request']:.2f} "
         f"(per layer and page: {report['per_layer_per_page_descriptors'] / max(n, 1):.1f})"),
        ("start-up s (models, arenas, second process)", f"{s['startup']:.3f}"),
        ("prefill compute s", f"{s['prefill_compute']:.3f}"),
        ("transfer s", f"{s['transfer']:.3f}"),
        ("decode compute s", f"{s['decode_compute']:.3f}"),
        ("memory layer s", f"{s['memory_layer']:.3f}"),
        ("KV read + digest s", f"{s['kv_read_verify']:.3f}"),
        ("one-process reference s", f"{s['reference']:.3f}"),
        ("one-process continuous batching s", f"{s['one_process_cb']:.3f}"),
        ("total s", f"{s['total']:.3f}"),
        ("pages left (prefill, decode)", f"{report['pages_left']['prefill']}, {report['pages_left']['decode']}"),
        ("leases left (prefill, decode)", f"{report['leases_left']['prefill']}, {report['leases_left']['decode']}"),
    ]
    sv = report.get("serving")
    if sv is not None:
        rows.insert(8, ("TTFT p50 / p99 s", f"{sv['ttft_p50_s']:.3f} / {sv['ttft_p99_s']:.3f}"))
        rows.insert(9, ("ITL p50 / p99 ms", f"{sv['itl_p50_s'] * 1e3:.2f} / {sv['itl_p99_s'] * 1e3:.2f}"))
        rows.insert(10, ("decode steps, mean requests per step", f"{sv['steps']}, {sv['mean_batch']:.2f}"))
        rows[11:11] = serving_rows(sv)
    for k, v in rows:
        t.add_row(k, v)
    return t


__all__ = ["GENERATE_SCHEMA", "MIN_OUTPUT_TOKENS", "GenerateConfig", "acceptance_lengths", "arena_bytes_for",
           "check_generate_report", "generate_table", "load_slice", "prompt_tokens", "run_generate", "scale_output",
           "serving_figures", "serving_rows"]
