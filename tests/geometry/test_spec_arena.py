"""Foundation: spec arithmetic, validation errors, presets' bytes per token, arena offsets and views.

Every expected number here is worked out by hand in the test (comments show the arithmetic).
"""

from __future__ import annotations

import pytest
import torch

from umalloc.errors import InvalidIdError, SpecError, UmallocValueError
from umalloc.geometry.arena import Arena
from umalloc.geometry.presets import DEFAULT_PRESET, PRESETS, preset_arena_spec, preset_ends
from umalloc.geometry.region import Region, normalize_regions
from umalloc.geometry.spec import (
    ArenaSpec,
    EndRole,
    EndSpec,
    Grow,
    KVDtype,
    LayerKind,
    LayerSpec,
    arena_bytes_for_limits,
    arena_spec_for_budget,
    swa_pages_per_seq,
)

# ---------------------------------------------------------------------------------------------------------
# A hand-built two-layer, two-end example.
#   full: 2 MHA layers, 1 KV head x head_dim 4, fp16 (2 B), page_size 2
#         K row/token = 1*4*2 = 8 B, V row = 8 B -> 16 B/token/layer -> entry 32 B -> page 64 B
#         in-page offsets: L0 K 0, L0 V 16, L1 K 32, L1 V 48 (each block = 2 tokens x 8 B)
#   swa : 1 MHA layer, 1 KV head x head_dim 2, fp32 (4 B), window 4, page_size 2, grows down
#         K row = 8 B, V row = 8 B -> entry 16 B -> page 32 B
#   arena 512 B, floor = max page = 64 B.
#   full pages: first = ceil(64/64) = 1, top = 512//64 - 1 = 7
#   swa pages : first = ceil(64/32) = 2, top = 512//32 - 1 = 15
# ---------------------------------------------------------------------------------------------------------


def two_end_spec() -> ArenaSpec:
    full = EndSpec("full", (LayerSpec.mha(1, 4, dtype=KVDtype.FP16),) * 2, page_size=2)
    swa = EndSpec("swa", (LayerSpec.mha(1, 2, dtype=KVDtype.FP32, window_tokens=4),), page_size=2,
                  grow=Grow.DOWN, owner="full", role=EndRole.SWA)
    return ArenaSpec((full, swa), arena_bytes=512)


def test_hand_built_geometry():
    spec = two_end_spec()
    full, swa = spec.end("full"), spec.end("swa")
    assert (full.entry_bytes, full.page_bytes) == (32, 64)
    assert (swa.entry_bytes, swa.page_bytes) == (16, 32)
    assert full.layer_offsets_bytes == ((0, 16), (32, 48))
    assert swa.layer_offsets_bytes == ((0, 16),)
    assert spec.floor_bytes == 64
    assert (spec.first_page("full"), spec.top_page("full")) == (1, 7)
    assert (spec.first_page("swa"), spec.top_page("swa")) == (2, 15)
    assert swa.window_tokens == 4 and full.window_tokens is None
    assert spec.owner_of("swa") == "full" and spec.owner_of("full") == "full"


def test_arena_offsets_and_addresses():
    arena = Arena(two_end_spec())
    assert arena.data.dtype == torch.uint8 and arena.data.numel() == 512
    assert arena.page_offset_bytes("full", 3) == 192  # 3 * 64
    assert arena.page_offset_bytes("swa", 15) == 480  # 15 * 32
    assert arena.page_address("full", 5) == arena.base_ptr + 320
    with pytest.raises(InvalidIdError):
        arena.page_offset_bytes("full", 8)
    with pytest.raises(InvalidIdError):
        arena.page_offset_bytes("swa", -1)
    env = arena.envelopes("full")
    assert env.shape == (8, 64) and env.data_ptr() == arena.base_ptr


