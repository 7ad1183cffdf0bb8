"""Long soak of the umalloc SGLang allocator classes against SGLang's own, with a summary.

    PYTHONPATH=.peer/path .peer/sglang-venv/bin/python scripts/soak_sglang.py [--sequences N] [--ops M]
        [--classes token,paged,swa,unified] [--seed S]

(the venv and .peer/path are scripts/peer_suite_sglang.sh's). Runs tests/integrations/sglang_soak.py: for every
class and page size of the differential (token at 1; paged, SWA and unified at 1, 16 and 64), ``--sequences``
seeded op streams of ``--ops`` ops each (default 5,000: 100x the differential's 50), compared op by op with SGLang's
class, ``check_invariants()`` after every op, and the tokens each side leaked once every request is freed. Prints
one line per class and page size and a total: ops, sequences, seconds, pages/slots leaked, invariant checks held.
``UMALLOC_SEED`` or ``--seed``.

Exit status: 0 when every sequence matched SGLang and nothing leaked on either side; 1 otherwise; 2 on bad
arguments.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    sys.path[:0] = [str(ROOT / "tests" / "integrations"), str(ROOT / "tests" / "peer")]
    import sglang_cpu_shims

    sglang_cpu_shims.prepare()  # before any SGLang allocator module is imported
    from sglang_differential import CLASS_PAGE_SIZES
    from sglang_soak import SOAK_OPS, soak

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=4)
    p.add_argument("--ops", type=int, default=SOAK_OPS)
    p.add_argument("--classes", default=",".join(CLASS_PAGE_SIZES))
    p.add_argument("--seed", type=int, default=int(os.environ.get("UMALLOC_SEED", "38")))
    args = p.parse_args(argv)
    kinds = args.classes.split(",")
    if args.sequences < 1 or args.ops < 1 or any(k not in CLASS_PAGE_SIZES for k in kinds):
        p.error(f"--sequences and --ops >= 1, --classes from {','.join(CLASS_PAGE_SIZES)}")
    print(f"seed={args.seed} (override with --seed or UMALLOC_SEED); {args.sequences} sequences x {args.ops} ops "
          f"per class and page size", flush=True)
    t0 = time.perf_counter()
    total_ops = total_seq = leaked = leaked_sglang = checks = 0
    failed: list[str] = []
    for kind in kinds:
        for ps in CLASS_PAGE_SIZES[kind]:
            res = soak(kind, ps, args.sequences, args.ops, args.seed)
            print(res.summary(), flush=True)
            for f in res.failures[:3]:
                print(f"  first failure: {f}")
            total_ops += res.ops
            total_seq += res.sequences
            leaked += res.leaked_pages_umalloc
            leaked_sglang += res.leaked_tokens_sglang
            checks += res.invariant_checks
            failed += res.failures
    print(f"soak total: {total_ops} ops, {total_seq} sequences, {time.perf_counter() - t0:.0f} s, pages/slots leaked "
          f"{leaked} (SGLang's classes: {leaked_sglang} tokens), check_invariants held {checks}x, "
          f"{len(failed)} sequences failed")
    return 0 if not failed and leaked == 0 and leaked_sglang == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
