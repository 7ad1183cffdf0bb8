"""``umalloc generate``: a random-weight model's KV moved from a prefill side to a decode side on umalloc pages,
every request's tokens equal to one process's (issue 23).

Oracles: the one-process reference (:func:`reference_tokens`) is checked against transformers' stock
``model.generate()`` (greedy, its own cache, no umalloc); the PD runs against the reference, on the local backend
and over real NIXL and Mooncake with the prefill side in a second process, for a full-attention model (llama) and
a sliding + full model (gemma3). The mutation tests write a wrong KV on the prefill side (two KV heads swapped,
the SWA tail sent from one page early): the byte digest still matches (it covers what was sent), the token check
catches it. Seeded (``UMALLOC_SEED``, printed).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from process_tree import descendant_pids, wait_all_ended  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from umalloc.testing import require_or_skip, seed_from_env  # noqa: E402
from umalloc_replay.cli import app  # noqa: E402
from umalloc_replay.generate.kv import reference_tokens  # noqa: E402
from umalloc_replay.generate.models import VOCAB_SIZE, build_model, geometry_of  # noqa: E402
from umalloc_replay.generate.run import (  # noqa: E402
    GenerateConfig,
    check_generate_report,
    load_slice,
    prompt_tokens,
    run_generate,
)

SEED = seed_from_env(0)
#: a small slice: 4 requests, prompts 36-421 tokens (gemma3's window is 32: every long prompt has an SWA tail)
SLICE: dict[str, Any] = dict(requests=4, token_scale=64, output_scale=32, seed=SEED)
MODELS = ("llama", "gemma3")
_reports: dict[tuple[str, str], dict] = {}


#: the remote runs that carry a drafter too (its draft vector over NIXL and over Mooncake, no extra process)
WITH_DRAFT = {("llama", "nixl"), ("gemma3", "mooncake"), ("llama", "local-draft"), ("gemma3", "local-draft")}


def report_of(model: str, backend: str) -> dict:
    if (model, backend) not in _reports:
        draft = (model, backend) in WITH_DRAFT
        print(f"seed {SEED}: {model} over {backend}, draft {draft}")
        _reports[(model, backend)] = run_generate(GenerateConfig(
            model=model, backend=backend.removesuffix("-draft"), draft=draft, draft_tokens=2, **SLICE))
    return _reports[(model, backend)]


@pytest.mark.parametrize("model", MODELS)
def test_the_reference_is_transformers_stock_greedy_generate(model: str) -> None:
    """The one-process reference equals ``model.generate()`` (transformers' DynamicCache, greedy)."""
    cfg = GenerateConfig(model=model, **SLICE)
    m = build_model(model, SEED)
    geo = geometry_of(m)
    gcfg = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    for r in load_slice(cfg, 1024)[:2]:
        prompt = prompt_tokens(SEED, r.request_id, r.input_tokens, VOCAB_SIZE)
        with torch.no_grad():
            stock = m.generate(torch.tensor([prompt]), generation_config=gcfg, max_new_tokens=r.output_tokens,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert reference_tokens(m, geo, prompt, r.output_tokens, 16) == stock[0, len(prompt):].tolist()


@pytest.mark.parametrize("backend", ["local", "local-draft", pytest.param("nixl", marks=pytest.mark.backend),
                                     pytest.param("mooncake", marks=pytest.mark.backend)])
@pytest.mark.parametrize("model", MODELS)
def test_every_request_equals_one_process(model: str, backend: str) -> None:
    if not backend.startswith("local"):
        require_or_skip(backend)
    rep = report_of(model, backend)
    assert check_generate_report(rep) == []
    assert rep["identical"] == rep["requests"] == 4 and rep["differing"] == []
    assert rep["tokens_generated"] == sum(len(t) for t in rep["tokens"].values()) > 4
    # the plan moved the target pages of every prompt, and for gemma3 the SWA tail too: bytes from the pages held
    spec_bytes = {"llama": {"target"}, "gemma3": {"target", "swa_tail"}}[model]
    if (model, backend) in WITH_DRAFT:  # speculative decoding, tokens still the target-only reference's
        spec_bytes |= {"draft"}
        sp = rep["speculative"]
        assert rep["draft"] and sp["rounds"] > 0 and 0 < sp["accepted"] < sp["proposed"], sp
    else:
        assert not rep["draft"] and rep["speculative"]["rounds"] == 0
    assert set(rep["bytes_by_vector"]) == spec_bytes
    assert rep["pages_left"] == {"prefill": 0, "decode": 0} and rep["leases_left"] == {"prefill": 0, "decode": 0}


@pytest.mark.parametrize("model, fault", [("llama", "swap_kv_heads"), ("gemma3", "swap_kv_heads"),
                                          ("gemma3", "swa_tail_start")])
def test_a_wrong_kv_that_passes_the_byte_check_fails_the_token_check(model: str, fault: str) -> None:
    """Mutation check: the prefill side writes a wrong KV (its digest is of what it sent, so every digest
    matches); the decode side's tokens differ from one process for every request that decodes past its first
    token, and the report names each with its first differing position."""
    rep = run_generate(GenerateConfig(model=model, fault=fault, **SLICE))
    assert rep["digest_mismatches"] == []
    decoding = [r for r, t in rep["tokens"].items() if len(t) > 1]
    assert sorted(str(d["request"]) for d in rep["differing"]) == sorted(decoding), rep["differing"]
    assert all(d["position"] >= 1 and d["got"] != d["want"] for d in rep["differing"])
    problems = check_generate_report(rep)
    assert len(problems) == len(decoding) and all("tokens differ from one process at position" in p
                                                   for p in problems)


@pytest.mark.parametrize("args, needle", [
    (["--model", "mistral"], "--model 'mistral': allowed one of llama, qwen3, gemma3"),
    (["--backend", "rdma"], "'rdma' is not one of"),
    (["--page-size", "0"], "Invalid value for '--page-size'"),
    (["--token-scale", "1"], "allowed --token-scale >= 48"),
    (["--trace", "/nonexistent/trace.jsonl"], "/nonexistent/trace.jsonl"),
])
def test_bad_arguments_exit_2_with_one_error_line(args: list[str], needle: str) -> None:
    res = CliRunner().invoke(app, ["generate", *args], catch_exceptions=False)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2, (res.stdout, res.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines
    assert res.stdout == ""


def test_the_command_prints_its_table_and_exits_0() -> None:
    res = CliRunner().invoke(app, ["generate", "--model", "qwen3", "--requests", "2", "--no-progress"],
                             catch_exceptions=False)
    assert res.exit_code == 0, (res.stdout, res.stderr)
    assert "identical to one process" in res.stdout and "2 of 2" in res.stdout


def test_help_imports_no_torch() -> None:
    """``umalloc generate --help`` answers without torch, transformers, numba or an engine."""
    import json
    import subprocess
    import sys

    code = ("import sys, json\nfrom umalloc_replay.cli import app\ntry:\n    app(['generate', '--help'])\n"
            "except SystemExit as e:\n    c = e.code\nheavy = ('torch', 'transformers', 'numba', 'nixl_cu12', "
            "'mooncake')\nsys.stderr.write('PROBE ' + json.dumps([c, [m for m in heavy if m in sys.modules]]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert json.loads(res.stderr.rpartition("PROBE ")[2]) == [0, []], res.stderr
    assert "--backend" in res.stdout and "gemma3" in res.stdout


def test_every_documented_generate_command_parses() -> None:
    """The ``umalloc generate`` commands of README.md and docs/*.md parse (the command's own parser, no run)."""
    from doc_blocks import umalloc_commands
    from typer.main import get_command

    cmds = umalloc_commands("generate")
    assert len(cmds) >= 6, cmds
    gen = get_command(app).commands["generate"]  # type: ignore[attr-defined]
    backends = set()
    for args in cmds:
        backends.add(gen.make_context("generate", list(args)).params["backend"].value)
    assert backends == {"local", "nixl", "mooncake"}


@pytest.mark.backend
def test_a_killed_prefill_process_ends_the_run_with_a_backend_error() -> None:
    """The prefill process killed (SIGKILL, from outside) between two batches: the next batch's call raises
    ``WorkerDied``, a ``BackendError``, which the CLI turns into its one ``error:`` line and exit 1."""
    import os
    import signal

    from umalloc import BackendError, WorkerDied

    require_or_skip("nixl")
    seen: list = []

    def kill_after_first(batch: int, prefill) -> None:  # type: ignore[no-untyped-def]
        seen.append(prefill.worker)
        os.kill(prefill.worker.pid, signal.SIGKILL)  # as from outside: the worker does not know
        while prefill.worker.alive():  # the kernel ends it: wait on its state, not on a clock
            os.sched_yield()

    cfg = GenerateConfig(model="llama", backend="nixl", requests=4, token_scale=64, output_scale=32, max_batch=2)
    with pytest.raises(WorkerDied) as info:
        run_generate(cfg, on_batch=kill_after_first)
    assert isinstance(info.value, BackendError) and not seen[0].alive()


def test_a_stale_draft_kv_keeps_the_tokens_and_changes_the_acceptance() -> None:
    """The drafter's pages sent unwritten (zeros: what they held before the drafter's forward): greedy
    verification keeps every token equal to the target-only reference, and only the draft acceptance shows it
    — so the token check alone cannot see a stale draft; the acceptance differs from the true-KV run's."""
    good = report_of("gemma3", "local-draft")
    stale = run_generate(GenerateConfig(model="gemma3", draft=True, draft_tokens=2, fault="stale_draft", **SLICE))
    assert check_generate_report(stale) == []
    assert stale["tokens"] == good["tokens"]
    assert stale["speculative"]["accepted"] != good["speculative"]["accepted"], (stale["speculative"],
                                                                                good["speculative"])


def test_the_write_gate_keeps_stale_draft_kv_from_the_decode_side() -> None:
    """The drafter's forward runs after the target's pages are planned (vLLM #35158's order). Through the write
    gate every post waits for the drafter and the decode side receives the draft KV the drafter wrote (every
    digest matches); posted at once (``write_gate=False``) the same run sends the draft pages' old bytes, and
    the decode side's digest of every request's draft pages differs from what the drafter wrote."""
    gated = report_of("gemma3", "local-draft")
    assert gated["write_gate"] == {"deferred_posts": 4, "posted_before_draft": 0}
    assert gated["digest_mismatches"] == []
    early = run_generate(GenerateConfig(model="gemma3", draft=True, draft_tokens=2, write_gate=False, **SLICE))
    assert early["write_gate"] == {"deferred_posts": 0, "posted_before_draft": 4}
    assert early["digest_mismatches"] == [0, 1, 2, 3]
    assert early["tokens"] == gated["tokens"]  # verification keeps the tokens: only the bytes show it


# ---- the CLI ended from outside: Ctrl-C, a killed prefill process ---------------------------------------------

#: Eight batches of one request: the run has batches left to do when the prefill process's marker line appears.
CLI_LONG = ["--requests", "8", "--max-batch", "1", "--no-progress"]


def _start_until_prefill(backend: str) -> tuple[subprocess.Popen, int, set[int], list[str]]:
    """Start ``umalloc generate --backend BACKEND`` in a session of its own (so a SIGINT to its process group is a
    terminal's Ctrl-C) and read its output up to the ``prefill process: pid N`` line. Returns the process, N, the
    run's descendants then (N among them) and the lines read."""
    cmd = [sys.executable, "-c", "from umalloc_replay.cli import app; app()", "generate", "--backend", backend,
           *CLI_LONG]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    lines: list[str] = []
    for raw in iter(proc.stdout.readline, b""):  # type: ignore[union-attr]
        lines.append(raw.decode(errors="replace"))
        m = re.fullmatch(rf"prefill process: pid (\d+) \({backend}\)\n", lines[-1])
        if m:
            kids = descendant_pids(proc.pid)
            assert int(m[1]) in kids, (m[1], kids)  # the line names a real child of the run
            return proc, int(m[1]), kids, lines
    proc.wait(timeout=120)
    raise AssertionError(f"no prefill process line (exit {proc.returncode}):\n" + "".join(lines))


def _finish(proc: subprocess.Popen, lines: list[str], kids: set[int]) -> str:
    """Wait (hang guard 120 s) for the run to end; assert none of ``kids`` outlives it; return all its output."""
    try:
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert wait_all_ended(kids) == [], "a child outlived the run"
    return "".join(lines) + rest.decode(errors="replace")


@pytest.mark.backend
def test_ctrl_c_mid_run_is_quiet_ends_the_prefill_process_and_exits_130() -> None:
    require_or_skip("nixl")
    proc, _, kids, lines = _start_until_prefill("nixl")
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group, the child included
    text = _finish(proc, lines, kids)
    assert proc.returncode == 130, text
    assert text.strip().splitlines()[-1] == "interrupted" and text.count("interrupted") == 1, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text and "error:" not in text, text


@pytest.mark.backend
def test_a_killed_prefill_process_ends_the_cli_run_with_one_error_line_naming_it() -> None:
    require_or_skip("mooncake")
    proc, pid, kids, lines = _start_until_prefill("mooncake")
    os.kill(pid, signal.SIGKILL)
    text = _finish(proc, lines, kids)
    assert proc.returncode == 1, text
    errors = [ln for ln in text.splitlines() if "error:" in ln]
    assert errors == [f"error: the mooncake backend failed: the prefill process (pid {pid}) died (killed by "
                      "signal 9)"], text
    assert "Traceback" not in text, text
