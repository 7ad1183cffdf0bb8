"""The layout comparison of `umalloc replay --layout`: SGLang's static SWA split and vLLM's unified page pinned to
numbers derived by hand from their rules, the three layouts on a small slice with figures a person can check,
and the byte accounting (live + padding + pending + free + floor = arena) after every scheduler step."""

from __future__ import annotations

import json

import pytest

from umalloc.errors import UmallocValueError
from umalloc.geometry.presets import preset_ends
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, LayerSpec
from umalloc_replay.report import check_report
from umalloc_replay.single.layouts import (
    SGLANG_SWA_FULL_TOKENS_RATIO,
    byte_accounting,
    padded_ends,
    parse_layout,
    static_budget_pages,
    vllm_blocks,
    vllm_unified_page,
)
from umalloc_replay.single.run import Replay, ReplayConfig

PS = 16
O_TOKEN = 12 * 8 * 128 * 2  # gpt-oss-20b: 12 layers per end x 8 KV heads x (64 + 64) x 2 B = 24,576 B per token
O_PAGE = PS * O_TOKEN       # 393,216 B


# ---- the rules ------------------------------------------------------------------------------------------------


def test_sglang_default_ratio_and_static_split_by_hand():
    assert SGLANG_SWA_FULL_TOKENS_RATIO == 0.8  # sglang/srt/server_args.py: swa_full_tokens_ratio: float = 0.8
    assert parse_layout("static").swa_full_tokens_ratio == 0.8
    # Gemma-3-12B + 1B drafter, bytes per token: full 65,536, swa 327,680 + 22 drafter layers x 1,024, draft
    # 4 x 1,024. SGLang counts the drafter's sliding layers in the SWA pool and its full layers in the full one
    # (pool_configurator.py: _cell_size = full + draft full + r x (swa + draft swa)). Usable bytes U:
    # full_tokens = int(U // (65,536 + 4,096 + r * (327,680 + 22,528))) rounded down to whole pages; swa_tokens =
    # int(r * full_tokens) (HybridSWAPoolConfigurator._solve_pool_sizes); draft = full_tokens.
    spec = ArenaSpec(preset_ends("gemma-3-12b-draft"), arena_bytes=(16 << 20) * 200)
    usable = spec.usable_bytes()
    for r in (0.8, 0.25):
        f = int(usable // (65536 + 4096 + r * (327680 + 22528))) // 16 * 16
        want = {"full": f // 16, "swa": int(r * f) // 16, "draft": f // 16}
        got = static_budget_pages(spec, r)
        assert got == want
        # the pools never exceed the arena
        assert sum(got[e.name] * e.page_bytes for e in spec.ends) <= usable


def test_vllm_unified_page_rule_by_hand():
    # Gemma-3-12B + Gemma-3-1B drafter at 16-token pages: per-layer pages 16 x 8,192 = 131,072 B (target) and
    # 16 x 1,024 = 16,384 B (drafter; divides 131,072, so vLLM grows its block size 8x, no padding). Layer types:
    # target full 8, target sliding-1024 40, drafter sliding-512 22, drafter full 4. min 4, max 40 >= 1.5 x 4, so
    # the group size is 4; 22 -> 24 layers (2 padding), the others are multiples of 4. Block: 4 x 131,072 B.
    u = vllm_unified_page(preset_ends("gemma-3-12b-draft", page_size=PS))
    assert (u.page_bytes, u.group_size, u.block_bytes) == (131072, 4, 524288)
    assert u.types == {(8192, None, "mha"): (8, 0), (8192, 1024, "mha"): (40, 0), (1024, 512, "mha"): (22, 2),
                       (1024, None, "mha"): (4, 0)}
    padded = {e.name: e for e in padded_ends(preset_ends("gemma-3-12b-draft", page_size=PS))}
    # the drafter's sliding layers (and their 2 padding layers) sit in the swa end beside the target's
    assert padded["draft"].entry_bytes == 4 * 1024 and padded["swa"].entry_bytes == 40 * 8192 + 24 * 1024
    assert padded["swa"].window_tokens == 1024 and padded["draft"].window_tokens is None
    whole = {e.name: e for e in padded_ends(preset_ends("gemma-3-12b-draft", page_size=PS, draft_sliding="draft"))}
    assert whole["draft"].entry_bytes == 26624 + 2 * 1024 and whole["swa"].entry_bytes == 40 * 8192
    # gpt-oss-20b: 12 sliding + 12 full of one size: one group size (12), no padding
    u = vllm_unified_page(preset_ends("gpt-oss-20b", page_size=PS))
    assert (u.page_bytes, u.group_size, u.block_bytes) == (32768, 12, 393216)
    assert all(pad == 0 for _n, pad in u.types.values())

    def ends(full: int, sw: int) -> tuple[EndSpec, ...]:
        return (EndSpec("full", (LayerSpec.mha(8, 64),) * full, page_size=PS),
                EndSpec("swa", (LayerSpec.mha(8, 64, window_tokens=128),) * sw, page_size=PS, grow=Grow.DOWN,
                        owner="full", role=EndRole.SWA))

    # the examples of vLLM's comments: 12 sw + 13 full -> groups of 13 (one padding sw layer); 10 full + 20 sw ->
    # groups of 10, no padding; 20 full + 30 sw -> 30 < 1.5 x 20 is false, groups of 20, sw padded 30 -> 40
    assert vllm_unified_page(ends(13, 12)).group_size == 13
    assert [len(e.layers) for e in padded_ends(ends(13, 12))] == [13, 13]
    assert [len(e.layers) for e in padded_ends(ends(10, 20))] == [10, 20]
    assert [len(e.layers) for e in padded_ends(ends(20, 30))] == [20, 40]


def test_layout_parsing_refuses_bad_values():
    assert parse_layout("static:0.25").label == "static:0.25" and parse_layout("padded").label == "padded"
    assert parse_layout("vllm").label == "vllm" and parse_layout("static:1").label == "static:1"
    # SGLang refuses --swa-full-tokens-ratio outside (0, 1] (kv_cache_hook)
    # a colon with nothing after it names no RATIO: refused, not read as the bare name
    for bad in ("static:0", "static:-1", "static:x", "static:inf", "static:1.5", "fixed", "dynamic:2", "vllm:1",
                "", "static:", "dynamic:", "vllm:", "padded:"):
        with pytest.raises(UmallocValueError):
            parse_layout(bad)


# ---- the three layouts on a small slice -----------------------------------------------------------------------


def two_requests(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i, "input_length": 300, "output_length": 40}) + "\n"
                         for i in range(2)))
    return p


