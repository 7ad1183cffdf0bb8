"""Descriptor batches: built from index vectors and bounds-checked once, then, when a backend posts them,
located against the registered regions and cut into bounded engine submissions.

A descriptor batch is a C-contiguous ``(N, 3)`` ``uint64`` numpy array of ``(src_addr, dst_addr, nbytes)`` rows.

Building (a plan's vectors, :func:`vector_descriptors`):

* Input ids are numpy ``int64`` 1-D arrays of *physical* ids (pages, or token rows ``page * page_size + row``),
  already checked non-negative by their vector; output descriptors are a read-only numpy ``uint64`` ``(N, 3)``
  array, member-major (one block of rows per region-group member), page runs before row runs.
* Run coalescing is the translators' ``pages_to_runs`` through :func:`umalloc.translators.coalesce_runs` (the
  one implementation); a row run never crosses a page boundary on either side (rows of two pages are not
  adjacent bytes: Note [Boundary page] in :mod:`umalloc.transfer.build`).
* Every id is checked against its end's last page *before* any address arithmetic (an id past it could wrap a
  uint64 address back into the arena), every group member against the side's registered regions, then every
  descriptor, vectorized, against the region and arena, the handable page range and the pages the plan leases
  on that side. A violation raises :class:`~umalloc.errors.DescriptorBoundsError` naming the first bad row and
  nothing is returned. The check runs once, when the plan is built; nothing re-checks a built plan's rows.
* Cost: O(ids + descriptors * log leased pages) numpy work per vector, a handful of calls; no Python loop over
  pages, rows or runs (loops run over region-group members, a handful).

Posting (a backend, any batch):

* A raw batch (``write_descriptors``) is validated once by :func:`as_descriptors`; a plan's batch was
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
from typing import Any, NamedTuple

import numpy as np
from numba import njit

from umalloc.errors import DescriptorBoundsError, InvariantError, UmallocValueError
from umalloc.geometry.region import Region, RegionGroup
from umalloc.transfer.layout import ADDRESS_LIMIT, EndGeometry, PeerLayout
from umalloc.transfer.slices import pair_pieces, same_slices, slice_descriptors
from umalloc.translators import coalesce_runs

EMPTY_IDS = np.zeros(0, dtype=np.int64)
EMPTY_IDS.setflags(write=False)
_EMPTY_RUNS = np.zeros((0, 3), dtype=np.int64)
_EMPTY_RUNS.setflags(write=False)
_NO_DESCRIPTORS = np.zeros((0, 3), dtype=np.uint64)
_NO_DESCRIPTORS.setflags(write=False)


class VectorDescriptors(NamedTuple):
    """What :func:`vector_descriptors` returns.

    Attributes:
        descriptors: read-only uint64 ``(N, 3)`` ``(src_addr, dst_addr, nbytes)``.
        page_runs, row_runs: runs coalesced from the page pairs and from the row pairs (for a slice vector,
            ``row_runs`` is its merged descriptors).
        slice_pieces: for a slice vector (two sides of different TP, page size or head groups), the
            descriptors one per (token row, head slice piece) would be; ``0`` otherwise.
    """

    descriptors: np.ndarray
    page_runs: int
    row_runs: int
    slice_pieces: int = 0


class SideBounds(NamedTuple):
    """One side of a vector for :func:`vector_descriptors`: its layout, end geometry, region group and the
    sorted unique int64 pages the plan leases on that end (the only pages a descriptor may touch)."""

    layout: PeerLayout
    geom: EndGeometry
    group: RegionGroup
    leased: np.ndarray


def vector_descriptors(vector: str, src_pages: np.ndarray, dst_pages: np.ndarray, src_rows: np.ndarray,
                       dst_rows: np.ndarray, src: SideBounds, dst: SideBounds,
                       translator: Any = None) -> VectorDescriptors:
    """Bounds-checked descriptors of one vector.

    Args:
        vector: the vector's name (for messages).
        src_pages, dst_pages: int64 ``(n,)`` physical page pairs, non-negative; pair ``i`` is one envelope copy.
        src_rows, dst_rows: int64 ``(m,)`` physical token-row pairs, non-negative; pair ``i`` copies one row of
            every layer block.
        src, dst: the two sides (:class:`SideBounds`).
        translator: the translator that coalesces runs (:func:`umalloc.translators.coalesce_runs`'s
            ``translator``; default None: the host one, numpy in and out).

    Returns:
        :class:`VectorDescriptors`.

    Raises:
        UmallocValueError: whole-page pairs between ends that differ in TP, page size or head groups (those
            travel as token rows through :mod:`umalloc.transfer.slices`).
        DescriptorBoundsError: an id past its end's last page, a group member that is not a registered region of
            its side or steps by other than the end's page bytes, or a descriptor outside the region and arena,
            the handable pages or the leased pages. Nothing is returned.

    Complexity: O(n + m * blocks * members + N log leased).
    """
    s_geom, d_geom = src.geom, dst.geom
    own = src.group is src.layout.region_group(s_geom.name) and dst.group is dst.layout.region_group(d_geom.name)
    if not same_slices(src.layout, dst.layout, s_geom, d_geom):
        return _slice_vector(vector, src_pages, src_rows, dst_rows, src, dst, own)
    if not own:  # a layout's own groups are right by construction
        for side, bounds in (("src", src), ("dst", dst)):
            _check_group(vector, side, bounds)
    # the compiled check below covers page ids; row ids are checked first (spreading them could overflow)
    fast = own and len(src.group.members) == 1
    _check_ids(vector, "src", EMPTY_IDS if fast else src_pages, src_rows, s_geom)
    _check_ids(vector, "dst", EMPTY_IDS if fast else dst_pages, dst_rows, d_geom)
    # row runs stay inside one page on both sides (the spread form of coalesce_runs)
    page_runs = coalesce_runs(src_pages, dst_pages, translator=translator) if src_pages.shape[0] else _EMPTY_RUNS
    row_runs = coalesce_runs(src_rows, dst_rows, page_size=s_geom.page_size, translator=translator) \
        if src_rows.shape[0] else _EMPTY_RUNS
    if page_runs.shape[0] == 0 and row_runs.shape[0] == 0:
        return VectorDescriptors(_NO_DESCRIPTORS, 0, 0)
    if len(src.group.members) == 1:
        desc = np.empty((page_runs.shape[0] + row_runs.shape[0] * s_geom.num_blocks, 3), dtype=np.uint64)
        s_lim, s_pages = src.layout.page_limits(s_geom.name) if own else _limits(src)
        d_lim, d_pages = dst.layout.page_limits(d_geom.name) if own else _limits(dst)
        bad = _fill_checked(page_runs, row_runs, s_geom.page_size, s_geom.block_offs, s_geom.block_bytes,
                            np.uint64(s_geom.page_bytes), s_lim, d_lim, s_pages, d_pages, src.leased,
                            dst.leased, np.uint64(src.group.members[0].base_addr),
                            np.uint64(dst.group.members[0].base_addr), desc)
        if bad >= 0:  # the vectorized checks name the first bad id or row and its reason
            _check_ids(vector, "src", src_pages, src_rows, s_geom)
            _check_ids(vector, "dst", dst_pages, dst_rows, d_geom)
            for side, col, bounds in (("src", 0, src), ("dst", 1, dst)):
                _check_side(vector, side, desc[:, col], desc[:, 2], None, bounds)
            raise InvariantError(f"vector {vector!r}: descriptor {bad} failed the compiled bounds check but not "
                                 "the vectorized one")
    else:
        parts = []
        if page_runs.shape[0]:
            parts.append(_page_descriptors(page_runs, src.group, dst.group))
        if row_runs.shape[0]:
            parts.append(_row_descriptors(row_runs, s_geom, src.group, dst.group))
        desc = parts[0] if len(parts) == 1 else np.concatenate(parts)
        k = len(src.group.members)
        for side, col, bounds in (("src", 0, src), ("dst", 1, dst)):
            _check_side(vector, side, desc[:, col], desc[:, 2], _members(parts, k), bounds)
    desc.setflags(write=False)
    return VectorDescriptors(desc, int(page_runs.shape[0]), int(row_runs.shape[0]))


def _slice_vector(vector: str, src_pages: np.ndarray, src_rows: np.ndarray, dst_rows: np.ndarray,
                  src: SideBounds, dst: SideBounds, own: bool) -> VectorDescriptors:
    """Descriptors of a vector between ends of different TP, page size or head groups
    (:mod:`umalloc.transfer.slices`): token rows only, checked before and after the arithmetic."""
    if src_pages.shape[0] or not own:
        raise UmallocValueError(f"vector {vector!r}: ends {src.geom.name!r} and {dst.geom.name!r} differ in TP, "
                                "page size or head groups: allowed token-row pairs on the layouts' own region groups "
                                "(build the plan with umalloc.transfer.build)")
    _check_ids(vector, "src", EMPTY_IDS, src_rows, src.geom)
    _check_ids(vector, "dst", EMPTY_IDS, dst_rows, dst.geom)
    pieces = pair_pieces(src.layout, src.geom.name, dst.layout, dst.geom.name)
    desc, unmerged = slice_descriptors(src_rows, dst_rows, pieces, src.layout, src.geom.name, dst.layout,
                                       dst.geom.name)
    for side, col, bounds in (("src", 0, src), ("dst", 1, dst)):
        _check_side(vector, side, desc[:, col], desc[:, 2], None, bounds)
    return VectorDescriptors(desc, 0, int(desc.shape[0]), unmerged)


@njit(cache=True, nogil=True)
def _side_ok(addr: np.uint64, n: np.uint64, arena_lo: np.uint64, lo: np.uint64, hi: np.uint64, pb: np.uint64,
             first: np.int64, top: np.int64, leased: np.ndarray) -> bool:
    """One descriptor side inside ``[lo, hi)``, the handable pages and the leased pages (sorted unique)."""
    if addr < lo or addr > hi or n == 0 or n > hi - addr:
        return False
    off = addr - arena_lo
    p_lo = np.int64(off // pb)
    p_hi = np.int64((off + n - np.uint64(1)) // pb)
    if p_lo < first or p_hi > top:
        return False
    i = np.searchsorted(leased, p_lo)
    j = i + (p_hi - p_lo)
    return j < leased.shape[0] and leased[i] == p_lo and leased[j] == p_hi


@njit(cache=True, nogil=True)
def _fill_checked(page_runs: np.ndarray, row_runs: np.ndarray, ps: np.int64, offs: np.ndarray,
                  tok_bytes: np.ndarray, item: np.uint64, s_lim: np.ndarray, d_lim: np.ndarray,
                  s_pages: np.ndarray, d_pages: np.ndarray, s_leased: np.ndarray, d_leased: np.ndarray,
                  s_base: np.uint64, d_base: np.uint64, out: np.ndarray) -> np.int64:
    """Fill ``out`` with the descriptors of one-member groups (page runs, then row runs x blocks) and check both
    sides as :func:`_check_ids` and :func:`_check_side` do; returns the first bad run or row, or -1.
    ``*_lim``: uint64 ``(arena_lo, lo, hi, page_bytes)``; ``*_pages``: int64 ``(first, top)``; ``*_base``: the
    members' base addresses. Ids past an end's last page are refused before any address arithmetic."""
    for r in range(page_runs.shape[0]):
        if page_runs[r, 0] + page_runs[r, 2] - 1 > s_pages[1] or page_runs[r, 1] + page_runs[r, 2] - 1 > d_pages[1]:
            return np.int64(r)
    for r in range(row_runs.shape[0]):
        if row_runs[r, 0] // ps > s_pages[1] or row_runs[r, 1] // ps > d_pages[1]:
            return np.int64(r)
    k = 0
    bad = np.int64(-1)
    for r in range(page_runs.shape[0]):
        out[k, 0] = s_base + np.uint64(page_runs[r, 0]) * item
        out[k, 1] = d_base + np.uint64(page_runs[r, 1]) * item
        out[k, 2] = np.uint64(page_runs[r, 2]) * item
        k += 1
    ups = np.uint64(ps)
    for r in range(row_runs.shape[0]):
        st, dt = np.uint64(row_runs[r, 0]), np.uint64(row_runs[r, 1])
        s0 = s_base + (st // ups) * item
        d0 = d_base + (dt // ups) * item
        cnt = np.uint64(row_runs[r, 2])
        for b in range(offs.shape[0]):
            out[k, 0] = s0 + offs[b] + (st % ups) * tok_bytes[b]
            out[k, 1] = d0 + offs[b] + (dt % ups) * tok_bytes[b]
            out[k, 2] = cnt * tok_bytes[b]
            k += 1
    for i in range(k):
        if not (_side_ok(out[i, 0], out[i, 2], s_lim[0], s_lim[1], s_lim[2], s_lim[3], s_pages[0], s_pages[1],
                         s_leased)
                and _side_ok(out[i, 1], out[i, 2], d_lim[0], d_lim[1], d_lim[2], d_lim[3], d_pages[0], d_pages[1],
                             d_leased)):
            bad = i
            break
    return bad


def _limits(bounds: SideBounds) -> tuple[np.ndarray, np.ndarray]:
    """``(uint64 (arena_lo, lo, hi, page_bytes), int64 (first, top))`` of a one-member side."""
    mem, layout, geom = bounds.group.members[0], bounds.layout, bounds.geom
    arena_lo = layout.arena_base_ptr
    lo = max(mem.region.base_ptr, arena_lo)
    hi = min(mem.region.end_ptr, arena_lo + layout.spec.arena_bytes)
    return (np.array([arena_lo, lo, max(lo, hi), geom.page_bytes], dtype=np.uint64),
            np.array([geom.first_page, geom.top_page], dtype=np.int64))


def _members(parts: list[np.ndarray], k: int) -> np.ndarray | None:
    """Member index of every descriptor row (``None`` for one-member groups: every row is member 0)."""
    if k == 1:
        return None
    return np.concatenate([np.repeat(np.arange(k, dtype=np.int64), p.shape[0] // k) for p in parts])


def _page_descriptors(runs: np.ndarray, src_group: RegionGroup, dst_group: RegionGroup) -> np.ndarray:
    """``(K * R, 3)`` uint64 whole-envelope descriptors of ``R`` page runs (member-major). The ids were checked
    against the ends' last pages, so no address overflows."""
    k, r = len(src_group.members), runs.shape[0]
    out = np.empty((k, r, 3), dtype=np.uint64)
    u = runs.astype(np.uint64)
    for m, (sm, dm) in enumerate(zip(src_group.members, dst_group.members, strict=True)):
        item = np.uint64(sm.item_bytes)
        np.multiply(u[:, 0], item, out=out[m, :, 0])
        out[m, :, 0] += np.uint64(sm.base_addr)
        np.multiply(u[:, 1], item, out=out[m, :, 1])
        out[m, :, 1] += np.uint64(dm.base_addr)
        np.multiply(u[:, 2], item, out=out[m, :, 2])
    return out.reshape(k * r, 3)


