"""A seeded fuzz of umalloc's public calls with hostile arguments: allocator, arena, leases, request
table, translators, plans, backends (local, nixl, mooncake) and the vLLM integration's entry.

Every call gets, per parameter, either a sane value or a hostile one drawn for that parameter's kind (wrong types,
lists for names, huge / negative ints, NaN, float / bool / 2-D / stride-0 tensors, None, objects). Each outcome is
classified:

* ``ok``: returned (state may change: the call may have been valid);
* ``typed``: raised a :class:`~umalloc.errors.UmallocError` (whose ``ValueError`` / ``TypeError`` subclasses are the
  documented misuse errors) and changed nothing;
* ``untyped``: raised anything else;
* ``silent``: returned although an argument was one no call may accept (e.g. a float slot, a list as a name);
* ``state_changed``: raised, but the target's state snapshot (allocator and table snapshots, arena bytes, lease
  pins, backend stats and registrations, the ``out=`` buffer) differs from before the call.

Run ``python tests/fuzz/fuzz_public_calls.py [--seed N] [--rounds N]``: prints the seed and the counts (and the
first examples of each bad class). ``tests/fuzz/test_fuzz_public_calls.py`` asserts 0 untyped, silent and
state-changed outcomes.
"""

from __future__ import annotations

import argparse
import random
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from umalloc import check_compatible
from umalloc.allocator.facade import MultiEndedAllocator, snapshots_equal
from umalloc.errors import InvariantError, UmallocError
from umalloc.geometry.arena import Arena
from umalloc.geometry.presets import preset_ends, rank_kv_heads
from umalloc.geometry.spec import pages_for_tokens, swa_pages_per_seq
from umalloc.leases.table import LeaseTable
from umalloc.requests.table import RequestTable
from umalloc.testing import tiny_spec
from umalloc.transfer import PeerLayout, ReceiverHalf, build_receiver_half, build_send_plan
from umalloc.transfer.build import build_plan
from umalloc.transfer.rows import owned_count, vector_rows
from umalloc.transfer.slices import sends_to
from umalloc.translators import get_translator


# ==== hostile values per parameter kind: (value, never-valid) ======================================================
def _expanded(dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype).expand(3)


