"""Request traces for ``umalloc replay``: the Mooncake JSONL format and the Azure LLM inference CSV format.

Policy:

* A trace is a sequence of requests in **file order** (both public traces are sorted by arrival); arrival
  times are kept as seconds relative to the first row and never reorder requests.
* Token counts are scaled by ``token_scale`` with a ceiling division and a floor of one token
  (``max(1, ceil(n / K))``), so every request keeps at least one prompt and one output token.
* Parsing is strict: a malformed row raises :class:`TraceFormatError` naming the file, the line and the field;
  nothing is silently skipped or clamped.
* No pandas: the Azure ``TIMESTAMP`` column carries 7 fractional digits (100 ns ticks), which
  ``datetime.strptime(..., "%f")`` rejects, so :func:`parse_timestamp_ns` parses it to integer nanoseconds by
  hand (any 0-9 fractional digits).

Formats:

* Mooncake (kvcache-ai/Mooncake ``FAST25-release/traces/*.jsonl``; Qin et al., FAST'25): one JSON object per
  line with ``timestamp`` (int, milliseconds from the trace start), ``input_length``, ``output_length`` (tokens)
  and ``hash_ids`` (one prefix-block hash per 512-token block).
* Azure (Azure/AzurePublicDataset ``data/AzureLLMInferenceTrace_{conv,code}.csv``; Patel et al., Splitwise,
  ISCA'24): header ``TIMESTAMP,ContextTokens,GeneratedTokens``; ``TIMESTAMP`` is
  ``YYYY-MM-DD HH:MM:SS.fffffff`` without a time zone.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from umalloc import UmallocValueError
from umalloc_replay.preflight import SNIFF_BYTES, check_trace_file

#: Block size (tokens) of the Mooncake ``hash_ids``.
MOONCAKE_HASH_BLOCK_TOKENS = 512

#: File name of the trace shipped inside the package (``umalloc_replay/data``).
DEFAULT_TRACE_NAME = "conversation_trace.jsonl"

TRACE_FORMATS = ("mooncake", "azure")


class TraceFormatError(UmallocValueError):
    """A trace file that cannot be parsed; the message names the file, the line and the field."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        request_id: 0-based row of the trace file (``--skip`` rows included), so a message naming a request
            names its row.
        arrival_s: arrival in seconds relative to the slice's first row.
        input_tokens: prompt length in tokens (after ``token_scale``), >= 1.
        output_tokens: generated length in tokens (after ``token_scale``), >= 1.
        hash_ids: Mooncake prefix-block hashes (one per 512 unscaled tokens), empty for Azure traces.
    """

    request_id: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Trace:
    """A parsed trace: requests in file order plus where they came from.

    Attributes:
        path: the file read.
        format: ``"mooncake"`` or ``"azure"``.
        token_scale: the divisor applied to every token count.
        requests: the requests, in file order.
        zero_prompts, zero_outputs: requests of the slice whose prompt / output has 0 tokens in the file; the
            replay counts each as 1 token (a request needs a token to hold a page), and its report says how many.
    """

    path: str
    format: str
    token_scale: int
    requests: tuple[TraceRequest, ...]
    zero_prompts: int = 0
    zero_outputs: int = 0

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def input_tokens(self) -> np.ndarray:
        """``int64 (n,)`` prompt lengths."""
        return np.fromiter((r.input_tokens for r in self.requests), dtype=np.int64, count=len(self.requests))

    @property
    def output_tokens(self) -> np.ndarray:
        """``int64 (n,)`` output lengths."""
        return np.fromiter((r.output_tokens for r in self.requests), dtype=np.int64, count=len(self.requests))

    @property
    def arrival_s(self) -> np.ndarray:
        """``float64 (n,)`` arrival times (seconds from the first row)."""
        return np.fromiter((r.arrival_s for r in self.requests), dtype=np.float64, count=len(self.requests))

    def summary(self) -> dict:
        """Counts and token totals (plain ints/floats, JSON-ready)."""
        inp, out = self.input_tokens, self.output_tokens
        return {
            "path": self.path, "format": self.format, "token_scale": self.token_scale,
            "requests": len(self.requests),
            "input_tokens": int(inp.sum()) if len(inp) else 0,
            "output_tokens": int(out.sum()) if len(out) else 0,
            "max_input_tokens": int(inp.max()) if len(inp) else 0,
            "max_output_tokens": int(out.max()) if len(out) else 0,
            "span_s": float(self.requests[-1].arrival_s) if self.requests else 0.0,
            "zero_prompts": self.zero_prompts, "zero_outputs": self.zero_outputs,
        }


def scale_tokens(num_tokens: int, token_scale: int) -> int:
    """``max(1, ceil(num_tokens / token_scale))``.

    Raises:
        UmallocValueError: ``token_scale < 1`` or ``num_tokens < 0``.

    >>> scale_tokens(6758, 16), scale_tokens(1, 16), scale_tokens(0, 4), scale_tokens(32, 16)
    (423, 1, 1, 2)
    """
    if isinstance(token_scale, bool) or not isinstance(token_scale, int) or token_scale < 1:
        raise UmallocValueError(f"token_scale={token_scale!r}: allowed an int >= 1")
    if num_tokens < 0:
        raise UmallocValueError(f"num_tokens={num_tokens!r}: allowed >= 0")
    return max(1, -(-num_tokens // token_scale))


_TS_RE = re.compile(r"^\s*(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?\s*$")
_EPOCH_ORDINAL = _dt.date(1970, 1, 1).toordinal()


def parse_timestamp_ns(text: str) -> int:
    """Parse ``YYYY-MM-DD HH:MM:SS[.f{1,9}]`` (no time zone) into integer nanoseconds since 1970-01-01.

    Any number of fractional digits from 0 to 9 is accepted (the Azure traces use 7, 100 ns ticks, which
    ``datetime.strptime``'s ``%f`` rejects); the value is exact, with no float rounding.

    Raises:
        TraceFormatError: not of that form, or not a valid calendar date/time.

    >>> parse_timestamp_ns("1970-01-01 00:00:01.0000001")
    1000000100
    >>> parse_timestamp_ns("2023-11-16 18:15:50.9951690") - parse_timestamp_ns("2023-11-16 18:15:46.6805900")
    4314579000
    """
    m = _TS_RE.match(text)
    if m is None:
        raise TraceFormatError(f"timestamp {text!r}: allowed 'YYYY-MM-DD HH:MM:SS[.fffffff]' (0-9 fraction digits)")
    y, mo, d, hh, mm, ss = (int(m.group(i)) for i in range(1, 7))
    frac = m.group(7) or ""
    try:
        day = _dt.date(y, mo, d).toordinal() - _EPOCH_ORDINAL
        _dt.time(hh, mm, ss)
    except ValueError as exc:
        raise TraceFormatError(f"timestamp {text!r}: {exc}") from None
    secs = day * 86400 + hh * 3600 + mm * 60 + ss
    return secs * 1_000_000_000 + int(frac.ljust(9, "0") or "0")


def _nonneg_int(value: object, where: str, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceFormatError(f"{where}: field {field!r}={value!r}: allowed a non-negative int")
    return value


def _check_limit(max_requests: int | None, skip: int) -> None:
    if max_requests is not None and (isinstance(max_requests, bool) or not isinstance(max_requests, int)
                                     or max_requests < 1):
        raise UmallocValueError(f"max_requests={max_requests!r}: allowed None or an int >= 1")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise UmallocValueError(f"skip={skip!r}: allowed an int >= 0")


def trace_label(path: str | Path | None) -> str:
    """How messages name a trace: ``packaged trace conversation_trace.jsonl`` for ``None`` or the packaged file
    (:func:`default_trace_path`, wherever the package is installed), else the path as given."""
    if path is None:
        return f"packaged trace {DEFAULT_TRACE_NAME}"
    p = Path(path)
    if p.name == DEFAULT_TRACE_NAME and p.resolve() == default_trace_path().resolve():
        return f"packaged trace {DEFAULT_TRACE_NAME}"
    return str(path)


def check_slice_rows(trace: Trace, asked: int | None, skip: int) -> None:
    """Refuse a slice shorter than the ``--requests`` asked for (``None``: every row, nothing to check).

    Raises:
        UmallocValueError: naming ``--requests``, the trace (:func:`trace_label`), its rows after ``--skip``
            and the allowed range.
    """
    if asked is not None and len(trace) < asked:
        after = f" after --skip {skip}" if skip else ""
        raise UmallocValueError(f"--requests {asked}: {trace_label(trace.path)} holds only {len(trace)} "
                                f"requests{after}: allowed --requests <= {len(trace)}")


def _no_rows(path: Path, skip: int, rows: int) -> TraceFormatError:
    if skip and rows:
        return TraceFormatError(f"--skip {skip} passes every one of the {rows} requests of {trace_label(path)}: "
                                f"allowed --skip <= {rows - 1}")
    return TraceFormatError(f"{trace_label(path)}: no requests")


def read_mooncake_jsonl(path: str | Path, *, token_scale: int = 1, max_requests: int | None = None,
                        skip: int = 0) -> Trace:
    """Read a Mooncake JSONL trace.

    Args:
        path: the ``.jsonl`` file.
        token_scale: divide every token count by this (ceiling, at least 1 token); see :func:`scale_tokens`.
        max_requests: keep only the first N rows after ``skip`` (``None``: all).
        skip: pass over the first ``skip`` rows (not parsed, only counted).

    Returns:
        A :class:`Trace` with ``arrival_s = (timestamp - first kept timestamp) / 1000``.

    Raises:
        TraceFormatError: a line that is not a JSON object with int ``timestamp``, ``input_length``,
            ``output_length`` (and, if present, a list of int ``hash_ids``), a line that is not UTF-8, or no rows
            after ``skip``.
        UmallocValueError: bad ``token_scale`` / ``max_requests``.

    Complexity: O(rows read); stops reading after ``max_requests`` rows.
    """
    scale_tokens(0, token_scale)
    _check_limit(max_requests, skip)
    path = Path(path)
    reqs: list[TraceRequest] = []
    zeros = [0, 0]  # rows of the slice with a 0-token prompt, output
    t0: int | None = None
    row_index = -1
    label = trace_label(path)
    for lineno, line in _text_lines(path):
        if not line.strip():
            continue
        row_index += 1
        if row_index < skip:
            continue
        where = f"{label}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            # json's message names the place with a trailing "at" ("Invalid control character at"); the column
            # completes it
            what = exc.msg.removesuffix(" at")
            raise TraceFormatError(f"{where}:{exc.colno}: not JSON: {what} at column {exc.colno}") from None
        if not isinstance(row, dict):
            raise TraceFormatError(f"{where}: allowed a JSON object per line")
        for key in ("timestamp", "input_length", "output_length"):
            if key not in row:
                raise TraceFormatError(f"{where}: missing field {key!r}")
        ts = _nonneg_int(row["timestamp"], where, "timestamp")
        inp = _nonneg_int(row["input_length"], where, "input_length")
        out = _nonneg_int(row["output_length"], where, "output_length")
        hashes = row.get("hash_ids", [])
        if not isinstance(hashes, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in hashes):
            raise TraceFormatError(f"{where}: field 'hash_ids': allowed a list of ints")
        if t0 is None:
            t0 = ts
        reqs.append(TraceRequest(row_index, (ts - t0) / 1000.0, scale_tokens(inp, token_scale),
                                 scale_tokens(out, token_scale), tuple(hashes)))
        zeros[0] += int(inp == 0)
        zeros[1] += int(out == 0)
        if max_requests is not None and len(reqs) >= max_requests:
            break
    if not reqs:
        raise _no_rows(path, skip, row_index + 1)
    return Trace(str(path), "mooncake", token_scale, tuple(reqs), *zeros)


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a UTF-8 text file; a line that is not UTF-8 raises :class:`TraceFormatError`."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceFormatError(f"{trace_label(path)}:{lineno}: not UTF-8 text (byte {exc.start} of the "
                                       "line)") from None


AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def read_azure_csv(path: str | Path, *, token_scale: int = 1, max_requests: int | None = None,
                   skip: int = 0) -> Trace:
    """Read an Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Args:
        path: the ``.csv`` file (a missing final newline is fine).
        token_scale: see :func:`scale_tokens`.
        max_requests: keep only the first N rows after ``skip``.
        skip: pass over the first ``skip`` data rows (not parsed, only counted).

    Returns:
        A :class:`Trace` whose ``arrival_s`` is ``TIMESTAMP`` minus the first kept row's, in seconds (exact to the
        100 ns tick before conversion to float).

    Raises:
        TraceFormatError: missing columns, a bad timestamp (see :func:`parse_timestamp_ns`), a non-integer or
            negative token count, text that is not UTF-8, or no rows after ``skip``.

    Complexity: O(rows read).
    """
    scale_tokens(0, token_scale)
    _check_limit(max_requests, skip)
    path = Path(path)
    try:
        return _read_azure(path, token_scale, max_requests, skip)
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{trace_label(path)}: not UTF-8 text (byte {exc.start} of a read block)") from None


def _read_azure(path: Path, token_scale: int, max_requests: int | None, skip: int) -> Trace:
    reqs: list[TraceRequest] = []
    zeros = [0, 0]  # rows of the slice with a 0-token prompt, output
    row_index = -1
    with path.open("r", encoding="utf-8", newline="") as fh:
        reader = csv.reader(fh)
        try:
            header = next(reader)
        except StopIteration:
            raise TraceFormatError(f"{trace_label(path)}: empty file, allowed a header {','.join(AZURE_COLUMNS)}") \
                from None
        header = [h.strip().lstrip("\ufeff") for h in header]
        missing = [c for c in AZURE_COLUMNS if c not in header]
        if missing:
            raise TraceFormatError(f"{trace_label(path)}:1: missing column(s) {', '.join(missing)}: allowed a header "
                                   f"{','.join(AZURE_COLUMNS)} (an Azure CSV trace; --trace-format mooncake for "
                                   "a Mooncake JSONL one)")
        i_ts, i_in, i_out = (header.index(c) for c in AZURE_COLUMNS)
        label = trace_label(path)
        t0: int | None = None
        for row in reader:
            lineno = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            row_index += 1
            if row_index < skip:
                continue
            where = f"{label}:{lineno}"
            if len(row) != len(header):
                raise TraceFormatError(f"{where}: {len(row)} fields, allowed {len(header)}")
            try:
                ts = parse_timestamp_ns(row[i_ts])
            except TraceFormatError as exc:
                raise TraceFormatError(f"{where}: field 'TIMESTAMP': {exc}") from None
            counts = []
            for i, name in ((i_in, "ContextTokens"), (i_out, "GeneratedTokens")):
                text = row[i].strip()
                if not text.isdigit():
                    raise TraceFormatError(f"{where}: field {name!r}={row[i]!r}: allowed a non-negative int")
                counts.append(int(text))
            if t0 is None:
                t0 = ts
            reqs.append(TraceRequest(row_index, (ts - t0) / 1e9, scale_tokens(counts[0], token_scale),
                                     scale_tokens(counts[1], token_scale)))
            zeros[0] += int(counts[0] == 0)
            zeros[1] += int(counts[1] == 0)
            if max_requests is not None and len(reqs) >= max_requests:
                break
    if not reqs:
        raise _no_rows(path, skip, row_index + 1)
    return Trace(str(path), "azure", token_scale, tuple(reqs), *zeros)


def default_trace_path() -> Path:
    """Path of the Mooncake conversation trace shipped in ``umalloc_replay/data`` (Apache-2.0, see its NOTICE)."""
    return Path(str(resources.files("umalloc_replay") / "data" / DEFAULT_TRACE_NAME))


def detect_format(path: str | Path) -> str:
    """``"azure"`` for a ``.csv`` file or one whose first line is a header naming ``TIMESTAMP``, else
    ``"mooncake"``."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        return "azure"
    with path.open("rb") as fh:
        first = fh.readline(SNIFF_BYTES).decode("utf-8", errors="replace")
    return "azure" if "TIMESTAMP" in first and not first.lstrip().startswith("{") else "mooncake"


