"""``umalloc generate``'s prefill side in the second process (``--backend nixl`` / ``mooncake``).

The replay's :class:`~umalloc_replay.single.remote.RemotePrefill` runs the child; these functions are its
``setup`` and the one extra call the generate driver makes. The child builds its own model copy (same name and
seed: its :func:`~umalloc_replay.generate.models.weights_digest` comes back for the parent to compare), its own
arena and allocator, and a :class:`~umalloc_replay.generate.kv.ModelKV` as the pattern; the replay's
``child_start`` / ``child_finish_all`` then allocate, prefill (the model forward, inside ``fill``), plan, post,
wait and free exactly as in the replay.
"""

from __future__ import annotations

#: ``module:function`` of :func:`child_setup_model` and :func:`child_outputs`, as the worker imports them.
SETUP_TARGET = "umalloc_replay.generate.child:child_setup_model"
OUTPUTS_TARGET = "umalloc_replay.generate.child:child_outputs"


def child_setup_model(ctx, model_name: str, seed: int, page_size: int, arena_bytes: int, compaction: str,
                      prompts: dict[int, list[int]], fault: str | None, draft: bool,
                      draft_layers: int = 0) -> dict:
    """Build the model (and with ``draft`` its drafter), the prefill arena (ends of :func:`~umalloc_replay.generate.models.arena_ends`) and its
    allocator, and adopt them as the child's prefill side; returns the child's stats."""
    from umalloc import Arena, ArenaSpec, MultiEndedAllocator
    from umalloc_replay.generate.kv import ModelKV
    from umalloc_replay.generate.models import (
        arena_ends,
        build_drafter,
        build_model,
        geometry_of,
        weights_digest,
    )
    from umalloc_replay.single.remote import adopt_prefill_side

    model = build_model(model_name, seed)
    geo = geometry_of(model)
    drafter = build_drafter(model, seed, draft_layers) if draft else None
    spec = ArenaSpec(arena_ends(geo, page_size, None if drafter is None else geometry_of(drafter)),
                     arena_bytes=arena_bytes)
    alloc = MultiEndedAllocator(Arena(spec, zero=False), compaction=compaction)
    kv = ModelKV(model, geo, spec, {int(k): list(v) for k, v in prompts.items()}, fault, drafter)
    ctx.objects["generate_weights_digest"] = weights_digest(model) + ("" if drafter is None else
                                                                      "/" + weights_digest(drafter))
    return adopt_prefill_side(ctx, alloc, kv)


def child_outputs(ctx, request_ids: list[int]) -> dict:
    """The written requests' first tokens and digests (:meth:`ModelKV.outputs`), the child's prefill seconds so
    far and its model's weights digest."""
    kv = ctx.objects["replay_pattern"]
    return {"outputs": kv.outputs(list(request_ids)), "prefill_s": kv.prefill_s,
            "weights_digest": ctx.objects["generate_weights_digest"]}


__all__ = ["OUTPUTS_TARGET", "SETUP_TARGET", "child_outputs", "child_setup_model"]
