"""Run slices of the test suite, one after another, beside ``--busy`` CPU-bound processes (default ``nproc``):
issue 26 item 25's "the suite stays green on a busy machine". Not part of CI (it takes minutes and loads the
machine on purpose). Prints, per slice, its wall time and pytest's summary line, then the total; exit 1 if any slice
failed.

    PYTHONPATH=$PWD .venv/bin/python scripts/suite_under_load.py                  # the whole suite, slice by slice
    PYTHONPATH=$PWD .venv/bin/python scripts/suite_under_load.py tests/requests tests/app

Without slices, the slices are the entries of ``tests/`` (folders and ``test_*.py`` files) and the whole suite runs as
``scripts/test.sh`` runs it (the transformers equality matrix, which runs in its peer venv, left out). Each slice is
one ``pytest -q`` process (``-p no:cacheprovider``); a slice in which every test was skipped or none was collected
(pytest exit 5: the engine it needs is not in this venv) counts as passed. The busy processes spin in pure Python
until the last slice ended, each holding ``--hold-mib`` of memory; one that dies early fails the run (the load was not there)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

# A busy process holds ``sys.argv[1]`` MiB of touched memory (memory load) and spins (CPU load).
BUSY = "import sys\nheld = bytearray(int(sys.argv[1]) << 20)\nwhile True:\n    pass\n"
LEFT_OUT = "tests/integrations/test_transformers_cb.py"   # runs in the transformers peer venv (scripts/test.sh)
NO_TESTS_COLLECTED = 5


def default_slices(root: str = "tests") -> list[str]:
    """The entries of ``root`` that hold tests: folders with a ``test_*.py`` anywhere below, and ``test_*.py`` files."""
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if os.path.isdir(path) and any(f.startswith("test_") and f.endswith(".py")
                                       for _, _, files in os.walk(path) for f in files):
            out.append(path)
        elif name.startswith("test_") and name.endswith(".py"):
            out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("slices", nargs="*", help="test paths, one pytest run each, in order (default: all of tests/)")
    p.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="busy processes (default: nproc)")
    p.add_argument("--hold-mib", type=int, default=1024, help="MiB of memory each busy process holds (default 1024)")
    a = p.parse_args(argv)
    slices = a.slices or default_slices()
    busy = [subprocess.Popen([sys.executable, "-c", BUSY, str(a.hold_mib)], start_new_session=True) for _ in range(a.busy)]
    failed = 0
    start = time.monotonic()
    try:
        for path in slices:
            t0 = time.monotonic()
            res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  f"--ignore={LEFT_OUT}", path], capture_output=True, text=True)
            took = time.monotonic() - t0
            summary = (res.stdout.strip().splitlines() or ["(no output)"])[-1]
            print(f"{path}: {took:.0f} s beside {a.busy} busy processes ({a.hold_mib} MiB each), exit {res.returncode}: {summary}",
                  flush=True)
            if res.returncode not in (0, NO_TESTS_COLLECTED):
                failed += 1
                print(res.stdout[-4000:], res.stderr[-2000:], sep="\n", flush=True)
        if any(b.poll() is not None for b in busy):
            print("a busy process ended early: the load was not there", flush=True)
            failed += 1
        print(f"total: {time.monotonic() - start:.0f} s for {len(slices)} slices, {failed} failed", flush=True)
    finally:
        for b in busy:
            os.killpg(b.pid, signal.SIGKILL)
            b.wait()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
