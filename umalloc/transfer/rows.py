"""Row arithmetic of a transfer: which local rows of each end travel, and which DCP ranks send them.

Policy:

* Pure functions of the shared geometry (:class:`~umalloc.geometry.spec.EndSpec`) and request lengths; no state.
  Sender and receiver call the same functions, so both compute the same ranges.
* The SWA tail comes from :func:`umalloc.geometry.spec.swa_tail_start`, the one SWA formula the allocators use
  too (F19).
* Decode context parallel (DCP): ends of role ``target`` and ``swa`` are sharded by token position
  (rank ``r`` of ``d`` holds positions ``p % d == r`` at rank-local row ``p // d``); ``draft`` and ``state`` ends
  keep logical rows (Note [DCP rows]).
* Arguments are checked here (typed :class:`~umalloc.errors.UmallocValueError` naming the allowed range); every
  function is O(1) or O(DCP size).

Note [Which rows travel]
~~~~~~~~~~~~~~~~~~~~~~~~
For a request of ``L`` tokens of which the receiver already holds the first ``P`` (``prefix_tokens``), in the
receiver's local rows (``L_loc`` = its rows below ``L``, ``P_loc`` = its rows below ``P``; both equal ``L``
and ``P`` without DCP) an end receives rows ``[row_lo, L_loc)`` (:func:`vector_rows`):
* an end with any full-attention layer (``EndSpec.window_tokens is None``): ``row_lo = P_loc``;
* an end whose every layer slides with window ``W``: ``row_lo = max(P_loc, swa_tail_start(L_loc, W_loc, P_loc,
  page_size))`` with ``W_loc`` the receiver's rows among the last ``W`` positions. ``swa_tail_start`` is the one
  shared function (``floor_to_page(max(prefix, seq_len - window))``, F19) the allocators use too, so a draft
  whose every layer slides sends only its window tail, and a draft with any full layer sends everything;
* a ``state`` end: its whole slot (every page of the slot's tokens), whatever ``P``: state is a snapshot at
  ``L``, not token-addressed.

::

    positions   0 ........ P ............. L-W ............ L
    full end:              [===============================)      rows P .. L
    swa end:                          |page|===============)      whole pages from swa_tail_start, clipped at P

Note [Boundary page]
~~~~~~~~~~~~~~~~~~~~
A page envelope is page-major (layer 0 K rows, layer 0 V rows, ...), so a page's tokens are not one byte
range. When ``row_lo`` is not page-aligned, the first page holds rows the receiver already has (tokens below
``P``: valid on the destination, F23). That page is sent as *row runs*: one descriptor per layer block (K, V, or
the MLA latent) covering exactly rows ``[row_lo, page end)``, so no valid destination token is overwritten and
no page is refused. Every later page is a whole-envelope copy; the last page may be partial, and its rows at or
past ``L`` are not valid on either side (allocated to this request, not yet written), so a whole copy is safe.

Note [DCP rows]
~~~~~~~~~~~~~~~
Prefill runs with DCP ``p`` (source rank ``q``), decode with DCP ``d`` (destination rank ``r``). A sharded end
(role ``target``/``swa``) holds position ``x`` on rank ``x % n`` at row ``x // n``; a ``draft``/``state`` end
holds logical rows on every rank. A plan is built per (source rank, destination rank) pair:

* same row layout on both sides (``p == d`` and ``q == r``, or an unsharded end): page-to-page copies of the same
  local rows (plus the boundary rows of Note [Boundary page]);
* different layouts (``p != d``): the source sends the positions it owns among the receiver's rows, each as a
  row run (``x // p`` on the source, ``x // d`` on the receiver; runs coalesce where both sides step by one);
* unsharded vectors (``draft``, ``state``) travel once per destination rank, from source rank ``r % p``
  (:func:`source_ranks`); other source ranks carry them empty.

So P1->D8 sends rows ``r, r + 8, ...`` of the prefill's target pages to rank ``r`` plus the whole draft to every
rank; P8->D8 pairs rank ``q`` with rank ``q`` page by page; P1->D1 is the plain page-to-page plan."""