def _row_descriptors(runs: np.ndarray, geom: EndGeometry, src_group: RegionGroup, dst_group: RegionGroup
                     ) -> np.ndarray:
    """``(K * R * B, 3)`` uint64 descriptors (member-major, then run, then layer block)."""
    offs, tok_bytes = geom.block_offs, geom.block_bytes
    ps = geom.page_size
    k, r, b = len(src_group.members), runs.shape[0], offs.shape[0]
    out = np.empty((k, r, b, 3), dtype=np.uint64)
    u = runs.astype(np.uint64)
    s_page, s_row = u[:, 0] // np.uint64(ps), u[:, 0] % np.uint64(ps)
    d_page, d_row = u[:, 1] // np.uint64(ps), u[:, 1] % np.uint64(ps)
    for m, (sm, dm) in enumerate(zip(src_group.members, dst_group.members, strict=True)):  # K is tiny (regions)
        s_base = np.uint64(sm.base_addr) + s_page * np.uint64(sm.item_bytes)
        d_base = np.uint64(dm.base_addr) + d_page * np.uint64(dm.item_bytes)
        out[m, :, :, 0] = s_base[:, None] + offs[None, :] + s_row[:, None] * tok_bytes[None, :]
        out[m, :, :, 1] = d_base[:, None] + offs[None, :] + d_row[:, None] * tok_bytes[None, :]
        out[m, :, :, 2] = u[:, 2][:, None] * tok_bytes[None, :]
    return out.reshape(k * r * b, 3)


