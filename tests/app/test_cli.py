"""`umalloc replay` as a user meets it: every bad argument or path refused before anything runs (exit 2, one
`error:` line, no traceback, nothing written), outputs written where the CLI says, the title naming the slice,
and Ctrl-C (a real SIGINT to a real process tree) ending with exit 130, one `interrupted` line and no child."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_tree import descendant_pids, pid_alive
from typer.testing import CliRunner

from umalloc_replay.cli import app

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(
    f"2023-11-16 18:15:4{i}.{i}805900,{40 + 10 * i},{6 + i}" for i in range(6))
QUICK = ["--token-scale", "1", "--no-progress"]


@pytest.fixture()
def azure(tmp_path: Path) -> Path:
    p = tmp_path / "in" / "azure.csv"
    p.parent.mkdir()
    p.write_text(AZURE)
    return p


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def refused(args: list[str], root: Path, *needles: str) -> str:
    """Run the CLI; assert exit 2, one `error:` line first (before any table), no traceback, every needle in it,
    nothing new under ``root``. Returns the output."""
    before = files_under(root)
    res = CliRunner().invoke(app, ["replay", *args])
    out = res.output
    assert res.exit_code == 2, out
    assert out.startswith("error: ") and out.count("error:") == 1, out
    assert "Traceback" not in out and "result" not in out, out
    for n in needles:
        assert n in out, (n, out)
    assert files_under(root) == before
    return out


def mem_available() -> int:
    """The host memory the replay sees (fixed for the tests by ``conftest.py``)."""
    from umalloc_replay.preflight import available_memory_bytes

    return available_memory_bytes()


# ---- output paths ---------------------------------------------------------------------------------------------


def test_report_and_plot_paths_are_checked_before_the_run(tmp_path, azure):
    base = ["--trace", str(azure), *QUICK]
    refused([*base, "--report", str(tmp_path / "nope" / "r.json")], tmp_path, "does not exist")
    refused([*base, "--report", str(tmp_path)], tmp_path, "is a directory")
    refused([*base, "--report", "/proc/umalloc-report.json"], tmp_path, "cannot be written")
    refused([*base, "--plot", str(tmp_path / "p.txt")], tmp_path, "suffix '.txt'", ".png")
    refused([*base, "--plot", str(tmp_path / "nope" / "p.png")], tmp_path, "does not exist")
    refused([*base, "--plot", "/proc/umalloc-plot.png"], tmp_path, "cannot be written")
    refused([*base, "--report", str(tmp_path / "x.png"), "--plot", str(tmp_path / "x.png")], tmp_path,
            "same file")


def test_an_output_that_is_the_input_trace_is_refused_and_the_trace_kept(tmp_path, azure):
    """``--report`` naming the ``--trace`` file (the same path, another spelling of it, or a link to it) would
    write the report over the trace: refused before the run, the trace's bytes unchanged."""
    link = tmp_path / "link.csv"
    link.symlink_to(azure)
    spelled = tmp_path / "in" / ".." / "in" / "azure.csv"
    for trace, out in ((azure, azure), (azure, spelled), (link, azure), (azure, link)):
        refused(["--trace", str(trace), "--report", str(out), *QUICK], tmp_path, "--report", "and --trace name the "
                "same file")
        assert azure.read_text() == AZURE


