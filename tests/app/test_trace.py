"""Trace parsers: Mooncake JSONL and Azure LLM inference CSV (7-digit fractional timestamps), token scaling."""

from __future__ import annotations

import datetime as dt
import hashlib

import pytest

from umalloc.errors import UmallocValueError
from umalloc_replay.trace import (
    TraceFormatError,
    default_trace_path,
    detect_format,
    load_trace,
    parse_timestamp_ns,
    read_azure_csv,
    read_mooncake_jsonl,
    scale_tokens,
)

AZURE = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:15:46.6805900,374,44\n"
    "2023-11-16 18:15:50.9951690,396,109\n"
    "2023-11-16 18:16:00.0000001,10,1\n"
    "2023-11-17 00:00:00.5000000,7,3"  # no final newline, like the real file; crosses midnight
)

MOONCAKE = (
    '{"timestamp": 1000, "input_length": 891, "output_length": 1, "hash_ids": [0, 1]}\n'
    '{"timestamp": 4001, "input_length": 1024, "output_length": 350, "hash_ids": [0, 2]}\n'
    "\n"
    '{"timestamp": 4001, "input_length": 5, "output_length": 0, "hash_ids": [0]}\n'
)


def test_strptime_rejects_seven_digits_which_is_why_we_parse_by_hand():
    with pytest.raises(ValueError):
        dt.datetime.strptime("2023-11-16 18:15:46.6805900", "%Y-%m-%d %H:%M:%S.%f")


def test_parse_timestamp_ns_exact():
    # 1970-01-02 00:00:01.0000001 = 86401 s + 100 ns
    assert parse_timestamp_ns("1970-01-02 00:00:01.0000001") == 86_401 * 10**9 + 100
    assert parse_timestamp_ns("1970-01-01 00:00:00") == 0
    assert parse_timestamp_ns("1970-01-01 00:00:00.5") == 500_000_000
    assert parse_timestamp_ns("1970-01-01 00:00:00.123456789") == 123_456_789
    # 2000-03-01 minus 2000-02-28 (leap year): 2 days
    d = parse_timestamp_ns("2000-03-01 00:00:00.0000000") - parse_timestamp_ns("2000-02-28 00:00:00.0000000")
    assert d == 2 * 86400 * 10**9


@pytest.mark.parametrize("bad", ["2023-11-16", "2023-11-16 18:15:46.", "2023-13-01 00:00:00.1",
                                 "2023-11-16 25:00:00.0", "2023-11-16 18:15:46.1234567890", "x"])
def test_parse_timestamp_rejects(bad):
    with pytest.raises(TraceFormatError):
        parse_timestamp_ns(bad)


def test_azure_csv_seven_digit_fractions(tmp_path):
    p = tmp_path / "azure.csv"
    p.write_text(AZURE)
    t = read_azure_csv(p)
    assert t.format == "azure" and len(t) == 4
    # by hand: 50.9951690 - 46.6805900 = 4.3145790; 60.0000001 - 46.6805900 = 13.3194101;
    # midnight: (24:00:00 - 18:15:46.6805900) + 0.5 = 20653.3194100 + 0.5
    assert [r.arrival_s for r in t] == pytest.approx([0.0, 4.314579, 13.3194101, 20653.81941], abs=1e-9)
    assert [(r.input_tokens, r.output_tokens) for r in t] == [(374, 44), (396, 109), (10, 1), (7, 3)]
    assert [r.request_id for r in t] == [0, 1, 2, 3]
    assert all(r.hash_ids == () for r in t)


def test_azure_csv_token_scale_and_limit(tmp_path):
    p = tmp_path / "azure.csv"
    p.write_text(AZURE)
    t = read_azure_csv(p, token_scale=16, max_requests=3)
    # ceil(374/16)=24, ceil(44/16)=3, ceil(396/16)=25, ceil(109/16)=7, ceil(10/16)=1, ceil(1/16)=1
    assert [(r.input_tokens, r.output_tokens) for r in t] == [(24, 3), (25, 7), (1, 1)]
    assert t.summary()["input_tokens"] == 50 and t.summary()["requests"] == 3