def test_write_through_view_lands_at_page_offset():
    arena = Arena(two_end_spec())
    k1, v1 = arena.kv_views("full", 1)
    assert k1.shape == (8, 2, 1, 4) and k1.dtype == torch.float16
    # page 3, token 1, head 0, element 2 of layer 1's V block:
    # byte = 3*64 (page) + 48 (L1 V) + 1*8 (token row) + 2*2 (element) = 252
    v1[3, 1, 0, 2] = 1.5
    raw = arena.data[252:254].clone().view(torch.float16)
    assert raw.item() == 1.5
    # nothing else changed: fp16 1.5 = 0x3E00, little-endian -> byte 252 = 0x00, byte 253 = 0x3E
    assert arena.data.nonzero().flatten().tolist() == [253] and int(arena.data[253]) == 0x3E
    # swa page 14, token 0, K element 1: byte = 14*32 + 0 + 0 + 1*4 = 452
    ks, vs = arena.kv_views("swa", 0)
    assert ks.shape == (16, 2, 1, 2) and ks.dtype == torch.float32
    ks[14, 0, 0, 1] = -2.0
    assert arena.data[452:456].clone().view(torch.float32).item() == -2.0
    # the envelope of full page 3 sees the V write
    assert arena.envelope("full", 3)[60:62].clone().view(torch.float16).item() == 1.5


def test_mla_view_has_no_v():
    # latent 6 + 2 = 8 elements bf16 = 16 B/token/layer, 3 layers, page_size 4 -> 4 x 48 = 192 B pages
    end = EndSpec("full", (LayerSpec.mla(6, 2),) * 3, page_size=4)
    arena = Arena(ArenaSpec((end,), arena_bytes=192 * 6))
    k, v = arena.kv_views("full", 2)
    assert v is None and k.shape == (6, 4, 1, 8)
    k[5, 3, 0, 7] = 3.0
    # byte = 5*192 + layer 2 offset (2 * 4 tokens * 16 B = 128) + 3*16 + 7*2 = 960 + 128 + 48 + 14 = 1150
    assert arena.data[1150:1152].clone().view(torch.bfloat16).item() == 3.0


def test_copy_pages_moves_whole_envelopes_overlapping():
    arena = Arena(two_end_spec())
    env = arena.envelopes("full")
    for p in range(8):
        env[p].fill_(p)
    # rotate pages 1 -> 2 -> 3 -> 1 in one batch: sources read before destinations written
    arena.copy_pages("full", torch.tensor([2, 3, 1]), torch.tensor([1, 2, 3]))
    assert [int(env[p, 0]) for p in range(8)] == [0, 3, 1, 2, 4, 5, 6, 7]
    with pytest.raises(UmallocValueError):
        arena.copy_pages("full", torch.tensor([1, 2]), torch.tensor([1]))


@pytest.mark.parametrize("device", ["meta", torch.device("meta"), "mps", "xla", "bogus:0", 3, None])
def test_arena_refuses_devices_other_than_cpu_and_cuda(device):
    with pytest.raises(UmallocValueError, match="allowed 'cpu', 'cuda' or 'cuda:N'"):
        Arena(two_end_spec(), device=device)


