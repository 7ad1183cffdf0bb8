"""The suite on a busy machine. At load 12-15 on 2 cores two tests failed that pass alone (a
SIGINT during start-up, a host-memory refusal). This test runs a slice of the suite — those tests and the
start-up Ctrl-C tests — in a second pytest beside ``2 x nproc`` busy-looping processes, and requires it to pass.

It takes minutes, so it runs only with ``UMALLOC_LOAD_TEST=1`` (``UMALLOC_LOAD_TEST=1 pytest
tests/app/test_suite_under_load.py -s`` prints how long the slice took). Nothing in it depends on timing: the
slice's tests inject their interrupts at known steps or wait for output, and see a fixed host memory
(``conftest.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The slice: the two tests that failed under load, and the deterministic start-up interrupts.
SLICE = [
    "tests/app/test_cli.py::test_ctrl_c_is_quiet_ends_every_child_and_exits_130",
    "tests/app/test_cli.py::test_the_host_memory_refusal_follows_the_injected_figure_not_the_machine",
    "tests/app/test_cli.py::test_sizes_larger_than_the_machine_are_refused",
    "tests/app/test_replay_ranks.py::test_a_killed_rank_ends_every_rank_with_one_error_line_naming_it",
    "tests/app/test_cli_start_up.py::test_ctrl_c_during_start_up_is_quiet_and_exits_130",
]

BUSY = "import os\nos.nice(0)\nwhile True:\n    pass\n"


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(os.environ.get("UMALLOC_LOAD_TEST", "") in ("", "0"), reason="set UMALLOC_LOAD_TEST=1")
def test_a_slice_of_the_suite_passes_beside_2x_nproc_busy_processes() -> None:
    n = 2 * (os.cpu_count() or 1)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True) for _ in range(n)]
    try:
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SLICE],
                             cwd=ROOT, capture_output=True, text=True, timeout=3600)
        took = time.monotonic() - t0
        assert all(p.poll() is None for p in busy), "a busy process ended early: the load was not there"
    finally:
        for p in busy:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    print(f"\nthe slice ({len(SLICE)} test functions) beside {n} busy processes took {took:.0f} s")
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert " passed" in res.stdout and " failed" not in res.stdout, res.stdout[-3000:]
