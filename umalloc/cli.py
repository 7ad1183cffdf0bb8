"""The ``umalloc`` console script (typer). Subcommands:

* ``umalloc replay`` — the main job: a real request trace through a prefill arena and a decode arena, every byte
  verified (:mod:`umalloc.replay.run`). With no arguments it replays a slice of the packaged Mooncake
  conversation trace on the default preset (Gemma-3-12B with its sliding-window layers and a Gemma-3-1B drafter)
  through the local backend, under memory pressure, in about two minutes on a 2-core machine.

Sizes accept plain bytes or a binary/decimal suffix (``512MiB``, ``2GiB``, ``1.5GB``); ``--arena-bytes`` takes one
size for both arenas or ``PREFILL,DECODE``. Every argument, the trace file and both output paths are checked
before anything runs (:mod:`umalloc.replay.preflight`). The exit status is 0 when every invariant of the report
holds, 1 when one does not, 2 for bad arguments (one ``error:`` line, nothing written), and 130 after Ctrl-C (one
``interrupted`` line; the second process of ``nixl``/``mooncake`` is ended).

With ``--prefill-tp``, ``--decode-tp``, ``--prefill-dcp``, ``--decode-dcp``, ``--prefill-head-groups`` or
``--decode-head-groups`` other than 1, a ``--prefill-page-size`` other than ``--page-size``, or ``--multi-rank``, it runs the multi-rank transfer replay instead
(:mod:`umalloc.replay.ranks`): one process per rank on each side, every rank's slice verified. A rank that dies
ends every process and exits 1 with one ``error:`` line naming the rank.
"""

from __future__ import annotations

import re
from enum import Enum
from fractions import Fraction
from pathlib import Path
from typing import Annotated

import typer

from umalloc.errors import BackendError, UmallocValueError
from umalloc.geometry.presets import DEFAULT_PRESET, PRESETS
from umalloc.replay import DEFAULT_REQUESTS, DEFAULT_TOKEN_SCALE
from umalloc.replay.ranks import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_RANK_REQUESTS, DEFAULT_RANK_TOKEN_SCALE

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="umalloc: multi-ended KV-cache page allocator. `umalloc replay` runs the main job.")


@app.callback()
def _main() -> None:
    """umalloc: multi-ended KV-cache page allocator."""


_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]i?[bB]?|[bB])?\s*$")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "ki": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "mi": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "gi": 2**30, "t": 10**12,
          "tb": 10**12, "tib": 2**40, "ti": 2**40}