def test_copy_pages_validates_before_moving_any_byte():
    """Floats, the sink, out-of-range ids, repeated destinations, meta/sparse ids, an unknown end: typed errors
    naming the allowed range [first_page, top_page] = [1, 7] of 'full', and not one byte moved."""
    import numpy as np

    arena = Arena(two_end_spec())
    env = arena.envelopes("full")
    for p in range(8):
        env[p].fill_(p)
    before = arena.data.clone()
    cases = [
        (torch.tensor([2.0]), torch.tensor([1]), InvalidIdError, "dtype"),
        (torch.tensor([2]), torch.tensor([1.5]), InvalidIdError, "dtype"),
        (np.array([2.0]), np.array([1]), InvalidIdError, "dtype"),
        (torch.tensor([True]), torch.tensor([1]), InvalidIdError, "dtype"),
        (torch.tensor([0]), torch.tensor([1]), InvalidIdError, r"dst_pages\[0\] = 0 .* allowed \[1, 7\]"),
        (torch.tensor([2]), torch.tensor([0]), InvalidIdError, r"src_pages\[0\] = 0 .* allowed \[1, 7\]"),
        (torch.tensor([2, 8]), torch.tensor([1, 3]), InvalidIdError, r"dst_pages\[1\] = 8 .* allowed \[1, 7\]"),
        (torch.tensor([2, 3]), torch.tensor([-1, 3]), InvalidIdError, r"allowed \[1, 7\]"),
        (torch.tensor([4, 2, 4]), torch.tensor([1, 3, 5]), InvalidIdError, "page 4 .* more than once"),
        (torch.zeros(1, dtype=torch.int64, device="meta"), torch.tensor([1]), InvalidIdError, "dense"),
        (torch.tensor([2]).to_sparse(), torch.tensor([1]), InvalidIdError, "dense"),
        ([2], torch.tensor([1]), InvalidIdError, "tensor or numpy"),
        (torch.tensor([[2]]), torch.tensor([[1]]), UmallocValueError, "1-D"),
    ]
    for dst, src, err, match in cases:
        with pytest.raises(err, match=match):
            arena.copy_pages("full", dst, src)
        assert torch.equal(arena.data, before)
    with pytest.raises(SpecError):
        arena.copy_pages("nope", torch.tensor([2]), torch.tensor([1]))
    # the bounds named are allowed: page 1 and page 7 both move; int32 and numpy ids work like int64
    arena.copy_pages("full", torch.tensor([1, 7], dtype=torch.int32), np.array([7, 1]))
    assert [int(env[p, 0]) for p in range(8)] == [0, 7, 2, 3, 4, 5, 6, 1]


def test_region_is_whole_arena():
    arena = Arena(two_end_spec())
    r = arena.region()
    assert (r.base_ptr, r.nbytes, r.device, r.mem_kind) == (arena.base_ptr, 512, "cpu", "DRAM")
    m = arena.region_member("swa")
    assert m.address(3) == arena.base_ptr + 96


# ---------------------------------------------------------------------------------------------------------
# presets: bytes per token by hand from each model's published config
# ---------------------------------------------------------------------------------------------------------
KIB = 1024


@pytest.mark.parametrize(
    "preset, expected",
    [
        # Llama-3.1-8B: 32 layers x 8 heads x (128+128) x 2 B = 32 x 4096 = 128 KiB
        ("llama-3.1-8b", {"full": 128 * KIB}),
        # Qwen3-8B: 36 x 4096 = 144 KiB
        ("qwen3-8b", {"full": 144 * KIB}),
        # + Qwen3-0.6B drafter: 28 x 4096 = 112 KiB
        ("qwen3-8b-draft", {"full": 144 * KIB, "draft": 112 * KIB}),
        # Gemma-3-12B: 8 global x 8 x (256+256) x 2 = 8 x 8 KiB = 64 KiB; 40 local x 8 KiB = 320 KiB
        ("gemma-3-12b", {"full": 64 * KIB, "swa": 320 * KIB}),
        # + Gemma-3-1B drafter: 26 layers x 1 head x 512 x 2 B = 1 KiB each: its 22 local layers join swa
        # (320 + 22 KiB), its 4 global layers stay in draft (4 KiB)
        ("gemma-3-12b-draft", {"full": 64 * KIB, "swa": 342 * KIB, "draft": 4 * KIB}),
        # gpt-oss-20b: 12 full x 8 x (64+64) x 2 = 12 x 2 KiB = 24 KiB, same for 12 sliding
        ("gpt-oss-20b", {"full": 24 * KIB, "swa": 24 * KIB}),
        # DeepSeek-V3: 61 x (512+64) x 2 = 61 x 1152 = 70272 B; MTP layer 1152 B
        ("deepseek-v3", {"full": 70272, "draft": 1152}),
        # Llama-3-8B + EAGLE head: 1 layer x 8 x 256 x 2 (fp16) = 4 KiB
        ("llama-3-8b-eagle", {"full": 128 * KIB, "draft": 4 * KIB}),
    ],
)
def test_preset_bytes_per_token(preset, expected):
    ends = {e.name: e for e in preset_ends(preset)}
    assert {k: e.entry_bytes for k, e in ends.items()} == expected
    assert all(e.page_bytes == 16 * e.entry_bytes for e in ends.values())


