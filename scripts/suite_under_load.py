"""Run slices of the test suite, one after another, beside ``--busy`` CPU-bound processes (default ``nproc``):
issue 26 item 25's "the suite stays green on a busy machine". Not part of CI (it takes minutes and loads the
machine on purpose). Prints, per slice, its wall time and pytest's summary line; exit 1 if any slice failed.

    PYTHONPATH=$PWD .venv/bin/python scripts/suite_under_load.py tests/requests tests/backends tests/app

Each slice is one ``pytest -q`` process (``-p no:cacheprovider``). The busy processes spin in pure Python until the
last slice ended; one that dies early fails the run (the load was not there)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

BUSY = "while True:\n    pass\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("slices", nargs="+", help="test paths, one pytest run each, in order")
    p.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="busy processes (default: nproc)")
    a = p.parse_args(argv)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True) for _ in range(a.busy)]
    failed = 0
    try:
        for path in a.slices:
            t0 = time.monotonic()
            res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                                 capture_output=True, text=True)
            took = time.monotonic() - t0
            summary = (res.stdout.strip().splitlines() or ["(no output)"])[-1]
            print(f"{path}: {took:.0f} s beside {a.busy} busy processes, exit {res.returncode}: {summary}",
                  flush=True)
            if res.returncode != 0:
                failed += 1
                print(res.stdout[-4000:], res.stderr[-2000:], sep="\n", flush=True)
        if any(b.poll() is not None for b in busy):
            print("a busy process ended early: the load was not there", flush=True)
            failed += 1
    finally:
        for b in busy:
            os.killpg(b.pid, signal.SIGKILL)
            b.wait()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
