"""Frozen geometry specs: layers, ends (sub-pools) and the arena as a whole.

Policy:

* Specs are immutable values (frozen dataclasses), validated on construction; every invalid field raises
  :class:`~umalloc.errors.SpecError` naming the field, the value and the allowed range.
* Bytes follow the standard KV arithmetic (vLLM ``AttentionSpec.real_page_size_bytes``):
  an MHA layer stores ``num_kv_heads * (head_dim_k + head_dim_v) * dtype_bytes``
  per token; an MLA layer stores one latent row of ``kv_lora_rank + qk_rope_head_dim`` elements (vLLM
  ``MLAAttentionSpec``: no separate V).
* ``entry_bytes`` of an end is the bytes one token occupies across every layer that end holds;
  ``page_bytes = page_size * entry_bytes``.
* Inside a page the layout is page-major (Note [Page-major envelope]): layer 0 K rows, layer 0 V rows,
  layer 1 K rows, ... so one physical page is one contiguous envelope holding every layer. An end may opt into
  the head-group-outer envelope (``head_groups > 1``, Note [Head-group-outer envelope]); ``head_groups == 1``
  is exactly the page-major one.

Note [Page-major envelope]
~~~~~~~~~~~~~~~~~~~~~~~~~~
::

    one page of an end with 2 MHA layers, page_size = 2 tokens
    +---------------+---------------+---------------+---------------+
    | L0 K (t0, t1) | L0 V (t0, t1) | L1 K (t0, t1) | L1 V (t0, t1) |
    +---------------+---------------+---------------+---------------+
    ^ page * page_bytes                                (page + 1) * page_bytes ^

Each K (or V) block is ``page_size * num_kv_heads * head_dim * dtype_bytes`` bytes, token-major inside.

Note [Head-group-outer envelope]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``head_groups = G`` a page is laid out ``[head_group][layer][K|V][page_size][heads_per_group][dim]``: the
partition axis outermost, as SGLang's host-layout proposal (sgl-project/sglang#39727) argues for PD transfers
between different TP sizes. Group ``g`` holds heads ``[g * H / G, (g + 1) * H / G)`` of every layer and is one
contiguous chunk of ``page_bytes / G`` bytes, so the slice of heads a rank of another TP size needs is one byte
run per (page, head group) instead of one per (token, layer, K|V). ``G = 1`` is the page-major envelope::

    one page, 1 MHA layer of 4 heads, head_groups = 2, page_size = 2
    +-------------------------------+-------------------------------+
    | g0: L0 K (t0,t1; h0,h1) L0 V  | g1: L0 K (t0,t1; h2,h3) L0 V  |
    +-------------------------------+-------------------------------+

An end with an MLA layer (one latent, replicated across TP ranks) keeps ``G = 1``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from umalloc.errors import SpecError, UmallocValueError

#: Byte alignment of the arena size and of every layer block inside a page.
ARENA_ALIGN_BYTES = 16


class KVDtype(str, enum.Enum):
    """KV-cache element dtypes."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP8_E4M3 = "fp8_e4m3"
    FP32 = "fp32"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _DTYPE_BYTES[self]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The matching torch dtype."""
        return _DTYPE_TORCH[self]


_DTYPE_BYTES = {KVDtype.BF16: 2, KVDtype.FP16: 2, KVDtype.FP8_E4M3: 1, KVDtype.FP32: 4}
_DTYPE_TORCH = {
    KVDtype.BF16: torch.bfloat16,
    KVDtype.FP16: torch.float16,
    KVDtype.FP8_E4M3: torch.float8_e4m3fn,
    KVDtype.FP32: torch.float32,
}


class LayerKind(str, enum.Enum):
    """Attention layer kinds. Sliding-window attention is an MHA layer with ``window_tokens`` set."""

    MHA = "mha"
    MLA = "mla"


class Grow(str, enum.Enum):
    """Grow direction of an end's band: ``up`` from the reserved floor, ``down`` from the top, or a
    ``float``ing middle band between them."""

    UP = "up"
    DOWN = "down"
    FLOAT = "float"


class EndRole(str, enum.Enum):
    """What an end holds; transfer plans name their index vectors after it."""

    TARGET = "target"  # the served model's full-attention (or MLA) layers
    SWA = "swa"  # the served model's sliding-window layers (only the window tail is live)
    DRAFT = "draft"  # the speculative drafter's layers
    STATE = "state"  # per-request state slots (one page per request)


def _check_int(field_name: str, value: object, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(field_name, value, f"an int in [{lo}, {'inf' if hi is None else hi}]")
    if value < lo or (hi is not None and value > hi):
        raise SpecError(field_name, value, f"[{lo}, {'inf' if hi is None else hi}]")
    return value


@dataclass(frozen=True)
class LayerSpec:
    """Geometry of one attention layer's KV cache.

    Attributes:
        kind: :class:`LayerKind`.
        num_kv_heads: KV heads stored (MHA); 1 for MLA.
        head_dim_k: K head dim (MHA) in elements.
        head_dim_v: V head dim (MHA) in elements; 0 for MLA.
        latent_dim: MLA latent width ``kv_lora_rank + qk_rope_head_dim`` in elements; 0 for MHA.
        window_tokens: sliding window in tokens, or ``None`` for full attention.
        dtype: :class:`KVDtype` of the cache.

    Raises:
        SpecError: on any invalid field (field name, value and allowed range in the message).

    >>> LayerSpec.mha(8, 128).token_bytes     # Llama-3.1-8B layer: 8 heads x (128 + 128) x 2 B
    4096
    >>> LayerSpec.mla(512, 64).token_bytes    # DeepSeek-V3 layer: (512 + 64) x 2 B
    1152
    """

    kind: LayerKind
    num_kv_heads: int = 1
    head_dim_k: int = 0
    head_dim_v: int = 0
    latent_dim: int = 0
    window_tokens: int | None = None
    dtype: KVDtype = KVDtype.BF16

    def __post_init__(self) -> None:
        if not isinstance(self.kind, LayerKind):
            raise SpecError("kind", self.kind, f"one of {[k.value for k in LayerKind]}")
        if not isinstance(self.dtype, KVDtype):
            raise SpecError("dtype", self.dtype, f"one of {[d.value for d in KVDtype]}")
        if self.kind is LayerKind.MHA:
            _check_int("num_kv_heads", self.num_kv_heads, 1, 1 << 12)
            _check_int("head_dim_k", self.head_dim_k, 1, 1 << 14)
            _check_int("head_dim_v", self.head_dim_v, 1, 1 << 14)
            if self.latent_dim != 0:
                raise SpecError("latent_dim", self.latent_dim, "0 for an MHA layer")
        else:
            _check_int("latent_dim", self.latent_dim, 1, 1 << 14)
            if self.num_kv_heads != 1:
                raise SpecError("num_kv_heads", self.num_kv_heads, "1 for an MLA layer (one shared latent)")
            if self.head_dim_k != 0 or self.head_dim_v != 0:
                raise SpecError("head_dim_k/head_dim_v", (self.head_dim_k, self.head_dim_v),
                                "0 for an MLA layer (no separate K/V heads)")
            if self.window_tokens is not None:
                raise SpecError("window_tokens", self.window_tokens, "None for an MLA layer")
        if self.window_tokens is not None:
            _check_int("window_tokens", self.window_tokens, 1)

    @classmethod
    def mha(cls, num_kv_heads: int, head_dim: int, head_dim_v: int | None = None, *,
            dtype: KVDtype = KVDtype.BF16, window_tokens: int | None = None) -> LayerSpec:
        """An MHA/GQA layer (sliding if ``window_tokens`` is given)."""
        return cls(LayerKind.MHA, num_kv_heads, head_dim, head_dim if head_dim_v is None else head_dim_v,
                   0, window_tokens, dtype)

    @classmethod
    def mla(cls, kv_lora_rank: int, rope_dim: int, *, dtype: KVDtype = KVDtype.BF16) -> LayerSpec:
        """An MLA layer storing one latent row of ``kv_lora_rank + rope_dim`` elements per token."""
        return cls(LayerKind.MLA, 1, 0, 0, kv_lora_rank + rope_dim, None, dtype)

    @property
    def is_sliding(self) -> bool:
        return self.window_tokens is not None

    @property
    def k_token_bytes(self) -> int:
        """Bytes of the K row (MHA) or the latent row (MLA) of one token."""
        if self.kind is LayerKind.MLA:
            return self.latent_dim * self.dtype.itemsize
        return self.num_kv_heads * self.head_dim_k * self.dtype.itemsize

    @property
    def v_token_bytes(self) -> int:
        """Bytes of the V row of one token; 0 for MLA."""
        if self.kind is LayerKind.MLA:
            return 0
        return self.num_kv_heads * self.head_dim_v * self.dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies in this layer (K + V, or the latent row)."""
        return self.k_token_bytes + self.v_token_bytes