def _pool(kind: str) -> list[tuple[Callable[[], Any], bool]]:
    """Candidates for a parameter of ``kind``: a factory of the value and whether no call may accept it."""
    junk: list[tuple[Callable[[], Any], bool]] = [
        (lambda: None, True), (lambda: object(), True), (lambda: b"x", True), (lambda: {"k": 1}, True),
        (lambda: float("nan"), True), (lambda: 1.5, True), (lambda: {1, 2}, True)]
    if kind == "name":
        return [(lambda: "full", False), (lambda: "swa", False), (lambda: ["full"], True), (lambda: ("full",), True),
                (lambda: 3, True), (lambda: "nope", True), (lambda: torch.tensor([1]), True), *junk]
    if kind == "count_or_none":   # a count where None means "all" / "default"
        return [(lambda: None, False), *[(m, b) for m, b in _pool("count") if m() is not None]]
    if kind == "obj_or_none":   # an optional library object: None is valid
        return [(lambda: None, False), *[(m, b) for m, b in _pool("obj") if m() is not None]]
    if kind == "owner":   # an id-owner end name, or None for the allocator's only one
        return [(lambda: None, False), *[(m, b) for m, b in _pool("name") if m() is not None]]
    if kind == "ids":   # 1-D integer ids (range errors depend on state: neutral)
        return [(lambda: torch.tensor([1, 2]), False), (lambda: torch.tensor([2], dtype=torch.int32), False),
                (lambda: np.array([1]), False), (lambda: [1], False), (lambda: torch.tensor([2**62]), False),
                (lambda: torch.tensor([-1]), False), (lambda: torch.zeros(0, dtype=torch.int64), False),
                (lambda: torch.tensor([0.7]), True), (lambda: torch.tensor([True]), True),
                (lambda: torch.tensor([[1, 2]]), False), (lambda: np.array([1.5]), True),
                (lambda: np.array([2**63], np.uint64), True), (lambda: [2**64], True), (lambda: [1.5], True),
                (lambda: _expanded(torch.float32), True), (lambda: torch.tensor([1 + 2j]), True),
                (lambda: torch.empty(2, dtype=torch.int64, device="meta"), True), (lambda: "1", True), *junk]
    if kind == "count":
        return [(lambda: 0, False), (lambda: 1, False), (lambda: 3, False), (lambda: 2**62, False),
                (lambda: -1, True), (lambda: 2**63, True), (lambda: 2**64, True), (lambda: True, True),
                (lambda: "2", True), (lambda: [2], True), (lambda: torch.tensor(2.0), True),
                (lambda: float("inf"), True), *junk]
    if kind == "slot":
        return [(lambda: 0, False), (lambda: 1, False), (lambda: torch.tensor([0]), False), (lambda: -1, False),
                (lambda: 7, False), (lambda: torch.tensor([0.7]), True), (lambda: torch.tensor(0.0), True),
                (lambda: 2**63, True), (lambda: 2**64 + 3, True), (lambda: True, True), (lambda: "0", True),
                (lambda: np.float64(0.0), True), *junk]
    if kind == "bool":
        return [(lambda: True, False), (lambda: False, False), (lambda: 0, True), (lambda: 1, True),
                (lambda: "yes", True), (lambda: np.float64(1.0), True), *junk]
    if kind == "seconds":   # a deadline or timeout: None or a finite number
        return [(lambda: 1.0, False), (lambda: 0.01, False), (lambda: "soon", True), (lambda: [1.0], True),
                (lambda: object(), True), (lambda: float("nan"), True), (lambda: b"1", True)]
    if kind == "out":
        return [(lambda: None, False), (lambda: _expanded(torch.int64), True), (lambda: torch.zeros(3), True),
                (lambda: torch.zeros((1, 3), dtype=torch.int64), True), (lambda: [0, 0, 0], True),
                (lambda: object(), True)]
    if kind == "table":   # a v2p table over a physical space of 6 pages (the translators' num_physical_pages)
        return [(lambda: torch.tensor([0, 3, 4, 5, -1]), False), (lambda: np.array([5, -1, 2]), False),
                (lambda: torch.tensor([0, 2**62]), True), (lambda: torch.tensor([6]), True),
                (lambda: np.array([2**63 - 1, 0]), True), (lambda: torch.tensor([[0, 1]]), True),
                (lambda: torch.tensor([0.5]), True), (lambda: [0, 1], False), *junk]
    if kind == "mapping":   # end name -> count or pages
        return [(lambda: {"full": 1}, False), (lambda: {"full": 1, "swa": 1}, False), (lambda: ["full"], True),
                (lambda: {("full",): 1}, True), (lambda: {"nope": 1}, True), (lambda: {"full": 1.5}, True),
                (lambda: {"full": -1}, True), (lambda: {"full": None}, True), *junk]
    if kind == "str":
        return [(lambda: "r1", False), (lambda: ["r"], True), (lambda: 3, True), (lambda: None, True),
                (lambda: b"r", True)]
    if kind == "obj":   # an object of a library type (allocator, half, plan, end spec...): anything else is bad
        return [(lambda: None, True), (lambda: object(), True), (lambda: "x", True), (lambda: {"a": 1}, True),
                (lambda: 3, True), (lambda: [1], True)]
    raise AssertionError(kind)


# ==== targets =======================================================================================================
@dataclass
class Target:
    """One public call: ``call(ctx, *args)`` with parameters of ``kinds``; ``sane`` gives a valid value per
    parameter (``None``: draw only from the pool); ``snap(ctx)`` the state compared on a raise."""

    name: str
    kinds: tuple[str, ...]
    call: Callable[..., Any]
    sane: tuple[Callable[[Any], Any] | None, ...] = ()
    group: str = "alloc"


@dataclass
class Ctx:
    alloc: MultiEndedAllocator
    talloc: MultiEndedAllocator
    table: RequestTable
    leases: LeaseTable
    arena: Arena
    backends: dict[str, Any] = field(default_factory=dict)
    evicted: list = field(default_factory=list)
    live: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    slotpool: Any = None
    halloc: Any = None   # an allocator only the plan helpers use: its sequence ``hseq`` stays live
    hseq: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))


