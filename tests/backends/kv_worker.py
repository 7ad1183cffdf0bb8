"""Plan-level commands for :class:`umalloc.backends.worker.BackendWorker` children, run as
``worker.run("kv_worker:kv_setup", ...)``: a KV side (arena + allocator) in the child, receiver halves, send plans.

Test harness code: it drives an allocator, which the engine layer never does (backends know plans and regions,
not allocators), so it lives with the tests. The spawned child imports this module by name: it inherits the
parent's ``sys.path``, where pytest put this directory.
"""

from __future__ import annotations

import torch

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.backends.worker import WorkerContext, pattern_fill
from umalloc.errors import BackendError
from umalloc.geometry.arena import Arena
from umalloc.transfer import PeerLayout, build_receiver_half, build_send_plan


def kv_setup(ctx: WorkerContext, layout: dict, seed: int | None = None) -> dict:
    """Create an arena + allocator for the spec of ``layout`` (a ``PeerLayout.to_dict()``), fill it with
    :func:`pattern_fill` (``seed``) or zeros, register the arena with the backend and publish its layout.

    Returns:
        This side's ``PeerLayout.to_dict()``.
    """
    spec = PeerLayout.from_dict(layout).spec
    arena = Arena(spec)
    if seed is not None:
        pattern_fill(arena.data, seed)
    alloc = MultiEndedAllocator(arena)
    b = ctx._b()
    old = ctx.objects.get("arena")
    if old is not None and all(b.registration_counts().get(r, 0) for r in old.regions()):
        b.deregister(old.regions())
    b.register(arena.regions())
    mine = PeerLayout.from_arena(arena)
    b.set_layout(mine)
    ctx.objects.update(arena=arena, alloc=alloc, halves={}, plans={})
    return mine.to_dict()


def kv_alloc(ctx: WorkerContext, tokens_by_owner: dict[str, int]) -> dict[str, list[int]]:
    """``alloc_extend`` a fresh request of ``n`` tokens per id owner; returns ``{owner: virtual token ids}``."""
    alloc = ctx.objects["alloc"]
    out = {}
    for owner, n in tokens_by_owner.items():
        vt = alloc.alloc_extend(torch.tensor([0]), torch.tensor([int(n)]), torch.tensor([-1]), owner=owner)
        if vt is None:
            raise BackendError(f"kv_alloc: no space for {n} tokens of {owner!r}")
        out[owner] = vt.tolist()
    return out


def _vtokens(v: dict[str, list[int]]) -> dict:
    return {o: torch.tensor(t, dtype=torch.int64) for o, t in v.items()}


def kv_receiver_half(ctx: WorkerContext, request_id: str, vtokens: dict[str, list[int]], prefix_tokens: int = 0,
                     seq_len_tokens: int | None = None) -> dict:
    """Build and keep (leased) the receiver half of a request; returns its publication through the child's
    backend (``backend.publish_half``: the dict the sender builds its plan from): from then on the half is held
    until :func:`kv_finish_half` reports the sender's end, or the backend's reset/close settles it."""
    half = build_receiver_half(request_id, ctx.objects["alloc"], _vtokens(vtokens), prefix_tokens=prefix_tokens,
                               seq_len_tokens=seq_len_tokens)
    ctx.objects["halves"][request_id] = half
    return ctx._b().publish_half(half)


def kv_finish_half(ctx: WorkerContext, request_id: str, ok: bool = True) -> int:
    """The sender's terminal report for a kept receiver half: its plan finished done (``ok``: complete) or failed
    (settle: a confirmed termination, so the published pages come free). Call it only once the sender's plan finished.
    Returns the allocator's active leases."""
    half = ctx.objects["halves"].pop(request_id)
    half.complete() if ok else half.settle(None)
    return ctx.objects["alloc"].leases_active()


def kv_send(ctx: WorkerContext, request_id: str, half: dict, peer: str, vtokens: dict[str, list[int]],
            timeout_s: float = 30.0, wait: bool = True) -> dict:
    """Build the sender plan from a receiver half and submit it; with ``wait`` wait for it and forget the handle.

    A failed wait is followed by a bounded ``drain`` (up to ``timeout_s`` more), so the outcome is reported only
    once the sender's plan finished and the receiver may release its half (Note [Deadlines and in-flight parts]);
    ``"draining": True`` says the engine still held a part when the drain gave up: keep the receiver's half.

    Returns:
        ``{"state", "plan_state", "draining", "descriptors", "bytes", "num_parts", "handle_id", "leases_active",
        "error"}``.
    """
    b = ctx._b()
    plan = build_send_plan(request_id, ctx.objects["alloc"], _vtokens(vtokens), half, b.peer_layout(peer))
    h = b.submit(plan, peer)
    err = None
    if wait:
        try:
            b.wait(h, timeout_s)
        except BackendError as e:
            err = f"{type(e).__name__}: {e}"
            b.drain(h, timeout_s)
        b.forget(h)
    else:
        ctx.handles[h.handle_id] = h
    return {"state": h.state, "plan_state": plan.state, "draining": h.draining, "descriptors": plan.num_descriptors,
            "bytes": plan.total_bytes, "num_parts": h.num_parts, "handle_id": h.handle_id,
            "leases_active": ctx.objects["alloc"].leases_active(), "error": err}


def kv_arena_bytes(ctx: WorkerContext) -> bytes:
    """The whole arena's bytes."""
    return bytes(ctx.objects["arena"].data.numpy().tobytes())


def kv_leases_active(ctx: WorkerContext) -> int:
    return ctx.objects["alloc"].leases_active()


def kv_translate_pages(ctx: WorkerContext, vpages: list[int], end: str) -> list[int]:
    """Physical pages of ``end`` for virtual pages ``vpages`` (strict)."""
    return ctx.objects["alloc"].translate_pages(torch.tensor(vpages, dtype=torch.int64), end).tolist()


def echo_when(ctx: WorkerContext, path: str, value: object) -> object:
    """Return ``value`` once ``path`` exists (the test creates it): a submitted request that cannot answer before
    the test lets it, whatever the machine's speed."""
    import os
    import time

    while not os.path.exists(path):
        time.sleep(0.001)
    return value


def refuse(ctx: WorkerContext, message: str) -> None:
    """Raise :class:`umalloc.UmallocValueError` with ``message`` (an error that travels back typed)."""
    from umalloc import UmallocValueError

    raise UmallocValueError(message)
