"""Descriptor batches against registered regions: validation of raw batches and vectorised region lookup.

Policy:

* A descriptor batch is a C-contiguous ``(N, 3)`` ``uint64`` numpy array of ``(src_addr, dst_addr, nbytes)``
  rows. A raw batch (``write_descriptors``) is validated once by :func:`as_descriptors`; a plan's batch was
  validated when the plan was built and is not validated again.
* Every batch, raw or from a plan, is located against the regions registered now (sources: this side's engine
  regions; destinations: the regions in the peer's metadata) by :func:`locate`: a range outside every region
  raises :class:`~umalloc.errors.DescriptorBoundsError` before anything is sent. Regions are sorted by base and
  disjoint; the lookup is one ``searchsorted``, O(N log R).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from umalloc.errors import DescriptorBoundsError, UmallocValueError
from umalloc.geometry.region import Region


def as_descriptors(descriptors: object) -> np.ndarray:
    """Validate a raw descriptor batch and return it as a C-contiguous ``(N, 3)`` ``uint64`` array.

    Rows are ``(src_addr, dst_addr, nbytes)``. Accepts any integer numpy dtype with non-negative values. O(N).

    Raises:
        UmallocValueError: not a 2-D ``(N, 3)`` integer array, a negative value, or an ``nbytes`` of 0.

    >>> as_descriptors(np.array([[4096, 8192, 16]], dtype=np.int64)).dtype
    dtype('uint64')
    """
    if not isinstance(descriptors, np.ndarray):
        raise UmallocValueError(f"descriptors: allowed a numpy (N, 3) uint64 array, got {type(descriptors).__name__}")
    d = descriptors
    if d.ndim != 2 or d.shape[1] != 3:
        raise UmallocValueError(f"descriptors.shape={d.shape}: allowed (N, 3) rows of (src_addr, dst_addr, nbytes)")
    if not np.issubdtype(d.dtype, np.integer):
        raise UmallocValueError(f"descriptors.dtype={d.dtype}: allowed an integer dtype (uint64)")
    if d.dtype != np.uint64:
        if d.size and int(d.min()) < 0:
            raise UmallocValueError("descriptors: allowed non-negative addresses and lengths")
        d = d.astype(np.uint64)
    d = np.ascontiguousarray(d)
    if d.shape[0] and not bool((d[:, 2] > 0).all()):
        row = int(np.flatnonzero(d[:, 2] == 0)[0])
        raise UmallocValueError(f"descriptor row {row}: nbytes=0, allowed > 0")
    return d


def region_ranges(regions: Sequence[Region]) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)`` ``uint64`` arrays of regions already sorted by base.

    >>> [a.tolist() for a in region_ranges([Region(100, 50)])]
    [[100], [150]]
    """
    starts = np.array([r.base_ptr for r in regions], dtype=np.uint64)
    ends = np.array([r.end_ptr for r in regions], dtype=np.uint64)
    return starts, ends


def locate_ranges(addrs: np.ndarray, nbytes: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Index of the region containing each ``[addr, addr + nbytes)``, or -1. Regions sorted by base,
    disjoint. O(N log R), vectorised.

    >>> s, e = np.array([100, 200], np.uint64), np.array([150, 300], np.uint64)
    >>> locate_ranges(np.array([100, 140, 250], np.uint64), np.array([50, 20, 50], np.uint64), s, e).tolist()
    [0, -1, 1]
    """
    if starts.size == 0:
        return np.full(addrs.shape[0], -1, dtype=np.int64)
    idx = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
    safe = np.maximum(idx, 0)
    end = ends[safe]
    room = np.where(addrs < end, end - np.minimum(addrs, end), np.uint64(0))
    ok = (idx >= 0) & (addrs >= starts[safe]) & (nbytes <= room)
    return np.where(ok, idx, -1)


def locate(d: np.ndarray, col: int, starts: np.ndarray, ends: np.ndarray, what: str) -> np.ndarray:
    """:func:`locate_ranges` of column ``col`` (0: sources, 1: destinations) of a batch.

    Raises:
        DescriptorBoundsError: naming the first row outside every region (``what`` says which side and why).
    """
    idx = locate_ranges(d[:, col], d[:, 2], starts, ends)
    if d.shape[0] and (idx < 0).any():
        row = int(np.flatnonzero(idx < 0)[0])
        raise DescriptorBoundsError(f"descriptor row {row}: [{int(d[row, col]):#x}, +{int(d[row, 2])}): {what}")
    return idx