def _refuse_first(ok: np.ndarray, sel: np.ndarray | None, vector: str, side: str, why: str,
                  *cols: np.ndarray) -> None:
    """Raise :class:`DescriptorBoundsError` naming the first row ``i`` where ``ok`` is False; ``why`` is
    formatted with row ``i`` of each of ``cols`` (``{0}``, ``{1}``, ...)."""
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        row = i if sel is None else int(sel[i])
        raise DescriptorBoundsError(f"vector {vector!r} {side} descriptor {row}: "
                                    f"{why.format(*(int(c[i]) for c in cols))}; nothing was sent")


def _check_side(vector: str, side: str, desc_addr: np.ndarray, nbytes: np.ndarray, member: np.ndarray | None,
                bounds: SideBounds) -> None:
    """Vectorized bounds check of one side of one vector's descriptors (DescriptorBoundsError on the first bad
    row, naming it). O(N log leased)."""
    layout, end, leased = bounds.layout, bounds.geom, bounds.leased
    first, top = end.first_page, end.top_page
    pb = np.uint64(end.page_bytes)  # == every member's item_bytes (_check_group)
    arena_lo = layout.arena_base_ptr
    arena_hi = arena_lo + layout.spec.arena_bytes
    for m, mem in enumerate(bounds.group.members):
        if member is None:
            sel, addr, n = None, desc_addr, nbytes
        else:
            sel = np.flatnonzero(member == m)
            if sel.size == 0:
                continue
            addr, n = desc_addr[sel], nbytes[sel]
        lo = np.uint64(max(mem.region.base_ptr, arena_lo))
        hi = np.uint64(min(mem.region.end_ptr, arena_hi))
        # hi - addr wraps where addr > hi, but that row already fails addr <= hi; n - 1 wraps to 2**64 - 1 for
        # n == 0, which no room exceeds
        _refuse_first((addr >= lo) & (addr <= hi) & (n - np.uint64(1) < hi - addr), sel, vector, side,
                      f"bytes [{{0}}, {{0}} + {{1}}) fall outside the registered region and arena [{lo}, {hi})",
                      addr, n)
        off = addr - np.uint64(arena_lo)
        p_lo = (off // pb).astype(np.int64)
        p_hi = ((off + n - np.uint64(1)) // pb).astype(np.int64)
        _refuse_first((p_lo >= first) & (p_hi <= top), sel, vector, side,
                      f"pages [{{0}}, {{1}}] of end {end.name!r} leave the handable range [{first}, {top}] (page 0 "
                      "and the reserved floor are never transferred)", p_lo, p_hi)
        covered = np.searchsorted(leased, p_hi, "right") - np.searchsorted(leased, p_lo, "left")
        _refuse_first(covered == p_hi - p_lo + 1, sel, vector, side,
                      f"pages [{{0}}, {{1}}] of end {end.name!r} are not all leased by this plan", p_lo, p_hi)


def _check_ids(vector: str, side: str, pages: np.ndarray, rows: np.ndarray, end: EndGeometry) -> None:
    """Refuse a page id, or the page of a row id, past the end's last page *before* any address arithmetic:
    such an id could wrap a uint64 address back into the arena and slip past :func:`_check_side`."""
    for what, ids, limit in (("page", pages, end.top_page), ("row", rows, (end.top_page + 1) * end.page_size - 1)):
        if ids.shape[0] and int(ids.max()) > limit:
            i = int(np.flatnonzero(ids > limit)[0])
            raise DescriptorBoundsError(
                f"vector {vector!r} {side} {what} id {int(ids[i])} (entry {i}) lies outside the pages of end "
                f"{end.name!r} (last page {end.top_page}); nothing was sent")


def _check_group(vector: str, side: str, bounds: SideBounds) -> None:
    """A group's members must step by the end's page bytes and lie inside a region that side registered."""
    end = bounds.geom
    for m, mem in enumerate(bounds.group.members):
        if mem.item_bytes != end.page_bytes:
            raise DescriptorBoundsError(f"vector {vector!r} {side}: region member {m} steps {mem.item_bytes} B "
                                        f"but end {end.name!r} pages are {end.page_bytes} B")
        if not any(r.contains(mem.region.base_ptr, mem.region.nbytes) for r in bounds.layout.regions):
            raise DescriptorBoundsError(f"vector {vector!r} {side}: region member {m} "
                                        f"({mem.region.base_ptr}, {mem.region.nbytes}) is not a registered region "
                                        f"of that side")
        if mem.base_addr + (end.top_page + 1) * end.page_bytes > ADDRESS_LIMIT:
            raise DescriptorBoundsError(f"vector {vector!r} {side}: region member {m} addresses page "
                                        f"{end.top_page} of end {end.name!r} past 2**64 (offset "
                                        f"{mem.offset_bytes} B); allowed addresses below 2**64")


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


__all__ = ["MAX_BATCH_BYTES", "MAX_BATCH_DESCRIPTORS", "Chunk", "SideBounds", "VectorDescriptors", "as_descriptors",
           "check_batch_limits", "chunk_descriptors", "chunk_located", "locate", "locate_ranges", "region_ranges",
           "vector_descriptors"]
