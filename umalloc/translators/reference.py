"""Reference translators: plain torch tensor operations, on any device.

* The readable definition every other implementation is tested against (together with brute-force loops in
  the tests); correct on CPU, CUDA or any other torch device, not tuned for speed.
* Validation first, then the result: bad input raises a typed error before anything is written, so an
  ``out=`` survives an error unchanged (also one that aliases the input).
* Ids may be int64 or int32 (vLLM's and SGLang's block tables are int32); id results keep the input's dtype
  and a result that would not fit it is refused. Structural results (runs, DCP indices) are int64, v2p
  tables are int64.
* ``strict`` is a bool everywhere, default :data:`~umalloc.translators.STRICT_DEFAULT` (True): tombstones
  raise unless the caller passes ``strict=False`` (the allocator's ``translate`` has the same default).
* Validation reads values back to the host, so on CUDA each call synchronizes the stream once (more on the
  error path).
* ``runs_to_descriptors`` is host work whatever the device: descriptors are numpy ``uint64`` arrays handed to
  a transfer engine.

Note [Tombstones map to the sink]
    A v2p entry below zero (:data:`TOMBSTONE` is -1) marks a virtual page with no physical page bound. In
    strict mode translating it raises :class:`TombstoneError`. Otherwise it maps to physical page
    :data:`SINK_PAGE` (0), the reserved page padded lanes may hit, keeping the in-page offset: virtual token
    ``t`` becomes physical token ``0 * page_size + t % page_size``. Reads from the sink return garbage that
    nobody uses; writes land in a page that is never handed out (docs/architecture.md, "Terms": reserved
    floor / sink; docs/faults.md F05).
"""

from __future__ import annotations

import numpy as np
import torch

from umalloc.translators import _common as c

NAME = "reference"


def available() -> bool:
    """Always True: the reference needs only torch."""
    return True


def unavailable_reason() -> str | None:
    """None: the reference is always available."""
    return None


def supports_device(device: torch.device | str) -> bool:
    """True for every torch device."""
    return True


def virtual_to_physical(
    vtokens: c.IndexLike,
    v2p: c.IndexLike,
    page_size: int,
    *,
    out: torch.Tensor | np.ndarray | None = None,
    strict: bool = c.STRICT_DEFAULT,
    num_physical_pages: int | None = None,
) -> torch.Tensor | np.ndarray:
    """Translate virtual token ids to physical token ids: ``v2p[t // page_size] * page_size + t % page_size``.

    Args:
        vtokens: int64 or int32 tensor (or numpy array) of virtual token ids, any shape, on ``v2p``'s device.
        v2p: 1-D int64 tensor (or numpy array), ``v2p[vpage]`` is the physical page bound to ``vpage`` or
            negative (:data:`TOMBSTONE`) when unbound.
        page_size: tokens per page, in ``[1, 2**63 - 1]``.
        out: optional tensor of ``vtokens``' dtype, shape and device to write into (may be ``vtokens``
            itself, or overlap it), or for CPU ids a writeable numpy array of their dtype and shape; returned.
        strict: a bool (``True``/``False`` only, default :data:`STRICT_DEFAULT` = True): raise on a
            tombstoned entry; ``False`` maps it to the sink (Note [Tombstones map to the sink]).
        num_physical_pages: the size of the physical page space the table's entries index, or ``None``: a table
            holding an entry at or above it is refused, whether or not the ids look it up (``O(len(v2p))``
            more). Without it an entry the ids look up must still be a physical page id, below
            :data:`~umalloc.translators.MAX_PHYSICAL_PAGES` (``2**48``).

    Returns:
        tensor of ``vtokens``' shape, dtype and device: physical token ids (``out`` itself when given).

    Raises:
        InvalidIdError: a virtual token outside ``[0, len(v2p) * page_size)`` (never clamped); a v2p entry
            looked up at or above ``2**48``, or whose physical ids ``entry * page_size + offset`` would not fit
            ``vtokens``' dtype (never wrapped; the message names the largest entry allowed); a v2p entry at or above ``num_physical_pages``; a
            wrong dtype, rank, layout (sparse), a meta tensor, or a wrong ``out`` dtype/shape.
        TombstoneError: ``strict`` and a token falls in a tombstoned page.
        UmallocValueError: ``strict`` not a bool; ``page_size`` outside ``[1, 2**63 - 1]``; a bad
            ``num_physical_pages``;
            ``len(v2p) * page_size`` beyond int64; tensors on different devices.

    Errors are checked in that order (range, tombstone, entry overflow) and raised before anything is
    written: ``out`` is left untouched. O(n) time, O(n) temporaries.
    Follows SGLang's paged ``req_to_token`` convention (token id = page id * page_size + offset).

    >>> v2p = torch.tensor([5, -1, 2])
    >>> virtual_to_physical(torch.tensor([0, 1, 3, 4, 5]), v2p, 2, strict=False)
    tensor([10, 11,  1,  4,  5])
    """
    vt, tab, ps, flag = c.translate_args(vtokens, v2p, page_size, out, "vtokens", strict)
    c.check_physical_bound(tab, num_physical_pages)
    return _translate(vt, tab, ps, out, flag, "vtokens", "token")


