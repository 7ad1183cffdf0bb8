"""The four decode-arena layouts ``umalloc replay --layout`` compares: same scheduler, admission, retraction, bytes.

* ``dynamic`` (the default): one multi-ended arena; the split between the ends follows the requests served.
* ``static[:RATIO]``: each end gets a fixed share of the same arena, sized once as SGLang sizes its hybrid SWA
  pools (:func:`static_budget_pages`). It is enforced as a per-end page budget checked by the scheduler's
  admission, restore and decode step (the allocator underneath is the dynamic one, so the bytes, the transfers
  and the verification are the same; only what may be held per end changes). ``RATIO`` is SGLang's
  ``--swa-full-tokens-ratio`` (SWA-layer tokens / full-layer tokens); omitted, SGLang's default
  :data:`SGLANG_SWA_FULL_TOKENS_RATIO`.
* ``vllm``: vLLM's block pool as a count (Note [vLLM's block accounting]): each request holds, per KV cache group,
  the blocks vLLM's managers hold, the drafter's sliding groups freeing out-of-window blocks too.
* ``padded``: every layer's page unified to one size as vLLM's hybrid KV cache manager does
  (:func:`vllm_unified_page`), built as a padded :class:`ArenaSpec` (:func:`padded_ends`) for both arenas (the two
  sides of a transfer share one geometry). Padding layers are real layers of the envelope: they are filled,
  moved and verified like the others, and counted as bytes lost to padding.

Static pools and padded pages never change the prefill arena's layout except that ``padded`` pads it too.

Note [SGLang's static SWA split]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
SGLang (``python/sglang/srt/server_args.py``: ``swa_full_tokens_ratio: float = 0.8``;
``model_runner.set_num_tokens_hybrid_swa``) solves, in per-layer tokens ``T``::

    swa_tokens * swa_layers + full_tokens * full_layers = T,   swa_tokens = ratio * full_tokens

and rounds both down to whole pages. The replay's ends have different bytes per token (the drafter's too), so
the same two equations are solved in bytes of the usable arena, with the draft pool given the full pool's token
count (a request holds as many draft tokens as full tokens)::

    full_tokens * (full_entry + ratio * swa_entry + draft_entry) = usable_bytes

Note [SGLang's SWA eviction]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
SGLang's decode side (``srt/disaggregation/decode.py``, ``_swa_tail_len``) preallocates a transferred prompt's
SWA tokens from ``floor_to_page(seq_len - window)``, as every layout here does. During decode,
``ScheduleBatch.maybe_evict_swa`` (``srt/managers/schedule_batch.py``) frees a request's out-of-window SWA
tokens only from its second decode batch on and only once ``seqlen - 1 - window`` is
:data:`SGLANG_SWA_EVICTION_INTERVAL` tokens past the first token still held, then up to
``floor_to_page(seqlen - 1 - window)`` (``srt/mem_cache/common.py``, ``free_swa_out_of_window_slots``, no
prefix sharing). The ``static`` layout unbinds its SWA pages by this rule (:func:`sglang_swa_evicted_to`); the
other layouts unbind at the window (:func:`umalloc.geometry.spec.swa_tail_start`).

Note [vLLM's block accounting]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The ``vllm`` layout counts what vLLM's hybrid KV cache manager holds, over the same usable bytes:

1. Groups as in Note [vLLM's unified page]: per layer type, ``cdiv(layers, G)`` KV cache groups of block size
   ``P / token_bytes`` tokens (the grown block size); a block is ``G * P`` bytes
   (``kv_cache_planning.get_kv_cache_config_from_groups``: ``num_blocks = available_memory //
   bytes_per_block``), one of them ``BlockPool``'s null block, and every group draws from that one pool.
2. Per request and group (``single_type_kv_cache_manager.py``, prefix caching off): a full-attention group holds
   ``cdiv(slots, B)`` blocks; a sliding group frees, before each allocation, the whole blocks before the
   ``computed - W + 1`` tokens ``SlidingWindowManager.get_num_skipped_tokens`` skips (``remove_skipped_blocks``;
   a new request gets null blocks there), so with ``n`` slots and ``n - 1`` tokens computed it holds
   ``cdiv(n, B) - (n - W) // B`` (:meth:`VllmGroup.held`).

The count is enforced as a budget at admission (Note [Admission reserve] in blocks), restore and each decode
step; the bytes live in a carrier arena of the natural ends with four times the bytes
(``umalloc_replay.single.run.VLLM_CARRIER_FACTOR``; at twice, the floating draft band left the Gemma-3 +
drafter carrier unable to place an admission 9 times on the drift trace), so the carrier never binds before
the count (``tests/integrations/test_vllm_capacity_model.py`` checks 1 and 2 against vLLM's code).

Note [vLLM's unified page]
~~~~~~~~~~~~~~~~~~~~~~~~~~
vLLM's hybrid allocator (``vllm/v1/core/kv_cache_utils.py``) keeps one physical block size for every layer:

1. ``unify_kv_cache_spec_page_size``: each layer's page is ``block_size * token_bytes``; the largest is the
   unified page ``P``. A layer with a smaller page whose size divides ``P`` grows its block size by
   ``P / page`` (same bytes per token, coarser pages); one that does not divide ``P`` is padded to ``P``.
2. ``_get_kv_cache_groups_uniform_page_size``: layers of one spec form a type; the group size ``G`` is the
   smallest type's layer count, or the largest's when ``max < 1.5 * min``; every type is padded with layers up
   to a multiple of ``G`` (``num_padding_layers = G - n % G``), and one block is ``G * P`` bytes.

The replay keeps its page size for every end (bound ends share the owner's page size), so step 1's block-size
growth is taken at its bytes (no padding; its coarser granularity is not modelled) and step 2's padding layers
add bytes. A page that does not divide ``P`` (vLLM's ``page_size_padded``) occurs in no preset and is refused. Types are keyed by the layer spec across ends, as vLLM
keys them across the target and the drafter; a type's padding layers join the last end holding that type.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from umalloc import ArenaSpec, EndRole, EndSpec, LayerSpec, UmallocValueError

#: SGLang's default ``--swa-full-tokens-ratio`` (``server_args.py``, Note [SGLang's static SWA split]).
SGLANG_SWA_FULL_TOKENS_RATIO = 0.8

#: SGLang's ``SGLANG_SWA_EVICTION_INTERVAL`` (``srt/environ.py``): a decoding request's SWA tokens are freed only
#: once ``seqlen - 1 - window`` has moved this many tokens past what was freed last (Note [SGLang's SWA eviction]).
SGLANG_SWA_EVICTION_INTERVAL = 128

LAYOUTS = ("dynamic", "static", "padded", "vllm")


@dataclass(frozen=True)
class Layout:
    """A parsed ``--layout``: ``name`` one of :data:`LAYOUTS`; ``swa_full_tokens_ratio`` for ``static``."""

    name: str = "dynamic"
    swa_full_tokens_ratio: float | None = None

    @property
    def label(self) -> str:
        """``dynamic``, ``static:0.8``, ``padded``."""
        return f"static:{self.swa_full_tokens_ratio:g}" if self.name == "static" else self.name


def parse_layout(text: str) -> Layout:
    """``"dynamic"``, ``"padded"``, ``"vllm"``, ``"static"`` or ``"static:RATIO"`` (RATIO in ``(0, 1]``, the range
    SGLang's ``kv_cache_hook`` accepts for ``--swa-full-tokens-ratio``).

    Raises:
        UmallocValueError: anything else.

    >>> parse_layout("static").label, parse_layout("static:0.25").label, parse_layout("padded").label
    ('static:0.8', 'static:0.25', 'padded')
    """
    if not isinstance(text, str):
        raise UmallocValueError(f"layout={text!r}: allowed 'dynamic', 'static[:RATIO]', 'padded' or 'vllm'")
    name, colon, arg = text.strip().partition(":")
    if name in ("dynamic", "padded", "vllm") and not colon:
        return Layout(name)
    if name == "static":
        if not colon:
            return Layout("static", SGLANG_SWA_FULL_TOKENS_RATIO)
        try:
            ratio = float(arg)
        except ValueError:
            ratio = float("nan")
        if not (math.isfinite(ratio) and 0 < ratio <= 1):
            raise UmallocValueError(f"layout={text!r}: RATIO {arg!r}, allowed a number in (0, 1] (SGLang's "
                                    "--swa-full-tokens-ratio, SWA tokens / full tokens; SGLang refuses others)")
        return Layout("static", ratio)
    raise UmallocValueError(f"layout={text!r}: allowed 'dynamic', 'static[:RATIO]', 'padded' or 'vllm'")


def static_budget_pages(spec: ArenaSpec, ratio: float) -> dict[str, int]:
    """Pages each end of ``spec`` may hold under SGLang's static split (Note [SGLang's static SWA split]).

    Raises:
        UmallocValueError: ``ratio`` not a finite number > 0; an SWA pool of at most ``window + page_size``
            tokens, which SGLang refuses (``validate_swa_pool_size``).

    Returns:
        ``{end: pages}``: ``full_tokens // page_size`` for target and draft ends and ``int(ratio * full_tokens) //
        page_size`` for SWA ends, where ``full_tokens`` is ``int(usable_bytes // per_full_token)`` rounded down to
        whole pages (SGLang's ``HybridSWAPoolConfigurator``: ``int(available // cell_size)``, then
        ``align_page_size`` of it and of ``int(full_tokens * ratio)``).

    >>> from umalloc.geometry.presets import preset_arena_spec
    >>> page = 16 * 24576                  # gpt-oss-20b: both ends 24,576 B per token
    >>> spec = preset_arena_spec("gpt-oss-20b", page + 2000 * page, page_size=16)   # floor = one page
    >>> static_budget_pages(spec, 1.0), static_budget_pages(spec, 0.25)
    ({'full': 1000, 'swa': 1000}, {'full': 1600, 'swa': 400})
    """
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0):
        raise UmallocValueError(f"ratio={ratio!r}: allowed a finite number > 0")
    per_full_token = sum(e.entry_bytes * (ratio if e.role is EndRole.SWA else 1.0) for e in spec.ends)
    page = spec.ends[0].page_size
    full_tokens = int(spec.usable_bytes() // per_full_token) // page * page
    swa_tokens = int(full_tokens * ratio) // page * page
    for e in spec.ends:
        if e.role is EndRole.SWA and e.window_tokens is not None and e.window_tokens + page >= swa_tokens:
            raise UmallocValueError(
                f"static:{ratio:g}: the SWA pool of {swa_tokens} tokens cannot hold one request's window of "
                f"{e.window_tokens} plus a page ({page}); SGLang refuses to start with it "
                "(HybridSWAPoolConfigurator.validate_swa_pool_size): allowed a larger RATIO or more bytes")
    return {e.name: (swa_tokens if e.role is EndRole.SWA else full_tokens) // e.page_size for e in spec.ends}


def sglang_swa_evicted_to(seq_len: int, evicted: int, window: int, page_size: int, *, decoded: int,
                          interval: int = SGLANG_SWA_EVICTION_INTERVAL) -> int:
    """First SWA token SGLang keeps after the eviction check of a decode step that computes token ``seq_len - 1``
    (Note [SGLang's SWA eviction]); ``evicted``: the first token kept before it; ``decoded``: decode steps the
    request ran before this one (SGLang skips its first decode batch). O(1).

    >>> sglang_swa_evicted_to(1200, 0, 1024, 16, decoded=5)          # 1199 - 1024 = 175 >= 0 + 128: evict
    160
    >>> sglang_swa_evicted_to(1200, 64, 1024, 16, decoded=5)         # 175 < 64 + 128: not yet
    64
    """
    pre_len = seq_len - 1
    if decoded < 1 or pre_len - window < evicted + interval:
        return evicted
    return max(evicted, (pre_len - window) // page_size * page_size)


@functools.lru_cache(maxsize=4096)
def sglang_swa_peak_pages(input_tokens: int, output_tokens: int, window: int, page_size: int, *,
                          interval: int = SGLANG_SWA_EVICTION_INTERVAL) -> int:
    """Most SWA pages one request holds on SGLang's decode side (Note [SGLang's SWA eviction]): the prompt's
    window tail from ``floor_to_page(input_tokens - window)`` (``_swa_tail_len``), then one token per decode step,
    freed only by :func:`sglang_swa_evicted_to`. O(output_tokens).

    >>> # 7 pages; 64 tail pages (125 - 976 // 16), 8 more before the first eviction at decode step 128
    >>> sglang_swa_peak_pages(100, 10, 1024, 16), sglang_swa_peak_pages(2000, 400, 1024, 16)
    (7, 72)
    """
    evicted = max(0, input_tokens - window) // page_size * page_size
    peak = -(-input_tokens // page_size) - evicted // page_size
    for k in range(output_tokens):
        n = input_tokens + k + 1
        evicted = sglang_swa_evicted_to(n, evicted, window, page_size, decoded=k, interval=interval)
        peak = max(peak, -(-n // page_size) - evicted // page_size)
    return peak


@dataclass(frozen=True)
class UnifiedPage:
    """vLLM's unified page for a set of ends (Note [vLLM's unified page]).

    Attributes:
        page_bytes: ``P``, the largest per-layer page (bytes).
        group_size: ``G``, layers per KV cache group.
        block_bytes: ``G * P``, one physical block.
        types: per layer type ``(token_bytes, window_tokens, kind)``: ``(layers, padding_layers)``.
    """

    page_bytes: int
    group_size: int
    block_bytes: int
    types: dict[tuple[int, int | None, str], tuple[int, int]]


def _type_key(layer: LayerSpec) -> tuple[int, int | None, str]:
    return (layer.token_bytes, layer.window_tokens, layer.kind.value)


def vllm_unified_page(ends: tuple[EndSpec, ...]) -> UnifiedPage:
    """vLLM's unified page size and grouping for ``ends`` (their layers, at each end's page size). O(layers).

    Raises:
        UmallocValueError: a layer page that does not divide the unified page (page padding, not modelled).

    >>> from umalloc.geometry.presets import preset_ends
    >>> u = vllm_unified_page(preset_ends("gemma-3-12b-draft", page_size=16))
    >>> u.page_bytes, u.group_size, u.block_bytes, u.types[(1024, 512, "mha")]
    (131072, 4, 524288, (22, 2))
    """
    big = max(e.page_size * layer.token_bytes for e in ends for layer in e.layers)
    for e in ends:
        for layer in e.layers:
            if big % (e.page_size * layer.token_bytes):
                raise UmallocValueError(f"end {e.name!r}: a layer page of {e.page_size * layer.token_bytes} B does "
                                        f"not divide the unified page {big} B (vLLM pads it; not modelled here)")
    counts: dict[tuple[int, int | None, str], int] = {}
    for e in ends:
        for layer in e.layers:
            counts[_type_key(layer)] = counts.get(_type_key(layer), 0) + 1
    lo, hi = min(counts.values()), max(counts.values())
    group = hi if hi < lo * 1.5 else lo
    types = {k: (n, (group - n % group) % group) for k, n in counts.items()}
    return UnifiedPage(big, group, group * big, types)


def padded_ends(ends: tuple[EndSpec, ...]) -> tuple[EndSpec, ...]:
    """``ends`` as vLLM's rule lays them out (Note [vLLM's unified page]): every layer type gets its padding
    layers (copies of its spec) appended to the last end holding it. O(layers).

    Raises:
        UmallocValueError: see :func:`vllm_unified_page`.

    >>> from umalloc.geometry.presets import preset_ends
    >>> [(e.name, len(e.layers)) for e in padded_ends(preset_ends("gemma-3-12b-draft"))]   # 40 + 22 + 2 in swa
    [('full', 8), ('swa', 64), ('draft', 4)]
    >>> [(e.name, len(e.layers)) for e in padded_ends(preset_ends("gemma-3-12b-draft", draft_sliding="draft"))]
    [('full', 8), ('swa', 40), ('draft', 28)]
    """
    u = vllm_unified_page(ends)
    last_end = {}
    for e in ends:
        for layer in e.layers:
            last_end[_type_key(layer)] = e.name
    out = []
    for e in ends:
        layers = list(e.layers)
        for key, (_n, pad) in u.types.items():
            if pad and last_end[key] == e.name:
                spec = next(x for x in e.layers if _type_key(x) == key)
                layers.extend([spec] * pad)
        out.append(replace(e, layers=tuple(layers)))
    return tuple(out)


@dataclass(frozen=True)
class VllmGroup:
    """One layer type of vLLM's hybrid KV cache manager (Note [vLLM's block accounting]).

    Attributes:
        block_tokens: tokens per block (``block_size`` after ``unify_kv_cache_spec_page_size``'s growth).
        window_tokens: the sliding window (``None``: full attention, nothing is freed before the request ends).
        groups: KV cache groups of this type, ``cdiv(layers, G)``; each holds its own blocks per request.
    """

    block_tokens: int
    window_tokens: int | None
    groups: int

    def held(self, tokens: int) -> int:
        """Blocks one group holds for a request with ``tokens`` token slots (its KV plus the token being
        computed): ``cdiv(tokens, B)`` less, for a sliding group, the ``(tokens - W) // B`` whole blocks
        ``SlidingWindowManager.remove_skipped_blocks`` freed (``get_num_skipped_tokens(tokens - 1)`` skips
        ``tokens - W`` tokens). O(1).

        >>> VllmGroup(16, 128, 1).held(300), VllmGroup(16, None, 1).held(300)   # 19 - 172 // 16 = 19 - 10
        (9, 19)
        """
        n = -(-tokens // self.block_tokens)
        if self.window_tokens is None:
            return n
        return n - max(0, tokens - self.window_tokens) // self.block_tokens


@dataclass(frozen=True)
class VllmBlocks:
    """vLLM's block pool over ``usable_bytes`` (Note [vLLM's block accounting]): ``num_blocks`` blocks of
    ``block_bytes``, one of them the null block, shared by every group of ``types``."""

    block_bytes: int
    num_blocks: int
    types: tuple[VllmGroup, ...]

    @property
    def free_at_start(self) -> int:
        """Blocks a request may take: all but ``BlockPool``'s null block."""
        return self.num_blocks - 1

    def held(self, tokens: int) -> int:
        """Blocks one request holds with ``tokens`` token slots, over every group. O(types)."""
        return sum(t.groups * t.held(tokens) for t in self.types)

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (frozen, hashable, a handful per run)
    def peak(self, input_tokens: int, output_tokens: int) -> int:
        """Most blocks one request holds from its admission (``input_tokens`` slots) to its last decode step
        (``input_tokens + output_tokens``). O(output_tokens x types), cached."""
        return max(self.held(n) for n in range(input_tokens, input_tokens + output_tokens + 1))


