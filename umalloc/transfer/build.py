"""Building transfer plans from allocators: the receiver's half, the sender's plan, and both in one call.

Policy:

* Two forms: :func:`build_plan` for two in-process allocators (the local backend); :func:`build_receiver_half`
  (receiver: pages + lease, JSON-safe) and :func:`build_send_plan` (sender: its pages + lease + descriptors)
  for two processes.
* Which tokens travel is decided on the receiver's side (Note [Which rows travel] in
  :mod:`umalloc.transfer.rows`); the sender recomputes the same ranges from the shared geometry and refuses a
  receiver that disagrees.
* The payload starts at the receiver's prefix: tokens it already holds are never sent, and a prefix ending
  mid-page is clipped at token granularity (Note [Boundary page], F23).
* One straight path per side: virtual token ids are validated once here, at the API boundary (dtype int64 or
  int32, strided, 1-D, page-consistent, no virtual page twice), converted to numpy ``int64`` once, translated
  to physical pages once per vector (``translate_pages``, strict), leased once; the half is built once; the
  plan's descriptors are bounds-checked once (:mod:`umalloc.transfer.descriptors`). Nothing converts back.
* Peer compatibility is checked at connect (:func:`~umalloc.transfer.layout.compatible_layouts`); a
  :class:`~umalloc.transfer.layout.CheckedLayouts` passed as ``checked=`` skips the check in :func:`build_plan`.
* Errors are typed (:mod:`umalloc.errors`) and leave both allocators as they were: validation and translation
  run before any lease, and a failure after the receiver's lease releases it.
* Every lease has a finite deadline by default (:data:`DEFAULT_DEADLINE_S`, F12): a peer that never answers
  cannot pin pages forever. Pass ``deadline_s=None`` to hold until released, or another number of seconds. A
  deadline that passes while an engine may hold a part leaves the lease in doubt instead of freeing its pages
  (Note [Lease states] in :mod:`umalloc.leases.table`).

Note [Boundary page]
~~~~~~~~~~~~~~~~~~~~
A page envelope is page-major (layer 0 K rows, layer 0 V rows, ...), so a page's tokens are not one byte
range. When ``row_lo`` is not page-aligned, the first page holds rows the receiver already has (tokens below
``P``: valid on the destination, F23). That page is sent as *row runs*: one descriptor per layer block (K, V, or
the MLA latent) covering exactly rows ``[row_lo, page end)``, so no valid destination token is overwritten and
no page is refused. Every later page is a whole-envelope copy; the last page may be partial, and its rows at or
past ``L`` are not valid on either side (allocated to this request, not yet written), so a whole copy is safe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch
from numba import njit

from umalloc.errors import InvalidIdError, InvariantError, UmallocValueError
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec
from umalloc.ids import host_ids
from umalloc.transfer.layout import CheckedLayouts, PeerLayout, check_compatible
from umalloc.transfer.plan import EMPTY_IDS, HalfVector, IndexVector, ReceiverHalf, TransferPlan
from umalloc.transfer.rows import check_tokens, is_dcp_sharded, rows_of_checked
from umalloc.transfer.slices import pair_pieces, same_slices
from umalloc.translators import get_translator

#: Virtual token ids of one request: one 1-D int64/int32 tensor (or numpy array) for the target owner, or a
#: mapping ``{id owner end: ids}``.
VTokens = torch.Tensor | np.ndarray | Mapping[str, torch.Tensor | np.ndarray]


class PlanAllocator(Protocol):
    """What the builders need of an allocator (:class:`umalloc.allocator.facade.MultiEndedAllocator` is one)."""

    arena: Any
    spec: ArenaSpec

    def translate_pages(self, vpages: torch.Tensor, end: str, *, strict: bool = True,
                        out: torch.Tensor | None = None) -> torch.Tensor: ...

    def lease(self, pages: Mapping[str, Any], *, deadline_s: float | None = None, tag: str = "") -> Any: ...


def _check_allocator(alloc: object, name: str) -> None:
    """Refuse, with a typed error, an argument that is not a :class:`PlanAllocator` (an arena with a spec, the
    translate and lease calls), before anything is read from it."""
    arena = getattr(alloc, "arena", None)
    if not (isinstance(getattr(alloc, "spec", None), ArenaSpec) and isinstance(getattr(arena, "spec", None), ArenaSpec)
            and callable(getattr(alloc, "translate_pages", None)) and callable(getattr(alloc, "lease", None))):
        raise UmallocValueError(f"{name}={type(alloc).__name__}: allowed an allocator (a MultiEndedAllocator or "
                                f"another PlanAllocator)")


def _check_deadline(deadline_s: object) -> None:
    """``deadline_s`` is ``None`` or a finite number of seconds > 0 (the leases' rule), checked before any lease
    is taken, also for a plan that pins no page."""
    if deadline_s is None:
        return
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float, np.integer, np.floating)) \
            or not math.isfinite(deadline_s) or deadline_s <= 0:
        raise UmallocValueError(f"deadline_s={deadline_s!r}: allowed None or a finite number of seconds > 0")


# ==== virtual token ids: validated and converted once =========================================================


def _host_ids(vt: object, what: str) -> np.ndarray:
    """Virtual token ids (int64 or int32) as a 1-D numpy int64 array (a view where the input already is one,
    else one copy): :func:`umalloc.ids.host_ids`."""
    return host_ids(vt, f"{what} (virtual token ids)", accept="int32")


def _resolve_vtokens(spec: ArenaSpec, vtokens: VTokens, owner: str | None, side: str) -> dict[str, np.ndarray]:
    """Map id-owner end name -> virtual token ids (int64 host array) for every owner the spec needs."""
    owners = [e.name for e in spec.ends if e.is_owner]
    if isinstance(vtokens, Mapping):
        raw = dict(vtokens)
    else:
        if owner is None:
            targets = [e.name for e in spec.ends_with_role(EndRole.TARGET) if e.is_owner]
            cands = targets if len(targets) == 1 else owners if len(owners) == 1 else []
            if not cands:
                raise UmallocValueError(f"{side}_vtokens is one tensor but the arena has owners {owners}: pass "
                                        f"{side}_owner or a mapping owner -> vtokens")
            owner = cands[0]
        raw = {owner: vtokens}
    out: dict[str, np.ndarray] = {}
    for name, vt in raw.items():
        end = spec.end(name)
        if not end.is_owner:
            raise UmallocValueError(f"{side}_vtokens key {name!r} is bound to {end.owner!r}: allowed id owners "
                                    f"{owners}")
        out[name] = _host_ids(vt, f"{side}_vtokens[{name!r}]")
    missing = sorted({spec.owner_of(e.name) for e in spec.ends} - set(out))
    if missing:
        raise UmallocValueError(
            f"{side}_vtokens has no virtual token ids for owner(s) {missing}: every end travels in its own "
            "vector (F10), so each id owner (a draft with its own page size included) needs its token ids")
    return out


def _check_rows(vt: np.ndarray, ps: int, rows: np.ndarray, what: str) -> None:
    """Raise :class:`InvalidIdError` unless ``vt[rows]`` are page-consistent with their page's first row."""
    seg = vt[rows]
    firsts = vt[(rows // ps) * ps]
    bad = (seg < 0) | (seg // ps != firsts // ps) | (seg % ps != rows % ps)
    if bad.any():
        i = int(rows[np.flatnonzero(bad)[0]])
        raise InvalidIdError(f"{what}: row {i} has virtual token id {int(vt[i])}, not at offset {i % ps} of its "
                             "page's virtual page (a token-addressed sequence fills pages in order)")


def _check_distinct(vpages: np.ndarray, what: str) -> None:
    """Refuse a virtual page named twice (two descriptors would write one destination page). O(n) when
    ascending (a fresh allocation), else O(n log n)."""
    if vpages.shape[0] < 2 or bool((vpages[1:] > vpages[:-1]).all()):
        return
    s = np.sort(vpages)
    dup = np.flatnonzero(s[1:] == s[:-1])
    if dup.size:
        raise InvalidIdError(f"{what}: virtual page {int(s[dup[0]])} is named twice; allowed each virtual page "
                             "once per request")


@njit(cache=True, nogil=True)
def _vpages_kernel(vt: np.ndarray, ps: np.int64, lo: np.int64, hi: np.int64, out: np.ndarray
                   ) -> tuple[np.int64, bool]:
    """Virtual pages of rows ``[lo, hi)`` (``lo`` page-aligned) into ``out``; returns ``(first row that is not
    page-consistent or -1, whether the pages ascend strictly)``. One pass over the rows."""
    asc = True
    prev = np.int64(-1)
    for p in range(out.shape[0]):
        r0 = lo + p * ps
        f = vt[r0]
        if f < 0 or f % ps != 0:
            return r0, asc
        for r in range(r0 + 1, min(r0 + ps, hi)):
            if vt[r] != f + (r - r0):
                return np.int64(r), asc
        vp = f // ps
        out[p] = vp
        if vp <= prev:
            asc = False
        prev = vp
    return np.int64(-1), asc


class _OwnerPages:
    """One id owner's virtual pages for local pages ``[page_lo, page_hi)``, checked once (page-consistent rows,
    no virtual page twice) and shared by every vector of that owner's ends. O(rows), one compiled pass."""

    __slots__ = ("page_lo", "vpages")

    def __init__(self, vt: np.ndarray, ps: int, page_lo: int, page_hi: int, what: str) -> None:
        self.page_lo = page_lo
        if (page_hi - 1) * ps >= vt.shape[0]:
            raise InvalidIdError(f"{what}: {vt.shape[0]} virtual token ids do not reach local page {page_hi - 1} "
                                 f"(row {(page_hi - 1) * ps})")
        lo, hi = page_lo * ps, min(page_hi * ps, vt.shape[0])
        self.vpages = np.empty(page_hi - page_lo, dtype=np.int64)
        bad, ascending = _vpages_kernel(vt, ps, lo, hi, self.vpages)
        if bad >= 0:
            _check_rows(vt, ps, np.arange(lo, hi, dtype=np.int64), what)  # raises, naming the first bad row
            raise InvariantError(f"{what}: row {bad} failed the compiled page-consistency check only")
        if not ascending:
            _check_distinct(self.vpages, what)

    def take(self, page_lo: int, page_hi: int) -> np.ndarray:
        """Virtual pages of local pages ``[page_lo, page_hi)`` (inside the checked range)."""
        return self.vpages[page_lo - self.page_lo: page_hi - self.page_lo]


def _translate(alloc: PlanAllocator, vpages: np.ndarray, end: str) -> np.ndarray:
    """Strict physical pages of ``vpages`` on ``end``: read-only int64 numpy. Numpy ids and a numpy ``out=``
    take the allocator's numpy fast path, so nothing converts to or from torch."""
    n = vpages.shape[0]
    if n == 0:
        return EMPTY_IDS
    out = np.empty(n, dtype=np.int64)
    alloc.translate_pages(vpages, end, strict=True, out=out)
    out.setflags(write=False)
    return out


def _page_span(row_lo: int, row_hi: int, ps: int) -> tuple[int, int]:
    """Local pages ``[lo, hi)`` covering rows ``[row_lo, row_hi)`` (``(0, 0)`` for no rows)."""
    if row_lo == row_hi:
        return 0, 0
    return row_lo // ps, -(-row_hi // ps)


def _owner_pages(spec: ArenaSpec, owner_vt: Mapping[str, np.ndarray], spans: Mapping[str, tuple[int, int]],
                 side: str) -> dict[str, _OwnerPages]:
    """Check each owner's ids once over the union of the page spans its ends need (``spans``: end -> pages)."""
    union: dict[str, tuple[int, int]] = {}
    for end_name, (lo, hi) in spans.items():
        if hi <= lo:
            continue
        owner = spec.owner_of(end_name)
        u = union.get(owner)
        union[owner] = (lo, hi) if u is None else (min(u[0], lo), max(u[1], hi))
    return {o: _OwnerPages(owner_vt[o], spec.end(o).page_size, lo, hi, f"{side} vtokens[{o!r}]")
            for o, (lo, hi) in union.items()}


def _default_seq_len(spec: ArenaSpec, layout: PeerLayout, owner_vt: Mapping[str, np.ndarray],
                     seq_len_tokens: int | None, side: str) -> int:
    if seq_len_tokens is not None:
        return seq_len_tokens
    if layout.dcp_size > 1:
        raise UmallocValueError(f"{side}: seq_len_tokens is required under DCP (local rows do not give the "
                                "logical length)")
    token_owners = [e.name for e in spec.ends if e.is_owner and e.role is not EndRole.STATE]
    lens = {owner_vt[o].shape[0] for o in token_owners if o in owner_vt}
    if len(lens) != 1:
        raise UmallocValueError(f"{side}: owners carry {sorted(lens)} tokens; pass seq_len_tokens")
    return lens.pop()


def _sorted_unique(parts: list[np.ndarray]) -> np.ndarray:
    """Sorted unique read-only int64 union of ``parts`` (no copy for one strictly ascending part)."""
    if len(parts) == 1:
        a = parts[0]
        if a.shape[0] < 2 or bool((a[1:] > a[:-1]).all()):
            return a
    u = np.unique(np.concatenate(parts))
    u.setflags(write=False)
    return u


def _lease(alloc: PlanAllocator, pages: Mapping[str, np.ndarray], deadline_s: float | None, tag: str) -> Any:
    """Lease the non-empty page sets (``None`` if there are none)."""
    wanted = {e: p for e, p in pages.items() if p.shape[0]}
    return alloc.lease(wanted, deadline_s=deadline_s, tag=tag) if wanted else None


# ==== receiver ================================================================================================


#: Default lease deadline of receiver halves and plans (seconds): longer than any transfer of one request stays
#: in an engine here, short enough that a lost peer's pages come back (F12). Overridable per call.
DEFAULT_DEADLINE_S = 300.0


def build_receiver_half(request_id: str, dst_alloc: PlanAllocator, dst_vtokens: VTokens, *,
                        seq_len_tokens: int | None = None, prefix_tokens: int = 0, dst_owner: str | None = None,
                        layout: PeerLayout | None = None,
                        deadline_s: float | None = DEFAULT_DEADLINE_S) -> ReceiverHalf:
    """The receiver's half of a plan: its physical pages per vector, leased.

    Args:
        request_id: the request id (also the lease tag, prefixed ``"plan-dst:"``).
        dst_alloc: the receiver's allocator (``translate_pages``, ``lease``, ``spec``, ``arena``).
        dst_vtokens: virtual token ids of the request's local rows, one 1-D int64 (or int32) tensor or numpy
            array for the target owner, or a mapping ``{owner end: ids}`` (a draft with its own page size needs
            its own entry; a ``state`` end its slot's token ids). May be longer than the rows transferred
            (lookahead slots, F09).
        seq_len_tokens: ``L`` (logical positions); default: the token owners' common length (required under
            DCP).
        prefix_tokens: ``P``, leading tokens the receiver already holds (not sent, never overwritten: F23).
        dst_owner: the owner a single tensor belongs to (default: the target's id owner).
        layout: the receiver's :class:`PeerLayout` (default: ``PeerLayout.from_arena(dst_alloc.arena)``);
            carries its DCP rank/size.
        deadline_s: lease deadline in seconds (default :data:`DEFAULT_DEADLINE_S`; ``None``: until released).

    Returns:
        A pending :class:`ReceiverHalf` holding the lease.

    Raises:
        UmallocValueError: missing owners (F10), bad lengths/prefix, a bound state end.
        InvalidIdError / TombstoneError: ids of another dtype, a meta or sparse tensor, ids that are not
            page-consistent, a virtual page named twice, or pages not bound.
        LeaseError: a page the allocator refuses to lease. Nothing is leased on any error.

    Complexity: O(rows) validation + O(pages) translation, once per id owner and vector.
    """
    _check_allocator(dst_alloc, "dst_alloc")
    _check_deadline(deadline_s)
    layout = PeerLayout.from_arena(dst_alloc.arena) if layout is None else layout
    spec = layout.spec
    owner_vt = _resolve_vtokens(spec, dst_vtokens, dst_owner, "dst")
    L = _default_seq_len(spec, layout, owner_vt, seq_len_tokens, "dst")
    check_tokens(L, prefix_tokens)
    rows: dict[str, tuple[str, int, int, str]] = {}  # vector -> (end, row_lo, row_hi, kind)
    spans: dict[str, tuple[int, int]] = {}
    for name, end_name in layout.vector_names().items():
        end = spec.end(end_name)
        vt = owner_vt[spec.owner_of(end_name)]
        if end.role is EndRole.STATE:
            if not end.is_owner:
                raise UmallocValueError(f"state end {end_name!r} is bound to {end.owner!r}: a state slot needs "
                                        "its own id owner")
            row_lo, row_hi, kind = 0, vt.shape[0], "slots"
            span = (0, -(-row_hi // end.page_size))
        else:
            d, r = layout.dcp_for(end_name)
            row_lo, row_hi = rows_of_checked(end, L, prefix_tokens, d, r)
            kind = "rows"
            if vt.shape[0] < row_hi:
                raise UmallocValueError(f"dst_vtokens[{spec.owner_of(end_name)!r}] has {vt.shape[0]} rows; end "
                                        f"{end_name!r} needs {row_hi} (L={L}, DCP {d}/{r})")
            span = _page_span(row_lo, row_hi, end.page_size)
        rows[name] = (end_name, row_lo, row_hi, kind)
        spans[name] = span
    checked = _owner_pages(spec, owner_vt, {rows[n][0]: s for n, s in spans.items()}, "dst")
    vectors: dict[str, HalfVector] = {}
    by_end: dict[str, list[np.ndarray]] = {}
    for name, (end_name, row_lo, row_hi, kind) in rows.items():
        lo, hi = spans[name]
        vpages = checked[spec.owner_of(end_name)].take(lo, hi) if hi > lo else EMPTY_IDS
        pages = _translate(dst_alloc, vpages, end_name)
        vectors[name] = HalfVector(name, end_name, kind, row_lo, row_hi, pages)
        by_end.setdefault(end_name, []).append(pages)
    lease = _lease(dst_alloc, {e: p[0] if len(p) == 1 else np.concatenate(p) for e, p in by_end.items()},
                   deadline_s, f"plan-dst:{request_id}")
    leased = dict(lease.pages) if lease is not None else {}
    return ReceiverHalf.of_checked(request_id, layout.digest, L, prefix_tokens, layout.dcp_size, layout.dcp_rank,
                                   vectors, leased, lease)


# ==== sender ==================================================================================================


def _sender_vector(name: str, src_end: EndSpec, dst_end: EndSpec, hv: HalfVector, vt: np.ndarray,
                   checked: Mapping[str, _OwnerPages], src_alloc: PlanAllocator, src_layout: PeerLayout,
                   dst_layout: PeerLayout, half: ReceiverHalf, replicated_sender: bool
                   ) -> tuple[IndexVector, np.ndarray]:
    """Pair the receiver's half vector ``hv`` with this sender's physical ids (Note [DCP rows]); returns the
    vector and the source pages it reads."""
    ps = src_end.page_size
    src_group, dst_group = src_layout.region_group(src_end.name), dst_layout.region_group(dst_end.name)

    def vec(sp: np.ndarray = EMPTY_IDS, dp: np.ndarray = EMPTY_IDS, sr: np.ndarray = EMPTY_IDS,
            dr: np.ndarray = EMPTY_IDS) -> IndexVector:
        return IndexVector.of_checked(name, src_end.name, dst_end.name, sp, dp, src_group, dst_group, sr, dr)

    sharded = is_dcp_sharded(src_end)
    if not sharded and not replicated_sender:
        return vec(), EMPTY_IDS  # another source rank sends this unsharded vector (Note [DCP rows])
    dst_pages = hv.pages
    owner = src_layout.spec.owner_of(src_end.name)
    if hv.kind == "slots":
        if not same_slices(src_layout, dst_layout, src_layout.geometry(src_end.name),
                           dst_layout.geometry(dst_end.name)):
            return vec(), EMPTY_IDS  # another TP rank's state (equal geometry is checked at connect)
        n_pages = -(-vt.shape[0] // ps)
        src_pages = _translate(src_alloc, checked[owner].take(0, n_pages) if n_pages else EMPTY_IDS,
                               src_end.name)
        if src_pages.size != dst_pages.size:
            raise UmallocValueError(f"vector {name!r}: sender slot has {src_pages.size} page(s), receiver "
                                    f"{dst_pages.size}")
        return vec(src_pages, dst_pages), src_pages
    L, P = half.seq_len_tokens, half.prefix_tokens
    d, r = dst_layout.dcp_for(dst_end.name)
    p, q = src_layout.dcp_for(src_end.name)
    d_ps = dst_end.page_size
    page_lo = hv.row_lo // d_ps  # rows and pages checked by build_send_plan
    if hv.row_lo == hv.row_hi:
        return vec(), EMPTY_IDS
    slices = not same_slices(src_layout, dst_layout, src_layout.geometry(src_end.name),
                             dst_layout.geometry(dst_end.name))
    if slices and pair_pieces(src_layout, src_end.name, dst_layout, dst_end.name).count == 0:
        return vec(), EMPTY_IDS  # no head this source rank sends to that destination rank (Note [TP heads])
    if (p, q) == (d, r) and not slices:
        # Same local rows on both sides: whole pages, plus the boundary page as rows (Note [Boundary page]).
        src_pages = _translate(src_alloc, checked[owner].take(page_lo, -(-hv.row_hi // ps)), src_end.name)
        if hv.row_lo % ps == 0:
            return vec(src_pages, dst_pages), src_pages
        rows = np.arange(hv.row_lo, min((page_lo + 1) * ps, hv.row_hi), dtype=np.int64) % ps
        src_rows, dst_rows = src_pages[0] * ps + rows, dst_pages[0] * ps + rows
        src_rows.setflags(write=False)
        dst_rows.setflags(write=False)
        return vec(src_pages[1:], dst_pages[1:], src_rows, dst_rows), src_pages
    # Different row layouts or slices: the positions this source rank owns among the receiver's rows, row by
    # row, each side in its own page size (F14).
    translator = get_translator("cpu")
    row_hi = hv.row_hi
    if slices and (p, d) == (1, 1):
        # the last pages whole up to where the first of them ends (rows past L are valid on neither side, Note
        # [Boundary page]), so a head-group-outer page is one run, not one per row
        row_hi = min(-(-L // ps) * ps, -(-L // d_ps) * d_ps)
    dst_rows = np.arange(hv.row_lo, row_hi, dtype=np.int64)
    positions = dst_rows * d + r
    window = src_end.window_tokens
    lo_pos = P if window is None else max(P, L - window)
    keep, local = translator.rank_local_positions(positions, p, q)
    keep, src_local = keep.numpy(), local.numpy()
    dst_rows = dst_rows[keep]
    pos_ok = positions[keep] >= lo_pos
    dst_rows, src_local = dst_rows[pos_ok], src_local[pos_ok]
    if src_local.shape[0] == 0:
        return vec(), EMPTY_IDS
    real = src_local[dst_rows < hv.row_hi]  # rows below L: they must have ids (the rest share their last page)
    if real.shape[0] and int(real.max()) >= vt.shape[0]:
        raise UmallocValueError(f"src_vtokens for end {src_end.name!r} has {vt.shape[0]} rows; need "
                                f"{int(real.max()) + 1}")
    _check_rows(vt, ps, real, f"src {name}")
    src_page_idx = src_local // ps
    uniq = np.unique(src_page_idx)  # sorted
    vpages = vt[uniq * ps] // ps
    _check_distinct(vpages, f"src {name}")
    src_phys = _translate(src_alloc, vpages, src_end.name)
    src_tok = src_phys[np.searchsorted(uniq, src_page_idx)] * ps + src_local % ps
    dst_tok = dst_pages[dst_rows // d_ps - page_lo] * d_ps + dst_rows % d_ps
    src_tok.setflags(write=False)
    dst_tok.setflags(write=False)
    return vec(EMPTY_IDS, EMPTY_IDS, src_tok, dst_tok), src_phys


def _check_half_vector(hv: HalfVector, dst_end: EndSpec) -> None:
    """Refuse a half vector whose kind does not fit its end's role (``slots`` for a ``state`` end, ``rows``
    otherwise) or that names a destination page twice (two descriptors would write one page and another page's
    rows would never arrive). O(pages) for ascending pages (what builders make), else O(pages log pages)."""
    want = "slots" if dst_end.role is EndRole.STATE else "rows"
    if hv.kind != want:
        raise UmallocValueError(f"half vector {hv.name!r}: kind {hv.kind!r} for end {dst_end.name!r} (role "
                                f"{dst_end.role.value}); allowed {want!r}")
    pages = hv.pages
    if pages.shape[0] > 1 and not bool((pages[1:] > pages[:-1]).all()):
        s = np.sort(pages)
        dup = np.flatnonzero(s[1:] == s[:-1])
        if dup.size:
            raise UmallocValueError(f"half vector {hv.name!r}: destination page {int(s[dup[0]])} is named twice; "
                                    "allowed each physical page once")


def build_send_plan(request_id: str, src_alloc: PlanAllocator, src_vtokens: VTokens,
                    half: ReceiverHalf | Mapping[str, Any], dst_layout: PeerLayout, *,
                    src_layout: PeerLayout | None = None, src_owner: str | None = None,
                    seq_len_tokens: int | None = None,
                    deadline_s: float | None = DEFAULT_DEADLINE_S) -> TransferPlan:
    """The sender's plan for one request, from its own allocator and the receiver's half.

    Args:
        request_id: must equal the half's.
        src_alloc: the sender's allocator.
        src_vtokens: the sender's virtual token ids of the request's local rows (see :func:`build_receiver_half`).
        half: the receiver's :class:`ReceiverHalf` or its :meth:`~ReceiverHalf.to_dict`.
        dst_layout: the receiver's layout as received at connect (already checked compatible there, F22); the
            half must name its digest. Keep one object per peer: its digest and geometry are computed once.
        src_layout: the sender's layout (default from ``src_alloc.arena``; carries the sender's DCP rank/size).
        src_owner: the owner a single ``src_vtokens`` tensor belongs to.
        seq_len_tokens: the sender's ``L``, cross-checked against the half's when given.
        deadline_s: source lease deadline in seconds (default :data:`DEFAULT_DEADLINE_S`; ``None``: until
            released).

    Returns:
        A pending :class:`TransferPlan` holding the source lease (``dst_lease`` is ``None``: the receiver holds
        its own). Descriptors are bounds-checked against both layouts and both sides' leased pages.

    Raises:
        UmallocValueError: request id, digest, length or vector-set mismatch (F10, F22), a half whose rows
            disagree with the shared geometry (F23), missing owners, a malformed half dict.
        InvalidIdError / TombstoneError: bad virtual token ids (as :func:`build_receiver_half`).
        DescriptorBoundsError: a descriptor outside either side's regions or leased pages; nothing is leased.
        LeaseError: the allocator refuses a source page.

    Complexity: O(rows + pages) plus the descriptors' bounds check.
    """
    _check_allocator(src_alloc, "src_alloc")
    _check_deadline(deadline_s)
    if not isinstance(half, ReceiverHalf):
        half = ReceiverHalf.from_dict(half)
    src_layout = PeerLayout.from_arena(src_alloc.arena) if src_layout is None else src_layout
    if half.request_id != request_id:
        raise UmallocValueError(f"receiver half is for request {half.request_id!r}, not {request_id!r}")
    if half.layout_digest != dst_layout.digest:
        raise UmallocValueError(f"receiver half names layout {half.layout_digest}, but the connected peer's layout "
                                f"is {dst_layout.digest}: reconnect (geometry is checked at connect, F22)")
    if (half.dcp_size, half.dcp_rank) != (dst_layout.dcp_size, dst_layout.dcp_rank):
        raise UmallocValueError("receiver half DCP differs from its layout's")
    if seq_len_tokens is not None and seq_len_tokens != half.seq_len_tokens:
        raise UmallocValueError(f"sender L={seq_len_tokens} but receiver L={half.seq_len_tokens}")
    src_names, dst_names = src_layout.vector_names(), dst_layout.vector_names()
    if src_names != dst_names or set(half.vectors) != set(dst_names):
        raise UmallocValueError(f"vector sets differ: sender {src_names}, receiver layout {dst_names}, half "
                                f"{sorted(half.vectors)} (F10: every vector travels)")
    spec = src_layout.spec
    owner_vt = _resolve_vtokens(spec, src_vtokens, src_owner, "src")
    replicated_sender = half.dcp_rank % src_layout.dcp_size == src_layout.dcp_rank
    spans: dict[str, tuple[int, int]] = {}
    for name, end_name in src_names.items():
        hv = half.vectors[name]
        if hv.end != dst_names[name]:
            raise UmallocValueError(f"half vector {name!r} names end {hv.end!r}, layout has {dst_names[name]!r}")
        _check_half_vector(hv, dst_layout.end(hv.end))
        src_end = spec.end(end_name)
        if not is_dcp_sharded(src_end) and not replicated_sender:
            continue  # another source rank sends it (Note [DCP rows])
        vt = owner_vt[spec.owner_of(end_name)]
        ps = src_end.page_size
        if hv.kind == "slots":
            spans[end_name] = (0, -(-vt.shape[0] // ps))
            continue
        d, r = dst_layout.dcp_for(hv.end)
        dst_end = dst_layout.end(hv.end)
        expect = rows_of_checked(dst_end, half.seq_len_tokens, half.prefix_tokens, d, r)
        page_lo, page_hi = _page_span(hv.row_lo, hv.row_hi, dst_end.page_size)
        if (hv.row_lo, hv.row_hi) != expect or hv.pages.size != page_hi - page_lo:
            raise UmallocValueError(
                f"vector {name!r}: receiver half covers rows [{hv.row_lo}, {hv.row_hi}) with {hv.pages.size} "
                f"page(s); the shared geometry gives rows {list(expect)} with {page_hi - page_lo} page(s) "
                f"(L={half.seq_len_tokens}, P={half.prefix_tokens}, DCP {d}/{r})")
        if hv.row_lo != hv.row_hi and src_layout.dcp_for(end_name) == (d, r) and same_slices(
                src_layout, dst_layout, src_layout.geometry(end_name), dst_layout.geometry(hv.end)):
            if vt.shape[0] < hv.row_hi:
                raise UmallocValueError(f"src_vtokens for end {end_name!r} has {vt.shape[0]} rows; need "
                                        f"{hv.row_hi}")
            spans[end_name] = (page_lo, page_hi)
    checked = _owner_pages(spec, owner_vt, spans, "src")
    vectors: dict[str, IndexVector] = {}
    read: dict[str, list[np.ndarray]] = {}
    for name, end_name in src_names.items():
        hv = half.vectors[name]
        v, pages = _sender_vector(name, spec.end(end_name), dst_layout.end(hv.end), hv,
                                  owner_vt[spec.owner_of(end_name)], checked, src_alloc, src_layout, dst_layout,
                                  half, replicated_sender)
        vectors[name] = v
        if pages.shape[0]:
            read.setdefault(end_name, []).append(pages)
    src_pages = {e: _sorted_unique(p) for e, p in read.items()}
    plan = TransferPlan.of_checked(request_id, vectors, src_layout, dst_layout, src_pages, half.leased_pages())
    lease = _lease(src_alloc, src_pages, deadline_s, f"plan-src:{request_id}")
    if lease is not None:
        plan.attach_leases(lease, None)
    return plan


def build_plan(request_id: str, src_alloc: PlanAllocator, src_vtokens: VTokens, dst_alloc: PlanAllocator,
               dst_vtokens: VTokens, *, prefix_tokens: int = 0, seq_len_tokens: int | None = None,
               src_owner: str | None = None, dst_owner: str | None = None, src_layout: PeerLayout | None = None,
               dst_layout: PeerLayout | None = None, checked: CheckedLayouts | None = None,
               deadline_s: float | None = DEFAULT_DEADLINE_S) -> TransferPlan:
    """A plan between two in-process allocators (the local backend): receiver half + sender plan in one call.

    Args: as :func:`build_receiver_half` (``dst_*``) and :func:`build_send_plan` (``src_*``); the layouts
    default to :meth:`PeerLayout.from_arena` of each allocator's arena. ``checked``: the
    :class:`~umalloc.transfer.layout.CheckedLayouts` that :func:`~umalloc.transfer.layout.compatible_layouts`
    made for ``(src_layout, dst_layout)`` at connect: the pair is not checked again (it must be that pair).
    Without it the pair is :func:`check_compatible`-checked (cached per pair of digests).

    Returns:
        A pending :class:`TransferPlan` holding both leases (``src_lease`` and ``dst_lease``).

    Raises:
        IncompatiblePeerError: the two layouts differ (every difference listed).
        UmallocValueError: ``checked`` is not a CheckedLayouts, or does not cover the layouts given.
        Everything :func:`build_receiver_half` and :func:`build_send_plan` raise; on any error no lease is held.
    """
    _check_allocator(src_alloc, "src_alloc")
    _check_allocator(dst_alloc, "dst_alloc")
    src_layout = PeerLayout.from_arena(src_alloc.arena) if src_layout is None else src_layout
    dst_layout = PeerLayout.from_arena(dst_alloc.arena) if dst_layout is None else dst_layout
    if checked is None:
        check_compatible(src_layout, dst_layout)
    elif not isinstance(checked, CheckedLayouts):
        raise UmallocValueError(f"checked={type(checked).__name__}: allowed a CheckedLayouts from "
                                "compatible_layouts(src_layout, dst_layout)")
    elif not checked.covers(src_layout, dst_layout):
        raise UmallocValueError("checked: the CheckedLayouts pair is not (src_layout, dst_layout); allowed the "
                                "token compatible_layouts made for these layouts")
    half = build_receiver_half(request_id, dst_alloc, dst_vtokens, seq_len_tokens=seq_len_tokens,
                               prefix_tokens=prefix_tokens, dst_owner=dst_owner, layout=dst_layout,
                               deadline_s=deadline_s)
    try:
        plan = build_send_plan(request_id, src_alloc, src_vtokens, half, dst_layout, src_layout=src_layout,
                               src_owner=src_owner, seq_len_tokens=None, deadline_s=deadline_s)
    except BaseException as exc:
        half.fail(exc)
        raise
    plan.attach_leases(plan.src_lease, half.lease)
    return plan


__all__ = ["DEFAULT_DEADLINE_S", "PlanAllocator", "VTokens", "build_plan", "build_receiver_half", "build_send_plan"]