def virtual_to_physical_pages(
    vpages: c.IndexLike,
    v2p: c.IndexLike,
    *,
    out: torch.Tensor | np.ndarray | None = None,
    strict: bool = c.STRICT_DEFAULT,
    num_physical_pages: int | None = None,
) -> torch.Tensor | np.ndarray:
    """Translate virtual page ids to physical page ids: ``v2p[vpage]``, tombstones to the sink page.

    Args:
        vpages: int64 or int32 tensor (or numpy array) of virtual page ids, any shape, on ``v2p``'s device.
        v2p: 1-D int64 table as in :func:`virtual_to_physical`.
        out: optional tensor of ``vpages``' dtype, shape and device (may alias ``vpages``), or for CPU ids
            a writeable numpy array; returned.
        strict: a bool (default True): raise on a tombstoned entry; ``False`` returns :data:`SINK_PAGE`.
        num_physical_pages: as in :func:`virtual_to_physical`.

    Returns:
        tensor of ``vpages``' shape and dtype: physical page ids (0 for tombstones when not strict).

    Raises:
        InvalidIdError: a page outside ``[0, len(v2p))``; an entry looked up at or above ``2**48``, beyond
            int32 for int32 ids, or at or above ``num_physical_pages``; wrong dtype,
            rank, layout, a meta tensor, or a wrong ``out``.
        TombstoneError: ``strict`` and a tombstoned entry.
        UmallocValueError: ``strict`` not a bool; tensors on different devices.

    Nothing is written when an error is raised. O(n).

    >>> virtual_to_physical_pages(torch.tensor([2, 1, 0]), torch.tensor([5, -1, 2]), strict=False)
    tensor([2, 0, 5])
    """
    vp, tab, _, flag = c.translate_args(vpages, v2p, 1, out, "vpages", strict)
    c.check_physical_bound(tab, num_physical_pages)
    return _translate(vp, tab, 1, out, flag, "vpages", "page")


def _translate(
    ids: torch.Tensor, tab: torch.Tensor, ps: int, out: torch.Tensor | np.ndarray | None, strict: bool, name: str,
    unit: str,
) -> torch.Tensor | np.ndarray:
    v = ids if ids.dtype == torch.int64 else ids.to(torch.int64)
    limit = tab.numel() * ps
    if v.numel() and bool(((v < 0) | (v >= limit)).any()):
        c.raise_out_of_range(v, limit, name, unit)
    vpages = torch.div(v, ps, rounding_mode="floor") if ps > 1 else v
    ppages = torch.take(tab, vpages)  # always a new tensor (tab[0-d index] would be a view of tab)
    if strict and v.numel() and bool((ppages < 0).any()):
        c.raise_tombstone(v, tab, ps, name)
    id_max = c.ID_MAX[ids.dtype]
    if v.numel() and bool((ppages > c.max_entry(ps, id_max)).any()):
        c.raise_entry_overflow(ids, tab, ps, name, id_max)
    result = ppages.clamp_(min=c.SINK_PAGE)
    if ps > 1:
        result = result.mul_(ps).add_(v - vpages * ps)
    return c.deliver(result, out, ids.dtype)


