"""Fixtures of the allocator tests (on the root ``make_allocator``): allocators with every invariant checked
after each call, and the two geometries most tests use."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from allocator_helpers import draft_end, full_end, swa_end

from umalloc.allocator.facade import MultiEndedAllocator


@pytest.fixture
def checked_allocator(make_allocator: Callable[..., MultiEndedAllocator]) -> Callable[..., MultiEndedAllocator]:
    """``checked_allocator(ends, arena_bytes, **allocator_kwargs)``: :func:`make_allocator` with
    ``debug_checks=True`` unless the caller says otherwise."""
    def make(ends: tuple, arena_bytes: int, **kw: object) -> MultiEndedAllocator:
        kw.setdefault("debug_checks", True)
        return make_allocator(ends, arena_bytes, **kw)

    return make


@pytest.fixture
def full_swa(checked_allocator: Callable[..., MultiEndedAllocator]) -> Callable[..., MultiEndedAllocator]:
    """``full_swa(**allocator_kwargs)``: full (up, owner) + swa (down, bound), page_size 2, 32 B pages each; 320 B
    arena: floor 32 B, pages 1..9."""
    return lambda **kw: checked_allocator((full_end(), swa_end()), 320, **kw)


@pytest.fixture
def float3(checked_allocator: Callable[..., MultiEndedAllocator]) -> Callable[..., MultiEndedAllocator]:
    """``float3(**allocator_kwargs)``: full (up, 32 B pages, slots 0..19) / draft (float, 16 B pages, first 2,
    slots 0..39) / swa (down, 32 B pages, slots 0..19); 640 B arena, floor 32 B; all bound to full."""
    return lambda **kw: checked_allocator((full_end(), draft_end(), swa_end()), 640, **kw)