class Accounted(Replay):
    """Checks where every decode byte is after every scheduler step."""

    def _sample(self) -> None:
        super()._sample()
        st = self.dec.stats()
        acc = byte_accounting(self.dec_spec, st, self.natural_page_bytes)
        total = acc["live_bytes"] + acc["padding_bytes"] + acc["pending_bytes"] + acc["free_bytes"] + \
            acc["floor_bytes"]
        assert total == self.decode_arena_bytes, (self.step, acc)
        # recomputed from the page counts and the natural geometry of the preset
        natural = {e.name: e.page_bytes for e in preset_ends(self.cfg.model, page_size=PS,
                                                             draft_sliding=self.cfg.draft_sliding)}
        assert acc["live_bytes"] == sum(s.live_pages * natural[n] for n, s in st.items())
        self.accounted = getattr(self, "accounted", 0) + 1


@pytest.mark.parametrize("layout,max_running,steps", [("dynamic", 2, 41), ("padded", 2, 41), ("static:1", 1, 82)])
def test_three_layouts_on_a_small_slice(tmp_path, layout, max_running, steps):
    # gpt-oss-20b (window 128): each request, 300 prompt + 40 output tokens, peaks at ceil(340 / 16) = 22 full
    # pages and 9 SWA pages (the window tail: cdiv(128, 16) + 1). The decode arena has 64 pages of 393,216 B above
    # its one-page floor: dynamic holds both requests at once (2 x 31 = 62 pages): both admitted at step 1, decode
    # steps 2..41 (dynamic and padded hold at most the 9-page window tail on the SWA end, cdiv(128, 16) + 1).
    # static:1 splits it 32 full / 32 SWA pages: the second request's 19 prompt pages plus the
    # first's reserve do not fit the 13 full pages left, so it waits until step 41 frees the first, is admitted at
    # step 42 and decodes steps 43..82. padded: vLLM's rule pads nothing for gpt-oss (groups of 12): as dynamic.
    r = Accounted(ReplayConfig(trace=str(two_requests(tmp_path)), model="gpt-oss-20b", token_scale=1,
                               decode_arena_bytes=65 * O_PAGE, layout=layout, check_every=1))
    rep = r.run()
    assert check_report(rep) == [] and rep["ok"]
    cap = rep["capacity"]
    assert (cap["max_running"], cap["steps"]) == (max_running, steps)
    assert r.accounted == steps + 1  # the first sample, then one per step
    assert cap["mean_padding_bytes"] == 0 and cap["retractions"] == 0
    if layout == "static:1":
        assert cap["budget_pages"] == {"full": 32, "swa": 32}
        # it waits at steps 1..41 (the first request is freed at the end of step 41, after admission)
        assert cap["admission_waits"] == 41 and cap["wrong_pool_waits"] == cap["admission_waits"]
        # at each of those waits the SWA pool had 32 - 9 = 23 down to 32 - 12 = 20 pages free that the full pool
        # could not use: SGLang frees SWA tokens only once the window moved 128 tokens past the last eviction, so
        # the first request's SWA pages grow from its 9-page tail (tokens 160..299) to cdiv(340, 16) - 10 = 12
        assert 20 * O_PAGE <= cap["mean_wrong_pool_bytes"] <= 23 * O_PAGE
    else:
        assert cap["budget_pages"] == {} and cap["admission_waits"] == 0
    # the same bytes moved and verified in every layout: 2 x (19 full + 9 SWA tail pages)
    assert rep["bytes"]["moved"] == rep["bytes"]["verified"] == 2 * (19 + 9) * O_PAGE


