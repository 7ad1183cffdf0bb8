"""``local``: in-process copies between registered host regions — the embedded default and the reference.

Policy:

* Both sides live in one process: ``connect`` accepts only metadata of a live ``LocalBackend`` of this process
  (looked up by peer id); a peer in another process is refused (use ``nixl`` or ``mooncake`` there).
* Host memory (``DRAM``) only; a ``VRAM`` region raises :class:`~umalloc.errors.RegistrationError`.
* A submit copies synchronously and the handle is terminal when ``submit`` returns. Before copying it re-checks
  that the peer is still open and still has every destination range registered (a peer closed or deregistered
  after connect fails the handle, nothing copied).
* The batch is copied chunk by chunk, one part per chunk of Note [Bounded batches]
  (:mod:`umalloc.transfer.descriptors`), so ``handle.num_parts`` is the same here as on the engines.
* Copy strategy per group of descriptors sharing ``(nbytes, source region, destination region)``: when the group
  is large and both offsets are multiples of ``nbytes`` the copy is one numpy gather/scatter over
  ``(n, nbytes)`` row views; otherwise one ``ctypes.memmove`` per descriptor (coalesced runs are few and long).
  A batch of fewer than ``GATHER_MIN_ROWS`` descriptors is copied row by row without grouping.
"""

from __future__ import annotations

import ctypes
import os
import weakref

import numpy as np

from umalloc.backends.base import BackendBase
from umalloc.backends.handle import TransferHandle
from umalloc.backends.peers import PeerInfo
from umalloc.errors import BackendError, RegistrationError, TransferError
from umalloc.geometry.region import DRAM, Region
from umalloc.transfer.descriptors import MAX_BATCH_BYTES, MAX_BATCH_DESCRIPTORS, Chunk, locate_ranges

#: Live local backends of this process by peer id.
_BY_PEER_ID: weakref.WeakValueDictionary[str, LocalBackend] = weakref.WeakValueDictionary()

#: Below this many descriptors in a group, copy with memmove per descriptor instead of a row gather.
GATHER_MIN_ROWS = 16


def _host_view(region: Region) -> np.ndarray:
    """A ``uint8`` numpy view of a host region (no copy; the caller keeps the memory alive)."""
    buf = (ctypes.c_uint8 * region.nbytes).from_address(region.base_ptr)
    return np.ctypeslib.as_array(buf)


