"""Helpers for umalloc's tests and for users' own stress tests (not used by the library itself).

* :func:`small_allocator`: the tiny two-end allocator the doctests use (``full`` up + ``swa`` down,
  ``page_size = 2``, 10 page slots each).
* :func:`tiny_spec`: that geometry as an :class:`~umalloc.geometry.spec.ArenaSpec`, to build arenas of it.
* :class:`FakeClock`: a settable clock for lease deadlines (no sleeps).
* :func:`seed_from_env`: a seed, printed, overridable with ``UMALLOC_SEED``.
* :func:`require_or_skip`: skip a test whose transfer engine is missing (fails instead under
  ``UMALLOC_REQUIRE_BACKENDS=1``): the one place tests decide whether an engine may be skipped.
* :func:`writable_end_tables`: writable ``(p2v, state, v2p)`` of one end, for tests that corrupt an allocator
  on purpose to check that :meth:`~umalloc.allocator.facade.MultiEndedAllocator.check_invariants` notices.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.backends import backend_available
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, LayerSpec

#: Env var that turns engine skips into failures (set in CI).
REQUIRE_ENV = "UMALLOC_REQUIRE_BACKENDS"


def require_or_skip(name: str) -> None:
    """Skip the calling pytest test if backend ``name`` cannot be imported — or FAIL it under
    ``UMALLOC_REQUIRE_BACKENDS=1`` (CI), so a broken install can never pass as a skip.

    Raises:
        UmallocValueError: unknown ``name``.
        pytest's Skipped or Failed outcome (imports pytest lazily; only for use inside tests).
    """
    ok, why = backend_available(name)
    if ok:
        return
    import pytest

    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        pytest.fail(f"backend {name!r} is required ({REQUIRE_ENV}=1) but unavailable: {why}", pytrace=False)
    pytest.skip(f"backend {name!r} unavailable: {why}")


def tiny_spec(arena_bytes: int = 320) -> ArenaSpec:
    """``full`` (up, id owner) and ``swa`` (down, bound), both ``page_size = 2`` with 32 B pages; with the default
    320 B arena: 10 page slots each (page 0 the sink, pages 1..9 usable)."""
    full = EndSpec("full", (LayerSpec.mha(1, 4),), page_size=2)
    swa = EndSpec("swa", (LayerSpec.mha(1, 4, window_tokens=4),), page_size=2, grow=Grow.DOWN, owner="full",
                  role=EndRole.SWA)
    return ArenaSpec((full, swa), arena_bytes=arena_bytes)


def small_allocator(**kwargs: Any) -> MultiEndedAllocator:
    """A fresh allocator on a fresh arena of :func:`tiny_spec` (keyword arguments go to the allocator).

    >>> small_allocator().alloc_pages(2).tolist()
    [1, 2]
    """
    return MultiEndedAllocator(Arena(tiny_spec()), **kwargs)


class FakeClock:
    """A settable clock in seconds (no sleeps in tests): ``clock.now = 5.0``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def seed_from_env(default: int) -> int:
    """``UMALLOC_SEED`` if set, else ``default``; printed so a failing run can be replayed."""
    seed = int(os.environ.get("UMALLOC_SEED", default))
    print(f"seed={seed} (override with UMALLOC_SEED)")
    return seed


def writable_end_tables(alloc: MultiEndedAllocator, end: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Writable ``(p2v, state, v2p)`` views of ``end``'s host masters: a test hook for corrupting an allocator on
    purpose (everything the public API returns is read-only)."""
    return alloc._heap.end_tables(alloc.spec.end_names.index(end))


__all__ = ["FakeClock", "require_or_skip", "seed_from_env", "small_allocator", "tiny_spec", "writable_end_tables"]