def test_preset_structure():
    ends = {e.name: e for e in preset_ends("gemma-3-12b-draft")}
    assert ends["full"].grow is Grow.UP and ends["full"].is_owner
    # the drafter's 22 local layers (window 512) join the target's 40 (window 1024): held for the larger window
    assert ends["swa"].grow is Grow.FLOAT and ends["swa"].owner == "full" and ends["swa"].window_tokens == 1024
    assert sorted({x.window_tokens for x in ends["swa"].layers}) == [512, 1024] and len(ends["swa"].layers) == 62
    assert ends["draft"].grow is Grow.DOWN and ends["draft"].owner == "full"
    assert ends["draft"].window_tokens is None and not any(x.is_sliding for x in ends["draft"].layers)
    assert len(ends["draft"].layers) == 4
    # the drafter's own end for its sliding layers, at its own window
    own = {e.name: e for e in preset_ends("gemma-3-12b-draft", draft_sliding="own")}
    assert (own["draft_swa"].window_tokens, own["draft_swa"].owner, len(own["draft_swa"].layers)) == (512, "full", 22)
    assert own["draft_swa"].role is EndRole.SWA and own["swa"].window_tokens == 1024
    # the whole drafter in one end: Gemma-3-1B mixes 4 global + 22 local layers -> the draft keeps every token
    old = {e.name: e for e in preset_ends("gemma-3-12b-draft", draft_sliding="draft")}
    assert old["swa"].grow is Grow.DOWN and old["draft"].grow is Grow.FLOAT
    assert old["draft"].window_tokens is None
    assert sum(1 for x in old["draft"].layers if x.is_sliding) == 22
    with pytest.raises(SpecError, match="draft_sliding"):
        preset_ends("gemma-3-12b-draft", draft_sliding="target")
    # gpt-oss: even layers slide with window 128
    oss = {e.name: e for e in preset_ends("gpt-oss-20b")}
    assert oss["swa"].window_tokens == 128 and len(oss["swa"].layers) == 12
    # DeepSeek: MLA, no separate V
    assert all(x.kind is LayerKind.MLA and x.v_token_bytes == 0 for x in preset_ends("deepseek-v3")[0].layers)
    # a draft page size differing from the target's makes the draft its own id owner
    d = {e.name: e for e in preset_ends("qwen3-8b-draft", draft_page_size=32)}
    assert d["draft"].owner is None and d["draft"].page_size == 32
    assert DEFAULT_PRESET in PRESETS
    spec = preset_arena_spec("gpt-oss-20b", arena_bytes=64 << 20, page_size=16)
    assert spec.floor_bytes == 16 * 24 * KIB


