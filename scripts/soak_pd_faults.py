"""Long PD fault soak of the replay's prefill -> decode hand-off, with a summary and the table of faults.

    PYTHONPATH=$PWD UCX_NET_DEVICES=lo MC_LOG_LEVEL=ERROR python scripts/soak_pd_faults.py --requests 20000 \
        [--minutes M] [--seed S] [--backend local|nixl|mooncake ...]

``local`` (always run): :func:`umalloc_replay.faults.fault_soak` -- the prefill side killed and restarted, the
peer stalled past the lease deadlines, decode cancellations while KV is in flight, in one process. ``nixl`` /
``mooncake`` (each ``--backend`` named; skipped with a line when the engine cannot start here):
:func:`umalloc_replay.faults_remote.remote_fault_soak` -- a real prefill process killed with SIGKILL while its
KV is in flight and restarted, and decode cancellations, ``--requests // 10`` requests (each restart spawns a
process). Requests lost to a fault are retried (at most 4 attempts) or reported failed, never decoded; every
other request is verified page by page. ``UMALLOC_SEED`` or ``--seed``.

Exit status: 0 when every fault was survived, no completed request differed, nothing leaked and no process is
left; 1 otherwise; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--minutes", type=float, default=None, help="stop admitting new requests after this long")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--backend", action="append", choices=("nixl", "mooncake"), default=[],
                   help="also run the two-process soak over this engine (repeatable)")
    args = p.parse_args(argv)
    if args.requests < 10:
        p.error(f"--requests={args.requests}: allowed >= 10")
    if args.minutes is not None and args.minutes <= 0:
        p.error(f"--minutes={args.minutes}: allowed > 0")
    from umalloc.errors import BackendUnavailable
    from umalloc.testing import seed_from_env
    from umalloc_replay.faults import fault_soak, fault_table, summary
    from umalloc_replay.faults_remote import remote_fault_soak, remote_summary

    # lease expiries of the stalled peer are the fault itself: counted in the table, not logged one by one
    logging.getLogger("umalloc").setLevel(logging.ERROR)
    seed = seed_from_env(20261205) if args.seed is None else args.seed
    problems: list[str] = []
    res = fault_soak(args.requests, seed, minutes=args.minutes, log=lambda s: print(s, flush=True))
    print(f"local: {summary(res)}")
    print(fault_table(res))
    if res.survived != res.injected:
        problems.append(f"local: faults not survived {res.injected} vs {res.survived}")
    if res.mismatched_pages or any(res.leaks.values()):
        problems.append(f"local: mismatched pages {res.mismatched_pages}, leaks {res.leaks}")
    for backend in args.backend:
        try:
            r = remote_fault_soak(backend, max(10, args.requests // 10), seed, minutes=args.minutes,
                                  log=lambda s: print(s, flush=True))
        except BackendUnavailable as exc:
            print(f"{backend}: skipped, the engine cannot start here: {exc}")
            continue
        print(f"{backend}: {remote_summary(r)}")
        print("| fault | injected | survived | requests hit |\n| --- | --- | --- | --- |")
        for k in r.injected:
            print(f"| {k} | {r.injected[k]} | {r.survived[k]} | {r.requests_hit[k]} |")
        if r.survived != r.injected or r.mismatched_pages or any(r.leaks.values()):
            problems.append(f"{backend}: injected {r.injected} survived {r.survived} mismatched "
                            f"{r.mismatched_pages} leaks {r.leaks}")
    for prob in problems:
        print(f"error: {prob}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
