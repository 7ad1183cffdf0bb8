"""`umalloc replay` end to end: real trace slices through prefill and decode arenas, every figure of the report
checked against values computed by hand in the test (page geometry from the models' configs, token counts
from the trace file), the report's invariants, memory pressure, each backend, and the CLI."""

from __future__ import annotations

import copy
import json
import math

import pytest
from typer.testing import CliRunner

from umalloc.errors import UmallocValueError
from umalloc.geometry.presets import preset_ends
from umalloc.testing import require_or_skip
from umalloc_replay.cli import app, parse_arena_bytes, parse_size_bytes
from umalloc_replay.report import check_report
from umalloc_replay.single.run import Replay, ReplayConfig, default_arena_bytes
from umalloc_replay.trace import default_trace_path, load_trace

MIB = 1 << 20

# Gemma-3-12B (48 layers, every 6th global, 8 KV heads x 256, bf16, window 1024) + Gemma-3-1B drafter
# (26 layers, every 6th global, 1 KV head x 256, window 512): bytes per token = layers x heads x (256 + 256) x 2.
# The drafter's 22 sliding layers sit in the swa end (held for its 1,024-token window), its 4 global ones in draft.
G_FULL_TOKEN = 8 * 8 * 512 * 2                         # 65,536
G_SWA_TOKEN = 40 * 8 * 512 * 2 + 22 * 1 * 512 * 2      # 327,680 + 22,528
G_DRAFT_TOKEN = 4 * 1 * 512 * 2                        # 4,096
PS = 16
G_WINDOW = 1024
# per-layer-per-page descriptors (K and V per layer per page)
G_PER_LAYER = {"target": 8 * 2, "swa_tail": (40 + 22) * 2, "draft": 4 * 2}

# gpt-oss-20b: 24 layers alternating sliding (even, window 128) / full (odd), 8 KV heads x 64, bf16
O_TOKEN = 12 * 8 * 128 * 2           # 24,576 per end
O_WINDOW = 128


