"""Shared helpers of the backend tests (``test_backends.py``, ``test_fault_matrix.py``, ``test_backend_batches.py``):
the small KV arenas both sides use, the independent byte models the tests compare with, and the worker look-up.

The backend and worker fixtures live in this folder's ``conftest.py``. Every engine runs for real over loopback;
every wait is bounded by ``DEADLINE_S``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.backends import BACKEND_NAMES
from umalloc.backends.worker import BackendWorker
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, LayerSpec
from umalloc.testing import require_or_skip, seed_from_env
from umalloc.transfer import PeerLayout

ENGINES = ["nixl", "mooncake"]
DEADLINE_S = 60.0  # a hang guard only: no test asserts that anything ends before it
SEED = seed_from_env(20240607)
W = "kv_worker:"
L_TOKENS = 21  # request length used by the plan tests


def backend_param(name: str):
    """``name`` as a pytest parameter: marked ``backend`` (a real transfer engine) unless it is ``local``."""
    return pytest.param(name, marks=[pytest.mark.backend] if name != "local" else [], id=name)


BACKEND_PARAMS = [backend_param(n) for n in BACKEND_NAMES]   # every backend
ENGINE_PARAMS = [backend_param(n) for n in ENGINES]          # the real transfer engines


# ==== byte models ===============================================================================================


def seeded_bytes(nbytes: int, seed: int) -> torch.Tensor:
    """Independent re-creation of the worker's pattern: torch.randint over a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def brute_apply(dst_before: bytes, dst_base: int, src: bytes, src_base: int, descs: np.ndarray) -> bytes:
    """The destination after applying each descriptor, one by one, in plain Python."""
    out = bytearray(dst_before)
    for s, d, n in descs.tolist():
        out[d - dst_base: d - dst_base + n] = src[s - src_base: s - src_base + n]
    return bytes(out)


def tbytes(t: torch.Tensor) -> bytes:
    return bytes(t.numpy().tobytes())



# ==== KV sides ==================================================================================================


def kv_spec(full_page_size: int = 4) -> ArenaSpec:
    """target (full, up) + SWA (window 8, down, bound to full) + draft (own page size 2, own id owner)."""
    full = EndSpec("full", (LayerSpec.mha(1, 8),), page_size=full_page_size)  # 32 B/token
    swa = EndSpec("swa", (LayerSpec.mha(1, 4, window_tokens=8),), page_size=full_page_size, grow=Grow.DOWN,
                  owner="full", role=EndRole.SWA)  # 16 B/token
    draft = EndSpec("draft", (LayerSpec.mha(1, 4),), page_size=2, grow=Grow.FLOAT, owner=None,
                    role=EndRole.DRAFT)  # 16 B/token, 32 B pages
    return ArenaSpec((full, swa, draft), arena_bytes=16384)


def kv_side(spec: ArenaSpec, seed: int | None,
            clock: Callable[[], float] | None = None) -> tuple[Arena, MultiEndedAllocator]:
    """An arena of ``spec`` filled with :func:`seeded_bytes` (``seed``; zeros for ``None``) and its allocator
    (lease clock ``clock``, default monotonic)."""
    arena = Arena(spec)
    if seed is not None:
        arena.data.copy_(seeded_bytes(spec.arena_bytes, seed))
    return arena, MultiEndedAllocator(arena, clock=clock or time.monotonic)


def alloc_request(alloc: MultiEndedAllocator, tokens: int) -> dict[str, torch.Tensor]:
    one = lambda x: torch.tensor([x], dtype=torch.int64)  # noqa: E731
    return {owner: alloc.alloc_extend(one(0), one(tokens), one(-1), owner=owner) for owner in ("full", "draft")}


def kv_pair(make, name: str, dst_regions=None, clock: Callable[[], float] | None = None):
    """Two seeded KV sides of :func:`kv_spec` with a backend each (``make`` is ``backend_factory``), layouts set,
    arenas registered (the receiver registers ``dst_regions(dst_arena)`` instead when given); both allocators
    use the lease clock ``clock``.

    Returns:
        ``(src_arena, src_alloc, a, dst_arena, dst_alloc, b)``.
    """
    spec = kv_spec()
    src_arena, src_alloc = kv_side(spec, SEED, clock)
    dst_arena, dst_alloc = kv_side(spec, SEED + 1, clock)
    a = make(name, layout=PeerLayout.from_arena(src_arena))
    b = make(name, layout=PeerLayout.from_arena(dst_arena))
    a.register(src_arena.regions())
    b.register(dst_arena.regions() if dst_regions is None else dst_regions(dst_arena))
    return src_arena, src_alloc, a, dst_arena, dst_alloc, b


def sender_to_worker(backend_workers, make, name: str, *, role: str = "shared", reset: bool = True,
                     spec: ArenaSpec | None = None, clock: Callable[[], float] | None = None, **backend_kw):
    """A seeded sender here (:func:`kv_side` of ``spec``, default :func:`kv_spec`; backend ``make(name,
    **backend_kw)``) connected to a receiver KV side (``kv_setup``, seed ``SEED + 1``) in the ``role`` worker,
    whose backend is reset first when ``reset``. The connection is fresh: NIXL's first WRITE of a connection
    needs the target.

    Returns:
        ``(w, src_arena, src_alloc, a, peer)``.
    """
    w = worker(backend_workers, name, role)
    if reset:
        w.call("reset_backend")
    src_arena, src_alloc = kv_side(spec or kv_spec(), SEED, clock)
    layout = PeerLayout.from_arena(src_arena)
    a = make(name, layout=layout, **backend_kw)
    a.register(src_arena.regions())
    w.run(W + "kv_setup", layout.to_dict(), seed=SEED + 1)
    peer = a.connect(w.call("metadata"))
    return w, src_arena, src_alloc, a, peer


def worker(backend_workers, name: str, role: str = "shared") -> BackendWorker:
    require_or_skip(name)
    w = backend_workers[(name, role)]
    w.wait_ready(60.0)
    return w
