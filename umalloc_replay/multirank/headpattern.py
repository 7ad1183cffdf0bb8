"""The multi-rank replay's KV pattern: every element a hash of its global coordinates.

Policy:

* An element's value depends only on what it *is* — seed, request, end, layer, K or V, the **global** KV head,
  the **logical** token position and the element's index inside the head (Note [Head pattern]) — never on where
  a rank keeps it (TP rank, DCP row, page size, page, head group, layout). So each rank computes the bytes of
  its own heads and rows directly, whatever the other side's geometry, and a receiver's expected bytes are
  computed independently of the plan code that moved them.
* The global heads a rank holds come from the model's total head count and the rank's TP (vLLM's split and
  replication, :func:`global_heads`); the per-rank spec must agree (``LayerSpec.num_kv_heads == hi - lo``), else
  :class:`~umalloc.errors.InvariantError`. An MLA latent is one replicated "head" 0.
* Rows are reached through :meth:`umalloc.geometry.arena.Arena.kv_group_views` (both page layouts): physical
  token ``t`` of an end with page size ``ps`` is view row ``[t // ps, :, t % ps]``, heads in group order.
* Values are written and compared as same-width unsigned integers (a float view could hold NaNs that never
  compare equal). The hash loop is compiled (numba, no pointers): one pass per layer block.

Note [Head pattern]
~~~~~~~~~~~~~~~~~~~
::

    element e of global head h at logical position x, in layer l's K (kv = 0; the MLA latent too) or V (kv = 1)
    block of end E, request r:
        key   = splitmix64 chain over (seed, r, crc32(E), l, kv)
        value = fmix64(key + x * P_POS + h * P_HEAD + e * P_ELEM), its low 8 * itemsize bits

``P_*`` are odd 64-bit constants; ``fmix64`` is MurmurHash3's finaliser. Swapped heads, positions, layers, K/V,
requests or stale bytes all differ.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit, uint64

from umalloc import Arena, ArenaSpec, InvariantError, UmallocValueError
from umalloc.geometry.presets import rank_kv_heads
from umalloc.geometry.spec import LayerKind
from umalloc_replay import seed64

_M64 = (1 << 64) - 1
_P_POS = 0x9E3779B97F4A7C15
_P_HEAD = 0xC2B2AE3D27D4EB4F
_P_ELEM = 0x165667B19E3779F9
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def global_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global KV heads ``[lo, hi)`` TP rank ``tp_rank`` of ``tp_size`` holds of a layer with ``total_kv_heads``
    (vLLM: ``total // tp_size`` consecutive heads per rank; when ``tp_size > total`` rank ``t`` holds head
    ``t // (tp_size // total)``, replicated). O(1).

    Raises:
        UmallocValueError: ``tp_rank`` outside ``[0, tp_size)``. SpecError: heads that do not split.

    >>> global_heads(8, 2, 1), global_heads(1, 2, 1), global_heads(2, 4, 3), global_heads(8, 1, 0)
    ((4, 8), (0, 1), (1, 2), (0, 8))
    """
    per_rank = rank_kv_heads(total_kv_heads, tp_size)
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise UmallocValueError(f"tp_rank={tp_rank!r}: allowed an int in [0, {tp_size - 1}]")
    if tp_size > total_kv_heads:
        lo = tp_rank // (tp_size // total_kv_heads)
        return lo, lo + 1
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def block_key(seed: int, request_id: int, end: str, layer: int, kv: int) -> int:
    """The 64-bit key of one layer block of one request (Note [Head pattern]). O(1).

    >>> block_key(0, 1, "full", 0, 0) != block_key(0, 1, "full", 0, 1)
    True
    """
    x = 0
    for part in (seed64(seed), request_id, zlib.crc32(end.encode()), layer, kv):
        x = _splitmix((x ^ (int(part) & _M64)) & _M64)
    return x


@njit(cache=True, nogil=True)
def _block_values(key, positions, head_lo, out):  # pragma: no cover - compiled
    """``out[i, h, e] = fmix64(key + positions[i] * P_POS + (head_lo + h) * P_HEAD + e * P_ELEM)``, truncated
    to ``out``'s unsigned width. ``out``: C-contiguous ``(n, heads, dim)``. O(n * heads * dim)."""
    n, heads, dim = out.shape
    p_pos, p_head, p_elem = uint64(_P_POS), uint64(_P_HEAD), uint64(_P_ELEM)
    c1, c2, s = uint64(0xFF51AFD7ED558CCD), uint64(0xC4CEB9FE1A85EC53), uint64(33)
    k = uint64(key)
    for i in range(n):
        base_i = k + uint64(positions[i]) * p_pos
        for h in range(heads):
            base = base_i + uint64(head_lo + h) * p_head
            for e in range(dim):
                x = base + uint64(e) * p_elem
                x ^= x >> s
                x *= c1
                x ^= x >> s
                x *= c2
                x ^= x >> s
                out[i, h, e] = x


def expected_block(key: int, positions: np.ndarray, head_lo: int, num_heads: int, dim: int,
                   itemsize: int) -> np.ndarray:
    """The pattern of one layer block (Note [Head pattern]) for ``positions`` (int64 ``(n,)``) and global heads
    ``[head_lo, head_lo + num_heads)``: unsigned ``(n, num_heads, dim)`` of ``itemsize`` bytes. O(n * heads * dim).

    >>> a = expected_block(7, np.array([3, 4]), 2, 2, 5, 2)
    >>> a.shape, a.dtype.name, bool((a[1:, :1] == expected_block(7, np.array([4]), 2, 1, 5, 2)).all())
    ((2, 2, 5), 'uint16', True)
    """
    out = np.empty((positions.shape[0], num_heads, dim), dtype=_UINT[itemsize])
    _block_values(np.uint64(key), np.ascontiguousarray(positions, dtype=np.int64), np.int64(head_lo), out)
    return out


