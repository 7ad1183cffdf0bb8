"""`umalloc` before any work starts: help, version and argument errors answer without torch, numba or an
engine; errors go to stderr and stdout carries the result only (item 2); a bad value is one
`error:` line with exit 2 (item 3); `replay --help` at 80 columns (item 5); the result table in a log and
`--format json` (item 6); Ctrl-C while the console script starts (item 25).

No test here measures time: "answers at once" is checked as "imports none of the heavy modules"."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import umalloc
from umalloc.geometry import presets
from umalloc_replay import (
    DEFAULT_PRESET_NAME,
    DRAFT_SLIDING,
    MAX_PAGE_SIZE_TOKENS,
    PRESET_NAMES,
    PRESETS_WITH_DRAFT,
)
from umalloc_replay.cli import app

#: Modules whose import takes seconds (torch, numba, numpy under them), an engine, or matplotlib.
HEAVY = ("torch", "numba", "numpy", "nixl_cu12", "mooncake", "matplotlib")

#: Run the console script in a fresh interpreter with ``argv``; print its exit status and the heavy modules
#: it imported as the last line of stderr (JSON).
PROBE = """
import json, sys
heavy = json.loads(sys.argv[2])
sys.argv = ["umalloc", *json.loads(sys.argv[1])]
from umalloc_replay.cli import app
try:
    app()
    code = 0
except SystemExit as exc:
    code = exc.code
sys.stderr.write("\\nPROBE " + json.dumps([code, [m for m in heavy if m in sys.modules]]) + "\\n")
"""

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(
    f"2023-11-16 18:15:4{i}.{i}805900,{40 + 10 * i},{6 + i}" for i in range(4))


def probe(args: list[str], env: dict | None = None) -> tuple[int, list[str], str, str]:
    """``(exit status, heavy modules imported, stdout, stderr without the probe line)`` of ``umalloc *args``."""
    res = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args), json.dumps(HEAVY)], capture_output=True,
                         text=True, timeout=300, env=env)
    head, _, tail = res.stderr.rpartition("\nPROBE ")
    assert tail, res.stderr
    code, heavy = json.loads(tail)
    return code, heavy, res.stdout, head


def test_the_app_spells_the_library_presets_right() -> None:
    """The preset names the CLI offers without importing the geometry are the library's own."""
    assert PRESET_NAMES == tuple(sorted(presets.PRESETS))
    assert DEFAULT_PRESET_NAME == presets.DEFAULT_PRESET
    assert PRESETS_WITH_DRAFT == tuple(sorted(n for n, p in presets.PRESETS.items() if p.draft is not None))
    assert DRAFT_SLIDING == presets.DRAFT_SLIDING


def test_the_app_spells_the_library_page_size_range_right() -> None:
    """``--page-size`` is range-checked without the geometry: its bound is the one :class:`umalloc.EndSpec`
    enforces."""
    layer = (umalloc.LayerSpec.mha(1, 8),)
    assert umalloc.EndSpec("full", layer, page_size=MAX_PAGE_SIZE_TOKENS).page_size == MAX_PAGE_SIZE_TOKENS
    with pytest.raises(umalloc.UmallocValueError, match="page_size"):
        umalloc.EndSpec("full", layer, page_size=MAX_PAGE_SIZE_TOKENS + 1)


@pytest.mark.parametrize("args, code", [
    (["--help"], 0), (["--version"], 0), (["replay", "--help"], 0), (["replay", "--page-size", "0"], 2),
    (["replay", "--trace", "/nonexistent/trace.jsonl"], 2), (["replay", "--model", "no-such-model"], 2),
    (["replay", "--arena-bytes", "1.5"], 2), (["replay", "--backend", "rdma"], 2),
    (["replay", "--plot", "p.gif"], 2), (["replay", "--max-prompt-tokens", "8"], 2),
    (["replay", "--page-size", "65537"], 2), (["generate", "--page-size", "65537"], 2),
    (["generate", "--draft-tokens", "3"], 2)])
