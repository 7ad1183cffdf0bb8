"""Installing umalloc into transformers' continuous batching: :func:`install`, :func:`uninstall`,
:func:`installed` and the :class:`Installation` they return (Note [Seams] 1, 9, 10 in
:mod:`umalloc.integrations.transformers.cache`).

Note [Lifetime]
~~~~~~~~~~~~~~~
A cache lives exactly as long as transformers keeps it, as the stock cache does: the installation records each
cache it builds through a weak reference (plus its :class:`CacheCounters`, a plain dataclass), the cache's own
parts refer back to it weakly (its groups, its pool, the table's ``on_evict`` callback, the scheduler hook), so
the batch processor's reference is the last one and dropping it frees the arena at once, with no cycle left for
the garbage collector. ``keep_caches=True`` asks the installation to hold them (to read counters and tables after
``generate_batch`` returns) until :meth:`Installation.release` or the installation itself is dropped.

Threading: install / uninstall from the thread that calls transformers; caches are built on its generation
thread.
"""

from __future__ import annotations

import contextlib
import importlib
import weakref
from collections.abc import Iterator
from typing import Any

from umalloc import InvariantError, UmallocValueError
from umalloc.integrations.transformers.cache import UmallocPagedCache
from umalloc.integrations.transformers.options import (
    CacheCounters,
    CacheOptions,
    UnsupportedTransformersVersion,
)
from umalloc.integrations.versions import check_engine_version

#: transformers releases this integration is tested against (exactly; its peer suite runs each).
SUPPORTED_VERSIONS: tuple[str, ...] = ("5.23.0", "5.24.0", "5.25.0")
SUPPORTED_TRANSFORMERS_VERSIONS = SUPPORTED_VERSIONS   #: the same tuple under the name earlier releases used


class Installation:
    """What :func:`install` did (Note [Lifetime]).

    Attributes:
        options: the :class:`CacheOptions` every cache is built with.
        original / original_processor: transformers' own ``PagedAttentionCache`` and ``ContinuousBatchProcessor``
            (put back by :func:`uninstall`).
        keep_caches: whether the installation holds the caches it builds (for inspection after a run; they then
            live as long as this object, or until :meth:`release`); by default it holds none and a cache dies with
            transformers' batch processor, as the stock cache does.
        caches_built: how many caches were built while installed.
        last_counters: the :class:`CacheCounters` of the cache built last (a plain dataclass, not the cache; it
            keeps counting while that cache lives), ``None`` before the first.

    Threading: caches are built on transformers' generation thread; read the attributes after the run.
    """

    def __init__(self, options: CacheOptions, original: Any, original_processor: Any, keep_caches: bool) -> None:
        self.options = options
        self.original = original
        self.original_processor = original_processor
        self.keep_caches = keep_caches
        self.caches_built = 0
        self.last_counters: CacheCounters | None = None
        self._kept: list[UmallocPagedCache] = []
        self._refs: list[weakref.ref[UmallocPagedCache]] = []

    def add(self, cache: UmallocPagedCache) -> None:
        """Record a cache just built (strongly only with ``keep_caches``). O(caches alive)."""
        self.caches_built += 1
        self.last_counters = cache.counters
        if self.keep_caches:
            self._kept.append(cache)
        self._refs = [r for r in self._refs if r() is not None]
        self._refs.append(weakref.ref(cache))

    @property
    def caches(self) -> list[UmallocPagedCache]:
        """The caches built while installed that are still alive, oldest first (all of them with
        ``keep_caches``)."""
        if self.keep_caches:
            return list(self._kept)
        return [c for r in self._refs if (c := r()) is not None]

    def release(self) -> None:
        """Drop every reference to the caches (:func:`uninstall` calls it)."""
        self._kept.clear()
        self._refs.clear()


_active: Installation | None = None

#: every PagedAttentionCache method transformers 5.23's batch processor, scheduler, IO builder, model runner,
#: offloading manager and attention interfaces call
_ENGINE_METHODS = (
    "can_store_request_tokens", "count_storable_requests", "free_blocks", "free_all_requests", "search_prefix_match",
    "count_new_complete_blocks", "mark_complete_blocks", "evict_cached_blocks", "extend_read_and_write_indices",
    "update", "reset", "prepare_fork_request", "perform_cache_copy", "compute_free_capacity", "fill_block_table",
    "__init__",
)


def installed_version() -> str:
    """The version of the transformers module Python imports (``transformers.__version__``)."""
    return str(importlib.import_module("transformers").__version__)


def check_version(version: str) -> None:
    """Raise :class:`UnsupportedTransformersVersion` (an
    :class:`~umalloc.integrations.versions.EngineVersionError`) unless ``version`` is one of
    :data:`SUPPORTED_VERSIONS`."""
    check_engine_version("transformers", version, SUPPORTED_VERSIONS, "transformers", UnsupportedTransformersVersion)