def pages(n: int) -> int:
    return -(-n // PS)


def swa_first_page(n: int, window: int) -> int:
    return max(0, n - window) // PS


def trace_rows(n: int, scale: int) -> list[tuple[int, int]]:
    """(prompt, output) tokens of the first n rows of the packaged trace, scaled by hand."""
    rows = []
    with open(default_trace_path()) as fh:
        for line in fh:
            d = json.loads(line)
            rows.append((max(1, math.ceil(d["input_length"] / scale)), max(1, math.ceil(d["output_length"] / scale))))
            if len(rows) == n:
                break
    return rows


def gemma_expected(rows: list[tuple[int, int]]) -> dict:
    """Bytes the replay must move and verify, computed from the geometry above."""
    moved = {"target": 0, "swa_tail": 0, "draft": 0}
    per_layer = 0
    final = 0
    for L, out in rows:
        p = pages(L)
        sp = p - swa_first_page(L, G_WINDOW)
        moved["target"] += p * PS * G_FULL_TOKEN
        moved["draft"] += p * PS * G_DRAFT_TOKEN
        moved["swa_tail"] += sp * PS * G_SWA_TOKEN
        per_layer += p * G_PER_LAYER["target"] + p * G_PER_LAYER["draft"] + sp * G_PER_LAYER["swa_tail"]
        n = L + out
        whole = max(pages(L), n // PS)
        tail_tokens = n - whole * PS if n > whole * PS else 0
        swa_lo = swa_first_page(n, G_WINDOW)
        final += whole * PS * (G_FULL_TOKEN + G_DRAFT_TOKEN) + (whole - swa_lo) * PS * G_SWA_TOKEN
        final += tail_tokens * (G_FULL_TOKEN + G_DRAFT_TOKEN + G_SWA_TOKEN)
    return {"moved": moved, "per_layer": per_layer, "final": final,
            "prompt": sum(L for L, _ in rows), "generated": sum(o for _, o in rows)}


def assert_clean(rep: dict) -> None:
    assert check_report(rep) == [] and rep["ok"] is True
    assert rep["requests"]["completed"] == rep["requests"]["total"]
    assert rep["bytes"]["verified"] == rep["bytes"]["moved"] > 0
    assert rep["mismatches"] == {"pages": 0, "bytes": 0}
    for side in ("prefill", "decode"):
        assert rep["end_state"][side]["leases_active"] == 0
        for e in rep["end_state"][side]["ends"].values():
            assert e == {"live_pages": 0, "pending_pages": 0}


def check_against_hand_values(rep: dict, rows: list[tuple[int, int]]) -> None:
    exp = gemma_expected(rows)
    assert rep["tokens"] == {"prompt": exp["prompt"], "generated": exp["generated"],
                             "total": exp["prompt"] + exp["generated"],
                             "zero_prompts_as_1": sum(L == 0 for L, _ in rows),
                             "zero_outputs_as_1": sum(o == 0 for _, o in rows)}
    assert rep["bytes"]["moved_by_vector"] == exp["moved"]
    assert rep["bytes"]["moved"] == sum(exp["moved"].values())
    assert rep["bytes"]["filled"] == rep["bytes"]["moved"]  # prefill writes exactly what travels
    assert rep["bytes"]["verified_final"] == exp["final"]
    assert rep["bytes"]["decode_written"] == exp["generated"] * (G_FULL_TOKEN + G_SWA_TOKEN + G_DRAFT_TOKEN)
    d = rep["descriptors"]
    assert d["plans"] == len(rows)
    assert d["per_layer_per_page_total"] == exp["per_layer"]
    # at least one descriptor per vector per request, never more than the per-layer-per-page count
    assert 3 * len(rows) <= d["total"] <= exp["per_layer"]


@pytest.fixture(scope="module")
def local_slice_report() -> tuple[dict, list[tuple[int, int]]]:
    rows = trace_rows(4, 64)
    rep = Replay(ReplayConfig(requests=4, token_scale=64, check_every=1)).run()
    return rep, rows


def test_trace_slice_local_end_to_end(local_slice_report):
    rep, rows = local_slice_report
    assert_clean(rep)
    check_against_hand_values(rep, rows)
    cfg = rep["config"]
    assert (cfg["model"], cfg["backend"], cfg["page_size"], cfg["requests"]) == ("gemma-3-12b-draft", "local", 16, 4)
    assert [(e["name"], e["page_bytes"]) for e in cfg["ends"]] == [
        ("full", PS * G_FULL_TOKEN), ("swa", PS * G_SWA_TOKEN), ("draft", PS * G_DRAFT_TOKEN)]
    assert json.loads(json.dumps(rep)) == rep  # JSON-ready
    tl = rep["timeline"]
    assert len(tl["step"]) == len(tl["time_s"]) == len(tl["decode_live_pages"]["swa"]) >= 2
    assert tl["requests_done"][-1] == 4 and tl["decode_live_pages"]["full"][-1] == 0


def test_report_check_flags_each_broken_invariant(local_slice_report):
    rep, _ = local_slice_report

    def broken(mutate) -> list[str]:
        r = copy.deepcopy(rep)
        mutate(r)
        return check_report(r)

    assert any("verified" in p for p in broken(lambda r: r["bytes"].__setitem__("verified", 1)))
    assert any("mismatches" in p for p in broken(lambda r: r["mismatches"].__setitem__("bytes", 3)))
    assert any("completed" in p for p in broken(lambda r: r["requests"].__setitem__("completed", 3)))
    assert any("live" in p for p in broken(lambda r: r["end_state"]["decode"]["ends"]["swa"].__setitem__(
        "live_pages", 2)))
    assert any("leases" in p for p in broken(lambda r: r["end_state"]["prefill"].__setitem__("leases_active", 1)))
    assert any("report.ok" in p for p in broken(lambda r: r.__setitem__("ok", False)))
    assert any("missing" in p for p in broken(lambda r: r["descriptors"].pop("total")))
    assert any("expected int" in p for p in broken(lambda r: r["tokens"].__setitem__("prompt", "7")))


def test_swa_tail_sent_and_released_while_decoding(tmp_path):
    # gpt-oss-20b, window 128: prompt 300 tokens -> the SWA tail starts at floor_to_page(300 - 128) = 160
    # (page 10), 9 pages of 19; after 40 decode tokens (340) the window starts at floor_to_page(212) = 208
    # (page 13): pages 10, 11, 12 are released during decode.
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 300, "output_length": 40, "hash_ids": [0]}\n')
    r = Replay(ReplayConfig(trace=str(p), model="gpt-oss-20b", token_scale=1, check_every=1))
    rep = r.run()
    assert_clean(rep)
    assert rep["bytes"]["moved_by_vector"] == {"target": 19 * PS * O_TOKEN, "swa_tail": 9 * PS * O_TOKEN}
    assert r.dec.stats()["swa"].pages_unbound == 3
    # final verify: 340 = 21 whole pages + 4 tokens; SWA pages 13..20 + 4 tokens
    assert rep["bytes"]["verified_final"] == (21 + 8) * PS * O_TOKEN + 2 * 4 * O_TOKEN


AZURE_PRESSURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(
    f"2023-11-16 18:15:4{i}.{i}805900,40,90" for i in range(6))  # 7-digit fractions, no final newline


def test_memory_pressure_completes_every_request(tmp_path):
    p = tmp_path / "pressure.csv"
    p.write_text(AZURE_PRESSURE)
    # one request peaks at 130 tokens = 9 pages per end = 9 x 6.4 MiB; a 100 MiB decode arena holds ~2 of 6
    r = Replay(ReplayConfig(trace=str(p), token_scale=1, decode_arena_bytes=100 * MIB, check_every=1))
    rep = r.run()
    assert_clean(rep)
    check_against_hand_values(rep, [(40, 90)] * 6)
    req, sf = rep["requests"], rep["shortfall"]
    assert req["retracted"] >= 1 and req["restored"] == req["retracted"] == sf["retractions"]
    assert req["admission_waits"] > 0 and 1 <= req["max_running"] < 6
    assert rep["config"]["trace_format"] == "azure"


def test_stranded_space_is_recovered_by_replacing_the_lone_request(tmp_path):
    p = tmp_path / "pressure.csv"
    p.write_text(AZURE_PRESSURE)
    rep = Replay(ReplayConfig(trace=str(p), token_scale=1, decode_arena_bytes=70 * MIB, check_every=1)).run()
    assert_clean(rep)
    check_against_hand_values(rep, [(40, 90)] * 6)


def test_request_that_can_never_fit_is_refused_up_front(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 64, "output_length": 4}\n'
                 '{"timestamp": 1, "input_length": 600, "output_length": 4}\n')
    # request 1 peaks at 604 tokens = 38 pages x 6.4 MiB = 243 MiB > 128 MiB
    with pytest.raises(UmallocValueError, match=r"cannot fit even in an empty decode arena.*request 1 "):
        Replay(ReplayConfig(trace=str(p), token_scale=1, decode_arena_bytes=128 * MIB))
    with pytest.raises(UmallocValueError, match="prefill arena"):
        Replay(ReplayConfig(trace=str(p), token_scale=1, prefill_arena_bytes=64 * MIB))


