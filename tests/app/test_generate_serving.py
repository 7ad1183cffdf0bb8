"""``umalloc generate``: the serving targets against a one-process continuous-batching run of the same
requests, the ``--plot`` timeline, and a decode cache smaller than the load (:mod:`umalloc_replay.generate.timeline`).

Oracle: the one-process reference tokens (checked against transformers' ``model.generate()`` in
``test_generate.py``); the baseline is transformers' own scheduler prefilling on the decode side. Seeded
(``UMALLOC_SEED``, printed). No timing is asserted: only that the figures are recorded and consistent.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from umalloc.testing import require_or_skip, seed_from_env  # noqa: E402
from umalloc_replay.cli import app  # noqa: E402
from umalloc_replay.generate.run import GenerateConfig, check_generate_report, run_generate  # noqa: E402
from umalloc_replay.generate.timeline import PHASES  # noqa: E402

SEED = seed_from_env(0)
SLICE: dict[str, Any] = dict(requests=4, token_scale=64, output_scale=32, seed=SEED, max_batch=3)
#: 8 requests, 4 in the batch, a cache of 34 pages (the 8 lifetimes need 101, the longest 29); a request handed
#: over while the batch runs is admitted after 3 decode steps at the earliest
PRESSURE: dict[str, Any] = dict(requests=8, token_scale=64, output_scale=16, seed=SEED, max_batch=4,
                                decode_blocks=34, steps_in_flight=3)


def test_serving_targets_are_measured_against_a_one_process_cb_run() -> None:
    print(f"seed {SEED}: qwen3, decoded in place")
    rep = run_generate(GenerateConfig(model="qwen3", **SLICE))
    assert check_generate_report(rep) == [] and rep["schema"] == "umalloc-generate/6"
    sv = rep["serving"]
    assert sv["one_process_cb_identical"] == rep["requests"] == 4
    assert sv["one_process_cb_steps"] > 0 and sv["pd_decode_tokens_per_s"] > 0
    assert sv["speed_ratio"] == pytest.approx(sv["pd_decode_tokens_per_s"] / sv["one_process_cb_tokens_per_s"])
    assert sv["pd_decode_tokens_per_s"] == pytest.approx(rep["decoded_tokens"] / rep["seconds"]["decode_compute"])
    # 4 requests, 3 in the batch: the fourth's transfer was in flight while the batch took a step
    assert sv["steps_with_transfers_in_flight"] >= 1 and sv["longest_stall_s"] > 0
    assert 0 < sv["memory_layer_share"]
    order = [p[1] for p in PHASES] + ["done"]
    for row in rep["timeline"]:
        st = row["stamps"]
        assert list(st) == order or sorted(st, key=order.index) == order, st
        assert [st[k] for k in order] == sorted(st[k] for k in order)


def test_a_corrupt_baseline_fails_the_check(shared_generate: Callable[[Any], dict[str, Any]]) -> None:
    rep = shared_generate(GenerateConfig(model="llama", **SLICE))   # a copy of the in-place run: changed below
    rep["serving"]["one_process_cb_identical"] -= 1
    assert any("one-process continuous-batching baseline" in p for p in check_generate_report(rep))


@pytest.mark.parametrize("backend", ["local", pytest.param("nixl", marks=pytest.mark.backend),
                                     pytest.param("mooncake", marks=pytest.mark.backend)])
def test_a_decode_cache_under_pressure_waits_compacts_and_equals_one_process(backend: str) -> None:
    if backend != "local":
        require_or_skip(backend)
    print(f"seed {SEED}: llama over {backend}, --decode-blocks 34")
    rep = run_generate(GenerateConfig(model="llama", backend=backend, **PRESSURE))
    assert check_generate_report(rep) == [] and rep["identical"] == 8
    sv = rep["serving"]
    assert sv["waits_for_room"] > 0                       # arrivals waited: their KV was not sent before room
    assert sv["steps_with_transfers_in_flight"] > 0       # the batch stepped while transfers were in flight
    assert sv["pages_moved"] > 0                          # compaction moved pages between steps
    if backend == "local":
        # the local prefill plans (leases) a request once its forward is done, so the first step after its hand-over
        # compacts the pages reserved for it; over NIXL and Mooncake they are leased from the hand-over (the
        # published half) and move once the request is admitted
        assert sv["pages_moved_with_transfers_in_flight"] > 0
    assert rep["seconds"]["decode_compute"] > 0 and rep["digest_mismatches"] == []
    assert rep["pages_left"] == {"prefill": 0, "decode": 0} and rep["leases_left"] == {"prefill": 0, "decode": 0}


def test_plot_into_a_folder_names_the_generate_job() -> None:
    from umalloc_replay.preflight import resolve_plot_path

    assert resolve_plot_path(Path("/tmp"), "umalloc-generate.png") == Path("/tmp/umalloc-generate.png")


def test_plot_writes_the_timeline(tmp_path: Path) -> None:
    out = tmp_path / "timeline"
    res = CliRunner().invoke(app, ["generate", "--model", "llama", "--requests", "3",
                                   "--token-scale", "64", "--output-scale", "64", "--plot", str(out),
                                   "--no-progress"], catch_exceptions=False)
    assert res.exit_code == 0, res.stderr
    png = tmp_path / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {png}" in res.stderr
    assert "PD / one-process CB decode tokens/s" in res.stdout and "longest stall" in res.stdout


@pytest.mark.parametrize("args, needle", [
    (["--model", "llama", "--plot", "{p}", "--report", "{p}"], "name the same file"),
    (["--model", "llama", "--decode-blocks", "2"], "--decode-blocks 2: the longest request needs"),
    # the longest request needs 29 target pages of 16 tokens and as many early-exit draft pages (1 of llama's 2
    # layers: half a target page each), 43.5 target pages' bytes in all: 29 blocks hold it only without the drafter
    (["--model", "llama", "--draft", "early-exit:1", "--decode-blocks", "29"],
     "--decode-blocks 29: the cache"),
    # transformers' continuous batching refuses pages under 4 tokens when it builds its cache
    (["--model", "llama", "--page-size", "2"], "--page-size 2: transformers'"),
    # 10**8 pages of 16 tokens of a 2-layer model: about 2 TB, more than any test machine holds
    (["--model", "llama", "--decode-blocks", "100000000"], "--decode-blocks 100000000: a decode cache"),
    (["--model", "llama", "--plot", "{p}.gif"], "--plot"),
    (["--model", "llama", "--plot", "{p}."], "o.png.': allowed a file name"),
])
def test_serving_options_refused_exit_2_with_one_error_line(args: list[str], needle: str, tmp_path: Path) -> None:
    args = [a.replace("{p}", str(tmp_path / "o.png")) for a in args]
    res = CliRunner().invoke(app, ["generate", *args], catch_exceptions=False)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], res.stderr


def test_the_table_has_a_start_up_row_inside_the_total() -> None:
    from rich.console import Console

    from umalloc_replay.generate.run import generate_table

    rep = run_generate(GenerateConfig(model="llama", requests=2, token_scale=64, output_scale=64, seed=SEED))
    s = rep["seconds"]
    assert 0 < s["startup"] and s["startup"] + s["reference"] + s["one_process_cb"] < s["total"]
    out = Console(width=200, record=True, file=io.StringIO())
    out.print(generate_table(rep))
    assert "start-up s (models, arenas, second process)" in out.export_text()


@pytest.mark.backend
def test_a_remote_start_is_announced_before_its_pid() -> None:
    from rich.console import Console

    require_or_skip("nixl")
    buf = io.StringIO()
    rep = run_generate(GenerateConfig(model="llama", backend="nixl", requests=2, token_scale=64, output_scale=64,
                                      seed=SEED), progress=True, console=Console(file=buf, width=200))
    assert check_generate_report(rep) == []
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    assert lines[0] == "starting the prefill process (nixl) ..." and lines[1].startswith("prefill process: pid ")


def test_submit_refuses_a_duplicate_id_and_an_empty_prompt_and_changes_nothing() -> None:
    from umalloc import UmallocValueError
    from umalloc_replay.generate.inplace import engine_for
    from umalloc_replay.generate.models import build_model
    from umalloc_replay.trace import TraceRequest

    engine = engine_for(build_model("llama", SEED), [TraceRequest(0, 0.0, 8, 4, ())], 16, 2)
    try:
        engine.submit("a", [5, 6, 7], 3)
        with pytest.raises(UmallocValueError, match="already in the engine"):
            engine.submit("a", [5, 6, 7], 3)
        with pytest.raises(UmallocValueError, match="allowed >= 1 each"):
            engine.submit("b", [], 3)
        assert engine.running() == 1 and list(engine.states) == ["a"]
        while engine.running():
            engine.step()
        (rid, state), = engine.finished()
        assert rid == "a" and state.error is None and len(state.generated_tokens) == 3
    finally:
        engine.close()


def test_a_decode_cache_under_pressure_holds_the_drafters_pages_beside_the_targets() -> None:
    """``--decode-blocks`` counts the target's pages; an early-exit drafter's pages (half a target page each for
    llama's 1 of 2 layers) share the cache. 4 requests whose lifetimes are 9, 10, 11 and 4 target pages of 16
    tokens (prompts 106, 115, 114, 36; outputs 32, 31, 50, 20), 3 in the batch, 22 blocks: 22 target pages
    would hold the first two at once, but with their draft pages they need 28.5 blocks' bytes, so the cache
    holds only about 22 / 1.5 pages of each; arrivals wait for room and every request completes identical."""
    print(f"seed {SEED}: llama, --draft early-exit:1 --decode-blocks 22")
    rep = run_generate(GenerateConfig(model="llama", requests=4, token_scale=64, output_scale=16, seed=SEED,
                                      max_batch=3, decode_blocks=22, draft=True, draft_layers=1))
    assert check_generate_report(rep) == [], check_generate_report(rep)
    assert rep["identical"] == 4


def test_a_max_batch_above_the_requests_runs_them_all_at_once() -> None:
    """``--max-batch`` bounds the requests in the engine at once, so one above ``--requests`` is the same run as
    ``--max-batch`` = ``--requests``: 3 requests, ``max_batch`` 100000, every request identical, nothing left."""
    print(f"seed {SEED}: llama, --max-batch 100000 --requests 3")
    rep = run_generate(GenerateConfig(model="llama", requests=3, token_scale=64, output_scale=32, seed=SEED,
                                      max_batch=100_000))
    assert check_generate_report(rep) == [], check_generate_report(rep)
    assert rep["identical"] == 3 and rep["serving"]["one_process_cb_identical"] == 3


def test_a_decode_blocks_refusal_with_a_drafter_names_a_value_that_runs() -> None:
    # the value a refusal names must itself be accepted: the early-exit drafter's pages share the cache's bytes,
    # so the target-only page count (the longest request's pages) is not enough and must not be the one named
    base = ["generate", "--model", "llama", "--draft", "early-exit:1", "--requests", "2", "--token-scale", "64",
            "--output-scale", "64", "--no-progress"]
    res = CliRunner().invoke(app, [*base, "--decode-blocks", "1"], catch_exceptions=False)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1, res.stderr
    named = re.search(r"\((\d+) holds it\)", lines[0])
    assert named is not None, lines[0]
    ok = CliRunner().invoke(app, [*base, "--decode-blocks", named.group(1)], catch_exceptions=False)
    assert ok.exit_code == 0, ok.stderr
