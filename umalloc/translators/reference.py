"""Reference translators: plain torch tensor operations, on any device.

* The readable definition every other implementation is tested against (together with brute-force loops in
  the tests); correct on CPU, CUDA or any other torch device, not tuned for speed.
* Validation first, then the result: bad input raises a typed error before anything is written, so an
  ``out=`` that aliases the input survives an error unchanged.
* Validation reads values back to the host, so on CUDA each call synchronizes the stream once (more on the
  error path).
* ``runs_to_descriptors`` is host work whatever the device: descriptors are numpy ``uint64`` arrays handed to
  a transfer engine.

Note [Tombstones map to the sink]
    A v2p entry below zero (:data:`TOMBSTONE` is -1) marks a virtual page with no physical page bound. In
    strict mode translating it raises :class:`TombstoneError`. Otherwise it maps to physical page
    :data:`SINK_PAGE` (0), the reserved page padded lanes may hit, keeping the in-page offset: virtual token
    ``t`` becomes physical token ``0 * page_size + t % page_size``. Reads from the sink return garbage that
    nobody uses; writes land in a page that is never handed out (DESIGN.md §2, "reserved floor").
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
    out: torch.Tensor | None = None,
    strict: bool = False,
) -> torch.Tensor:
    """Translate virtual token ids to physical token ids: ``v2p[t // page_size] * page_size + t % page_size``.

    Args:
        vtokens: int64 tensor of virtual token ids, any shape, on the same device as ``v2p``.
        v2p: 1-D int64 tensor, ``v2p[vpage]`` is the physical page bound to ``vpage`` or negative
            (:data:`TOMBSTONE`) when unbound. Entries must be below ``2**63 // page_size`` (not checked:
            that would cost a pass over the gathered entries; the allocator's tables always meet it).
        page_size: tokens per page, >= 1.
        out: optional int64 tensor of ``vtokens``' shape and device to write into (may be ``vtokens``
            itself); returned.
        strict: raise on a tombstoned entry instead of mapping it to the sink (Note [Tombstones map to the sink]).

    Returns:
        int64 tensor of ``vtokens``' shape and device: physical token ids.

    Raises:
        InvalidIdError: a virtual token outside ``[0, len(v2p) * page_size)`` (never clamped); a wrong dtype,
            rank or ``out`` shape.
        TombstoneError: ``strict`` and a token falls in a tombstoned page.
        UmallocValueError: ``page_size < 1``; ``len(v2p) * page_size`` beyond int64; tensors on different
            devices.

    Nothing is written when an error is raised. O(n) time, O(n) temporaries.
    Follows SGLang's paged ``req_to_token`` convention (token id = page id * page_size + offset).

    >>> v2p = torch.tensor([5, -1, 2])
    >>> virtual_to_physical(torch.tensor([0, 1, 3, 4, 5]), v2p, 2)
    tensor([10, 11,  1,  4,  5])
    """
    vt, tab, ps = c.translate_args(vtokens, v2p, page_size, out, "vtokens")
    limit = tab.numel() * ps
    if vt.numel() and bool(((vt < 0) | (vt >= limit)).any()):
        c.raise_out_of_range(vt, limit, "vtokens", "token")
    vpages = torch.div(vt, ps, rounding_mode="floor")
    ppages = torch.take(tab, vpages)  # always a new tensor (tab[0-d index] would be a view of tab)
    if strict and vt.numel() and bool((ppages < 0).any()):
        c.raise_tombstone(vt, tab, ps, "vtokens")
    result = ppages.clamp_(min=c.SINK_PAGE).mul_(ps).add_(vt - vpages * ps)
    return c.deliver(result, out)


def virtual_to_physical_pages(
    vpages: c.IndexLike,
    v2p: c.IndexLike,
    *,
    out: torch.Tensor | None = None,
    strict: bool = False,
) -> torch.Tensor:
    """Translate virtual page ids to physical page ids: ``v2p[vpage]``, tombstones to the sink page.

    Args:
        vpages: int64 tensor of virtual page ids, any shape, on ``v2p``'s device.
        v2p: 1-D int64 table as in :func:`virtual_to_physical`.
        out: optional int64 tensor of ``vpages``' shape and device (may alias ``vpages``); returned.
        strict: raise on a tombstoned entry instead of returning :data:`SINK_PAGE`.

    Returns:
        int64 tensor of ``vpages``' shape: physical page ids (0 for tombstones when not strict).

    Raises:
        InvalidIdError: a page outside ``[0, len(v2p))``; wrong dtype, rank or ``out`` shape.
        TombstoneError: ``strict`` and a tombstoned entry.
        UmallocValueError: tensors on different devices.

    Nothing is written when an error is raised. O(n).

    >>> virtual_to_physical_pages(torch.tensor([2, 1, 0]), torch.tensor([5, -1, 2]))
    tensor([2, 0, 5])
    """
    vp, tab, _ = c.translate_args(vpages, v2p, 1, out, "vpages")
    limit = tab.numel()
    if vp.numel() and bool(((vp < 0) | (vp >= limit)).any()):
        c.raise_out_of_range(vp, limit, "vpages", "page")
    ppages = torch.take(tab, vp)  # a new tensor, never a view of tab
    if strict and vp.numel() and bool((ppages < 0).any()):
        c.raise_tombstone(vp, tab, 1, "vpages")
    result = ppages.clamp_(min=c.SINK_PAGE)
    return c.deliver(result, out)


def tokens_to_pages(tokens: c.IndexLike, page_size: int) -> torch.Tensor:
    """Page ids of page-aligned token segments.

    Args:
        tokens: 1-D int64 tensor whose length is a multiple of ``page_size``; each consecutive group of
            ``page_size`` entries must be exactly ``p*page_size, p*page_size + 1, ..., p*page_size + page_size-1``
            for some page ``p >= 0``.
        page_size: tokens per page, >= 1.

    Returns:
        1-D int64 tensor of ``len(tokens) // page_size`` page ids, on ``tokens``' device.

    Raises:
        InvalidIdError: a trailing partial page, a segment that is not one whole aligned page, a negative id,
            wrong dtype or rank. Never truncates.
        UmallocValueError: ``page_size < 1``.

    O(n).

    >>> tokens_to_pages(torch.tensor([8, 9, 10, 11, 0, 1, 2, 3]), 4)
    tensor([2, 0])
    """
    tok, ps = c.tokens_args(tokens, page_size)
    if tok.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=tok.device)
    groups = tok.reshape(-1, ps)
    first = groups[:, 0]
    ok = (first >= 0) & (first % ps == 0)
    if ps > 1:
        offsets = torch.arange(ps, dtype=torch.int64, device=tok.device)
        ok &= (groups == first[:, None] + offsets).all(dim=1)
    if not bool(ok.all()):
        c.raise_misaligned(tok, ps)
    return torch.div(first, ps, rounding_mode="floor")


def pages_to_runs(src_pages: c.IndexLike, dst_pages: c.IndexLike) -> torch.Tensor:
    """Maximal runs of page pairs contiguous on both sides.

    A run is a maximal stretch ``i .. i+n-1`` with ``src[j+1] == src[j] + 1`` and ``dst[j+1] == dst[j] + 1``
    inside it. Runs are returned in input order; every pair belongs to exactly one run.

    Args:
        src_pages, dst_pages: 1-D int64 tensors of equal length, ids >= 0, same device.

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
    src, dst = c.runs_args(src_pages, dst_pages)
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
        tokens: int64 tensor of physical token ids >= 0, any shape, any device.
        page_size: tokens per page (``ps``), >= 1.
        layers_per_page: layers (row blocks) per page envelope (``L``), >= 1.

    Returns:
        int64 tensor of ``tokens``' shape and device.

    Raises:
        InvalidIdError: a negative token; a result that would overflow int64; wrong dtype.
        UmallocValueError: ``page_size`` or ``layers_per_page`` < 1, or their product beyond int64.

    O(n).

    >>> kernel_page_ids(torch.tensor([0, 5, 9]), 4, 3)
    tensor([ 0, 13, 25])
    """
    tok, ps, layers = c.kernel_ids_args(tokens, page_size, layers_per_page)
    if tok.numel() == 0:
        return torch.empty_like(tok)
    lo, hi = (int(v) for v in torch.aminmax(tok))
    if lo < 0:
        c.raise_negative(tok, "tokens")
    c.check_kernel_ids_fit(hi, ps, layers)
    pages = torch.div(tok, ps, rounding_mode="floor")
    return pages * (ps * layers) + (tok - pages * ps)


def rank_local_positions(
    positions: c.IndexLike, dcp_size: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions a decode-context-parallel rank owns and their rank-local rows.

    Rank ``r`` of ``d`` owns position ``p`` iff ``p % d == r``; it stores that token at rank-local row
    ``p // d``. This is the token-interleaved layout of vLLM's decode context parallelism (interleave size 1).

    Args:
        positions: 1-D int64 tensor of token positions >= 0 (any order, repeats allowed), any device.
        dcp_size: number of DCP ranks ``d``, >= 1.
        rank: this rank ``r``, in ``[0, d)``.

    Returns:
        ``(indices, local_rows)``: two 1-D int64 tensors of equal length ``R`` on ``positions``' device.
        ``indices`` are the ascending positions *in the input* (``0 .. len-1``) of the owned entries;
        ``local_rows[j] = positions[indices[j]] // dcp_size``.

    Raises:
        InvalidIdError: a negative position; wrong dtype or rank (ndim).
        UmallocValueError: ``dcp_size < 1`` or ``rank`` outside ``[0, dcp_size)``.

    O(n).

    >>> rank_local_positions(torch.tensor([4, 5, 6, 7, 9]), 2, 1)
    (tensor([1, 3, 4]), tensor([2, 3, 4]))
    """
    pos, d, r = c.dcp_args(positions, dcp_size, rank)
    if pos.numel() and bool((pos < 0).any()):
        c.raise_negative(pos, "positions")
    indices = torch.nonzero(pos % d == r).reshape(-1)
    return indices, torch.div(pos[indices], d, rounding_mode="floor")
