"""Which vLLM releases the pool supports, and what differs between them (imports no vLLM).

Note [Release seams]
~~~~~~~~~~~~~~~~~~~~
The pool overrides ``BlockPool`` internals, so each supported release was read and its own KV-cache-manager and
scheduler tests run against the pool (``scripts/peer_suite_vllm.sh``). What the pool adapts to, read from the
stock classes when :mod:`umalloc.integrations.vllm.pool` is imported (:func:`hash_slots`, :func:`pool_ref`),
never from the version string:

======================  =====================================  ==========================================
seam                    0.33.0                                 0.34.0
======================  =====================================  ==========================================
a block's hash          slots ``_block_hash`` /                 slots ``block_hash`` /
                        ``_block_hash_num_tokens`` (read-only   ``block_hash_num_tokens``
                        properties over them)
``KVCacheBlock.pool``   the pool                               a ``weakref.ref`` to the pool
                                                               (``BlockPool._weak_self``)
``BlockHashToBlockMap`` ``BlockHashToBlockMap()``, holds       ``BlockHashToBlockMap(blocks)``: holds ids,
                        blocks                                 reads them from the pool's block list
``free_blocks``         ``free_blocks(blocks)``                ``free_blocks(blocks, evict_first=False)``
======================  =====================================  ==========================================

Any other release is refused by :func:`check_version` before anything is rebound.
"""

from __future__ import annotations

from typing import Any

from umalloc.integrations.versions import EngineVersionError, check_engine_version

#: vLLM releases this adapter is tested with (the ``umalloc[vllm]`` extra allows exactly these).
SUPPORTED_VERSIONS: tuple[str, ...] = ("0.33.0", "0.34.0")
SUPPORTED_VLLM_VERSIONS = SUPPORTED_VERSIONS   #: the same tuple under the name earlier releases used


class UnsupportedVLLMVersion(EngineVersionError):
    """:func:`~umalloc.integrations.vllm.install` on a vLLM release this adapter was not tested against (nothing
    is rebound)."""


def check_version(version: str) -> str:
    """Return ``version`` if it is one of :data:`SUPPORTED_VERSIONS`, else raise :class:`UnsupportedVLLMVersion`.

    >>> check_version("0.34.0")
    '0.34.0'
    >>> check_version("0.35.0")
    Traceback (most recent call last):
    ...
    umalloc.integrations.vllm.seams.UnsupportedVLLMVersion: vLLM 0.35.0 is untested with umalloc.integrations.vllm; allowed 0.33.0, 0.34.0 (pip install 'umalloc[vllm]')
    """
    return check_engine_version("vLLM", version, SUPPORTED_VERSIONS, "vllm", UnsupportedVLLMVersion)


def hash_slots(block_cls: type) -> tuple[str, str]:
    """The slot names holding a ``KVCacheBlock``'s hash and its token count (Note [Release seams]):
    ``("block_hash", "block_hash_num_tokens")`` where ``block_hash`` is a plain slot, else the underscored pair
    behind read-only properties."""
    if isinstance(block_cls.__dict__.get("block_hash"), property):
        return "_block_hash", "_block_hash_num_tokens"
    return "block_hash", "block_hash_num_tokens"


def pool_ref(pool: Any) -> Any:
    """What ``KVCacheBlock.pool`` holds for ``pool`` after the stock ``BlockPool.__init__`` ran (Note [Release
    seams]): its ``weakref.ref`` where the stock pool keeps one (``_weak_self``), else the pool."""
    return getattr(pool, "_weak_self", pool)


__all__ = ["SUPPORTED_VERSIONS", "SUPPORTED_VLLM_VERSIONS", "UnsupportedVLLMVersion", "check_version",
           "hash_slots", "pool_ref"]
