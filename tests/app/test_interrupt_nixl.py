"""Ctrl-C on ``--backend nixl`` printed ``interrupted`` but the process lingered 10-25 s: the
replay asked its second process to finish its transfers and close its NIXL agent, then the interpreter tore the
parent's agent down. After Ctrl-C the second process is killed at once (nothing of the run is kept) and the
console script skips the teardown. The interrupt is injected at a known step, not after a delay."""

from __future__ import annotations

import signal

import pytest

from umalloc.testing import require_or_skip
from umalloc_replay.single.run import Replay, ReplayConfig


@pytest.mark.backend
def test_ctrl_c_mid_replay_kills_the_second_process_instead_of_waiting_for_it() -> None:
    require_or_skip("nixl")
    steps = []

    def ctrl_c_at_step_3(figures: dict) -> None:
        steps.append(figures["step"])
        if figures["step"] == 3:
            raise KeyboardInterrupt  # what SIGINT raises in the main thread, at a step of our choosing

    rep = Replay(ReplayConfig(backend="nixl", requests=8, token_scale=64), on_progress=ctrl_c_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        rep.run()
    assert steps[-1] == 3
    worker = rep.prefill.worker  # type: ignore[attr-defined]
    # killed (SIGKILL), not an orderly exit (0) after finishing its transfers and closing its engine
    assert worker.process.exitcode == -signal.SIGKILL, worker.process.exitcode
    assert not worker.alive()