def vllm_blocks(ends: tuple[EndSpec, ...], usable_bytes: int) -> VllmBlocks:
    """vLLM's block pool for ``ends`` (natural, unpadded) over ``usable_bytes`` (Note [vLLM's block accounting]).

    Raises:
        UmallocValueError: see :func:`vllm_unified_page`.

    >>> from umalloc.geometry.presets import preset_ends
    >>> v = vllm_blocks(preset_ends("gemma-3-12b-draft", page_size=16), 100 * 524288)
    >>> v.block_bytes, v.num_blocks, [(t.block_tokens, t.window_tokens, t.groups) for t in v.types]
    (524288, 100, [(16, None, 2), (16, 1024, 10), (128, 512, 6), (128, None, 1)])
    """
    u = vllm_unified_page(ends)
    types = tuple(VllmGroup(u.page_bytes // key[0], key[1], -(-n // u.group_size))
                  for key, (n, _pad) in u.types.items())
    return VllmBlocks(u.block_bytes, usable_bytes // u.block_bytes, types)


def byte_accounting(spec: ArenaSpec, stats: dict, natural_page_bytes: dict[str, int]) -> dict[str, int]:
    """Where every byte of a decode arena is, from one :meth:`MultiEndedAllocator.stats` snapshot.

    Returns ``{"live_bytes", "padding_bytes", "pending_bytes", "free_bytes", "floor_bytes", "held_bytes"}``:
    ``live_bytes`` the live pages at their natural (unpadded) page bytes, ``padding_bytes`` what the padded
    layout adds to them, ``pending_bytes`` freed pages still leased, ``free_bytes`` holes plus the bytes no band
    covers, ``held_bytes = live + padding + pending``. The bands are measured from their page bounds, so
    ``live + padding + pending + free + floor == arena_bytes`` is a check, not a definition: it fails if a band
    held a page the counts miss.
    """
    out = dict.fromkeys(("live_bytes", "padding_bytes", "pending_bytes", "free_bytes"), 0)
    band_bytes = 0
    for name, st in stats.items():
        pb = spec.end(name).page_bytes
        out["live_bytes"] += st.live_pages * natural_page_bytes[name]
        out["padding_bytes"] += st.live_pages * (pb - natural_page_bytes[name])
        out["pending_bytes"] += st.pending_pages * pb
        out["free_bytes"] += st.hole_pages * pb
        band_bytes += max(0, st.band_hi - st.band_lo) * pb
    out["free_bytes"] += spec.usable_bytes() - band_bytes
    out["floor_bytes"] = spec.floor_bytes
    out["held_bytes"] = out["live_bytes"] + out["padding_bytes"] + out["pending_bytes"]
    return out


__all__ = ["LAYOUTS", "SGLANG_SWA_EVICTION_INTERVAL", "SGLANG_SWA_FULL_TOKENS_RATIO", "Layout", "UnifiedPage",
           "VllmBlocks", "VllmGroup", "byte_accounting", "padded_ends", "parse_layout", "sglang_swa_evicted_to",
           "sglang_swa_peak_pages",
           "static_budget_pages", "vllm_blocks", "vllm_unified_page"]
