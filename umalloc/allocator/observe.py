"""Observability of the allocator core: the stats schema, read-only end views, snapshot equality, invariants.

* :class:`EndStats` is the fixed schema :meth:`MultiEndedAllocator.stats` returns per end.
* :class:`~umalloc.pool.views.EndView` (the pool's typed view of one end) is re-exported here for the facade.
* :func:`snapshots_equal` compares two snapshots; :func:`check_invariants` checks the heap's invariants
  (:func:`umalloc.pool.views.check_heap`) and the lease table's, and names the first broken one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from umalloc.geometry.spec import ArenaSpec
from umalloc.leases.table import LeaseTable
from umalloc.pool.heap import Heap
from umalloc.pool.views import EndView, check_heap


@dataclass(frozen=True)
class EndStats:
    """Fixed-schema statistics of one end (PyTorch-allocator style: current, peak, cumulative).

    Pages are in the end's own page units, bytes are ``pages * page_bytes``.

    Attributes:
        name, role, grow, owner: identity (``owner`` is the id-owner end's name, itself for an owner).
        page_size (tokens), page_bytes, first_page, top_page, num_page_slots: geometry.
        band_lo, band_hi: the band ``[band_lo, band_hi)`` in physical pages; watermark: ``band_hi`` for an up
            end, ``band_lo - 1`` for a down end, ``band_hi`` for a float end.
        live_pages, hole_pages, pending_pages, gap_pages, reserved_pages: page-state counts (they sum to
            ``num_page_slots``); gap pages may lie under another end's band.
        reachable_gap_pages: gap pages this end could grow into now (byte frontiers of its neighbours).
        free_pages: ``hole_pages + reachable_gap_pages`` (= :meth:`MultiEndedAllocator.available_pages`).
        live_bytes, hole_bytes, pending_bytes, free_bytes: the same in bytes.
        peak_live_pages, peak_live_bytes: high-water mark of live pages.
        pages_allocated, pages_freed, pages_unbound, pages_moved, bytes_moved: cumulative counters
            (freed by :meth:`~MultiEndedAllocator.free`, unbound by :meth:`~MultiEndedAllocator.unbind_end`,
            moved by compaction).
        pinned_pages: pages of this end pinned by leases now; leases_active: active leases naming this end;
            leases_expired: leases naming this end reclaimed at their deadline.
        in_doubt_pages: pages of this end pinned by in-doubt leases (F24: an engine may still touch them; they
            are counted in ``pinned_pages`` too, never as free or leaked); leases_in_doubt: in-doubt leases
            naming this end.
    """

    name: str
    role: str
    grow: str
    owner: str
    page_size: int
    page_bytes: int
    first_page: int
    top_page: int
    num_page_slots: int
    band_lo: int
    band_hi: int
    watermark: int
    live_pages: int
    hole_pages: int
    pending_pages: int
    gap_pages: int
    reserved_pages: int
    reachable_gap_pages: int
    free_pages: int
    live_bytes: int
    hole_bytes: int
    pending_bytes: int
    free_bytes: int
    peak_live_pages: int
    peak_live_bytes: int
    pages_allocated: int
    pages_freed: int
    pages_unbound: int
    pages_moved: int
    bytes_moved: int
    pinned_pages: int
    leases_active: int
    leases_expired: int
    in_doubt_pages: int = 0
    leases_in_doubt: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)



def snapshots_equal(a: Any, b: Any) -> bool:
    """Deep equality of two :meth:`MultiEndedAllocator.snapshot` results (numpy arrays compared by value)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, Mapping):
        return a.keys() == b.keys() and all(snapshots_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(snapshots_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    return a == b



def check_invariants(heap: Heap, spec: ArenaSpec, views: Mapping[str, EndView],
                     mirrors: Mapping[int, torch.Tensor], leases: LeaseTable) -> None:
    """Check every invariant of one allocator in O(slots + virtual pages): its heap's
    (:func:`umalloc.pool.views.check_heap` lists them), then its lease table's; raise :class:`~umalloc.errors.InvariantError`
    naming the first broken one."""
    check_heap(heap, spec, views, mirrors)
    leases.check_invariants()


def end_stats(heap: Heap, spec: ArenaSpec, views: Mapping[str, EndView], leases: LeaseTable,
              expired_by_end: Sequence[int]) -> dict[str, EndStats]:
    """The :class:`EndStats` of every end (``MultiEndedAllocator.stats``). O(ends + active leases)."""
    leases_by_end = [0] * len(heap.names)
    for lease in leases.active():
        for name, arr in lease.pages.items():
            if arr.size:
                leases_by_end[heap.index[name]] += 1
    doubt_by_end = [0] * len(heap.names)
    for lease in leases.in_doubt():
        for name, arr in lease.pages.items():
            if arr.size:
                doubt_by_end[heap.index[name]] += 1
    out = {}
    for i, name in enumerate(heap.names):
        v = views[name]
        es = spec.ends[i]
        pb = v.page_bytes
        live, holes, pend = v.live_pages, v.hole_pages, v.pending_pages
        first, top = v.first_page, v.top_page
        slots = top + 1
        reach = v.reachable_gap_pages
        peak, moved = v.peak_live_pages, v.pages_moved
        out[name] = EndStats(
            name=name, role=es.role.value, grow=es.grow.value, owner=v.owner,
            page_size=v.page_size, page_bytes=pb, first_page=first, top_page=top, num_page_slots=slots,
            band_lo=v.lo, band_hi=v.hi, watermark=v.watermark,
            live_pages=live, hole_pages=holes, pending_pages=pend,
            gap_pages=slots - first - live - holes - pend, reserved_pages=first,
            reachable_gap_pages=reach, free_pages=holes + reach,
            live_bytes=live * pb, hole_bytes=holes * pb, pending_bytes=pend * pb, free_bytes=(holes + reach) * pb,
            peak_live_pages=peak, peak_live_bytes=peak * pb,
            pages_allocated=v.pages_allocated, pages_freed=v.pages_freed, pages_unbound=v.pages_unbound,
            pages_moved=moved, bytes_moved=moved * pb,
            pinned_pages=leases.pins_current(name), leases_active=leases_by_end[i],
            leases_expired=expired_by_end[i], in_doubt_pages=leases.in_doubt_pages(name),
            leases_in_doubt=doubt_by_end[i],
        )
    return out


def snapshot(heap: Heap, views: Mapping[str, EndView], leases: LeaseTable) -> dict[str, Any]:
    """Every page's state and every table as copies (``MultiEndedAllocator.snapshot`` states the schema)."""
    ends = {}
    for i, name in enumerate(heap.names):
        v = views[name]
        ends[name] = {
            "state": v.state.copy(), "p2v": v.p2v.copy(), "v2p": v.v2p.copy(),
            "pins": np.array(heap.pins[i]), "band": (v.lo, v.hi), "watermark": v.watermark,
            "grow": v.grow.value, "owner": v.owner, "page_bytes": v.page_bytes, "page_size": v.page_size,
            "first_page": v.first_page, "top_page": v.top_page,
            "counters": {"live": v.live_pages, "holes": v.hole_pages, "pending": v.pending_pages,
                         "peak": v.peak_live_pages, "allocated": v.pages_allocated, "freed": v.pages_freed,
                         "unbound": v.pages_unbound, "moved": v.pages_moved},
        }
    owners = {}
    for o in heap.owners:
        owners[heap.names[o]] = {"vstate": heap.vstate(o).copy(), "live": heap.live_vpages(o)}
    held = [{"id": lease.id, "tag": lease.tag, "deadline": lease.deadline, "state": lease.state,
             "generation": lease.generation, "pages": {k: v.copy() for k, v in lease.pages.items()}}
            for lease in (*leases.active(), *leases.in_doubt())]
    return {"ends": ends, "owners": owners, "leases": held}


__all__ = ["EndStats", "EndView", "check_invariants", "end_stats", "snapshot", "snapshots_equal"]