def _make_ctx(backends: dict[str, Any]) -> Ctx:
    """An allocator with a few live pages for the raw calls and plans, a second one under the request table
    (the table's pages are freed only through it), a lease table and an arena."""
    alloc = MultiEndedAllocator(Arena(tiny_spec(640)))
    ctx = Ctx(alloc=alloc, talloc=MultiEndedAllocator(Arena(tiny_spec(640))), table=None,  # type: ignore[arg-type]
              leases=LeaseTable({"full": 8, "swa": 8}), arena=Arena(tiny_spec()), backends=backends)
    ctx.live = alloc.alloc_pages(4) * 2
    ctx.halloc = MultiEndedAllocator(Arena(tiny_spec(640)))
    ps = ctx.halloc.spec.end("full").page_size
    ctx.hseq = (ctx.halloc.alloc_pages(2)[:, None] * ps + torch.arange(ps)).reshape(-1)
    from umalloc.integrations.sglang.pools import SlotPool

    ctx.slotpool = SlotPool(8, 2)
    ctx.slotpool.alloc_tokens(4)
    ctx.table = RequestTable(ctx.talloc, max_requests=4, max_tokens_per_request=16,
                             on_evict=lambda vp: ctx.evicted.append(vp.tolist()))
    s = ctx.table.new_requests(2)
    ctx.table.extend(s, torch.tensor([3, 4]))
    return ctx


def _snap(ctx: Ctx, group: str) -> Any:
    if group in ("alloc", "plan"):
        return (ctx.alloc.snapshot(), ctx.alloc.arena.data.clone())
    if group == "table":
        return (ctx.talloc.snapshot(), ctx.table.snapshot(), ctx.talloc.arena.data.clone(), list(ctx.evicted))
    if group == "arena":
        return ctx.arena.data.clone()
    if group == "halloc":
        return (ctx.halloc.snapshot(), ctx.halloc.arena.data.clone())
    if group == "leases":
        return (len(ctx.leases), ctx.leases.pin_count("full").copy(), ctx.leases.pin_count("swa").copy(),
                ctx.leases.stats())
    if group == "slotpool":
        return (ctx.slotpool.allocator.snapshot(),) if ctx.slotpool is not None else None
    if group.startswith("backend:"):
        b = ctx.backends[group.split(":", 1)[1]]
        return (b.stats(), b.registered_regions(), b.peers(), b.published_halves())
    return None


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return snapshots_equal(a, b)


def _live_vtokens(ctx: Ctx) -> torch.Tensor:
    return ctx.live


def _seq_vtokens(ctx: Ctx) -> torch.Tensor:
    """A live sequence's virtual token ids on ``ctx.halloc`` (no fuzzed call frees them)."""
    return ctx.hseq


def _fresh_half(ctx: Ctx) -> ReceiverHalf:
    """A receiver half over the live pages whose lease is released at once (a copy of its dict stays valid input)."""
    half = build_receiver_half("h", ctx.halloc, _seq_vtokens(ctx))
    half.abort()
    return half


def _fresh_plan(ctx: Ctx) -> Any:
    """A plan over the live pages, aborted at once (its vectors stay readable)."""
    plan = build_plan("p", ctx.halloc, _seq_vtokens(ctx), ctx.halloc, _seq_vtokens(ctx))
    plan.abort()
    return plan


