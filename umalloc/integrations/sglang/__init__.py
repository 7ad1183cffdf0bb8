"""umalloc behind SGLang's KV-cache allocators: token, paged and SWA pools whose slot ids come from umalloc.

Enable it with one call before SGLang builds its ``ModelRunner``::

    import umalloc.integrations.sglang
    umalloc.integrations.sglang.install()   # SGLang's KV-cache configurator now builds the umalloc classes

Tested with SGLang 0.5.23 (:data:`SUPPORTED_VERSIONS`; the ``umalloc[sglang]`` extra pins it);
:func:`install` refuses any other version with :class:`UnsupportedSGLangVersion`, because the classes follow
that release's allocator interface method by method.

What :func:`install` patches: ``KVCacheConfigurator._build_token_to_kv_pool_allocator`` in
``sglang.srt.mem_cache.kv_cache_configurator`` constructs the allocator through the module-level names it
imported; :func:`install` rebinds them in that module:

* ``TokenToKVPoolAllocator`` -> :class:`UmallocTokenToKVPoolAllocator` (``page_size`` 1),
* ``PagedTokenToKVPoolAllocator`` -> :class:`UmallocPagedTokenToKVPoolAllocator`,
* ``SWATokenToKVPoolAllocator`` -> :class:`UmallocSWATokenToKVPoolAllocator` (full + sliding-window pools).

and, in ``sglang.srt.mem_cache.allocator.unified_hybrid_swa`` (:data:`UNIFIED_MODULE`, the module SGLang's
unified-memory factory ``init_unified_swa_pools`` imports the class from when it runs):

* ``UnifiedSWATokenToKVPoolAllocator`` -> :class:`UmallocUnifiedSWATokenToKVPoolAllocator` (one umalloc arena for
  the full and SWA sub-pools of a ``UnifiedKVPool``: :mod:`umalloc.integrations.sglang.unified`).

The classes are defined at module level in the modules that import SGLang (:data:`CLASS_MODULES`); this package
imports without SGLang and reaches them as attributes on first access (after the version check):

* ``UmallocTokenToKVPoolAllocator``, ``UmallocPagedTokenToKVPoolAllocator``: one
  :class:`~umalloc.integrations.sglang.pools.SlotPool` each.
* ``UmallocSWATokenToKVPoolAllocator``: a full and an SWA pool with SGLang's token-level ``full -> swa``
  index mapping (:mod:`umalloc.integrations.sglang.swa`).
* ``UmallocUnifiedSWATokenToKVPoolAllocator``: the two ends of one umalloc ``MultiEndedAllocator`` under shared
  virtual ids, compaction and move gates (:mod:`umalloc.integrations.sglang.unified`).

How they differ from SGLang's own classes (order of ids, misuse that raises) is listed in
:mod:`umalloc.integrations.sglang.pools` and in docs/engines.md ("SGLang").
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import sys
from collections.abc import Iterator
from typing import Any

from umalloc.errors import UmallocError
from umalloc.integrations.versions import EngineVersionError, check_engine_version

#: SGLang versions this integration is tested with (the ``umalloc[sglang]`` extra pins them).
SUPPORTED_VERSIONS: tuple[str, ...] = ("0.5.23",)
SUPPORTED_SGLANG_VERSIONS = SUPPORTED_VERSIONS   #: the same tuple under the name earlier releases used

#: ``kv_cache_configurator`` name -> umalloc class name that :func:`install` binds there.
PATCHED_NAMES: dict[str, str] = {
    "TokenToKVPoolAllocator": "UmallocTokenToKVPoolAllocator",
    "PagedTokenToKVPoolAllocator": "UmallocPagedTokenToKVPoolAllocator",
    "SWATokenToKVPoolAllocator": "UmallocSWATokenToKVPoolAllocator",
}

#: The module whose names :func:`install` rebinds.
CONFIGURATOR_MODULE = "sglang.srt.mem_cache.kv_cache_configurator"

#: The module ``init_unified_swa_pools`` (SGLang's unified-memory factory) imports its allocator class from at each
#: call; :func:`install` rebinds ``UnifiedSWATokenToKVPoolAllocator`` there.
UNIFIED_MODULE = "sglang.srt.mem_cache.allocator.unified_hybrid_swa"

#: ``unified_hybrid_swa`` name -> umalloc class name that :func:`install` binds there.
PATCHED_UNIFIED_NAMES: dict[str, str] = {
    "UnifiedSWATokenToKVPoolAllocator": "UmallocUnifiedSWATokenToKVPoolAllocator",
}


class UnsupportedSGLangVersion(EngineVersionError):
    """The installed SGLang is not one of :data:`SUPPORTED_VERSIONS`; ``version`` names it."""


class SGLangUnavailable(UmallocError, ImportError):
    """SGLang is not installed here (typed, and an ImportError for callers that catch that)."""


def sglang_version() -> str:
    """The installed SGLang's version (its distribution metadata; SGLang is not imported).

    Raises:
        SGLangUnavailable: SGLang is not installed (an ImportError).
    """
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise SGLangUnavailable("SGLang is not installed (pip install 'umalloc[sglang]')") from None


def check_version(version: str | None = None) -> str:
    """Refuse an untested SGLang: returns ``version`` (default: the installed one) if supported.

    Raises:
        UnsupportedSGLangVersion: it is not in :data:`SUPPORTED_VERSIONS`. ImportError: no SGLang.

    >>> check_version("0.5.23")
    '0.5.23'
    >>> check_version("0.5.24")
    Traceback (most recent call last):
    ...
    umalloc.integrations.sglang.UnsupportedSGLangVersion: SGLang 0.5.24 is untested with umalloc.integrations.sglang; allowed 0.5.23 (pip install 'umalloc[sglang]')
    """
    v = sglang_version() if version is None else version
    return check_engine_version("SGLang", v, SUPPORTED_VERSIONS, "sglang", UnsupportedSGLangVersion)


#: umalloc class name -> the module that defines it (each imports SGLang when imported)
CLASS_MODULES: dict[str, str] = {
    "UmallocTokenToKVPoolAllocator": "umalloc.integrations.sglang.classes",
    "UmallocPagedTokenToKVPoolAllocator": "umalloc.integrations.sglang.classes",
    "UmallocSWATokenToKVPoolAllocator": "umalloc.integrations.sglang.swa",
    "UmallocUnifiedSWATokenToKVPoolAllocator": "umalloc.integrations.sglang.unified",
}


def _classes() -> dict[str, type]:
    check_version()
    return {name: getattr(importlib.import_module(module), name) for name, module in CLASS_MODULES.items()}


#: (module name, name) -> SGLang's own object that :func:`install` replaced there (what :func:`uninstall` restores)
_rebound: dict[tuple[str, str], Any] = {}


def install() -> dict[str, type]:
    """Make SGLang's KV-cache configurator build the umalloc classes (see the module docstring for the names it
    rebinds in ``sglang.srt.mem_cache.kv_cache_configurator``). Call it before SGLang builds its model runner.
    Idempotent; :func:`uninstall` undoes it.

    Returns:
        the rebound names -> the umalloc classes now bound to them.

    Raises:
        UnsupportedSGLangVersion (an :class:`~umalloc.integrations.versions.EngineVersionError`): the installed
        SGLang is not tested; nothing is rebound. ImportError: SGLang is not installed.
    """
    classes = _classes()
    bound = {}
    for module_name, names in ((CONFIGURATOR_MODULE, PATCHED_NAMES), (UNIFIED_MODULE, PATCHED_UNIFIED_NAMES)):
        __import__(module_name)
        module = sys.modules[module_name]
        for name, ours in names.items():
            _rebound.setdefault((module_name, name), getattr(module, name))
            setattr(module, name, classes[ours])
            bound[name] = classes[ours]
    return bound


def uninstall() -> None:
    """Give SGLang back every name :func:`install` rebound (no-op if not installed). Allocators already built
    stay umalloc's until SGLang drops them."""
    for (module_name, name), original in list(_rebound.items()):
        module = sys.modules.get(module_name)
        if module is not None:
            setattr(module, name, original)
        del _rebound[(module_name, name)]


@contextlib.contextmanager
def installed() -> Iterator[dict[str, type]]:
    """``with installed() as bound:`` -- :func:`install` for the block, :func:`uninstall` after."""
    bound = install()
    try:
        yield bound
    finally:
        uninstall()


def __getattr__(name: str) -> Any:
    if name in CLASS_MODULES:
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# the Umalloc*Allocator classes are reached as attributes (module __getattr__: they import SGLang)
__all__ = ["CLASS_MODULES", "CONFIGURATOR_MODULE", "PATCHED_NAMES", "PATCHED_UNIFIED_NAMES",
           "SUPPORTED_SGLANG_VERSIONS", "SUPPORTED_VERSIONS", "UNIFIED_MODULE", "EngineVersionError",
           "SGLangUnavailable", "UnsupportedSGLangVersion", "check_version", "install", "installed",
           "sglang_version", "uninstall"]