# ---------------------------------------------------------------------------------------------------------
# validation errors: each names the field
# ---------------------------------------------------------------------------------------------------------
def _full(**kw):
    base = dict(name="full", layers=(LayerSpec.mha(1, 4),), page_size=2)
    base.update(kw)
    return EndSpec(**base)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: LayerSpec.mha(0, 4), "num_kv_heads"),
        (lambda: LayerSpec.mha(1, 0), "head_dim_k"),
        (lambda: LayerSpec.mha(1, 4, window_tokens=0), "window_tokens"),
        (lambda: LayerSpec(LayerKind.MLA, 1, 0, 0, 0), "latent_dim"),
        (lambda: LayerSpec(LayerKind.MLA, 2, 0, 0, 8), "num_kv_heads"),
        (lambda: LayerSpec(LayerKind.MHA, 1, 4, 4, 8), "latent_dim"),
        (lambda: LayerSpec(LayerKind.MHA, 1, 4, 4, dtype="bf16"), "dtype"),
        (lambda: _full(page_size=0), "full.page_size"),
        (lambda: _full(layers=()), "full.layers"),
        (lambda: _full(name=""), "name"),
        (lambda: _full(owner="full"), "full.owner"),
        (lambda: _full(role=EndRole.SWA), "full.layers"),
        (lambda: _full(grow="up"), "full.grow"),
        (lambda: ArenaSpec((), arena_bytes=64), "ends"),
        (lambda: ArenaSpec((_full(), _full()), arena_bytes=256), "ends[1].name"),
        (lambda: ArenaSpec((_full(), _full(name="b")), arena_bytes=256), "ends[*].grow=up"),
        (lambda: ArenaSpec((_full(), _full(name="b", grow=Grow.DOWN, owner="zz")), arena_bytes=256),
         "ends[1].owner"),
        (lambda: ArenaSpec((_full(), _full(name="b", grow=Grow.DOWN, owner="full", page_size=4)),
                           arena_bytes=256), "ends[1].page_size"),
        (lambda: ArenaSpec((_full(owner=None), _full(name="b", grow=Grow.DOWN, owner="full"),
                            _full(name="c", grow=Grow.FLOAT, owner="b")), arena_bytes=256), "ends[2].owner"),
        (lambda: ArenaSpec((_full(),), arena_bytes=40), "arena_bytes"),  # floor 32 + one page 32 > 40
        (lambda: ArenaSpec((_full(),), arena_bytes=100), "arena_bytes"),  # not 16-aligned
        (lambda: ArenaSpec((_full(),), arena_bytes=256, floor_bytes=16), "floor_bytes"),  # < page 32 B
    ],
)
def test_spec_errors_name_the_field(make, field):
    with pytest.raises(SpecError) as exc:
        make()
    assert exc.value.field == field
    assert isinstance(exc.value, ValueError)
    assert "allowed" in str(exc.value)


def test_unknown_end_and_preset():
    with pytest.raises(SpecError):
        two_end_spec().end("nope")
    with pytest.raises(SpecError):
        preset_ends("no-such-model")


def test_fp8_alignment_rule():
    # fp8 (1 B) layer of 3 heads x 1 dim, page_size 1 -> 3 B K block, then a bf16 layer at odd offset 6? K 3 + V 3
    # = 6 B: even, fine. With head_dim 1, kv 1: K=1 B, V=1 B -> offset 2 for the bf16 layer: aligned.
    ok = EndSpec("e", (LayerSpec.mha(3, 1, dtype=KVDtype.FP8_E4M3), LayerSpec.mha(1, 2)), page_size=1)
    assert ok.layer_offsets_bytes == ((0, 3), (6, 10))
    with pytest.raises(SpecError):
        # K block 1 B then V block 1 B... an fp8 layer of 1 head x 1 dim with page_size 1 has 2 B, then an
        # fp32 layer at offset 2 is misaligned for 4-byte elements
        EndSpec("e", (LayerSpec.mha(1, 1, dtype=KVDtype.FP8_E4M3), LayerSpec.mha(1, 1, dtype=KVDtype.FP32)),
                page_size=1)


# ---------------------------------------------------------------------------------------------------------
# sizing helpers
# ---------------------------------------------------------------------------------------------------------
def test_sizing_from_runtime_limits():
    full = _full()  # 16 B/token, page 32 B
    swa = EndSpec("swa", (LayerSpec.mha(1, 2, window_tokens=4),), page_size=2, grow=Grow.DOWN, owner="full",
                  role=EndRole.SWA)  # 8 B/token, page 16 B
    # swa pages/seq: cdiv(4 - 1 + 1, 2) + 1 = 3
    assert swa_pages_per_seq(4, 2) == 3
    # max_seq_len 10, batch 3: full 5 pages x 3 x 32 = 480; swa min(5, 3) = 3 x 3 x 16 = 144; floor 32
    assert arena_bytes_for_limits([full, swa], max_seq_len_tokens=10, max_batch=3) == 32 + 480 + 144
    spec = arena_spec_for_budget([full, swa], 1000)
    assert spec.arena_bytes == 992
    with pytest.raises(SpecError):
        arena_spec_for_budget([full, swa], 50)


