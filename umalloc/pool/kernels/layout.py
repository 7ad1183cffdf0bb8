"""The host heap's layout constants, shared by the kernels, the heap that builds the arrays and the facade.

* ``meta`` is an ``int64 (E, M_NFIELDS)`` array, one row per end. The first groups are per end (band, geometry,
  offsets into the flat heaps, counters); the last group (``M_FLOORB`` ..) is the same in every row and names
  where the shared areas of ``h64`` start (Note [Host heaps] in :mod:`umalloc.pool.heap`).
* Grow codes (``_G_*``) encode :class:`~umalloc.geometry.spec.Grow` in ``meta[e, M_GROW]``.
* Virtual page states (``V_*``) are the owner's ``int8`` per-virtual-page codes in ``h8``.

No code here: only numbers every layer must agree on.
"""

from __future__ import annotations

# ---- meta columns (one int64 row per end; the last group is the same in every row) ------------------------
M_LO, M_HI, M_FIRST, M_TOP, M_PB, M_PS, M_GROW, M_POFF, M_VOFF, M_OWNER, M_NV = range(11)
M_LIVE, M_HOLES, M_PENDING, M_HINT, M_PEAK, M_ALLOCS, M_FREES, M_UNBOUND, M_MOVES = range(11, 20)
M_VLIVE, M_VHINT, M_STAMP, M_SPLIT = range(20, 24)
M_FLOORB, M_ARENAB, M_VT, M_CHOFF, M_ERROFF, M_SCROFF, M_NE, M_HBOFF, M_VBOFF, M_PSOFF, M_PGOFF, M_PSHIFT, M_NFIELDS = \
    range(24, 37)

# ---- grow codes ------------------------------------------------------------------------------------------------
G_UP, G_DOWN, G_FLOAT = 0, 1, 2

# ---- virtual page states (owner ends) -----------------------------------------------------------------------
V_NEVER, V_LIVE, V_FREED, V_RESERVED = 0, 1, 2, 3

SPLIT_ONE = 1_000_000  # float_split is stored in parts per million
MASK_SLOTS = 64  # cached bind masks per allocator

__all__ = ["V_FREED", "V_LIVE", "V_NEVER", "V_RESERVED"]
