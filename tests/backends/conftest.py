"""Fixtures of the backend tests: backends made per test (Mooncake ones pooled per module) and the worker
processes (one shared and one victim per available engine, per module). The helpers they use live in
``backend_helpers.py``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from backend_helpers import ENGINES, SEED

from umalloc.backends import backend_available, get_backend
from umalloc.backends.worker import BackendWorker
from umalloc.testing import require_or_skip

# ==== backends and workers ==================================================================================


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
