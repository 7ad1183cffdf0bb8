"""Adapters that put umalloc behind an engine's own interfaces.

* :mod:`umalloc.integrations.vllm` -- a vLLM ``BlockPool`` whose block ids and free list come from a
  :class:`~umalloc.MultiEndedAllocator` (extra ``umalloc[vllm]``); ``umalloc.integrations.vllm.install()``
  makes vLLM build it.

Each adapter imports its engine only when it is used, so ``import umalloc.integrations.<engine>`` works (and
its doctests collect) where the engine is not installed; a module that imports its engine at the top
(:mod:`umalloc.integrations.vllm.pool`) is collected only where the engine is (the package's ``conftest.py``).
"""