def _targets() -> list[Target]:
    A = lambda f: (lambda ctx, *a: f(ctx.alloc, *a))  # noqa: E731
    T = lambda f: (lambda ctx, *a: f(ctx.table, *a))  # noqa: E731
    R = lambda f: (lambda ctx, *a: f(ctx.arena, *a))  # noqa: E731
    L = lambda f: (lambda ctx, *a: f(ctx.leases, *a))  # noqa: E731
    tr = {impl: get_translator(impl=impl) for impl in ("reference", "cpu")}
    v2p = torch.tensor([0, 3, 4, 5, -1], dtype=torch.int64)
    out: list[Target] = [
        # ---- allocator
        Target("alloc.alloc_pages", ("count", "out"), A(lambda a, n, o: a.alloc_pages(n, out=o))),
        Target("alloc.alloc_pages(bind)", ("count", "name"), A(lambda a, n, b: a.alloc_pages(n, bind=[b]))),
        Target("alloc.free", ("ids",), A(lambda a, v: a.free(v))),
        Target("alloc.free_pages", ("ids",), A(lambda a, v: a.free_pages(v))),
        Target("alloc.unbind_end", ("name", "ids", "bool"), A(lambda a, e, v, s: a.unbind_end(e, v, strict=s))),
        Target("alloc.unbind_pages", ("name", "ids", "bool"),
               A(lambda a, e, v, s: a.unbind_pages(e, v, strict=s))),
        Target("alloc.translate", ("ids", "name", "bool"), A(lambda a, v, e, s: a.translate(v, e, strict=s))),
        Target("alloc.translate_pages", ("ids", "name", "out"),
               A(lambda a, v, e, o: a.translate_pages(v, e, strict=False, out=o))),
        Target("alloc.alloc_extend", ("ids", "ids", "ids"), A(lambda a, p, s, last: a.alloc_extend(p, s, last))),
        Target("alloc.alloc_decode", ("ids", "ids"), A(lambda a, s, last: a.alloc_decode(s, last))),
        Target("alloc.bind_end", ("name", "ids"), A(lambda a, e, v: a.bind_end(e, v))),
        Target("alloc.available_pages", ("name",), A(lambda a, e: a.available_pages(e))),
        Target("alloc.available_tokens", ("name",), A(lambda a, e: a.available_tokens(e))),
        Target("alloc.can_alloc", ("mapping",), A(lambda a, m: a.can_alloc(m))),
        Target("alloc.shortfall_pages", ("mapping",), A(lambda a, m: a.shortfall_pages(m))),
        Target("alloc.compact", ("owner", "count_or_none"), A(lambda a, e, n: a.compact(e, budget_pages=n))),
        Target("alloc.band", ("name",), A(lambda a, e: a.band(e))),
        Target("alloc.watermark", ("name",), A(lambda a, e: a.watermark(e))),
        Target("alloc.owner_of", ("name",), A(lambda a, e: a.owner_of(e))),
        Target("alloc.num_vpages", ("owner",), A(lambda a, e: a.num_vpages(e))),
        Target("alloc.bound_ends", ("owner",), A(lambda a, e: a.bound_ends(e))),
        Target("alloc.v2p", ("name",), A(lambda a, e: a.v2p(e))),
        Target("alloc.p2v", ("name",), A(lambda a, e: a.p2v(e))),
        Target("alloc.num_contiguous_runs", ("ids", "name"), A(lambda a, v, e: a.num_contiguous_runs(v, e))),
        Target("alloc.lease", ("mapping", "seconds", "str"),
               A(lambda a, m, d, t: a.lease({k: v for k, v in m.items()} if isinstance(m, dict) else m,
                                            deadline_s=d, tag=t).release())),
        Target("alloc.swa_tail_start", ("count", "count", "count", "count"),
               A(lambda a, *x: a.swa_tail_start(*x))),
        Target("alloc.trial", ("bool",), A(lambda a, c: a.trial(compaction=c).__enter__().commit())),
        Target("MultiEndedAllocator()", ("str", "count", "bool", "name"),
               lambda ctx, c, b, d, m: MultiEndedAllocator(Arena(tiny_spec()), compaction=c, move_budget_pages=b,
                                                           debug_checks=d, mirror_device=m), group="none"),
        # ---- arena
        *[Target(f"arena.{m}", ("name",), R(lambda ar, n, m=m: getattr(ar, m)(n)), group="arena")
          for m in ("end", "page_bytes", "first_page", "top_page", "envelopes", "region_member")],
        Target("arena.page_offset_bytes", ("name", "count"), R(lambda ar, n, p: ar.page_offset_bytes(n, p)),
               group="arena"),
        Target("arena.envelope", ("name", "count"), R(lambda ar, n, p: ar.envelope(n, p)), group="arena"),
        Target("arena.kv_views", ("name", "count"), R(lambda ar, n, layer: ar.kv_views(n, layer)), group="arena"),
        Target("arena.kv_group_views", ("name", "count"), R(lambda ar, n, layer: ar.kv_group_views(n, layer)),
               group="arena"),
        Target("arena.copy_pages", ("name", "ids", "ids"), R(lambda ar, n, d, s: ar.copy_pages(n, d, s)),
               group="arena"),
        Target("arena.copy_pages(allocator, overwrite)", ("name", "ids", "ids", "bool"),
               A(lambda a, n, d, s, o: a.arena.copy_pages(n, d, s, overwrite=o))),
        Target("Arena()", ("name", "bool", "bool"),
               lambda ctx, d, z, p: Arena(tiny_spec(), device="cpu" if d == "full" else d, zero=z, pin_memory=p),
               group="none"),
        # ---- leases
        Target("leases.pin", ("mapping", "seconds", "str"),
               L(lambda t, m, d, g: t.pin({k: [1] if v == 1 else v for k, v in m.items()} if isinstance(m, dict)
                                          else m, deadline_s=d, tag=g).release()), group="leases"),
        Target("leases.expire", ("seconds",), L(lambda t, n: t.expire(n)), group="leases"),
        Target("leases.is_pinned", ("name", "ids"), L(lambda t, e, p: t.is_pinned(e, p)), group="leases"),
        Target("leases.pin_count", ("name",), L(lambda t, e: t.pin_count(e)), group="leases"),
        Target("leases.in_doubt_pages", ("name",), L(lambda t, e: t.in_doubt_pages(e)), group="leases"),
        Target("leases.release_tagged", ("str",), L(lambda t, g: t.release_tagged(g)), group="leases"),
        Target("leases.lookup", ("count", "count"), L(lambda t, i, g: t.lookup(i, g)), group="leases"),
        Target("LeaseTable()", ("mapping", "obj"), lambda ctx, m, c: LeaseTable(m, clock=c), group="none"),
        # ---- request table
        Target("table.new_requests", ("count", "bool"), T(lambda t, n, h: t.new_requests(n, handles=h)),
               group="table"),
        Target("table.extend", ("ids", "ids"), T(lambda t, s, e: t.extend(s, e)), group="table"),
        Target("table.decode", ("ids",), T(lambda t, s: t.decode(s)), group="table"),
        Target("table.truncate", ("ids", "ids"), T(lambda t, s, n: t.truncate(s, n)), group="table"),
        Target("table.free_requests", ("ids", "bool"), T(lambda t, s, c: t.free_requests(s, cache=c)),
               group="table"),
        Target("table.fork", ("slot", "count_or_none"), T(lambda t, s, n: t.fork(s, n)), group="table"),
        Target("table.attach_prefix", ("slot", "ids"), T(lambda t, s, v: t.attach_prefix(s, v)), group="table"),
        Target("table.num_tokens", ("ids",), T(lambda t, s: t.num_tokens(s)), group="table"),
        Target("table.tokens", ("slot",), T(lambda t, s: t.tokens(s)), group="table"),
        Target("table.pages", ("slot",), T(lambda t, s: t.pages(s)), group="table"),
        Target("table.retain", ("ids",), T(lambda t, v: t.retain(v)), group="table"),
        Target("table.reclaim", ("ids",), T(lambda t, v: t.reclaim(v)), group="table"),
        Target("table.drop_refs", ("ids", "bool"), T(lambda t, v, c: t.drop_refs(v, cache=c)), group="table"),
        Target("table.evict", ("count",), T(lambda t, n: t.evict(n)), group="table"),
        Target("table.can_extend", ("ids", "ids"), T(lambda t, s, e: t.can_extend(s, e)), group="table"),
        Target("table.max_extend_tokens", ("slot",), T(lambda t, s: t.max_extend_tokens(s)), group="table"),
        Target("table.handles", ("ids",), T(lambda t, s: t.handles(s)), group="table"),
        Target("RequestTable()", ("count", "count", "bool", "name"),
               lambda ctx, r, m, z, o: RequestTable(ctx.talloc, max_requests=r, max_tokens_per_request=m,
                                                    zero_page=z, owner=o, exclusive=False), group="table"),
        # ---- translators (stateless; the out= buffer is the state)
        *[Target(f"{impl}.virtual_to_physical", ("ids", "count", "out", "bool"),
                 lambda ctx, v, p, o, s, t=t: t.virtual_to_physical(v, v2p, p, out=o, strict=s), group="none")
          for impl, t in tr.items()],
        *[Target(f"{impl}.virtual_to_physical_pages", ("ids", "out", "bool"),
                 lambda ctx, v, o, s, t=t: t.virtual_to_physical_pages(v, v2p, out=o, strict=s), group="none")
          for impl, t in tr.items()],
        *[Target(f"{impl}.virtual_to_physical_pages(num_physical_pages)", ("ids", "table", "bool"),
                 lambda ctx, v, tab, st, t=t: t.virtual_to_physical_pages(v, tab, strict=st, num_physical_pages=6),
                 group="none") for impl, t in tr.items()],
        *[Target(f"{impl}.virtual_to_physical(num_physical_pages)", ("ids", "table", "count"),
                 lambda ctx, v, tab, p, t=t: t.virtual_to_physical(v, tab, p, strict=False, num_physical_pages=6),
                 group="none") for impl, t in tr.items()],
        *[Target(f"{impl}.tokens_to_pages", ("ids", "count"), lambda ctx, v, p, t=t: t.tokens_to_pages(v, p),
                 group="none") for impl, t in tr.items()],
        *[Target(f"{impl}.pages_to_runs", ("ids", "ids"), lambda ctx, a, b, t=t: t.pages_to_runs(a, b),
                 group="none") for impl, t in tr.items()],
        *[Target(f"{impl}.kernel_page_ids", ("ids", "count", "count"),
                 lambda ctx, v, p, n, t=t: t.kernel_page_ids(v, p, n), group="none") for impl, t in tr.items()],
        # ---- plans
        Target("build_plan", ("obj", "ids", "str"),
               lambda ctx, a, v, r: build_plan(r, a, v, ctx.alloc, v), group="plan"),
        Target("build_plan(ids)", ("ids", "ids", "count"),
               lambda ctx, s, d, p: build_plan("r", ctx.alloc, s, ctx.alloc, d, prefix_tokens=p).abort(),
               group="plan"),
        Target("build_receiver_half", ("ids", "count", "seconds"),
               lambda ctx, v, n, d: build_receiver_half("r", ctx.alloc, v, seq_len_tokens=n, deadline_s=d).abort(),
               group="plan"),
        Target("vector_rows", ("obj", "count", "count"), lambda ctx, e, n, p: vector_rows(e, n, p), group="none"),
        Target("build_send_plan", ("obj", "ids", "obj"),
               lambda ctx, h, v, lay: build_send_plan("r", ctx.halloc, v, h, lay).abort(), group="halloc"),
        Target("ReceiverHalf.from_dict", ("obj",), lambda ctx, d: ReceiverHalf.from_dict(d), group="none"),
        Target("TransferPlan.split", ("obj",), lambda ctx, names: _fresh_plan(ctx).split(names), group="halloc"),
        Target("pages_for_tokens", ("count", "count"), lambda ctx, n, p: pages_for_tokens(n, p), group="none"),
        Target("swa_pages_per_seq", ("count", "count", "count"),
               lambda ctx, w, p, c: swa_pages_per_seq(w, p, c), group="none"),
        Target("rank_kv_heads", ("count", "count"), lambda ctx, h, tp: rank_kv_heads(h, tp), group="none"),
        Target("owned_count", ("count", "count", "count"), lambda ctx, n, s, r: owned_count(n, s, r), group="none"),
        Target("check_compatible", ("obj", "obj"), lambda ctx, a, b: check_compatible(a, b), group="none"),
        Target("sends_to", ("obj", "obj"), lambda ctx, a, b: sends_to(a, b), group="none"),
        Target("preset_ends", ("str", "count"), lambda ctx, n, p: preset_ends(n, page_size=p), group="none"),
        Target("PeerLayout.from_arena", ("obj",), lambda ctx, a: PeerLayout.from_arena(a), group="none"),
    ]
    # sane values for the parameters that need one to reach deeper code
    sane = {"table.extend": (lambda c: [0], lambda c: [1]), "table.truncate": (lambda c: [0], lambda c: [1]),
            "build_plan": (None, lambda c: _live_vtokens(c), None),
            "build_plan(ids)": (lambda c: _live_vtokens(c), lambda c: _live_vtokens(c), None),
            "build_receiver_half": (lambda c: _live_vtokens(c), None, None),
            "alloc.translate": (lambda c: _live_vtokens(c), None, None),
            "vector_rows": (lambda c: c.alloc.spec.end("full"), None, None),
            "build_send_plan": (lambda c: _fresh_half(c), lambda c: _seq_vtokens(c),
                                lambda c: PeerLayout.from_arena(c.alloc.arena)),
            "ReceiverHalf.from_dict": (lambda c: _fresh_half(c).to_dict(),),
            "check_compatible": (lambda c: PeerLayout.from_arena(c.alloc.arena),
                                 lambda c: PeerLayout.from_arena(c.alloc.arena)),
            "sends_to": (lambda c: PeerLayout.from_arena(c.alloc.arena), lambda c: PeerLayout.from_arena(c.alloc.arena)),
            "preset_ends": (lambda c: "qwen3-8b", lambda c: 16),
            "PeerLayout.from_arena": (lambda c: c.alloc.arena,)}
    for t in out:
        t.sane = sane.get(t.name, ())
    return out


