"""Descriptor batches against registered regions: validation of raw batches and vectorised region lookup.

Policy:

* A descriptor batch is a C-contiguous ``(N, 3)`` ``uint64`` numpy array of ``(src_addr, dst_addr, nbytes)``
  rows. A raw batch (``write_descriptors``) is validated once by :func:`as_descriptors`; a plan's batch was
  validated when the plan was built and is not validated again.
* Every batch, raw or from a plan, is located against the regions registered now (sources: this side's engine
  regions; destinations: the regions in the peer's metadata) by :func:`locate`: a range outside every region
  raises :class:`~umalloc.errors.DescriptorBoundsError` before anything is sent. Regions are sorted by base and
  disjoint; the lookup is one ``searchsorted``, O(N log R).
* Bounded batches (Note [Bounded batches]): every batch is posted in chunks of at most ``max_batch_descriptors``
  descriptors and ``max_batch_bytes`` bytes, each chunk its own engine submission (:func:`chunk_descriptors`).

Note [Bounded batches]
~~~~~~~~~~~~~~~~~~~~~~
Engines bound what one submission may carry: Mooncake's TCP transport refuses more than 2,048 descriptors in
flight per peer by default (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``), and SGLang's disaggregation caps a
batch at 1 GiB. So a backend cuts every batch, a plan's or a raw one, before the engine sees it:

* a descriptor longer than ``max_batch_bytes`` is first cut into contiguous pieces of ``max_batch_bytes``
  (the last one shorter), in order, so no submission exceeds the byte cap;
* the rows, in order, are then cut greedily into chunks: a chunk takes rows while it holds at most
  ``max_batch_descriptors`` of them and at most ``max_batch_bytes`` bytes;
* each chunk is one engine submission (NIXL: one request per chunk and memory-kind group); every chunk runs under
  the plan's leases, the handle is done when every chunk is done and failed when any failed, and the in-flight
  and in-doubt rules count every chunk (Note [Deadlines and in-flight parts] in :mod:`umalloc.backends.handle`).

Defaults, on every backend, configurable per backend at construction: :data:`MAX_BATCH_DESCRIPTORS` (2048) and
:data:`MAX_BATCH_BYTES` (1 GiB).

::

    rows   |a:400|b:2500            |c:300|d:100|e:100|        max 3 descriptors, 1000 bytes
    pieces |a:400|b:1000|b:1000|b:500|c:300|d:100|e:100|
    chunks [a]   [b]    [b]    [b c d][e]                       -> 5 submissions
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from umalloc.errors import DescriptorBoundsError, UmallocValueError
from umalloc.geometry.region import Region

#: Default cap on descriptors per engine submission (Mooncake TCP's per-peer limit), Note [Bounded batches].
MAX_BATCH_DESCRIPTORS = 2048
#: Default cap on bytes per engine submission (1 GiB, SGLang's batch cap), Note [Bounded batches].
MAX_BATCH_BYTES = 1 << 30


def check_batch_limits(max_batch_descriptors: object, max_batch_bytes: object) -> None:
    """Validate the two caps of Note [Bounded batches]. O(1).

    Raises:
        UmallocValueError: either is not an ``int`` in ``[1, 2**63)`` (``bool`` refused), naming the argument.

    >>> check_batch_limits(2048, 1 << 30)
    """
    for what, v in (("max_batch_descriptors", max_batch_descriptors), ("max_batch_bytes", max_batch_bytes)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v < 1 << 63:
            raise UmallocValueError(f"{what}={v!r}: allowed an int in [1, 2**63)")


def chunk_descriptors(d: np.ndarray, max_batch_descriptors: int = MAX_BATCH_DESCRIPTORS,
                      max_batch_bytes: int = MAX_BATCH_BYTES) -> list[np.ndarray]:
    """Cut a validated descriptor batch into engine submissions (Note [Bounded batches]).

    Args:
        d: ``(N, 3)`` ``uint64`` rows ``(src_addr, dst_addr, nbytes)`` as returned by :func:`as_descriptors`
            (or a plan's batch); its type and shape are checked (O(1)), its values are not checked again.
        max_batch_descriptors: most rows in one chunk (int in ``[1, 2**63)``).
        max_batch_bytes: most bytes in one chunk (int in ``[1, 2**63)``); a longer row is first cut into
            contiguous pieces of this many bytes (the last piece shorter): piece ``k`` of row ``(s, t, n)`` is
            ``(s + k * B, t + k * B, min(B, n - k * B))``.

    Returns:
        The chunks in order, each a ``(N_i, 3)`` ``uint64`` array with ``1 <= N_i <= max_batch_descriptors`` rows
        and at most ``max_batch_bytes`` bytes; their concatenation is ``d`` with long rows cut into pieces.
        Chunks are views of ``d`` when no row was cut, else of one new array; ``d`` is never written. An empty
        batch gives ``[]``. Greedy: each chunk takes as many rows as both caps allow, so no two consecutive
        chunks fit together in one.

    Raises:
        UmallocValueError: a cap outside ``[1, 2**63)`` or not an int, or ``d`` not an ``(N, 3)`` ``uint64``
            array (nothing computed).

    Complexity: O(N) to cut long rows (vectorised; none cut: O(N) for one comparison), plus O(N) when the whole
    batch fits the byte cap, else O(N + C log N) for C chunks (one ``searchsorted`` per chunk).

    >>> d = np.array([[0, 0, 400], [400, 400, 2500], [3000, 3000, 300], [4000, 4000, 100]], np.uint64)
    >>> [c[:, 2].tolist() for c in chunk_descriptors(d, 3, 1000)]
    [[400], [1000], [1000], [500, 300, 100]]
    """
    check_batch_limits(max_batch_descriptors, max_batch_bytes)
    if not (isinstance(d, np.ndarray) and d.dtype == np.uint64 and d.ndim == 2 and d.shape[1] == 3):
        raise UmallocValueError(f"descriptors: {type(d).__name__} {getattr(d, 'dtype', '')} "
                                f"{getattr(d, 'shape', '')}, allowed an (N, 3) uint64 array (see as_descriptors)")
    cap_n, cap_b = int(max_batch_descriptors), np.uint64(max_batch_bytes)
    n = d.shape[0]
    if n == 0:
        return []
    nb = d[:, 2]
    if bool((nb > cap_b).any()):
        d = _cut_long_rows(d, cap_b)
        n, nb = d.shape[0], d[:, 2]
    cum = np.cumsum(nb, dtype=np.uint64)
    if cum[-1] <= cap_b:  # the byte cap binds nowhere: chunks of cap_n rows
        return [d[i:i + cap_n] for i in range(0, n, cap_n)]
    out = []
    i = 0
    done = np.uint64(0)  # bytes in chunks already cut
    while i < n:
        j = min(int(np.searchsorted(cum, done + cap_b, side="right")), i + cap_n)  # > i: every row <= cap_b
        out.append(d[i:j])
        done = cum[j - 1]
        i = j
    return out


#: One engine submission: ``(descriptors (N_i, 3) uint64, source region index (N_i,) int64, destination region
#: index (N_i,) int64)``, at most ``max_batch_descriptors`` rows and ``max_batch_bytes`` bytes.
Chunk = tuple[np.ndarray, np.ndarray, np.ndarray]


def chunk_located(d: np.ndarray, src_idx: np.ndarray, dst_idx: np.ndarray, max_batch_descriptors: int,
                  max_batch_bytes: int, src_regions: Any, dst_regions: Any) -> list[Chunk]:
    """A located batch cut by :func:`chunk_descriptors`, each chunk with the region indices of its rows.

    ``src_idx``/``dst_idx`` are :func:`locate`'s indices of ``d``'s rows; ``src_regions``/``dst_regions`` have the
    sorted ``starts``/``ends`` they were located in (a backend's registry, a peer's info). Chunks of uncut rows
    take slices of the indices; when a row was cut (longer than ``max_batch_bytes``), the pieces lie inside their
    row's regions and are located again (no error possible). O(N), plus O(N log R) when a row was cut.
    """
    chunks = chunk_descriptors(d, max_batch_descriptors, max_batch_bytes)
    if sum(c.shape[0] for c in chunks) != d.shape[0]:  # a row was cut into pieces
        return [(c, locate_ranges(c[:, 0], c[:, 2], src_regions.starts, src_regions.ends),
                 locate_ranges(c[:, 1], c[:, 2], dst_regions.starts, dst_regions.ends)) for c in chunks]
    out = []
    a = 0
    for c in chunks:
        b = a + c.shape[0]
        out.append((c, src_idx[a:b], dst_idx[a:b]))
        a = b
    return out


def _cut_long_rows(d: np.ndarray, cap_b: np.uint64) -> np.ndarray:
    """``d`` with every row longer than ``cap_b`` bytes cut into contiguous pieces of ``cap_b`` (the last one
    shorter), rows in order. O(N + pieces), vectorised."""
    nb = d[:, 2]
    counts = ((nb + cap_b - np.uint64(1)) // cap_b).astype(np.int64)
    rows = np.repeat(np.arange(d.shape[0]), counts)
    first = np.cumsum(counts) - counts
    off = (np.arange(rows.shape[0], dtype=np.int64) - np.repeat(first, counts)).astype(np.uint64) * cap_b
    out = np.empty((rows.shape[0], 3), dtype=np.uint64)
    out[:, 0] = d[rows, 0] + off
    out[:, 1] = d[rows, 1] + off
    out[:, 2] = np.minimum(nb[rows] - off, cap_b)
    return out


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
