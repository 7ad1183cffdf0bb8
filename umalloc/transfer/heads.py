"""Tensor-parallel head arithmetic: which KV heads a rank holds, and which source rank sends each to a receiver.

Policy:

* Pure functions of per-rank head counts and TP sizes; no state, O(1) each.
* A layer spec states the heads *one rank* holds (``num_kv_heads``); a side of TP size ``t`` holding ``h`` heads
  per rank spans ``h * t`` head slots. Two sides describe one model when the smaller span is the model's heads
  and the larger side replicates them (vLLM's rule when ``tp_size > total_kv_heads``: every rank holds
  ``max(1, total // tp_size)`` heads, so a replicated side holds one head per rank and ``rep = span / total``
  consecutive ranks hold the same head). Anything else is a difference listed at connect (F22).
* MLA keeps one latent row per token on every rank (replicated), like a DCP-unsharded vector: each receiver
  rank reads it from one source rank (Note [TP heads]).

Note [TP heads]
~~~~~~~~~~~~~~~
Prefill TP ``p`` (source rank ``q``), decode TP ``d`` (destination rank ``r``), one dividing the other. With
``H`` heads and no replication, rank ``q`` holds heads ``[q * H / p, (q + 1) * H / p)``:

* P2 -> D4: rank ``r`` needs heads ``[r * H / 4, ...)``, a slice of source rank ``r // 2``'s heads;
* P4 -> D2: rank ``r`` needs the heads of source ranks ``2 r`` and ``2 r + 1``, each into a slice of its own.

A head held by several ranks of a replicating side is sent by one of them: source rank
``head * rep + r % rep`` (spreading the receivers over the replicas). An MLA latent goes to rank ``r`` from
source rank ``r % p``.
"""

from __future__ import annotations

from typing import NamedTuple

from umalloc.errors import UmallocValueError
from umalloc.geometry.spec import LayerKind, LayerSpec


def _check_ints(lo: int = 1, **values: object) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise UmallocValueError(f"{name}={v!r}: allowed an int >= {lo}")


class HeadMap(NamedTuple):
    """How one layer's heads lie on two sides (:func:`head_map`).

    Attributes:
        total: head slots the model has (the smaller side's span).
        src_heads, dst_heads: heads per rank on each side.
        src_rep, dst_rep: ranks per head on each side (``1``: no replication; at most one side is ``> 1``).
    """

    total: int
    src_heads: int
    dst_heads: int
    src_rep: int
    dst_rep: int


def tp_difference(src_tp: int, dst_tp: int) -> str | None:
    """Why two TP sizes cannot be mapped (neither divides the other), or ``None``. O(1).

    >>> tp_difference(2, 4) is None, tp_difference(2, 3)[:43]
    (True, 'tp_size: local 2, remote 3: neither divides')

    Raises:
        UmallocValueError: a size that is not an int >= 1.
    """
    _check_ints(src_tp=src_tp, dst_tp=dst_tp)
    if max(src_tp, dst_tp) % min(src_tp, dst_tp):
        return (f"tp_size: local {src_tp}, remote {dst_tp}: neither divides the other (a rank of one side must "
                "hold whole slices of the other's heads)")
    return None