def _backend_targets(names: list[str]) -> list[Target]:
    out: list[Target] = []
    for n in names:
        B = lambda f, n=n: (lambda ctx, *a: f(ctx.backends[n], *a))  # noqa: E731
        g = f"backend:{n}"
        out += [
            Target(f"{n}.publish_half", ("obj",), B(lambda b, h: b.publish_half(h)), group=g),
            Target(f"{n}.register", ("obj",), B(lambda b, r: b.register(r)), group=g),
            Target(f"{n}.deregister", ("obj",), B(lambda b, r: b.deregister(r)), group=g),
            Target(f"{n}.connect", ("obj",), B(lambda b, m: b.connect(m)), group=g),
            Target(f"{n}.disconnect", ("str",), B(lambda b, p: b.disconnect(p)), group=g),
            Target(f"{n}.peer_info", ("str",), B(lambda b, p: b.peer_info(p)), group=g),
            Target(f"{n}.peer_state", ("str",), B(lambda b, p: b.peer_state(p)), group=g),
            Target(f"{n}.submit", ("obj", "str"), B(lambda b, p, q: b.submit(p, q)), group=g),
            Target(f"{n}.write_descriptors", ("obj", "str"), B(lambda b, d, q: b.write_descriptors(d, q)), group=g),
            Target(f"{n}.poll", ("obj",), B(lambda b, h: b.poll(h)), group=g),
            Target(f"{n}.wait", ("obj", "seconds"), B(lambda b, h, t: b.wait(h, t)), group=g),
            Target(f"{n}.forget", ("obj",), B(lambda b, h: b.forget(h)), group=g),
            Target(f"{n}.drain", ("obj", "seconds"), B(lambda b, h, t: b.drain(h, t)), group=g),
            Target(f"{n}.set_layout", ("obj_or_none",), B(lambda b, lay: b.set_layout(lay)), group=g),
            Target(f"{n}.fail_half_if_peer_died", ("obj", "str"),
                   B(lambda b, h, p: b.fail_half_if_peer_died(h, p)), group=g),
        ]
    return out


