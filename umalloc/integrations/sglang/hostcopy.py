"""The host copies SGLang's retraction takes, shared by every umalloc allocator class of this package.

SGLang's allocators hand ``get_cpu_copy`` / ``load_cpu_copy`` to their KV pool (``kvcache``): the slot ids an
allocator hands out are the KV pool's own indices, so the copies need nothing of umalloc. The classes bind these
functions as methods (``get_cpu_copy = hostcopy.get_cpu_copy``); each reads the allocator's ``_kvcache``.
"""

from __future__ import annotations

from typing import Any


def get_cpu_copy(allocator: Any, indices: Any, mamba_indices: Any = None, req_pool_index: Any = None) -> Any:
    """The KV pool's host copy of ``indices``."""
    return allocator._kvcache.get_cpu_copy(indices, mamba_indices=mamba_indices, req_pool_index=req_pool_index)


def load_cpu_copy(allocator: Any, kv_cache_cpu: Any, indices: Any, mamba_indices: Any = None,
                  req_pool_index: Any = None) -> Any:
    """Write a host copy back into the KV pool at ``indices``."""
    return allocator._kvcache.load_cpu_copy(kv_cache_cpu, indices, mamba_indices=mamba_indices,
                                            req_pool_index=req_pool_index)


__all__ = ["get_cpu_copy", "load_cpu_copy"]
