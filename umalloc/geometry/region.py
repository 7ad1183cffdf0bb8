"""Registered byte ranges and the region groups that index vectors address.

* A :class:`Region` is ``(base_ptr, nbytes, device, mem_kind)``: what a transfer backend registers.
* A :class:`RegionGroup` binds an index vector to regions: each member has its own ``item_bytes`` (bytes per
  index step, an end's ``page_bytes`` for page envelopes). Address of index ``i`` in member ``r``:
  ``r.base_ptr + r.offset_bytes + i * r.item_bytes``.
* :func:`normalize_regions` is the one registration normaliser (F21): identical regions fold into one
  (refcounted), overlapping or touching regions of the same device and memory kind merge, regions of different
  device or kind never fold together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from umalloc.errors import UmallocValueError

DRAM = "DRAM"
VRAM = "VRAM"
_ADDR_LIMIT = 1 << 64


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, order=True)
class Region:
    """A registered byte range.

    Attributes:
        base_ptr: first byte's address (int, host or device pointer).
        nbytes: length in bytes (> 0).
        device: ``"cpu"`` or ``"cuda:N"``.
        mem_kind: ``"DRAM"`` or ``"VRAM"``.

    >>> Region(1000, 24).end_ptr
    1024
    """

    base_ptr: int
    nbytes: int
    device: str = "cpu"
    mem_kind: str = DRAM

    def __post_init__(self) -> None:
        if not _is_int(self.base_ptr) or self.base_ptr < 0:
            raise UmallocValueError(f"Region.base_ptr={self.base_ptr!r}: allowed a non-negative int")
        if not _is_int(self.nbytes) or self.nbytes <= 0:
            raise UmallocValueError(f"Region.nbytes={self.nbytes!r}: allowed a positive int")
        if self.base_ptr + self.nbytes > _ADDR_LIMIT:
            raise UmallocValueError(f"Region [{self.base_ptr}, +{self.nbytes}) ends past the 64-bit address space: "
                                    "allowed to end at or below 2**64")
        if self.mem_kind not in (DRAM, VRAM):
            raise UmallocValueError(f"Region.mem_kind={self.mem_kind!r}: allowed {DRAM!r} or {VRAM!r}")

    @property
    def end_ptr(self) -> int:
        """One past the last byte."""
        return self.base_ptr + self.nbytes

    def contains(self, addr: int, nbytes: int) -> bool:
        """True if ``[addr, addr + nbytes)`` lies inside this region."""
        return self.base_ptr <= addr and addr + nbytes <= self.end_ptr

    def to_dict(self) -> dict:
        return {"base_ptr": self.base_ptr, "nbytes": self.nbytes, "device": self.device,
                "mem_kind": self.mem_kind}

    @classmethod
    def from_dict(cls, d: dict) -> Region:
        """Inverse of :meth:`to_dict`; a peer's non-int address or length is refused, never truncated."""
        return cls(d["base_ptr"], d["nbytes"], str(d["device"]), str(d["mem_kind"]))


@dataclass(frozen=True)
class RegionMember:
    """One region of a group with the item size an index step spans in it.

    Attributes:
        region: the registered :class:`Region`.
        item_bytes: bytes per index step (> 0).
        offset_bytes: byte offset of index 0 from ``region.base_ptr`` (default 0).
    """

    region: Region
    item_bytes: int
    offset_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.item_bytes, int) or self.item_bytes <= 0:
            raise UmallocValueError(f"RegionMember.item_bytes={self.item_bytes!r}: allowed a positive int")
        if not isinstance(self.offset_bytes, int) or self.offset_bytes < 0:
            raise UmallocValueError(f"RegionMember.offset_bytes={self.offset_bytes!r}: allowed >= 0")

    @property
    def base_addr(self) -> int:
        """Address of index 0."""
        return self.region.base_ptr + self.offset_bytes

    def address(self, index: int) -> int:
        """``base_addr + index * item_bytes``."""
        return self.base_addr + index * self.item_bytes


@dataclass(frozen=True)
class RegionGroup:
    """The regions one index vector addresses, in a fixed order (paired by position with the peer's group)."""

    members: tuple[RegionMember, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        if not self.members:
            raise UmallocValueError("RegionGroup.members: allowed at least one RegionMember")

    def bases_and_items(self) -> list[tuple[int, int]]:
        """``[(base_addr, item_bytes), ...]``, the form translators take."""
        return [(m.base_addr, m.item_bytes) for m in self.members]


@dataclass
class RegisteredRegion:
    """A normalised region with the number of registrations folded into it."""

    region: Region
    refcount: int


def normalize_regions(regions: Iterable[Region]) -> list[RegisteredRegion]:
    """Fold a batch of regions for registration (F21).

    Identical regions fold into one with a refcount; overlapping or adjacent regions of the same ``device``
    and ``mem_kind`` merge into their union; regions of different device or kind stay apart even if their
    address ranges overlap. Output is sorted by ``(device, mem_kind, base_ptr)``. O(n log n).

    >>> r = normalize_regions([Region(0, 16), Region(0, 16), Region(8, 16), Region(100, 4)])
    >>> [(x.region.base_ptr, x.region.nbytes, x.refcount) for x in r]
    [(0, 24, 3), (100, 4, 1)]
    """
    items = sorted(regions, key=lambda r: (r.device, r.mem_kind, r.base_ptr, r.nbytes))
    out: list[RegisteredRegion] = []
    for r in items:
        if out:
            last = out[-1]
            lr = last.region
            if lr.device == r.device and lr.mem_kind == r.mem_kind and r.base_ptr <= lr.end_ptr:
                end = max(lr.end_ptr, r.end_ptr)
                last.region = Region(lr.base_ptr, end - lr.base_ptr, lr.device, lr.mem_kind)
                last.refcount += 1
                continue
        out.append(RegisteredRegion(r, 1))
    return out


def find_region(regions: Sequence[Region], addr: int, nbytes: int) -> Region | None:
    """The first region containing ``[addr, addr + nbytes)``, or ``None``. O(len(regions))."""
    for r in regions:
        if r.contains(addr, nbytes):
            return r
    return None