def head_map(src: LayerSpec, src_tp: int, dst: LayerSpec, dst_tp: int) -> HeadMap | str:
    """The :class:`HeadMap` of one layer held by two sides, or a string saying why they are not one model's layer.

    MLA: the latent is replicated on every rank (``total = 1``). MHA: ``total = min(spans)``; each span must be a
    multiple of it and a replicating side must hold one head per rank. O(1).

    >>> head_map(LayerSpec.mha(4, 8), 2, LayerSpec.mha(2, 8), 4)
    HeadMap(total=8, src_heads=4, dst_heads=2, src_rep=1, dst_rep=1)
    >>> head_map(LayerSpec.mha(1, 8), 1, LayerSpec.mha(1, 8), 2)
    HeadMap(total=1, src_heads=1, dst_heads=1, src_rep=1, dst_rep=2)
    >>> head_map(LayerSpec.mha(4, 8), 1, LayerSpec.mha(4, 8), 2)
    'num_kv_heads: local 4 x TP 1, remote 4 x TP 2: a replicated side must hold one head per rank'

    Raises:
        UmallocValueError: a TP size that is not an int >= 1.
    """
    _check_ints(src_tp=src_tp, dst_tp=dst_tp)
    if src.kind is LayerKind.MLA or dst.kind is LayerKind.MLA:
        return HeadMap(1, 1, 1, src_tp, dst_tp)
    if src_tp == dst_tp and src.num_kv_heads != dst.num_kv_heads:
        return f"num_kv_heads local {src.num_kv_heads} != remote {dst.num_kv_heads}"
    s_span, d_span = src.num_kv_heads * src_tp, dst.num_kv_heads * dst_tp
    total = min(s_span, d_span)
    why = (f"num_kv_heads: local {src.num_kv_heads} x TP {src_tp}, remote {dst.num_kv_heads} x TP {dst_tp}: ")
    if s_span % total or d_span % total:
        return why + "the head spans are not multiples of one head count"
    s_rep, d_rep = s_span // total, d_span // total
    if (s_rep > 1 and src.num_kv_heads != 1) or (d_rep > 1 and dst.num_kv_heads != 1):
        return why + "a replicated side must hold one head per rank"
    return HeadMap(total, src.num_kv_heads, dst.num_kv_heads, s_rep, d_rep)


def held_heads(tp_rank: int, heads_per_rank: int, rep: int = 1) -> tuple[int, int]:
    """Head slots ``[lo, hi)`` rank ``tp_rank`` holds (``rep`` consecutive ranks hold the same heads). O(1).

    >>> held_heads(3, 2), held_heads(3, 1, rep=2)
    ((6, 8), (1, 2))

    Raises:
        UmallocValueError: a negative rank, or a head count or ``rep`` that is not an int >= 1.
    """
    _check_ints(heads_per_rank=heads_per_rank, rep=rep)
    _check_ints(0, tp_rank=tp_rank)
    lo = (tp_rank // rep) * heads_per_rank
    return lo, lo + heads_per_rank


def global_heads(tp_rank: int, tp_size: int, heads_per_rank: int, total_heads: int) -> tuple[int, int]:
    """The model's KV heads ``[lo, hi)`` that rank ``tp_rank`` of ``tp_size`` holds, ``heads_per_rank`` each, of
    ``total_heads`` (vLLM's layout: replicated when ``tp_size > total_heads``). For fill and verify patterns.

    Raises:
        UmallocValueError: a rank out of range, or counts that are not one model's heads split by rank.

    >>> global_heads(1, 4, 2, 8), global_heads(3, 4, 1, 2)
    ((2, 4), (1, 2))
    """
    _check_ints(tp_size=tp_size, heads_per_rank=heads_per_rank, total_heads=total_heads)
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise UmallocValueError(f"tp_rank={tp_rank!r}: allowed [0, {tp_size - 1}]")
    span = heads_per_rank * tp_size
    if span % total_heads or (span > total_heads and heads_per_rank != 1):
        raise UmallocValueError(f"{heads_per_rank} heads per rank x TP {tp_size} do not split {total_heads} heads "
                                "(allowed total // tp heads per rank, or 1 replicated head per rank)")
    return held_heads(tp_rank, heads_per_rank, span // total_heads)


def sent_heads(hm: HeadMap, src_rank: int, dst_rank: int) -> tuple[int, int]:
    """Head slots ``[lo, hi)`` source rank ``src_rank`` sends to destination rank ``dst_rank`` (empty: ``lo ==
    hi``); a replicated head is sent by one replica only (Note [TP heads]). O(1).

    >>> hm = HeadMap(8, 4, 2, 1, 1)                      # P2 -> D4, 8 heads
    >>> sent_heads(hm, 1, 2), sent_heads(hm, 0, 2)
    ((4, 6), (4, 4))
    """
    s_lo, s_hi = held_heads(src_rank, hm.src_heads, hm.src_rep)
    d_lo, d_hi = held_heads(dst_rank, hm.dst_heads, hm.dst_rep)
    lo, hi = max(s_lo, d_lo), min(s_hi, d_hi)
    if hi <= lo or (hm.src_rep > 1 and src_rank % hm.src_rep != dst_rank % hm.src_rep):
        return lo, lo
    return lo, hi


__all__ = ["HeadMap", "global_heads", "head_map", "held_heads", "sent_heads", "tp_difference"]
