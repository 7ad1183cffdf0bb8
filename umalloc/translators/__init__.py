"""Translators: pure functions over index tensors, with no allocator state.

* ``virtual_to_physical`` / ``virtual_to_physical_pages``: virtual token/page ids to physical ones through a
  v2p table; tombstones raise in strict mode and map to the sink page otherwise. ``strict`` is a bool
  (``strict=0`` or ``"no"`` are refused) whose one default, :data:`STRICT_DEFAULT`, is True in every
  implementation, as in the allocator's ``translate``: a tombstone maps to the sink only when asked.
* Ids may be int64 or int32 tensors or numpy arrays (vLLM's and SGLang's block tables are int32); id results
  keep the input's dtype, and a result that would not fit it (or would overflow int64) is refused, never
  wrapped. A refused call writes nothing: ``out=`` is left untouched.
* ``tokens_to_pages``: page ids of whole, aligned pages of tokens (misalignment raises, never truncates).
* ``pages_to_runs`` / ``runs_to_descriptors``: coalesce page pairs into runs contiguous on both sides, then into
  ``(src_addr, dst_addr, nbytes)`` uint64 descriptors per region pair. :func:`coalesce_runs` (package level) is
  ``pages_to_runs`` as host numpy, optionally bounded to pages: what callers outside the translators use.
* ``kernel_page_ids``: ids a page-major layout gives attention kernels.
* ``rank_local_positions``: what a decode-context-parallel rank owns and its rank-local rows.

Three implementations expose the same functions (:class:`Translator`): ``reference`` (torch, any device),
``cpu`` (numba), ``cuda`` (cupy). :func:`get_translator` picks one per device; ``impl=`` or the environment
variable ``UMALLOC_TRANSLATOR`` forces one. This package imports nothing from the rest of umalloc except
:mod:`umalloc.errors`.
"""

from umalloc.translators._common import (
    MAX_PHYSICAL_PAGES,
    SINK_PAGE,
    STRICT_DEFAULT,
    TOMBSTONE,
    IndexLike,
    RegionsLike,
)
from umalloc.translators._dispatch import (
    ENV_VAR,
    IMPL_NAMES,
    Translator,
    available_impls,
    get_translator,
    load_impl,
)
from umalloc.translators.runs import coalesce_runs

__all__ = [
    "ENV_VAR",
    "IMPL_NAMES",
    "MAX_PHYSICAL_PAGES",
    "SINK_PAGE",
    "STRICT_DEFAULT",
    "TOMBSTONE",
    "IndexLike",
    "RegionsLike",
    "Translator",
    "available_impls",
    "coalesce_runs",
    "get_translator",
    "load_impl",
]