def parse_size_bytes(text: str) -> int:
    """``"3GiB"`` -> 3221225472; plain ints are bytes; ``k/M/G/T`` are decimal, ``Ki/Mi/Gi/Ti`` binary.

    The value is exact (no float rounding) and must be a whole, positive number of bytes.

    Raises:
        UmallocValueError: not a size, zero, or a fraction of a byte (``"0.5"``, ``"1.5"``).

    >>> parse_size_bytes("1536MiB"), parse_size_bytes("2GB"), parse_size_bytes("4096"), parse_size_bytes("4.1GB")
    (1610612736, 2000000000, 4096, 4100000000)
    """
    m = _SIZE_RE.match(text)
    if m is None:
        raise UmallocValueError(f"size {text!r}: allowed an int or a number with a unit (e.g. 512MiB, 2GiB)")
    nbytes = Fraction(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if nbytes.denominator != 1 or nbytes < 1:
        raise UmallocValueError(f"size {text!r} is {float(nbytes):g} bytes: allowed a whole number of bytes >= 1")
    return int(nbytes)


def parse_arena_bytes(text: str) -> tuple[int, int]:
    """``"SIZE"`` (both arenas) or ``"PREFILL,DECODE"`` -> ``(prefill_bytes, decode_bytes)``.

    Raises:
        UmallocValueError: not one or two sizes (see :func:`parse_size_bytes`).

    >>> parse_arena_bytes("1GiB,3GiB")
    (1073741824, 3221225472)
    """
    parts = text.split(",")
    if len(parts) not in (1, 2):
        raise UmallocValueError(f"--arena-bytes {text!r}: allowed SIZE or PREFILL,DECODE")
    try:
        sizes = [parse_size_bytes(p) for p in parts]
    except UmallocValueError as exc:
        raise UmallocValueError(f"--arena-bytes: {exc}") from None
    return (sizes[0], sizes[-1])


class BackendName(str, Enum):
    local = "local"
    nixl = "nixl"
    mooncake = "mooncake"


class CompactionMode(str, Enum):
    lazy = "lazy"
    eager = "eager"
    off = "off"


class TraceFormat(str, Enum):
    auto = "auto"
    mooncake = "mooncake"
    azure = "azure"


@app.command()
def replay(
    trace: Annotated[Path | None, typer.Option(
        "--trace", help="Trace file: Mooncake JSONL or Azure LLM inference CSV. Default: the packaged Mooncake "
        "conversation trace (Apache-2.0).")] = None,
    trace_format: Annotated[TraceFormat, typer.Option("--trace-format", help="Trace format.")] = TraceFormat.auto,
    model: Annotated[str, typer.Option("--model", help=f"Model preset: {', '.join(sorted(PRESETS))}.")
                     ] = DEFAULT_PRESET,
    page_size: Annotated[int, typer.Option("--page-size", min=1, help="Tokens per page.")] = 16,
    arena_bytes: Annotated[str | None, typer.Option(
        "--arena-bytes", help="Arena bytes: SIZE for both or PREFILL,DECODE (e.g. 2GiB,3GiB; rounded down to 16 "
        "bytes). Default: sized from the slice, tight enough to keep the decode arena under pressure.")] = None,
    backend: Annotated[BackendName, typer.Option(
        "--backend", help="Transfer backend; nixl and mooncake run the prefill side in a second process.")
    ] = BackendName.local,
    requests: Annotated[int | None, typer.Option(
        "--requests", min=1, help="Replay N requests (at most the trace's rows after --skip). "
        f"[default: {DEFAULT_REQUESTS}, or every row of a shorter trace]")] = None,
    skip: Annotated[int, typer.Option("--skip", min=0, help="Start the slice after the first N rows of the "
                                      "trace.")] = 0,
    token_scale: Annotated[int | None, typer.Option(
        "--token-scale", min=1, help="Divide every token count by K (ceiling, at least 1). "
        f"[default: {DEFAULT_TOKEN_SCALE}]")] = None,
    draft: Annotated[bool | None, typer.Option(
        "--draft/--no-draft", help="Include the drafter's pool. [default: --draft where the preset has a drafter]",
        show_default=False)] = None,
    layout: Annotated[str, typer.Option(
        "--layout", help="Decode arena layout: dynamic (one multi-ended arena), static[:RATIO] (a fixed region "
        "per end, RATIO = SWA tokens / full tokens as SGLang's --swa-full-tokens-ratio) or padded (every end "
        "padded as vLLM's hybrid allocator unifies page sizes).")] = "dynamic",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the KV pattern.")] = 0,
    report: Annotated[Path | None, typer.Option("--report", help="Write the JSON report here.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write the occupancy plot (PNG) here.")] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", min=1, help="Most requests decoding at once.")] = 64,
    compaction: Annotated[CompactionMode, typer.Option("--compaction", help="Allocator compaction mode.")
                          ] = CompactionMode.lazy,
    check_every: Annotated[int, typer.Option(
        "--check-every", min=0, help="Run check_invariants() on both sides every N steps (0: at the end only).")
    ] = 0,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show the progress bar.")] = True,
    prefill_tp: Annotated[int, typer.Option(
        "--prefill-tp", min=1, help="Prefill TP size: with any of the multi-rank options below other than 1 (or "
        "--multi-rank) the replay runs one process per rank on each side and verifies every rank's slice.")] = 1,
    decode_tp: Annotated[int, typer.Option("--decode-tp", min=1, help="Decode TP size (multi-rank).")] = 1,
    prefill_dcp: Annotated[int, typer.Option("--prefill-dcp", min=1, help="Prefill DCP size (multi-rank).")] = 1,
    decode_dcp: Annotated[int, typer.Option("--decode-dcp", min=1, help="Decode DCP size (multi-rank).")] = 1,
    prefill_page_size: Annotated[int | None, typer.Option(
        "--prefill-page-size", min=1, help="Prefill tokens per page (multi-rank; --page-size is decode's). "
        "[default: --page-size]")] = None,
    prefill_head_groups: Annotated[int, typer.Option(
        "--prefill-head-groups", min=1, help="Multi-rank: head groups of the prefill ranks' pages (1: page-major "
        "envelope; G > 1: head-group-outer on every end whose heads divide by G).")] = 1,
    decode_head_groups: Annotated[int, typer.Option(
        "--decode-head-groups", min=1, help="Multi-rank: head groups of the decode ranks' pages.")] = 1,
    max_prompt_tokens: Annotated[int | None, typer.Option(
        "--max-prompt-tokens", min=1, help="Multi-rank: cap every scaled prompt at N tokens. "
        f"[default: {DEFAULT_MAX_PROMPT_TOKENS}]")] = None,
    multi_rank: Annotated[bool, typer.Option(
        "--multi-rank", help="Run the multi-rank replay even at TP 1, DCP 1 and one page size (one process per "
        "side). Multi-rank defaults: --requests " f"{DEFAULT_RANK_REQUESTS}, --token-scale {DEFAULT_RANK_TOKEN_SCALE}; "
        "--max-batch is the requests in flight per step; --arena-bytes sizes every rank's arena.")] = False,
) -> None:
    """Replay a real request trace through a prefill arena and a decode arena; verify every byte."""
    from rich.console import Console
    from rich.markup import escape

    from umalloc.replay.preflight import check_output_file, check_trace_file, resolve_plot_path
    from umalloc.replay.ranks import RankError, RanksConfig, is_multi_rank, run_ranks
    from umalloc.replay.ranks_report import check_ranks_report, ranks_table
    from umalloc.replay.report import check_report, report_table
    from umalloc.replay.run import ReplayConfig, run_replay

    console = Console()

    def fail(msg: str, code: int) -> typer.Exit:
        # soft_wrap: a path or a figure in the message is never split across lines; escape: "[...]" in a
        # message is text, not rich markup
        console.print(f"[red]error:[/red] {escape(msg)}", soft_wrap=True)
        return typer.Exit(code)

    try:
        try:
            pre_b, dec_b = parse_arena_bytes(arena_bytes) if arena_bytes is not None else (None, None)
            if trace is not None:
                check_trace_file(trace)
            if draft and model in PRESETS and PRESETS[model].draft is None:
                raise UmallocValueError(
                    f"--draft: preset {model!r} has no drafter: allowed --no-draft, or a preset with one "
                    f"({', '.join(sorted(n for n, p in PRESETS.items() if p.draft is not None))})")
            if report is not None:
                check_output_file(report, "--report")
            plot_path = resolve_plot_path(plot) if plot is not None else None
            if plot_path is not None and report is not None and plot_path.resolve() == report.resolve():
                raise UmallocValueError(f"--report and --plot name the same file {str(report)!r}")
            table_of, check_of = report_table, check_report
            if multi_rank or prefill_head_groups > 1 or decode_head_groups > 1 or \
                    is_multi_rank(prefill_tp, decode_tp, prefill_dcp, decode_dcp, prefill_page_size, page_size):
                if layout != "dynamic" or plot_path is not None:
                    raise UmallocValueError(f"{'--plot' if plot_path is not None else '--layout ' + layout}: the "
                                            "multi-rank replay runs the dynamic layout and draws no plot; allowed "
                                            "without it")
                rcfg = RanksConfig(
                    backend=backend.value, trace=None if trace is None else str(trace),
                    trace_format=None if trace_format is TraceFormat.auto else trace_format.value, model=model,
                    page_size=page_size, prefill_page_size=prefill_page_size, prefill_tp=prefill_tp,
                    decode_tp=decode_tp, prefill_dcp=prefill_dcp, decode_dcp=decode_dcp,
                    prefill_head_groups=prefill_head_groups, decode_head_groups=decode_head_groups,
                    prefill_arena_bytes=pre_b, decode_arena_bytes=dec_b, requests=requests, skip=skip,
                    token_scale=token_scale,
                    max_prompt_tokens=DEFAULT_MAX_PROMPT_TOKENS if max_prompt_tokens is None else max_prompt_tokens,
                    draft=True if draft is None else draft, seed=seed, max_batch=max_batch,
                    compaction=compaction.value, check_every=check_every)
                result = run_ranks(rcfg, progress=progress, console=console)
                table_of, check_of = ranks_table, check_ranks_report
            else:
                if max_prompt_tokens is not None:
                    raise UmallocValueError(f"--max-prompt-tokens {max_prompt_tokens}: only the multi-rank replay "
                                            "caps prompts; allowed with --multi-rank or a multi-rank option "
                                            "(--prefill-tp, --decode-tp, ...), or without it")
                cfg = ReplayConfig(
                    trace=None if trace is None else str(trace),
                    trace_format=None if trace_format is TraceFormat.auto else trace_format.value,
                    model=model, page_size=page_size, prefill_arena_bytes=pre_b, decode_arena_bytes=dec_b,
                    backend=backend.value, requests=requests, skip=skip, token_scale=token_scale,
                    draft=True if draft is None else draft, seed=seed, max_batch=max_batch,
                    compaction=compaction.value, check_every=check_every, layout=layout,
                )
                result = run_replay(cfg, progress=progress, console=console)
        except UmallocValueError as exc:
            raise fail(str(exc), 2) from None
        except RankError as exc:  # a rank of the multi-rank replay died or failed: every rank was ended
            raise fail(str(exc), 1) from None
        except BackendError as exc:  # a transfer engine or the second process failed mid-run (e.g. killed)
            raise fail(f"the {backend.value} backend failed: {exc}", 1) from None
        console.print(table_of(result))
        try:
            if report is not None:
                import json

                report.write_text(json.dumps(result, indent=1) + "\n")
                console.print(f"report: {report}", soft_wrap=True)
            if plot_path is not None:
                from umalloc.replay.plot import plot_report

                console.print(f"plot: {plot_report(result, plot_path)}", soft_wrap=True)
        except OSError as exc:  # checked up front; the disk may still fill up or the folder go away
            raise fail(f"writing the output failed: {exc}", 1) from None
    except KeyboardInterrupt:
        console.print("interrupted")
        raise typer.Exit(130) from None
    problems = check_of(result)
    if problems:
        for p in problems:
            console.print(f"[red]invariant:[/red] {escape(str(p))}", soft_wrap=True)
        raise typer.Exit(1)


__all__ = ["app", "parse_arena_bytes", "parse_size_bytes"]
