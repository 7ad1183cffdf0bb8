"""The replay's model of vLLM's hybrid KV cache manager (``--layout vllm``,
:func:`umalloc_replay.single.layouts.vllm_blocks`) against vLLM's own code: its grouping and page unification
(``kv_cache_planning.unify_kv_cache_spec_page_size`` and ``_get_kv_cache_groups_uniform_page_size``) on the same
layers, and the blocks its real ``SlidingWindowManager`` / ``FullAttentionManager`` hold per request as a request
decodes. Skipped where vLLM is not importable (the main venv); run in the vLLM peer venv::

    PYTHONPATH=$PWD .peer/vllm-venv/bin/python -m pytest -q -p no:cacheprovider -o addopts="" \\
        tests/integrations/test_vllm_capacity_model.py
"""

from __future__ import annotations

import pytest

from umalloc.geometry.presets import preset_ends
from umalloc.geometry.spec import LayerKind
from umalloc_replay.single.layouts import VllmGroup, vllm_blocks

pytest.importorskip("vllm.v1.core.kv_cache_planning")
torch = pytest.importorskip("torch")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_planning import (  # noqa: E402
    _get_kv_cache_groups_uniform_page_size,
    unify_kv_cache_spec_page_size,
)
from vllm.v1.core.single_type_kv_cache_manager import (  # noqa: E402
    FullAttentionManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

DTYPE = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}


def vllm_specs(ends, block_size: int = 16) -> dict:
    """vLLM's KV cache spec of every layer of ``ends`` (MHA layers only), named by end and index."""
    out = {}
    for e in ends:
        for i, layer in enumerate(e.layers):
            assert layer.kind is LayerKind.MHA
            kw = dict(block_size=block_size, num_kv_heads=layer.num_kv_heads, head_size=layer.head_dim_k,
                      dtype=DTYPE[layer.dtype.itemsize])
            out[f"{e.name}.{i}"] = (FullAttentionSpec(**kw) if layer.window_tokens is None
                                    else SlidingWindowSpec(**kw, sliding_window=layer.window_tokens))
    return out


def vllm_types(ends) -> list[tuple[int, int | None, int]]:
    """``(block_size, sliding_window or None, groups)`` per layer type, from vLLM's own grouping."""
    groups = _get_kv_cache_groups_uniform_page_size(unify_kv_cache_spec_page_size(vllm_specs(ends)))
    count: dict[tuple[int, int | None], int] = {}
    for g in groups:
        key = (g.kv_cache_spec.block_size, getattr(g.kv_cache_spec, "sliding_window", None))
        count[key] = count.get(key, 0) + 1
    return [(b, w, n) for (b, w), n in count.items()]


def bench_preset_ends(which: str):
    """The ends of a preset ``benchmarks/bench_capacity.py`` registers (``LLAMA4``: Llama-4-Scout chunked, 48
    layers, every fourth global, chunk 1,024 as a window; ``GEMMA3_27B``: 10 full + 52 sliding layers)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_capacity.py"
    spec = importlib.util.spec_from_file_location("bench_capacity_for_vllm_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return preset_ends(getattr(mod, which))


def _key(t: tuple[int, int | None, int]) -> tuple[int, int, int]:
    return (t[0], -1 if t[1] is None else t[1], t[2])


@pytest.mark.parametrize("name", ["gemma-3-12b-draft", "gpt-oss-20b", "LLAMA4", "GEMMA3_27B"])
def test_groups_and_block_sizes_match_vllm(name):
    ends = bench_preset_ends(name) if name.isupper() else preset_ends(name, page_size=16)
    model = vllm_blocks(ends, 1 << 30)
    ours = sorted(((t.block_tokens, t.window_tokens, t.groups) for t in model.types), key=_key)
    assert ours == sorted(vllm_types(ends), key=_key)
    # one block: G layers of the unified page (vLLM's page of every layer after unification)
    unified = unify_kv_cache_spec_page_size(vllm_specs(ends))
    (page,) = {s.page_size_bytes for s in unified.values()}
    groups = _get_kv_cache_groups_uniform_page_size(unified)
    assert model.block_bytes == page * len(groups[0].layer_names)


@pytest.mark.parametrize("block,window,prompt,output", [(16, 1024, 3000, 300), (16, 128, 300, 40),
                                                        (128, 512, 700, 200), (16, 1024, 200, 900),
                                                        (16, None, 90, 50)])
def test_blocks_held_match_vllms_managers(block, window, prompt, output):
    # A decode-side request arrives with its prompt computed elsewhere (the KV connector's external tokens) and
    # computes one token per step; vLLM's order in KVCacheManager.allocate_slots: the window's skipped blocks
    # are nulls (a new request) or freed (remove_skipped_blocks), computed tokens = slots - 1, then blocks up to
    # the slots. Prefix caching off.
    kw = dict(block_size=block, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    spec = FullAttentionSpec(**kw) if window is None else SlidingWindowSpec(**kw, sliding_window=window)
    pool = BlockPool(num_gpu_blocks=4096, enable_caching=False, hash_block_size=block)
    cls = FullAttentionManager if window is None else SlidingWindowManager
    mgr = cls(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=block)
    ours = VllmGroup(block, window, 1)
    mgr.add_local_computed_blocks("r", [], 0, prompt - 1)
    mgr.allocate_external_computed_blocks("r", 0, prompt - 1)
    for n in range(prompt, prompt + output + 1):
        if n > prompt:
            mgr.remove_skipped_blocks("r", n - 1)
        mgr.allocate_new_blocks("r", n, n)
        held = sum(1 for b in mgr.req_to_blocks["r"] if not b.is_null)
        assert held == ours.held(n), n
        assert pool.get_num_free_blocks() == 4096 - 1 - held  # the null block is never handed out