def _integration_targets() -> list[Target]:
    """The integrations' entries that run without their engine installed (the engines' own classes are
    exercised by each integration's peer suite)."""
    from umalloc.integrations import sglang, transformers, vllm
    from umalloc.integrations.sglang.pools import SlotPool

    P = lambda f: (lambda ctx, *a: f(ctx.slotpool, *a))  # noqa: E731
    return [
        Target("vllm.id_allocator", ("count",), lambda ctx, n: vllm.id_allocator(n), group="none"),
        Target("transformers.check_version", ("str",), lambda ctx, v: transformers.check_version(v), group="none"),
        Target("sglang.check_version", ("str",), lambda ctx, v: sglang.check_version(v), group="none"),
        Target("sglang.SlotPool()", ("count", "count"), lambda ctx, n, p: SlotPool(n, p), group="none"),
        Target("sglang.SlotPool.alloc_tokens", ("count",), P(lambda pl, n: pl.alloc_tokens(n)), group="slotpool"),
        Target("sglang.SlotPool.free_tokens", ("ids",), P(lambda pl, v: pl.free_tokens(v)), group="slotpool"),
        Target("sglang.SlotPool.free_pages", ("ids",), P(lambda pl, v: pl.free_pages(v)), group="slotpool"),
        Target("sglang.SlotPool.alloc_extend", ("ids", "ids", "ids", "count"),
               P(lambda pl, a, b, c, n: pl.alloc_extend(a, b, c, n)), group="slotpool"),
        Target("sglang.SlotPool.alloc_decode", ("ids", "ids"), P(lambda pl, a, b: pl.alloc_decode(a, b)),
               group="slotpool"),
    ]


