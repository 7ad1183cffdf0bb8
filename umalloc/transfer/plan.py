"""Transfer plans: named index vectors of physical pages bound to region groups, for one PD request.

Policy:

* A :class:`PeerLayout` describes one side (geometry of every end, TP and DCP rank/size, registered regions,
  the arena's base address). It is JSON-safe (:meth:`PeerLayout.to_dict`), and :func:`check_compatible`
  refuses a peer at connect time with every difference listed (F22), never per request.
* A :class:`TransferPlan` pairs, per end, source and destination *physical* page ids (F13) in named
  :class:`IndexVector` s: ``target`` (full attention), ``swa_tail`` (the sliding window tail only),
  ``draft`` (the drafter's own end, own page size, never the target's ids: F10, F14) and ``state`` (one slot
  per request). Every end of the layout travels in its own vector; a plan is never built without one (F10).
* Which tokens travel is decided on the receiver's side (Note [Which rows travel]); the sender recomputes the
  same ranges from the shared geometry and refuses a receiver that disagrees.
* The payload starts at the receiver's prefix: tokens it already holds are never sent, and a prefix ending
  mid-page is clipped at token granularity (Note [Boundary page], F23).
* Building a plan leases the pages it touches (source pages on the sender, destination pages on the
  receiver); :meth:`TransferPlan.complete`, :meth:`~TransferPlan.fail` and :meth:`~TransferPlan.abort` release
  them, idempotently; the plan is a context manager (an exception fails it).
* Descriptors come from coalesced runs (:mod:`umalloc.translators`, the one run-coalescing implementation) and
  are bounds-checked, vectorized, against the regions and the leased pages of both sides before anyone can
  read them; a violation raises :class:`~umalloc.errors.DescriptorBoundsError` and nothing is returned. In the
  two-process form the receiver's half carries the pages its lease actually pins, separately from its vectors.
* Two forms: :func:`build_plan` for two in-process allocators (the local backend); :func:`build_receiver_half`
  (receiver: pages + lease, JSON-safe) and :func:`build_send_plan` (sender: its pages + lease + descriptors)
  for two processes.
* The SWA tail comes from ``MultiEndedAllocator.swa_tail_start``, the one function the allocators use (F19).
* Decode context parallel (DCP): ends of role ``target`` and ``swa`` are sharded by token position
  (rank ``r`` of ``d`` holds positions ``p % d == r`` at rank-local row ``p // d``); ``draft`` and ``state`` ends
  keep logical rows (Note [DCP rows]).

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
rank; P8->D8 pairs rank ``q`` with rank ``q`` page by page; P1->D1 is the plain page-to-page plan.
"""

from __future__ import annotations

import hashlib
import json
import math
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import TracebackType
from typing import Any, Protocol

import numpy as np
import torch

from umalloc.core.allocator import MultiEndedAllocator
from umalloc.errors import (
    DescriptorBoundsError,
    IncompatiblePeerError,
    InvalidIdError,
    LeaseError,
    UmallocValueError,
)
from umalloc.geometry.region import Region, RegionGroup, RegionMember
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, KVDtype, LayerKind, LayerSpec, swa_tail_start
from umalloc.translators import get_translator

#: Vector name of each end role (a second end of the same role is named ``"<role name>.<end name>"``).
VECTOR_NAME_BY_ROLE: dict[EndRole, str] = {
    EndRole.TARGET: "target",
    EndRole.DRAFT: "draft",
    EndRole.SWA: "swa_tail",
    EndRole.STATE: "state",
}
_ROLE_ORDER = (EndRole.TARGET, EndRole.DRAFT, EndRole.SWA, EndRole.STATE)
#: Roles whose ends are sharded by token position under DCP (Note [DCP rows]).
DCP_SHARDED_ROLES = frozenset({EndRole.TARGET, EndRole.SWA})

PLAN_PENDING = "pending"
PLAN_DONE = "done"
PLAN_FAILED = "failed"
PLAN_ABORTED = "aborted"

_LAYOUT_FORMAT = 1
#: Descriptors carry uint64 addresses: no byte a layout names may lie at or past 2**64.
_ADDRESS_LIMIT = 1 << 64
_HALF_FORMAT = 1
_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_EMPTY_I64.setflags(write=False)





# ==== DCP row arithmetic ======================================================================================


def owned_count(num_tokens: int, dcp_size: int = 1, dcp_rank: int = 0) -> int:
    """Positions in ``[0, num_tokens)`` that DCP rank ``dcp_rank`` of ``dcp_size`` owns (``x % size == rank``):
    its rank-local rows below ``num_tokens``. O(1).

    >>> owned_count(10, 4, 1), owned_count(10, 4, 3), owned_count(10)
    (3, 2, 10)
    """
    _check_dcp(dcp_size, dcp_rank)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise UmallocValueError(f"num_tokens={num_tokens!r}: allowed an int >= 0")
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
    _check_dcp(dst_dcp_size, dst_dcp_rank)
    _check_dcp(src_dcp_size, 0)
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
    if end.role is EndRole.STATE:
        raise UmallocValueError(f"end {end.name!r} is a state end: it travels as a whole slot, not by rows")
    _check_tokens(seq_len_tokens, prefix_tokens)
    d, r = (dcp_size, dcp_rank) if is_dcp_sharded(end) else (1, 0)
    _check_dcp(d, r)
    row_hi = owned_count(seq_len_tokens, d, r)
    prefix_rows = owned_count(prefix_tokens, d, r)
    window = end.window_tokens
    if window is None:
        return prefix_rows, row_hi
    window_rows = row_hi - owned_count(max(0, seq_len_tokens - window), d, r)
    if window_rows == 0:
        return row_hi, row_hi
    tail = swa_tail_start(row_hi, window_rows, prefix_rows, end.page_size)
    return max(prefix_rows, tail), row_hi


def _check_dcp(dcp_size: object, dcp_rank: object) -> None:
    if isinstance(dcp_size, bool) or not isinstance(dcp_size, int) or dcp_size < 1:
        raise UmallocValueError(f"dcp_size={dcp_size!r}: allowed an int >= 1")
    if isinstance(dcp_rank, bool) or not isinstance(dcp_rank, int) or not 0 <= dcp_rank < dcp_size:
        raise UmallocValueError(f"dcp_rank={dcp_rank!r}: allowed an int in [0, {dcp_size - 1}]")


def _check_tokens(seq_len_tokens: object, prefix_tokens: object) -> None:
    if isinstance(seq_len_tokens, bool) or not isinstance(seq_len_tokens, int) or seq_len_tokens < 0:
        raise UmallocValueError(f"seq_len_tokens={seq_len_tokens!r}: allowed an int >= 0")
    if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int) \
            or not 0 <= prefix_tokens <= seq_len_tokens:
        raise UmallocValueError(f"prefix_tokens={prefix_tokens!r}: allowed an int in [0, {seq_len_tokens}]")


@dataclass(frozen=True, eq=False)
class _EndGeom:
    """Per-end numbers a plan uses on every call, computed once per layout."""

    name: str
    page_size: int
    page_bytes: int
    first_page: int
    top_page: int
    block_offs: np.ndarray  # uint64 (B,): byte offset of every K / V / latent block inside a page
    block_bytes: np.ndarray  # uint64 (B,): bytes one token row occupies in that block

    @classmethod
    def of(cls, spec: ArenaSpec, end: EndSpec) -> _EndGeom:
        offs, sizes = [], []
        for (k_off, v_off), layer in zip(end.layer_offsets_bytes, end.layers, strict=True):
            offs.append(k_off)
            sizes.append(layer.k_token_bytes)
            if layer.v_token_bytes:
                offs.append(v_off)
                sizes.append(layer.v_token_bytes)
        o, b = np.array(offs, dtype=np.uint64), np.array(sizes, dtype=np.uint64)
        o.setflags(write=False)
        b.setflags(write=False)
        return cls(end.name, end.page_size, end.page_bytes, spec.first_page(end.name), spec.top_page(end.name),
                   o, b)

    @property
    def num_blocks(self) -> int:
        return int(self.block_offs.shape[0])

    def same_bytes(self, other: _EndGeom) -> bool:
        return (self.page_size, self.page_bytes) == (other.page_size, other.page_bytes) and \
            np.array_equal(self.block_offs, other.block_offs) and np.array_equal(self.block_bytes, other.block_bytes)


#: PeerLayout.from_arena cache: arena -> {(tp_rank, tp_size, dcp_rank, dcp_size, base_ptr): layout}.
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: check_compatible cache: (local digest, remote digest) -> differences.
_COMPAT: dict[tuple[str, str], list[str]] = {}


