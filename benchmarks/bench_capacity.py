"""Capacity of the decode arena under each layout: one multi-ended arena (dynamic) against SGLang-style static
pools and vLLM-style padded pages, on the shipped real traces. Never part of the test run.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_capacity.py [--requests 64] [--slices 2] [--plot capacity.png]
        [--presets gemma-3-12b-draft,gpt-oss-20b,deepseek-v3] [--ratios 0.25,0.5,1] [--results runs.jsonl]
        [--traces-dir DIR] [--conv-token-scale 32] [--azure-token-scale 4] [--decode-arena-bytes N]

For every trace in ``--traces-dir`` (default: ``shared/data/traces`` next to the checkout) and every preset
(SWA + draft, SWA only, MLA), the same slice runs through ``umalloc replay``'s scheduler once per layout on the
same arena bytes (``umalloc_replay.single.layouts``): ``dynamic``; ``static`` at SGLang's default
``--swa-full-tokens-ratio`` (0.8) and at every ``--ratios`` value (the best in hindsight is the *oracle*);
``vllm`` (vLLM's block pool) and ``padded`` (vLLM's unified page). The arenas are sized as ``umalloc replay`` sizes them (the decode arena holds
about six average requests at their peak), so the slice runs under memory pressure.

Every run prints its row as it completes (a refused run: the reason, on its line), a progress line on stderr,
and with ``--results`` its figures as one JSON line. A row: max and mean concurrent requests, admission waits,
retractions, scheduler steps to finish the slice
(a server's throughput; not wall time), peak and mean bytes held, mean bytes lost to padding and to the wrong
pool; the mean concurrency of each layout over the ``--slices`` disjoint slices as mean (min-max). Then, per
trace and preset, dynamic's mean concurrency against the targets: >= 1.3x static at SGLang's
default, >= 1.0x the oracle static ratio, >= 1.2x vLLM's block pool, each marked met or MISSED. Every run verifies every
byte it moved (``ok``). The default run (two traces x three presets, two slices of 64 requests each) prints the
time it took; lower the token scales or raise ``--requests`` to scale up.

``--drift [--jobs 2] [--markdown FILE]``: the headline of docs/capacity.md. The shipped drifting mix
(``benchmarks/data/drift_trace.jsonl``, written by ``make_drift_trace.py``: long-context requests, then short
ones, then long again) on Gemma-3-12B + drafter, gpt-oss-20b and a Llama-4-style chunked geometry (and two
labelled extra runs, Gemma-3-12B alone and Gemma-3-27B), each at its token scale; dynamic against the oracle static ratio (the best of 0.8 and ``--ratios``, default
:data:`DRIFT_RATIOS`, in hindsight), static 0.8, vLLM's block pool (``vllm``) and padded pages, on one decode
arena size per geometry. Each run's
mean and max admitted requests, admission waits, preemptions and steps, its accounting checked (every request
completed, every preemption restored), the verdicts against :data:`DRIFT_TARGETS`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from umalloc.errors import UmallocValueError
from umalloc.geometry.presets import DRAFT_SLIDING, MODELS, PRESETS, ModelGeometry, Preset, preset_ends
from umalloc.geometry.spec import EndRole, LayerSpec
from umalloc_replay.single.layouts import SGLANG_SWA_FULL_TOKENS_RATIO
from umalloc_replay.single.run import Replay, ReplayConfig

ROOT = Path(__file__).resolve().parents[1]
PRESETS_DEFAULT = ("gemma-3-12b-draft", "gpt-oss-20b", "deepseek-v3")
KIND = {"gemma-3-12b-draft": "SWA + draft", "gpt-oss-20b": "SWA only", "deepseek-v3": "MLA (+MTP draft)"}
TARGETS = {"static:0.8": 1.3, "oracle": 1.0, "vllm": 1.2}
#: Defaults: 64 requests per slice (enough for concurrency to matter), two disjoint slices per trace (the spread),
#: static ratios 0.25, 0.5, 1 besides SGLang's 0.8, token scales that keep every run short.
DEFAULT_REQUESTS = 64
DEFAULT_SLICES = 2
DEFAULT_RATIOS = "0.25,0.5,1"
DEFAULT_CONV_SCALE = 32
DEFAULT_AZURE_SCALE = 4


#: ``--drift``: the shipped drifting mix (``make_drift_trace.py``), its presets with their token scales (chosen so
#: a long request's prompt spans several windows and a short one fits inside one), the static ratios swept for
#: the oracle besides SGLang's 0.8.
DRIFT_TRACE = ROOT / "benchmarks" / "data" / "drift_trace.jsonl"
LLAMA4_CHUNK_SCALE = 8
LLAMA4 = f"llama-4-scout-chunk{8192 // LLAMA4_CHUNK_SCALE}"
GEMMA3_27B = "gemma-3-27b"
#: The headline geometries, then two labelled extra runs: Gemma-3-12B without its drafter (what the drafter adds
#: to the comparison with vLLM) and Gemma-3-27B (10 full + 52 sliding layers: vLLM's grouping pads the sliding
#: type to 60 layers).
DRIFT_PRESETS = {"gemma-3-12b-draft": 8, "gpt-oss-20b": 16, LLAMA4: LLAMA4_CHUNK_SCALE, "gemma-3-12b": 8,
                 GEMMA3_27B: 8}
DRIFT_RATIOS = "0.1,0.25,0.5,1"
#: The padded-page target is taken against ``vllm`` (vLLM's block accounting, the faithful model of its hybrid
#: manager); ``padded`` (the physical padding layers alone) is printed beside it.
DRIFT_TARGETS = {"oracle": 1.0, "static:0.8": 1.3, "vllm": 1.2}
DRIFT_LAYOUTS = ("dynamic", "vllm", "padded")
KIND[LLAMA4] = "chunked + full"
KIND["gemma-3-12b"] = "SWA, no drafter (extra)"
KIND[GEMMA3_27B] = "SWA, vLLM pads 8 layers (extra)"


def _register_llama4_chunked() -> None:
    """Llama-4-Scout's KV geometry (HF ``Llama4TextConfig``: 48 layers, 8 KV heads x 128, ``attention_chunk_size``
    8192, ``no_rope_layer_interval`` 4: layer ``i`` with ``(i + 1) % 4 == 0`` attends globally, the others
    within their 8,192-token chunk) as a benchmark preset. A chunked layer holds at most the current chunk, so it
    is an SWA end whose window is the chunk (an upper bound: right after a chunk boundary it holds fewer). Chunk
    and token counts are both divided by :data:`LLAMA4_CHUNK_SCALE` (the bench replays the trace at that token
    scale), which keeps every request's full : chunked bytes as at full scale, up to page rounding."""
    chunk = 8192 // LLAMA4_CHUNK_SCALE
    layers = tuple(LayerSpec.mha(8, 128, window_tokens=None if (i + 1) % 4 == 0 else chunk) for i in range(48))
    MODELS.setdefault(LLAMA4, ModelGeometry(LLAMA4, layers, "HF Llama4TextConfig (Scout), chunk / 8"))
    PRESETS.setdefault(LLAMA4, Preset(LLAMA4, LLAMA4))