def install(options: CacheOptions | None = None, *, keep_caches: bool = False) -> Installation:
    """Make every ``PagedAttentionCache`` transformers builds from now on an :class:`UmallocPagedCache`.

    Args:
        options: how each cache builds its arena (default :class:`CacheOptions()`).
        keep_caches: the returned :class:`Installation` holds every cache built (to inspect it after
            ``generate_batch`` returns) for as long as it lives or until :meth:`Installation.release`; by default a
            cache dies with transformers' batch processor (Note [Lifetime]).

    Returns:
        the :class:`Installation`.

    Raises:
        UnsupportedTransformersVersion: transformers is not one of :data:`SUPPORTED_VERSIONS`.
        UmallocValueError: already installed, or ``options`` not a :class:`CacheOptions`. Nothing changes.
    """
    global _active
    check_version(installed_version())
    opts = CacheOptions() if options is None else options
    if not isinstance(opts, CacheOptions):
        raise UmallocValueError(f"options={options!r}: allowed a CacheOptions")
    if type(keep_caches) is not bool:
        raise UmallocValueError(f"keep_caches={keep_caches!r}: allowed True or False")
    if _active is not None:
        raise UmallocValueError("umalloc is already installed in transformers; call uninstall() first")
    api: Any = importlib.import_module("transformers.generation.continuous_batching.continuous_api")
    inst = Installation(opts, api.PagedAttentionCache, api.ContinuousBatchProcessor, keep_caches)
    # sdpa / flash attention test isinstance(cache, PagedAttentionCache) (Note [Seams] 9): the cache class the
    # engine sees names the stock one as a base, for that check only; every method it calls is umalloc's
    engine_cls = type("UmallocPagedAttentionCache", (UmallocPagedCache, api.PagedAttentionCache), {})
    missing = [m for m in _ENGINE_METHODS if getattr(engine_cls, m) is not getattr(UmallocPagedCache, m)]
    if missing:
        raise InvariantError(f"engine cache class: {missing} would resolve to transformers' own methods")

    def factory(*args: Any, **kwargs: Any) -> UmallocPagedCache:
        cache: UmallocPagedCache = engine_cls(*args, options=inst.options, **kwargs)
        inst.add(cache)
        return cache

    processor_cls = api.ContinuousBatchProcessor

    def processor_init(self: Any, *args: Any, **kwargs: Any) -> None:
        processor_cls.__init__(self, *args, **kwargs)
        bind_processor(self)

    api.PagedAttentionCache = factory
    # the processor transformers builds is its own with one step added after __init__ (Note [Seams] 10)
    api.ContinuousBatchProcessor = type("UmallocContinuousBatchProcessor", (processor_cls,),
                                        {"__init__": processor_init})
    _active = inst
    return inst


def bind_processor(processor: Any) -> None:
    """Let a batch processor whose cache is an :class:`UmallocPagedCache` fail, alone, the requests that cache
    finds unable to complete (Note [Cannot fit]): its scheduler's ``schedule_batch`` (an attribute of that one
    scheduler object) runs transformers' own, then removes each such request from the scheduler's queues, frees
    its pages and delivers it failed with the cache's error (and each child it was to fork into, so that
    ``generate_batch`` waits for no output that cannot come), and lets waiting requests start again, as transformers
    does when a request finishes (``block_new_requests``); if the step scheduled nothing only because of them,
    it schedules again. No-op for a stock cache. Holds the scheduler and the cache weakly."""
    cache = processor.cache
    if not isinstance(cache, UmallocPagedCache):
        return
    scheduler = processor.scheduler
    router = processor.output_router
    schedule = type(scheduler).schedule_batch
    scheduler_ref, cache_ref = weakref.ref(scheduler), weakref.ref(cache)

    def schedule_batch(token_budget: int, cache_budget: int) -> Any:
        sched, c = scheduler_ref(), cache_ref()
        result = schedule(sched, token_budget, cache_budget)
        if c is None or sched is None:
            return result
        doomed = c.take_doomed()
        for state, error in doomed:
            rid = state.request_id
            sched.active_requests.pop(rid, None)
            sched.waiting_requests.pop(rid, None)
            if rid in sched.waiting_requests_order:
                sched.waiting_requests_order.remove(rid)
            sched.starved_requests = [(st, n) for st, n in sched.starved_requests if st.request_id != rid]
            c.free_blocks(rid, no_cache=True)
            # children not forked yet (num_return_sequences > 1) fail with it: generate_batch waits for each
            children = [state.fork(f"{rid}__child#{i}") for i in range(state.num_children)]
            state.num_children = 0
            c.counters.failed_alone += 1 + len(children)
            for child in children:
                router.fail_and_deliver(child, error)
            router.fail_and_deliver(state, error)
        if doomed:
            sched.block_new_requests = False   # as when a request finishes: the waiting ones may start again
            if result[0] is None:
                result = schedule(sched, token_budget, cache_budget)
        return result

    def state_of(request_id: str) -> Any:
        sched = scheduler_ref()
        if sched is None:
            return None
        return sched.waiting_requests.get(request_id) or sched.active_requests.get(request_id)

    scheduler.schedule_batch = schedule_batch
    cache.state_of = state_of


def uninstall() -> None:
    """Give transformers its own ``PagedAttentionCache`` back (no-op if not installed). The module then holds no
    reference to the installation; caches it kept (``keep_caches=True``) live as long as the caller's
    :class:`Installation` does."""
    global _active
    if _active is None:
        return
    api: Any = importlib.import_module("transformers.generation.continuous_batching.continuous_api")
    api.PagedAttentionCache = _active.original
    api.ContinuousBatchProcessor = _active.original_processor
    _active = None


@contextlib.contextmanager
def installed(options: CacheOptions | None = None, *, keep_caches: bool = False) -> Iterator[Installation]:
    """``with installed(opts) as inst:`` -- :func:`install` for the block, :func:`uninstall` after (caches kept
    with ``keep_caches`` stay readable through ``inst.caches`` after the block too, while ``inst`` lives)."""
    inst = install(options, keep_caches=keep_caches)
    try:
        yield inst
    finally:
        uninstall()


__all__ = ["SUPPORTED_TRANSFORMERS_VERSIONS", "SUPPORTED_VERSIONS", "Installation", "bind_processor",
           "check_version", "install", "installed", "installed_version", "uninstall"]