def test_help_version_and_argument_errors_import_no_torch_numba_or_engine(args, code) -> None:
    """None of these imports torch, numba, numpy, an engine or matplotlib."""
    got, heavy, out, err = probe(args)
    assert got == code, (out, err)
    assert heavy == [], f"umalloc {' '.join(args)} imported {heavy}"
    if args == ["--version"]:
        assert out == f"umalloc {umalloc.__version__}\n"


def test_errors_go_to_stderr_and_stdout_stays_empty(tmp_path) -> None:
    """``umalloc replay --trace /nonexistent 2>/dev/null`` shows nothing."""
    missing = tmp_path / "nonexistent.jsonl"
    code, _, out, err = probe(["replay", "--trace", str(missing)])
    assert code == 2 and out == "", out
    assert err.strip().splitlines() == [f"error: --trace '{missing}' does not exist: allowed a Mooncake JSONL or "
                                        "Azure CSV file"], err


@pytest.mark.parametrize("args, option", [
    (["--page-size", "0"], "--page-size"), (["--requests", "-1"], "--requests"), (["--skip", "-2"], "--skip"),
    (["--token-scale", "0"], "--token-scale"), (["--max-batch", "zero"], "--max-batch"),
    (["--backend", "rdma"], "--backend"), (["--no-such-option"], "--no-such-option")])
def test_a_bad_value_is_one_error_line_with_exit_2(args, option) -> None:
    """Range, type and choice errors print the one-line ``error:`` form (no boxed usage)."""
    res = CliRunner().invoke(app, ["replay", *args])
    assert res.exit_code == 2, res.output
    assert res.stdout == "", res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and option in lines[0], res.stderr
    assert "Usage" not in res.stderr and "╭" not in res.stderr and "Traceback" not in res.stderr


def _replay_help_at(columns: int) -> str:
    code, _, out, err = probe(["replay", "--help"], env=dict(os.environ, COLUMNS=str(columns), TERM="xterm"))
    assert code == 0, err
    return out


def test_replay_help_at_80_columns_groups_options_and_shows_every_default() -> None:
    """Every option name whole, five panels, a default for every option that takes a value,
    and the plot formats that work."""
    text = _replay_help_at(80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    for panel in ("Trace", "Model and arena", "Backend", "Multi-rank", "Output"):
        assert re.search(rf"╭─ {re.escape(panel)} ─", text), panel
    from typer.main import get_command

    options = [o for p in get_command(app).commands["replay"].params for o in p.opts]  # type: ignore[attr-defined]
    assert len(options) >= 28
    flat = re.sub(r"[│╭╮╰╯─]", " ", text)
    for name in options:
        assert re.search(rf"(^|\s){re.escape(name)}(\s|$)", flat, re.M), f"{name} cut or missing"
    # the help block of each option: from its name to the next option's name (or the panel's end)
    starts = sorted((m.start(), m.group(1)) for m in re.finditer(r"^│ (--[a-z-]+)", text, re.M))
    for (pos, name), (nxt, _) in zip(starts, [*starts[1:], (len(text), "")], strict=True):
        block = text[pos:nxt].split("╰")[0]
        if name not in ("--help", "--multi-rank"):  # a flag without a value: --multi-rank is off unless given
            assert "[default:" in " ".join(block.split()), f"{name} shows no default:\n{block}"
    assert "(PNG)" not in text and ".pdf" in text and ".svg" in text


def test_the_result_table_stays_one_line_per_figure_in_a_log_and_json_is_the_report(tmp_path) -> None:
    """With stdout not a terminal each row is one line; ``--format json`` prints the report."""
    trace = tmp_path / "azure.csv"
    trace.write_text(AZURE)
    base = ["replay", "--trace", str(trace), "--requests", "2", "--token-scale", "1", "--no-progress"]
    res = CliRunner().invoke(app, base)
    assert res.exit_code == 0, res.output
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("│")]
    figures = [ln.split("│")[1].strip() for ln in rows]
    # every figure row names its figure in the first cell: a wrapped row would leave continuation lines with an
    # empty first cell
    assert all(figures[1:]), rows
    assert any(f == "per-layer-per-page / request" for f in figures), figures
    row = next(ln for ln in rows if "per-layer-per-page / request" in ln)
    assert "descriptors without envelopes and runs" in row, row
    report = tmp_path / "r.json"
    res = CliRunner().invoke(app, [*base, "--format", "json", "--report", str(report)])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got == json.loads(report.read_text()) and got["ok"] is True
    assert f"report: {report}" in res.stderr


