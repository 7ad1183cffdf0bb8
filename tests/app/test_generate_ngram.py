"""``umalloc generate --draft --draft-method ngram``: the n-gram (prompt lookup) drafter across PD.

Oracles: the proposer against a brute-force scan written here (every earlier occurrence of the suffix, longest
``n`` first, the most recent one); the PD run's tokens against target-only greedy decoding, its acceptance length
against the one-process speculative run and against the rounds a brute-force drafter replayed over the reference
tokens predicts (an n-gram proposal is a function of the tokens alone, so once the tokens equal the reference
every round's acceptance is fixed: the longest common prefix of the proposal and the reference's next tokens).
The same fact means a target KV corrupted so that greedy tokens survive cannot move the n-gram acceptance length;
a corrupted target KV (two KV heads swapped) is caught by the token check. Seeded (``UMALLOC_SEED``, printed).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umalloc import UmallocValueError
from umalloc.testing import seed_from_env
from umalloc_replay.generate.ngram import NgramIndex

SEED = seed_from_env(0)
#: 4 requests, prompts 36-421 tokens; gemma3's random greedy output repeats itself now and then, so the n-gram
#: drafter gets drafts accepted
SLICE: dict[str, Any] = dict(requests=4, token_scale=64, output_scale=32, seed=SEED)


def brute_propose(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Scan every start right to left for the suffix, longest n first."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[len(tokens) - n:]
        for j in range(len(tokens) - n - 1, -1, -1):
            if tokens[j: j + n] == suffix:
                return tokens[j + n: j + n + k]
    return []


def brute_rounds(context: list[int], tokens: list[int], draft_tokens: int) -> list[int]:
    """Drafts accepted per round when the output is ``tokens`` (its first the prefill's), proposals by
    :func:`brute_propose` over ``context`` + the tokens emitted so far."""
    out, pos = [], 1
    while pos < len(tokens):
        props = brute_propose([*context, *tokens[:pos]], min(draft_tokens, len(tokens) - pos))
        n = 0
        while n < len(props) and props[n] == tokens[pos + n]:
            n += 1
        out.append(n)
        pos += n + 1
    return out


@settings(max_examples=300, deadline=None, derandomize=True)  # the same examples every run
@given(tokens=st.lists(st.integers(0, 3), max_size=40), chunks=st.lists(st.integers(1, 5), max_size=12),
       k=st.integers(0, 6), sizes=st.sampled_from([(3, 1), (2, 1), (1, 1), (4, 2), (3, 3)]))
def test_the_proposer_equals_a_brute_force_scan_as_the_context_grows(tokens: list[int], chunks: list[int], k: int,
                                                                     sizes: tuple[int, int]) -> None:
    """A small alphabet makes matches common; the context grows in chunks and every prefix is checked."""
    max_n, min_n = sizes
    idx = NgramIndex(tokens[:1], max_n, min_n)
    pos = 1
    assert idx.propose(k) == brute_propose(tokens[:1], k, max_n, min_n)
    for c in [*chunks, len(tokens)]:
        idx.extend(tokens[pos: pos + c])
        pos = min(len(tokens), pos + c)
        assert idx.tokens == tokens[:pos]
        assert idx.propose(k) == brute_propose(tokens[:pos], k, max_n, min_n), (tokens[:pos], k)


def test_the_proposer_examples_and_bad_sizes() -> None:
    # the longest suffix wins over a more recent shorter match; the most recent occurrence wins among equals
    assert NgramIndex([1, 2, 3, 9, 2, 3, 7, 3, 1, 2, 3]).propose(3) == [9, 2, 3]
    assert NgramIndex([5, 6, 5, 7, 5]).propose(2) == [7, 5]
    assert NgramIndex([4, 4, 4]).propose(5) == [4]          # the match may run up to the context's end
    assert NgramIndex([1, 2, 3]).propose(4) == [] and NgramIndex([]).propose(2) == []
    with pytest.raises(UmallocValueError, match="allowed 1 <= min_n <= max_n"):
        NgramIndex([1], max_n=1, min_n=2)


pytest.importorskip("transformers")


def _ngram_report(**kw: Any) -> dict:
    from umalloc_replay.generate.run import GenerateConfig, run_generate

    print(f"seed {SEED}: {kw}")
    cfg = {"model": "gemma3", **SLICE, **kw}
    return run_generate(GenerateConfig(draft=True, draft_method="ngram", draft_tokens=3, **cfg))


_cache: dict[str, dict] = {}


def gemma3_ngram() -> dict:
    if "gemma3" not in _cache:
        _cache["gemma3"] = _ngram_report(model="gemma3")
    return _cache["gemma3"]


def test_an_ngram_run_equals_greedy_and_its_acceptance_length_the_one_process_run() -> None:
    """Tokens equal target-only greedy; AL equals the one-process speculative run's round by round and the
    rounds a brute-force drafter predicts from the reference tokens; the drafter has no KV: no draft vector."""
    from umalloc_replay.generate.models import VOCAB_SIZE
    from umalloc_replay.generate.run import check_generate_report, generate_table, prompt_tokens

    rep = gemma3_ngram()
    assert check_generate_report(rep) == [] and rep["identical"] == 4
    assert set(rep["bytes_by_vector"]) == {"target", "swa_tail"}   # nothing of the drafter on the plan
    assert rep["write_gate"] == {"deferred_posts": 0, "posted_before_draft": 0}
    sp, al = rep["speculative"], rep["acceptance_length"]
    assert 0 < sp["accepted"] < sp["proposed"], sp
    assert al["differing"] == [] and al["pd"] == al["one_process"]
    predicted: dict[str, int] = {}
    for p in rep["per_request"]:
        prompt = prompt_tokens(SEED, p["request"], p["prompt_tokens"], VOCAB_SIZE)
        for n in brute_rounds(prompt, rep["tokens"][str(p["request"])], 3):
            predicted[str(n + 1)] = predicted.get(str(n + 1), 0) + 1
    assert al["pd"]["distribution"] == dict(sorted(predicted.items()))
    assert sum(int(a) * c for a, c in predicted.items()) == sp["accepted"] + sp["rounds"]
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(generate_table(rep))
    text = console.export_text()
    assert "ngram: " in text and "no draft KV (n-gram drafter)" in text
    broken = dict(rep, acceptance_length=dict(al, differing=[rep["per_request"][0]["request"]]))
    assert any("the target KV received changed the target's verification" in p
               for p in check_generate_report(broken))


def test_a_target_kv_with_two_heads_swapped_is_caught_by_the_token_check() -> None:
    """The n-gram acceptance length follows from the tokens, so a target KV wrong in a way greedy tokens survive
    cannot move it (see the module docstring); a wrong target KV that changes the tokens fails the token check."""
    rep = _ngram_report(model="llama", fault="swap_kv_heads")
    from umalloc_replay.generate.run import check_generate_report

    problems = check_generate_report(rep)
    assert rep["differing"] and rep["digest_mismatches"] == []
    assert any("tokens differ from one process" in p for p in problems), problems


@pytest.mark.backend
def test_an_ngram_run_over_nixl_sends_no_draft_kv() -> None:
    from umalloc.testing import require_or_skip

    require_or_skip("nixl")
    rep = _ngram_report(model="llama", backend="nixl")
    from umalloc_replay.generate.run import check_generate_report

    assert check_generate_report(rep) == [] and rep["identical"] == 4
    assert set(rep["bytes_by_vector"]) == {"target"}
    assert rep["acceptance_length"]["pd"] == rep["acceptance_length"]["one_process"]


def test_the_command_runs_the_ngram_drafter_and_its_report_names_it(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from umalloc_replay.cli import app

    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["generate", "--model", "qwen3", "--requests", "2", "--draft", "--draft-method",
                                   "ngram", "--draft-tokens", "2", "--seed", str(SEED), "--report", str(out),
                                   "--no-progress"], catch_exceptions=False)
    assert res.exit_code == 0, (res.stdout, res.stderr)
    rep = json.loads(out.read_text())
    assert rep["schema"] == "umalloc-generate/6"
    assert (rep["config"]["draft"], rep["config"]["draft_method"], rep["config"]["draft_layers"]) == (True, "ngram", None)
    assert rep["acceptance_length"]["pd"] == rep["acceptance_length"]["one_process"]
    assert "one-process speculative vs target only" in res.stdout and "speed-up" in res.stdout
