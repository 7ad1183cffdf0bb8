"""A successful NIXL replay printed ``lease 3 (tag 'plan-dst:4003') in doubt: released while 1
engine hold(s) are outstanding``. It was no real in-doubt lease: when the prefill child's arena is short it posts
nothing, and the replay settled the published receiver half — ``ReceiverHalf.settle`` releases the lease before
letting go of the publication hold (so that a confirmed termination reads ``settled``), and the lease passed through in
doubt. The replay finishes such a half with ``complete()`` (the sender's report: nothing posted), which lets go of
the hold first; a real in-doubt lease is counted in the report (``leases.in_doubt``) and its table."""

from __future__ import annotations

import json
import logging

import torch
from typer.testing import CliRunner

from umalloc import Arena, MultiEndedAllocator, build_receiver_half
from umalloc.testing import FakeClock, require_or_skip, tiny_spec
from umalloc_replay.cli import app


def _published_half(clock=None):
    dst = MultiEndedAllocator(Arena(tiny_spec()), clock=clock) if clock else MultiEndedAllocator(Arena(tiny_spec()))
    one = lambda x: torch.tensor([x], dtype=torch.int64)  # noqa: E731
    dvt = dst.alloc_extend(one(0), one(6), one(-1))
    half = build_receiver_half("r", dst, {"full": dvt}, deadline_s=5.0)
    half.publish()
    return dst, dvt, half


def test_a_published_half_the_sender_posted_nothing_to_finishes_without_going_in_doubt(caplog) -> None:
    """The replay's path when the child is short: the sender's report (nothing posted) finishes the half with
    ``complete()``, which lets go of the publication hold first."""
    dst, dvt, half = _published_half()
    with caplog.at_level(logging.WARNING, logger="umalloc"):
        half.complete()
    assert half.lease.state == "released"
    assert dst.lease_table.leases_in_doubt == 0 and not caplog.records, caplog.records
    dst.free(dvt)
    assert sum(s.pending_pages for s in dst.stats().values()) == 0
    dst.check_invariants()


def test_a_real_in_doubt_lease_still_goes_in_doubt_and_settles() -> None:
    """The order changed nothing for a lease already in doubt (its deadline passed while published)."""
    clock = FakeClock()
    dst, dvt, half = _published_half(clock)
    clock.now = 6.0
    assert dst.leases_active() == 0 and half.lease.state == "in_doubt"
    assert dst.lease_table.leases_in_doubt == 1
    half.settle()
    assert half.lease.state == "settled" and half.state == "failed"
    dst.free(dvt)
    dst.check_invariants()


def test_a_nixl_replay_whose_prefill_arena_runs_short_reports_no_in_doubt_lease(tmp_path) -> None:
    """The replay at the edge that printed the warning: a prefill arena that holds one prompt at a time, so the
    child is short whenever two requests are admitted in a step. No `in doubt` line; the report counts 0."""
    require_or_skip("nixl")
    trace = tmp_path / "azure.csv"
    # four prompts of 96 tokens arriving together: each fits the prefill arena alone, two do not
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(
        f"2023-11-16 18:15:46.{i}000000,96,4" for i in range(4)))
    report = tmp_path / "r.json"
    base = ["replay", "--trace", str(trace), "--token-scale", "1", "--no-progress", "--model", "llama-3.1-8b",
            "--report", str(report)]
    from umalloc.geometry.presets import preset_ends
    from umalloc_replay.single.fit import slice_needs_bytes
    from umalloc_replay.trace import load_trace

    ends = preset_ends("llama-3.1-8b", page_size=16, draft=False)
    one_prompt = slice_needs_bytes(ends, load_trace(trace, token_scale=1), "prefill")
    res = CliRunner().invoke(app, [*base, "--backend", "nixl", "--arena-bytes", f"{one_prompt},64MiB"])
    assert res.exit_code == 0, res.output
    assert "in doubt: released" not in res.stderr, res.stderr
    rep = json.loads(report.read_text())
    assert rep["leases"]["in_doubt"] == 0 and rep["ok"]
    assert rep["requests"]["admission_waits"] > 0  # the child was short at least once: the path ran
    row = next(ln for ln in res.stdout.splitlines() if "leases" in ln and "taken" in ln)
    assert "0 in doubt" in row, row