def tokens_to_pages(tokens: c.IndexLike, page_size: int) -> torch.Tensor:
    """Page ids of page-aligned token segments.

    Args:
        tokens: 1-D int64 or int32 tensor whose length is a multiple of ``page_size``; each consecutive group of
            ``page_size`` entries must be exactly ``p*page_size, p*page_size + 1, ..., p*page_size + page_size-1``
            for some page ``p >= 0``.
        page_size: tokens per page, >= 1.

    Returns:
        1-D tensor of ``len(tokens) // page_size`` page ids, of ``tokens``' dtype and device.

    Raises:
        InvalidIdError: a trailing partial page, a segment that is not one whole aligned page, a negative id,
            wrong dtype or rank. Never truncates.
        UmallocValueError: ``page_size < 1``.

    O(n).

    >>> tokens_to_pages(torch.tensor([8, 9, 10, 11, 0, 1, 2, 3]), 4)
    tensor([2, 0])
    """
    tok_in, ps = c.tokens_args(tokens, page_size)
    if tok_in.numel() == 0:
        return torch.empty(0, dtype=tok_in.dtype, device=tok_in.device)
    tok = tok_in.to(torch.int64)
    groups = tok.reshape(-1, ps)
    first = groups[:, 0]
    ok = (first >= 0) & (first % ps == 0)
    if ps > 1:
        offsets = torch.arange(ps, dtype=torch.int64, device=tok.device)
        ok &= (groups == first[:, None] + offsets).all(dim=1)
    if not bool(ok.all()):
        c.raise_misaligned(tok, ps)
    return torch.div(first, ps, rounding_mode="floor").to(tok_in.dtype)


def pages_to_runs(src_pages: c.IndexLike, dst_pages: c.IndexLike) -> torch.Tensor:
    """Maximal runs of page pairs contiguous on both sides.

    A run is a maximal stretch ``i .. i+n-1`` with ``src[j+1] == src[j] + 1`` and ``dst[j+1] == dst[j] + 1``
    inside it. Runs are returned in input order; every pair belongs to exactly one run.

    Args:
        src_pages, dst_pages: 1-D tensors of equal length and one dtype (int64 or int32), ids >= 0, same
            device.

    Returns:
        ``(R, 3)`` int64 tensor of ``(src_start, dst_start, num_pages)`` rows on the inputs' device;
        ``(0, 3)`` for empty inputs.

    Raises:
        UmallocValueError: unequal lengths or devices.
        InvalidIdError: a negative page id; wrong dtype or rank.

    O(n).

    >>> pages_to_runs(torch.tensor([3, 4, 5, 9]), torch.tensor([7, 8, 2, 3]))
    tensor([[3, 7, 2],
            [5, 2, 1],
            [9, 3, 1]])
    """
    src, dst = (t.to(torch.int64) for t in c.runs_args(src_pages, dst_pages))
    n = src.numel()
    if n == 0:
        return torch.empty((0, 3), dtype=torch.int64, device=src.device)
    if bool((src < 0).any()):
        c.raise_negative(src, "src_pages")
    if bool((dst < 0).any()):
        c.raise_negative(dst, "dst_pages")
    starts_mask = torch.ones(n, dtype=torch.bool, device=src.device)
    starts_mask[1:] = (src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)
    starts = torch.nonzero(starts_mask).reshape(-1)
    ends = torch.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1] = n
    return torch.stack([src[starts], dst[starts], ends - starts], dim=1)


def runs_to_descriptors(
    runs: c.IndexLike, src_regions: c.RegionsLike, dst_regions: c.RegionsLike
) -> np.ndarray:
    """Byte descriptors for every run in every region pair.

    For region pair ``k`` (``src_regions[k]`` with ``dst_regions[k]``, each ``(base_addr, item_bytes)``) and run
    ``(s, d, n)``: ``(src_base + s * item_bytes, dst_base + d * item_bytes, n * item_bytes)``.

    Args:
        runs: ``(R, 3)`` int64 tensor (any device; copied to the host) or numpy array, as from
            :func:`pages_to_runs`.
        src_regions, dst_regions: equally long sequences of ``(base_addr, item_bytes)`` int pairs, or ``(K, 2)``
            integer arrays; paired by position; a pair's item_bytes must be equal.

    Returns:
        ``(K * R, 3)`` numpy uint64 array of ``(src_addr, dst_addr, nbytes)`` rows, region-major: all runs of
        pair 0, then all runs of pair 1, ...

    Raises:
        UmallocValueError: unequal region counts, a pair with unequal item_bytes, a malformed region.
        InvalidIdError: a negative start, a run of < 1 page, an address overflowing uint64, bad dtype/shape.

    O(K * R) numpy work, no Python loop over runs.

    >>> runs_to_descriptors(pages_to_runs(torch.tensor([3, 4]), torch.tensor([7, 8])), [(1000, 64)], [(2000, 64)])
    array([[1192, 2448,  128]], dtype=uint64)
    """
    return c.descriptors_numpy(*c.descriptor_args(runs, src_regions, dst_regions))