# ==== PeerLayout ==============================================================================================


@dataclass(frozen=True)
class PeerLayout:
    """Serializable description of one side of a transfer.

    Attributes:
        spec: the side's :class:`ArenaSpec` (ends: name, role, page_size, layers with head geometry and dtypes,
            grow, owner; ``entry_bytes``/``page_bytes`` derive from it).
        regions: the registered regions of that side (the arena lies inside one of them).
        arena_base_ptr: address of byte 0 of the arena; page ``p`` of end ``e`` is at
            ``arena_base_ptr + p * page_bytes(e)``.
        tp_rank, tp_size: tensor-parallel rank and size (an envelope holds that rank's heads).
        dcp_rank, dcp_size: decode-context-parallel rank and size (Note [DCP rows]).
        device: ``"cpu"`` or ``"cuda:N"`` of the arena.

    Raises:
        UmallocValueError: ranks out of range, no region containing the arena, or (under DCP) a bound end whose
            sharding differs from its owner's (a draft that keeps logical rows must be its own id owner).

    >>> from umalloc.geometry.spec import LayerSpec
    >>> spec = ArenaSpec((EndSpec("full", (LayerSpec.mha(1, 8),), page_size=2),), arena_bytes=640)
    >>> lay = PeerLayout(spec, (Region(1000, 640),), 1000)
    >>> lay.region_member("full").address(3), PeerLayout.from_dict(lay.to_dict()) == lay
    (1192, True)
    """

    spec: ArenaSpec
    regions: tuple[Region, ...]
    arena_base_ptr: int
    tp_rank: int = 0
    tp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.spec, ArenaSpec):
            raise UmallocValueError(f"PeerLayout.spec={self.spec!r}: allowed an ArenaSpec")
        object.__setattr__(self, "regions", tuple(self.regions))
        if not self.regions or not all(isinstance(r, Region) for r in self.regions):
            raise UmallocValueError("PeerLayout.regions: allowed a non-empty sequence of Region")
        if isinstance(self.arena_base_ptr, bool) or not isinstance(self.arena_base_ptr, int) \
                or self.arena_base_ptr < 0:
            raise UmallocValueError(f"PeerLayout.arena_base_ptr={self.arena_base_ptr!r}: allowed an int >= 0")
        for what, end_ptr in [("arena", self.arena_base_ptr + self.spec.arena_bytes)] + [
                (f"region {r.base_ptr}+{r.nbytes}", r.end_ptr) for r in self.regions]:
            if end_ptr > _ADDRESS_LIMIT:
                raise UmallocValueError(f"PeerLayout: the {what} ends at byte {end_ptr}, past the 64-bit address "
                                        f"space: allowed an end <= 2**64")
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise UmallocValueError(f"PeerLayout.tp_size={self.tp_size!r}: allowed an int >= 1")
        if isinstance(self.tp_rank, bool) or not isinstance(self.tp_rank, int) \
                or not 0 <= self.tp_rank < self.tp_size:
            raise UmallocValueError(f"PeerLayout.tp_rank={self.tp_rank!r}: allowed [0, {self.tp_size - 1}]")
        _check_dcp(self.dcp_size, self.dcp_rank)
        if not isinstance(self.device, str):
            raise UmallocValueError(f"PeerLayout.device={self.device!r}: allowed a str")
        if self._arena_region() is None:
            raise UmallocValueError(
                f"PeerLayout: no region contains the arena [{self.arena_base_ptr}, "
                f"{self.arena_base_ptr + self.spec.arena_bytes}); regions: "
                f"{[(r.base_ptr, r.nbytes) for r in self.regions]}")
        if self.dcp_size > 1:
            for e in self.spec.ends:
                if e.owner is not None and is_dcp_sharded(e) != is_dcp_sharded(self.spec.end(e.owner)):
                    raise UmallocValueError(
                        f"end {e.name!r} (role {e.role.value}) is bound to {e.owner!r} but under DCP "
                        f"({self.dcp_size}) one is sharded by position and the other keeps logical rows; "
                        "allowed: make it its own id owner (owner=None)")

    @cached_property
    def _geom(self) -> dict[str, _EndGeom]:
        return {e.name: _EndGeom.of(self.spec, e) for e in self.spec.ends}

    def _arena_region(self) -> Region | None:
        for r in self.regions:
            if r.contains(self.arena_base_ptr, self.spec.arena_bytes):
                return r
        return None

    @classmethod
    def from_arena(cls, arena: Any, *, tp_rank: int = 0, tp_size: int = 1, dcp_rank: int = 0,
                   dcp_size: int = 1) -> PeerLayout:
        """The layout of an :class:`~umalloc.geometry.arena.Arena` (its spec, regions and base address).

        Cached per arena and arguments (the arena's bytes never move), so repeated plans reuse one layout and
        its digest."""
        key = (tp_rank, tp_size, dcp_rank, dcp_size, arena.base_ptr)
        try:
            per_arena = _LAYOUTS.setdefault(arena, {})
        except TypeError:  # not weak-referenceable: no cache
            per_arena = {}
        layout = per_arena.get(key)
        if layout is None:
            region = arena.region()
            layout = cls(arena.spec, tuple(arena.regions()), arena.base_ptr, tp_rank, tp_size, dcp_rank,
                         dcp_size, region.device)
            per_arena[key] = layout
        return layout

    # ---- geometry ------------------------------------------------------------------------------------------
    @property
    def ends(self) -> tuple[EndSpec, ...]:
        return self.spec.ends

    def end(self, name: str) -> EndSpec:
        """The end called ``name`` (raises :class:`~umalloc.errors.SpecError` if absent)."""
        return self.spec.end(name)

    def geometry(self, end: str) -> _EndGeom:
        """Cached per-end numbers (page size/bytes, handable page range, layer block offsets). Raises
        :class:`~umalloc.errors.SpecError` for an unknown end."""
        geom = self._geom.get(end)
        if geom is None:
            self.spec.end(end)  # raises naming the allowed ends
        return geom  # type: ignore[return-value]

    def dcp_for(self, end: str) -> tuple[int, int]:
        """``(dcp_size, dcp_rank)`` that lay out ``end``'s rows: this side's DCP for a sharded end, ``(1, 0)``
        for an end keeping logical rows."""
        return (self.dcp_size, self.dcp_rank) if is_dcp_sharded(self.end(end)) else (1, 0)

    def region_member(self, end: str) -> RegionMember:
        """The region member whose index ``p`` addresses physical page ``p`` of ``end``."""
        region = self._arena_region()
        assert region is not None  # checked in __post_init__
        return RegionMember(region, self.geometry(end).page_bytes, self.arena_base_ptr - region.base_ptr)

    def region_group(self, end: str) -> RegionGroup:
        """One-member :class:`RegionGroup` for ``end``'s pages."""
        return RegionGroup((self.region_member(end),))

    def vector_names(self) -> dict[str, str]:
        """``{vector name: end name}`` in plan order (target, draft, swa_tail, state; ends in spec order)."""
        out: dict[str, str] = {}
        for role in _ROLE_ORDER:
            for e in self.spec.ends_with_role(role):
                base = VECTOR_NAME_BY_ROLE[role]
                out[base if base not in out else f"{base}.{e.name}"] = e.name
        return out

    # ---- serialization ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-safe dict (ints, strs, lists, None). Derived byte sizes are included so a peer can check them."""
        spec = self.spec
        return {
            "format": _LAYOUT_FORMAT,
            "arena_bytes": spec.arena_bytes,
            "floor_bytes": spec.floor_bytes,
            "arena_base_ptr": self.arena_base_ptr,
            "device": self.device,
            "tp_rank": self.tp_rank, "tp_size": self.tp_size,
            "dcp_rank": self.dcp_rank, "dcp_size": self.dcp_size,
            "regions": [r.to_dict() for r in self.regions],
            "ends": [_end_to_dict(spec, e) for e in spec.ends],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PeerLayout:
        """Inverse of :meth:`to_dict`; re-validates everything, including the derived byte sizes.

        Raises:
            UmallocValueError: a malformed dict, an invalid spec, or declared sizes that disagree with the
                layers (a peer whose metadata is inconsistent).
        """
        try:
            if d["format"] != _LAYOUT_FORMAT:
                raise UmallocValueError(f"PeerLayout format {d['format']!r}: allowed {_LAYOUT_FORMAT}")
            ends = tuple(_end_from_dict(e) for e in d["ends"])
            spec = ArenaSpec(ends, arena_bytes=_wire_int(d["arena_bytes"]),
                             floor_bytes=_wire_int(d["floor_bytes"]))
            for ed in d["ends"]:
                e = spec.end(ed["name"])
                declared = {k: ed[k] for k in ("entry_bytes", "page_bytes", "first_page", "top_page")}
                actual = {"entry_bytes": e.entry_bytes, "page_bytes": e.page_bytes,
                          "first_page": spec.first_page(e.name), "top_page": spec.top_page(e.name)}
                if declared != actual:
                    raise UmallocValueError(f"peer end {e.name!r} declares {declared} but its layers give {actual}")
            return cls(spec, tuple(Region.from_dict(r) for r in d["regions"]), _wire_int(d["arena_base_ptr"]),
                       _wire_int(d["tp_rank"]), _wire_int(d["tp_size"]), _wire_int(d["dcp_rank"]),
                       _wire_int(d["dcp_size"]), str(d["device"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, UmallocValueError):
                raise
            raise UmallocValueError(f"malformed PeerLayout dict: {exc!r}") from exc

    @cached_property
    def digest(self) -> str:
        """Short SHA-256 of the canonical :meth:`to_dict` JSON; a receiver half names the layout it was built on."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:32]


def _wire_int(value: object) -> int:
    """An int field of a peer's dict, exactly: a float, str or bool is malformed, never silently converted."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an int, got {value!r}")
    return value


def _end_to_dict(spec: ArenaSpec, e: EndSpec) -> dict:
    return {
        "name": e.name, "role": e.role.value, "page_size": e.page_size, "grow": e.grow.value, "owner": e.owner,
        "entry_bytes": e.entry_bytes, "page_bytes": e.page_bytes,
        "first_page": spec.first_page(e.name), "top_page": spec.top_page(e.name),
        "layers": [{"kind": x.kind.value, "num_kv_heads": x.num_kv_heads, "head_dim_k": x.head_dim_k,
                    "head_dim_v": x.head_dim_v, "latent_dim": x.latent_dim, "window_tokens": x.window_tokens,
                    "dtype": x.dtype.value} for x in e.layers],
    }


def _end_from_dict(d: Mapping[str, Any]) -> EndSpec:
    layers = tuple(LayerSpec(LayerKind(x["kind"]), _wire_int(x["num_kv_heads"]), _wire_int(x["head_dim_k"]),
                             _wire_int(x["head_dim_v"]), _wire_int(x["latent_dim"]),
                             None if x["window_tokens"] is None else _wire_int(x["window_tokens"]), KVDtype(x["dtype"]))
                   for x in d["layers"])
    return EndSpec(str(d["name"]), layers, _wire_int(d["page_size"]), Grow(d["grow"]),
                   None if d["owner"] is None else str(d["owner"]), EndRole(d["role"]))


_LAYER_FIELDS = ("kind", "num_kv_heads", "head_dim_k", "head_dim_v", "latent_dim", "window_tokens", "dtype")


def _fmt(v: object) -> str:
    return str(v.value) if isinstance(v, (LayerKind, KVDtype, EndRole)) else repr(v)


def layout_differences(local: PeerLayout, remote: PeerLayout) -> list[str]:
    """Every geometry difference that makes envelope transfers between ``local`` and ``remote`` wrong.

    Compared: the set of ends (by name) and each end's role, page size, entry/page bytes, layer count and per
    layer kind, head geometry, window and dtype; TP size and rank (an envelope holds one TP rank's heads).
    Not compared (local placement choices): arena size, floor, grow direction, owner binding, regions, DCP
    (plans remap rows between DCP layouts, Note [DCP rows]). O(ends * layers).
    """
    diffs: list[str] = []
    if local.tp_size != remote.tp_size:
        diffs.append(f"tp_size: local {local.tp_size} != remote {remote.tp_size} "
                     "(envelopes hold one TP rank's heads; both sides need the same TP)")
    if local.tp_rank != remote.tp_rank:
        diffs.append(f"tp_rank: local {local.tp_rank} != remote {remote.tp_rank} (a rank pairs with the same rank)")
    lnames = [e.name for e in local.ends]
    rnames = {e.name for e in remote.ends}
    for name in lnames:
        if name not in rnames:
            diffs.append(f"end {name!r} (role {local.end(name).role.value}): missing on remote")
    for e in remote.ends:
        if e.name not in set(lnames):
            diffs.append(f"end {e.name!r} (role {e.role.value}): missing on local")
    for name in lnames:
        if name not in rnames:
            continue
        a, b = local.end(name), remote.end(name)
        for attr in ("role", "page_size", "entry_bytes", "page_bytes"):
            va, vb = getattr(a, attr), getattr(b, attr)
            if va != vb:
                diffs.append(f"end {name!r}: {attr} local {_fmt(va)} != remote {_fmt(vb)}")
        if len(a.layers) != len(b.layers):
            diffs.append(f"end {name!r}: layer count local {len(a.layers)} != remote {len(b.layers)}")
        for i, (la, lb) in enumerate(zip(a.layers, b.layers, strict=False)):
            for attr in _LAYER_FIELDS:
                va, vb = getattr(la, attr), getattr(lb, attr)
                if va != vb:
                    diffs.append(f"end {name!r} layer {i}: {attr} local {_fmt(va)} != remote {_fmt(vb)}")
    return diffs


def check_compatible(local: PeerLayout, remote: PeerLayout) -> None:
    """Refuse an incompatible peer at connect time (F22); see :func:`layout_differences` for what is compared.

    Raises:
        IncompatiblePeerError: with ``differences`` listing every difference, one line each.

    >>> from umalloc.geometry.spec import LayerSpec
    >>> def lay(ps, heads):
    ...     spec = ArenaSpec((EndSpec("full", (LayerSpec.mha(heads, 8),), page_size=ps),), arena_bytes=4096)
    ...     return PeerLayout(spec, (Region(1 << 20, 4096),), 1 << 20)
    >>> check_compatible(lay(2, 1), lay(2, 1))
    >>> try:
    ...     check_compatible(lay(2, 1), lay(4, 2))
    ... except IncompatiblePeerError as e:
    ...     print(len(e.differences), e.differences[0])
    4 end 'full': page_size local 2 != remote 4
    """
    key = (local.digest, remote.digest)
    diffs = _COMPAT.get(key)
    if diffs is None:
        diffs = layout_differences(local, remote)
        if len(_COMPAT) >= 4096:
            _COMPAT.clear()
        _COMPAT[key] = diffs
    if diffs:
        raise IncompatiblePeerError(list(diffs))


# ==== index vectors ===========================================================================================


def _as_page_tensor(x: object, what: str) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "iu":
            raise InvalidIdError(f"{what}: dtype {x.dtype}, allowed int64")
        t = torch.from_numpy(np.array(x, dtype=np.int64))  # a private, writable copy
    elif isinstance(x, torch.Tensor):
        if x.dtype != torch.int64:
            raise InvalidIdError(f"{what}: dtype {x.dtype}, allowed torch.int64")
        t = x.detach().cpu()
    elif isinstance(x, (list, tuple)):
        t = torch.tensor(x, dtype=torch.int64) if len(x) else torch.zeros(0, dtype=torch.int64)
    else:
        raise InvalidIdError(f"{what}: {type(x).__name__}, allowed an int64 tensor, array or list")
    if t.dim() != 1:
        raise InvalidIdError(f"{what}: shape {tuple(t.shape)}, allowed 1-D")
    if t.numel() and int(t.min()) < 0:
        raise InvalidIdError(f"{what}: negative physical id {int(t.min())}")
    return t.contiguous()


@dataclass(frozen=True, eq=False)
class IndexVector:
    """One named vector of a plan: source and destination *physical* ids of one end, bound to region groups.

    Attributes:
        name: ``"target"``, ``"draft"``, ``"swa_tail"``, ``"state"`` (or ``"<role>.<end>"`` for a second end of
            a role).
        src_end, dst_end: end names on each side (equal for plans built here).
        src_pages, dst_pages: int64 CPU tensors ``(n,)``; pair ``i`` is one whole-envelope copy.
        src_group, dst_group: region groups whose members step by that end's ``page_bytes``.
        src_rows, dst_rows: int64 CPU tensors ``(m,)`` of physical *token* ids (``page * page_size + row``);
            pair ``i`` copies one token row of every layer block (Note [Boundary page], Note [DCP rows]).

    Raises:
        InvalidIdError: non-1-D, non-int64 or negative ids, or unequal pair lengths.
    """

    name: str
    src_end: str
    dst_end: str
    src_pages: torch.Tensor
    dst_pages: torch.Tensor
    src_group: RegionGroup
    dst_group: RegionGroup
    src_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    dst_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    def __post_init__(self) -> None:
        for attr in ("src_pages", "dst_pages", "src_rows", "dst_rows"):
            object.__setattr__(self, attr, _as_page_tensor(getattr(self, attr), f"{self.name}.{attr}"))
        if self.src_pages.numel() != self.dst_pages.numel():
            raise InvalidIdError(f"vector {self.name!r}: {self.src_pages.numel()} source pages but "
                                 f"{self.dst_pages.numel()} destination pages; they pair by position")
        if self.src_rows.numel() != self.dst_rows.numel():
            raise InvalidIdError(f"vector {self.name!r}: {self.src_rows.numel()} source rows but "
                                 f"{self.dst_rows.numel()} destination rows; they pair by position")
        if not isinstance(self.src_group, RegionGroup) or not isinstance(self.dst_group, RegionGroup):
            raise UmallocValueError(f"vector {self.name!r}: src_group/dst_group must be RegionGroup")
        if len(self.src_group.members) != len(self.dst_group.members):
            raise UmallocValueError(f"vector {self.name!r}: region groups of {len(self.src_group.members)} and "
                                    f"{len(self.dst_group.members)} members; they pair by position")

    @property
    def num_pages(self) -> int:
        """Whole-envelope page pairs."""
        return int(self.src_pages.numel())

    @property
    def num_rows(self) -> int:
        """Row pairs (boundary or DCP rows)."""
        return int(self.src_rows.numel())

    @property
    def empty(self) -> bool:
        return self.num_pages == 0 and self.num_rows == 0


# ==== descriptors =============================================================================================


def _row_runs(translator: Any, src_rows: torch.Tensor, dst_rows: torch.Tensor, page_size: int) -> np.ndarray:
    """Runs ``(src_token, dst_token, num_rows)`` of row pairs contiguous on both sides *inside one page*.

    Coalescing is the translators' ``pages_to_runs`` on ids spread by one per page (``t + t // page_size``), so
    a run never crosses a page boundary on either side (rows of two pages are not adjacent bytes).
    """
    if src_rows.numel() == 0:
        return np.zeros((0, 3), dtype=np.int64)
    spread_s = src_rows + torch.div(src_rows, page_size, rounding_mode="floor")
    spread_d = dst_rows + torch.div(dst_rows, page_size, rounding_mode="floor")
    runs = translator.pages_to_runs(spread_s, spread_d).cpu().numpy().astype(np.int64, copy=True)
    runs[:, 0] -= runs[:, 0] // (page_size + 1)
    runs[:, 1] -= runs[:, 1] // (page_size + 1)
    return runs


def _row_descriptors(runs: np.ndarray, geom: _EndGeom, src_group: RegionGroup, dst_group: RegionGroup
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``(K * R * B, 3)`` uint64 descriptors (member-major, then run, then layer block) and member ids."""
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
    member = np.repeat(np.arange(k, dtype=np.int64), r * b)
    return out.reshape(k * r * b, 3), member


def _page_mask(geom: _EndGeom, leased: np.ndarray) -> np.ndarray:
    """Prefix sums of a bool mask over the end's page slots; pages outside the handable range never count."""
    slots = geom.top_page + 1
    mask = np.zeros(slots + 1, dtype=np.int64)
    if leased.size:
        ok = leased[(leased >= geom.first_page) & (leased < slots)]
        mask[ok + 1] = 1
    return np.cumsum(mask)


def _refuse_first(ok: np.ndarray, sel: np.ndarray, vector: str, side: str, why: str, *cols: np.ndarray) -> None:
    """Raise :class:`DescriptorBoundsError` naming the first row ``i`` where ``ok`` is False; ``why`` is
    formatted with row ``i`` of each of ``cols`` (``{0}``, ``{1}``, ...)."""
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise DescriptorBoundsError(f"vector {vector!r} {side} descriptor {int(sel[i])}: "
                                    f"{why.format(*(int(c[i]) for c in cols))}; nothing was sent")


def _check_side(vector: str, side: str, desc_addr: np.ndarray, nbytes: np.ndarray, member: np.ndarray,
                group: RegionGroup, layout: PeerLayout, end: _EndGeom, leased_cum: np.ndarray) -> None:
    """Vectorized bounds check of one side of one vector's descriptors (DescriptorBoundsError on the first bad
    row, naming it). O(N + page slots)."""
    spec = layout.spec
    first, top = end.first_page, end.top_page
    pb = end.page_bytes  # == every member's item_bytes (_check_group)
    arena_lo = layout.arena_base_ptr
    for m, mem in enumerate(group.members):
        sel = np.flatnonzero(member == m)
        if sel.size == 0:
            continue
        addr, n = desc_addr[sel], nbytes[sel]
        reg_lo, reg_hi = mem.region.base_ptr, mem.region.end_ptr
        lo = np.uint64(max(reg_lo, arena_lo))
        hi = np.uint64(min(reg_hi, arena_lo + spec.arena_bytes))
        room = np.where(addr <= hi, hi - np.minimum(addr, hi), np.uint64(0))
        _refuse_first((addr >= lo) & (addr <= hi) & (n > np.uint64(0)) & (n <= room), sel, vector, side,
                      f"bytes [{{0}}, {{0}} + {{1}}) fall outside the registered region and arena [{lo}, {hi})",
                      addr, n)
        off = (addr - np.uint64(arena_lo)).astype(np.int64)
        p_lo = off // pb
        p_hi = (off + n.astype(np.int64) - 1) // pb
        _refuse_first((p_lo >= first) & (p_hi <= top), sel, vector, side,
                      f"pages [{{0}}, {{1}}] of end {end.name!r} leave the handable range [{first}, {top}] (page 0 "
                      "and the reserved floor are never transferred)", p_lo, p_hi)
        covered = leased_cum[p_hi + 1] - leased_cum[p_lo]
        _refuse_first(covered == (p_hi - p_lo + 1), sel, vector, side,
                      f"pages [{{0}}, {{1}}] of end {end.name!r} are not all leased by this plan", p_lo, p_hi)


def _check_ids(vector: str, side: str, pages: torch.Tensor, rows: torch.Tensor, end: _EndGeom) -> None:
    """Refuse a page id, or the page of a row id, past the end's last page *before* any address arithmetic:
    such an id could wrap a uint64 address back into the arena and slip past :func:`_check_side`."""
    for what, ids, ps in (("page", pages, 1), ("row", rows, end.page_size)):
        beyond = torch.div(ids, ps, rounding_mode="floor") > end.top_page
        if ids.numel() and bool(beyond.any()):
            i = int(torch.nonzero(beyond)[0, 0])
            raise DescriptorBoundsError(
                f"vector {vector!r} {side} {what} id {int(ids[i])} (entry {i}) lies outside the pages of end "
                f"{end.name!r} (last page {end.top_page}); nothing was sent")


def _check_group(vector: str, side: str, group: RegionGroup, layout: PeerLayout, end: _EndGeom) -> None:
    """A group's members must step by the end's page bytes and lie inside a region that side registered."""
    for m, mem in enumerate(group.members):
        if mem.item_bytes != end.page_bytes:
            raise DescriptorBoundsError(f"vector {vector!r} {side}: region member {m} steps {mem.item_bytes} B "
                                        f"but end {end.name!r} pages are {end.page_bytes} B")
        if not any(r.contains(mem.region.base_ptr, mem.region.nbytes) for r in layout.regions):
            raise DescriptorBoundsError(f"vector {vector!r} {side}: region member {m} "
                                        f"({mem.region.base_ptr}, {mem.region.nbytes}) is not a registered region "
                                        f"of that side")


def _pages_dict(pages: Mapping[str, object] | None, what: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for end, arr in (pages or {}).items():
        out[end] = np.unique(_as_page_tensor(arr, f"{what}[{end!r}]").numpy())
    return out


# ==== leases (what the plan needs of an allocator) ============================================================


class _LeaseLike(Protocol):
    @property
    def active(self) -> bool: ...

    @property
    def state(self) -> str: ...

    def release(self) -> bool: ...


class _PlanAllocator(Protocol):
    arena: Any
    spec: ArenaSpec

    def translate_pages(self, vpages: torch.Tensor, end: str, *, strict: bool = True) -> torch.Tensor: ...

    def lease(self, pages: Mapping[str, torch.Tensor], *, deadline_s: float | None = None,
              tag: str = "") -> Any: ...


class _LeaseHolder:
    """Shared terminal-state machinery of :class:`TransferPlan` and :class:`ReceiverHalf`."""

    _leases: tuple[_LeaseLike | None, ...]
    state: str
    error: BaseException | None

    def _finish(self, state: str, exc: BaseException | None = None) -> bool:
        if self.state != PLAN_PENDING:
            return False  # idempotent: the first terminal transition wins
        self.state = state
        self.error = exc
        for lease in self._leases:
            if lease is not None:
                lease.release()
        return True

    def complete(self) -> bool:
        """Mark done and release every lease this object holds. Returns False (and changes nothing) if it had
        already ended. O(leased pages)."""
        return self._finish(PLAN_DONE)

    def fail(self, exc: BaseException | None = None) -> bool:
        """Mark failed (keeping ``exc`` as ``error``) and release every lease. Idempotent like :meth:`complete`."""
        return self._finish(PLAN_FAILED, exc)

    def abort(self) -> bool:
        """Mark aborted and release every lease. Idempotent like :meth:`complete`."""
        return self._finish(PLAN_ABORTED)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            self.fail(exc)
        else:
            self.complete()

    def _check_usable(self) -> None:
        if self.state != PLAN_PENDING:
            raise UmallocValueError(f"{type(self).__name__} is {self.state}: its leases are released, nothing "
                                    "may be posted")
        for lease in self._leases:
            if lease is not None and not lease.active:
                raise LeaseError(f"a lease of this {type(self).__name__} ended ({lease.state}) before the transfer "
                                 "was posted; its pages may be reused (F11)")


# ==== TransferPlan ============================================================================================


@dataclass(frozen=True)
class VectorStats:
    """Counters of one vector: page pairs, row pairs, runs, descriptors, bytes, per-layer-equivalent."""

    pages: int
    rows: int
    runs: int
    descriptors: int
    bytes: int
    per_layer_descriptor_equivalent: int


class TransferPlan(_LeaseHolder):
    """One request's transfer: named :class:`IndexVector` s, their bounds-checked descriptors, and the leases.

    Built by :func:`build_plan` (two in-process allocators) or :func:`build_send_plan` (sender side of two
    processes); constructible directly from hand-made vectors (the bounds check still runs).

    Args:
        request_id: the request's id (str).
        vectors: the vectors (sequence, or mapping name -> vector) in plan order.
        src_layout, dst_layout: the two sides' layouts (geometry, regions, base addresses).
        src_leased_pages, dst_leased_pages: per end, the physical pages leased on each side for this plan;
            every descriptor must lie inside them.
        src_lease, dst_lease: lease objects released when the plan ends (``None``: held elsewhere, e.g. by the
            remote receiver's :class:`ReceiverHalf`).

    Attributes:
        total_bytes, num_descriptors, num_runs: counters over every vector.
        per_layer_descriptor_equivalent: descriptors a per-layer (non-envelope) design would post: for every
            whole page ``layers x (2 for MHA K/V, 1 for MLA)`` per region, plus the row descriptors (a per-layer
            design needs those too).
        state: ``"pending"`` | ``"done"`` | ``"failed"`` | ``"aborted"``; ``error`` keeps the failure.

    Raises:
        DescriptorBoundsError: a descriptor outside the regions, the handable pages, or the leased pages
            (nothing is posted; the plan is not created).
        UmallocValueError: vectors naming unknown ends or duplicate names.

    Complexity: O(pages + rows * blocks + page slots) at construction; :meth:`descriptors` is O(1).

    >>> from umalloc.geometry.spec import LayerSpec
    >>> spec = ArenaSpec((EndSpec("full", (LayerSpec.mha(1, 8),), page_size=2),), arena_bytes=640)
    >>> src, dst = PeerLayout(spec, (Region(1000, 640),), 1000), PeerLayout(spec, (Region(2000, 640),), 2000)
    >>> v = IndexVector("target", "full", "full", torch.tensor([3, 4]), torch.tensor([7, 8]),
    ...                 src.region_group("full"), dst.region_group("full"))
    >>> plan = TransferPlan("r1", [v], src_layout=src, dst_layout=dst, src_leased_pages={"full": [3, 4]},
    ...                     dst_leased_pages={"full": [7, 8]})
    >>> plan.descriptors().tolist(), plan.per_layer_descriptor_equivalent
    ([[1192, 2448, 128]], 4)
    """

    def __init__(self, request_id: str, vectors: Sequence[IndexVector] | Mapping[str, IndexVector], *,
                 src_layout: PeerLayout, dst_layout: PeerLayout,
                 src_leased_pages: Mapping[str, object] | None = None,
                 dst_leased_pages: Mapping[str, object] | None = None,
                 src_lease: _LeaseLike | None = None, dst_lease: _LeaseLike | None = None) -> None:
        vecs = list(vectors.values()) if isinstance(vectors, Mapping) else list(vectors)
        self.request_id = request_id
        self.src_layout = src_layout
        self.dst_layout = dst_layout
        self.vectors: dict[str, IndexVector] = {}
        for v in vecs:
            if not isinstance(v, IndexVector):
                raise UmallocValueError(f"vectors: {type(v).__name__}, allowed IndexVector")
            if v.name in self.vectors:
                raise UmallocValueError(f"vectors: duplicate name {v.name!r}")
            src_layout.end(v.src_end)
            dst_layout.end(v.dst_end)
            self.vectors[v.name] = v
        self.src_leased_pages = _pages_dict(src_leased_pages, "src_leased_pages")
        self.dst_leased_pages = _pages_dict(dst_leased_pages, "dst_leased_pages")
        self.state = PLAN_PENDING
        self.error: BaseException | None = None
        self._leases = ()
        self._by_vector, self.stats_by_vector = self._build_descriptors()
        parts = [d for d in self._by_vector.values() if d.shape[0]]
        all_desc = np.concatenate(parts) if parts else np.zeros((0, 3), dtype=np.uint64)
        all_desc.setflags(write=False)
        self._all = all_desc
        self.num_descriptors = int(all_desc.shape[0])
        self.total_bytes = int(all_desc[:, 2].sum(dtype=np.uint64)) if all_desc.shape[0] else 0
        self.num_runs = sum(s.runs for s in self.stats_by_vector.values())
        self.per_layer_descriptor_equivalent = sum(
            s.per_layer_descriptor_equivalent for s in self.stats_by_vector.values())
        self._leases = (src_lease, dst_lease)

    @property
    def src_lease(self) -> _LeaseLike | None:
        return self._leases[0]

    @property
    def dst_lease(self) -> _LeaseLike | None:
        return self._leases[1]

    def _attach_leases(self, src_lease: _LeaseLike | None, dst_lease: _LeaseLike | None) -> None:
        self._leases = (src_lease, dst_lease)

    def _build_descriptors(self) -> tuple[dict[str, np.ndarray], dict[str, VectorStats]]:
        translator = get_translator("cpu")
        cums: dict[tuple[str, str], np.ndarray] = {}
        by_vector: dict[str, np.ndarray] = {}
        stats: dict[str, VectorStats] = {}
        for v in self.vectors.values():
            s_end, d_end = self.src_layout.geometry(v.src_end), self.dst_layout.geometry(v.dst_end)
            if not s_end.same_bytes(d_end):
                raise UmallocValueError(f"vector {v.name!r}: ends {v.src_end!r} and {v.dst_end!r} differ in "
                                        "geometry (check_compatible the layouts first)")
            _check_group(v.name, "src", v.src_group, self.src_layout, s_end)
            _check_group(v.name, "dst", v.dst_group, self.dst_layout, d_end)
            _check_ids(v.name, "src", v.src_pages, v.src_rows, s_end)
            _check_ids(v.name, "dst", v.dst_pages, v.dst_rows, d_end)
            k = len(v.src_group.members)
            parts, members = [], []
            runs = translator.pages_to_runs(v.src_pages, v.dst_pages)
            num_page_runs = int(runs.shape[0])
            if num_page_runs:
                desc = translator.runs_to_descriptors(runs, v.src_group.bases_and_items(),
                                                      v.dst_group.bases_and_items())
                parts.append(desc)
                members.append(np.repeat(np.arange(k, dtype=np.int64), num_page_runs))
            row_runs = _row_runs(translator, v.src_rows, v.dst_rows, s_end.page_size)
            if row_runs.shape[0]:
                desc, mem = _row_descriptors(row_runs, s_end, v.src_group, v.dst_group)
                parts.append(desc)
                members.append(mem)
            desc = np.concatenate(parts) if parts else np.zeros((0, 3), dtype=np.uint64)
            member = np.concatenate(members) if members else _EMPTY_I64
            if desc.shape[0]:
                for side, layout, end, col, leased in (
                        ("src", self.src_layout, s_end, 0, self.src_leased_pages),
                        ("dst", self.dst_layout, d_end, 1, self.dst_leased_pages)):
                    key = (side, end.name)
                    if key not in cums:
                        cums[key] = _page_mask(end, leased.get(end.name, _EMPTY_I64))
                    group = v.src_group if side == "src" else v.dst_group
                    _check_side(v.name, side, desc[:, col], desc[:, 2], member, group, layout, end, cums[key])
            desc.setflags(write=False)
            by_vector[v.name] = desc
            blocks = s_end.num_blocks
            n_row_desc = int(row_runs.shape[0]) * blocks * k
            stats[v.name] = VectorStats(
                pages=v.num_pages, rows=v.num_rows, runs=num_page_runs + int(row_runs.shape[0]),
                descriptors=int(desc.shape[0]),
                bytes=int(desc[:, 2].sum(dtype=np.uint64)) if desc.shape[0] else 0,
                per_layer_descriptor_equivalent=v.num_pages * blocks * k + n_row_desc)
        return by_vector, stats

    def descriptors(self) -> np.ndarray:
        """All descriptors, vector by vector in plan order: read-only ``(N, 3)`` uint64
        ``(src_addr, dst_addr, nbytes)``, bounds-checked at construction.

        Raises:
            UmallocValueError: the plan already ended.
            LeaseError: a lease the plan holds ended (expired or released elsewhere) before posting.
        """
        self._check_usable()
        return self._all

    def descriptors_by_vector(self) -> dict[str, np.ndarray]:
        """``{vector name: read-only (n, 3) uint64 descriptors}`` (the rows of :meth:`descriptors`, split).
        Raises as :meth:`descriptors`."""
        self._check_usable()
        return dict(self._by_vector)

    def summary(self) -> dict[str, Any]:
        """Counters as a JSON-safe dict (fixed keys)."""
        return {
            "request_id": self.request_id, "state": self.state, "descriptors": self.num_descriptors,
            "runs": self.num_runs, "bytes": self.total_bytes,
            "per_layer_descriptor_equivalent": self.per_layer_descriptor_equivalent,
            "vectors": {n: vars(s) for n, s in self.stats_by_vector.items()},
        }

    def __repr__(self) -> str:
        return (f"TransferPlan({self.request_id!r}, state={self.state}, vectors={list(self.vectors)}, "
                f"descriptors={self.num_descriptors}, bytes={self.total_bytes})")


# ==== receiver half ===========================================================================================


@dataclass(frozen=True, eq=False)
class HalfVector:
    """The receiver's side of one vector.

    Attributes:
        name: vector name; end: the receiver's end.
        kind: ``"rows"`` (token-addressed: pages cover local rows ``[row_lo, row_hi)``) or ``"slots"`` (state).
        row_lo, row_hi: the receiver's local rows filled (``"slots"``: 0 and the slot's tokens).
        pages: read-only int64 physical pages covering ``[row_lo // page_size, ceil(row_hi / page_size))``.
    """

    name: str
    end: str
    kind: str
    row_lo: int
    row_hi: int
    pages: np.ndarray

    def to_dict(self) -> dict:
        return {"end": self.end, "kind": self.kind, "row_lo": self.row_lo, "row_hi": self.row_hi,
                "pages": [int(p) for p in self.pages]}


class ReceiverHalf(_LeaseHolder):
    """What the receiver (decode) publishes for one request: its physical pages per vector (F13), the rows they
    cover, the request length and prefix, and the digest of the :class:`PeerLayout` they refer to.

    Built by :func:`build_receiver_half`, which leases the pages; the receiver ends the lease with
    :meth:`complete` / :meth:`fail` / :meth:`abort` (or a ``with`` block) when every sender has finished.
    :meth:`to_dict` is JSON-safe (physical ids only, never virtual ids); :meth:`from_dict` rebuilds a lease-less
    copy on the sender.

    ``leased`` (per end, the pages the receiver's lease actually pins) travels separately from the vectors, so
    the sender's bounds check compares every destination descriptor with the lease, not with the vectors that
    produced it: a corrupted vector entry is refused (``None``: the vectors' own pages, for hand-built halves).
    """

    def __init__(self, request_id: str, layout_digest: str, seq_len_tokens: int, prefix_tokens: int,
                 dcp_size: int, dcp_rank: int, vectors: Mapping[str, HalfVector], *,
                 leased: Mapping[str, object] | None = None, lease: _LeaseLike | None = None) -> None:
        _check_tokens(seq_len_tokens, prefix_tokens)
        _check_dcp(dcp_size, dcp_rank)
        self.request_id = request_id
        self.layout_digest = layout_digest
        self.seq_len_tokens = seq_len_tokens
        self.prefix_tokens = prefix_tokens
        self.dcp_size = dcp_size
        self.dcp_rank = dcp_rank
        self.vectors = dict(vectors)
        self._leased = self.pages_by_end() if leased is None else _pages_dict(leased, "leased")
        self.state = PLAN_PENDING
        self.error: BaseException | None = None
        self._leases = (lease,)

    @property
    def lease(self) -> _LeaseLike | None:
        return self._leases[0]

    def leased_pages(self) -> dict[str, np.ndarray]:
        """Per end, the sorted unique pages the receiver's lease pins (what destination descriptors may touch)."""
        return dict(self._leased)

    def pages_by_end(self) -> dict[str, np.ndarray]:
        """Per end, the sorted unique pages of every vector."""
        out: dict[str, list[np.ndarray]] = {}
        for hv in self.vectors.values():
            out.setdefault(hv.end, []).append(hv.pages)
        return {e: np.unique(np.concatenate(p)) for e, p in out.items()}

    def to_dict(self) -> dict:
        """JSON-safe dict (ints, strs, lists)."""
        return {"format": _HALF_FORMAT, "request_id": self.request_id, "layout_digest": self.layout_digest,
                "seq_len_tokens": self.seq_len_tokens, "prefix_tokens": self.prefix_tokens,
                "dcp_size": self.dcp_size, "dcp_rank": self.dcp_rank,
                "vectors": {n: hv.to_dict() for n, hv in self.vectors.items()},
                "leased": {e: [int(p) for p in pages] for e, pages in self._leased.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReceiverHalf:
        """Inverse of :meth:`to_dict` (without the lease). Raises :class:`UmallocValueError` on a malformed dict."""
        try:
            if d["format"] != _HALF_FORMAT:
                raise UmallocValueError(f"ReceiverHalf format {d['format']!r}: allowed {_HALF_FORMAT}")
            vectors = {}
            for name, hv in d["vectors"].items():
                if hv["kind"] not in ("rows", "slots"):
                    raise UmallocValueError(f"half vector {name!r} kind {hv['kind']!r}: allowed 'rows', 'slots'")
                pages = _as_page_tensor(list(hv["pages"]), f"half vector {name!r} pages").numpy()
                pages.setflags(write=False)
                vectors[str(name)] = HalfVector(str(name), str(hv["end"]), hv["kind"], _wire_int(hv["row_lo"]),
                                                _wire_int(hv["row_hi"]), pages)
            return cls(str(d["request_id"]), str(d["layout_digest"]), _wire_int(d["seq_len_tokens"]),
                       _wire_int(d["prefix_tokens"]), _wire_int(d["dcp_size"]), _wire_int(d["dcp_rank"]), vectors,
                       leased={str(e): list(p) for e, p in d["leased"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, UmallocValueError):
                raise
            raise UmallocValueError(f"malformed ReceiverHalf dict: {exc!r}") from exc

    def __repr__(self) -> str:
        return (f"ReceiverHalf({self.request_id!r}, state={self.state}, L={self.seq_len_tokens}, "
                f"P={self.prefix_tokens}, vectors={ {n: len(v.pages) for n, v in self.vectors.items()} })")


#: The name the agreed interface uses for the receiver's half.
PlanHalf = ReceiverHalf


# ==== building from allocators ================================================================================


VTokens = torch.Tensor | Mapping[str, torch.Tensor]


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
        if not isinstance(vt, torch.Tensor) or vt.dtype != torch.int64 or vt.dim() != 1:
            raise InvalidIdError(f"{side}_vtokens[{name!r}]: allowed a 1-D int64 tensor of virtual token ids")
        out[name] = vt.detach().cpu().numpy()
    missing = sorted({spec.owner_of(e.name) for e in spec.ends} - set(out))
    if missing:
        raise UmallocValueError(
            f"{side}_vtokens has no virtual token ids for owner(s) {missing}: every end travels in its own "
            "vector (F10), so each id owner (a draft with its own page size included) needs its token ids")
    return out


def _vpages_for(vt: np.ndarray, page_size: int, page_lo: int, page_hi: int, what: str) -> np.ndarray:
    """Virtual pages of local pages ``[page_lo, page_hi)`` of a token-addressed sequence, after checking that
    rows ``[page_lo * ps, min(page_hi * ps, len))`` are page-consistent (row ``i`` sits at offset ``i % ps`` of
    the same virtual page as the first row of its page). O(rows), numpy."""
    if page_hi <= page_lo:
        return _EMPTY_I64
    if (page_hi - 1) * page_size >= vt.shape[0]:
        raise InvalidIdError(f"{what}: {vt.shape[0]} virtual token ids do not reach local page {page_hi - 1} "
                             f"(row {(page_hi - 1) * page_size})")
    lo, hi = page_lo * page_size, min(page_hi * page_size, vt.shape[0])
    seg = vt[lo:hi]
    rows = np.arange(lo, hi, dtype=np.int64)
    _check_rows(vt, page_size, rows, what)
    return seg[::page_size] // page_size


def _check_rows(vt: np.ndarray, ps: int, rows: np.ndarray, what: str) -> None:
    """Raise :class:`InvalidIdError` unless ``vt[rows]`` are page-consistent with their page's first row."""
    seg = vt[rows]
    firsts = vt[(rows // ps) * ps]
    bad = (seg < 0) | (seg // ps != firsts // ps) | (seg % ps != rows % ps)
    if bad.any():
        i = int(rows[np.flatnonzero(bad)[0]])
        raise InvalidIdError(f"{what}: row {i} has virtual token id {int(vt[i])}, not at offset {i % ps} of its "
                             "page's virtual page (a token-addressed sequence fills pages in order)")


def _translate(alloc: _PlanAllocator, vpages: np.ndarray, end: str) -> np.ndarray:
    if vpages.shape[0] == 0:
        return _EMPTY_I64
    phys = alloc.translate_pages(torch.from_numpy(np.ascontiguousarray(vpages)), end, strict=True)
    return phys.detach().cpu().numpy().astype(np.int64, copy=False)


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


def build_receiver_half(request_id: str, dst_alloc: _PlanAllocator, dst_vtokens: VTokens, *,
                        seq_len_tokens: int | None = None, prefix_tokens: int = 0, dst_owner: str | None = None,
                        layout: PeerLayout | None = None, deadline_s: float | None = None) -> ReceiverHalf:
    """The receiver's half of a plan: its physical pages per vector, leased.

    Args:
        request_id: the request id (also the lease tag, prefixed ``"plan-dst:"``).
        dst_alloc: the receiver's allocator (``translate_pages``, ``lease``, ``spec``, ``arena``).
        dst_vtokens: virtual token ids of the request's local rows, one int64 tensor for the target owner or a
            mapping ``{owner end: tensor}`` (a draft with its own page size needs its own entry; a ``state`` end
            its slot's token ids). A tensor may be longer than the rows transferred (lookahead slots, F09).
        seq_len_tokens: ``L`` (logical positions); default: the token owners' common length (required under
            DCP).
        prefix_tokens: ``P``, leading tokens the receiver already holds (not sent, never overwritten: F23).
        dst_owner: the owner a single tensor belongs to (default: the target's id owner).
        layout: the receiver's :class:`PeerLayout` (default: ``PeerLayout.from_arena(dst_alloc.arena)``);
            carries its DCP rank/size.
        deadline_s: lease deadline in seconds (``None``: until released).

    Returns:
        A pending :class:`ReceiverHalf` holding the lease.

    Raises:
        UmallocValueError: missing owners (F10), bad lengths/prefix, a bound state end.
        InvalidIdError / TombstoneError: token ids that are not page-consistent or pages not bound.
        LeaseError: a page the allocator refuses to lease. Nothing is leased on any error.

    Complexity: O(rows) validation + O(pages) translation.
    """
    layout = PeerLayout.from_arena(dst_alloc.arena) if layout is None else layout
    spec = layout.spec
    owner_vt = _resolve_vtokens(spec, dst_vtokens, dst_owner, "dst")
    L = _default_seq_len(spec, layout, owner_vt, seq_len_tokens, "dst")
    _check_tokens(L, prefix_tokens)
    vectors: dict[str, HalfVector] = {}
    for name, end_name in layout.vector_names().items():
        end = spec.end(end_name)
        vt = owner_vt[spec.owner_of(end_name)]
        ps = end.page_size
        if end.role is EndRole.STATE:
            if not end.is_owner:
                raise UmallocValueError(f"state end {end_name!r} is bound to {end.owner!r}: a state slot needs "
                                        "its own id owner")
            row_lo, row_hi, kind = 0, vt.shape[0], "slots"
        else:
            d, r = layout.dcp_for(end_name)
            row_lo, row_hi = vector_rows(end, L, prefix_tokens, dcp_size=d, dcp_rank=r)
            kind = "rows"
            if vt.shape[0] < row_hi:
                raise UmallocValueError(f"dst_vtokens[{spec.owner_of(end_name)!r}] has {vt.shape[0]} rows; end "
                                        f"{end_name!r} needs {row_hi} (L={L}, DCP {d}/{r})")
        page_lo, page_hi = row_lo // ps, -(-row_hi // ps)
        if row_lo == row_hi and kind == "rows":
            page_lo = page_hi = 0
        vpages = _vpages_for(vt, ps, page_lo, page_hi, f"dst {name}")
        pages = _translate(dst_alloc, vpages, end_name).copy()
        pages.setflags(write=False)
        vectors[name] = HalfVector(name, end_name, kind, row_lo, row_hi, pages)
    wanted = ReceiverHalf(request_id, layout.digest, L, prefix_tokens, layout.dcp_size, layout.dcp_rank,
                          vectors).pages_by_end()
    lease_pages = {e: torch.from_numpy(p.copy()) for e, p in wanted.items() if p.size}
    lease = None
    if lease_pages:
        lease = dst_alloc.lease(lease_pages, deadline_s=deadline_s, tag=f"plan-dst:{request_id}")
    leased = {e: np.asarray(p) for e, p in lease.pages.items()} if lease is not None else {}
    return ReceiverHalf(request_id, layout.digest, L, prefix_tokens, layout.dcp_size, layout.dcp_rank, vectors,
                        leased=leased, lease=lease)


def _sender_vector(name: str, src_end: EndSpec, dst_end: EndSpec, hv: HalfVector, vt: np.ndarray,
                   src_alloc: _PlanAllocator, src_layout: PeerLayout, dst_layout: PeerLayout, half: ReceiverHalf,
                   replicated_sender: bool) -> IndexVector:
    """Pair the receiver's half vector ``hv`` with this sender's physical ids (Note [DCP rows])."""
    ps = src_end.page_size
    src_group, dst_group = src_layout.region_group(src_end.name), dst_layout.region_group(dst_end.name)
    e64 = torch.zeros(0, dtype=torch.int64)

    def vec(sp: object = e64, dp: object = e64, sr: object = e64, dr: object = e64) -> IndexVector:
        return IndexVector(name, src_end.name, dst_end.name, sp, dp, src_group, dst_group, sr, dr)  # type: ignore

    sharded = is_dcp_sharded(src_end)
    if not sharded and not replicated_sender:
        return vec()  # another source rank sends this unsharded vector (Note [DCP rows])
    dst_pages = hv.pages
    if hv.kind == "slots":
        n_pages = -(-vt.shape[0] // ps)
        src_pages = _translate(src_alloc, _vpages_for(vt, ps, 0, n_pages, f"src {name}"), src_end.name)
        if src_pages.size != dst_pages.size:
            raise UmallocValueError(f"vector {name!r}: sender slot has {src_pages.size} page(s), receiver "
                                    f"{dst_pages.size}")
        return vec(src_pages, dst_pages)
    L, P = half.seq_len_tokens, half.prefix_tokens
    d, r = dst_layout.dcp_for(dst_end.name)
    p, q = src_layout.dcp_for(src_end.name)
    expect = vector_rows(dst_end, L, P, dcp_size=d, dcp_rank=r)
    page_lo, page_hi = hv.row_lo // ps, -(-hv.row_hi // ps)
    if hv.row_lo == hv.row_hi:
        page_lo = page_hi = 0
    if (hv.row_lo, hv.row_hi) != expect or dst_pages.size != page_hi - page_lo:
        raise UmallocValueError(
            f"vector {name!r}: receiver half covers rows [{hv.row_lo}, {hv.row_hi}) with {dst_pages.size} page(s); "
            f"the shared geometry gives rows {list(expect)} with {page_hi - page_lo} page(s) (L={L}, P={P}, "
            f"DCP {d}/{r})")
    if hv.row_lo == hv.row_hi:
        return vec()
    if (p, q) == (d, r):
        # Same local rows on both sides: whole pages, plus the boundary page as rows (Note [Boundary page]).
        if vt.shape[0] < hv.row_hi:
            raise UmallocValueError(f"src_vtokens for end {src_end.name!r} has {vt.shape[0]} rows; need {hv.row_hi}")
        src_pages = _translate(src_alloc, _vpages_for(vt, ps, page_lo, page_hi, f"src {name}"), src_end.name)
        first_whole = 1 if hv.row_lo % ps else 0
        rows = np.arange(hv.row_lo, min((page_lo + 1) * ps, hv.row_hi), dtype=np.int64) if first_whole else \
            _EMPTY_I64
        return vec(src_pages[first_whole:], dst_pages[first_whole:],
                   src_pages[0] * ps + rows % ps, dst_pages[0] * ps + rows % ps)
    # Different row layouts: the positions this source rank owns among the receiver's rows, row by row.
    translator = get_translator("cpu")
    dst_rows = np.arange(hv.row_lo, hv.row_hi, dtype=np.int64)
    positions = dst_rows * d + r
    window = src_end.window_tokens
    lo_pos = P if window is None else max(P, L - window)
    keep, local = translator.rank_local_positions(positions, p, q)
    keep, src_local = keep.numpy(), local.numpy()
    dst_rows = dst_rows[keep]
    pos_ok = positions[keep] >= lo_pos
    dst_rows, src_local = dst_rows[pos_ok], src_local[pos_ok]
    if src_local.shape[0] == 0:
        return vec()
    if int(src_local.max()) >= vt.shape[0]:
        raise UmallocValueError(f"src_vtokens for end {src_end.name!r} has {vt.shape[0]} rows; need "
                                f"{int(src_local.max()) + 1}")
    _check_rows(vt, ps, src_local, f"src {name}")
    src_page_idx = src_local // ps
    uniq = np.unique(src_page_idx)  # sorted
    src_phys = _translate(src_alloc, vt[uniq * ps] // ps, src_end.name)
    src_tok = src_phys[np.searchsorted(uniq, src_page_idx)] * ps + src_local % ps
    dst_tok = dst_pages[dst_rows // ps - page_lo] * ps + dst_rows % ps
    return vec(e64, e64, src_tok, dst_tok)


def build_send_plan(request_id: str, src_alloc: _PlanAllocator, src_vtokens: VTokens,
                    half: ReceiverHalf | Mapping[str, Any], dst_layout: PeerLayout, *,
                    src_layout: PeerLayout | None = None, src_owner: str | None = None,
                    seq_len_tokens: int | None = None, deadline_s: float | None = None) -> TransferPlan:
    """The sender's plan for one request, from its own allocator and the receiver's half.

    Args:
        request_id: must equal the half's.
        src_alloc: the sender's allocator.
        src_vtokens: the sender's virtual token ids of the request's local rows (tensor for the target owner or
            ``{owner: tensor}``; see :func:`build_receiver_half`).
        half: the receiver's :class:`ReceiverHalf` or its :meth:`~ReceiverHalf.to_dict`.
        dst_layout: the receiver's layout as received at connect (already :func:`check_compatible`-checked);
            the half must name its digest.
        src_layout: the sender's layout (default from ``src_alloc.arena``; carries the sender's DCP rank/size).
        src_owner: the owner a single ``src_vtokens`` tensor belongs to.
        seq_len_tokens: the sender's ``L``, cross-checked against the half's when given.
        deadline_s: source lease deadline.

    Returns:
        A pending :class:`TransferPlan` holding the source lease (``dst_lease`` is ``None``: the receiver holds
        its own). Descriptors are bounds-checked against both layouts and both sides' leased pages.

    Raises:
        UmallocValueError: request id, digest, length or vector-set mismatch (F10, F22), a half whose rows
            disagree with the shared geometry (F23), missing owners.
        DescriptorBoundsError: a descriptor outside either side's regions or leased pages; nothing is leased.
        LeaseError: the allocator refuses a source page.
    """
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
    vectors = []
    for name, end_name in src_names.items():
        hv = half.vectors[name]
        if hv.end != dst_names[name]:
            raise UmallocValueError(f"half vector {name!r} names end {hv.end!r}, layout has {dst_names[name]!r}")
        vectors.append(_sender_vector(name, spec.end(end_name), dst_layout.end(hv.end), hv,
                                      owner_vt[spec.owner_of(end_name)], src_alloc, src_layout, dst_layout, half,
                                      replicated_sender))
    src_pages = _leased_union(vectors, spec)
    plan = TransferPlan(request_id, vectors, src_layout=src_layout, dst_layout=dst_layout,
                        src_leased_pages=src_pages, dst_leased_pages=half.leased_pages())
    lease_pages = {e: torch.from_numpy(p.copy()) for e, p in src_pages.items() if p.size}
    if lease_pages:
        plan._attach_leases(src_alloc.lease(lease_pages, deadline_s=deadline_s, tag=f"plan-src:{request_id}"),
                            None)
    return plan


def _leased_union(vectors: Iterable[IndexVector], spec: ArenaSpec) -> dict[str, np.ndarray]:
    """Per source end, the unique pages the vectors read (whole pages and the pages of rows)."""
    parts: dict[str, list[np.ndarray]] = {}
    for v in vectors:
        ps = spec.end(v.src_end).page_size
        parts.setdefault(v.src_end, []).extend(
            [v.src_pages.numpy(), torch.div(v.src_rows, ps, rounding_mode="floor").numpy()])
    return {e: np.unique(np.concatenate(p)) for e, p in parts.items()}


def build_plan(request_id: str, src_alloc: _PlanAllocator, src_vtokens: VTokens, dst_alloc: _PlanAllocator,
               dst_vtokens: VTokens, *, prefix_tokens: int = 0, seq_len_tokens: int | None = None,
               src_owner: str | None = None, dst_owner: str | None = None, src_layout: PeerLayout | None = None,
               dst_layout: PeerLayout | None = None, deadline_s: float | None = None) -> TransferPlan:
    """A plan between two in-process allocators (the local backend): receiver half + sender plan in one call.

    Args: as :func:`build_receiver_half` (``dst_*``) and :func:`build_send_plan` (``src_*``); the layouts
    default to :meth:`PeerLayout.from_arena` of each allocator's arena and are :func:`check_compatible`-checked.

    Returns:
        A pending :class:`TransferPlan` holding both leases (``src_lease`` and ``dst_lease``).

    Raises:
        IncompatiblePeerError: the two layouts differ (every difference listed).
        Everything :func:`build_receiver_half` and :func:`build_send_plan` raise; on any error no lease is held.
    """
    src_layout = PeerLayout.from_arena(src_alloc.arena) if src_layout is None else src_layout
    dst_layout = PeerLayout.from_arena(dst_alloc.arena) if dst_layout is None else dst_layout
    check_compatible(src_layout, dst_layout)
    half = build_receiver_half(request_id, dst_alloc, dst_vtokens, seq_len_tokens=seq_len_tokens,
                               prefix_tokens=prefix_tokens, dst_owner=dst_owner, layout=dst_layout,
                               deadline_s=deadline_s)
    try:
        plan = build_send_plan(request_id, src_alloc, src_vtokens, half, dst_layout, src_layout=src_layout,
                               src_owner=src_owner, seq_len_tokens=None, deadline_s=deadline_s)
    except BaseException as exc:
        half.fail(exc)
        raise
    plan._attach_leases(plan.src_lease, half.lease)
    return plan


__all__ = [
    "DCP_SHARDED_ROLES", "PLAN_ABORTED", "PLAN_DONE", "PLAN_FAILED", "PLAN_PENDING", "VECTOR_NAME_BY_ROLE",
    "HalfVector", "IndexVector", "PeerLayout", "PlanHalf", "ReceiverHalf", "TransferPlan", "VectorStats",
    "build_plan", "build_receiver_half", "build_send_plan", "check_compatible", "is_dcp_sharded",
    "layout_differences", "owned_count", "source_ranks", "swa_tail_start", "vector_rows",
]
