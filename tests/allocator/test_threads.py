"""F26: lease release, engine reports, plan finishing and leases taken on a completion thread while the scheduler
thread allocates, frees and compacts. ``check_invariants()`` after every step, and every pinned page checked
unmoved (its virtual page still translates to the physical page that was leased).

``UMALLOC_STRESS_STEPS`` sets the run length in scheduler steps (default 1,000 in the suite); ``UMALLOC_SEED`` the
seed (printed). The run is bounded by steps, never by wall time, so a loaded machine runs the same steps slower.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time

import numpy as np
import pytest
import torch

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.geometry.arena import Arena
from umalloc.pool.pagestate import PAGE_LIVE, PAGE_PENDING
from umalloc.testing import seed_from_env, tiny_spec
from umalloc.transfer import build_plan

STRESS_STEPS = int(os.environ.get("UMALLOC_STRESS_STEPS", "1000"))


class _Completions(threading.Thread):
    """The engine side: takes leases on pages handed to it, reports engine parts terminal, releases leases and finishes plans."""

    def __init__(self, alloc: MultiEndedAllocator, seed: int) -> None:
        super().__init__(name="completions", daemon=True)
        self.alloc = alloc
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.back: queue.SimpleQueue = queue.SimpleQueue()
        self.rng = np.random.default_rng(seed + 1)
        self.errors: list[BaseException] = []
        self.submitted = 0  # jobs handed over by the main thread; each one ends before the stop job
        self.done = 0

    def submit(self, job: tuple) -> None:
        """Queues one job (main thread only)."""
        self.submitted += 1
        self.jobs.put(job)

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                kind = job[0]
                if kind == "pin":  # a lease taken on this thread, maybe while the owner compacts: translate
                    _, key, vpages = job  # and pin under the table's lock, so no move comes in between
                    with self.alloc.lease_table.lock:
                        pages = self.alloc.translate_pages(torch.from_numpy(vpages), "full").numpy()
                        lease = self.alloc.lease({"full": pages}, tag="t")
                    self.back.put((key, pages, lease))
                elif kind == "release":
                    job[1].release()
                elif kind == "engine":  # release while an engine holds a part, then the engine's report
                    _, lease, gen = job
                    lease.release()
                    time.sleep(float(self.rng.random()) * 1e-4)
                    lease.unhold_engine(gen)
                elif kind == "plan":
                    plan = job[1]
                    plan.complete() if self.rng.random() < 0.5 else plan.abort()
                self.done += 1
            except BaseException as exc:  # noqa: BLE001 - reported to the main thread
                self.errors.append(exc)


def _check_unmoved(alloc: MultiEndedAllocator, held: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
    state = alloc.ends["full"].state
    for vpages, ppages in held.values():
        assert np.isin(state[ppages], (PAGE_LIVE, PAGE_PENDING)).all()
        live = state[ppages] == PAGE_LIVE
        if live.any():  # not freed yet: still the same physical page (compaction did not move it)
            got = alloc.translate_pages(torch.from_numpy(vpages[live]), "full").numpy()
            assert np.array_equal(got, ppages[live])


@pytest.mark.timeout(STRESS_STEPS // 5 + 300)
def test_completion_thread_races_alloc_free_compact() -> None:
    seed = seed_from_env(20261201)
    rng = np.random.default_rng(seed)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    alloc = MultiEndedAllocator(Arena(tiny_spec(arena_bytes=32 * 96)), compaction="lazy")
    other = MultiEndedAllocator(Arena(tiny_spec(arena_bytes=32 * 96)))
    worker = _Completions(alloc, seed)
    worker.start()
    owned: list[int] = []  # live virtual pages the main thread may free
    in_transit: dict[int, np.ndarray] = {}  # key -> vpages handed to the worker for leasing (not freed meanwhile)
    held: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # lease id -> (vpages, physical pages) while pinned
    leases: dict[int, object] = {}
    keys = iter(range(1 << 30))
    steps = 0
    one = lambda x: torch.tensor([x], dtype=torch.int64)  # noqa: E731
    try:
        while steps < STRESS_STEPS:
            op = rng.integers(0, 8)
            if op == 0:
                got = alloc.alloc_pages(int(rng.integers(1, 5)))
                if got is not None:
                    owned.extend(got.tolist())
            elif op == 1 and owned:
                k = min(len(owned), int(rng.integers(1, 4)))
                vp = np.array([owned.pop(int(rng.integers(len(owned)))) for _ in range(k)], dtype=np.int64)
                pp = alloc.translate_pages(torch.from_numpy(vp), "full").numpy()
                if rng.random() < 0.5:  # leased on the worker thread
                    key = next(keys)
                    in_transit[key] = vp
                    worker.submit(("pin", key, vp))
                else:
                    # some with a deadline of a few ms: the owner's expiry races the worker's release
                    lease = alloc.lease({"full": pp}, deadline_s=0.002 if rng.random() < 0.3 else None)
                    held[lease.id] = (vp, pp)
                    leases[lease.id] = lease
                    owned.extend(vp.tolist())  # the main thread may free leased pages (they go pending)
            elif op == 2 and owned:
                k = min(len(owned), int(rng.integers(1, 4)))
                vp = [owned.pop(int(rng.integers(len(owned)))) for _ in range(k)]
                alloc.free_pages(np.array(vp, dtype=np.int64))
            elif op == 3:
                alloc.compact()
            elif op == 4 and leases:
                lid = list(leases)[int(rng.integers(len(leases)))]
                lease = leases.pop(lid)
                held.pop(lid, None)  # pages may come free from now on
                if rng.random() < 0.5 or not lease.active:  # (an expired lease takes no engine hold)
                    worker.submit(("release", lease))
                else:
                    worker.submit(("engine", lease, lease.hold_engine()))
            elif op == 5:
                svt = alloc.alloc_extend(one(0), one(4), one(-1))
                dvt = other.alloc_extend(one(0), one(4), one(-1))
                if svt is not None and dvt is not None:
                    plan = build_plan("r", alloc, {"full": svt}, other, {"full": dvt}, deadline_s=None)
                    worker.submit(("plan", plan))
                    owned.extend((svt[::2] // 2).tolist())
                    other.free(dvt)
                else:
                    if svt is not None:
                        alloc.free(svt)
                    if dvt is not None:
                        other.free(dvt)
            elif op == 6:
                alloc.stats()
            while True:  # leases the worker took: the main thread owns their pages again
                try:
                    key, pp, lease = worker.back.get_nowait()
                except queue.Empty:
                    break
                vp = in_transit.pop(key)
                held[lease.id] = (vp, pp)
                leases[lease.id] = lease
                owned.extend(vp.tolist())
            for lid in [lid for lid in held if leases[lid].state not in ("active", "in_doubt")]:
                del held[lid]  # expired (reclaimed): its pages may move from now on
            alloc.check_invariants()
            other.check_invariants()
            _check_unmoved(alloc, held)
            steps += 1
    finally:
        worker.jobs.put(None)
        worker.join()  # the worker ends after every job queued before the stop
        sys.setswitchinterval(old_interval)
    assert not worker.errors, worker.errors[:3]
    while not worker.back.empty():
        key, _, lease = worker.back.get()
        owned.extend(in_transit.pop(key).tolist())
        leases[lease.id] = lease
    for lease in leases.values():
        lease.release()
    alloc.free_pages(np.array(sorted(set(owned)), dtype=np.int64))
    alloc.check_invariants()
    st = alloc.stats()["full"]
    print(f"seed={seed} steps={steps} completions={worker.done} expired={alloc.lease_table.leases_expired} "
          f"settled={alloc.lease_table.leases_settled}")
    assert (st.live_pages, st.pending_pages, st.pinned_pages, st.in_doubt_pages) == (0, 0, 0, 0)
    assert alloc.leases_active() == 0 and not alloc.lease_table.in_doubt()
    assert worker.done == worker.submitted > 10