def test_request_whose_bytes_fit_but_cannot_be_placed_is_refused_up_front(tmp_path):
    # 11,000 prompt + 2 output tokens: 688 pages on full and draft, the SWA window tail 688 - (11000 - 1024) // 16
    # = 65 pages. Its peak bytes fit a 1,400 MiB decode arena with room to spare, but the empty draft band is
    # placed in the middle of the gap when the SWA tail is allocated, so the 623 head pages of the full end
    # cannot be placed below it. Once this crashed the run ("nothing runs and request 0 cannot be admitted");
    # now it is refused before anything runs (or, if the allocator learns to place it, the run is clean).
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 11000, "output_length": 2}\n')
    peak = 688 * PS * (G_FULL_TOKEN + G_DRAFT_TOKEN) + 65 * PS * G_SWA_TOKEN
    assert peak < 1300 * MIB  # the bytes fit
    cfg = ReplayConfig(trace=str(p), token_scale=1, decode_arena_bytes=1400 * MIB)
    try:
        r = Replay(cfg)
    except UmallocValueError as exc:
        assert "request 0 (11000 prompt + 2 output tokens" in str(exc) and "cannot be placed" in str(exc)
        assert f"holds {peak:,} bytes" in str(exc)
    else:
        assert_clean(r.run())


