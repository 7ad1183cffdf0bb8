"""``umalloc generate``: a random-weight model's KV moved from a prefill side to a decode side on umalloc pages,
every request's tokens equal to one process's.

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

from umalloc import UmallocValueError  # noqa: E402
from umalloc.testing import require_or_skip, seed_from_env  # noqa: E402
from umalloc_replay.cli import app  # noqa: E402
from umalloc_replay.generate.kv import reference_tokens  # noqa: E402
from umalloc_replay.generate.models import VOCAB_SIZE, build_model, geometry_of, weights_digest  # noqa: E402
from umalloc_replay.generate.run import (  # noqa: E402
    GenerateConfig,
    check_generate_report,
    generate_table,
    load_slice,
    prompt_tokens,
    run_generate,
)
from umalloc_replay.trace import default_trace_path  # noqa: E402

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


def smallest_fitting_token_scale(rows: int, output_scale: int, context: int = 1024) -> int:
    """By search, from the packaged trace's first ``rows`` rows read here: the smallest K with every
    ``max(1, ceil(prompt / K)) + max(2, ceil(output / output_scale))`` within ``context``."""
    import json

    with open(default_trace_path()) as fh:
        reqs = [json.loads(next(fh)) for _ in range(rows)]
    outs = [max(2, -(-r["output_length"] // output_scale)) for r in reqs]
    return next(k for k in range(1, 1 << 20) if all(max(1, -(-r["input_length"] // k)) + o <= context
                                                    for r, o in zip(reqs, outs, strict=True)))


@pytest.mark.parametrize("args, needle", [
    (["--model", "mistral"], "--model 'mistral': allowed one of llama, qwen3, gemma3"),
    (["--backend", "rdma"], "'rdma' is not one of"),
    (["--page-size", "0"], "Invalid value for '--page-size'"),
    (["--page-size", "65537"], "Invalid value for '--page-size'"),
    (["--token-scale", "1"], f"allowed --token-scale >= {smallest_fitting_token_scale(8, 16)}"),
    (["--token-scale", "1", "--output-scale", "1"], f"allowed --token-scale >= {smallest_fitting_token_scale(8, 1)}"),
    (["--trace", "/nonexistent/trace.jsonl"], "/nonexistent/trace.jsonl"),
    (["--draft-tokens", "2"], "--draft-tokens 2: only a run with a drafter proposes draft tokens; allowed with "
     "--draft"),
    (["--no-draft", "--draft-tokens", "2"], "allowed with --draft"),
    (["--draft-layers", "1"], "--draft-layers 1: only a run with a drafter has draft layers; allowed with --draft"),
    (["--draft", "--draft-layers", "3", "--model", "llama"], "--draft-layers 3: allowed 1..1 (the target has 2 "
     "layers)"),
    (["--draft-method", "ngram"], "--draft-method ngram: only a run with a drafter has a draft method; allowed "
     "with --draft"),
    (["--draft", "--draft-method", "medusa"], "--draft-method 'medusa': allowed early-exit, ngram"),
    (["--draft", "--draft-method", "ngram", "--draft-layers", "1"], "--draft-layers 1: the n-gram drafter has no "
     "layers; allowed with --draft-method early-exit"),
    (["--draft", "--draft-layers", "3"], "--draft-layers 3: allowed 1..2 (the target has 3 layers)"),
    (["--requests", "12032"], "--requests 12032: packaged trace conversation_trace.jsonl holds only 12031 "
     "requests: allowed --requests <= 12031"),
    (["--skip", "12031"], "--skip 12031 passes every one of the 12031 requests of packaged trace "
     "conversation_trace.jsonl: allowed --skip <= 12030"),
    (["--skip", "12030", "--requests", "2"], "holds only 1 requests after --skip 12030"),
    (["--trace-format", "azure"], "packaged trace conversation_trace.jsonl:1: missing column(s) TIMESTAMP, "
     "ContextTokens, GeneratedTokens: allowed a header TIMESTAMP,ContextTokens,GeneratedTokens"),
])
def test_bad_arguments_exit_2_with_one_error_line(args: list[str], needle: str) -> None:
    """Each refusal: exit 2, one ``error:`` line naming the CLI's options (never a Python keyword such as
    ``skip=``) and the packaged trace by its name (never its install path, never its first line's text)."""
    res = CliRunner().invoke(app, ["generate", "--model", "gemma3", *args], catch_exceptions=False)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2, (res.stdout, res.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines
    assert res.stdout == ""
    assert str(default_trace_path()) not in lines[0] and '"timestamp"' not in lines[0]
    assert re.search(r"[a-z_]=", lines[0]) is None, lines[0]  # "skip=4" is a Python keyword, not an option


def test_the_context_hint_of_a_huge_row_is_computed() -> None:
    """A row of 1e11 prompt tokens: the refusal names the smallest fitting ``--token-scale`` (worked out here by
    hand: ``ceil(1e11 / (1024 - 2))``, the 2 output tokens every request generates at least); an output alone
    over the context names the smallest fitting ``--output-scale`` (``ceil(1e11 / 1023)``). No search over
    scales: the refusal comes from arithmetic on the row."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        huge = os.path.join(d, "huge.jsonl")
        with open(huge, "w") as fh:
            fh.write('{"timestamp": 0, "input_length": 100000000000, "output_length": 5}\n'
                     '{"timestamp": 1, "input_length": 10, "output_length": 100000000000}\n')
        with pytest.raises(UmallocValueError, match=rf"allowed --token-scale >= {-(-10**11 // 1022)}$"):
            load_slice(GenerateConfig(trace=huge, requests=1), 1024)
        with pytest.raises(UmallocValueError, match=rf"allowed --output-scale >= {-(-10**11 // 1023)}$"):
            load_slice(GenerateConfig(trace=huge, requests=1, skip=1), 1024)
        # the hinted scales fit
        assert load_slice(GenerateConfig(trace=huge, requests=1, token_scale=-(-10**11 // 1022)), 1024)
        assert load_slice(GenerateConfig(trace=huge, requests=1, skip=1, output_scale=-(-10**11 // 1023)), 1024)


def test_an_output_path_equal_to_the_input_trace_is_refused_and_the_trace_kept(tmp_path) -> None:
    """``--report`` naming the ``--trace`` file (itself, another spelling, a link either way) is refused before
    anything runs; the trace keeps its bytes."""
    trace = tmp_path / "t.jsonl"
    text = '{"timestamp": 0, "input_length": 100, "output_length": 40}\n'
    trace.write_text(text)
    link = tmp_path / "link.jsonl"
    link.symlink_to(trace)
    for t, out in ((trace, trace), (trace, tmp_path / "." / "t.jsonl"), (link, trace), (trace, link)):
        res = CliRunner().invoke(app, ["generate", "--trace", str(t), "--report", str(out), "--requests", "1",
                                       "--no-progress"], catch_exceptions=False)
        lines = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1, (res.stdout, res.stderr)
        assert lines[0].startswith("error: --report") and "and --trace name the same file" in lines[0], lines
        assert trace.read_text() == text and res.stdout == ""


def test_any_seed_is_accepted_and_seeds_past_64_bits_stay_distinct() -> None:
    """``--seed`` takes any size (``seed * 1_000_003`` once overflowed 64 bits from about 1.8e13 on): a seed past
    64 bits runs, and its prompts and weights are not those of the seed it equals modulo 2**64."""
    big = 10**25
    print(f"seed {big}")
    prompt = prompt_tokens(big, 0, 64, VOCAB_SIZE)
    assert all(3 <= t < VOCAB_SIZE for t in prompt) and len(prompt) == 64
    assert prompt != prompt_tokens(big % 2**64, 0, 64, VOCAB_SIZE) and prompt != prompt_tokens(big, 1, 64, VOCAB_SIZE)
    assert weights_digest(build_model("llama", 2**64 + 1)) != weights_digest(build_model("llama", 1))
    rep = run_generate(GenerateConfig(model="llama", seed=big, requests=1, token_scale=64, output_scale=64))
    assert check_generate_report(rep) == [] and rep["config"]["seed"] == big and rep["decoded_tokens"] >= 1


def test_the_command_prints_its_table_and_its_report_reproduces_the_run(tmp_path) -> None:
    """The JSON report names every option of its run (trace, ``--skip``, ``--requests``, ``--max-batch``, ...),
    the umalloc version and each request's lengths (worked out here from the trace rows); the run its config
    describes generates the same tokens. Decoded tokens/s divides the decoded tokens (every token after the
    prefill's first) by the decode forwards' seconds."""
    import json

    import umalloc
    from umalloc_replay.generate.run import GENERATE_SCHEMA

    out = tmp_path / "r.json"
    args = ["--model", "qwen3", "--skip", "3", "--requests", "2", "--max-batch", "1", "--seed", str(SEED),
            "--report", str(out), "--no-progress"]
    res = CliRunner().invoke(app, ["generate", *args], catch_exceptions=False)
    assert res.exit_code == 0, (res.stdout, res.stderr)
    assert "identical to one process" in res.stdout and "2 of 2" in res.stdout
    rep = json.loads(out.read_text())
    assert rep["schema"] == GENERATE_SCHEMA == "umalloc-generate/6"
    assert rep["umalloc_version"] == umalloc.__version__
    assert rep["config"] == {"model": "qwen3", "backend": "local", "trace": None,
                             "trace_name": "packaged trace conversation_trace.jsonl", "trace_format": None,
                             "requests": 2, "skip": 3, "token_scale": 64, "output_scale": 16, "page_size": 16,
                             "max_batch": 1, "seed": SEED, "draft": False, "draft_tokens": None,
                             "draft_layers": None, "draft_method": None, "compaction": "lazy",
                             "decode_blocks": None, "steps_in_flight": 1}
    with open(default_trace_path()) as fh:
        rows = [json.loads(line) for line in list(fh)[3:5]]
    assert [(p["request"], p["prompt_tokens"], p["output_tokens"]) for p in rep["per_request"]] == [
        (3 + i, -(-r["input_length"] // 64), max(2, -(-r["output_length"] // 16))) for i, r in enumerate(rows)]
    assert [p["decoded"] for p in rep["per_request"]] == [len(rep["tokens"][str(3 + i)]) - 1 for i in range(2)]
    assert rep["decoded_tokens"] == rep["tokens_generated"] - 2
    assert rep["decoded_tokens_per_s"] == pytest.approx(rep["decoded_tokens"] / rep["seconds"]["decode_compute"])
    cfg = {k: v for k, v in rep["config"].items() if k not in ("trace_name", "draft_tokens")}
    assert run_generate(GenerateConfig(**cfg))["tokens"] == rep["tokens"]


def test_every_request_decodes_from_the_received_kv_and_the_summary_counts_it() -> None:
    """At any ``--output-scale`` every request generates at least 2 tokens: the prefill's first and one decoded
    over the received KV, so two KV heads swapped in flight show even at ``--output-scale 1000000`` (every
    request's 1 decoded token is compared; before, every request stopped at the prefill's token and the run
    said "identical"). The summary line gives the decoded tokens compared and the fewest per request; a request
    that decoded none is a failed check."""
    rep = run_generate(GenerateConfig(model="llama", fault="swap_kv_heads", requests=4, token_scale=64,
                                      output_scale=1_000_000, seed=SEED))
    assert [(p["output_tokens"], p["decoded"]) for p in rep["per_request"]] == [(2, 1)] * 4
    assert rep["decoded_tokens"] == 4 and rep["decoded_tokens_min"] == 1
    assert rep["identical"] < 4 and check_generate_report(rep) != []
    table = generate_table(rep)
    rows = dict(zip(table.columns[0]._cells, table.columns[1]._cells, strict=True))
    assert rows["identical to one process"] == f"{rep['identical']} of 4 (4 decoded tokens compared, at least 1 " \
        "per request)"
    good = dict(rep, differing=[], per_request=[dict(rep["per_request"][0], decoded=0), *rep["per_request"][1:]])
    assert check_generate_report(good) == [f"requests [{rep['per_request'][0]['request']}] decoded no token from "
                                           "the received KV: their token check cannot see the transferred KV"]


def test_help_names_the_models_tiny_random_weight_ones_and_smollm2_real_weights() -> None:
    for args in (["--help"], ["generate", "--help"]):
        res = CliRunner().invoke(app, args, catch_exceptions=False)
        text = " ".join(res.stdout.split())
        assert res.exit_code == 0 and "real model" not in text and "random-weight" in text, text
        assert "SmolLM2-135M's real weights" in text, text


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
    """The prefill process killed (SIGKILL, from outside) once the first request finished, two still waiting:
    the next admission's call raises ``WorkerDied``, a ``BackendError``, which the CLI turns into its one
    ``error:`` line and exit 1."""
    import os
    import signal

    from umalloc import BackendError
    from umalloc.backends.worker import WorkerDied

    require_or_skip("nixl")
    seen: list = []

    def kill_after_first(index: int, prefill) -> None:  # type: ignore[no-untyped-def]
        if index:
            return
        seen.append(prefill.worker)
        os.kill(prefill.worker.pid, signal.SIGKILL)  # as from outside: the worker does not know
        while prefill.worker.alive():  # the kernel ends it: wait on its state, not on a clock
            os.sched_yield()

    cfg = GenerateConfig(model="llama", backend="nixl", requests=4, token_scale=64, output_scale=32, max_batch=2)
    with pytest.raises(WorkerDied) as info:
        run_generate(cfg, on_finished=kill_after_first)
    assert isinstance(info.value, BackendError) and not seen[0].alive()


def test_a_stale_draft_kv_keeps_the_tokens_and_fails_the_acceptance_length_check() -> None:
    """The drafter's pages sent unwritten (zeros: what they held before the drafter's forward): greedy
    verification keeps every token equal to the target-only reference, so the token check passes; the
    acceptance length, compared round by round with the one-process speculative run, fails."""
    good = report_of("gemma3", "local-draft")
    al = good["acceptance_length"]
    assert al["differing"] == [] and al["pd"] == al["one_process"] and al["pd"]["rounds"] > 0
    stale = run_generate(GenerateConfig(model="gemma3", draft=True, draft_tokens=2, fault="stale_draft", **SLICE))
    problems = check_generate_report(stale)
    assert stale["differing"] == [] and stale["identical"] == 4   # the token check passes
    assert stale["acceptance_length"]["differing"], stale["acceptance_length"]
    assert len(problems) == 1 and "acceptance lengths differ from the one-process speculative run" in problems[0]
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
    # posted before the drafter ran: a post the transfer engine carries out before the drafter's write sends the
    # old bytes; on a loaded machine a late transfer may carry the new ones, so at least one request shows it
    assert early["digest_mismatches"] and set(early["digest_mismatches"]) <= {0, 1, 2, 3}
    assert early["tokens"] == gated["tokens"]  # verification keeps the tokens: only the bytes show it


# ---- the CLI ended from outside: Ctrl-C, a killed prefill process ---------------------------------------------

#: Eight requests, one in the batch at a time: the run has requests left to do when the prefill process's marker
#: line appears.
CLI_LONG = ["--model", "gemma3", "--requests", "8", "--max-batch", "1", "--no-progress"]


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


def test_an_early_exit_drafter_of_k_layers_has_the_one_process_acceptance_length() -> None:
    """``--draft-layers K``: the drafter is the target's first K layers; its KV rides the plan as the ``draft``
    vector and its acceptance length equals the one-process speculative run's, round by round."""
    rep = run_generate(GenerateConfig(model="qwen3", draft=True, draft_layers=1, draft_tokens=3, **SLICE))
    assert check_generate_report(rep) == [] and rep["identical"] == 4
    al = rep["acceptance_length"]
    assert al["differing"] == [] and al["pd"] == al["one_process"] and al["pd"]["rounds"] > 0
    assert sum(al["pd"]["distribution"].values()) == al["pd"]["rounds"] and "draft" in rep["bytes_by_vector"]


def test_an_early_exit_drafter_with_sliding_layers_has_the_one_process_acceptance_length() -> None:
    """tiny gemma3's first two layers (one sliding, window 32) as the drafter, prompts past the window: the
    ``draft`` end carries every token of both layers, the decode side's drafter cache keeps the window and rolls
    back rejected proposals like the one-process drafter's, so the acceptance length equals it round by round;
    the same run with the draft pages unwritten keeps the tokens and fails that check."""
    from umalloc_replay.generate.models import GEMMA3_WINDOW_TOKENS, build_drafter, build_model, geometry_of

    drafter = build_drafter(build_model("gemma3", SEED), SEED, 2)
    assert "sliding_attention" in geometry_of(drafter).layer_types
    past = dict(SLICE, token_scale=192, page_size=4)
    rep = run_generate(GenerateConfig(model="gemma3", draft=True, draft_layers=2, draft_tokens=3, **past))
    assert check_generate_report(rep) == [] and rep["identical"] == 4
    assert max(p["prompt_tokens"] for p in rep["per_request"]) > GEMMA3_WINDOW_TOKENS
    al = rep["acceptance_length"]
    assert al["differing"] == [] and al["pd"] == al["one_process"] and rep["speculative"]["accepted"] > 0
    stale = run_generate(GenerateConfig(model="gemma3", draft=True, draft_layers=2, draft_tokens=3,
                                        fault="stale_draft", **past))
    assert stale["tokens"] == rep["tokens"] and stale["acceptance_length"]["differing"]
