"""One line per outcome on stderr for the console script's NIXL runs: a passing ``replay``/``generate`` prints no
engine line (the receiving side says no goodbye to a prefill process that already ended), a killed prefill
process gives exactly one ``error:`` line (no lease warning before it), and SIGTERM is handled as Ctrl-C: every
child ended, one ``terminated`` line, exit 143. Run with ``UCX_NET_DEVICES=lo MC_LOG_LEVEL=ERROR`` as
scripts/test.sh sets them."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest
from process_tree import descendant_pids, wait_all_ended

from umalloc.testing import require_or_skip

CLI = [sys.executable, "-c", "from umalloc_replay.cli import app; app()"]


def engine_lines(text: str) -> list[str]:
    """Lines a transfer engine's C++ logging wrote (glog/abseil ``E1204 12:00:00...`` or a NIXL status name)."""
    return [ln for ln in text.splitlines()
            if "NIXL_ERR" in ln or (len(ln) > 5 and ln[0] in "EWF" and ln[1:5].isdigit())]


@pytest.mark.backend
def test_a_passing_nixl_replay_prints_no_engine_line() -> None:
    require_or_skip("nixl")
    res = subprocess.run([*CLI, "replay", "--backend", "nixl", "--requests", "4", "--token-scale", "64",
                          "--no-progress", "--format", "json"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert engine_lines(res.stderr) == [] and res.stderr.strip() == "", res.stderr


@pytest.mark.backend
def test_a_passing_nixl_generate_prints_no_engine_line() -> None:
    pytest.importorskip("transformers")
    require_or_skip("nixl")
    res = subprocess.run([*CLI, "generate", "--model", "gemma3", "--backend", "nixl", "--requests", "3", "--no-progress", "--format",
                          "json"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(r"prefill process: pid \d+ \(nixl\)", lines[0]), res.stderr


def run_and_end(act: Callable[[subprocess.Popen, int], None]) -> tuple[int, list[str], int]:
    """``umalloc generate --backend nixl`` (eight requests, one in the batch at a time) in a session of its own; once it names
    its prefill process, ``act(proc, prefill_pid)``; then wait for it (a hang guard) and check that no process of
    the run outlives it. Returns the exit status, every output line and the prefill pid."""
    pytest.importorskip("transformers")
    require_or_skip("nixl")
    proc = subprocess.Popen([*CLI, "generate", "--model", "gemma3", "--backend", "nixl",
                             "--requests", "8", "--max-batch", "1", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    lines: list[str] = []
    pid, kids = -1, set()
    try:
        for raw in iter(proc.stdout.readline, b""):  # type: ignore[union-attr]
            lines.append(raw.decode(errors="replace").rstrip("\n"))
            m = re.fullmatch(r"prefill process: pid (\d+) \(nixl\)", lines[-1])
            if m:
                pid, kids = int(m[1]), descendant_pids(proc.pid)
                act(proc, pid)
                break
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert pid in kids, (pid, kids, lines)
    assert wait_all_ended(kids) == [], "a child outlived the run"
    return proc.returncode, lines + rest.decode(errors="replace").splitlines(), pid


@pytest.mark.backend
def test_a_killed_prefill_process_gives_exactly_one_error_line() -> None:
    code, lines, pid = run_and_end(lambda proc, child: os.kill(child, signal.SIGKILL))
    assert code == 1, lines
    assert lines == [f"prefill process: pid {pid} (nixl)",
                     f"error: the nixl backend failed: the prefill process (pid {pid}) died (killed by signal 9)"]


@pytest.mark.backend
@pytest.mark.parametrize("whom", ["process", "group"])
def test_sigterm_is_handled_like_ctrl_c(whom: str) -> None:
    """SIGTERM to the run's process (``kill PID``) or to its whole process group (a service manager): the prefill
    process is ended, one ``terminated`` line, exit 143, no traceback."""
    def term(proc: subprocess.Popen, child: int) -> None:
        (os.kill if whom == "process" else os.killpg)(proc.pid, signal.SIGTERM)

    code, lines, pid = run_and_end(term)
    assert code == 143, lines
    assert lines == [f"prefill process: pid {pid} (nixl)", "terminated"], lines


def test_library_warnings_are_held_until_the_run_returns() -> None:
    """HeldLogs: a library warning during a run is printed (one ``warning:`` line) only once the run returned;
    a run that raises drops it; the umalloc logger is as before afterwards."""
    from rich.console import Console

    from umalloc_replay.cli import HeldLogs

    log = logging.getLogger("umalloc.leases.table")
    root = logging.getLogger("umalloc")
    before = (root.propagate, root.level, list(root.handlers))
    console = Console(stderr=False, record=True, width=200)
    with HeldLogs() as held:
        log.warning("lease %d in doubt", 7)
    held.flush_to(console)
    assert console.export_text().splitlines() == ["warning: lease 7 in doubt"]
    with pytest.raises(RuntimeError), HeldLogs() as dropped:
        log.warning("lease 8 in doubt")
        raise RuntimeError("the run failed")
    assert [r.getMessage() for r in dropped.records] == ["lease 8 in doubt"]  # never printed: the error speaks
    assert (root.propagate, root.level, list(root.handlers)) == before
