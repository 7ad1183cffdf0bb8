"""The replay's static pools (``--layout static:RATIO``, :func:`umalloc_replay.single.layouts.static_budget_pages`)
against SGLang 0.5.23's own pool sizing, ``HybridSWAPoolConfigurator.calculate_pool_sizes``
(``srt/model_executor/pool_configurator.py``), on the same bytes and geometry. Skipped where SGLang is not
importable (the main venv); run in the SGLang peer venv::

    PYTHONPATH=$PWD .peer/sglang-venv/bin/python -m pytest -q -p no:cacheprovider -o addopts="" \\
        tests/integrations/test_sglang_capacity_model.py

The configurator is built without a model: its per-token fields are set to what its ``__init__`` derives for the
geometry (KV heads x (head_dim + v_head_dim) x 2 bytes per full and per SWA layer, the layer counts, no drafter),
then SGLang's own ``_recompute_cell_size`` and ``calculate_pool_sizes`` run unchanged.
"""

from __future__ import annotations

import os
import sys

import pytest

from umalloc.errors import UmallocValueError
from umalloc.geometry.presets import preset_arena_spec
from umalloc.geometry.spec import EndRole
from umalloc_replay.single.layouts import static_budget_pages

pytest.importorskip("sglang")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peer"))

import sglang_cpu_shims  # noqa: E402

sglang_cpu_shims.prepare()

from sglang.srt.model_executor.pool_configurator import HybridSWAPoolConfigurator  # noqa: E402

PS = 16


def sglang_pools(spec, ratio: float) -> tuple[int, int]:
    """SGLang's ``(full_tokens, swa_tokens)`` for ``spec``'s target ends over its usable bytes."""
    full = next(e for e in spec.ends if e.role is EndRole.TARGET)
    swa = next(e for e in spec.ends if e.role is EndRole.SWA)
    c = object.__new__(HybridSWAPoolConfigurator)
    c._full_layers_num, c._swa_layers_num = len(full.layers), len(swa.layers)
    c._full_per_token = full.layers[0].token_bytes
    c._swa_per_token = swa.layers[0].token_bytes
    c._swa_full_tokens_ratio = ratio
    c._sliding_window_size, c._page_size, c._enable_unified_memory = swa.window_tokens, PS, False
    c._draft_full_layers_num = c._draft_swa_layers_num = c._draft_swa_full_layers_num = 0
    c._draft_cell_size, c._fused_full_entry, c._fused_swa_entry = 0, None, None
    c.kv_cache_dtype_str = "auto"
    c._recompute_cell_size()
    cfg = c.calculate_pool_sizes(spec.usable_bytes(), PS)
    return cfg.full_max_total_num_tokens, cfg.swa_max_total_num_tokens


@pytest.mark.parametrize("model", ["gpt-oss-20b", "gemma-3-12b"])
@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("pages", [700, 2001, 12345])
def test_static_pools_match_sglangs_sizing(model, ratio, pages):
    spec = preset_arena_spec(model, pages * preset_arena_spec(model, 1 << 30, page_size=PS).ends[0].page_bytes,
                             page_size=PS)
    try:
        theirs = sglang_pools(spec, ratio)
    except ValueError as exc:  # SGLang refuses an SWA pool that cannot hold one window: so does the replay
        assert "cannot hold even one request" in str(exc)
        with pytest.raises(UmallocValueError, match="SGLang refuses to start"):
            static_budget_pages(spec, ratio)
        return
    ours = static_budget_pages(spec, ratio)
    assert (ours["full"] * PS, ours["swa"] * PS) == theirs


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("pages", [2001, 12345])
def test_drafter_sliding_layers_priced_in_the_swa_pool(ratio, pages):
    # SGLang prices an EAGLE / standalone drafter's layers at the target's per-layer bytes: its full layers on the
    # full side (_draft_full_layers_num), its sliding layers at RATIO on the SWA side (_draft_swa_layers_num). A
    # Gemma-3-style target with a drafter of the target's head geometry (4 full + 22 sliding layers, window 512),
    # laid out as preset_ends lays out a drafter: sliding layers in the swa end, full layers in the draft end.
    from umalloc.geometry.spec import ArenaSpec, EndSpec, Grow, LayerSpec

    full_l, swa_l = LayerSpec.mha(8, 256), LayerSpec.mha(8, 256, window_tokens=1024)
    d_swa = LayerSpec.mha(8, 256, window_tokens=512)
    ends = (EndSpec("full", (full_l,) * 8, PS),
            EndSpec("swa", (swa_l,) * 40 + (d_swa,) * 22, PS, Grow.FLOAT, "full", EndRole.SWA),
            EndSpec("draft", (full_l,) * 4, PS, Grow.DOWN, "full", EndRole.DRAFT))
    spec = ArenaSpec(ends, arena_bytes=pages * ends[0].page_bytes)
    c = object.__new__(HybridSWAPoolConfigurator)
    c._full_layers_num, c._swa_layers_num = 8, 40
    c._full_per_token = c._swa_per_token = full_l.token_bytes
    c._swa_full_tokens_ratio = ratio
    c._sliding_window_size, c._page_size, c._enable_unified_memory = 1024, PS, False
    c._draft_full_layers_num, c._draft_swa_layers_num, c._draft_swa_full_layers_num = 4, 22, 0
    c._draft_cell_size, c._fused_full_entry, c._fused_swa_entry = 0, None, None
    c.kv_cache_dtype_str = "auto"
    c._recompute_cell_size()
    cfg = c.calculate_pool_sizes(spec.usable_bytes(), PS)
    ours = static_budget_pages(spec, ratio)
    assert (ours["full"] * PS, ours["swa"] * PS) == (cfg.full_max_total_num_tokens, cfg.swa_max_total_num_tokens)
    assert ours["draft"] == ours["full"]
