"""Shared set-up of the backend tests (``test_backends.py``, ``test_fault_matrix.py``): the backend and worker
fixtures, the small KV arenas both sides use, and the independent byte models the tests compare with.

A test module imports the fixtures by name (``from backend_fixtures import backend_factory, ...``); the
module-scoped ones (``backend_pool``, ``backend_workers``) then live once per importing module. Every engine
runs for real over loopback; every wait is bounded by ``DEADLINE_S``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from umalloc.backends import backend_available, get_backend
from umalloc.backends.worker import BackendWorker
from umalloc.core.allocator import MultiEndedAllocator
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, LayerSpec
from umalloc.testing import require_or_skip
from umalloc.transfer import PeerLayout

ENGINES = ["nixl", "mooncake"]
DEADLINE_S = 10.0
SEED = int(os.environ.get("UMALLOC_SEED", "20240607"))
W = "kv_worker:"
L_TOKENS = 21  # request length used by the plan tests


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


class ManualClock:
    """A settable lease clock in seconds (no sleeps)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


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


# ==== backends and workers ======================================================================================


@pytest.fixture(scope="module")
def backend_pool():
    """Idle Mooncake backends, reused across tests: a Mooncake engine takes about 1 s (holding the GIL) to stop,
    so a test's Mooncake backends are ``reset()`` (every handle, peer, registration, layout and counter dropped,
    a new peer id: the state of a new backend) and handed to the next test. All are closed at module end."""
    idle: dict[tuple, list] = {}
    yield idle
    for lst in idle.values():
        for b in lst:
            b.close()


@pytest.fixture
def backend_factory(backend_pool):
    """Create backends for one test; afterwards close (or reset and pool) them and check nothing leaked."""
    made: list = []

    def make(name: str, *, layout=None, **kw):
        require_or_skip(name)
        key = (name, tuple(sorted(kw.items())))
        if name == "mooncake" and backend_pool.get(key):
            b = backend_pool[key].pop()
            b.set_layout(layout)
        else:
            b = get_backend(name, layout=layout, **kw)
        made.append((key, b))
        return b

    yield make
    for key, b in reversed(made):
        if key[0] == "mooncake" and not b.closed:
            b.reset()
            backend_pool.setdefault(key, []).append(b)
        else:
            b.close()
        b.check_invariants()
        s = b.stats()
        assert (s["open_handles"], s["registered_regions"], s["registrations"], s["peers"]) == (0, 0, 0, 0)


@pytest.fixture(scope="module")
def backend_workers():
    """Per available engine: a shared worker and a victim worker (paused and killed by failure tests).
    All start at once so their start-up costs overlap; all are ended at module teardown."""
    print(f"UMALLOC_SEED={SEED}")
    workers: dict[tuple[str, str], BackendWorker] = {}
    for name in ENGINES:
        if backend_available(name)[0]:
            workers[(name, "shared")] = BackendWorker(name)
            workers[(name, "victim")] = BackendWorker(name)
    yield workers
    with ThreadPoolExecutor(max(1, len(workers))) as ex:  # each exit costs about a second (engine stop): overlap
        list(ex.map(BackendWorker.close, workers.values()))
    assert not any(w.alive() for w in workers.values())


def worker(backend_workers, name: str, role: str = "shared") -> BackendWorker:
    require_or_skip(name)
    w = backend_workers[(name, role)]
    w.wait_ready(60.0)
    return w
