"""Real model KV geometries as arena specs (numbers from each model's published configuration; sources below).

Each preset yields ends:

* ``full`` — the target's full-attention (or MLA) layers; grows ``up``; the id owner.
* ``swa`` — the target's sliding-window layers, where the model slides; grows ``down`` (``float``s between
  ``full`` and ``draft`` when the preset has a drafter, Note [Draft end placement]); bound to ``full``.
  By default it also holds the drafter's sliding layers (``draft_sliding="swa"``), kept for the end's window
  (the largest of its layers' windows: Gemma-3-1B's 22 layers of window 512 held for the target's 1,024).
* ``draft`` — the speculative drafter's layers, where the preset has one (its full-attention layers only when
  its sliding layers go elsewhere); grows ``down`` (``float``s under a ``swa`` end at the top with
  ``draft_sliding="draft"``); bound to ``full`` when it shares its page size, else its own id owner (a draft with its own page size
  keeps its own block table).
* ``draft_swa`` — with ``draft_sliding="own"``: the drafter's sliding layers as an SWA end of the drafter's
  own window, ``float``ing next to ``swa`` and bound to the id owner ``draft`` uses.

Note [Draft end placement]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A ``float`` end's band sits between the ends growing up and down and can wall in the end growing toward it
(compaction packs a band, a float slide moves it only into free gap). On the drifting capacity trace
(``benchmarks/bench_capacity.py --drift``, Gemma-3-12B + Gemma-3-1B) a floating ``draft`` end, which grows with
every request's sequence, cost about a fifth of the mean concurrency against the same ends with the draft at the
top and the ``swa`` end (one window per request) floating: 2.80 vs 3.46 requests. So with a drafter the ``draft``
end grows ``down`` and ``swa`` floats; ``draft_sliding="draft"`` keeps the earlier shape (``swa`` down,
``draft`` floating). Two ``float`` ends side by side (``draft_sliding="own"``) place an empty pair one after the
other, the first taking the gap up to the ``draft`` end: a request can need about 1.7x its bytes of arena there
(refused up front by the replay's fit check), and it scored 2.81 on the same trace.

Sources: Llama-3.1-8B / Qwen3-8B / Qwen3-0.6B / gpt-oss-20b / DeepSeek-V3 from the HF
``config.json`` copies in ai-dynamo/aiconfigurator; Gemma 3 from google-deepmind/gemma ``_gemma.py``
(5 local : 1 global, ``i % 6 == 5`` global, window 1024 for 12B and 512 for 1B); EAGLE-LLaMA3 head from
SafeAILab/EAGLE. Gemma-3-1B as a drafter for Gemma-3-12B relies on the family's shared tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from umalloc.errors import SpecError
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, KVDtype, LayerKind, LayerSpec


@dataclass(frozen=True)
class ModelGeometry:
    """Layers of one model (target or drafter) in model order, and the source they come from."""

    name: str
    layers: tuple[LayerSpec, ...]
    source: str

    @property
    def full_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(x for x in self.layers if not x.is_sliding)

    @property
    def sliding_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(x for x in self.layers if x.is_sliding)


def _gemma3(num_layers: int, kv_heads: int, head_dim: int, window: int) -> tuple[LayerSpec, ...]:
    # GEMMA3_ATTENTION_PATTERN: (LOCAL x 5, GLOBAL) tiled then truncated to num_layers.
    return tuple(LayerSpec.mha(kv_heads, head_dim, window_tokens=None if i % 6 == 5 else window)
                 for i in range(num_layers))


def _gpt_oss(num_layers: int) -> tuple[LayerSpec, ...]:
    # layer_types: even layers sliding_attention (window 128), odd layers full_attention; 8 KV heads x 64.
    return tuple(LayerSpec.mha(8, 64, window_tokens=128 if i % 2 == 0 else None) for i in range(num_layers))


MODELS: dict[str, ModelGeometry] = {
    m.name: m
    for m in (
        ModelGeometry("llama-3.1-8b", (LayerSpec.mha(8, 128),) * 32, "AIC meta-llama--Meta-Llama-3.1-8B"),
        ModelGeometry("llama-3-8b", (LayerSpec.mha(8, 128),) * 32, "AIC meta-llama (same geometry as 3.1)"),
        ModelGeometry("qwen3-8b", (LayerSpec.mha(8, 128),) * 36, "AIC Qwen--Qwen3-8B"),
        ModelGeometry("qwen3-0.6b", (LayerSpec.mha(8, 128),) * 28, "AIC Qwen--Qwen3-0.6B"),
        ModelGeometry("gemma-3-12b", _gemma3(48, 8, 256, 1024), "GEMMA Gemma3_12B"),
        ModelGeometry("gemma-3-1b", _gemma3(26, 1, 256, 512), "GEMMA Gemma3_1B"),
        ModelGeometry("gpt-oss-20b", _gpt_oss(24), "AIC openai--gpt-oss-20b"),
        ModelGeometry("deepseek-v3", (LayerSpec.mla(512, 64),) * 61, "AIC deepseek-ai--DeepSeek-V3"),
        ModelGeometry("deepseek-v3-mtp", (LayerSpec.mla(512, 64),), "AIC DeepSeek-V3 num_nextn_predict_layers=1"),
        ModelGeometry("eagle-llama3-8b", (LayerSpec.mha(8, 128, dtype=KVDtype.FP16),),
                      "EAGLE eagle/train/EAGLE-LLaMA3-Instruct-8B.json"),
    )
}


@dataclass(frozen=True)
class Preset:
    """A served model and, optionally, its drafter."""

    name: str
    target: str
    draft: str | None = None


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("llama-3.1-8b", "llama-3.1-8b"),
        Preset("llama-3-8b-eagle", "llama-3-8b", "eagle-llama3-8b"),
        Preset("qwen3-8b", "qwen3-8b"),
        Preset("qwen3-8b-draft", "qwen3-8b", "qwen3-0.6b"),
        Preset("gemma-3-12b", "gemma-3-12b"),
        Preset("gemma-3-12b-draft", "gemma-3-12b", "gemma-3-1b"),
        Preset("gpt-oss-20b", "gpt-oss-20b"),
        Preset("deepseek-v3", "deepseek-v3", "deepseek-v3-mtp"),
    )
}

#: The preset `umalloc replay` uses by default: sliding-window layers and a drafter.
DEFAULT_PRESET = "gemma-3-12b-draft"


def _with_dtype(layers: tuple[LayerSpec, ...], dtype: KVDtype | None) -> tuple[LayerSpec, ...]:
    if dtype is None:
        return layers
    return tuple(LayerSpec(x.kind, x.num_kv_heads, x.head_dim_k, x.head_dim_v, x.latent_dim, x.window_tokens,
                           dtype) for x in layers)


def rank_kv_heads(total_kv_heads: int, tp_size: int) -> int:
    """KV heads one TP rank of ``tp_size`` holds of a layer with ``total_kv_heads``: vLLM's split,
    ``max(1, total // tp_size)`` (when ``tp_size > total`` each head is replicated on ``tp_size // total``
    consecutive ranks). O(1).

    Raises:
        SpecError: ``total_kv_heads`` or ``tp_size`` not an int in ``[1, 2**63)``, or heads that do not split evenly (``total % tp_size`` when
            ``tp_size <= total``, ``tp_size % total`` when ``tp_size > total``; vLLM refuses both).

    >>> rank_kv_heads(8, 2), rank_kv_heads(8, 8), rank_kv_heads(1, 4), rank_kv_heads(8, 16)
    (4, 1, 1, 1)
    """
    for nm, v in (("total_kv_heads", total_kv_heads), ("tp_size", tp_size)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < 1 << 63:
            raise SpecError(nm, v, "an int in [1, 2**63)")
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise SpecError("tp_size", tp_size, f"a divisor of the layer's {total_kv_heads} KV heads, or a "
                            "multiple of them (replication)")
        return total_kv_heads // tp_size
    if tp_size % total_kv_heads:
        raise SpecError("tp_size", tp_size, f"a multiple of the layer's {total_kv_heads} KV heads (replication), "
                        "or a divisor of them")
    return 1


def _per_rank(layers: tuple[LayerSpec, ...], tp_size: int) -> tuple[LayerSpec, ...]:
    """``layers`` as one TP rank of ``tp_size`` holds them: MHA heads split (:func:`rank_kv_heads`), an MLA
    latent replicated whole."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise SpecError("tp_size", tp_size, "an int >= 1")
    if tp_size == 1:
        return layers
    return tuple(x if x.kind is LayerKind.MLA else
                 LayerSpec(x.kind, rank_kv_heads(x.num_kv_heads, tp_size), x.head_dim_k, x.head_dim_v,
                           x.latent_dim, x.window_tokens, x.dtype) for x in layers)


