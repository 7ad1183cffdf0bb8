"""Backend metadata and peers: the wire format, its validation, and the layout check made once at connect (F22).

Policy:

* Metadata is JSON bytes (:func:`encode_metadata`): format tag, backend name, peer id, pid, host, the side's
  :class:`~umalloc.transfer.plan.PeerLayout` dict (or ``null``), the engine-registered regions, and engine data.
  It reflects the registrations at the time it is taken: register first, then export.
* :func:`parse_metadata` validates every field (present, typed, regions well formed) before a backend makes any
  engine call: bad metadata raises :class:`~umalloc.errors.UmallocValueError` and changes nothing.
* :func:`check_layouts` runs :func:`~umalloc.transfer.plan.check_compatible` once per connect and returns the
  peer's checked :class:`PeerLayout`, kept in :class:`PeerInfo`. Plans for that peer are matched against it by
  identity (or digest), never checked again. Both sides without a layout is allowed (descriptor-level use);
  exactly one side without a layout is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from umalloc.errors import IncompatiblePeerError, UmallocValueError
from umalloc.geometry.region import Region
from umalloc.transfer import PeerLayout, check_compatible
from umalloc.transfer.descriptors import region_ranges

#: Format tag of backend metadata.
METADATA_FORMAT = "umalloc-backend-md/1"

#: Loopback host every backend binds to by default.
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class PeerInfo:
    """A connected peer as seen from its metadata.

    Attributes:
        name: engine peer name (NIXL agent name, Mooncake ``host:rpc_port``, local peer id).
        peer_id: the peer backend's unique id.
        pid: the peer's process id.
        backend: the peer's backend name.
        regions: the peer's engine-registered regions, sorted by base.
        starts, ends: ``uint64`` arrays of the regions' byte ranges (for vectorised bounds checks).
        layout: the peer's layout dict, or ``None``.
        engine: the engine part of its metadata.
        checked_layout: the peer's :class:`PeerLayout`, checked compatible with this side's at connect
            (``None`` when neither side has one).
        host: the address its engine binds to (its process is on this host when it is loopback).
    """

    name: str
    peer_id: str
    pid: int
    backend: str
    regions: tuple[Region, ...]
    starts: np.ndarray
    ends: np.ndarray
    layout: dict | None
    engine: dict
    checked_layout: PeerLayout | None = None
    host: str = LOOPBACK


def layout_pair(layout: object | None) -> tuple[dict | None, PeerLayout | None]:
    """A side's layout as ``(dict for the metadata, PeerLayout)``, validated once (``set_layout`` / the
    constructor).

    Raises:
        UmallocValueError: not a PeerLayout, a ``PeerLayout.to_dict()`` dict (malformed dicts are refused), or None.

    >>> layout_pair(None)
    (None, None)
    """
    if layout is None:
        return None, None
    if isinstance(layout, PeerLayout):
        return layout.to_dict(), layout
    if isinstance(layout, dict):
        return layout, PeerLayout.from_dict(layout)
    raise UmallocValueError(f"layout={layout!r}: allowed a PeerLayout, its to_dict(), or None")


def encode_metadata(*, backend: str, peer_id: str, pid: int, host: str, layout: dict | None,
                    regions: tuple[Region, ...], engine: dict) -> bytes:
    """Metadata JSON bytes (see the module policy)."""
    d = {
        "format": METADATA_FORMAT,
        "backend": backend,
        "peer_id": peer_id,
        "pid": pid,
        "host": host,
        "layout": layout,
        "regions": [r.to_dict() for r in regions],
        "engine": engine,
    }
    return json.dumps(d, separators=(",", ":")).encode()


def _field(d: dict, key: str, kinds: type | tuple[type, ...], what: str) -> Any:
    v = d.get(key)
    if key not in d or isinstance(v, bool) or not isinstance(v, kinds):
        raise UmallocValueError(f"peer metadata field {key!r}={v!r}: allowed {what}")
    return v


def parse_metadata(peer_metadata: object) -> dict:
    """Decode and validate metadata bytes made by :func:`encode_metadata`; returns the dict with ``regions``
    replaced by a tuple of :class:`Region` sorted by base. O(regions).

    Raises:
        UmallocValueError: not umalloc backend metadata, or a field missing or of the wrong type.

    >>> d = parse_metadata(encode_metadata(backend="local", peer_id="p", pid=1, host=LOOPBACK, layout=None,
    ...                                    regions=(Region(4096, 64),), engine={}))
    >>> d["backend"], d["regions"]
    ('local', (Region(base_ptr=4096, nbytes=64, device='cpu', mem_kind='DRAM'),))
    >>> parse_metadata(b'{"format": "umalloc-backend-md/1", "backend": "local"}')
    Traceback (most recent call last):
    ...
    umalloc.errors.UmallocValueError: peer metadata field 'peer_id'=None: allowed a non-empty str
    """
    if not isinstance(peer_metadata, (bytes, bytearray, memoryview)):
        raise UmallocValueError(f"peer metadata: allowed the bytes of backend.metadata(), got "
                                f"{type(peer_metadata).__name__}")
    try:
        d = json.loads(bytes(peer_metadata).decode())
    except (TypeError, ValueError) as e:
        raise UmallocValueError(f"peer metadata: not umalloc backend metadata ({e})") from e
    if not isinstance(d, dict) or d.get("format") != METADATA_FORMAT:
        raise UmallocValueError(f"peer metadata: allowed format {METADATA_FORMAT!r}")
    _field(d, "backend", str, "a backend name (str)")
    if not _field(d, "peer_id", str, "a non-empty str"):
        raise UmallocValueError("peer metadata field 'peer_id'='': allowed a non-empty str")
    if _field(d, "pid", int, "a process id (int > 0)") <= 0:
        raise UmallocValueError(f"peer metadata field 'pid'={d['pid']!r}: allowed a process id (int > 0)")
    _field(d, "host", str, "a host (str)")
    if d.get("layout") is not None:
        _field(d, "layout", dict, "a PeerLayout dict or null")
    else:
        d["layout"] = None
    _field(d, "engine", dict, "an object")
    raw = _field(d, "regions", list, "a list of region objects")
    regions = []
    for i, x in enumerate(raw):
        if not isinstance(x, dict):
            raise UmallocValueError(f"peer metadata regions[{i}]={x!r}: allowed a region object")
        try:
            regions.append(Region.from_dict(x))
        except (KeyError, TypeError) as e:
            raise UmallocValueError(f"peer metadata regions[{i}]={x!r}: allowed base_ptr, nbytes, device, mem_kind "
                                    f"({type(e).__name__}: {e})") from e
    d["regions"] = tuple(sorted(regions, key=lambda r: (r.base_ptr, r.nbytes)))
    return d


def check_layouts(mine: PeerLayout | None, remote: dict | None) -> PeerLayout | None:
    """The peer's layout, checked compatible with ``mine`` (F22, one :func:`check_compatible` call), or ``None``
    when neither side has one.

    Raises:
        IncompatiblePeerError: exactly one side without a layout, or every geometry difference.
        UmallocValueError: a malformed peer layout dict.
    """
    if mine is None and remote is None:
        return None
    if mine is None or remote is None:
        raise IncompatiblePeerError([f"layout: local {'set' if mine else 'missing'}, "
                                     f"peer {'set' if remote else 'missing'}"])
    theirs = PeerLayout.from_dict(remote)
    check_compatible(mine, theirs)
    return theirs


def peer_info(name: str, d: dict, checked_layout: PeerLayout | None) -> PeerInfo:
    """The :class:`PeerInfo` of a peer from its parsed metadata ``d`` (:func:`parse_metadata`)."""
    starts, ends = region_ranges(d["regions"])
    return PeerInfo(name=name, peer_id=d["peer_id"], pid=d["pid"], backend=d["backend"], regions=d["regions"],
                    starts=starts, ends=ends, layout=d["layout"], engine=d["engine"], checked_layout=checked_layout,
                    host=d["host"])
