"""``umalloc generate --decode cb`` with an asynchronous prefill side (:mod:`umalloc_replay.generate.feed`): a
request is handed over without waiting and joins the running batch once its own transfer finished.

Oracle: the one-process reference tokens (checked against transformers' ``model.generate()`` in
``test_generate.py``). The schedule is asserted from the run's own step records (which requests each engine step
ran, which were in flight), as counts, never as times. A killed prefill process is killed from outside
(SIGKILL), as an operator or the OOM killer would. Seeded (``UMALLOC_SEED``, printed).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("transformers")

from process_tree import descendant_pids, wait_all_ended  # noqa: E402

from umalloc import BackendError  # noqa: E402
from umalloc.testing import require_or_skip, seed_from_env  # noqa: E402
from umalloc_replay.generate.run import GenerateConfig, check_generate_report, run_generate  # noqa: E402

SEED = seed_from_env(0)
#: 4 requests, at most 3 in the batch: the first request decodes 15 tokens or more while the next ones land
ASYNC: dict[str, Any] = dict(requests=4, token_scale=64, output_scale=32, seed=SEED, max_batch=3)
BACKENDS = ["local", pytest.param("nixl", marks=pytest.mark.backend),
            pytest.param("mooncake", marks=pytest.mark.backend)]


def admitted_mid_batch(report: dict) -> list[tuple[int, int]]:
    """``(x, y)`` for every request ``x`` admitted between two engine steps that request ``y`` both ran in."""
    rows = report["timeline"]
    out = []
    for x in rows:
        k = x["admitted_after_steps"]
        for y in rows:
            span = y["engine_steps"]
            if y is not x and span is not None and span[0] <= k - 1 and k <= span[1]:
                out.append((x["request"], y["request"]))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_joins_the_running_batch_once_its_own_transfer_landed(
        backend: str, shared_generate: Callable[[Any], dict[str, Any]]) -> None:
    """The run is test_generate_inplace.py's (the same config: one report, ``shared_generate``)."""
    if backend != "local":
        require_or_skip(backend)
    print(f"seed {SEED}: llama over {backend}, --decode cb")
    rep = shared_generate(GenerateConfig(model="llama", backend=backend, **ASYNC))
    assert check_generate_report(rep) == [] and rep["identical"] == rep["requests"] == 4
    assert rep["pages_left"] == {"prefill": 0, "decode": 0} and rep["leases_left"] == {"prefill": 0, "decode": 0}
    rows = rep["timeline"]
    # each request runs in the engine step right after its admission, and every step is in the log
    assert all(r["engine_steps"][0] == r["admitted_after_steps"] for r in rows), rows
    assert max(r["engine_steps"][1] for r in rows) + 1 == rep["serving"]["steps"]
    assert admitted_mid_batch(rep), rows    # a request joined between two steps of another one
    assert rep["serving"]["steps_with_transfers_in_flight"] > 0   # the batch stepped while a transfer was in flight


@pytest.mark.backend
def test_a_prefill_process_killed_mid_run_ends_it_with_worker_died_and_no_lease_left() -> None:
    """The prefill process killed once the first request finished, with the others submitted or about to be:
    the run raises ``WorkerDied`` (a ``BackendError``: the CLI's one ``error:`` line, exit 1), every receiver
    half of a request the dead child had is settled (no decode lease left, none kept), the child is gone."""
    from umalloc.backends.worker import WorkerDied

    require_or_skip("nixl")
    seen: list = []

    def kill_at_first_finish(index: int, prefill: Any) -> None:
        if index == 0:
            seen.append(prefill)
            os.kill(prefill.worker.pid, signal.SIGKILL)   # as from outside: the worker does not know
            while prefill.worker.alive():                 # the kernel ends it: wait on its state, not a clock
                os.sched_yield()

    cfg = GenerateConfig(model="llama", backend="nixl", requests=6, token_scale=64, output_scale=32, seed=SEED,
                         max_batch=2)
    with pytest.raises(WorkerDied) as info:
        run_generate(cfg, on_finished=kill_at_first_finish)
    prefill = seen[0]
    assert isinstance(info.value, BackendError) and not prefill.worker.alive()
    assert prefill.decode.leases_active() == 0 and prefill.kept_halves == [] and prefill.in_flight() == []


@pytest.mark.backend
def test_a_killed_prefill_process_ends_the_in_place_cli_run_with_one_error_line() -> None:
    require_or_skip("mooncake")
    cmd = [sys.executable, "-c", "from umalloc_replay.cli import app; app()", "generate", "--backend", "mooncake",
           "--model", "gemma3", "--requests", "8", "--max-batch", "1", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    lines: list[str] = []
    pid = None
    try:
        for raw in iter(proc.stdout.readline, b""):  # type: ignore[union-attr]
            lines.append(raw.decode(errors="replace"))
            m = re.fullmatch(r"prefill process: pid (\d+) \(mooncake\)\n", lines[-1])
            if m:
                pid = int(m[1])
                kids = descendant_pids(proc.pid)
                os.kill(pid, signal.SIGKILL)
                break
        assert pid is not None, "".join(lines)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(lines) + rest.decode(errors="replace")
    assert wait_all_ended(kids) == [], "a child outlived the run"
    assert proc.returncode == 1, text
    errors = [ln for ln in text.splitlines() if "error:" in ln]
    assert errors == [f"error: the mooncake backend failed: the prefill process (pid {pid}) died (killed by "
                      "signal 9)"], text
    assert "Traceback" not in text, text