def test_plot_path_without_suffix_or_a_directory_prints_the_file_written(tmp_path, azure):
    base = ["replay", "--trace", str(azure), "--requests", "1", *QUICK]
    res = CliRunner().invoke(app, [*base, "--plot", str(tmp_path / "myplot")])
    assert res.exit_code == 0, res.output
    assert f"plot: {tmp_path / 'myplot.png'}" in res.output
    assert (tmp_path / "myplot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "myplot").exists()
    folder = tmp_path / "plots"
    folder.mkdir()
    res = CliRunner().invoke(app, [*base, "--plot", str(folder)])
    assert res.exit_code == 0, res.output
    assert f"plot: {folder / 'umalloc-replay.png'}" in res.output
    assert (folder / "umalloc-replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "plots.png").exists()
    res = CliRunner().invoke(app, [*base, "--plot", str(tmp_path / "p.svg")])
    assert res.exit_code == 0 and (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")


# ---- traces -------------------------------------------------------------------------------------------------


def test_binary_or_directory_traces_are_refused(tmp_path):
    blob = tmp_path / "model.bin"
    blob.write_bytes(bytes(range(256)) * 4)
    refused(["--trace", str(blob), *QUICK], tmp_path, "binary file")
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'{"timestamp": 0, "input_length": 5, "output_length": 1, "x": "\xe9"}\n')
    refused(["--trace", str(latin), *QUICK], tmp_path, "not UTF-8")
    refused(["--trace", str(tmp_path), *QUICK], tmp_path, "is a directory")


def test_sizes_larger_than_the_machine_are_refused(tmp_path, azure):
    base = ["--trace", str(azure), *QUICK]
    refused([*base, "--arena-bytes", "10TiB"], tmp_path, "host memory", "available")
    half = mem_available() // 2 + (1 << 30)  # the two arenas together exceed what is available by 2 GiB
    refused([*base, "--arena-bytes", str(half)], tmp_path, "host memory", "prefill arena", "decode arena")
    # a row of 100,000,000 context tokens: its default arenas alone exceed any machine here
    huge = tmp_path / "huge.jsonl"
    huge.write_text('{"timestamp": 0, "input_length": 100000000, "output_length": 1}\n')
    refused(["--trace", str(huge), *QUICK], tmp_path, "host memory", "request 0 (100000000 prompt")


def test_max_batch_huge_runs(tmp_path, azure):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["replay", "--trace", str(azure), "--requests", "2", *QUICK,
                                   "--max-batch", "1000000000", "--report", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["config"]["max_batch"] == 1_000_000_000 and rep["requests"]["completed"] == 2


# ---- arguments ----------------------------------------------------------------------------------------------


def test_skip_starts_the_slice_later_and_the_title_names_it(tmp_path, azure):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["replay", "--trace", str(azure), "--skip", "3", "--requests", "2", *QUICK,
                                   "--report", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    # rows 3 and 4 of the file: 70 + 6 and 80 + 7 tokens (AZURE above)
    assert rep["tokens"] == {"prompt": 70 + 80, "generated": 9 + 10, "total": 169, "zero_prompts_as_1": 0,
                             "zero_outputs_as_1": 0}
    assert rep["config"]["skip"] == 3
    title = " ".join(res.output.split())
    assert "azure.csv rows 3-4, token scale 1, gemma-3-12b-draft, 16-token pages, layout dynamic" in title
    refused(["--trace", str(azure), "--skip", "6", *QUICK], tmp_path, "--skip 6 passes every one of the 6 requests",
            "allowed --skip <= 5")
    refused(["--trace", str(azure), "--skip", "4", "--requests", "3", *QUICK], tmp_path,
            "--requests 3: ", "holds only 2 requests after --skip 4: allowed --requests <= 2")


def test_draft_without_a_drafter_is_refused(tmp_path, azure):
    refused(["--trace", str(azure), "--model", "gpt-oss-20b", "--draft", *QUICK], tmp_path, "has no drafter",
            "--no-draft")
    res = CliRunner().invoke(app, ["replay", "--trace", str(azure), "--model", "gpt-oss-20b", "--requests", "1",
                                   *QUICK])
    assert res.exit_code == 0, res.output  # the default: a drafter where the preset has one


def test_fewer_requests_is_suggested_only_when_it_helps(tmp_path):
    tr = tmp_path / "t.jsonl"
    rows = [(64, 4), (64, 4), (64, 4), (600, 4)]  # request 3 peaks at 604 tokens: 38 x 6.4 MiB > 128 MiB
    tr.write_text("".join(json.dumps({"timestamp": i, "input_length": a, "output_length": b}) + "\n"
                          for i, (a, b) in enumerate(rows)))
    out = refused(["--trace", str(tr), "--arena-bytes", "128MiB", *QUICK], tmp_path, "request 3 ",
                  "--requests 3 (the requests before it fit)")
    assert "fewer" not in out
    out = refused(["--trace", str(tr), "--skip", "3", "--arena-bytes", "128MiB", *QUICK], tmp_path, "request 3 ")
    assert "--requests" not in out  # the culprit starts the slice: fewer requests cannot help


def test_layout_is_validated(tmp_path, azure):
    refused(["--trace", str(azure), "--layout", "static:0", *QUICK], tmp_path, "RATIO")
    refused(["--trace", str(azure), "--layout", "fixed", *QUICK], tmp_path, "dynamic", "padded")


def test_draft_sliding_places_the_drafters_sliding_layers_and_is_validated(tmp_path, azure):
    refused(["--trace", str(azure), "--draft-sliding", "ring", *QUICK], tmp_path, "--draft-sliding 'ring'",
            "swa, own, draft")
    refused(["--trace", str(azure), "--draft-sliding", "own", "--no-draft", *QUICK], tmp_path, "only with a drafter")
    refused(["--trace", str(azure), "--model", "gpt-oss-20b", "--draft-sliding", "own", *QUICK], tmp_path,
            "only with a drafter")
    refused(["--trace", str(azure), "--draft-sliding", "own", "--decode-tp", "2", *QUICK], tmp_path,
            "multi-rank replay keeps the drafter whole")
    res = CliRunner().invoke(app, ["replay", "--trace", str(azure), "--requests", "2", "--draft-sliding", "own",
                                   "--format", "json", *QUICK])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["ok"] and rep["config"]["draft_sliding"] == "own"
    ends = {e["name"]: e for e in rep["config"]["ends"]}
    # Gemma-3-1B: 26 layers, every sixth global (5 local : 1 global), the local ones sliding over 512 tokens
    assert (ends["draft_swa"]["layers"], ends["draft_swa"]["window_tokens"]) == (22, 512)
    assert (ends["draft"]["layers"], ends["draft"]["window_tokens"]) == (4, None)
    assert rep["mismatches"] == {"pages": 0, "bytes": 0}
    for side in ("prefill", "decode"):
        assert rep["end_state"][side]["leases_active"] == 0
        assert all(e["live_pages"] == 0 for e in rep["end_state"][side]["ends"].values())


# ---- Ctrl-C -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["local", pytest.param("nixl", marks=pytest.mark.backend)])
def test_ctrl_c_is_quiet_ends_every_child_and_exits_130(tmp_path, backend):
    if backend != "local":
        from umalloc.testing import require_or_skip

        require_or_skip(backend)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-c", "from umalloc_replay.cli import app; app()", "replay", "--backend", backend,
           "--no-progress", "--requests", "1000"]  # several minutes of work: interrupted well before its end
    # a session of its own, so the SIGINT goes to the whole process group as a terminal's Ctrl-C does
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        start = time.monotonic()
        kids: set[int] = set()
        # running: past imports and warm-up (and, remote, the worker's start-up)
        # (any moment is a valid one for the SIGINT: start-up interrupts are just as quiet, see
        # test_cli_start_up.py; the 8 s only spread it into the run, and 600 s is a hang guard)
        while proc.poll() is None and (time.monotonic() - start < 8 or (backend != "local" and not kids)):
            if time.monotonic() - start > 600:
                break
            kids |= descendant_pids(proc.pid)
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0].decode()
        kids |= descendant_pids(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=300)  # a hang guard (item 10: it used to linger 10-25 s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.decode(errors="replace")
    assert proc.returncode == 130, text
    assert text.strip().splitlines()[-1] == "interrupted", text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    if backend != "local":
        assert kids, "the second process was never seen"
    end = time.monotonic() + 120  # a hang guard: a loaded machine may take a while to reap the children
    while any(pid_alive(k) for k in kids) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [k for k in kids if pid_alive(k)], "a child outlived the replay"


def test_compaction_off_refusal_suggests_lazy_when_lazy_places_it(tmp_path):
    # 11,000 prompt tokens in a 1,200 MiB decode arena: with compaction off the floating swa band stays where the
    # window tail placed it and the head pages cannot be placed beside it; lazy compaction's ladder slides the
    # band and the same request runs (found by scanning the arena size: refused with "off" at 1,100-1,300 MiB)
    tr = tmp_path / "t.jsonl"
    tr.write_text('{"timestamp": 0, "input_length": 11000, "output_length": 2}\n')
    base = ["--trace", str(tr), "--arena-bytes", "3GiB,1200MiB", *QUICK]
    out = refused([*base, "--compaction", "off"], tmp_path, "cannot be placed", "--compaction lazy places it")
    assert "--requests" not in out  # request 0 is the culprit: fewer requests cannot help
    from umalloc_replay.single.run import Replay, ReplayConfig

    Replay(ReplayConfig(trace=str(tr), token_scale=1, prefill_arena_bytes=3 << 30, decode_arena_bytes=1200 << 20,
                        compaction="lazy"))  # accepted: the hint is true


@pytest.mark.backend
def test_mooncake_replay_is_quiet_on_success():
    """A successful Mooncake run prints the result and no engine log lines: the engine's glog reports
    "Local segment descriptor not found" at ERROR on every P2P start unless its flag is raised for that call."""
    from umalloc.testing import require_or_skip

    require_or_skip("mooncake")
    cmd = [sys.executable, "-c", "from umalloc_replay.cli import app; app()", "replay", "--backend", "mooncake",
           "--requests", "2", "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    glog = [ln for ln in (res.stdout + res.stderr).splitlines()
            if "transfer_metadata" in ln or (len(ln) > 5 and ln[0] in "EWF" and ln[1:5].isdigit())]
    assert not glog, glog


@pytest.mark.backend
@pytest.mark.timeout(900)
def test_a_killed_second_process_ends_the_replay_with_one_error_line(tmp_path):
    from umalloc.testing import require_or_skip

    require_or_skip("nixl")
    cmd = [sys.executable, "-c", "from umalloc_replay.cli import app; app()", "replay", "--backend", "nixl",
           "--no-progress", "--requests", "1000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ),
                            start_new_session=True)
    try:
        start, kids = time.monotonic(), set()
        while proc.poll() is None and (time.monotonic() - start < 8 or not kids) and time.monotonic() - start < 600:
            kids |= descendant_pids(proc.pid)
            time.sleep(0.2)
        assert proc.poll() is None and kids, "the replay and its second process never ran together"
        for k in kids:
            os.kill(k, signal.SIGKILL)
        # a hang guard only: the replay notices the death at its next exchange with the second process, which
        # on a loaded machine may come minutes later (its own start-up and the kernels' first compile)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.decode(errors="replace")
    assert proc.returncode == 1, text
    assert "Traceback" not in text, text
    assert text.strip().splitlines()[-1].startswith("error: the nixl backend failed"), text


def test_the_host_memory_refusal_follows_the_injected_figure_not_the_machine(tmp_path, azure, monkeypatch):
    """The refusal depends on ``$UMALLOC_HOST_MEMORY_BYTES`` when set (the suite sets it), so
    no test depends on the memory free where it runs; the message says what to pass."""
    base = ["--trace", str(azure), *QUICK, "--arena-bytes", "64MiB"]
    monkeypatch.setenv("UMALLOC_HOST_MEMORY_BYTES", "100MiB")  # two 64 MiB arenas exceed it
    out = refused(base, tmp_path, "host memory", f"{100 << 20:,} bytes available: pass smaller --arena-bytes")
    assert "allowed" not in out.split("available:", 1)[1]
    monkeypatch.setenv("UMALLOC_HOST_MEMORY_BYTES", "4GiB")
    res = CliRunner().invoke(app, ["replay", *base])
    assert res.exit_code == 0, res.output
    monkeypatch.setenv("UMALLOC_HOST_MEMORY_BYTES", "lots")
    refused(base, tmp_path, "$UMALLOC_HOST_MEMORY_BYTES: size 'lots'")


def test_python_m_cli_runs_the_app_as_the_console_script_does() -> None:
    """``python -m umalloc_replay.cli ARGS`` is the ``umalloc`` console script (``pyproject.toml``: ``umalloc =
    umalloc_replay.cli:app``): a bad ``--model`` gives its one ``error:`` line and exit 2."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    res = subprocess.run([sys.executable, "-m", "umalloc_replay.cli", "generate", "--model", "nope"],
                         capture_output=True, text=True, env=env, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --model 'nope'"), res.stderr