def test_padded_layout_counts_the_padding_layers(tmp_path):
    # Gemma-3-12B + drafter: vLLM's rule adds 2 drafter sliding layers of 1,024 B per token, in the swa end
    # beside the drafter's other sliding layers: 32,768 B per swa page. One request of 40 prompt + 3 output
    # tokens (inside the window) holds 3 swa pages from its admission to its end.
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 40, "output_length": 3}\n')
    r = Accounted(ReplayConfig(trace=str(p), token_scale=1, layout="padded", check_every=1))
    rep = r.run()
    assert rep["ok"] and rep["capacity"]["peak_padding_bytes"] == 3 * 32768
    assert rep["bytes"]["moved_by_vector"]["draft"] == 3 * PS * 4096
    assert rep["bytes"]["moved_by_vector"]["swa_tail"] == 3 * PS * (327680 + 22528 + 2048)


def test_static_split_too_small_for_a_request_is_refused_up_front(tmp_path):
    # 64 pages of 24,576 B x 16 tokens; static:0.2: full_tokens = int(25,165,824 // (24,576 x 1.2)) = 853 -> 848
    # (53 pages), SWA int(848 x 0.2) = 169 -> 160 tokens (10 pages, above SGLang's floor of 128 + 16). Each
    # request's SWA grows from its 9-page tail to 12 pages (no eviction within 40 steps): more than the pool.
    with pytest.raises(UmallocValueError, match=r"static pools of --layout static:0.2.*'swa': 10"):
        Replay(ReplayConfig(trace=str(two_requests(tmp_path)), model="gpt-oss-20b", token_scale=1,
                            decode_arena_bytes=65 * O_PAGE, layout="static:0.2"))


def test_static_pool_below_sglangs_floor_is_refused(tmp_path):
    # static:0.1: full 58 pages -> 928 tokens, SWA int(92.8) = 92 -> 80 tokens <= window 128 + page 16: SGLang's
    # validate_swa_pool_size refuses to start, and so does the replay
    with pytest.raises(UmallocValueError, match=r"SWA pool of 80 tokens .* SGLang refuses to start"):
        Replay(ReplayConfig(trace=str(two_requests(tmp_path)), model="gpt-oss-20b", token_scale=1,
                            decode_arena_bytes=65 * O_PAGE, layout="static:0.1"))


def test_vllm_layout_blocks_by_hand(tmp_path):
    # gpt-oss-20b under vLLM's block pool: 12 + 12 layers, group size 12, block 12 x 16 x 2,048 B = 393,216 B (one
    # page of each end). 64 usable pages -> 64 blocks, one of them the null block. A request of 300 + 40 tokens
    # holds cdiv(n, 16) full blocks and, sliding, cdiv(n, 16) - (n - 128) // 16: 19 + 9 = 28 at admission, at
    # most 22 + 9 = 31. The second admission needs 28 + 28 + ceil(0.5 x (31 - 28)) = 58 <= 63 blocks: both run
    # from step 1, as under dynamic; held at the last step: 2 x 31 blocks.
    rep = Replay(ReplayConfig(trace=str(two_requests(tmp_path)), model="gpt-oss-20b", token_scale=1,
                              decode_arena_bytes=65 * O_PAGE, layout="vllm", check_every=1)).run()
    assert rep["ok"] and check_report(rep) == []
    cap = rep["capacity"]
    assert (cap["max_running"], cap["steps"], cap["admission_waits"]) == (2, 41, 0)
    assert cap["peak_held_bytes"] == 62 * O_PAGE and cap["mean_padding_bytes"] == 0
    assert rep["bytes"]["moved"] == rep["bytes"]["verified"] == 2 * (19 + 9) * O_PAGE
    # 31 usable pages: 31 blocks, 30 free, below one request's peak of 31: refused up front
    with pytest.raises(UmallocValueError, match=r"needs 31 vLLM blocks .* holds 30 \(--layout vllm\)"):
        Replay(ReplayConfig(trace=str(two_requests(tmp_path)), model="gpt-oss-20b", token_scale=1,
                            decode_arena_bytes=32 * O_PAGE, layout="vllm"))


def test_vllm_blocks_hold_the_drafter_window_only():
    # Gemma-3-12B + 1B drafter: 2 full + 10 sliding-1024 groups at 16-token blocks, 1 full + 6 sliding-512 groups
    # at 128-token blocks (the drafter's 16 KiB page grown to the 128 KiB unified page). At 4,096 slots: full
    # 2 x 256, sliding 10 x (256 - 3,072 // 16 = 64), drafter full 1 x 32, drafter sliding 6 x (32 - 3,584 // 128
    # = 4) = 512 + 640 + 32 + 24 = 1,208 blocks of 524,288 B
    v = vllm_blocks(preset_ends("gemma-3-12b-draft", page_size=PS), 1 << 30)
    assert v.held(4096) == 1208
    assert v.peak(4096, 1) == max(v.held(4096), v.held(4097))
