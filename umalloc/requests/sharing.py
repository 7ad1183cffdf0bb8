"""Sharing pages between the requests of a :class:`~umalloc.requests.table.RequestTable`: a prefix hit attaching
pages another request (or the cache) holds, and de-duplication swapping a request's page for an equal one. One
concept, the table's Note [Holders] applied to pages that change hands; the table validates the arguments and
calls these with the checked slot and pages (``table`` is that RequestTable: this module imports nothing of it,
so the dependency goes one way).

Not thread-safe, as the table.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from umalloc.errors import InvalidIdError, NotAllocatedError, UmallocValueError
from umalloc.requests.refcounts import (
    PAGE_CACHED,
    PAGE_HELD,
    PAGE_NOT_MANAGED,
    PG_ENG,
    PG_NEED,
    PG_REF,
    PG_STATE,
    RQ_FRONT,
    RQ_LEN,
    k_revive,
    k_unref,
)


def attach_pages(table: Any, s: int, vp: np.ndarray, revive: bool) -> bool:
    """:meth:`~umalloc.requests.table.RequestTable.attach_prefix` for live slot ``s`` and checked pages ``vp``."""
    ps = table.page_size
    n = vp.shape[0] * ps
    if table._rq[RQ_LEN, s] != 0:
        raise UmallocValueError(f"attach_prefix: request {s} holds {int(table._rq[RQ_LEN, s])} tokens; allowed an "
                                f"empty request")
    if n > table.max_tokens_per_request:
        raise UmallocValueError(f"attach_prefix: {n} tokens; allowed at most {table.max_tokens_per_request}")
    if np.unique(vp).shape[0] != vp.shape[0]:
        raise InvalidIdError("attach_prefix: a page appears twice; allowed each page once")
    state = table._pg[PG_STATE, vp]
    held = (state == PAGE_HELD) | ((state == PAGE_CACHED) if revive else False)
    if not held.all():
        bad = int(vp[np.flatnonzero(~held)[0]])
        raise NotAllocatedError(f"attach_prefix: virtual page {bad} is not held (cached pages need reclaim "
                                f"first, or revive=True); allowed pages with a holder")
    fronts = [min(vp.shape[0], max(0, n - int(w)) // ps) if w else 0 for w in table._win]
    bound: list[tuple[str, np.ndarray]] = []
    for b, end in enumerate(table.bound_ends):
        mine = vp[fronts[b]:]
        missing = mine[table.alloc.translate_pages(torch.from_numpy(mine), end, strict=False).numpy() <= 0]
        if missing.size:
            if not table.alloc.bind_end(end, torch.from_numpy(missing * ps)):
                for end2, pages in bound:
                    table.alloc.unbind_pages(end2, pages)
                return False
            bound.append((end, missing))
    cached = vp[state == PAGE_CACHED]
    if cached.size:   # out of the LRU, held: k_revive adds an engine reference, taken back at once
        k_revive(table._pg, table._lru, cached)
        table._pg[PG_ENG, cached] -= 1
        table._pg[PG_REF, cached] -= 1
        table._counters["reclaimed"] += int(cached.size)
    table._r2p[s, : vp.shape[0]] = vp
    pos = np.arange(n, dtype=np.int64)
    table._r2t[s, :n] = vp[pos // ps] * ps + pos % ps
    table._rq[RQ_LEN, s] = n
    table._pg[PG_REF, vp] += 1
    for b in range(len(table.bound_ends)):
        table._rq[RQ_FRONT + b, s] = fronts[b]
        table._pg[PG_NEED + b, vp[fronts[b]:]] += 1
    table._device_rows.push_ranges(np.array([s], np.int64), np.zeros(1, np.int64), np.array([n], np.int64))
    return True


def swap_page(table: Any, s: int, j: int, vp: int) -> None:
    """:meth:`~umalloc.requests.table.RequestTable.share_page` for live slot ``s``, page index ``j`` and checked
    page ``vp``."""
    ps = table.page_size
    full = int(table._rq[RQ_LEN, s]) // ps
    if j >= full:
        raise UmallocValueError(f"share_page: page_index={j}; allowed a full page of request {s}, in [0, {full})")
    state = int(table._pg[PG_STATE, vp])
    if state == PAGE_NOT_MANAGED:
        raise NotAllocatedError(f"share_page: virtual page {vp} is neither held nor cached")
    if vp in table._r2p[s, : -(-int(table._rq[RQ_LEN, s]) // ps)]:
        raise InvalidIdError(f"share_page: virtual page {vp} is already a page of request {s}; allowed another")
    old = int(table._r2p[s, j])
    one = np.array([vp], np.int64)
    k_revive(table._pg, table._lru, one)     # + 1 holder (an engine reference, made the request's just below)
    table._pg[PG_ENG, vp] -= 1
    if state == PAGE_CACHED:
        table._counters["reclaimed"] += 1
    table._r2p[s, j] = vp
    table._r2t[s, j * ps:(j + 1) * ps] = vp * ps + np.arange(ps)
    table._pg[PG_ENG, old] += 1            # the request's hold on the old page, dropped as an engine reference
    table._free_listed(k_unref(table._pg, table._lru, np.array([old], np.int64), False, table._freed))
    if table._dev is not None:
        table._device_rows.push_ranges(np.array([s], np.int64), np.array([j * ps], np.int64),
                                      np.array([(j + 1) * ps], np.int64))


__all__ = ["attach_pages", "swap_page"]