#: Where :func:`preset_ends` puts a drafter's sliding-window layers.
DRAFT_SLIDING = ("swa", "own", "draft")


def preset_ends(name: str, *, page_size: int = 16, draft: bool = True, draft_page_size: int | None = None,
                dtype: KVDtype | None = None, tp_size: int = 1, head_groups: int = 1,
                draft_sliding: str = "swa") -> tuple[EndSpec, ...]:
    """The ends of preset ``name``, as one TP rank of ``tp_size`` holds them.

    Args:
        name: a key of :data:`PRESETS`.
        page_size: tokens per page of the target ends.
        draft: include the drafter's end (if the preset has a drafter).
        draft_page_size: the draft end's page size (default ``page_size``); a different one makes the draft
            end its own id owner.
        dtype: override every layer's KV dtype (default: the model's own).
        tp_size: tensor-parallel size: every MHA layer (target and drafter) holds :func:`rank_kv_heads` of its
            heads (``LayerSpec.num_kv_heads`` is per rank); MLA latents are replicated whole.
        head_groups: ``G > 1`` lays out every end whose layers are all MHA with per-rank heads dividing by ``G``
            in the head-group-outer envelope (``EndSpec.head_groups``, Note [Head-group-outer envelope]); an end
            that cannot (an MLA layer, or fewer heads: a drafter of one head per rank) keeps the page-major one.
        draft_sliding: where a drafter's sliding-window layers go (:data:`DRAFT_SLIDING`): ``"swa"`` (default)
            the target's ``swa`` end, held for its window (the larger of the two: an upper bound for the
            drafter's); ``"own"`` a ``draft_swa`` end of the drafter's window (when it has full layers too and
            one window); ``"draft"`` the ``draft`` end, held for the whole sequence. ``"swa"`` needs the target
            to slide and the page sizes to match, else the drafter keeps its own ends as with ``"own"``.
            No effect on a drafter whose layers all attend fully.

    Raises:
        SpecError: unknown preset, an invalid page size, a ``tp_size`` the heads do not split by, a
            ``head_groups`` that is not an int >= 1 or that no end can take, or ``draft_sliding`` not one of
            :data:`DRAFT_SLIDING`.

    >>> [(e.name, e.grow.value, e.owner, e.entry_bytes) for e in preset_ends("gpt-oss-20b")]
    [('full', 'up', None, 24576), ('swa', 'down', 'full', 24576)]
    >>> [(e.name, e.layers[0].num_kv_heads) for e in preset_ends("gemma-3-12b-draft", tp_size=2)]
    [('full', 4), ('swa', 4), ('draft', 1)]
    >>> [(e.name, e.head_groups) for e in preset_ends("gemma-3-12b-draft", tp_size=2, head_groups=2)]
    [('full', 2), ('swa', 1), ('draft', 1)]
    >>> [(e.name, len(e.layers), e.window_tokens) for e in preset_ends("gemma-3-12b-draft")]
    [('full', 8, None), ('swa', 62, 1024), ('draft', 4, None)]
    >>> [(e.name, len(e.layers), e.window_tokens) for e in preset_ends("gemma-3-12b-draft", draft_sliding="own")]
    [('full', 8, None), ('swa', 40, 1024), ('draft', 4, None), ('draft_swa', 22, 512)]
    >>> [(e.name, len(e.layers)) for e in preset_ends("gemma-3-12b-draft", draft_sliding="draft")]
    [('full', 8), ('swa', 40), ('draft', 26)]
    """
    if draft_sliding not in DRAFT_SLIDING:
        raise SpecError("draft_sliding", draft_sliding, f"one of {list(DRAFT_SLIDING)}")
    try:
        preset = PRESETS[name]
    except (KeyError, TypeError):  # a list or dict name is no key either
        raise SpecError("preset", name, f"one of {sorted(PRESETS)}") from None
    target = MODELS[preset.target]

    def layers(xs: tuple[LayerSpec, ...]) -> tuple[LayerSpec, ...]:
        return _per_rank(_with_dtype(xs, dtype), tp_size)

    ends: list[EndSpec] = [EndSpec("full", layers(target.full_layers), page_size, Grow.UP, None, EndRole.TARGET)]
    dmodel = MODELS[preset.draft] if draft and preset.draft is not None else None
    dps = page_size if draft_page_size is None else draft_page_size
    dfull, dslide = (dmodel.full_layers, dmodel.sliding_layers) if dmodel is not None else ((), ())
    where = "draft" if not dslide or not dfull else draft_sliding
    if where == "swa" and (not target.sliding_layers or dps != page_size):
        where = "own"
    if where == "own" and len({x.window_tokens for x in dslide}) != 1:
        where = "draft"
    # Note [Draft end placement]: with a drafter next to sliding target layers, the draft end (which grows with
    # the sequence, as the full end does) takes the top and the swa end (a window per request) floats between;
    # draft_sliding="draft" keeps the draft end floating under a swa end at the top.
    swa_floats = dmodel is not None and where != "draft"
    if target.sliding_layers:
        joined = target.sliding_layers + (dslide if where == "swa" else ())
        ends.append(EndSpec("swa", layers(joined), page_size, Grow.FLOAT if swa_floats else Grow.DOWN, "full",
                            EndRole.SWA))
    if dmodel is not None:
        grow = Grow.FLOAT if target.sliding_layers and not swa_floats else Grow.DOWN
        owner = "full" if dps == page_size else None
        ends.append(EndSpec("draft", layers(dmodel.layers if where == "draft" else dfull), dps, grow, owner,
                            EndRole.DRAFT))
        if where == "own":
            ends.append(EndSpec("draft_swa", layers(dslide), dps, Grow.FLOAT, owner or "draft", EndRole.SWA))
    return _grouped(tuple(ends), head_groups)