from __future__ import annotations

import math

from umalloc.errors import UmallocValueError
from umalloc.geometry.spec import EndRole, EndSpec, swa_tail_start

#: Roles whose ends are sharded by token position under DCP (Note [DCP rows]).
DCP_SHARDED_ROLES = frozenset({EndRole.TARGET, EndRole.SWA})


def owned_count(num_tokens: int, dcp_size: int = 1, dcp_rank: int = 0) -> int:
    """Positions in ``[0, num_tokens)`` that DCP rank ``dcp_rank`` of ``dcp_size`` owns (``x % size == rank``):
    its rank-local rows below ``num_tokens``. O(1).

    >>> owned_count(10, 4, 1), owned_count(10, 4, 3), owned_count(10)
    (3, 2, 10)
    """
    check_dcp(dcp_size, dcp_rank)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 <= num_tokens < 1 << 63:
        raise UmallocValueError(f"num_tokens={num_tokens!r}: allowed an int in [0, 2**63)")
    return (num_tokens - dcp_rank + dcp_size - 1) // dcp_size


def is_dcp_sharded(end: EndSpec) -> bool:
    """True if ``end`` is sharded by token position under DCP (roles ``target`` and ``swa``)."""
    return end.role in DCP_SHARDED_ROLES


def source_ranks(dst_dcp_rank: int, dst_dcp_size: int, src_dcp_size: int) -> dict[str, list[int]]:
    """Which source (prefill) DCP ranks send to destination rank ``dst_dcp_rank``.

    Returns ``{"sharded": [...], "replicated": [q]}``: the ranks owning some of the receiver's sharded rows
    (``q == r mod gcd(p, d)``) and the one rank sending the unsharded vectors (``r % p``). A receiver waits for
    a plan from every rank listed. O(p).

    >>> source_ranks(3, 8, 1), source_ranks(3, 8, 8), source_ranks(1, 2, 4)
    ({'sharded': [0], 'replicated': [0]}, {'sharded': [3], 'replicated': [3]}, {'sharded': [1, 3], 'replicated': [1]})
    """
    check_dcp(dst_dcp_size, dst_dcp_rank)
    check_dcp(src_dcp_size, 0)
    g = math.gcd(src_dcp_size, dst_dcp_size)
    return {"sharded": [q for q in range(src_dcp_size) if q % g == dst_dcp_rank % g],
            "replicated": [dst_dcp_rank % src_dcp_size]}


def vector_rows(end: EndSpec, seq_len_tokens: int, prefix_tokens: int = 0, *, dcp_size: int = 1,
                dcp_rank: int = 0) -> tuple[int, int]:
    """The receiver's local rows ``[row_lo, row_hi)`` of ``end`` that a transfer fills (Note [Which rows travel]).

    Args:
        end: a token-addressed end (not ``state``).
        seq_len_tokens: request length ``L`` in tokens (logical positions).
        prefix_tokens: ``P``, leading tokens the receiver already holds, ``0 <= P <= L``.
        dcp_size, dcp_rank: the receiver's DCP; ignored (treated as 1, 0) for an end that is not sharded.

    Returns:
        ``(row_lo, row_hi)`` in the receiver's rows of ``end`` (``row_hi`` = its rows below ``L``). The pages
        that must be bound are ``[row_lo // page_size, ceil(row_hi / page_size))``. O(1).

    Raises:
        UmallocValueError: a state end, negative lengths, ``P > L``, bad DCP.

    >>> from umalloc.geometry.spec import LayerSpec
    >>> full = EndSpec("full", (LayerSpec.mha(1, 4),), page_size=4)
    >>> swa = EndSpec("swa", (LayerSpec.mha(1, 4, window_tokens=5),), 4, owner="full", role=EndRole.SWA)
    >>> vector_rows(full, 19, 6), vector_rows(swa, 19, 6), vector_rows(swa, 19, 17)
    ((6, 19), (12, 19), (17, 19))
    >>> vector_rows(full, 19, 6, dcp_size=4, dcp_rank=1)      # positions 1, 5, 9, 13, 17 -> rows 0..4
    (2, 5)
    """
    if not isinstance(end, EndSpec):
        raise UmallocValueError(f"end={type(end).__name__}: allowed an EndSpec")
    if end.role is EndRole.STATE:
        raise UmallocValueError(f"end {end.name!r} is a state end: it travels as a whole slot, not by rows")
    check_tokens(seq_len_tokens, prefix_tokens)
    d, r = (dcp_size, dcp_rank) if is_dcp_sharded(end) else (1, 0)
    check_dcp(d, r)
    return rows_of_checked(end, seq_len_tokens, prefix_tokens, d, r)