def kernel_page_ids(tokens: c.IndexLike, page_size: int, layers_per_page: int) -> torch.Tensor:
    """Layer-independent kernel ids of a page-major layout: ``(t // ps) * (ps * L) + t % ps``.

    In a page-major envelope one page holds ``L`` layers of ``ps`` rows each, so a per-layer view whose row
    stride spans one layer sees token ``t`` at this row, plus the layer's own row offset.

    Args:
        tokens: int64 or int32 tensor of physical token ids >= 0, any shape, any device.
        page_size: tokens per page (``ps``), >= 1.
        layers_per_page: layers (row blocks) per page envelope (``L``), >= 1.

    Returns:
        tensor of ``tokens``' shape, dtype and device.

    Raises:
        InvalidIdError: a negative token; a result that would not fit ``tokens``' dtype (the message names
            the largest token allowed); wrong dtype, layout, a meta tensor.
        UmallocValueError: ``page_size`` or ``layers_per_page`` < 1, or their product beyond int64.

    O(n).

    >>> kernel_page_ids(torch.tensor([0, 5, 9]), 4, 3)
    tensor([ 0, 13, 25])
    """
    tok_in, ps, layers = c.kernel_ids_args(tokens, page_size, layers_per_page)
    if tok_in.numel() == 0:
        return torch.empty_like(tok_in)
    tok = tok_in.to(torch.int64)
    lo, hi = (int(v) for v in torch.aminmax(tok))
    if lo < 0:
        c.raise_negative(tok, "tokens")
    c.check_kernel_ids_fit(hi, ps, layers, c.ID_MAX[tok_in.dtype])
    pages = torch.div(tok, ps, rounding_mode="floor")
    return (pages * (ps * layers) + (tok - pages * ps)).to(tok_in.dtype)


def rank_local_positions(
    positions: c.IndexLike, dcp_size: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions a decode-context-parallel rank owns and their rank-local rows.

    Rank ``r`` of ``d`` owns position ``p`` iff ``p % d == r``; it stores that token at rank-local row
    ``p // d``. This is the token-interleaved layout of vLLM's decode context parallelism (interleave size 1).

    Args:
        positions: 1-D int64 or int32 tensor of token positions >= 0 (any order, repeats allowed), any device.
        dcp_size: number of DCP ranks ``d``, >= 1.
        rank: this rank ``r``, in ``[0, d)``.

    Returns:
        ``(indices, local_rows)``: two 1-D tensors of equal length ``R`` on ``positions``' device; ``indices``
        int64, ``local_rows`` of ``positions``' dtype.
        ``indices`` are the ascending positions *in the input* (``0 .. len-1``) of the owned entries;
        ``local_rows[j] = positions[indices[j]] // dcp_size``.

    Raises:
        InvalidIdError: a negative position; wrong dtype or rank (ndim).
        UmallocValueError: ``dcp_size < 1`` or ``rank`` outside ``[0, dcp_size)``.

    O(n).

    >>> rank_local_positions(torch.tensor([4, 5, 6, 7, 9]), 2, 1)
    (tensor([1, 3, 4]), tensor([2, 3, 4]))
    """
    pos_in, d, r = c.dcp_args(positions, dcp_size, rank)
    pos = pos_in.to(torch.int64)
    if pos.numel() and bool((pos < 0).any()):
        c.raise_negative(pos, "positions")
    indices = torch.nonzero(pos % d == r).reshape(-1)
    return indices, torch.div(pos[indices], d, rounding_mode="floor").to(pos_in.dtype)
