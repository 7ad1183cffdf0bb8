"""The multi-rank replay: one process per rank on each side (real NIXL / Mooncake), every rank's slice verified.

* The head pattern against a pure-Python reimplementation of Note [Head pattern] and hand-computed byte offsets of
  both page layouts (page-major, head-group-outer), so the bytes a rank expects are known without the plan code.
* Per-rank geometry (vLLM's head split and replication) against hand values and the transfer layer's own
  arithmetic.
* The matrix (TP 1->2, 2->1, 2->2; DCP P1->D2, P2->D2; page size 16->32; head-group-outer pages; an SWA window
  tail; MLA) over NIXL, one case per kind of transfer over Mooncake too (``MOONCAKE_CASES``): every decode rank
  verified exactly the bytes the test counts for it by brute force.
* Ctrl-C and a SIGKILLed rank on the console script: every process ends, the exit status and the one line say
  what happened.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from process_tree import pid_alive

from umalloc.errors import IncompatiblePeerError, SpecError, UmallocValueError
from umalloc.geometry.arena import Arena
from umalloc.geometry.presets import preset_ends, rank_kv_heads
from umalloc.geometry.spec import ArenaSpec, EndSpec, KVDtype, LayerSpec
from umalloc.transfer import PeerLayout
from umalloc.transfer.heads import global_heads as transfer_global_heads
from umalloc_replay.multirank.headpattern import HeadPattern, expected_block, global_heads
from umalloc_replay.multirank.ranks import MultiRankReplay, RanksConfig, is_multi_rank, rank_ids
from umalloc_replay.multirank.ranks_report import check_ranks_report, ranks_table
from umalloc_replay.multirank.rankside import must_have_positions, rank_ends

M64 = (1 << 64) - 1


# ==== the pattern, reimplemented from its Note =================================================================


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def ref_value(seed: int, rid: int, end: str, layer: int, kv: int, head: int, pos: int, elem: int, itemsize: int) -> int:
    key = 0
    for part in (seed, rid, zlib.crc32(end.encode()), layer, kv):
        key = _splitmix(key ^ part)
    x = (key + pos * 0x9E3779B97F4A7C15 + head * 0xC2B2AE3D27D4EB4F + elem * 0x165667B19E3779F9) & M64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & M64
    x ^= x >> 33
    return x & ((1 << (8 * itemsize)) - 1)


def test_expected_block_is_the_note_s_hash():
    from umalloc_replay.multirank.headpattern import block_key

    pos = np.array([0, 5, 1 << 20], dtype=np.int64)
    for itemsize in (1, 2, 4):
        got = expected_block(block_key(3, 7, "swa", 2, 1), pos, 5, 2, 3, itemsize)
        want = [[[ref_value(3, 7, "swa", 2, 1, 5 + h, int(x), e, itemsize) for e in range(3)] for h in range(2)]
                for x in pos]
        assert got.tolist() == want


def test_a_seed_past_64_bits_keys_its_own_blocks():
    """The multi-rank replay's ``--seed`` takes any int: one past 64 bits is not the seed it equals modulo
    2**64."""
    from umalloc_replay.multirank.headpattern import block_key

    assert block_key(2**64 + 3, 7, "swa", 2, 1) != block_key(3, 7, "swa", 2, 1)
    assert block_key(-1, 7, "swa", 2, 1) != block_key(2**64 - 1, 7, "swa", 2, 1)


@pytest.mark.parametrize("groups", [1, 2])
def test_fill_lands_at_hand_computed_bytes_of_either_layout(groups):
    # one FP32 MHA layer, 4 heads per rank (TP rank 1 of 2 of 8 heads: global heads 4..7), 2 dims, 2-token pages
    end = EndSpec("e", (LayerSpec.mha(4, 2, dtype=KVDtype.FP32),), page_size=2, head_groups=groups)
    spec = ArenaSpec((end,), arena_bytes=128 * 8)
    arena = Arena(spec)
    pat = HeadPattern(spec, {"e": (8,)}, tp_rank=1, tp_size=2, seed=11)
    positions = np.array([10, 11, 12], dtype=np.int64)
    ptoks = torch.tensor([4, 5, 6])  # pages 2, 2, 3 at offsets 0, 1, 0
    assert pat.fill(arena, "e", 9, positions, ptoks) == 3 * 64
    raw = arena.data.numpy()
    for pos, tok in zip(positions.tolist(), ptoks.tolist(), strict=True):
        page, t = divmod(tok, 2)
        for kv in (0, 1):
            for h in range(4):
                for e in range(2):
                    if groups == 1:   # [layer][K|V][page_size][heads][dim]: K block 64 B, row 32 B, head 8 B
                        off = page * 128 + kv * 64 + t * 32 + h * 8 + e * 4
                    else:             # [group][layer][K|V][page_size][heads_per_group][dim]: group 64 B
                        off = page * 128 + (h // 2) * 64 + kv * 32 + t * 16 + (h % 2) * 8 + e * 4
                    got = int.from_bytes(raw[off:off + 4].tobytes(), "little")
                    assert got == ref_value(11, 9, "e", 0, kv, 4 + h, pos, e, 4), (pos, kv, h, e)
    chk = pat.verify(arena, "e", 9, positions, ptoks)
    assert (chk.checked_bytes, chk.mismatched_bytes, chk.mismatched_rows) == (192, 0, 0)
    arena.data[2 * 128 + 17] ^= 0x40  # one bit of one byte of token 4
    chk = pat.verify(arena, "e", 9, positions, ptoks)
    assert (chk.mismatched_bytes, chk.mismatched_rows) == (1, 1)
    assert pat.verify(arena, "e", 8, positions, ptoks).mismatched_rows == 6  # another request: every block row


def test_a_rank_whose_heads_are_not_its_tp_share_is_refused():
    from umalloc.errors import InvariantError

    spec = ArenaSpec((EndSpec("e", (LayerSpec.mha(4, 2),), page_size=2),), arena_bytes=1024)
    with pytest.raises(InvariantError, match="gives heads"):
        HeadPattern(spec, {"e": (8,)}, tp_rank=0, tp_size=4, seed=0)  # TP 4 of 8 heads holds 2, not 4


# ==== per-rank geometry ========================================================================================


def test_rank_heads_follow_vllm_split_and_replication():
    assert [rank_kv_heads(8, t) for t in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    assert [global_heads(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [global_heads(2, 8, r) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    for total, tp in ((8, 1), (8, 2), (8, 8), (1, 2), (2, 8), (8, 16)):
        for r in range(tp):
            assert global_heads(total, tp, r) == transfer_global_heads(r, tp, rank_kv_heads(total, tp), total)
    for total, tp in ((8, 3), (2, 3), (4, 6)):
        with pytest.raises(SpecError):
            rank_kv_heads(total, tp)


def test_preset_ends_per_rank_heads_and_head_groups():
    g = preset_ends("gemma-3-12b-draft", tp_size=2, head_groups=2, draft_sliding="draft")
    assert [(e.name, e.layers[0].num_kv_heads, e.head_groups) for e in g] == [("full", 4, 2), ("swa", 4, 2),
                                                                            ("draft", 1, 1)]
    # the drafter's one-head sliding layers in the swa end keep it page-major
    g = preset_ends("gemma-3-12b-draft", tp_size=2, head_groups=2)
    assert [(e.name, e.layers[-1].num_kv_heads, e.head_groups) for e in g] == [("full", 4, 2), ("swa", 1, 1),
                                                                             ("draft", 1, 1)]
    assert preset_ends("gemma-3-12b-draft", tp_size=2)[0].entry_bytes * 2 == preset_ends("gemma-3-12b-draft")[0].entry_bytes
    assert preset_ends("deepseek-v3", tp_size=4)[0].layers == preset_ends("deepseek-v3")[0].layers  # MLA replicated
    with pytest.raises(SpecError, match="tp_size"):
        preset_ends("gemma-3-12b-draft", tp_size=3)
    with pytest.raises(SpecError, match="head_groups"):
        preset_ends("gemma-3-12b-draft", head_groups=3)
    with pytest.raises(SpecError, match="head_groups"):
        preset_ends("deepseek-v3", head_groups=2)  # MLA only: no end can take it
    d = rank_ends("gemma-3-12b-draft", page_size=16, draft=True, tp_size=1, dcp_size=2)
    assert [e.owner for e in d] == [None, "full", None]  # under DCP the draft keeps logical rows: its own owner


def test_must_have_rows_are_the_window_positions():
    ends = rank_ends("gpt-oss-20b", page_size=16, draft=False, tp_size=1, dcp_size=2)
    spec = ArenaSpec(ends, arena_bytes=1 << 24)
    lay = PeerLayout.from_arena(Arena(spec, zero=False), dcp_rank=1, dcp_size=2)
    rows, pos = must_have_positions(lay, spec.end("swa"), 200)
    assert pos.tolist() == [x for x in range(200 - 128, 200) if x % 2 == 1]
    assert rows.tolist() == [x // 2 for x in pos.tolist()]
    rows, pos = must_have_positions(lay, spec.end("full"), 7)
    assert pos.tolist() == [1, 3, 5] and rows.tolist() == [0, 1, 2]


def test_config_refuses_what_cannot_run():
    assert rank_ids("prefill", 2, 2)[3].label == "prefill rank 3 (tp 1/2, dcp 1/2)"
    assert not is_multi_rank(1, 1, 1, 1, 16, 16) and is_multi_rank(1, 1, 1, 2, None, 16)
    with pytest.raises(UmallocValueError, match="nixl"):
        RanksConfig(backend="local").resolved()
    with pytest.raises(SpecError, match="tp_size"):
        RanksConfig(decode_tp=3).resolved()
    with pytest.raises(UmallocValueError, match="max_prompt_tokens"):
        RanksConfig(max_prompt_tokens=0).resolved()
    with pytest.raises(UmallocValueError, match="--requests 99999: .* holds only 12031 requests"):
        MultiRankReplay(RanksConfig(requests=99999))
    with pytest.raises(SpecError, match="arena_bytes"):
        RanksConfig(decode_arena_bytes=4096).resolved()
    with pytest.raises(IncompatiblePeerError) as e:  # the connect-time check, before any process starts
        RanksConfig(prefill_page_size=16, page_size=24).resolved()
    assert any("page_size" in d and "16" in d and "24" in d for d in e.value.differences), e.value.differences
    assert RanksConfig(model="gpt-oss-20b").resolved().draft is False  # no drafter: none, as the replay does


# ==== the matrix, real processes ===============================================================================

#: A few requests of the packaged trace at a tiny token scale (prompts of 14-15 tokens on the default preset).
TINY = {"requests": 2, "token_scale": 512}
CASES = {
    "tp1-1": {},
    "tp1-2": {"decode_tp": 2},
    "tp1-2-groups": {"decode_tp": 2, "prefill_head_groups": 2},
    "tp2-1": {"prefill_tp": 2},
    "tp2-2": {"prefill_tp": 2, "decode_tp": 2},
    "dcp1-2": {"decode_dcp": 2},
    "dcp2-2": {"prefill_dcp": 2, "decode_dcp": 2},
    "page16-32": {"prefill_page_size": 16, "page_size": 32},
    # a window tail that starts mid-page (gpt-oss: window 128) under TP 2 -> 1, 16 -> 32 pages
    "swa-tail": {"model": "gpt-oss-20b", "draft": False, "prefill_tp": 2, "page_size": 32, "requests": 2,
                 "token_scale": 24},
    "swa-dcp1-2": {"model": "gpt-oss-20b", "draft": False, "decode_dcp": 2, "requests": 2, "token_scale": 24},
    "mla-tp1-2": {"model": "deepseek-v3", "draft": False, "decode_tp": 2, "requests": 1, "token_scale": 256},
}


def brute_expected_bytes(cfg: RanksConfig, lengths: list[int], tp_rank: int, dcp_rank: int) -> dict[str, int]:
    """Bytes one decode rank must hold per vector, by counting positions one by one."""
    # multi-rank runs keep the drafter whole in its draft end (rank_ends: under DCP it keeps logical rows)
    ends = preset_ends(cfg.model, page_size=cfg.page_size, draft=cfg.draft, tp_size=cfg.decode_tp,
                       draft_sliding="draft")
    names = {"full": "target", "swa": "swa_tail", "draft": "draft"}
    out = dict.fromkeys((names[e.name] for e in ends), 0)
    for L in lengths:
        for e in ends:
            w = e.window_tokens
            keep = [x for x in range(L) if (w is None or x >= L - w) and
                    (e.name == "draft" or x % cfg.decode_dcp == dcp_rank)]
            out[names[e.name]] += len(keep) * e.entry_bytes
    return out


def run_case(backend: str, case: dict) -> tuple[RanksConfig, dict]:
    from umalloc.testing import require_or_skip

    require_or_skip(backend)
    cfg = RanksConfig(backend=backend, **{**TINY, **case})
    return cfg, MultiRankReplay(cfg).run()


#: the cases also run over Mooncake: one per kind of transfer the matrix makes (strided head slices of
#: head-group-outer pages; interleaved DCP tokens between two ranks on each side; a page size that differs across
#: the sides; a window tail that starts mid-page). The rest of the matrix is geometry (which heads and tokens each
#: rank holds), computed above the transfer engine, and runs over NIXL; each engine's own transfers across
#: processes (descriptor batches, plans with target, draft and SWA vectors) are the conformance suite's
#: (tests/backends/test_backends.py).
MOONCAKE_CASES = ("tp1-2-groups", "dcp2-2", "page16-32", "swa-tail")
MATRIX = [(name, "nixl") for name in CASES] + [(name, "mooncake") for name in MOONCAKE_CASES]


@pytest.mark.backend
@pytest.mark.parametrize(("name", "backend"), MATRIX, ids=[f"{n}-{b}" for n, b in MATRIX])
def test_every_rank_receives_and_verifies_its_slice(backend, name):
    cfg, rep = run_case(backend, CASES[name])
    assert check_ranks_report(rep) == [] and rep["ok"], check_ranks_report(rep)
    cfg = cfg.resolved()
    lengths = rep["requests"]["prompt_tokens"]
    assert lengths == [min(n, cfg.max_prompt_tokens) for n in rep["requests"]["trace_input_tokens"]]
    decode = [r for r in rep["ranks"] if r["side"] == "decode"]
    prefill = [r for r in rep["ranks"] if r["side"] == "prefill"]
    assert (len(prefill), len(decode)) == (cfg.prefill_tp * cfg.prefill_dcp, cfg.decode_tp * cfg.decode_dcp)
    for r in decode:
        want = brute_expected_bytes(cfg, lengths, r["tp_rank"], r["dcp_rank"])
        assert r["verified_by_vector"] == want, (r["index"], r["verified_by_vector"], want)
        assert r["mismatch_bytes"] == 0 and r["mismatch_rows"] == 0
        assert r["plans"] == len(lengths) * len(r["peers"])  # one half per source per request
    assert sum(r["bytes"] for r in prefill) == sum(r["bytes"] for r in decode) > 0
    assert all(r["end_state"] == {**r["end_state"], "live_pages": 0, "pending_pages": 0, "leases_active": 0}
               for r in rep["ranks"])
    routes = {(x["src"], x["dst"]) for x in rep["routes"]}
    expected_routes = {
        "tp1-2": {(0, 0), (0, 1)}, "tp1-2-groups": {(0, 0), (0, 1)}, "tp2-1": {(0, 0), (1, 0)},
        "tp2-2": {(0, 0), (1, 1)}, "dcp1-2": {(0, 0), (0, 1)}, "dcp2-2": {(0, 0), (1, 1)},
        "swa-tail": {(0, 0), (1, 0)}, "swa-dcp1-2": {(0, 0), (0, 1)}, "mla-tp1-2": {(0, 0), (0, 1)}}
    assert routes == expected_routes.get(name, {(0, 0)})
    if cfg.model == "gemma-3-12b-draft":  # 8 target heads split by the decode TP, the 1-head drafter replicated
        assert all(r["kv_heads"] == {"full": 8 // cfg.decode_tp, "swa": 8 // cfg.decode_tp, "draft": 1}
                   for r in decode)
    ranks_table(rep)  # renders


@pytest.mark.backend
def test_head_group_outer_pages_merge_into_fewer_descriptors():
    _cfg, flat = run_case("nixl", CASES["tp1-2"])
    _cfg, grouped = run_case("nixl", CASES["tp1-2-groups"])
    assert flat["totals"]["bytes"] == grouped["totals"]["bytes"]
    assert grouped["totals"]["descriptors"] < flat["totals"]["descriptors"]


def flip_first_target_byte(ctx, rid: int) -> int:
    """In a decode rank: flip one bit of the first byte of the request's target row 0 (layer 0 K, head 0)."""
    st = ctx.objects["rank"]
    _L, vt = st.held[rid]
    end = st.spec.end("full")
    ptok = int(st.alloc.translate(vt["full"][:1], "full")[0])
    page, row = divmod(ptok, end.page_size)
    byte = page * end.page_bytes + end.blocks[0].offset_bytes + row * end.blocks[0].row_bytes
    st.arena.data[byte] ^= 0x01
    return byte