CTRL_C_AT = """
import os, signal, sys
point = sys.argv[1]
sys.argv = ["umalloc", "replay", "--help"]
if point == "import":  # Ctrl-C while the console script imports typer
    import builtins
    real_import = builtins.__import__
    def hooked(name, *args, **kwargs):
        if name == "typer":
            os.kill(os.getpid(), signal.SIGINT)
        return real_import(name, *args, **kwargs)
    builtins.__import__ = hooked
from umalloc_replay.cli import app
if point == "build":  # Ctrl-C while typer builds the command from the function's signature
    import typer.main
    real_get = typer.main.get_command
    def get_command(typer_instance):
        os.kill(os.getpid(), signal.SIGINT)
        return real_get(typer_instance)
    typer.main.get_command = get_command
if point == "parse":  # Ctrl-C while the command parses its arguments
    from typer.core import TyperGroup
    real_parse = TyperGroup.parse_args
    def parse_args(self, ctx, args):
        os.kill(os.getpid(), signal.SIGINT)
        return real_parse(self, ctx, args)
    TyperGroup.parse_args = parse_args
app()
"""


@pytest.mark.parametrize("point", ["import", "build", "parse"])
def test_ctrl_c_during_start_up_is_quiet_and_exits_130(point) -> None:
    """A SIGINT at each start-up step (delivered at that step, not after a delay) ends the
    process with one ``interrupted`` line and exit 130, no traceback."""
    res = subprocess.run([sys.executable, "-c", CTRL_C_AT, point], capture_output=True, text=True, timeout=120)
    assert res.returncode == 130, (res.stdout, res.stderr)
    assert res.stderr.strip().splitlines() == ["interrupted"], res.stderr
    assert "Usage" not in res.stdout


def test_the_console_script_entry_point_is_the_app() -> None:
    """``umalloc`` (pyproject's console script) runs ``umalloc_replay.cli:app``."""
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert 'umalloc = "umalloc_replay.cli:app"' in text


def test_zero_token_prompts_are_reported(tmp_path) -> None:
    """The replay's report and table count the 0-token rows it ran as 1 token."""
    trace = tmp_path / "zero.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,0,4\n"
                     "2023-11-16 18:15:47.0,40,0\n2023-11-16 18:15:48.0,0,3\n")
    report = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["replay", "--trace", str(trace), "--token-scale", "1", "--no-progress",
                                   "--report", str(report)])
    assert res.exit_code == 0, res.output
    tok = json.loads(report.read_text())["tokens"]
    assert (tok["zero_prompts_as_1"], tok["zero_outputs_as_1"]) == (2, 1)
    row = next(ln for ln in res.stdout.splitlines() if "0-token rows" in ln)
    assert "2 prompts, 1 outputs" in row and "counted as 1 token" in row, row


def test_a_failed_report_write_exits_1_and_a_failed_print_is_not_called_a_write_failure(tmp_path, capsys):
    """The one output helper of ``umalloc replay`` and ``umalloc generate``: the result is printed first, then a
    report that cannot be written is an ``error:`` line and exit status 1; an error while printing propagates as
    itself (it is not the report's ``OSError``) and no report is written."""
    import io

    import typer
    from rich.console import Console

    from umalloc_replay.cli import OutputFormat, emit_result

    err = Console(file=io.StringIO(), width=400)
    result = {"requests": 3, "leaked_pages": 0}
    with pytest.raises(typer.Exit) as exited:
        emit_result(result, OutputFormat.json, lambda r: None, tmp_path / "no-such-folder" / "r.json", err)
    assert exited.value.exit_code == 1
    assert "error: writing the output failed" in err.file.getvalue()
    assert json.loads(capsys.readouterr().out) == result

    def closed_stdout(r):
        raise BrokenPipeError("stdout closed")

    with pytest.raises(BrokenPipeError):
        emit_result(result, OutputFormat.table, closed_stdout, tmp_path / "r.json", err)
    assert not (tmp_path / "r.json").exists()