# ---------------------------------------------------------------------------------------------------------
# region normalisation (F21 building block)
# ---------------------------------------------------------------------------------------------------------
def test_normalize_regions():
    regs = [Region(100, 50), Region(100, 50), Region(120, 100), Region(400, 10), Region(100, 50, "cuda:0", "VRAM")]
    out = normalize_regions(regs)
    got = [(r.region.base_ptr, r.region.nbytes, r.region.device, r.refcount) for r in out]
    # cpu: 100..150 twice + 120..220 merge into 100..220 (refcount 3); 400..410 alone; cuda kept apart
    assert got == [(100, 120, "cpu", 3), (400, 10, "cpu", 1), (100, 50, "cuda:0", 1)]
    with pytest.raises(UmallocValueError):
        Region(0, 0)
    with pytest.raises(UmallocValueError):
        Region((1 << 64) - 8, 16)  # would end past the 64-bit address space
    with pytest.raises(UmallocValueError):
        Region.from_dict({"base_ptr": 1000.7, "nbytes": 16, "device": "cpu", "mem_kind": "DRAM"})
    assert Region.from_dict(Region(1000, 16).to_dict()) == Region(1000, 16)


def test_head_group_outer_views_alias_the_bytes_computed_by_hand():
    # 2 head groups; layer 0: 4 heads x 2 dims, layer 1: 2 heads x 2 dims, bf16, page_size 3.
    # Per group: L0 K 3 rows x (2 heads x 2 x 2 B = 8 B) = 24 B, L0 V 24 B, L1 K 3 x 4 B = 12 B, L1 V 12 B = 72 B;
    # page = 2 x 72 = 144 B.
    end = EndSpec("full", (LayerSpec.mha(4, 2), LayerSpec.mha(2, 2)), page_size=3, head_groups=2)
    assert end.page_bytes == 144
    arena = Arena(ArenaSpec((end,), arena_bytes=144 * 8))
    arena.data.view(torch.int16).copy_(torch.arange(arena.spec.arena_bytes // 2, dtype=torch.int16))
    block_off = {(0, 0): 0, (0, 1): 24, (1, 0): 48, (1, 1): 60}  # (layer, K=0 / V=1) -> bytes in a group
    row_bytes = {0: 8, 1: 4}
    for layer in (0, 1):
        views = arena.kv_group_views("full", layer)
        hpg = (2, 1)[layer]
        for kv, view in enumerate(views):
            assert view.shape == (8, 2, 3, hpg, 2)
            for p in (1, 5):
                for g in range(2):
                    for t in range(3):
                        for j in range(hpg):
                            for e in range(2):
                                off = p * 144 + g * 72 + block_off[(layer, kv)] + t * row_bytes[layer] + j * 4 + e * 2
                                assert int(view[p, g, t, j, e].view(torch.int16)) == off // 2
    with pytest.raises(UmallocValueError, match="kv_group_views"):
        arena.kv_views("full", 0)
    flat = Arena(ArenaSpec((EndSpec("full", (LayerSpec.mha(4, 2),), page_size=3),), arena_bytes=4096))
    k4, _ = flat.kv_views("full", 0)
    k5, _ = flat.kv_group_views("full", 0)
    assert k5.shape[1] == 1 and k4.stride() == k5[:, 0].stride() and k4.data_ptr() == k5.data_ptr()


def test_head_groups_must_divide_every_layers_heads():
    with pytest.raises(SpecError, match="head_groups"):
        EndSpec("full", (LayerSpec.mha(4, 2), LayerSpec.mha(3, 2)), page_size=2, head_groups=2)
    with pytest.raises(SpecError, match="head_groups"):
        EndSpec("full", (LayerSpec.mla(8, 4),), page_size=2, head_groups=2)
    with pytest.raises(SpecError, match="head_groups"):
        EndSpec("full", (LayerSpec.mha(4, 2),), page_size=2, head_groups=0)