def test_joint_plan_refusal_of_bytes_that_fit_is_named_a_placement(tmp_path):
    # draft_sliding="own": the drafter's 22 sliding layers are a draft_swa end (window 512) floating next to the
    # swa end. 1,809 prompt + 199 output tokens peak at 126 pages on full and draft, the 1,024-token window
    # tail on swa (65 pages) and the 512-token one on draft_swa (33 pages). Those bytes fit a 700 MiB decode
    # arena with 200 MiB to spare, so a refusal must name a placement, not a size the arena already exceeds.
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1809, "output_length": 199}\n')
    peak = 126 * PS * (G_FULL_TOKEN + G_DRAFT_TOKEN) + 65 * PS * 40 * 8 * 512 * 2 + 33 * PS * 22 * 1 * 512 * 2
    assert peak == 493_060_096 and peak + 200 * MIB < 700 * MIB
    cfg = ReplayConfig(trace=str(p), token_scale=1, draft_sliding="own", decode_arena_bytes=700 * MIB)
    try:
        r = Replay(cfg)
    except UmallocValueError as exc:
        assert "cannot be placed" in str(exc) and f"holds {peak:,} bytes" in str(exc), str(exc)
    else:
        assert_clean(r.run())


def test_verification_catches_a_corrupted_page(tmp_path):
    class Corrupting(Replay):
        def _verify_received(self, rs):
            if rs.rid == 0:  # flip one byte of the first target page decode received
                vp = self.table.vpages(rs.slot, PS, 0, 1)
                pp = int(self.dec.translate_pages(vp, "full")[0])
                self.dec_arena.envelopes("full")[pp, 123] ^= 0x5A
            return super()._verify_received(rs)

    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 40, "output_length": 3}\n')
    rep = Corrupting(ReplayConfig(trace=str(p), token_scale=1)).run()
    # the received check and the final check both see that one byte
    assert rep["mismatches"] == {"pages": 2, "bytes": 2}
    assert rep["ok"] is False and any("mismatches" in x for x in check_report(rep))


def test_no_draft_and_a_model_without_sliding_layers(tmp_path):
    rows = trace_rows(2, 128)
    rep = Replay(ReplayConfig(requests=2, token_scale=128, draft=False)).run()
    assert_clean(rep)
    assert set(rep["bytes"]["moved_by_vector"]) == {"target", "swa_tail"}
    rep = Replay(ReplayConfig(requests=2, token_scale=128, model="llama-3.1-8b")).run()
    assert_clean(rep)
    # Llama-3.1-8B: 32 layers x 8 heads x (128 + 128) x 2 B = 131,072 B per token, whole sequence
    assert rep["bytes"]["moved_by_vector"] == {"target": sum(pages(L) for L, _ in rows) * PS * 131072}


@pytest.mark.backend
@pytest.mark.parametrize("name", ["nixl", "mooncake"])
def test_trace_slice_through_a_second_process(name):
    require_or_skip(name)
    rows = trace_rows(3, 64)
    rep = Replay(ReplayConfig(requests=3, token_scale=64, backend=name, check_every=1)).run()
    assert_clean(rep)
    check_against_hand_values(rep, rows)
    assert rep["config"]["backend"] == name
    # the prefill side lived in the worker; its figures came back
    assert rep["occupancy"]["prefill"]["full"]["peak_live_pages"] >= max(pages(L) for L, _ in rows)


