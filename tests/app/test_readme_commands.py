"""Every `umalloc replay` command the docs show (README.md and docs/*.md) still parses (options, values, ranges:
the command's own parser, no run), and the Azure example names its token scale (at the default scale 8 it would
run with 35 MB arenas)."""

from __future__ import annotations

from doc_blocks import umalloc_commands
from typer.main import get_command

from umalloc_replay.cli import app


def test_every_documented_replay_command_parses() -> None:
    cmds = umalloc_commands("replay")
    assert len(cmds) >= 8, cmds
    replay = get_command(app).commands["replay"]  # type: ignore[attr-defined]
    for args in cmds:
        ctx = replay.make_context("replay", list(args))  # raises on an unknown option or a bad value
        assert ctx.params["progress"] in (True, False)


def test_the_azure_example_names_its_token_scale() -> None:
    azure = [a for a in umalloc_commands("replay") if any("Azure" in x for x in a)]
    assert azure, "the docs lost their Azure example"
    for args in azure:
        assert "--token-scale" in args, args
        assert int(args[args.index("--token-scale") + 1]) == 1
