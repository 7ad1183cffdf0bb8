#!/usr/bin/env python3
"""A Mamba hybrid laid out vLLM's way (one block size for every KV-cache group) and umalloc's way (each end its
own page size and page bytes in one arena), on the Mooncake conversation trace (not a timed test).

Model: Nemotron-H-8B-Base-8K (``NemotronHForCausalLM``; config fields as published: 52 layers, pattern
``M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-`` = 24 Mamba2 layers, 4 attention layers, 24 MLP;
attention 32 heads / 8 KV heads x 128 (hidden 4096), bf16; Mamba2 128 heads x 64, state 128, 8 groups, conv
kernel 4). Per layer:

* attention: ``8 * (128 + 128) * 2 = 4096`` bytes per token (vLLM ``FullAttentionSpec``);
* Mamba2 state (vLLM ``MambaStateShapeCalculator.mamba2_state_shape``): conv ``(10240, 3)`` in bf16 (conv_dim =
  128 * 64 + 2 * 8 * 128) plus ssm ``(128, 64, 128)`` in the SSM cache dtype: vLLM's default for NemotronH is
  float32 (4,255,744 bytes), ``--mamba-ssm-cache-dtype bfloat16`` gives 2,158,592 bytes.

(a) **vLLM**: ``Platform._align_hybrid_block_size`` raises the attention block to the smallest multiple of the
kernel alignment (16 tokens, FlashAttention) whose page holds one Mamba state, and pads the Mamba page to it
(:func:`vllm_block_tokens`; tests/integrations/test_integration_vllm.py pins it to vLLM's own spec classes); the hybrid
allocator then groups the layers 4 at a time (1 attention group, 6 Mamba groups), one block = 4 layer pages.
A request holds ``cdiv(L, block)`` attention blocks and one block per Mamba group.
(b) **umalloc**: an ``up`` end with the 4 attention layers at 16-token pages and a ``down`` end whose one page
is one request's state for all 24 Mamba layers (umalloc's geometry has no state-layer kind yet, so each Mamba
layer is written as one page_size-1 layer of the same bytes), in one :class:`~umalloc.ArenaSpec`.

Reported over the first ``--requests`` requests (their full length: input + output tokens): bytes lost to
padding per request; the smallest cacheable prefix and the prefix tokens an infinite prefix cache would hit
(the trace's 512-token chain hashes say what is shared; a cache with block ``B`` hits ``floor(shared / B) * B``);
requests that fit at once in ``--budget-gib`` (trace order, footprints at full length, umalloc's reserved floor
included); descriptors to move one request's KV and state for a PD transfer when its ids are one contiguous run
(vLLM: per layer a K and a V range for attention, one page per Mamba layer; umalloc: one range per contiguous run
of page-major envelopes per end).

Usage::

    python benchmarks/bench_hybrid_pages.py                  # 12,031 requests, 64 GiB, both SSM dtypes
    python benchmarks/bench_hybrid_pages.py --requests 2000 --budget-gib 32
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from umalloc import ArenaSpec, EndSpec, Grow, KVDtype, LayerSpec
from umalloc_replay.trace import load_trace

ATTN_LAYERS, MAMBA_LAYERS, KV_HEADS, HEAD_DIM = 4, 24, 8, 128
MAMBA_HEADS, MAMBA_HEAD_DIM, STATE, GROUPS, CONV_KERNEL = 128, 64, 128, 8, 4
KERNEL_BLOCK_TOKENS = 16          # FlashAttention's smallest kernel block; also vLLM's default block size
GROUP_LAYERS = 4                  # vLLM's hybrid allocator: layers per KV-cache group (the smallest type count)
UMALLOC_PAGE_TOKENS = 16
TRACE_BLOCK_TOKENS = 512          # Mooncake hash block


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def attention_token_bytes() -> int:
    """K + V bytes of one token in one attention layer (bf16)."""
    return KV_HEADS * 2 * HEAD_DIM * 2


def mamba_state_bytes(ssm_itemsize: int) -> int:
    """Bytes of one request's Mamba2 state in one layer: conv ``(conv_dim, kernel - 1)`` bf16 + ssm
    ``(heads, head_dim, state)`` at ``ssm_itemsize``."""
    conv_dim = MAMBA_HEADS * MAMBA_HEAD_DIM + 2 * GROUPS * STATE
    return conv_dim * (CONV_KERNEL - 1) * 2 + MAMBA_HEADS * MAMBA_HEAD_DIM * STATE * ssm_itemsize


def vllm_block_tokens(attn_token_bytes: int, mamba_page_bytes: int, kernel_block_tokens: int = KERNEL_BLOCK_TOKENS,
                      block_size: int = KERNEL_BLOCK_TOKENS) -> int:
    """vLLM's unified block size for an attention + Mamba hybrid (``Platform._align_hybrid_block_size``):
    ``align * cdiv(mamba_page, align * attn_page_1_token)`` with ``align = max(kernel block, block_size)``,
    rounded up to the kernel block, never below ``block_size``."""
    align = max(kernel_block_tokens, block_size)
    tokens = align * cdiv(mamba_page_bytes, align * attn_token_bytes)
    return max(block_size, kernel_block_tokens * cdiv(tokens, kernel_block_tokens))


def _layer_of_bytes(num_bytes: int) -> LayerSpec:
    """An MHA-shaped layer of exactly ``num_bytes`` bytes per token (bf16: heads * (k + v) * 2 = num_bytes)."""
    elems = num_bytes // 2
    heads = next(h for h in (4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1) if elems % h == 0
                 and elems // h <= 2 * (1 << 14))
    per_head = elems // heads
    return LayerSpec.mha(heads, per_head - per_head // 2, per_head // 2, dtype=KVDtype.BF16)


@dataclass(frozen=True)
class Layouts:
    ssm_dtype: str
    block_tokens: int            # vLLM's unified block
    vllm_block_bytes: int        # one block id: GROUP_LAYERS layer pages
    attn_end: EndSpec
    state_end: EndSpec


def layouts(ssm_dtype: str) -> Layouts:
    itemsize = {"float32": 4, "bfloat16": 2}[ssm_dtype]
    state = mamba_state_bytes(itemsize)
    block = vllm_block_tokens(attention_token_bytes(), state)
    attn_end = EndSpec("attn", (LayerSpec.mha(KV_HEADS, HEAD_DIM),) * ATTN_LAYERS, page_size=UMALLOC_PAGE_TOKENS)
    state_end = EndSpec("state", (_layer_of_bytes(state),) * MAMBA_LAYERS, page_size=1, grow=Grow.DOWN)
    if state_end.page_bytes != MAMBA_LAYERS * state:
        raise AssertionError(f"state page {state_end.page_bytes} != {MAMBA_LAYERS} x {state}")
    return Layouts(ssm_dtype, block, GROUP_LAYERS * block * attention_token_bytes(), attn_end, state_end)


def shared_prefix_tokens(hash_ids: list[tuple[int, ...]], lengths: np.ndarray) -> np.ndarray:
    """Per request, the prompt tokens an infinite prefix cache holds from earlier requests (trace order): the
    leading hash blocks seen before, times 512, capped at ``input - 1`` (the last token is always computed)."""
    seen: set[tuple[int, int]] = set()
    out = np.zeros(len(hash_ids), np.int64)
    for i, ids in enumerate(hash_ids):
        k = 0
        while k < len(ids) and (k, ids[k]) in seen:
            k += 1
        out[i] = min(k * TRACE_BLOCK_TOKENS, int(lengths[i]) - 1)
        seen.update((j, h) for j, h in enumerate(ids))
    return out


def fit(footprints: np.ndarray, budget_bytes: int) -> int:
    """Requests, in trace order, whose footprints fit in ``budget_bytes`` together."""
    return int(np.searchsorted(np.cumsum(footprints), budget_bytes, side="right"))


def row(lay: Layouts, total: np.ndarray, prompt: np.ndarray, shared: np.ndarray, budget_bytes: int) -> dict:
    tok_b = ATTN_LAYERS * attention_token_bytes()
    state = mamba_state_bytes({"float32": 4, "bfloat16": 2}[lay.ssm_dtype])
    b = lay.block_tokens
    groups = MAMBA_LAYERS // GROUP_LAYERS
    v_blocks = -(-total // b) + groups
    v_bytes = v_blocks * lay.vllm_block_bytes
    v_pad = (-(-total // b) * b - total) * tok_b + MAMBA_LAYERS * (b * attention_token_bytes() - state)
    spec = ArenaSpec((lay.attn_end, lay.state_end), arena_bytes=budget_bytes // 16 * 16)
    pages = -(-total // UMALLOC_PAGE_TOKENS)
    u_bytes = pages * lay.attn_end.page_bytes + lay.state_end.page_bytes
    u_pad = (pages * UMALLOC_PAGE_TOKENS - total) * tok_b
    hit_v = (shared // b) * b
    hit_u = (shared // UMALLOC_PAGE_TOKENS) * UMALLOC_PAGE_TOKENS
    return {
        "ssm": lay.ssm_dtype, "block": b,
        "pad_v": float(v_pad.mean()), "pad_u": float(u_pad.mean()),
        "bytes_v": float(v_bytes.mean()), "bytes_u": float(u_bytes.mean()),
        "hit_v": int(hit_v.sum()), "hit_u": int(hit_u.sum()), "prompt": int(prompt.sum()),
        "no_hit_v": int(np.count_nonzero((shared > 0) & (hit_v == 0))), "with_shared": int(np.count_nonzero(shared)),
        "fit_v": fit(v_bytes, budget_bytes), "fit_u": fit(u_bytes, budget_bytes - spec.floor_bytes),
        "desc_v": ATTN_LAYERS * 2 + MAMBA_LAYERS, "desc_u": 2,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=None, help="first N requests of the trace (default: all)")
    ap.add_argument("--budget-gib", type=float, default=64.0, help="KV + state bytes for the fit column")
    args = ap.parse_args()
    trace = load_trace(max_requests=args.requests)
    prompt = np.array([r.input_tokens for r in trace], np.int64)
    total = prompt + np.array([r.output_tokens for r in trace], np.int64)
    shared = shared_prefix_tokens([r.hash_ids for r in trace], prompt)
    budget = int(args.budget_gib * 2**30)
    mib = 2**20
    print(f"Nemotron-H-8B (4 attention + 24 Mamba2 layers), Mooncake conversation trace: {len(trace)} requests "
          f"(input + output tokens: median {int(np.median(total))}), budget {args.budget_gib:g} GiB")
    print("| SSM cache dtype | layout | page (tokens) | padding / request | bytes / request | smallest cacheable "
          "prefix | prefix tokens hit | requests with a shared prefix that never hit | requests in budget | "
          "PD descriptors / request |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for dtype in ("float32", "bfloat16"):
        r = row(layouts(dtype), total, prompt, shared, budget)
        print(f"| {dtype} | vLLM (one block size) | {r['block']} | {r['pad_v'] / mib:.2f} MiB | "
              f"{r['bytes_v'] / mib:.1f} MiB | {r['block']} tokens | {r['hit_v'] / r['prompt']:.1%} | "
              f"{r['no_hit_v']} of {r['with_shared']} | {r['fit_v']} | {r['desc_v']} |")
        print(f"| {dtype} | umalloc (page per end) | {UMALLOC_PAGE_TOKENS} / 1 state | {r['pad_u'] / mib:.2f} MiB | "
              f"{r['bytes_u'] / mib:.1f} MiB | {UMALLOC_PAGE_TOKENS} tokens | {r['hit_u'] / r['prompt']:.1%} | "
              f"0 of {r['with_shared']} | {r['fit_u']} ({r['fit_u'] / max(r['fit_v'], 1):.2f}x) | {r['desc_u']} |")


if __name__ == "__main__":
    main()
