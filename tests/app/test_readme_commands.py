"""Every `umalloc replay` command the README shows still parses after the app moved to ``umalloc_replay``
(options, values, ranges: the command's own parser, no run), and the Azure example names its token scale
(issue 26 item 13: at the default scale 8 it ran with 35 MB arenas)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from typer.main import get_command

from umalloc_replay.cli import app

README = Path(__file__).resolve().parents[2] / "README.md"


def _commands() -> list[list[str]]:
    lines = re.findall(r"^\$ umalloc replay(.*)$", README.read_text(), flags=re.M)
    return [shlex.split(line.split("  #", 1)[0]) for line in lines]


def test_every_readme_replay_command_parses() -> None:
    cmds = _commands()
    assert len(cmds) >= 8, cmds
    replay = get_command(app).commands["replay"]  # type: ignore[attr-defined]
    for args in cmds:
        ctx = replay.make_context("replay", list(args))  # raises on an unknown option or a bad value
        assert ctx.params["progress"] in (True, False)


def test_the_azure_example_names_its_token_scale() -> None:
    azure = [a for a in _commands() if any("Azure" in x for x in a)]
    assert azure, "the README lost its Azure example"
    for args in azure:
        assert "--token-scale" in args, args
        assert int(args[args.index("--token-scale") + 1]) == 1
