"""pytest plugin for vLLM's own KV-cache-manager tests (loaded with ``-p vllm_plugin`` by
scripts/peer_suite_vllm.sh; vLLM's conftest is not loaded, ``--noconftest``).

* ``--outcomes-json PATH``: write ``{nodeid: "passed" | "failed" | "skipped"}`` of every test (a setup or
  teardown error counts as failed, a module that fails to import as one failed entry) for
  :mod:`vllm_expectations` to compare.
* ``--umalloc-pool``: call :func:`umalloc.integrations.vllm.install` before collection, so every ``BlockPool``
  the tests build (directly or through vLLM's coordinators) is umalloc's; after each test that passed, every
  pool it built passes :meth:`check_invariants` (else the test fails).
* In both runs, where vLLM's CPU platform refuses an x86 machine without Triton's CPU backend (vLLM 0.34:
  ``RuntimeError: vLLM on x86 CPUs requires Triton``, raised while a ``VllmConfig`` is built), the platform is told
  Triton is there (``vllm.triton_utils.HAS_TRITON = True``): the KV-manager and scheduler tests build configs and
  never run a kernel, so the stock run stays the oracle for what they check.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import pytest

_outcomes: dict[str, str] = {}
_pools: weakref.WeakSet[Any] = weakref.WeakSet()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("umalloc peer suite")
    group.addoption("--outcomes-json", default=None, help="write every test's outcome to this JSON file")
    group.addoption("--umalloc-pool", action="store_true", help="run with umalloc's BlockPool installed")


def pytest_configure(config: pytest.Config) -> None:
    _cpu_without_triton()
    if not config.getoption("umalloc_pool"):
        return
    from umalloc.integrations import vllm as umalloc_vllm

    pool_cls = umalloc_vllm.install()
    init = pool_cls.__init__

    def tracked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _pools.add(self)

    pool_cls.__init__ = tracked_init


def _cpu_without_triton() -> None:
    """Let vLLM's CPU platform accept an x86 machine without triton-cpu (module docstring); a no-op where the
    platform has no such check (vLLM 0.33) or Triton is importable."""
    import inspect

    from vllm.platforms import cpu

    check = inspect.getsource(cpu.CpuPlatform.check_and_update_config)
    if "requires Triton" not in check:
        return
    import vllm.triton_utils

    if not vllm.triton_utils.HAS_TRITON:
        vllm.triton_utils.HAS_TRITON = True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _pools.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    result = yield
    for pool in list(_pools):
        pool.check_invariants()
    return result


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        prev = _outcomes.get(report.nodeid)
        if prev != "failed":
            _outcomes[report.nodeid] = "failed" if report.outcome == "failed" else report.outcome
    elif report.nodeid not in _outcomes:
        _outcomes[report.nodeid] = "passed"


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _outcomes[report.nodeid] = "failed"


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("outcomes_json")
    if path:
        with open(path, "w") as f:
            json.dump(dict(sorted(_outcomes.items())), f, indent=0)
