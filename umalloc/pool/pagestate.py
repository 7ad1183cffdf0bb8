"""Per-page state codes of an end's physical pages (host ``int8`` arrays of length ``num_page_slots(end)``).

Shared by :mod:`umalloc.allocator.facade`, :mod:`umalloc.pool.compaction` and :mod:`umalloc.leases.table` so that all three agree
on one encoding:

* ``PAGE_RESERVED`` (0): below ``first_page`` (the sink and the reserved floor); never handed out, moved or freed.
* ``PAGE_GAP`` (1): outside the end's band (the shared gap between facing ends, or beyond the arena).
* ``PAGE_HOLE`` (2): free, inside the band; handed out again before the watermark moves.
* ``PAGE_LIVE`` (3): mapped to a virtual page (``p2v[p] != TOMBSTONE``).
* ``PAGE_PENDING`` (4): freed while pinned by a lease; unreachable and not reusable until no lease pins it
  (then it becomes a hole; F11).

``TOMBSTONE`` (-1) marks an unmapped ``v2p``/``p2v`` entry; it is :data:`umalloc.translators.TOMBSTONE`,
re-exported here (the translators' constant is the one source: core depends on translators, not back).
"""

from __future__ import annotations

from umalloc.translators import TOMBSTONE

PAGE_RESERVED = 0
PAGE_GAP = 1
PAGE_HOLE = 2
PAGE_LIVE = 3
PAGE_PENDING = 4

__all__ = ["PAGE_GAP", "PAGE_HOLE", "PAGE_LIVE", "PAGE_PENDING", "PAGE_RESERVED", "TOMBSTONE"]
