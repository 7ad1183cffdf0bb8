"""Geometry and small helpers of the allocator tests: the ends they build arenas of (sizes in each builder's
comment), a token tensor, the physical pages of virtual pages. The arenas and allocators are the fixtures'
(``conftest.py``: ``checked_allocator``, ``full_swa``, ``float3``)."""

from __future__ import annotations

import torch

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.geometry.spec import EndRole, EndSpec, Grow, LayerSpec


def T(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def full_end(ps: int = 2, head_dim: int = 4) -> EndSpec:
    # 1 KV head x head_dim, bf16, K + V: 4 * head_dim bytes per token
    return EndSpec("full", (LayerSpec.mha(1, head_dim),), page_size=ps)


def swa_end(ps: int = 2, head_dim: int = 4, grow: Grow = Grow.DOWN) -> EndSpec:
    return EndSpec("swa", (LayerSpec.mha(1, head_dim, window_tokens=4),), page_size=ps, grow=grow, owner="full",
                   role=EndRole.SWA)


def draft_end(ps: int = 2, head_dim: int = 2, grow: Grow = Grow.FLOAT, owner: str | None = "full") -> EndSpec:
    return EndSpec("draft", (LayerSpec.mha(1, head_dim),), page_size=ps, grow=grow, owner=owner,
                   role=EndRole.DRAFT)


def pages(alloc: MultiEndedAllocator, vps: torch.Tensor, end: str) -> list[int]:
    return alloc.translate_pages(vps, end, strict=False).tolist()