class PageBlock(NamedTuple):
    """One K / V / latent block of a page (:attr:`EndSpec.blocks`).

    Attributes:
        group: head group index; layer: layer index; kv: ``"k"`` (K or the MLA latent) or ``"v"``.
        offset_bytes: byte offset of the block's first row in the page.
        row_bytes: bytes of one token row of the block (``heads * head_dim * dtype_bytes``).
        head_lo, heads: the block's first head (rank-local) and its head count (``1`` for MLA).
    """

    group: int
    layer: int
    kv: str
    offset_bytes: int
    row_bytes: int
    head_lo: int
    heads: int


@dataclass(frozen=True)
class EndSpec:
    """One end (sub-pool) of the arena.

    Attributes:
        name: unique name (``"full"``, ``"swa"``, ``"draft"``...).
        layers: the layers whose KV this end holds, in envelope order.
        page_size: tokens per page.
        grow: :class:`Grow` direction of the band.
        owner: ``None`` if this end is an id owner (mints virtual pages), else the name of the id-owner end
            whose virtual pages it binds its own physical pages to (SWA, or a draft sharing positions).
        role: :class:`EndRole`.
        head_groups: ``1`` (default) for the page-major envelope, ``G > 1`` for the head-group-outer one (Note
            [Head-group-outer envelope]); every MHA layer's ``num_kv_heads`` must divide by it and no layer may be
            MLA.

    >>> e = EndSpec("full", (LayerSpec.mha(8, 128),) * 2, page_size=16)
    >>> e.entry_bytes, e.page_bytes
    (8192, 131072)
    >>> [(b.group, b.layer, b.kv, b.offset_bytes, b.row_bytes) for b in
    ...  EndSpec("g", (LayerSpec.mha(4, 8),), page_size=2, head_groups=2).blocks]
    [(0, 0, 'k', 0, 32), (0, 0, 'v', 64, 32), (1, 0, 'k', 128, 32), (1, 0, 'v', 192, 32)]
    """

    name: str
    layers: tuple[LayerSpec, ...]
    page_size: int
    grow: Grow = Grow.UP
    owner: str | None = None
    role: EndRole = EndRole.TARGET
    head_groups: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise SpecError("name", self.name, "a non-empty identifier-like string")
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise SpecError(f"{self.name}.layers", self.layers, "at least one layer")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerSpec):
                raise SpecError(f"{self.name}.layers[{i}]", layer, "a LayerSpec")
        _check_int(f"{self.name}.page_size", self.page_size, 1, 1 << 16)
        if not isinstance(self.grow, Grow):
            raise SpecError(f"{self.name}.grow", self.grow, f"one of {[g.value for g in Grow]}")
        if not isinstance(self.role, EndRole):
            raise SpecError(f"{self.name}.role", self.role, f"one of {[r.value for r in EndRole]}")
        if self.owner is not None and self.owner == self.name:
            raise SpecError(f"{self.name}.owner", self.owner, "None or the name of another end")
        if self.role is EndRole.SWA and self.window_tokens is None:
            raise SpecError(f"{self.name}.layers", "mixed/full layers",
                            "an SWA end holds only sliding layers")
        _check_int(f"{self.name}.head_groups", self.head_groups, 1, 1 << 12)
        for i, layer in enumerate(self.layers):
            if self.head_groups > 1 and (layer.kind is LayerKind.MLA or layer.num_kv_heads % self.head_groups):
                raise SpecError(f"{self.name}.head_groups", self.head_groups,
                                f"a divisor of every MHA layer's num_kv_heads (layer {i}: {layer.kind.value}, "
                                f"{layer.num_kv_heads} heads) and no MLA layer; 1 for the page-major envelope")
        for b in self.blocks:
            item = self.layers[b.layer].dtype.itemsize
            if b.offset_bytes % item:
                raise SpecError(f"{self.name}.layers[{b.layer}]", self.layers[b.layer],
                                f"layer blocks aligned to the dtype size ({item} B)")

    @property
    def is_owner(self) -> bool:
        """True if this end mints virtual pages."""
        return self.owner is None

    @property
    def entry_bytes(self) -> int:
        """Bytes one token occupies across every layer of this end."""
        return sum(layer.token_bytes for layer in self.layers)

    @property
    def page_bytes(self) -> int:
        """``page_size * entry_bytes``."""
        return self.page_size * self.entry_bytes

    @property
    def window_tokens(self) -> int | None:
        """The sliding window the end keeps if *every* layer slides: the largest of their windows (a layer with
        a smaller one is held for the largest, a superset of its own window); else ``None``.

        An end with any full-attention layer keeps (and sends) every token, even if some layers slide.
        """
        windows = [layer.window_tokens for layer in self.layers]
        if any(w is None for w in windows):
            return None
        return max(windows)  # type: ignore[type-var]

    @property
    def blocks(self) -> tuple[PageBlock, ...]:
        """Every K / V / latent block of one page in byte order (Note [Head-group-outer envelope]): per head
        group, per layer, K then V (MLA: the latent block only). Block ``b`` holds ``page_size`` token rows of
        ``b.row_bytes`` each from ``b.offset_bytes``. Cached; O(groups * layers)."""
        cached = self.__dict__.get("_blocks")
        if cached is None:
            out: list[PageBlock] = []
            g_count = self.head_groups
            group_bytes = self.page_bytes // g_count
            for g in range(g_count):
                off = g * group_bytes
                for i, layer in enumerate(self.layers):
                    heads = layer.num_kv_heads // g_count
                    for kv, tok in (("k", layer.k_token_bytes), ("v", layer.v_token_bytes)):
                        if tok:
                            row = tok // g_count
                            out.append(PageBlock(g, i, kv, off, row, g * heads, heads))
                            off += self.page_size * row
            cached = tuple(out)
            object.__setattr__(self, "_blocks", cached)
        return cached

    @property
    def heads_per_group(self) -> tuple[int, ...]:
        """Per layer, the KV heads one head group holds (``num_kv_heads // head_groups``; 1 for MLA)."""
        return tuple(x.num_kv_heads // self.head_groups for x in self.layers)

    @property
    def layer_offsets_bytes(self) -> tuple[tuple[int, int], ...]:
        """Per layer, the byte offsets of its K block and V block inside one page (V = K + K block for
        MLA, an empty block). See Note [Page-major envelope]. Page-major ends only.

        Raises:
            UmallocValueError: ``head_groups > 1`` (a layer's K is then one block per group: use :attr:`blocks`).
        """
        if self.head_groups != 1:
            raise UmallocValueError(f"end {self.name!r} has head_groups={self.head_groups}: its layers have one "
                                    "block per head group; use EndSpec.blocks")
        out = []
        off = 0
        for layer in self.layers:
            k_off = off
            off += self.page_size * layer.k_token_bytes
            v_off = off
            off += self.page_size * layer.v_token_bytes
            out.append((k_off, v_off))
        return tuple(out)


@dataclass(frozen=True)
class ArenaSpec:
    """A whole arena: its ends and its size in bytes, validated as a whole.

    Rules (each violation raises :class:`SpecError` naming the field):

    * end names are unique; at least one end; at most one ``up`` end and one ``down`` end;
    * a bound end's ``owner`` names an id-owner end with the same ``page_size``;
    * ``floor_bytes`` (the reserved floor, holding physical page 0 of every end: the sink) is at least the
      largest ``page_bytes`` (default: exactly that, rounded up to ``ARENA_ALIGN_BYTES``);
    * ``arena_bytes`` is a multiple of ``ARENA_ALIGN_BYTES`` and leaves room for at least one page of every
      end above the floor.

    >>> full = EndSpec("full", (LayerSpec.mha(1, 4),), page_size=2)                   # 16 B/token, 32 B pages
    >>> swa = EndSpec("swa", (LayerSpec.mha(1, 2, window_tokens=4),), page_size=2, grow=Grow.DOWN,
    ...               owner="full", role=EndRole.SWA)                                 # 8 B/token, 16 B pages
    >>> spec = ArenaSpec((full, swa), arena_bytes=256)
    >>> spec.floor_bytes, spec.first_page("full"), spec.top_page("swa")
    (32, 1, 15)
    """

    ends: tuple[EndSpec, ...]
    arena_bytes: int
    floor_bytes: int = 0  # 0: default to the largest page_bytes (aligned)
    _by_name: dict[str, EndSpec] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ends", tuple(self.ends))
        if not self.ends:
            raise SpecError("ends", self.ends, "at least one EndSpec")
        by_name: dict[str, EndSpec] = {}
        for i, end in enumerate(self.ends):
            if not isinstance(end, EndSpec):
                raise SpecError(f"ends[{i}]", end, "an EndSpec")
            if end.name in by_name:
                raise SpecError(f"ends[{i}].name", end.name, "a name unique within the arena")
            by_name[end.name] = end
        object.__setattr__(self, "_by_name", by_name)
        for grow in (Grow.UP, Grow.DOWN):
            n = sum(1 for e in self.ends if e.grow is grow)
            if n > 1:
                raise SpecError(f"ends[*].grow={grow.value}", n, f"at most one {grow.value} end")
        for i, end in enumerate(self.ends):
            if end.owner is None:
                continue
            owner = by_name.get(end.owner)
            if owner is None:
                raise SpecError(f"ends[{i}].owner", end.owner, f"one of {sorted(by_name)}")
            if not owner.is_owner:
                raise SpecError(f"ends[{i}].owner", end.owner, "an id-owner end (whose owner is None)")
            if owner.page_size != end.page_size:
                raise SpecError(f"ends[{i}].page_size", end.page_size,
                                f"the owner {owner.name!r}'s page_size {owner.page_size}")
        max_page = max(e.page_bytes for e in self.ends)
        default_floor = _round_up(max_page, ARENA_ALIGN_BYTES)
        if self.floor_bytes == 0:
            object.__setattr__(self, "floor_bytes", default_floor)
        _check_int("floor_bytes", self.floor_bytes, max_page)
        _check_int("arena_bytes", self.arena_bytes, 1)
        if self.arena_bytes % ARENA_ALIGN_BYTES:
            raise SpecError("arena_bytes", self.arena_bytes, f"a multiple of {ARENA_ALIGN_BYTES}")
        need = self.floor_bytes + sum(e.page_bytes for e in self.ends)
        if self.arena_bytes < need:
            raise SpecError("arena_bytes", self.arena_bytes, f">= {need}",
                            "the floor plus one page of every end")

    def end(self, name: str) -> EndSpec:
        """The end called ``name``; raises :class:`SpecError` if there is none."""
        try:
            return self._by_name[name]
        except (KeyError, TypeError):   # TypeError: an unhashable name (a list)
            raise SpecError("end", name, f"one of {sorted(self._by_name)}") from None

    @property
    def end_names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.ends)

    def first_page(self, name: str) -> int:
        """Lowest physical page of end ``name`` above the reserved floor: ``ceil(floor_bytes / page_bytes)``
        (1 for the end with the largest page). Pages below it (page 0, the sink, included) are never
        handed out."""
        return -(-self.floor_bytes // self.end(name).page_bytes)

    def top_page(self, name: str) -> int:
        """Highest physical page of end ``name`` that fits in the arena: ``arena_bytes // page_bytes - 1``."""
        return self.arena_bytes // self.end(name).page_bytes - 1

    def num_page_slots(self, name: str) -> int:
        """Size of end ``name``'s physical id space, ``top_page + 1`` (page 0 included); also the size of its
        owner's virtual id space when ``name`` is an id owner."""
        return self.top_page(name) + 1

    def usable_bytes(self) -> int:
        """Bytes above the reserved floor, shared by all ends."""
        return self.arena_bytes - self.floor_bytes

    def owner_of(self, name: str) -> str:
        """The id-owner end whose virtual ids end ``name`` uses (itself if it is an owner)."""
        end = self.end(name)
        return end.name if end.owner is None else end.owner

    def ends_with_role(self, role: EndRole) -> tuple[EndSpec, ...]:
        return tuple(e for e in self.ends if e.role is role)


def _round_up(x: int, align: int) -> int:
    return -(-x // align) * align


def _check_ints(call: str, *args: tuple[str, object, int]) -> None:
    """UmallocValueError naming the first ``(name, value, lo)`` that is not an int (bools refused) in
    ``[lo, 2**63)``."""
    for nm, v, lo in args:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not lo <= v < 1 << 63:
            raise UmallocValueError(f"{call}: {nm}={v!r}; allowed an int in [{lo}, 2**63)")


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """``ceil(num_tokens / page_size)``. O(1).

    Raises:
        UmallocValueError: ``num_tokens`` not an int in ``[0, 2**63)`` or ``page_size`` not one in ``[1, 2**63)``.

    >>> pages_for_tokens(17, 16)
    2
    """
    _check_ints("pages_for_tokens", ("num_tokens", num_tokens, 0), ("page_size", page_size, 1))
    return int(-(-num_tokens // page_size))


def swa_pages_per_seq(window_tokens: int, page_size: int, chunk_tokens: int = 1) -> int:
    """Pages one sequence's sliding-window layers need at most: ``cdiv(window - 1 + chunk, page_size) + 1``
    (vLLM ``SlidingWindowSpec.max_memory_usage_bytes``; the ``+ 1`` covers a window that does not start on a
    page boundary; ``chunk_tokens`` is the largest prefill chunk, 1 for decode). O(1).

    Raises:
        UmallocValueError: an argument not an int in ``[1, 2**63)``, or ``window - 1 + chunk`` beyond it.
    """
    _check_ints("swa_pages_per_seq", ("window_tokens", window_tokens, 1), ("page_size", page_size, 1),
                ("chunk_tokens", chunk_tokens, 1))
    _check_ints("swa_pages_per_seq", ("window_tokens - 1 + chunk_tokens", window_tokens - 1 + chunk_tokens, 1))
    return pages_for_tokens(window_tokens - 1 + chunk_tokens, page_size) + 1


def arena_bytes_for_limits(ends: Sequence[EndSpec], *, max_seq_len_tokens: int, max_batch: int,
                           chunk_tokens: int = 1) -> int:
    """Arena bytes that hold ``max_batch`` sequences of ``max_seq_len_tokens`` in every end at once.

    Sized from the runtime limits, never from a model's advertised maximum positions (a drafter that sized
    itself from 1,048,576 positions could not start on a real deployment). An end whose every layer slides
    is priced by its window tail (:func:`swa_pages_per_seq`), capped at the whole sequence; every other end by
    the whole sequence; a ``state`` end by one page per sequence.

    >>> e = EndSpec("full", (LayerSpec.mha(1, 4),), page_size=2)    # 32 B pages
    >>> arena_bytes_for_limits([e], max_seq_len_tokens=5, max_batch=2)   # floor 32 + 2 x 3 pages x 32
    224
    """
    _check_int("max_seq_len_tokens", max_seq_len_tokens, 1)
    _check_int("max_batch", max_batch, 1)
    _check_int("chunk_tokens", chunk_tokens, 1)
    if not ends:
        raise SpecError("ends", ends, "at least one EndSpec")
    floor = _round_up(max(e.page_bytes for e in ends), ARENA_ALIGN_BYTES)
    total = floor
    for e in ends:
        full_pages = pages_for_tokens(max_seq_len_tokens, e.page_size)
        if e.role is EndRole.STATE:
            per_seq = 1
        elif e.window_tokens is not None:
            per_seq = min(full_pages, swa_pages_per_seq(e.window_tokens, e.page_size, chunk_tokens))
        else:
            per_seq = full_pages
        total += per_seq * max_batch * e.page_bytes
    return _round_up(total, ARENA_ALIGN_BYTES)


def arena_spec_for_budget(ends: Sequence[EndSpec], budget_bytes: int) -> ArenaSpec:
    """The largest valid arena within ``budget_bytes`` (rounded down to ``ARENA_ALIGN_BYTES``).

    Raises:
        SpecError: if the budget cannot hold the floor and one page of every end.
    """
    _check_int("budget_bytes", budget_bytes, 1)
    return ArenaSpec(tuple(ends), arena_bytes=(budget_bytes // ARENA_ALIGN_BYTES) * ARENA_ALIGN_BYTES)


__all__ = [
    "ARENA_ALIGN_BYTES", "ArenaSpec", "EndRole", "EndSpec", "Grow", "KVDtype", "LayerKind", "LayerSpec", "PageBlock",
    "arena_bytes_for_limits", "arena_spec_for_budget", "pages_for_tokens", "swa_pages_per_seq", "swa_tail_start",
]


def swa_tail_start(seq_len: int, window: int, prefix_len: int, page_size: int) -> int:
    """First token whose SWA page must exist: ``floor_to_page(max(prefix_len, seq_len - window))``.

    The one SWA formula (F18/F19): prefill (what to send), decode (what to keep: pages wholly before it may be
    unbound), plans and the replay all call this, so every side works in the same units (tokens floored to the
    page), also when ``page_size > window``. O(1).

    Raises:
        UmallocValueError: a non-int argument, negative lengths, ``window < 1``, ``page_size < 1`` or
            ``prefix_len > seq_len``.

    >>> swa_tail_start(100, 32, 0, 16)     # window [68, 100): pages from token 64
    64
    >>> swa_tail_start(10, 3, 0, 16)       # page_size > window: keep page 0
    0
    >>> swa_tail_start(100, 32, 90, 16)    # the receiver holds 90 tokens already
    80
    """
    for nm, v, lo in (("seq_len", seq_len, 0), ("window", window, 1), ("prefix_len", prefix_len, 0),
                      ("page_size", page_size, 1)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v < 1 << 63:
            raise UmallocValueError(f"swa_tail_start: {nm}={v!r}; allowed an int in [{lo}, 2**63)")
    if prefix_len > seq_len:
        raise UmallocValueError(f"swa_tail_start: prefix_len={prefix_len} > seq_len={seq_len}; "
                                f"allowed prefix_len in [0, seq_len]")
    first = max(prefix_len, seq_len - window)
    return int(first // page_size * page_size)
