"""Capacity of the decode arena under each layout: one multi-ended arena (dynamic) against SGLang-style static
pools and vLLM-style padded pages, on the shipped real traces. Never part of the test run.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_capacity.py [--requests 16] [--plot capacity.png]
        [--presets gemma-3-12b-draft,gpt-oss-20b,deepseek-v3] [--ratios 0.1,0.25,0.5,0.8,1,1.5]
        [--traces-dir DIR] [--conv-token-scale 8] [--azure-token-scale 1]

For every trace in ``--traces-dir`` (default: ``shared/data/traces`` next to the checkout) and every preset
(SWA + draft, SWA only, MLA), the same slice runs through ``umalloc replay``'s scheduler once per layout on the
same arena bytes (``umalloc.replay.layouts``): ``dynamic``; ``static`` at SGLang's default
``--swa-full-tokens-ratio`` (0.8) and at every ``--ratios`` value (the best in hindsight is the *oracle*);
``padded`` (vLLM's unified page). The arenas are sized as ``umalloc replay`` sizes them (the decode arena holds
about six average requests at their peak), so the slice runs under memory pressure.

One table: max and mean concurrent requests, admission waits, retractions, scheduler steps to finish the slice
(a server's throughput; not wall time), peak and mean bytes held, mean bytes lost to padding and to the wrong
pool. Then, per trace and preset, dynamic's mean concurrency against the targets: >= 1.3x static at SGLang's
default, >= 1.0x the oracle static ratio, >= 1.2x padded, each marked met or MISSED. Every run verifies every
byte it moved (``ok``). The default run (two traces x three presets, 16 requests each) takes a few minutes on
2 cores; raise ``--requests`` to scale up.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from umalloc.errors import UmallocValueError
from umalloc.geometry.presets import preset_ends
from umalloc.geometry.spec import EndRole
from umalloc.replay.layouts import SGLANG_SWA_FULL_TOKENS_RATIO
from umalloc.replay.run import Replay, ReplayConfig

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("gemma-3-12b-draft", "gpt-oss-20b", "deepseek-v3")
KIND = {"gemma-3-12b-draft": "SWA + draft", "gpt-oss-20b": "SWA only", "deepseek-v3": "MLA (+MTP draft)"}
TARGETS = {"static:0.8": 1.3, "oracle": 1.0, "padded": 1.2}


def find_traces_dir() -> Path | None:
    """``shared/data/traces`` in the first folder above the checkout that has it."""
    for up in ROOT.parents:
        cand = up / "shared" / "data" / "traces"
        if cand.is_dir():
            return cand
    return None


def run_one(path: Path, model: str, layout: str, requests: int, token_scale: int) -> dict:
    """The capacity figures of one replay (arenas sized from the slice, the same bytes for every layout), or
    ``{"refused": why}`` when a static split cannot hold one request of the slice."""
    cfg = ReplayConfig(trace=str(path), model=model, requests=requests, token_scale=token_scale, layout=layout,
                       verify_final=False)
    try:
        rep = Replay(cfg).run()
    except UmallocValueError as exc:
        return {"refused": str(exc)}
    cap = dict(rep["capacity"])
    cap["ok"] = rep["ok"]
    cap["decode_arena_bytes"] = rep["config"]["decode_arena_bytes"]
    return cap


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--ratios", default="0.1,0.25,0.5,0.8,1,1.5")
    ap.add_argument("--traces-dir", type=Path, default=None)
    ap.add_argument("--conv-token-scale", type=int, default=8, help="token scale of Mooncake JSONL traces")
    ap.add_argument("--azure-token-scale", type=int, default=1, help="token scale of Azure CSV traces")
    ap.add_argument("--plot", type=Path, default=None, help="write the layout comparison as a PNG")
    args = ap.parse_args()
    tdir = args.traces_dir or find_traces_dir()
    if tdir is None:
        raise SystemExit("no shared/data/traces found above the checkout: pass --traces-dir")
    traces = sorted(p for p in tdir.iterdir() if p.suffix in (".jsonl", ".csv"))
    ratios = [float(x) for x in args.ratios.split(",")]
    rows, verdicts = [], []
    t0 = time.perf_counter()
    for path in traces:
        scale = args.azure_token_scale if path.suffix == ".csv" else args.conv_token_scale
        for model in args.presets.split(","):
            has_swa = any(e.role is EndRole.SWA for e in preset_ends(model))
            layouts = ["dynamic", "padded", f"static:{SGLANG_SWA_FULL_TOKENS_RATIO:g}"]
            if has_swa:
                layouts += [f"static:{r:g}" for r in ratios if r != SGLANG_SWA_FULL_TOKENS_RATIO]
            res = {lay: run_one(path, model, lay, args.requests, scale) for lay in layouts}
            for lay, cap in res.items():
                rows.append((path.name, model, lay, scale, res["dynamic"]["decode_arena_bytes"], cap))
            statics = {k: v for k, v in res.items() if k.startswith("static") and "refused" not in v}
            oracle = max(statics.items(), key=lambda kv: kv[1]["mean_running"]) if statics else None
            dyn = res["dynamic"]["mean_running"]
            for name, target in TARGETS.items():
                other = oracle[1] if name == "oracle" and oracle else res.get(name)
                if not other or "refused" in other:
                    # the pools cannot hold the slice's largest request in these bytes; dynamic runs it
                    verdicts.append((path.name, model, name, None, target, "met: static refuses the slice"))
                    continue
                x = dyn / other["mean_running"]
                label = f"oracle {oracle[0]}" if name == "oracle" else name
                verdicts.append((path.name, model, label, x, target, "met" if x >= target else "MISSED"))
    print_table(rows)
    print()
    print(f"{'trace':34} {'preset':18} {'dynamic vs':18} {'mean conc x':>11} {'target':>7}  verdict")
    for tr, model, name, x, target, verdict in verdicts:
        xs = "inf" if x is None else f"{x:.2f}"
        print(f"{tr:34} {model:18} {name:18} {xs:>11} {target:>7.1f}  {verdict}")
    print(f"\n{len(rows)} replays in {time.perf_counter() - t0:.0f} s; every run verified its bytes: "
          f"{all(c.get('ok', True) for *_, c in rows)}")
    if args.plot is not None:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")


def print_table(rows: list) -> None:
    hdr = (f"{'trace':34} {'preset':18} {'layout':11} {'scale':>5} {'arena GB':>8} {'conc max':>8} "
           f"{'conc mean':>9} {'adm waits':>9} {'retract':>7} {'steps':>6} {'held pk GB':>10} {'held mn GB':>10} "
           f"{'pad MB':>7} {'wrong MB':>8}")
    print(hdr)
    for tr, model, lay, scale, dec, c in rows:
        if "refused" in c:
            print(f"{tr:34} {model:18} {lay:11} {scale:>5} {dec / 1e9:8.2f}  refused: a request exceeds a pool")
            continue
        print(f"{tr:34} {model:18} {lay:11} {scale:>5} {dec / 1e9:8.2f} {c['max_running']:8d} "
              f"{c['mean_running']:9.2f} {c['admission_waits']:9d} {c['retractions']:7d} {c['steps']:6d} "
              f"{c['peak_held_bytes'] / 1e9:10.2f} {c['mean_held_bytes'] / 1e9:10.2f} "
              f"{c['mean_padding_bytes'] / 1e6:7.1f} {c['mean_wrong_pool_bytes'] / 1e6:8.1f}")


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
            items = [(lay, c) for t, m, lay, _s, _d, c in rows if t == tr and m == model]
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
    main()