@pytest.mark.backend
def test_a_byte_corrupted_after_the_transfer_is_found_on_that_rank_only():
    from umalloc.testing import require_or_skip
    from umalloc_replay.multirank.ranks import RankPool

    require_or_skip("nixl")
    run = MultiRankReplay(RanksConfig(backend="nixl", decode_tp=2, **TINY))
    pool = RankPool("nixl", run.prefill + run.decode)
    try:
        run._setup(pool)
        batch = [(0, run.lengths[0])]
        run._start(pool, batch, run._prepare(pool, batch))
        run._finish(pool, batch)
        pool.workers[run.decode[1]].run("test_replay_ranks:flip_first_target_byte", 0)
        run._verify(pool, batch)
        run._check(pool)
        run.times["total"] = 1.0
        rep = run._report(pool, 1)
    finally:
        pool.close()
    d0, d1 = (r for r in rep["ranks"] if r["side"] == "decode")
    assert (d0["mismatch_bytes"], d0["mismatch_rows"]) == (0, 0)
    assert (d1["mismatch_bytes"], d1["mismatch_rows"]) == (1, 1)
    assert not rep["ok"] and "mismatches: 1 bytes in 1 rows differ" in check_ranks_report(rep)


# ==== the console script: report, Ctrl-C, a killed rank ======================================================