_register_llama4_chunked()


def _register_gemma3_27b() -> None:
    """Gemma-3-27B's KV geometry as a benchmark preset (shared/data/models.md, google-deepmind/gemma
    ``Gemma3_27B``: 62 layers of 16 KV heads x 128, the ``(LOCAL x 5, GLOBAL)`` pattern tiled and truncated, so
    10 global and 52 sliding layers, window 1,024). vLLM's grouping takes the group size 10 (52 >= 1.5 x 10)
    and pads the sliding type with 8 layers."""
    layers = tuple(LayerSpec.mha(16, 128, window_tokens=None if i % 6 == 5 else 1024) for i in range(62))
    MODELS.setdefault(GEMMA3_27B, ModelGeometry(GEMMA3_27B, layers, "GEMMA Gemma3_27B (shared/data/models.md)"))
    PRESETS.setdefault(GEMMA3_27B, Preset(GEMMA3_27B, GEMMA3_27B))


_register_gemma3_27b()


def find_traces_dir() -> Path | None:
    """``shared/data/traces`` in the first folder above the checkout that has it."""
    for up in ROOT.parents:
        cand = up / "shared" / "data" / "traces"
        if cand.is_dir():
            return cand
    return None


def run_one(path: Path, model: str, layout: str, requests: int, token_scale: int, skip: int = 0,
            decode_arena_bytes: int | None = None, draft_sliding: str = "swa") -> dict:
    """The capacity figures of one replay (arenas sized from the slice, the same bytes for every layout, or
    ``decode_arena_bytes`` for the decode arena; ``draft_sliding``: where a drafter's sliding layers go,
    :func:`umalloc.geometry.presets.preset_ends`), or ``{"refused": why}`` when the replay refuses the slice (a
    static split or padded pages that cannot hold one request, an arena too small)."""
    cfg = ReplayConfig(trace=str(path), model=model, requests=requests, token_scale=token_scale, layout=layout,
                       verify_final=False, skip=skip, decode_arena_bytes=decode_arena_bytes,
                       draft_sliding=draft_sliding)
    try:
        rep = Replay(cfg).run()
    except UmallocValueError as exc:
        return {"refused": str(exc)}
    cap = dict(rep["capacity"])
    cap["ok"] = rep["ok"]
    cap["requests_total"] = rep["requests"]["total"]
    cap["completed"] = rep["requests"]["completed"]
    cap["restores"] = rep["requests"]["restored"]
    cap["decode_arena_bytes"] = rep["config"]["decode_arena_bytes"]
    return cap


