"""Serving figures of ``umalloc generate``: the one-process continuous-batching baseline, the serving
targets measured against it in the same run, and the ``--plot`` timeline of requests.

Policy:

* The baseline (:func:`one_process_cb`): the same requests through a fresh
  :class:`~umalloc.integrations.transformers.admit.DecodeEngine` over the same model, each submitted the stock way
  (transformers' scheduler prefills it on this side), at most ``max_batch`` in the engine at once, as the PD run
  admits them. Its tokens must equal the one-process reference too.
* Decode tokens/s, both runs: tokens after each request's first (the prefill's) over the seconds of the engine's
  steps. The PD run's steps are decode steps only; the baseline's include its prefill forwards, which the PD run
  does on the prefill side: that is the trade the target ``pd / baseline >= 0.9`` measures.
* Memory-layer share: the decode cache's own seconds (reservations, growth, index building, compaction) over the
  decode steps' seconds.
* The timeline: one row per request, from the run's start: queued (waiting for pages), prefill (pages reserved to
  the request handed to the prefill side), transfer (handed over to its transfer found finished: the prefill
  forward, plan and post run in there, asynchronously), waiting for admission, decode (admitted to its last
  token); with the engine steps it was admitted after and ran in.
* Stall: the seconds between the end of one engine step and the start of the next while requests were running
  (reservations, hand-overs, polls for finished transfers and admissions between them; with ``local``, the
  prefill's plan and post too, its forward runs on a thread: Note [Local prefill on a thread] of
  :mod:`umalloc_replay.generate.feed`); the longest is printed as seconds and as multiples of the median step.

Threading: the caller's thread only.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The timeline's phases: (name, start stamp, end stamp, colour).
PHASES = (("queued", "queued", "reserved", "#bbbbbb"), ("prefill", "reserved", "sent", "#4c72b0"),
          ("transfer", "sent", "received", "#dd8452"), ("admission", "received", "admitted", "#937860"),
          ("decode", "admitted", "done", "#55a868"))
#: Target: PD decode tokens/s over the one-process baseline's, at least this.
TARGET_SPEED_RATIO = 0.9
#: Target: the memory layer's share of decode step time, at most this.
TARGET_MEMORY_SHARE = 0.03


def one_process_cb(model: Any, reqs: list, prompts: dict[int, list[int]], page_size: int,
                   max_batch: int) -> dict:
    """Run ``reqs`` through one process's continuous batching (module docstring). Returns ``{"tokens": {request:
    tokens}, "decode_s": step seconds, "steps": n, "decoded": tokens after each first}``.

    Raises:
        InvariantError: a request failed in the engine.
    """
    from umalloc import InvariantError
    from umalloc_replay.generate.inplace import engine_for

    engine = engine_for(model, reqs, page_size, max_batch)
    tokens: dict[int, list[int]] = {}
    step_s = 0.0
    try:
        todo = list(reqs)
        while todo or engine.running():
            while todo and engine.running() < max_batch:
                r = todo.pop(0)
                engine.submit(str(r.request_id), prompts[r.request_id], r.output_tokens)
            t0 = time.perf_counter()
            engine.step()
            step_s += time.perf_counter() - t0
            for rid, state in engine.finished():
                if state.error is not None:
                    raise InvariantError(f"request {rid} failed in the one-process baseline: {state.error}")
                tokens[int(rid)] = list(state.generated_tokens)
        steps = engine.steps
    finally:
        engine.close()
    return {"tokens": tokens, "decode_s": step_s, "steps": steps,
            "decoded": sum(max(0, len(t) - 1) for t in tokens.values())}


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    return ys[len(ys) // 2] if ys else 0.0


def serving_targets(ip: Any, decoded: int, baseline: dict, reference: dict[int, list[int]]) -> dict:
    """The targets of a PD in-place decode ``ip`` (:class:`~umalloc_replay.generate.inplace.InPlaceResult`,
    ``decoded`` tokens after each first) against ``baseline`` (:func:`one_process_cb`); ``reference``: the
    one-process tokens per request. Seconds, ratios, counts (module docstring)."""
    pd_tps = decoded / ip.decode_s if ip.decode_s > 0 else 0.0
    base_tps = baseline["decoded"] / baseline["decode_s"] if baseline["decode_s"] > 0 else 0.0
    med = _median(ip.step_s)
    stall = max(ip.stalls_s, default=0.0)
    share = ip.memory_s / ip.decode_s if ip.decode_s > 0 else 0.0
    return {"pd_decode_tokens_per_s": pd_tps, "one_process_cb_tokens_per_s": base_tps,
            "speed_ratio": pd_tps / base_tps if base_tps > 0 else 0.0, "speed_target": TARGET_SPEED_RATIO,
            "one_process_cb_steps": baseline["steps"],
            "one_process_cb_identical": sum(baseline["tokens"].get(k) == v for k, v in reference.items()),
            "median_step_s": med, "longest_stall_s": stall, "longest_stall_steps": stall / med if med > 0 else 0.0,
            "memory_layer_share": share, "memory_share_target": TARGET_MEMORY_SHARE,
            "steps_with_transfers_in_flight": ip.steps_in_flight,
            "pages_moved_with_transfers_in_flight": ip.pages_moved_in_flight, "pages_moved": ip.pages_moved, "waits_for_room": ip.waits_for_room}


def timeline_rows(ip: Any, reqs: list) -> list[dict]:
    """The report's ``timeline``: per request of ``reqs`` (in order), its ``stamps`` (seconds from the run's start,
    :data:`PHASES`), ``admitted_after_steps`` (engine steps taken before its admission) and ``engine_steps``
    (``[first, last]`` index of the engine steps it ran in, ``None`` if none), from ``ip``'s
    (:class:`~umalloc_replay.generate.inplace.InPlaceResult`) step log. O(steps x batch)."""
    ran: dict[int, list[int]] = {}
    for i, (in_engine, _in_flight) in enumerate(ip.step_log):
        for rid in in_engine:
            ran.setdefault(rid, [i, i])[1] = i
    return [{"request": r.request_id, "stamps": ip.stamps[r.request_id],
             "admitted_after_steps": ip.admitted_at.get(r.request_id),
             "engine_steps": ran.get(r.request_id)} for r in reqs]


def build_timeline_figure(report: Mapping) -> Any:
    """The matplotlib ``Figure`` of a report's ``timeline`` (module docstring); the caller saves
    and closes it.

    Raises:
        KeyError: a report without a timeline.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["timeline"]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.32 * len(rows)))
    seen: set[str] = set()
    for y, row in enumerate(rows):
        st = row["stamps"]
        for name, a, b, colour in PHASES:
            if a in st and b in st and st[b] > st[a]:
                ax.barh(y, st[b] - st[a], left=st[a], color=colour, height=0.7,
                        label=None if name in seen else name)
                seen.add(name)
    ax.set_yticks(range(len(rows)), [f"request {r['request']}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the run's start")
    ax.set_title(f"umalloc generate: {report['model']} over {report['backend']}, decode cb "
                 f"({report['requests']} requests, at most {report['config']['max_batch']} in the batch)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def plot_timeline(report: Mapping, path: Path) -> Path:
    """Write the timeline of ``report`` to ``path`` (format by its suffix: png, pdf, svg); returns ``path``.

    Raises:
        KeyError: a report without a timeline. OSError: the write failed.
    """
    import matplotlib.pyplot as plt

    fig = build_timeline_figure(report)
    try:
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


__all__ = ["PHASES", "TARGET_MEMORY_SHARE", "TARGET_SPEED_RATIO", "build_timeline_figure", "one_process_cb",
           "plot_timeline", "serving_targets", "timeline_rows"]
