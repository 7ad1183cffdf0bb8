"""The host heap's layout constants, shared by the kernels, the heap that builds the arrays and the facade.

* ``meta`` is an ``int64 (E, _NFIELDS)`` array, one row per end. The first groups are per end (band, geometry,
  offsets into the flat heaps, counters); the last group (``_FLOORB`` ..) is the same in every row and names
  where the shared areas of ``h64`` start (Note [Host heaps] in :mod:`umalloc.pool.heap`).
* Grow codes (``_G_*``) encode :class:`~umalloc.geometry.spec.Grow` in ``meta[e, _GROW]``.
* Virtual page states (``V_*``) are the owner's ``int8`` per-virtual-page codes in ``h8``.

No code here: only numbers every layer must agree on.
"""

from __future__ import annotations

# ---- meta columns (one int64 row per end; the last group is the same in every row) ------------------------
_LO, _HI, _FIRST, _TOP, _PB, _PS, _GROW, _POFF, _VOFF, _OWNER, _NV = range(11)
_LIVE, _HOLES, _PENDING, _HINT, _PEAK, _ALLOCS, _FREES, _RELEASED, _MOVES = range(11, 20)
_VLIVE, _VHINT, _STAMP, _SPLIT = range(20, 24)
_FLOORB, _ARENAB, _VT, _CHOFF, _ERROFF, _SCROFF, _NE, _HBOFF, _VBOFF, _PSOFF, _PGOFF, _PSHIFT, _NFIELDS = \
    range(24, 37)

# ---- grow codes ------------------------------------------------------------------------------------------------
_G_UP, _G_DOWN, _G_FLOAT = 0, 1, 2

# ---- virtual page states (owner ends) -----------------------------------------------------------------------
V_NEVER, V_LIVE, V_FREED, V_RESERVED = 0, 1, 2, 3

SPLIT_ONE = 1_000_000  # float_split is stored in parts per million
_MASK_SLOTS = 64  # cached bind masks per allocator

__all__ = ["V_FREED", "V_LIVE", "V_NEVER", "V_RESERVED"]
