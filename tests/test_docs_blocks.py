"""Every code block of README.md and docs/*.md is checked, so the documentation cannot go stale: a python block
runs as written (or carries a ``<!-- not-run: reason -->`` marker saying where it runs instead), a shell block's
``umalloc ...`` commands parse with the command's own parser (nothing runs), and the scripts and benchmarks a
shell block names exist."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
from doc_blocks import LANGUAGES, REPO, SHELLS, Block, all_blocks, read_blocks, shell_commands
from typer.main import get_command

from umalloc_replay.cli import app

BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if b.lang == "python" and b.not_run is None]
NOT_RUN = [b for b in BLOCKS if b.not_run is not None]


def test_every_fence_names_a_known_language() -> None:
    wrong = [f"{b.name}: {b.lang or '(none)'}" for b in BLOCKS if b.lang not in LANGUAGES]
    assert not wrong, f"blocks whose fence names no language of {LANGUAGES}:\n" + "\n".join(wrong)


def test_the_docs_have_blocks_to_run() -> None:
    # README.md's example, docs/usage.md's two and docs/engines.md's transformers example run here
    assert len(RUN) >= 4, [b.name for b in RUN]
    assert any(b.path.name == "README.md" for b in RUN)


@pytest.mark.parametrize("block", RUN, ids=[b.name for b in RUN])
def test_python_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "block.py"
    script.write_text(block.code)
    runpy.run_path(str(script), run_name="__main__")
    capsys.readouterr()


def test_a_not_run_marker_gives_a_reason_and_sits_before_a_python_block() -> None:
    # a reason of a few words at least ("needs SGLang ...", "runs in tests/..."), so a bare marker cannot hide a block
    wrong = [b.name for b in NOT_RUN if b.lang != "python" or len((b.not_run or "").split()) < 3]
    assert not wrong, f"not-run markers without a reason or before a block that is not python: {wrong}"


def test_the_marker_reader_sees_markers_and_unmarked_blocks(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text("text\n\n<!-- not-run: needs an engine here -->\n\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n"
                   "```console\n$ umalloc replay --requests 4  # four\nout\n```\n")
    blocks = read_blocks(doc)
    assert [(b.line, b.lang, b.code, b.not_run) for b in blocks] == [
        (5, "python", "x = 1\n", "needs an engine here"), (9, "python", "y = 2\n", None),
        (12, "console", "$ umalloc replay --requests 4  # four\nout\n", None)]
    assert shell_commands(blocks[2]) == [["umalloc", "replay", "--requests", "4"]]
    (tmp_path / "open.md").write_text("```python\nx = 1\n")
    with pytest.raises(ValueError, match="never closes"):
        read_blocks(tmp_path / "open.md")


def _shell_commands() -> list[tuple[str, list[str]]]:
    return [(b.name, cmd) for b in BLOCKS if b.lang in SHELLS for cmd in shell_commands(b)]


def test_every_umalloc_command_in_a_shell_block_parses() -> None:
    commands = [(name, cmd) for name, cmd in _shell_commands() if cmd[0] == "umalloc"]
    assert len(commands) >= 14, commands   # 9 replay commands in docs/replay.md, 7 generate ones in docs/generate.md
    group = get_command(app)
    for name, cmd in commands:
        sub = group.commands.get(cmd[1])  # type: ignore[attr-defined]
        assert sub is not None, f"{name}: umalloc has no command {cmd[1]!r}"
        sub.make_context(cmd[1], list(cmd[2:]))  # raises on an unknown option or a bad value


def test_every_script_a_shell_block_names_exists() -> None:
    named = {arg for _, cmd in _shell_commands() for arg in cmd
             if arg.startswith(("scripts/", "benchmarks/")) and arg.endswith((".sh", ".py"))}
    assert "scripts/test.sh" in named and "scripts/replay.sh" in named, named
    missing = sorted(p for p in named if not (REPO / p).is_file())
    assert not missing, f"shell blocks name files that do not exist: {missing}"