@pytest.mark.parametrize("body, what", [
    ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,374\n", "missing column"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023/11/16 18:15:46.6805900,374,44\n", "TIMESTAMP"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,-3,44\n", "ContextTokens"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374\n", "fields"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
    ("", "empty"),
])
def test_azure_csv_errors_name_the_problem(tmp_path, body, what):
    p = tmp_path / "bad.csv"
    p.write_text(body)
    with pytest.raises(TraceFormatError, match=what):
        read_azure_csv(p)


def test_azure_error_names_the_line(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text(AZURE.replace("396,109", "396,abc"))
    with pytest.raises(TraceFormatError, match=r"bad\.csv:3: field 'GeneratedTokens'"):
        read_azure_csv(p)


def test_mooncake_jsonl(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(MOONCAKE)
    t = read_mooncake_jsonl(p)
    assert [r.arrival_s for r in t] == [0.0, 3.001, 3.001]
    assert [(r.input_tokens, r.output_tokens) for r in t] == [(891, 1), (1024, 350), (5, 1)]  # 0 -> 1 token
    assert [r.hash_ids for r in t] == [(0, 1), (0, 2), (0,)]
    t4 = read_mooncake_jsonl(p, token_scale=4, max_requests=2)
    # ceil(891/4)=223, ceil(1/4)=1, ceil(1024/4)=256, ceil(350/4)=88
    assert [(r.input_tokens, r.output_tokens) for r in t4] == [(223, 1), (256, 88)]


@pytest.mark.parametrize("line, what", [
    ("not json", "not JSON"),
    ('{"timestamp": 0, "input_length": 5}', "output_length"),
    ('{"timestamp": 0, "input_length": -5, "output_length": 1}', "input_length"),
    ('{"timestamp": 0, "input_length": 5.5, "output_length": 1}', "input_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
    ("[1, 2]", "JSON object"),
])
def test_mooncake_errors(tmp_path, line, what):
    p = tmp_path / "t.jsonl"
    p.write_text(MOONCAKE.splitlines()[0] + "\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=what) as ei:
        read_mooncake_jsonl(p)
    assert "t.jsonl:2" in str(ei.value)


def test_scale_tokens():
    assert [scale_tokens(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [1, 1, 1, 1, 2, 2, 3]
    assert scale_tokens(6909, 1) == 6909
    for bad in (0, -1, True, 1.5):
        with pytest.raises(UmallocValueError):
            scale_tokens(10, bad)
    with pytest.raises(UmallocValueError):
        read_mooncake_jsonl(default_trace_path(), max_requests=0)


def test_detect_and_load(tmp_path):
    a = tmp_path / "azure.txt"
    a.write_text(AZURE)
    m = tmp_path / "m.txt"
    m.write_text(MOONCAKE)
    assert detect_format(a) == "azure" and detect_format(m) == "mooncake"
    assert load_trace(a).format == "azure" and load_trace(m).format == "mooncake"
    with pytest.raises(TraceFormatError, match="does not exist"):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(UmallocValueError):
        load_trace(m, fmt="csv")


def test_packaged_trace_is_the_mooncake_file():
    p = default_trace_path()
    assert hashlib.sha256(p.read_bytes()).hexdigest() == (
        "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df")
    assert (p.parent / "NOTICE").is_file() and "Apache" in (p.parent / "NOTICE").read_text()
    t = load_trace()
    assert len(t) == 12031
    first = t.requests[0]
    assert (first.input_tokens, first.output_tokens, first.hash_ids[:3]) == (6758, 500, (0, 1, 2))
    # every row: one hash id per 512-token block (SOURCES.md)
    assert all(len(r.hash_ids) == -(-r.input_tokens // 512) for r in t)
    assert t.requests[-1].arrival_s == pytest.approx(3536.999, abs=1.0)


def test_skip_starts_later_and_keeps_file_rows_as_request_ids(tmp_path):
    a = tmp_path / "a.csv"
    a.write_text(AZURE)
    t = load_trace(a, skip=1, max_requests=2)
    # rows 1 and 2 of the file; arrival relative to the first kept row (18:15:50.9951690)
    assert [(r.request_id, r.input_tokens, r.output_tokens) for r in t] == [(1, 396, 109), (2, 10, 1)]
    assert t.requests[1].arrival_s == pytest.approx(9.004831, abs=1e-6)
    m = tmp_path / "m.jsonl"
    m.write_text(MOONCAKE)
    rows = [ln for ln in MOONCAKE.splitlines() if ln.strip()]
    t = load_trace(m, skip=len(rows) - 1)
    assert [r.request_id for r in t] == [len(rows) - 1] and t.requests[0].arrival_s == 0.0
    with pytest.raises(TraceFormatError, match=f"--skip {len(rows)} passes every one of the {len(rows)} requests"):
        load_trace(m, skip=len(rows))
    with pytest.raises(UmallocValueError, match="skip"):
        load_trace(m, skip=-1)


def test_binary_non_utf8_and_directory_traces_are_refused(tmp_path):
    b = tmp_path / "b.jsonl"
    b.write_bytes(b'{"timestamp": 0}\n\x00\x01\x02')
    with pytest.raises(TraceFormatError, match="binary"):
        load_trace(b)
    # invalid UTF-8 past the sniffed head: the reader names the line
    late = tmp_path / "late.jsonl"
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
    late.write_bytes(good.encode() * 4000 + b'{"timestamp": 1, "input_length": 5, "output_length": 1, "x": "\xff"}\n')
    with pytest.raises(TraceFormatError, match=r"late.jsonl:4001: not UTF-8"):
        load_trace(late)
    with pytest.raises(TraceFormatError, match="is a directory"):
        load_trace(tmp_path)


def test_a_malformed_jsonl_line_names_its_line_and_column_in_full(tmp_path):
    """``…:6: not JSON (Invalid control character at)`` was cut mid-sentence, with no column."""
    good = '{"timestamp": 0, "input_length": 10, "output_length": 2}'
    bad = '{"timestamp": 5, "input_length": "1\t0", "output_length": 2}'  # a raw TAB inside a JSON string
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join([good] * 5 + [bad]) + "\n")
    column = bad.index("\t") + 1  # 1-based, counted here from the line itself
    with pytest.raises(UmallocValueError) as info:
        load_trace(p, fmt="mooncake")
    msg = str(info.value)
    assert msg == f"{p}:6:{column}: not JSON: Invalid control character at column {column}", msg


def test_zero_token_rows_are_counted(tmp_path):
    """A 0-token prompt (or output) becomes 1 token; the trace counts such rows of its slice."""
    p = tmp_path / "z.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.0,0,5\n2023-11-16 18:15:47.0,30,0\n2023-11-16 18:15:48.0,0,0\n"
                 "2023-11-16 18:15:49.0,17,3\n")
    t = load_trace(p, token_scale=1)
    assert [(r.input_tokens, r.output_tokens) for r in t] == [(1, 5), (30, 1), (1, 1), (17, 3)]
    assert (t.zero_prompts, t.zero_outputs) == (2, 2)
    assert t.summary()["zero_prompts"] == 2 and t.summary()["zero_outputs"] == 2
    skipped = load_trace(p, token_scale=1, skip=3)  # the count covers the slice only
    assert (skipped.zero_prompts, skipped.zero_outputs) == (0, 0)
    m = tmp_path / "z.jsonl"
    m.write_text('{"timestamp": 0, "input_length": 0, "output_length": 4}\n'
                 '{"timestamp": 1, "input_length": 9, "output_length": 2}\n')
    t = load_trace(m, token_scale=4)  # 9 tokens / 4 -> 3: a scaled count is never 0, only a 0 is raised
    assert [(r.input_tokens, r.output_tokens) for r in t] == [(1, 1), (3, 1)] and (t.zero_prompts, t.zero_outputs) == (1, 0)