def load_trace(path: str | Path | None = None, *, token_scale: int = 1, max_requests: int | None = None,
               fmt: str | None = None, skip: int = 0) -> Trace:
    """Read a trace of either format (``fmt=None``: :func:`detect_format`); ``path=None`` reads the packaged
    Mooncake conversation trace. ``skip`` rows are passed over, then up to ``max_requests`` kept.

    Raises:
        TraceFormatError: see the readers; also a missing file, a directory, or a binary file.
        UmallocValueError: ``fmt`` not in :data:`TRACE_FORMATS`.

    >>> t = load_trace(token_scale=16, max_requests=2)
    >>> [(r.request_id, r.arrival_s, r.input_tokens, r.output_tokens) for r in t]
    [(0, 0.0, 423, 32), (1, 0.0, 458, 31)]
    """
    p = default_trace_path() if path is None else Path(path)
    try:
        check_trace_file(p)
    except UmallocValueError as exc:
        raise TraceFormatError(str(exc).replace("--trace ", "trace file ", 1)) from None
    if fmt is None:
        fmt = detect_format(p)
    if fmt == "mooncake":
        return read_mooncake_jsonl(p, token_scale=token_scale, max_requests=max_requests, skip=skip)
    if fmt == "azure":
        return read_azure_csv(p, token_scale=token_scale, max_requests=max_requests, skip=skip)
    raise UmallocValueError(f"trace format {fmt!r}: allowed one of {TRACE_FORMATS}")


__all__ = [
    "AZURE_COLUMNS", "DEFAULT_TRACE_NAME", "MOONCAKE_HASH_BLOCK_TOKENS", "TRACE_FORMATS", "Trace",
    "TraceFormatError", "TraceRequest", "check_slice_rows", "default_trace_path", "detect_format", "load_trace",
    "parse_timestamp_ns", "read_azure_csv", "read_mooncake_jsonl", "scale_tokens", "trace_label",
]
