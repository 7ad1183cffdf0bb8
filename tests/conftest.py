"""Shared by every test folder. pytest (rootdir-relative "prepend" imports, no ``__init__.py`` files) puts the
folder of each conftest.py on ``sys.path``, so the helper modules in this folder (``compaction_helpers``) import
by name from any sub-folder, and a test folder's own helpers (``backends/backend_helpers.py``) from its tests.
The fixtures below make the arenas, allocators and request tables of every folder's tests."""

from collections.abc import Callable

import pytest
import torch
from compaction_helpers import three_ends, two_ends

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, KVDtype, LayerSpec
from umalloc.requests.table import RequestTable

# ``--doctest-modules`` would import every conftest.py a second time as a module named ``conftest``, which two
# folders cannot share; conftest files hold fixtures, not doctests.
collect_ignore_glob = ["conftest.py", "*/conftest.py"]

# ==== the fixture layer: arenas, allocators and request tables, made per test =================================
# Each fixture is a factory (a test often needs two arenas, or one per parameter); what it makes lives as long
# as the test holds it. The backends' fixtures (backends made per test, worker processes) are in
# backends/conftest.py, next to the helpers they use.


def _spec(ends: ArenaSpec | tuple[EndSpec, ...], arena_bytes: int | None) -> ArenaSpec:
    if isinstance(ends, ArenaSpec):
        assert arena_bytes is None, "an ArenaSpec carries its own arena_bytes"
        return ends
    assert arena_bytes is not None, "ends need arena_bytes"
    return ArenaSpec(tuple(ends), arena_bytes=arena_bytes)


@pytest.fixture
def make_arena() -> Callable[..., Arena]:
    """``make_arena(ends_or_spec, arena_bytes=None, *, device="cpu", fill_seed=None) -> Arena``: an arena of an
    :class:`ArenaSpec`, or of a tuple of :class:`EndSpec` and ``arena_bytes``; ``fill_seed`` fills its bytes
    with seeded random bytes (``torch.Generator().manual_seed(fill_seed)``), else they are the arena's zeros."""
    def make(ends: ArenaSpec | tuple[EndSpec, ...], arena_bytes: int | None = None, *, device: object = "cpu",
             fill_seed: int | None = None) -> Arena:
        arena = Arena(_spec(ends, arena_bytes), device=device)
        if fill_seed is not None:
            g = torch.Generator().manual_seed(fill_seed)
            arena.data.copy_(torch.randint(0, 256, arena.data.shape, dtype=torch.uint8, generator=g))
        return arena

    return make


@pytest.fixture
def make_allocator(make_arena: Callable[..., Arena]) -> Callable[..., MultiEndedAllocator]:
    """``make_allocator(ends_or_spec, arena_bytes=None, *, device="cpu", fill_seed=None, **allocator_kwargs)``:
    a :class:`MultiEndedAllocator` on a fresh :func:`make_arena` arena (``allocator_kwargs``: ``compaction``,
    ``debug_checks``, ``clock``, ...)."""
    def make(ends: ArenaSpec | tuple[EndSpec, ...], arena_bytes: int | None = None, *, device: object = "cpu",
             fill_seed: int | None = None, **kw: object) -> MultiEndedAllocator:
        return MultiEndedAllocator(make_arena(ends, arena_bytes, device=device, fill_seed=fill_seed), **kw)

    return make


@pytest.fixture
def kv_allocator(make_allocator: Callable[..., MultiEndedAllocator]) -> Callable[..., MultiEndedAllocator]:
    """``kv_allocator(page_size, pages, window=None, *, dtype=KVDtype.BF16, **allocator_kwargs)``: the request
    tables' geometry. One ``full`` end (one layer, one KV head of dimension 4, ``up``, the id owner) and an arena
    of ``pages + 1`` of its pages (the floor included); with ``window`` an ``swa`` end too (the same layer shape
    with that window, ``down``, bound to ``full``), sharing those bytes."""
    def make(page_size: int, pages: int, window: int | None = None, *, dtype: KVDtype = KVDtype.BF16,
             **kw: object) -> MultiEndedAllocator:
        full = EndSpec("full", (LayerSpec.mha(1, 4, dtype=dtype),), page_size=page_size)
        ends: tuple[EndSpec, ...] = (full,)
        if window is not None:
            ends = (full, EndSpec("swa", (LayerSpec.mha(1, 4, dtype=dtype, window_tokens=window),),
                                  page_size=page_size, grow=Grow.DOWN, owner="full", role=EndRole.SWA))
        return make_allocator(ends, full.page_bytes * (pages + 1), **kw)

    return make


@pytest.fixture
def make_table(make_allocator: Callable[..., MultiEndedAllocator]) -> Callable[..., RequestTable]:
    """``make_table(ends_or_spec, arena_bytes=None, *, max_requests=4, max_tokens_per_request=32,
    **table_kwargs) -> RequestTable``: a request table over a fresh :func:`make_allocator` allocator (reach it
    as ``table.alloc``)."""
    def make(ends: ArenaSpec | tuple[EndSpec, ...], arena_bytes: int | None = None, *, max_requests: int = 4,
             max_tokens_per_request: int = 32, **kw: object) -> RequestTable:
        return RequestTable(make_allocator(ends, arena_bytes), max_requests=max_requests,
                            max_tokens_per_request=max_tokens_per_request, **kw)

    return make


@pytest.fixture
def two_end_allocator(make_allocator: Callable[..., MultiEndedAllocator]) -> Callable[..., MultiEndedAllocator]:
    """``two_end_allocator(arena_bytes=32 * 12, **allocator_kwargs)``: an allocator of
    ``compaction_helpers.two_ends()`` (full up / swa down)."""
    return lambda arena_bytes=32 * 12, **kw: make_allocator(two_ends(), arena_bytes, **kw)


@pytest.fixture
def three_end_allocator(make_allocator: Callable[..., MultiEndedAllocator]) -> Callable[..., MultiEndedAllocator]:
    """``three_end_allocator(arena_bytes=32 * 24, **allocator_kwargs)``: an allocator of
    ``compaction_helpers.three_ends()`` (full up / draft float / swa down)."""
    return lambda arena_bytes=32 * 24, **kw: make_allocator(three_ends(), arena_bytes, **kw)
