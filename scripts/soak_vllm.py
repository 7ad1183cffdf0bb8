"""Long soak of umalloc's vLLM block pool under vLLM's own scheduler, with a summary.

    PYTHONPATH=<folder holding only umalloc> VLLM_TARGET_DEVICE=cpu .peer/vllm-venv/bin/python scripts/soak_vllm.py \
        --requests 5000 [--minutes M] [--blocks 64] [--seed S] [--no-prefix-caching]

Runs the driver of tests/integrations/test_vllm_soak.py (requests of mixed lengths arriving in random bursts,
aborts mid-generation and while waiting, a tight pool that makes the scheduler preempt, shared prompt prefixes,
``check_invariants()`` after every step) on umalloc's pool (admitting stops after ``--minutes``), then the same
requests on vLLM's stock pool as the oracle: every request's tokens and finish reason equal, and with prefix
caching off the whole per-step schedule. Needs vLLM 0.33 (``scripts/peer_suite_vllm.sh`` builds the venv).
``UMALLOC_SEED`` or ``--seed``.

Exit status: 0 when nothing leaked and the results equal stock's; 1 otherwise; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import tempfile


def load_driver():  # type: ignore[no-untyped-def]
    path = pathlib.Path(__file__).resolve().parents[1] / "tests" / "integrations" / "test_vllm_soak.py"
    spec = importlib.util.spec_from_file_location("vllm_soak_driver", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--minutes", type=float, default=None, help="stop admitting requests after this long")
    p.add_argument("--blocks", type=int, default=64, help="pool size in blocks of 16 tokens (tight: preemptions)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    args = p.parse_args(argv)
    if args.requests < 10:
        p.error(f"--requests={args.requests}: allowed >= 10")
    if args.minutes is not None and args.minutes <= 0:
        p.error(f"--minutes={args.minutes}: allowed > 0")
    if args.blocks < 40:
        p.error(f"--blocks={args.blocks}: allowed >= 40 (the longest prompt needs 38 blocks)")
    d = load_driver()
    seed = d.seed_from_env() if args.seed is None else args.seed
    caching = not args.no_prefix_caching
    print(f"seed={seed} requests={args.requests} minutes={args.minutes} blocks={args.blocks} "
          f"prefix_caching={caching}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = d.model_dir(pathlib.Path(tmp))
        reqs = d.workload(args.requests, seed)
        um = d.soak(reqs, path, use_umalloc=True, prefix_caching=caching, seed=seed, num_blocks=args.blocks,
                    minutes=args.minutes, log=lambda s: print(s, flush=True))
        stock = d.soak(reqs[:um.requests], path, use_umalloc=False, prefix_caching=caching, seed=seed,
                       num_blocks=args.blocks)
    print(d.summary(stock))
    print(d.summary(um))
    problems = d.compare(um, stock)
    if any(um.leaks.values()):
        problems.append(f"leaks {um.leaks}")
    print("summary:")
    print(f"  requests={um.requests} steps={um.steps} seconds={um.seconds:.1f} (stock {stock.seconds:.1f}) "
          f"aborts={um.aborted_running} mid-generation + {um.aborted_waiting} waiting, "
          f"preemptions={um.preemptions} (stock {stock.preemptions}), prefix hit tokens={um.prefix_hit_tokens} "
          f"(stock {stock.prefix_hit_tokens})")
    print(f"  invariants checked after each of {um.steps} steps; free blocks start={um.free_at_start} "
          f"end={um.free_at_end}; leaks={sum(um.leaks.values())}; results equal stock's: {not problems}; "
          f"per-step schedule identical to stock's: {um.schedule == stock.schedule}")
    for prob in problems:
        print(f"error: {prob}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