def test_cli_replay_writes_report_and_plot(tmp_path):
    p = tmp_path / "azure.csv"
    p.write_text(AZURE_PRESSURE)
    out, png = tmp_path / "r.json", tmp_path / "p.png"
    res = CliRunner().invoke(app, ["replay", "--trace", str(p), "--requests", "2", "--token-scale", "1",
                                   "--report", str(out), "--plot", str(png), "--no-progress", "--seed", "3"])
    assert res.exit_code == 0, res.output
    assert "verified" in res.output and "OK" in res.output
    rep = json.loads(out.read_text())
    assert check_report(rep) == [] and rep["config"]["seed"] == 3 and rep["requests"]["total"] == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_bad_arguments(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["replay", "--requests", "2", "--token-scale", "64", "--arena-bytes", "32MiB",
                              "--no-progress"])
    assert res.exit_code == 2 and "cannot fit" in res.output
    res = runner.invoke(app, ["replay", "--model", "no-such-model", "--no-progress"])
    assert res.exit_code == 2 and "no-such-model" in res.output
    # a long path (CI clones into deep folders) stays whole on one line, and "[...]" in it is not rich markup
    missing = tmp_path / ("deep-" * 30) / "[red]missing[/red].jsonl"
    res = runner.invoke(app, ["replay", "--trace", str(missing), "--no-progress"])
    assert res.exit_code == 2 and "does not exist" in res.output and str(missing) in res.output
    # more requests than the trace holds: refused, not silently shortened (the packaged trace has 12,031 rows)
    res = runner.invoke(app, ["replay", "--requests", "12032", "--no-progress"])
    assert res.exit_code == 2 and "holds only 12031 requests" in res.output
    res = runner.invoke(app, ["replay", "--arena-bytes", "0.5", "--no-progress"])
    assert res.exit_code == 2 and "size '0.5' is 0.5 bytes" in res.output
    # an arena too small for the geometry is refused before the progress bar is drawn: the error comes first
    res = runner.invoke(app, ["replay", "--arena-bytes", "1KiB"])
    assert res.exit_code == 2 and res.output.startswith("error: --arena-bytes: the prefill arena of 1,024 bytes")


def test_an_arena_below_its_floor_is_named_by_the_bytes_passed(tmp_path):
    """Arenas are rounded down to 16-byte multiples; the refusal names the bytes the user passed (1,000 and 1),
    not the rounded ones."""
    p = tmp_path / "azure.csv"
    p.write_text(AZURE_PRESSURE)
    base = ["replay", "--trace", str(p), "--requests", "2", "--token-scale", "1", "--no-progress"]
    for arena, side, asked in (("128MiB,1000", "decode", "1,000"), ("1,128MiB", "prefill", "1")):
        res = CliRunner().invoke(app, [*base, "--arena-bytes", arena])
        assert res.exit_code == 2, res.output
        assert res.stderr.startswith(f"error: --arena-bytes: the {side} arena of {asked} bytes "), res.stderr


def test_an_arena_below_its_floor_names_the_option_the_side_and_the_bytes_the_slice_needs(tmp_path):
    """``--arena-bytes 1KiB`` named neither the option nor the side (``invalid arena_bytes=1024:
    allowed >= 11960320``). The size it names is enough: the same slice with that many bytes passes the fit."""
    import re

    p = tmp_path / "azure.csv"
    p.write_text(AZURE_PRESSURE)
    base = ["replay", "--trace", str(p), "--requests", "2", "--token-scale", "1", "--no-progress"]
    for arena, side in (("128MiB,1KiB", "decode"), ("1KiB,128MiB", "prefill")):
        res = CliRunner().invoke(app, [*base, "--arena-bytes", arena])
        assert res.exit_code == 2, res.output
        msg = res.stderr.strip()
        assert msg.startswith(f"error: --arena-bytes: the {side} arena of 1,024 bytes is too small"), msg
        assert res.stdout == "" and "\n" not in msg
        need = int(re.search(rf"with {side.upper()} >= ([0-9,]+)", msg).group(1).replace(",", ""))
        ok = ("128MiB," if side == "decode" else "") + str(need) + ("" if side == "decode" else ",128MiB")
        res = CliRunner().invoke(app, [*base, "--arena-bytes", ok])  # the named size runs the slice
        assert res.exit_code == 0, res.output


