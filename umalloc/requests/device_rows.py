"""The device copy of a request table's ``req_to_token`` (arenas on CUDA) and its refresh.

* The host master (``int64 (max_requests, max_tokens_per_request)``) is the truth; on a CUDA arena
  :class:`DeviceRows` keeps one device tensor of the same shape that engines read, refreshed by one
  ``index_copy_`` per table call at the flat positions the call changed (no host wait: the copy is enqueued on
  the caller's current stream).
* On a CPU arena there is no copy: :attr:`DeviceRows.table` is the host master itself and every refresh is a
  no-op.
"""

from __future__ import annotations

import numpy as np
import torch


class DeviceRows:
    """``req_to_token`` as engines read it (owner thread).

    Args:
        host: the host master, ``int64 (max_requests, max_tokens_per_request)`` (C-contiguous).
        device: the arena's device.

    Attributes:
        device: the CUDA device, or ``None`` on a CPU arena. table: the tensor engines read (the host master on
        the CPU).
    """

    __slots__ = ("_host", "device", "table")

    def __init__(self, host: np.ndarray, device: torch.device) -> None:
        self._host = host
        self.device: torch.device | None = device if device.type != "cpu" else None
        self.table: torch.Tensor = (torch.from_numpy(host) if self.device is None
                                    else torch.from_numpy(host).to(device))

    def push(self, flat: np.ndarray) -> None:
        """Refresh the device copy at flat positions ``flat`` (``int64``). O(len(flat))."""
        if self.device is None or flat.size == 0:
            return
        idx = torch.from_numpy(np.ascontiguousarray(flat)).to(self.device)
        vals = torch.from_numpy(self._host.reshape(-1)[flat]).to(self.device)
        self.table.view(-1).index_copy_(0, idx, vals)

    def push_ranges(self, slots: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Refresh token positions ``[lo[i], hi[i])`` of row ``slots[i]`` for every ``i``. O(tokens)."""
        if self.device is None:
            return
        row_tokens = self._host.shape[1]
        parts = [s * row_tokens + np.arange(a, b, dtype=np.int64)
                 for s, a, b in zip(slots.tolist(), lo.tolist(), hi.tolist(), strict=True) if b > a]
        if parts:
            self.push(np.concatenate(parts))


__all__ = ["DeviceRows"]