CLI = [sys.executable, "-c", "from umalloc_replay.cli import app; app()", "replay"]


@pytest.mark.backend
def test_cli_writes_the_multi_rank_report(tmp_path):
    from umalloc.testing import require_or_skip

    require_or_skip("mooncake")
    out = tmp_path / "r.json"
    res = subprocess.run([*CLI, "--backend", "mooncake", "--decode-dcp", "2", "--requests", "2", "--token-scale",
                          "512", "--no-progress", "--report", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["config"]["decode"]["dcp"] == 2 and len(rep["ranks"]) == 3
    # what runs goes to stderr with the progress; stdout carries the result table only
    assert "multi-rank replay: prefill TP 1 x DCP 1" in res.stderr and "prompts capped at 256 tokens" in res.stderr
    bad = subprocess.run([*CLI, "--decode-tp", "3", "--backend", "nixl"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error:") and "tp_size" in bad.stderr, bad.stderr
    assert bad.stdout == "", bad.stdout


def _start_until_ranks(args: list[str]) -> tuple[subprocess.Popen, dict[str, int], list[str]]:
    """Start the console script in its own session; return it once it printed its ranks' pids."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    lines: list[str] = []
    deadline = time.monotonic() + 600  # a hang guard
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode(errors="replace")  # type: ignore[union-attr]
        if not line:
            break
        lines.append(line)
        if line.startswith("ranks: "):
            pids = {m[0]: int(m[1]) for m in re.findall(r"(\w+ rank \d+) \([^)]*\) pid (\d+)", line)}
            return proc, pids, lines
    proc.kill()
    raise AssertionError("the ranks never started:\n" + "".join(lines))


def _finish(proc: subprocess.Popen, lines: list[str], pids: dict[str, int]) -> str:
    try:
        rest, _ = proc.communicate(timeout=300)  # a hang guard
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    end = time.monotonic() + 120  # a hang guard: a loaded machine may take a while to reap the ranks
    while any(pid_alive(p) for p in pids.values()) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [k for k, p in pids.items() if pid_alive(p)], "a rank outlived the replay"
    return "".join(lines) + rest.decode(errors="replace")


#: Long enough to be running when interrupted: many requests, one per step.
LONG = ["--prefill-tp", "2", "--requests", "200", "--token-scale", "16", "--max-batch", "1", "--no-progress"]


@pytest.mark.backend
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_ctrl_c_ends_every_rank_and_exits_130(backend):
    from umalloc.testing import require_or_skip

    require_or_skip(backend)
    proc, pids, lines = _start_until_ranks(["--backend", backend, *LONG])
    assert set(pids) == {"prefill rank 0", "prefill rank 1", "decode rank 0"}
    time.sleep(1.0)  # spreads the SIGINT into the run; any moment is valid (start-up interrupts are quiet too)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group
    text = _finish(proc, lines, pids)
    assert proc.returncode == 130, text
    assert text.strip().splitlines()[-1] == "interrupted", text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text


@pytest.mark.backend
@pytest.mark.parametrize("backend,victim", [("nixl", "decode rank 0"), ("mooncake", "prefill rank 1")])
def test_a_killed_rank_ends_every_rank_with_one_error_line_naming_it(backend, victim):
    from umalloc.testing import require_or_skip

    require_or_skip(backend)
    proc, pids, lines = _start_until_ranks(["--backend", backend, *LONG])
    time.sleep(1.0)  # spreads the kill into the run; the outcome must be the same at any moment after start-up
    assert proc.poll() is None
    os.kill(pids[victim], signal.SIGKILL)
    text = _finish(proc, lines, pids)
    assert proc.returncode == 1, text
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, text
    assert errors[0].startswith(f"error: {victim} (") and "died" in errors[0] and "signal 9" in errors[0], text
    assert "Traceback" not in text, text


# ==== refusals before any rank starts: one error line naming the side and the option ===========================


def _refused_multi(args: list[str], root: Path, *needles: str, absent: tuple[str, ...] = ()) -> str:
    """Run the console script in this process; assert exit 2, exactly one line, an ``error:`` line (so nothing was
    described or started: the run's first line and the ranks' pids come after the checks), every needle in it,
    no ``absent`` text, nothing written under ``root`` and no child process left. Returns the line."""
    import multiprocessing

    from typer.testing import CliRunner

    from umalloc_replay.cli import app

    before = set(root.rglob("*"))
    res = CliRunner().invoke(app, ["replay", "--no-progress", "--report", str(root / "r.json"), *args])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    for n in needles:
        assert n in lines[0], (n, lines[0])
    for n in absent:
        assert n not in lines[0], (n, lines[0])
    assert set(root.rglob("*")) == before
    assert multiprocessing.active_children() == []
    return lines[0]


def _first_lengths(n: int, scale: int = 64, cap: int = 256) -> list[int]:
    """The packaged trace's first ``n`` prompt lengths at ``scale`` and ``cap``, read with the stdlib alone."""
    from importlib.resources import files

    out = []
    with (files("umalloc_replay") / "data" / "conversation_trace.jsonl").open() as fh:
        for line in fh:
            if len(out) == n:
                break
            out.append(min(-(-json.loads(line)["input_length"] // scale), cap))
    return out


def _pages_bytes(L: int, ends: tuple[EndSpec, ...]) -> int:
    """Bytes of the pages a TP/DCP-1 rank binds for a request of ``L`` tokens: every row below ``L`` on every end."""
    return sum(-(-L // e.page_size) * e.page_bytes for e in ends)


def test_an_arena_too_small_is_refused_before_any_rank_naming_side_request_and_bytes(tmp_path):
    L0 = _first_lengths(1)[0]
    ends = rank_ends("gemma-3-12b-draft", page_size=16, draft=True, tp_size=1, dcp_size=1)
    line = _refused_multi(["--prefill-tp", "2", "--backend", "nixl", "--arena-bytes", "13MiB", "--max-batch", "1"],
                          tmp_path, "decode side: request 0", f"({L0} prompt tokens",
                          f"needs {_pages_bytes(L0, ends):,} bytes", f"arena of {13 << 20:,} bytes",
                          "decode rank 0", "allowed --arena-bytes PREFILL,DECODE with DECODE >= ",
                          absent=("--max-batch", "InvariantError"))
    suggested = int(line.split("DECODE >= ")[1].split()[0].replace(",", ""))
    assert suggested >= _pages_bytes(max(_first_lengths(4)), ends)
    # a large enough decode arena moves the refusal to the prefill side (its ranks hold half the heads each)
    pre_ends = rank_ends("gemma-3-12b-draft", page_size=16, draft=True, tp_size=2, dcp_size=1)
    _refused_multi(["--prefill-tp", "2", "--backend", "nixl", "--arena-bytes", f"13MiB,{suggested}",
                    "--max-batch", "1"], tmp_path, "prefill side: request 0", "prefill rank 0",
                   f"needs {_pages_bytes(L0, pre_ends):,} bytes", "PREFILL >= ", absent=("--max-batch",))


def test_a_smaller_max_batch_is_suggested_only_when_the_request_fits_alone(tmp_path):
    lengths = _first_lengths(4)
    ends = rank_ends("gemma-3-12b-draft", page_size=16, draft=True, tp_size=1, dcp_size=1)
    # room for the largest request alone (and the floor and a spare page per end) but not for all four at once
    floor = max(e.page_bytes for e in ends) + sum(e.page_bytes for e in ends)
    arena = _pages_bytes(max(lengths), ends) + floor + 2 * sum(e.page_bytes for e in ends)
    assert arena < sum(_pages_bytes(L, ends) for L in lengths)
    _refused_multi(["--multi-rank", "--backend", "nixl", "--arena-bytes", f"1GiB,{arena}"], tmp_path,
                   "decode side: request", "with the step's others", "a smaller --max-batch (it fits alone)")


def test_host_memory_and_rank_count_are_checked_before_any_rank(tmp_path):
    from umalloc_replay.preflight import available_memory_bytes

    have = available_memory_bytes()
    _refused_multi(["--prefill-tp", "2", "--backend", "nixl", "--arena-bytes", "1TiB"], tmp_path,
                   f"prefill arenas (2 ranks) {2 << 40:,}", f"decode arenas (1 rank) {1 << 40:,}", "host memory", "smaller --arena-bytes", "fewer ranks")
    assert have < 3 * (1 << 40)
    _refused_multi(["--decode-tp", "128", "--backend", "nixl"], tmp_path, "--decode-tp 128", "128 ranks",
                   "at most 64")
    with pytest.raises(UmallocValueError, match="prefill side: --prefill-tp 8 x --prefill-dcp 16 = 128 ranks"):
        RanksConfig(prefill_tp=8, prefill_dcp=16).resolved()


def test_geometry_errors_name_the_side_and_its_option(tmp_path):
    _refused_multi(["--decode-tp", "3", "--backend", "nixl"], tmp_path, "decode side (--decode-tp 3)",
                   "tp_size=3", absent=("prefill",))
    _refused_multi(["--decode-head-groups", "2", "--model", "deepseek-v3", "--backend", "nixl"], tmp_path,
                   "decode side (--decode-head-groups 2)", "head_groups=2")
    _refused_multi(["--decode-tp", "2", "--arena-bytes", "1GiB,1KiB", "--backend", "nixl"], tmp_path,
                   "the decode value of --arena-bytes (1,024 bytes)", "arena_bytes=1024")
    _refused_multi(["--decode-tp", "2", "--arena-bytes", "1KiB,1GiB", "--backend", "nixl"], tmp_path,
                   "the prefill value of --arena-bytes (1,024 bytes)")
    with pytest.raises(SpecError, match=r"^prefill side \(--prefill-tp 3\)") as e:
        RanksConfig(prefill_tp=3).resolved()
    assert e.value.field == "tp_size"  # the error keeps its type and attributes
    with pytest.raises(IncompatiblePeerError, match=r"^prefill rank 0 .* -> decode rank 0 .*local: the prefill "
                       r"rank, remote: the decode rank") as e:
        RanksConfig(prefill_page_size=16, page_size=24).resolved()
    assert len(e.value.differences) == 3


def test_max_prompt_tokens_without_multi_rank_is_refused(tmp_path):
    _refused_multi(["--max-prompt-tokens", "64", "--backend", "nixl"], tmp_path, "--max-prompt-tokens 64",
                   "multi-rank")
    # with a multi-rank option it is taken (and an absurd arena still refused up front, so nothing runs)
    _refused_multi(["--multi-rank", "--max-prompt-tokens", "64", "--backend", "nixl", "--arena-bytes", "13MiB"],
                   tmp_path, "cap of 64")
