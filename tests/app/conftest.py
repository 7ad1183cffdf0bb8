"""Fixtures of the replay application's tests.

Every test here runs as if the host had :data:`TEST_HOST_MEMORY` bytes available (``$UMALLOC_HOST_MEMORY_BYTES``,
inherited by the console-script processes the tests start): the replay's host-memory refusal then depends on the
sizes a test asks for, never on the memory free on the machine that runs the suite."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from umalloc_replay.preflight import HOST_MEMORY_ENV

#: The host memory the tests see: far above what any test's replay holds, far below the sizes the refusal tests
#: ask for (10 TiB arenas, a 100,000,000-token prompt).
TEST_HOST_MEMORY = 256 << 30


@pytest.fixture(autouse=True)
def _fixed_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOST_MEMORY_ENV, str(TEST_HOST_MEMORY))


@pytest.fixture
def cache_builds(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the calls of ``cache_from_kv`` (the only function that puts K/V into a transformers cache; the
    one-process references build theirs with it): the returned dict's ``cache_from_kv``."""
    from umalloc_replay.generate import kv as kv_module

    calls = {"cache_from_kv": 0}
    real = kv_module.cache_from_kv

    def counted(*a: Any, **k: Any) -> Any:
        calls["cache_from_kv"] += 1
        return real(*a, **k)

    monkeypatch.setattr(kv_module, "cache_from_kv", counted)
    return calls


_generate_reports: dict[Any, dict[str, Any]] = {}


@pytest.fixture(scope="session")
def shared_generate() -> Callable[[Any], dict[str, Any]]:
    """``run_generate`` once per :class:`~umalloc_replay.generate.run.GenerateConfig` in the session: tests that
    assert different things about the same run read one report, each its own deep copy (a test may change its
    copy). For runs whose report depends only on the config (no fault injected, no patched module)."""
    from umalloc_replay.generate.run import run_generate

    def run(cfg: Any) -> dict[str, Any]:
        if cfg not in _generate_reports:
            _generate_reports[cfg] = run_generate(cfg)
        return copy.deepcopy(_generate_reports[cfg])
    return run
