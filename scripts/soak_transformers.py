"""Long soak of umalloc inside transformers' continuous batching, with a summary.

    PYTHONPATH=$PWD python scripts/soak_transformers.py --requests 2000 --minutes 10 [--model llama|gemma3]
        [--seed S] [--no-check]

Runs the driver of tests/integrations/test_transformers_soak.py (arrivals in random bursts, cancellations
mid-generation and as queued, requests that cannot fit alone, a small arena, forced compaction,
``check_invariants()`` after every step): a short warm-up of both caches (one-time allocations out of the RSS
figures), the workload on umalloc (adding requests stops after ``--minutes``), the same requests on transformers'
stock cache (RSS comparison; it skips the requests that cannot fit alone), then every finished request's tokens
against stock ``generate_batch`` on the same prompts, and a fork phase (``num_return_sequences=2``). Needs
transformers 5.23 or 5.25 (the transformers peer venv, or /work/main/.venv). ``UMALLOC_SEED`` or ``--seed``.

Exit status: 0 when nothing leaked, only the requests that cannot fit alone failed, no request cancelled
mid-generation finished, and the tokens equal stock's; 1 otherwise; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import pathlib
import sys


def load_driver():  # type: ignore[no-untyped-def]
    path = pathlib.Path(__file__).resolve().parents[1] / "tests" / "integrations" / "test_transformers_soak.py"
    spec = importlib.util.spec_from_file_location("transformers_soak_driver", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--minutes", type=float, default=None, help="stop adding requests after this long")
    p.add_argument("--model", choices=("llama", "gemma3"), default="llama")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-check", action="store_true", help="skip the token comparison with stock generate_batch")
    args = p.parse_args(argv)
    if args.requests < 10:
        p.error(f"--requests={args.requests}: allowed >= 10")
    if args.minutes is not None and args.minutes <= 0:
        p.error(f"--minutes={args.minutes}: allowed > 0")
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    d = load_driver()
    seed = d.seed_from_env() if args.seed is None else args.seed
    print(f"seed={seed} model={args.model} requests={args.requests} minutes={args.minutes}", flush=True)
    model = d.build_model(args.model, seed)
    warm = d.workload(20, seed + 7)
    d.soak(model, args.model, warm, use_umalloc=False, seed=seed)
    d.soak(model, args.model, warm, use_umalloc=True, seed=seed)

    reqs = d.workload(args.requests, seed)
    um = d.soak(model, args.model, reqs, use_umalloc=True, seed=seed, minutes=args.minutes,
                log=lambda s: print(s, flush=True))
    ran = reqs[:um.requests]
    stock = d.soak(model, args.model, ran, use_umalloc=False, seed=seed)
    print(d.summary(stock))
    print(d.summary(um))

    problems = []
    unfit = {r.rid for r in ran if r.kind == "unfit"}
    if set(um.failed) != unfit:
        problems.append(f"failed {sorted(set(um.failed) ^ unfit)[:10]} (expected only {sorted(unfit)})")
    if set(um.cancelled_in_flight) & set(um.tokens):
        problems.append("a request cancelled mid-generation finished")
    if any(um.leaks.values()):
        problems.append(f"leaks {um.leaks}")
    compared = 0
    if not args.no_check:
        try:
            compared = d.check_tokens(um, ran, model)
        except AssertionError as e:
            problems.append(f"tokens differ from stock generate_batch: {str(e)[:300]}")
    same, fc = d.fork_phase(model, [r.prompt for r in ran[:32] if r.kind != "unfit"], 8)
    if not same:
        problems.append("fork phase: tokens differ from stock")
    c = um.counters
    print("summary:")
    print(f"  requests={um.requests} finished={len(um.tokens)} cancelled={len(um.cancelled_in_flight)} in flight + "
          f"{len(um.cancelled_queued)} queued, failed={len(um.failed)} (cannot fit alone: {len(unfit)}), "
          f"minutes={um.seconds / 60:.1f}")
    print(f"  steps={c.steps} compactions={c.compactions} pages moved={c.pages_moved} refused={c.refused_allocations} "
          f"prefix hits={c.prefix_hits} evicted={c.evicted_pages} forks(phase 2)={fc.forks} identical={same}")
    print(f"  leaks={sum(um.leaks.values())} tokens compared with stock={compared}")
    print(f"  rss growth MiB: stock={(stock.rss_after - stock.rss_before) / 2**20:+.1f} "
          f"umalloc={(um.rss_after - um.rss_before) / 2**20:+.1f}  peak MiB: stock={stock.rss_peak / 2**20:.1f} "
          f"umalloc={um.rss_peak / 2**20:.1f}")
    for prob in problems:
        print(f"error: {prob}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