def rows_of_checked(end: EndSpec, seq_len_tokens: int, prefix_tokens: int, dcp_size: int, dcp_rank: int
                    ) -> tuple[int, int]:
    """:func:`vector_rows` for arguments the caller already checked (a token-addressed end, ``0 <= P <= L``,
    ``(dcp_size, dcp_rank)`` valid and already ``(1, 0)`` for an end that is not sharded). O(1)."""
    d, r = dcp_size, dcp_rank
    row_hi = (seq_len_tokens - r + d - 1) // d
    prefix_rows = (prefix_tokens - r + d - 1) // d
    window = end.window_tokens
    if window is None:
        return prefix_rows, row_hi
    window_rows = row_hi - (max(0, seq_len_tokens - window) - r + d - 1) // d
    if window_rows == 0:
        return row_hi, row_hi
    tail = swa_tail_start(row_hi, window_rows, prefix_rows, end.page_size)
    return max(prefix_rows, tail), row_hi


def check_dcp(dcp_size: object, dcp_rank: object) -> None:
    """Raise :class:`~umalloc.errors.UmallocValueError` unless ``dcp_size`` is an int in ``[1, 2**63)`` and
    ``dcp_rank`` an int in ``[0, dcp_size - 1]``. O(1).

    >>> check_dcp(4, 3)
    """
    if isinstance(dcp_size, bool) or not isinstance(dcp_size, int) or not 1 <= dcp_size < 1 << 63:
        raise UmallocValueError(f"dcp_size={dcp_size!r}: allowed an int in [1, 2**63)")
    if isinstance(dcp_rank, bool) or not isinstance(dcp_rank, int) or not 0 <= dcp_rank < dcp_size:
        raise UmallocValueError(f"dcp_rank={dcp_rank!r}: allowed an int in [0, {dcp_size - 1}]")


def check_tokens(seq_len_tokens: object, prefix_tokens: object) -> None:
    """Raise :class:`~umalloc.errors.UmallocValueError` unless ``seq_len_tokens`` is an int >= 0 and
    ``prefix_tokens`` an int in ``[0, seq_len_tokens]`` (lengths below ``2**62``: token ids times a page size
    must fit int64). O(1)."""
    if isinstance(seq_len_tokens, bool) or not isinstance(seq_len_tokens, int) or not 0 <= seq_len_tokens < 1 << 62:
        raise UmallocValueError(f"seq_len_tokens={seq_len_tokens!r}: allowed an int in [0, 2**62)")
    if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int) \
            or not 0 <= prefix_tokens <= seq_len_tokens:
        raise UmallocValueError(f"prefix_tokens={prefix_tokens!r}: allowed an int in [0, {seq_len_tokens}]")


__all__ = ["DCP_SHARDED_ROLES", "check_dcp", "check_tokens", "is_dcp_sharded", "owned_count", "rows_of_checked",
           "source_ranks", "vector_rows"]