@dataclass
class RowCheck:
    """What one verify found: ``checked_bytes`` compared, ``mismatched_bytes`` that differ, ``mismatched_rows``
    (token rows with at least one differing byte, counted per end and layer block)."""

    checked_bytes: int = 0
    mismatched_bytes: int = 0
    mismatched_rows: int = 0


class HeadPattern:
    """The pattern as one rank holds it: its arena spec, its TP rank and every layer's global head count.

    Args:
        spec: the rank's (per-rank) arena spec.
        total_kv_heads: ``{end: (heads of layer 0, heads of layer 1, ...)}``, the model's global KV heads (MLA: 1).
        tp_rank, tp_size: the rank's tensor parallelism.
        seed: the pattern seed.

    Raises:
        InvariantError: a layer whose per-rank head count is not what the rank's TP gives.

    Threading: one thread; the arena is the caller's.
    """

    def __init__(self, spec: ArenaSpec, total_kv_heads: dict[str, tuple[int, ...]], tp_rank: int, tp_size: int,
                 seed: int) -> None:
        self.spec = spec
        self.seed = int(seed)
        #: ``{end: [(head_lo, heads), ...]}`` per layer.
        self.heads: dict[str, list[tuple[int, int]]] = {}
        for e in spec.ends:
            totals = total_kv_heads[e.name]
            if len(totals) != len(e.layers):
                raise InvariantError(f"end {e.name!r}: {len(e.layers)} layers but {len(totals)} global head counts")
            per_layer = []
            for i, (layer, total) in enumerate(zip(e.layers, totals, strict=True)):
                lo, hi = (0, 1) if layer.kind is LayerKind.MLA else global_heads(total, tp_size, tp_rank)
                if hi - lo != layer.num_kv_heads:
                    raise InvariantError(f"end {e.name!r} layer {i}: the rank holds {layer.num_kv_heads} KV heads, "
                                         f"TP rank {tp_rank}/{tp_size} of {total} gives heads [{lo}, {hi})")
                per_layer.append((lo, hi - lo))
            self.heads[e.name] = per_layer

    def _blocks(self, arena: Arena, end: str, request_id: int, positions: np.ndarray, ptoks: torch.Tensor):
        """Per layer block: ``(int view of the rows, expected values)``; views ``(n, groups, heads_per_group,
        dim)``, expected ``(n, heads, dim)``."""
        e = self.spec.end(end)
        ps = e.page_size
        pages, offs = torch.div(ptoks, ps, rounding_mode="floor"), ptoks % ps
        for li, layer in enumerate(e.layers):
            head_lo, heads = self.heads[end][li]
            item = layer.dtype.itemsize
            k, v = arena.kv_group_views(end, li)
            blocks = [(k, layer.latent_dim)] if v is None else [(k, layer.head_dim_k), (v, layer.head_dim_v)]
            for kv, (view, dim) in enumerate(blocks):
                exp = expected_block(block_key(self.seed, request_id, end, li, kv), positions, head_lo, heads, dim,
                                     item)
                yield view.view(_TORCH_INT[item]), pages, offs, exp

    def fill(self, arena: Arena, end: str, request_id: int, positions: np.ndarray, ptoks: torch.Tensor) -> int:
        """Write the pattern of logical ``positions`` (int64 ``(n,)``) into physical tokens ``ptoks`` (int64
        ``(n,)``, ``page * page_size + offset``) of ``end``, every layer, K and V, every head the rank holds.
        Returns bytes written (``n * entry_bytes``). O(n * entry_bytes)."""
        self._check(end, positions, ptoks)
        n = int(positions.shape[0])
        for view, pages, offs, exp in self._blocks(arena, end, request_id, positions, ptoks):
            groups, hpg, dim = view.shape[1], view.shape[3], view.shape[4]
            src = torch.from_numpy(exp.view(_NP_INT[exp.itemsize])).reshape(n, groups, hpg, dim)
            view[pages, :, offs] = src
        return n * self.spec.end(end).entry_bytes

    def verify(self, arena: Arena, end: str, request_id: int, positions: np.ndarray, ptoks: torch.Tensor
               ) -> RowCheck:
        """Compare physical tokens ``ptoks`` of ``end`` with the pattern of ``positions`` (as :meth:`fill`);
        returns the :class:`RowCheck`. O(n * entry_bytes)."""
        self._check(end, positions, ptoks)
        n = int(positions.shape[0])
        res = RowCheck(checked_bytes=n * self.spec.end(end).entry_bytes)
        for view, pages, offs, exp in self._blocks(arena, end, request_id, positions, ptoks):
            got = view[pages, :, offs].reshape(n, -1).numpy().view(exp.dtype)
            bad = got != exp.reshape(n, -1)
            if bad.any():
                g8 = got.view(np.uint8).reshape(n, -1)
                e8 = exp.reshape(n, -1).view(np.uint8)
                res.mismatched_bytes += int((g8 != e8).sum())
                res.mismatched_rows += int(bad.any(axis=1).sum())
        return res

    def _check(self, end: str, positions: np.ndarray, ptoks: torch.Tensor) -> None:
        if not (isinstance(positions, np.ndarray) and positions.dtype == np.int64 and positions.ndim == 1):
            raise UmallocValueError("positions: allowed a 1-D int64 numpy array")
        if not (isinstance(ptoks, torch.Tensor) and ptoks.dtype == torch.int64 and ptoks.shape == positions.shape):
            raise UmallocValueError(f"ptoks: allowed an int64 tensor of shape {positions.shape}")
        self.spec.end(end)


__all__ = ["HeadPattern", "RowCheck", "block_key", "expected_block", "global_heads"]