# ==== the campaign ==================================================================================================
@dataclass
class Result:
    seed: int
    counts: Counter = field(default_factory=Counter)
    per_target: dict[str, Counter] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def bad(self) -> int:
        return self.counts["untyped"] + self.counts["silent"] + self.counts["state_changed"]


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor({v.dtype}, {tuple(v.shape)}, stride={v.stride() if v.layout is torch.strided else '-'}, " \
               f"{v.device})"
    r = repr(v)
    return r if len(r) < 40 else r[:37] + "..."


def run(seed: int, rounds: int = 20, backends: list[str] | None = None) -> Result:
    """``rounds`` hostile calls per target (``backends``: engine names to include; built here, closed at the
    end). Returns the counts; nothing is printed."""
    from umalloc.backends import backend_available, get_backend

    rng = random.Random(seed)
    res = Result(seed)
    made: dict[str, Any] = {}
    names = [n for n in (backends or []) if n == "local" or backend_available(n)[0]]
    try:
        for n in names:
            made[n] = get_backend(n, layout=None)
        targets = _targets() + _backend_targets(names) + _integration_targets()
        ctx = _make_ctx(made)
        pools = {k: _pool(k) for k in ("name", "owner", "count_or_none", "obj_or_none", "ids", "count", "slot", "bool", "seconds", "out", "mapping", "str",
                                       "obj", "table")}
        for t in targets:
            per = res.per_target.setdefault(t.name, Counter())
            for _ in range(rounds):
                args, invalid = [], []
                for i, kind in enumerate(t.kinds):
                    sane = t.sane[i] if i < len(t.sane) else None
                    if sane is not None and rng.random() < 0.5:
                        args.append(sane(ctx))
                        invalid.append(False)
                        continue
                    make, bad = pools[kind][rng.randrange(len(pools[kind]))]
                    args.append(make())
                    invalid.append(bad)
                outs = [a for a in args if isinstance(a, torch.Tensor)]
                before = _snap(ctx, t.group)
                out_before = [o.clone() if o.layout is torch.strided and not o.is_meta else None for o in outs]
                try:
                    t.call(ctx, *args)
                    kind = "silent" if any(invalid) else "ok"
                except InvariantError:   # a broken invariant is a bug, not a refusal
                    kind = "untyped"
                    tb = traceback.format_exc(limit=-2)
                except UmallocError:
                    kind = "typed"
                except Exception:   # noqa: BLE001 - the campaign classifies every exception
                    kind = "untyped"
                    tb = traceback.format_exc(limit=-2)
                if kind in ("typed", "untyped"):
                    changed = not _equal(before, _snap(ctx, t.group)) or any(
                        b is not None and not torch.equal(b, o) for b, o in zip(out_before, outs, strict=True))
                    if changed:
                        kind = "state_changed"
                res.counts[kind] += 1
                per[kind] += 1
                if kind in ("untyped", "silent", "state_changed"):
                    ex = res.examples.setdefault(kind, [])
                    if len(ex) < 12:
                        detail = tb.strip().splitlines()[-1] if kind == "untyped" else ""
                        ex.append(f"{t.name}({', '.join(_describe(a) for a in args)}) {detail}")
                if t.group in ("alloc", "table", "plan"):
                    try:
                        ctx.alloc.check_invariants()
                        ctx.talloc.check_invariants()
                    except Exception:   # noqa: BLE001 - a broken invariant ends this context
                        res.counts["invariant_broken"] += 1
                        ex = res.examples.setdefault("invariant_broken", [])
                        ex.append(f"after {t.name}: {traceback.format_exc(limit=-1).strip().splitlines()[-1]}")
                        ctx = _make_ctx(made)
    finally:
        for b in made.values():
            b.close()
    return res


def report(res: Result) -> str:
    lines = [f"fuzz seed={res.seed} (override with --seed / UMALLOC_SEED): "
             + ", ".join(f"{k}={res.counts.get(k, 0)}" for k in ("ok", "typed", "untyped", "silent", "state_changed",
                                                                 "invariant_broken"))
             + f"; {len(res.per_target)} public calls"]
    for kind, ex in res.examples.items():
        lines.append(f"  {kind}:")
        lines += [f"    {e}" for e in ex]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import os

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=int(os.environ.get("UMALLOC_SEED", "2026")))
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--backends", default="local,nixl,mooncake")
    a = p.parse_args(argv)
    res = run(a.seed, a.rounds, [b for b in a.backends.split(",") if b])
    print(report(res))
    return 1 if res.bad or res.counts["invariant_broken"] else 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["Result", "main", "report", "run"]
