"""Shared helpers for the lease / compaction / retraction tests: tiny geometries (their allocators are the
``two_end_allocator`` / ``three_end_allocator`` fixtures of ``conftest.py``), a fake clock and a byte model
that follows every virtual page through moves (data written through a virtual page must read back the same)."""

from __future__ import annotations

import numpy as np
import torch

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.geometry.spec import EndRole, EndSpec, Grow, LayerSpec
from umalloc.pool.pagestate import PAGE_GAP, PAGE_HOLE, PAGE_LIVE, PAGE_PENDING, PAGE_RESERVED, TOMBSTONE
from umalloc.testing import FakeClock, seed_from_env  # noqa: F401  (re-exported for the tests)

PAGE_SIZE = 2


def full_end() -> EndSpec:
    return EndSpec("full", (LayerSpec.mha(1, 4),), page_size=PAGE_SIZE)  # 16 B/token, 32 B pages


def swa_end() -> EndSpec:
    return EndSpec("swa", (LayerSpec.mha(1, 2, window_tokens=4),), page_size=PAGE_SIZE, grow=Grow.DOWN,
                   owner="full", role=EndRole.SWA)  # 8 B/token, 16 B pages


def draft_end(grow: Grow = Grow.FLOAT) -> EndSpec:
    return EndSpec("draft", (LayerSpec.mha(1, 2),), page_size=PAGE_SIZE, grow=grow, owner="full",
                   role=EndRole.DRAFT)  # 16 B pages


def two_ends() -> tuple[EndSpec, ...]:
    """full (up, owner, 32 B pages) + swa (down, bound, 16 B pages): the ``two_end_allocator`` fixture's ends."""
    return (full_end(), swa_end())


def three_ends() -> tuple[EndSpec, ...]:
    """full (up, owner) + draft (float, bound) + swa (down, bound): the ``three_end_allocator`` fixture's ends."""
    return (full_end(), draft_end(), swa_end())


class ByteModel:
    """Expected bytes of every bound (end, virtual page): written at allocation through the tables, checked
    through the tables after every operation."""

    def __init__(self, alloc: MultiEndedAllocator) -> None:
        self.alloc = alloc
        self.pages: dict[tuple[str, int], torch.Tensor] = {}
        self.gen = 0

    def bound_vpages(self, end: str, vpages: np.ndarray) -> np.ndarray:
        v2p = self.alloc.v2p(end).cpu().numpy()
        return vpages[v2p[vpages] != TOMBSTONE]

    def write(self, vpages: np.ndarray | torch.Tensor) -> None:
        """Fill every bound end's page of ``vpages`` with fresh bytes and remember them."""
        vp = np.asarray(vpages, dtype=np.int64)
        for end in self.alloc.spec.end_names:
            bound = self.bound_vpages(end, vp)
            if not bound.size:
                continue
            env = self.alloc.arena.envelopes(end)
            phys = self.alloc.translate_pages(torch.from_numpy(bound), end)
            for v, p in zip(bound.tolist(), phys.tolist(), strict=True):
                self.gen += 1
                g = torch.Generator().manual_seed(self.gen)
                data = torch.randint(0, 256, (env.shape[1],), dtype=torch.uint8, generator=g)
                env[p] = data
                self.pages[(end, v)] = data

    def forget(self, vpages: np.ndarray, ends: list[str] | None = None) -> None:
        for v in np.asarray(vpages).tolist():
            for end in ends or self.alloc.spec.end_names:
                self.pages.pop((end, v), None)

    def check(self) -> None:
        """Every remembered (end, vpage) is still bound and reads back its bytes; nothing else is bound."""
        for end in self.alloc.spec.end_names:
            v2p = self.alloc.v2p(end).cpu().numpy()
            bound = set(np.flatnonzero(v2p != TOMBSTONE).tolist()) - {0}
            expect = {v for (e, v) in self.pages if e == end}
            assert bound == expect, f"end {end}: bound {sorted(bound)} != expected {sorted(expect)}"
            env = self.alloc.arena.envelopes(end)
            for v in expect:
                assert torch.equal(env[int(v2p[v])], self.pages[(end, v)]), f"bytes of {end} vpage {v} changed"


def assert_no_ghost_pages(alloc: MultiEndedAllocator) -> None:
    """Every physical page of every end is exactly one of reserved, gap, hole, live or pending; live pages are
    exactly the p2v-mapped ones, pending pages exactly the pinned non-live ones, and no v2p entry reaches a
    pending page (pending pages are unreachable)."""
    for end in alloc.spec.end_names:
        view = alloc.ends[end]
        st, p2v, v2p = view.state, view.p2v, view.v2p
        pins = alloc.lease_table.pin_count(end)
        known = np.isin(st, [PAGE_RESERVED, PAGE_GAP, PAGE_HOLE, PAGE_LIVE, PAGE_PENDING])
        assert known.all(), f"{end}: unknown page states at {np.flatnonzero(~known)}"
        assert np.array_equal(p2v != TOMBSTONE, st == PAGE_LIVE), f"{end}: p2v set off live pages"
        pending = np.flatnonzero(st == PAGE_PENDING)
        assert (pins[pending] > 0).all(), f"{end}: a pending page is not pinned"
        reach = v2p[1:][v2p[1:] != TOMBSTONE]
        assert not np.isin(reach, pending).any(), f"{end}: a v2p entry reaches a pending page"