class LocalBackend(BackendBase):
    """In-process copy backend.

    Args:
        layout: this side's ``PeerLayout`` (see :class:`~umalloc.backends.base.BackendBase`).
        max_batch_descriptors, max_batch_bytes: chunk caps (see :class:`~umalloc.backends.base.BackendBase`).

    >>> import torch
    >>> from umalloc.geometry.region import Region
    >>> src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    >>> a, b = LocalBackend(), LocalBackend()
    >>> a.register([Region(src.data_ptr(), 64)]); b.register([Region(dst.data_ptr(), 64)])
    >>> peer = a.connect(b.metadata())
    >>> h = a.write_descriptors(np.array([[src.data_ptr() + 8, dst.data_ptr(), 4]], np.uint64), peer)
    >>> a.wait(h, timeout_s=1.0); a.forget(h)
    >>> dst[:4].tolist()
    [8, 9, 10, 11]
    >>> a.close(); b.close()
    """

    name = "local"
    fences_peer_writes = True  # a sender's copy re-checks this side's registration and liveness every time

    def __init__(self, *, layout: object | None = None, host: str = "127.0.0.1",
                 max_batch_descriptors: int = MAX_BATCH_DESCRIPTORS, max_batch_bytes: int = MAX_BATCH_BYTES) -> None:
        super().__init__(layout=layout, host=host, max_batch_descriptors=max_batch_descriptors,
                         max_batch_bytes=max_batch_bytes)
        _BY_PEER_ID[self._peer_id] = self

    def _check_region(self, region: Region) -> None:
        if region.mem_kind != DRAM:
            raise RegistrationError(f"local backend copies host memory only: {region} is {region.mem_kind}")

    def _engine_register(self, region: Region) -> object:
        return _host_view(region)

    def _engine_deregister(self, region: Region, token: object) -> None:
        return None

    def _engine_metadata(self) -> dict:
        return {"pid": os.getpid()}

    def _engine_connect(self, md: dict) -> str:
        if md["pid"] != os.getpid():
            raise BackendError(f"local backend: peer lives in process {md['pid']}, this is {os.getpid()}; "
                               "use the nixl or mooncake backend between processes")
        peer_id = md["peer_id"]
        if _BY_PEER_ID.get(peer_id) is None:
            raise BackendError(f"local backend: peer {peer_id} is closed")
        return peer_id

    def _engine_post(self, h: TransferHandle, chunks: list[Chunk], peer: PeerInfo, item_bytes: int | None) -> None:
        other = _BY_PEER_ID.get(peer.name)
        if other is None or other.closed:
            raise TransferError(f"local: peer {peer.name!r} was closed before the transfer")
        # The peer's *current* registration decides, not what its metadata said at connect time; every chunk is
        # checked before the first byte is copied.
        cur = [locate_ranges(d[:, 1], d[:, 2], other._reg.starts, other._reg.ends) for d, _, _ in chunks]
        row = 0  # rows of the batch as posted (descriptors longer than max_batch_bytes count once per piece)
        for (d, _, _), idx in zip(chunks, cur, strict=True):
            if (idx < 0).any():
                row += int(np.flatnonzero(idx < 0)[0])
                raise TransferError(f"local: destination row {row} is no longer registered by peer {peer.name!r}")
            row += d.shape[0]
        for (d, src_idx, _), dst_idx in zip(chunks, cur, strict=True):
            self._copy(d, src_idx, dst_idx, self._reg.regions, other._reg.regions, other)
            h.num_parts += 1
        h.engine["done"] = True

    def _copy(self, d: np.ndarray, src_idx: np.ndarray, dst_idx: np.ndarray, src_regions: tuple[Region, ...],
              dst_regions: tuple[Region, ...], other: LocalBackend) -> None:
        """Copy every row of ``d`` (the module policy's copy strategy). O(N log N) grouping."""
        n = d.shape[0]
        if n < GATHER_MIN_ROWS:  # no group can be gathered: copy row by row
            mm = ctypes.memmove
            for s, t, k in d.tolist():
                mm(t, s, k)
            return
        nb = d[:, 2]
        if (nb == nb[0]).all() and (src_idx == src_idx[0]).all() and (dst_idx == dst_idx[0]).all():
            groups = [np.arange(n)]
        else:  # one int64 key per (nbytes rank, source region, destination region), rows kept in batch order
            _, nb_rank = np.unique(nb, return_inverse=True)
            key = (nb_rank.reshape(-1).astype(np.int64) * len(src_regions) + src_idx) * len(dst_regions) + dst_idx
            order = np.argsort(key, kind="stable")
            groups = np.split(order, np.flatnonzero(np.diff(key[order])) + 1)
        for rows in groups:
            first = int(rows[0])
            nbytes, sreg, dreg = int(nb[first]), src_regions[int(src_idx[first])], dst_regions[int(dst_idx[first])]
            s_off = d[rows, 0] - np.uint64(sreg.base_ptr)
            d_off = d[rows, 1] - np.uint64(dreg.base_ptr)
            if rows.size >= GATHER_MIN_ROWS and not (s_off % np.uint64(nbytes)).any() and not (
                    d_off % np.uint64(nbytes)).any():
                sv = self._reg.engine[sreg]
                dv = other._reg.engine[dreg]
                srows = sv[: (sreg.nbytes // nbytes) * nbytes].reshape(-1, nbytes)
                drows = dv[: (dreg.nbytes // nbytes) * nbytes].reshape(-1, nbytes)
                drows[(d_off // np.uint64(nbytes)).astype(np.int64)] = srows[(s_off // np.uint64(nbytes)).astype(np.int64)]
            else:
                mm = ctypes.memmove
                for s, t in zip(d[rows, 0].tolist(), d[rows, 1].tolist(), strict=True):
                    mm(t, s, nbytes)

    def _engine_poll(self, h: TransferHandle) -> tuple[int, BaseException | None]:
        return 0, None

    def _engine_in_flight(self, h: TransferHandle) -> int:
        """Copies end inside ``submit``: nothing is ever in flight afterwards."""
        return 0

    def _on_reset(self, old_peer_id: str) -> None:
        _BY_PEER_ID.pop(old_peer_id, None)
        _BY_PEER_ID[self._peer_id] = self

    def _engine_close(self) -> None:
        _BY_PEER_ID.pop(self._peer_id, None)