def test_size_parsing():
    assert parse_size_bytes("3GiB") == 3 << 30 and parse_size_bytes("1.5GB") == 1_500_000_000
    assert parse_size_bytes("512MiB") == 512 * MIB and parse_size_bytes("4096") == 4096
    assert parse_arena_bytes("1GiB,2GiB") == (1 << 30, 2 << 30) and parse_arena_bytes("64MiB") == (64 * MIB,) * 2
    assert parse_size_bytes("4.1GB") == 4_100_000_000  # exact: float arithmetic gives 4,099,999,999
    assert parse_size_bytes("0.5KiB") == 512
    for bad in ("", "GiB", "1XB", "1,2,3", "-5", "0", "0.5", "1.5", "1GiB,0"):  # zero or a fraction of a byte
        with pytest.raises(UmallocValueError):
            parse_arena_bytes(bad)


def test_default_config_puts_the_default_slice_under_pressure():
    cfg = ReplayConfig().resolved()
    assert (cfg.model, cfg.backend, cfg.draft, cfg.page_size, cfg.trace) == (
        "gemma-3-12b-draft", "local", True, 16, None)  # None: the packaged Mooncake trace
    rows = trace_rows(cfg.requests, cfg.token_scale)
    _, dec = default_arena_bytes(preset_ends(cfg.model, page_size=PS), load_trace(
        token_scale=cfg.token_scale, max_requests=cfg.requests))
    peaks = [pages(L + o) * PS * (G_FULL_TOKEN + G_DRAFT_TOKEN)
             + min(pages(L + o), G_WINDOW // PS + 1) * PS * G_SWA_TOKEN for L, o in rows]
    assert max(peaks) <= dec < sum(peaks) / 2  # every request fits alone; the slice is far from fitting at once


# the first 12 rows of the Azure conversation trace (context, generated tokens)
AZURE_12 = [(374, 44), (396, 109), (879, 55), (91, 16), (91, 16), (381, 84), (1313, 142), (388, 84), (242, 14),
            (209, 152), (394, 124), (394, 59)]


@pytest.mark.backend
@pytest.mark.parametrize("name", ["nixl", "mooncake"])
def test_eager_prefill_compaction_is_the_same_on_every_backend(tmp_path, name):
    # A step's transfers all finish before any prompt is freed (Note [Finishing a step's transfers]): Mooncake finishes a
    # plan only in wait(), so freeing prompt by prompt left the step's later transfers pinning prefill pages and
    # its prefill side compacted 0 times where local compacted; the same input now compacts the same pages.
    require_or_skip(name)
    p = tmp_path / "az12.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(
        f"2023-11-16 18:15:{10 + i}.0000000,{a},{b}" for i, (a, b) in enumerate(AZURE_12)))
    figs = {}
    for backend in ("local", name):
        rep = Replay(ReplayConfig(trace=str(p), token_scale=8, prefill_arena_bytes=300 * MIB,
                                  decode_arena_bytes=300 * MIB, compaction="eager", backend=backend)).run()
        assert_clean(rep)
        figs[backend] = rep["compaction"]
    assert figs["local"]["prefill"]["moves_pages"] > 0
    assert figs[name]["prefill"] == figs["local"]["prefill"]
    assert figs[name]["decode"]["moves_pages"] == figs["local"]["decode"]["moves_pages"]
