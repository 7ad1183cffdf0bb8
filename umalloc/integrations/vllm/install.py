"""Installing umalloc's pool into vLLM: rebinding ``BlockPool`` where vLLM's KV-cache coordinators build it."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from umalloc.integrations.vllm.seams import check_version

#: module name -> the stock ``BlockPool`` that :func:`install` replaced there (what :func:`uninstall` restores)
_rebound: dict[str, type] = {}


def install() -> type:
    """Make vLLM build :class:`~umalloc.integrations.vllm.pool.UmallocBlockPool` wherever it builds a
    ``BlockPool``: rebinds the name in ``vllm.v1.core.block_pool`` and in every loaded module of ``vllm.v1.core``
    that imported it (the KV-cache coordinators). Call it before vLLM builds its scheduler (modules that import
    ``BlockPool`` later get the new class too). Idempotent; :func:`uninstall` undoes it. The hisparse host pool
    (``SharedEventQueueBlockPool``, a subclass of the stock class) stays vLLM's.

    Returns:
        the pool class.

    Raises:
        ImportError: vLLM is not installed.
        UnsupportedVLLMVersion (an :class:`~umalloc.integrations.versions.EngineVersionError`): the installed
            vLLM is not one of :data:`~umalloc.integrations.vllm.seams.SUPPORTED_VERSIONS`; nothing is rebound.
    """
    import vllm

    check_version(str(getattr(vllm, "__version__", "unknown")))
    import vllm.v1.core.kv_cache_coordinator  # noqa: F401 - the module that builds the pool

    from umalloc.integrations.vllm.pool import UmallocBlockPool

    stock: type = UmallocBlockPool.__mro__[1]
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.v1.core") and getattr(module, "BlockPool", None) is stock:
            _rebound[name] = stock
            setattr(module, "BlockPool", UmallocBlockPool)  # noqa: B010 - rebinding another package's attribute
    return UmallocBlockPool


def uninstall() -> None:
    """Give every module :func:`install` rebound its stock ``BlockPool`` back (no-op if not installed). Pools
    already built stay umalloc's until vLLM drops them."""
    for name, stock in list(_rebound.items()):
        module = sys.modules.get(name)
        if module is not None:
            setattr(module, "BlockPool", stock)  # noqa: B010 - restoring another package's module attribute
        del _rebound[name]


@contextlib.contextmanager
def installed() -> Iterator[type]:
    """``with installed() as pool_cls:`` -- :func:`install` for the block, :func:`uninstall` after."""
    pool = install()
    try:
        yield pool
    finally:
        uninstall()


__all__ = ["install", "installed", "uninstall"]
