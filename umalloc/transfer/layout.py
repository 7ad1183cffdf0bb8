"""Peer layouts: what one side of a transfer looks like, its wire format, and peer compatibility.

Policy:

* A :class:`PeerLayout` describes one side (geometry of every end, TP and DCP rank/size, registered regions,
  the arena's base address). It is immutable and JSON-safe (:meth:`PeerLayout.to_dict` /
  :meth:`PeerLayout.from_dict`, which re-validates every field and refuses floats, strs or bools where ints
  belong). Its :attr:`~PeerLayout.digest` names it on the wire.
* :func:`check_compatible` refuses a peer at connect time with every difference listed (F22), never per
  request. Its result is cached per pair of layout digests; :func:`compatible_layouts` returns the checked pair
  as a :class:`CheckedLayouts` token that a backend keeps from ``connect`` and hands to the plan builders, so no
  plan repeats the check.
* Per-end numbers every plan needs (page bytes, handable page range, layer block offsets, the region group) are
  computed once per layout (:meth:`PeerLayout.geometry`, :meth:`PeerLayout.region_group`).
* :meth:`PeerLayout.from_arena` is cached per arena and arguments, so repeated plans reuse one layout object.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from umalloc.errors import IncompatiblePeerError, UmallocValueError
from umalloc.geometry.region import Region, RegionGroup, RegionMember
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, KVDtype, LayerKind, LayerSpec
from umalloc.transfer.heads import head_map, tp_difference
from umalloc.transfer.rows import check_dcp, is_dcp_sharded

#: Vector name of each end role (a second end of the same role is named ``"<role name>.<end name>"``).
VECTOR_NAME_BY_ROLE: dict[EndRole, str] = {
    EndRole.TARGET: "target",
    EndRole.DRAFT: "draft",
    EndRole.SWA: "swa_tail",
    EndRole.STATE: "state",
}
_ROLE_ORDER = (EndRole.TARGET, EndRole.DRAFT, EndRole.SWA, EndRole.STATE)

_LAYOUT_FORMAT = 2
#: Descriptors carry uint64 addresses: no byte a layout names may lie at or past 2**64.
ADDRESS_LIMIT = 1 << 64


@dataclass(frozen=True, eq=False)
class EndGeometry:
    """Per-end numbers a plan uses on every call, computed once per layout.

    Attributes:
        name, page_size (tokens), page_bytes: the end's.
        first_page, top_page: the handable physical page range ``[first_page, top_page]`` of the end.
        block_offs, block_bytes: read-only uint64 ``(B,)``: byte offset of every K / V / latent block inside a
            page (:attr:`~umalloc.geometry.spec.EndSpec.blocks`: per head group, per layer), and the bytes one
            token row occupies in it.
    """

    name: str
    page_size: int
    page_bytes: int
    first_page: int
    top_page: int
    block_offs: np.ndarray
    block_bytes: np.ndarray

    @classmethod
    def of(cls, spec: ArenaSpec, end: EndSpec) -> EndGeometry:
        o = np.array([b.offset_bytes for b in end.blocks], dtype=np.uint64)
        b = np.array([b.row_bytes for b in end.blocks], dtype=np.uint64)
        o.setflags(write=False)
        b.setflags(write=False)
        return cls(end.name, end.page_size, end.page_bytes, spec.first_page(end.name), spec.top_page(end.name),
                   o, b)

    @property
    def num_blocks(self) -> int:
        return int(self.block_offs.shape[0])

    @cached_property
    def _bytes_key(self) -> tuple:
        return (self.page_size, self.page_bytes, self.block_offs.tobytes(), self.block_bytes.tobytes())

    def same_bytes(self, other: EndGeometry) -> bool:
        """True if a page of ``other`` has this end's byte layout (page size, page bytes, layer blocks). O(1)
        after the first call."""
        return self is other or self._bytes_key == other._bytes_key


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
        tp_rank, tp_size: tensor-parallel rank and size (the layers state the heads this rank holds; Note
            [TP heads] in :mod:`umalloc.transfer.heads`).
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
            if end_ptr > ADDRESS_LIMIT:
                raise UmallocValueError(f"PeerLayout: the {what} ends at byte {end_ptr}, past the 64-bit address "
                                        f"space: allowed an end <= 2**64")
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise UmallocValueError(f"PeerLayout.tp_size={self.tp_size!r}: allowed an int >= 1")
        if isinstance(self.tp_rank, bool) or not isinstance(self.tp_rank, int) \
                or not 0 <= self.tp_rank < self.tp_size:
            raise UmallocValueError(f"PeerLayout.tp_rank={self.tp_rank!r}: allowed [0, {self.tp_size - 1}]")
        check_dcp(self.dcp_size, self.dcp_rank)
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
    def _geom(self) -> dict[str, EndGeometry]:
        return {e.name: EndGeometry.of(self.spec, e) for e in self.spec.ends}

    @cached_property
    def _groups(self) -> dict[str, RegionGroup]:
        region = self._arena_region()
        assert region is not None  # checked in __post_init__
        off = self.arena_base_ptr - region.base_ptr
        return {e.name: RegionGroup((RegionMember(region, e.page_bytes, off),)) for e in self.spec.ends}

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
        its digest.

        Raises: UmallocValueError: ``arena`` is not an arena (a spec, a base address and its regions)."""
        if not all(hasattr(arena, a) for a in ("spec", "base_ptr", "regions", "region")):
            raise UmallocValueError(f"arena={type(arena).__name__}: allowed an umalloc Arena")
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

    def geometry(self, end: str) -> EndGeometry:
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
        return self.region_group(end).members[0]

    def region_group(self, end: str) -> RegionGroup:
        """One-member :class:`RegionGroup` for ``end``'s pages (one object per end and layout). Raises
        :class:`~umalloc.errors.SpecError` for an unknown end."""
        group = self._groups.get(end)
        if group is None:
            self.spec.end(end)  # raises naming the allowed ends
        return group  # type: ignore[return-value]

    def page_limits(self, end: str) -> tuple[np.ndarray, np.ndarray]:
        """Bounds of ``end``'s pages for the compiled descriptor check, for this layout's own
        :meth:`region_group`: uint64 ``(arena_base_ptr, lo, hi, page_bytes)`` with ``[lo, hi)`` the bytes of the
        arena inside its region, and int64 ``(first_page, top_page)``. Cached per end; read-only."""
        lim = self._limits.get(end)
        if lim is None:
            geom = self.geometry(end)
            lo, hi = self.arena_base_ptr, self.arena_base_ptr + self.spec.arena_bytes
            lim = (np.array([lo, lo, hi, geom.page_bytes], dtype=np.uint64),
                   np.array([geom.first_page, geom.top_page], dtype=np.int64))
            for a in lim:
                a.setflags(write=False)
            self._limits[end] = lim
        return lim

    @cached_property
    def _limits(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        return {}

    def vector_names(self) -> dict[str, str]:
        """``{vector name: end name}`` in plan order (target, draft, swa_tail, state; ends in spec order). A new
        dict each call, computed once per layout."""
        return dict(self._vector_names)

    @cached_property
    def _vector_names(self) -> dict[str, str]:
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
            spec = ArenaSpec(ends, arena_bytes=wire_int(d["arena_bytes"]),
                             floor_bytes=wire_int(d["floor_bytes"]))
            for ed in d["ends"]:
                e = spec.end(ed["name"])
                declared = {k: ed[k] for k in ("entry_bytes", "page_bytes", "first_page", "top_page")}
                actual = {"entry_bytes": e.entry_bytes, "page_bytes": e.page_bytes,
                          "first_page": spec.first_page(e.name), "top_page": spec.top_page(e.name)}
                if declared != actual:
                    raise UmallocValueError(f"peer end {e.name!r} declares {declared} but its layers give {actual}")
            return cls(spec, tuple(Region.from_dict(r) for r in d["regions"]), wire_int(d["arena_base_ptr"]),
                       wire_int(d["tp_rank"]), wire_int(d["tp_size"]), wire_int(d["dcp_rank"]),
                       wire_int(d["dcp_size"]), str(d["device"]))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            if isinstance(exc, UmallocValueError):
                raise
            raise UmallocValueError(f"malformed PeerLayout dict: {exc!r}") from exc

    @cached_property
    def digest(self) -> str:
        """Short SHA-256 of the canonical :meth:`to_dict` JSON; a receiver half names the layout it was built on."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:32]


def wire_int(value: object) -> int:
    """An int field of a peer's dict, exactly: a float, str or bool is malformed, never silently converted.

    Raises:
        TypeError: not an int (the ``from_dict`` callers turn it into a typed error naming the dict).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an int, got {value!r}")
    return value


def _end_to_dict(spec: ArenaSpec, e: EndSpec) -> dict:
    return {
        "name": e.name, "role": e.role.value, "page_size": e.page_size, "grow": e.grow.value, "owner": e.owner,
        "head_groups": e.head_groups,
        "entry_bytes": e.entry_bytes, "page_bytes": e.page_bytes,
        "first_page": spec.first_page(e.name), "top_page": spec.top_page(e.name),
        "layers": [{"kind": x.kind.value, "num_kv_heads": x.num_kv_heads, "head_dim_k": x.head_dim_k,
                    "head_dim_v": x.head_dim_v, "latent_dim": x.latent_dim, "window_tokens": x.window_tokens,
                    "dtype": x.dtype.value} for x in e.layers],
    }


def _end_from_dict(d: Mapping[str, Any]) -> EndSpec:
    layers = tuple(LayerSpec(LayerKind(x["kind"]), wire_int(x["num_kv_heads"]), wire_int(x["head_dim_k"]),
                             wire_int(x["head_dim_v"]), wire_int(x["latent_dim"]),
                             None if x["window_tokens"] is None else wire_int(x["window_tokens"]), KVDtype(x["dtype"]))
                   for x in d["layers"])
    return EndSpec(str(d["name"]), layers, wire_int(d["page_size"]), Grow(d["grow"]),
                   None if d["owner"] is None else str(d["owner"]), EndRole(d["role"]), wire_int(d["head_groups"]))


_LAYER_FIELDS = ("kind", "head_dim_k", "head_dim_v", "latent_dim", "window_tokens", "dtype")


def _fmt(v: object) -> str:
    return str(v.value) if isinstance(v, (LayerKind, KVDtype, EndRole)) else repr(v)


def layout_differences(local: PeerLayout, remote: PeerLayout) -> list[str]:
    """Every geometry difference that no plan between ``local`` and ``remote`` can map.

    Mapped (not differences): TP sizes where one divides the other and any TP ranks (heads split by rank, MLA
    replicated: :mod:`umalloc.transfer.heads`), page sizes where one divides the other (ids expand by the
    ratio, F14), head groups (:mod:`umalloc.transfer.slices`), DCP (Note [DCP rows]), and local placement
    choices (arena size, floor, grow direction, owner binding, regions). Compared: the set of ends (by name),
    each end's role, page-size ratio, layer count and per layer kind, head dims, latent dim, window and dtype,
    and the head counts (one model's heads split by rank); a ``state`` end (a snapshot, not token-addressed) needs
    equal page size, head groups and TP size. O(ends * layers).
    """
    diffs: list[str] = []
    tp_why = tp_difference(local.tp_size, remote.tp_size)
    if tp_why:
        diffs.append(tp_why)
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
        if a.role is not b.role:
            diffs.append(f"end {name!r}: role local {_fmt(a.role)} != remote {_fmt(b.role)}")
        if max(a.page_size, b.page_size) % min(a.page_size, b.page_size):
            diffs.append(f"end {name!r}: page_size local {a.page_size}, remote {b.page_size}: neither divides the "
                         "other (ids expand by a whole ratio, F14)")
        elif EndRole.STATE in (a.role, b.role) and (a.page_size, a.head_groups, local.tp_size) != (
                b.page_size, b.head_groups, remote.tp_size):
            diffs.append(f"end {name!r}: a state end needs the same page_size, head_groups and TP on both sides "
                         f"(local {a.page_size}/{a.head_groups}/TP {local.tp_size}, remote "
                         f"{b.page_size}/{b.head_groups}/TP {remote.tp_size})")
        if len(a.layers) != len(b.layers):
            diffs.append(f"end {name!r}: layer count local {len(a.layers)} != remote {len(b.layers)}")
        for i, (la, lb) in enumerate(zip(a.layers, b.layers, strict=False)):
            for attr in _LAYER_FIELDS:
                va, vb = getattr(la, attr), getattr(lb, attr)
                if va != vb:
                    diffs.append(f"end {name!r} layer {i}: {attr} local {_fmt(va)} != remote {_fmt(vb)}")
            if la.kind is lb.kind and not tp_why:
                hm = head_map(la, local.tp_size, lb, remote.tp_size)
                if isinstance(hm, str):
                    diffs.append(f"end {name!r} layer {i}: {hm}")
    return diffs


def check_compatible(local: PeerLayout, remote: PeerLayout) -> None:
    """Refuse an incompatible peer at connect time (F22); see :func:`layout_differences` for what is compared.

    Raises:
        IncompatiblePeerError: with ``differences`` listing every difference, one line each.
        UmallocValueError: ``local`` or ``remote`` not a :class:`PeerLayout`.

    >>> from umalloc.geometry.spec import LayerSpec
    >>> def lay(ps, heads):
    ...     spec = ArenaSpec((EndSpec("full", (LayerSpec.mha(heads, 8),), page_size=ps),), arena_bytes=4096)
    ...     return PeerLayout(spec, (Region(1 << 20, 4096),), 1 << 20)
    >>> check_compatible(lay(2, 1), lay(2, 1)), check_compatible(lay(2, 1), lay(4, 1))
    (None, None)
    >>> try:
    ...     check_compatible(lay(2, 1), lay(3, 2))
    ... except IncompatiblePeerError as e:
    ...     print(len(e.differences), e.differences[0])
    2 end 'full': page_size local 2, remote 3: neither divides the other (ids expand by a whole ratio, F14)
    """
    for nm, lay in (("local", local), ("remote", remote)):
        if not isinstance(lay, PeerLayout):
            raise UmallocValueError(f"check_compatible: {nm}={type(lay).__name__}; allowed a PeerLayout "
                                    "(PeerLayout.from_arena, or PeerLayout.from_dict of a peer's metadata)")
    key = (local.digest, remote.digest)
    diffs = _COMPAT.get(key)
    if diffs is None:
        diffs = layout_differences(local, remote)
        if len(_COMPAT) >= 4096:
            _COMPAT.clear()
        _COMPAT[key] = diffs
    if diffs:
        raise IncompatiblePeerError(list(diffs))


@dataclass(frozen=True, eq=False)
class CheckedLayouts:
    """Two layouts that passed :func:`check_compatible`; made only by :func:`compatible_layouts`.

    A backend keeps one from ``connect`` (``local``: this side, ``remote``: the peer as received) and passes it
    to :func:`~umalloc.transfer.build.build_plan` (``checked=``), so no plan re-checks the pair (F22: geometry is
    checked once, at connect).

    Attributes:
        local, remote: the two layouts (``local`` is the sender's side in ``build_plan``).
    """

    local: PeerLayout
    remote: PeerLayout

    def covers(self, local: PeerLayout, remote: PeerLayout) -> bool:
        """True if ``(local, remote)`` are the checked pair (the same objects, or layouts of the same digests).
        O(1)."""
        return (local is self.local or local.digest == self.local.digest) and \
            (remote is self.remote or remote.digest == self.remote.digest)


def compatible_layouts(local: PeerLayout, remote: PeerLayout) -> CheckedLayouts:
    """:func:`check_compatible` the pair once and return it as a :class:`CheckedLayouts` token.

    Raises:
        UmallocValueError: an argument that is not a :class:`PeerLayout`.
        IncompatiblePeerError: as :func:`check_compatible`; nothing is returned.

    >>> from umalloc.geometry.spec import LayerSpec
    >>> spec = ArenaSpec((EndSpec("full", (LayerSpec.mha(1, 8),), page_size=2),), arena_bytes=640)
    >>> a, b = PeerLayout(spec, (Region(1000, 640),), 1000), PeerLayout(spec, (Region(9000, 640),), 9000)
    >>> compatible_layouts(a, b).covers(a, b), compatible_layouts(a, b).covers(b, a)
    (True, False)
    """
    for what, lay in (("local", local), ("remote", remote)):
        if not isinstance(lay, PeerLayout):
            raise UmallocValueError(f"{what}={type(lay).__name__}: allowed a PeerLayout")
    check_compatible(local, remote)
    return CheckedLayouts(local, remote)


__all__ = ["ADDRESS_LIMIT", "VECTOR_NAME_BY_ROLE", "CheckedLayouts", "EndGeometry", "PeerLayout",
           "check_compatible", "compatible_layouts", "layout_differences", "wire_int"]