def _grouped(ends: tuple[EndSpec, ...], head_groups: int) -> tuple[EndSpec, ...]:
    """``ends`` with ``head_groups`` on every end that can take it (all layers MHA, heads dividing by it)."""
    if isinstance(head_groups, bool) or not isinstance(head_groups, int) or head_groups < 1:
        raise SpecError("head_groups", head_groups, "an int >= 1")
    if head_groups == 1:
        return ends
    out = tuple(replace(e, head_groups=head_groups)
                if all(x.kind is LayerKind.MHA and x.num_kv_heads % head_groups == 0 for x in e.layers) else e
                for e in ends)
    if all(e.head_groups == 1 for e in out):
        raise SpecError("head_groups", head_groups, "a divisor of some end's per-rank KV heads "
                        f"({sorted({x.num_kv_heads for e in ends for x in e.layers})}), or 1")
    return out


def preset_arena_spec(name: str, arena_bytes: int, **kwargs: object) -> ArenaSpec:
    """An :class:`ArenaSpec` of ``arena_bytes`` for preset ``name`` (kwargs as :func:`preset_ends`)."""
    return ArenaSpec(preset_ends(name, **kwargs), arena_bytes=arena_bytes)  # type: ignore[arg-type]



__all__ = ["DEFAULT_PRESET", "DRAFT_SLIDING", "MODELS", "PRESETS", "ModelGeometry", "Preset", "preset_arena_spec", "preset_ends",
           "rank_kv_heads"]
