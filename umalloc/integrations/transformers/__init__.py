"""umalloc as the KV memory of Hugging Face transformers' continuous batching (``generate_batch``).

``with installed(CacheOptions(...)):`` (or :func:`install` / :func:`uninstall`) makes every ``PagedAttentionCache``
transformers builds an :class:`UmallocPagedCache` over one umalloc arena. Modules, one concept each:
:mod:`~umalloc.integrations.transformers.cache` (the cache and its Notes: seams, rows, sliding ring, cannot fit),
:mod:`~umalloc.integrations.transformers.growth` (the tokens each request holds and the growth of its pages),
:mod:`~umalloc.integrations.transformers.groups` (one attention type on one end of the arena),
:mod:`~umalloc.integrations.transformers.options` (options, counters, errors, config reading),
:mod:`~umalloc.integrations.transformers.sizing` (stock's cache bytes, the most tokens one request holds) and
:mod:`~umalloc.integrations.transformers.install` (installing, and the lifetime of caches).
"""

from umalloc.integrations.transformers.cache import UmallocPagedCache
from umalloc.integrations.transformers.install import (
    SUPPORTED_TRANSFORMERS_VERSIONS,
    SUPPORTED_VERSIONS,
    Installation,
    bind_processor,
    check_version,
    install,
    installed,
    installed_version,
    uninstall,
)
from umalloc.integrations.transformers.options import (
    CacheCounters,
    CacheOptions,
    RequestCannotFitError,
    UnsupportedCacheError,
    UnsupportedTransformersVersion,
)

__all__ = [
    "SUPPORTED_TRANSFORMERS_VERSIONS",
    "SUPPORTED_VERSIONS",
    "CacheCounters",
    "CacheOptions",
    "Installation",
    "RequestCannotFitError",
    "UmallocPagedCache",
    "UnsupportedCacheError",
    "UnsupportedTransformersVersion",
    "bind_processor",
    "check_version",
    "install",
    "installed",
    "installed_version",
    "uninstall",
]