def spread(values: list[float]) -> str:
    """``"mean (min-max)"`` of the slices' figures, or ``"-"`` when none ran.

    >>> spread([2.0, 3.0, 4.0]), spread([1.5]), spread([])
    ('3.00 (2.00-4.00)', '1.50 (1.50-1.50)', '-')
    """
    if not values:
        return "-"
    return f"{sum(values) / len(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def verdicts_of(trace: str, model: str, means: dict[str, list[float]], refused: dict[str, str]) -> list[tuple]:
    """Dynamic's mean concurrency (over the slices) against each target: ``(trace, model, against, ratio or
    None, target, verdict)``. A refused dynamic run gives no ratio (the verdict says why); a refused other
    layout is met (its pools cannot hold the slice, dynamic runs it)."""
    out = []
    mean = {k: sum(v) / len(v) for k, v in means.items() if v}
    statics = {k: m for k, m in mean.items() if k.startswith("static")}
    oracle = max(statics.items(), key=lambda kv: kv[1]) if statics else None
    for name, target in TARGETS.items():
        if "dynamic" not in mean:
            out.append((trace, model, name, None, target, f"n/a: dynamic refused: {refused.get('dynamic', '?')}"))
            continue
        other = oracle[1] if name == "oracle" and oracle else mean.get(name)
        if other is None:
            out.append((trace, model, name, None, target, "met: the layout refuses the slice"))
            continue
        x = mean["dynamic"] / other
        label = f"oracle {oracle[0]}" if name == "oracle" and oracle else name
        out.append((trace, model, label, x, target, "met" if x >= target else "MISSED"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help="requests per slice")
    ap.add_argument("--slices", type=int, default=DEFAULT_SLICES,
                    help="disjoint slices per trace (the spread of the figures is over them)")
    ap.add_argument("--presets", default=",".join(PRESETS_DEFAULT))
    ap.add_argument("--ratios", default=DEFAULT_RATIOS, help="static ratios besides SGLang's default 0.8")
    ap.add_argument("--traces-dir", type=Path, default=None)
    ap.add_argument("--conv-token-scale", type=int, default=DEFAULT_CONV_SCALE,
                    help="token scale of Mooncake JSONL traces")
    ap.add_argument("--azure-token-scale", type=int, default=DEFAULT_AZURE_SCALE,
                    help="token scale of Azure CSV traces")
    ap.add_argument("--decode-arena-bytes", type=int, default=None,
                    help="decode arena bytes of every run (default: sized from each slice)")
    ap.add_argument("--results", type=Path, default=None,
                    help="append every run's figures (or its refusal) to this JSONL file as it completes")
    ap.add_argument("--plot", type=Path, default=None, help="write the layout comparison (.png, .pdf, .svg)")
    ap.add_argument("--drift", action="store_true",
                    help="the drifting workload (docs/capacity.md): the shipped drift trace, its presets and scales")
    ap.add_argument("--drift-trace", type=Path, default=DRIFT_TRACE)
    ap.add_argument("--jobs", type=int, default=1, help="replays run in parallel processes (--drift)")
    ap.add_argument("--markdown", type=Path, default=None, help="--drift: write the summary table here")
    ap.add_argument("--draft-sliding", choices=DRAFT_SLIDING, default="swa",
                    help="--drift: where a drafter's sliding layers go (umalloc.geometry.presets.preset_ends)")
    args = ap.parse_args(argv)
    if args.drift:
        return drift_main(args)
    tdir = args.traces_dir or find_traces_dir()
    if tdir is None:
        raise SystemExit("no shared/data/traces found above the checkout: pass --traces-dir")
    traces = sorted(p for p in tdir.iterdir() if p.suffix in (".jsonl", ".csv"))
    ratios = [float(x) for x in args.ratios.split(",") if x]
    models = args.presets.split(",")
    plan = []
    for path in traces:
        scale = args.azure_token_scale if path.suffix == ".csv" else args.conv_token_scale
        for model in models:
            has_swa = any(e.role is EndRole.SWA for e in preset_ends(model))
            layouts = ["dynamic", "vllm", "padded", f"static:{SGLANG_SWA_FULL_TOKENS_RATIO:g}"]
            if has_swa:
                layouts += [f"static:{r:g}" for r in ratios if r != SGLANG_SWA_FULL_TOKENS_RATIO]
            plan += [(path, model, lay, scale, k) for k in range(args.slices) for lay in layouts]
    results = args.results.open("a", buffering=1) if args.results is not None else None
    rows, t0 = [], time.perf_counter()
    print_header()
    for n, (path, model, lay, scale, k) in enumerate(plan, 1):
        t = time.perf_counter()
        cap = run_one(path, model, lay, args.requests, scale, skip=k * args.requests,
                      decode_arena_bytes=args.decode_arena_bytes)
        row = (path.name, model, lay, scale, k, cap)
        rows.append(row)
        print_row(row)  # each result as it completes, also when a later run fails or is interrupted
        if results is not None:
            results.write(json.dumps({"trace": path.name, "model": model, "layout": lay, "token_scale": scale,
                                      "slice": k, "skip": k * args.requests, "requests": args.requests,
                                      **cap}) + "\n")
        print(f"[{n}/{len(plan)}] {path.name} {model} {lay} slice {k}: "
              f"{'refused' if 'refused' in cap else 'done'} in {time.perf_counter() - t:.1f} s "
              f"({time.perf_counter() - t0:.0f} s so far)", file=sys.stderr, flush=True)
    if results is not None:
        results.close()
    print()
    print(f"{'trace':34} {'preset':18} {'layout':11} mean concurrency over {args.slices} slice(s): mean (min-max)")
    verdicts = []
    for path in traces:
        for model in models:
            group = [r for r in rows if r[0] == path.name and r[1] == model]
            means: dict[str, list[float]] = {}
            refused: dict[str, str] = {}
            for _tr, _m, lay, _s, _k, cap in group:
                if "refused" in cap:
                    refused.setdefault(lay, cap["refused"])
                else:
                    means.setdefault(lay, []).append(cap["mean_running"])
            for lay in dict.fromkeys(r[2] for r in group):
                n_refused = sum(1 for r in group if r[2] == lay and "refused" in r[5])
                print(f"{path.name:34} {model:18} {lay:11} {spread(means.get(lay, []))}"
                      + (f"  ({n_refused} refused)" if n_refused else ""))
            verdicts += verdicts_of(path.name, model, means, refused)
    print()
    print(f"{'trace':34} {'preset':18} {'dynamic vs':18} {'mean conc x':>11} {'target':>7}  verdict")
    for tr, model, name, x, target, verdict in verdicts:
        xs = "-" if x is None else f"{x:.2f}"
        print(f"{tr:34} {model:18} {name:18} {xs:>11} {target:>7.1f}  {verdict}")
    print(f"\n{len(rows)} replays in {time.perf_counter() - t0:.0f} s; every run verified its bytes: "
          f"{all(c.get('ok', True) for *_, c in rows)}")
    if args.plot is not None:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _drift_job(job: tuple) -> tuple:
    path, model, lay, scale, requests, arena, draft_sliding = job
    t = time.perf_counter()
    return job, run_one(path, model, lay, requests, scale, decode_arena_bytes=arena,
                        draft_sliding=draft_sliding), time.perf_counter() - t


def accounting_closes(cap: dict) -> bool:
    """Every request of the run finished and every preemption was restored: ``completed == total`` and
    ``retractions == restores`` (a request is waiting, running, preempted or done; at the end all are done)."""
    return cap["completed"] == cap["requests_total"] and cap["retractions"] == cap["restores"]


def drift_summary(rows: dict[str, dict], ratios_run: list[str]) -> tuple[dict, list[tuple]]:
    """``rows``: layout label -> figures (or ``{"refused": why}``) of one preset. Returns the oracle (``{"label",
    "mean_running"}`` of the best static ratio that ran; ``None`` when none did) and, per target of
    :data:`DRIFT_TARGETS`, ``(against, x or None, target, verdict)``; a refused baseline is met (it cannot run
    the workload in these bytes, dynamic does).

    >>> r = {"dynamic": {"mean_running": 3.0}, "vllm": {"mean_running": 3.0},
    ...      "static:0.8": {"refused": "x"}, "static:0.1": {"mean_running": 2.0}}
    >>> o, v = drift_summary(r, ["static:0.8", "static:0.1"])
    >>> o["label"], [(a, x, verdict) for a, x, _t, verdict in v]
    ('static:0.1', [('oracle static:0.1', 1.5, 'met'), ('static:0.8', None, 'met: refused'), ('vllm', 1.0, 'MISSED')])
    """
    ran = [(lay, rows[lay]["mean_running"]) for lay in ratios_run if "refused" not in rows.get(lay, {"refused": 1})]
    oracle = {"label": max(ran, key=lambda kv: kv[1])[0], "mean_running": max(v for _k, v in ran)} if ran else None
    out = []
    dyn = rows.get("dynamic", {})
    for name, target in DRIFT_TARGETS.items():
        base = oracle if name == "oracle" else rows.get(name)
        label = f"oracle {oracle['label']}" if name == "oracle" and oracle else name
        if "mean_running" not in dyn:
            out.append((label, None, target, "n/a: dynamic refused"))
        elif base is None or "mean_running" not in base:
            out.append((label, None, target, "met: refused"))
        else:
            x = dyn["mean_running"] / base["mean_running"]
            out.append((label, x, target, "met" if x >= target else "MISSED"))
    return oracle, out


def drift_main(args: argparse.Namespace) -> int:
    """``--drift``: every preset of :data:`DRIFT_PRESETS` (or ``--presets``) x every layout on the drift trace,
    the same decode arena bytes per preset (sized by ``umalloc replay`` from the trace), one slice of
    ``--requests`` rows; prints every run, the per-preset summary and the verdicts."""
    presets = DRIFT_PRESETS if args.presets == ",".join(PRESETS_DEFAULT) else \
        {m: DRIFT_PRESETS.get(m, args.conv_token_scale) for m in args.presets.split(",")}
    ratios = args.ratios if args.ratios != DEFAULT_RATIOS else DRIFT_RATIOS
    if args.requests == DEFAULT_REQUESTS:  # default: the whole drift trace
        args.requests = sum(1 for line in args.drift_trace.open() if line.strip())
    statics = [f"static:{SGLANG_SWA_FULL_TOKENS_RATIO:g}"] + \
        [f"static:{float(r):g}" for r in ratios.split(",") if r and float(r) != SGLANG_SWA_FULL_TOKENS_RATIO]
    jobs = [(args.drift_trace, m, lay, sc, args.requests, args.decode_arena_bytes, args.draft_sliding)
            for m, sc in presets.items() for lay in (*DRIFT_LAYOUTS, *statics)]
    print(f"drift trace {args.drift_trace.name}, {args.requests} requests, presets {presets} (token scales), "
          f"static ratios {statics}, {args.jobs} job(s)", flush=True)
    print_header()
    t0 = time.perf_counter()
    res: dict[str, dict[str, dict]] = {m: {} for m in presets}
    results = args.results.open("a", buffering=1) if args.results is not None else None
    # one process per replay: each replay's arenas are returned to the system when it ends
    with ProcessPoolExecutor(max_workers=args.jobs, max_tasks_per_child=1) as ex:
        for n, (job, cap, dt) in enumerate(ex.map(_drift_job, jobs), 1):
            path, model, lay, scale, *_ = job
            res[model][lay] = cap
            print_row((path.name, model, lay, scale, 0, cap))
            if results is not None:
                results.write(json.dumps({"trace": path.name, "model": model, "layout": lay, "token_scale": scale,
                                          "requests": job[4], **cap}) + "\n")
            print(f"[{n}/{len(jobs)}] {model} {lay}: {dt:.1f} s ({time.perf_counter() - t0:.0f} s so far)",
                  file=sys.stderr, flush=True)
    if results is not None:
        results.close()
    lines = ["| preset (token scale) | layout | mean admitted (concurrency) | max | admission waits | "
             "preemptions | steps | dynamic vs it |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    verdicts = []
    for m, sc in presets.items():
        oracle, vs = drift_summary(res[m], statics)
        verdicts += [(m, *v) for v in vs]
        dyn = res[m]["dynamic"].get("mean_running")
        for lay in (*DRIFT_LAYOUTS, *statics):
            cap = res[m][lay]
            tag = " (oracle)" if oracle and lay == oracle["label"] else ""
            if "refused" in cap:
                lines.append(f"| {m} ({sc}) | {lay}{tag} | refused: cannot hold the largest request | | | | | met |")
                continue
            x = dyn / cap["mean_running"] if dyn else None
            lines.append(f"| {m} ({sc}) | {lay}{tag} | {cap['mean_running']:.2f} | {cap['max_running']} | "
                         f"{cap['admission_waits']} | {cap['retractions']} | {cap['steps']} | "
                         f"{'' if x is None or lay == 'dynamic' else f'{x:.2f}x'} |")
    table = "\n".join(lines)
    print("\n" + table + "\n")
    for m, against, x, target, verdict in verdicts:
        print(f"{m:24} dynamic vs {against:20} {'-' if x is None else f'{x:.2f}x':>7} target {target:.1f}x  {verdict}")
    ran = [c for r in res.values() for c in r.values() if "refused" not in c]
    ok = all(c["ok"] for c in ran)
    closed = all(accounting_closes(c) for c in ran)
    print(f"\n{len(jobs)} replays in {time.perf_counter() - t0:.0f} s; every run verified its bytes: {ok}; "
          f"every run's accounting closed: {closed}")
    if args.markdown is not None:
        args.markdown.write_text(table + "\n")
    return 0 if ok and closed else 1


_HEADER = (f"{'trace':34} {'preset':18} {'layout':11} {'scale':>5} {'slice':>5} {'arena GB':>8} {'conc max':>8} "
           f"{'conc mean':>9} {'adm waits':>9} {'retract':>7} {'steps':>6} {'held pk GB':>10} {'held mn GB':>10} "
           f"{'pad MB':>7} {'wrong MB':>8}")


def print_header() -> None:
    print(_HEADER, flush=True)


def print_row(row: tuple) -> None:
    """One run's line; a refused run says why (the whole reason, on its line)."""
    tr, model, lay, scale, k, c = row
    if "refused" in c:
        print(f"{tr:34} {model:18} {lay:11} {scale:>5} {k:>5}  refused: {c['refused']}", flush=True)
        return
    print(f"{tr:34} {model:18} {lay:11} {scale:>5} {k:>5} {c['decode_arena_bytes'] / 1e9:8.2f} "
          f"{c['max_running']:8d} {c['mean_running']:9.2f} {c['admission_waits']:9d} {c['retractions']:7d} "
          f"{c['steps']:6d} {c['peak_held_bytes'] / 1e9:10.2f} {c['mean_held_bytes'] / 1e9:10.2f} "
          f"{c['mean_padding_bytes'] / 1e6:7.1f} {c['mean_wrong_pool_bytes'] / 1e6:8.1f}", flush=True)


def plot(rows: list, out: Path) -> None:
    """One panel per (trace, preset): mean concurrency of dynamic, padded and every static ratio (SGLang's default
    hatched; a ratio whose pools cannot hold the slice's largest request marked "refused")."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    traces = sorted({r[0] for r in rows})
    models = list(dict.fromkeys(r[1] for r in rows))
    fig, axes = plt.subplots(len(traces), len(models), figsize=(4.6 * len(models), 3.6 * len(traces)),
                             squeeze=False)
    for ti, tr in enumerate(traces):
        for mi, model in enumerate(models):
            ax = axes[ti][mi]
            by_layout: dict[str, list[dict]] = {}
            for t, m, lay, _s, _k, c in rows:
                if t == tr and m == model:
                    by_layout.setdefault(lay, []).append(c)
            # a layout's bar: its mean concurrency over the slices that ran; "refused" when none did
            items = []
            for lay, caps in by_layout.items():
                ran = [c["mean_running"] for c in caps if "refused" not in c]
                items.append((lay, {"mean_running": sum(ran) / len(ran)} if ran else {"refused": True}))
            items.sort(key=lambda x: (not x[0].startswith("dynamic"), not x[0].startswith("padded"),
                                      float(x[0].split(":")[1]) if ":" in x[0] else 0.0))
            top = max((c["mean_running"] for _l, c in items if "refused" not in c), default=1.0)
            for x, (lay, c) in enumerate(items):
                color = "tab:green" if lay == "dynamic" else "tab:purple" if lay == "padded" else "tab:orange"
                if "refused" in c:
                    ax.text(x, top * 0.03, "refused", rotation=90, ha="center", va="bottom", fontsize=7)
                    continue
                ax.bar(x, c["mean_running"], color=color,
                       hatch="//" if lay == f"static:{SGLANG_SWA_FULL_TOKENS_RATIO:g}" else None)
            ax.set_xticks(range(len(items)), [lay for lay, _c in items], rotation=35, ha="right", fontsize=7)
            ax.set_ylim(0, top * 1.15)
            ax.set_xlim(-0.6, len(items) - 0.4)
            ax.set_title(f"{tr} — {model} ({KIND.get(model, '')})", fontsize=8)
            if mi == 0:
                ax.set_ylabel("mean concurrent requests", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle("decode arena capacity by layout (same bytes, same scheduler); hatched: SGLang's default ratio",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
