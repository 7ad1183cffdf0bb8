"""The prefill side of the replay, and the sequence helpers both sides use.

* :class:`LocalPrefill`: the prefill arena, its allocator and a ``local`` backend pair in this process (the
  embedded default). :class:`umalloc_replay.single.remote.RemotePrefill` is the same side in a second process.
* Both expose one small interface to the driver: ``start(request, decode vtokens) -> ticket | None`` (allocate,
  fill, plan with leases on both sides, submit; ``None`` when the prefill arena is short and nothing changed),
  ``finish_all(tickets) -> [PlanFigures]`` (wait for every transfer of the step and release its plan's leases, then
  free the prefill pages), and observers (``stats``, ``leases_active``, ``lease_counts``, ``check_invariants``,
  ``bytes_filled``), ``close``.

Note [Finishing a step's transfers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A step's transfers all finish before any of their prompts is freed. Freed one by one instead (wait, forget,
free, next), a prompt is freed while the later transfers of the step still pin prefill pages, and eager
compaction, which never moves a pinned page, does less — by backend: Mooncake's plans finish in ``wait`` (the
caller's thread), NIXL's and the local backend's earlier (on completion), so with the same input the prefill
side of a Mooncake replay compacted 0 times where NIXL and local compacted 5-25 times. Finishing every plan first
gives every backend the same pins at each free, so the same compactions.
* :func:`alloc_sequence` and :func:`fill_sequence` are the one way a fresh sequence is allocated and filled,
  on the prefill side and for decode's preallocation (Note [Sequence placement]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from umalloc import (
    Arena,
    ArenaSpec,
    EndRole,
    InvariantError,
    MultiEndedAllocator,
    PeerLayout,
    WriteGate,
    build_plan,
)
from umalloc.geometry.spec import pages_for_tokens
from umalloc_replay.report import PhaseTimer
from umalloc_replay.workload import RequestState, first_kept_page, pages_held

# ==== sequence helpers (both sides) =============================================================================
#
# Note [Sequence placement]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# An empty float end (the draft, between the full end growing up and the SWA end growing down) is placed when it
# next allocates, in the middle of the gap its present neighbours leave. Binding it in one call and the SWA end
# in a later call (alloc_extend(bind=[draft]) then bind_end(swa)) can leave the SWA end too little room in an
# empty arena even though the joint need fits (can_alloc plans all ends at once). So a sequence is allocated in
# calls that each bind every end they need: the SWA window tail together with the full and draft ends, then
# the head without the SWA ends.


def swa_ends(spec: ArenaSpec) -> list[str]:
    return [e.name for e in spec.ends if e.role is EndRole.SWA and e.window_tokens is not None and not e.is_owner]


def alloc_sequence(alloc: MultiEndedAllocator, num_tokens: int) -> torch.Tensor | None:
    """Allocate a fresh sequence of ``num_tokens`` tokens: every end of the owner for the whole sequence, except
    SWA ends, which get only their own window tail. ``None`` (nothing changed) if an arena is short.

    Placement (Note [Sequence placement]): one ``alloc_extend`` binding every end when the whole sequence is
    inside every window; otherwise the sequence is cut at each SWA end's first kept page (``f_1 < f_2 < ...``,
    several when SWA ends have different windows, e.g. the target's and the drafter's) and allocated from the
    tail: ``alloc_pages`` binding every end for ``[f_k, n)``, then each segment ``[f_{i-1}, f_i)`` binding the
    ends that keep it (``bind=`` without the SWA ends whose tail starts later), the head ``[0, f_1)`` without
    any SWA end. Each call is one joint placement over every end it binds, so an empty ``float`` end (the draft)
    is placed knowing what the SWA ends need. O(ends + pages).

    Returns: int64 ``(num_tokens,)`` virtual token ids (token ``i`` at offset ``i % page_size`` of its page).
    """
    spec = alloc.spec
    swa = swa_ends(spec)
    need = {e.name: pages_held(spec, e.name, num_tokens) for e in spec.ends}
    if not alloc.can_alloc(need):
        return None
    owner = spec.end(spec.owner_of(spec.ends[0].name))
    ps = owner.page_size
    first = {e: first_kept_page(spec, e, num_tokens) for e in swa}
    if max(first.values(), default=0) == 0:
        z = torch.zeros(1, dtype=torch.int64)
        vt = alloc.alloc_extend(z, torch.tensor([num_tokens], dtype=torch.int64), torch.tensor([-1]))
        return None if vt is None else vt.clone()
    n_pages = pages_for_tokens(num_tokens, ps)
    cuts = sorted({0, *first.values()})             # segment starts, head first
    bounds = [*cuts, n_pages]
    others = [e.name for e in spec.ends if not e.is_owner and e.name not in swa]
    parts: list[torch.Tensor] = []
    for k in range(len(cuts) - 1, -1, -1):           # the tail (every end bound) first
        lo, hi = bounds[k], bounds[k + 1]
        if hi <= lo:
            continue
        bind = None if k == len(cuts) - 1 else others + [e for e in swa if first[e] <= lo]
        got = alloc.alloc_pages(hi - lo) if bind is None else alloc.alloc_pages(hi - lo, bind=bind)
        if got is None:
            for p in parts:
                alloc.free(p * ps)
            return None
        parts.append(got)
    vpages = torch.cat(parts[::-1])
    return (vpages[:, None] * ps + torch.arange(ps, dtype=torch.int64)[None, :]).reshape(-1)[:num_tokens].clone()


def warm_up(alloc: MultiEndedAllocator) -> None:
    """Run each allocator path the replay uses once on an empty allocator (numba kernels load or compile now,
    not inside the first timed request), leaving it empty again."""
    spec = alloc.spec
    ps = spec.end(spec.owner_of(spec.ends[0].name)).page_size
    vp = alloc.alloc_pages(1)
    if vp is not None:
        alloc.free(vp * ps)
    vt = alloc.alloc_extend(torch.zeros(1, dtype=torch.int64), torch.tensor([1]), torch.tensor([-1]))
    if vt is not None:
        nxt = alloc.alloc_decode(torch.tensor([2]), vt[-1:])
        alloc.free(vt if nxt is None else torch.cat([vt, nxt]))


def _seq_pages(spec: ArenaSpec, end: str, seq_len: int, lo_page: int) -> np.ndarray:
    return np.arange(lo_page, pages_for_tokens(seq_len, spec.end(end).page_size), dtype=np.int64)


def fill_sequence(alloc: MultiEndedAllocator, pattern: PagePattern, rid: int, vt: torch.Tensor, seq_len: int) -> int:
    """Fill every page a fresh sequence holds on every end (whole pages); returns bytes written."""
    spec = alloc.spec
    total = 0
    for e in spec.ends:
        ps = e.page_size
        sp = _seq_pages(spec, e.name, seq_len, first_kept_page(spec, e.name, seq_len))
        vpages = torch.div(vt[torch.from_numpy(sp * ps)], ps, rounding_mode="floor")
        total += pattern.fill_pages(alloc.arena, e.name, rid, sp, alloc.translate_pages(vpages, e.name))
    return total



# ==== the local prefill side ============================================================================


class PagePattern(Protocol):
    """What fills a prefill side's pages: :class:`~umalloc_replay.single.kvfill.KVPattern` (the replay's keyed
    pattern) or a model's KV writer (``umalloc generate``)."""

    def fill_pages(self, arena: Arena, end: str, request_id: int, seq_pages: torch.Tensor | np.ndarray,
                   ppages: torch.Tensor | np.ndarray) -> int: ...


@dataclass
class PlanFigures:
    """What one transfer moved: bytes per vector, descriptors, runs, the per-layer-per-page equivalent."""

    bytes_total: int
    bytes_by_vector: dict[str, int]
    descriptors: int
    runs: int
    per_layer_per_page: int


@dataclass
class Arrival:
    """A request whose asynchronous start finished (its transfer done, both sides' leases of it released):
    ``figures`` of its plan (``None``: the prefill arena was short, nothing was sent and nothing changed) and
    ``extra``, what the prefill side attached (``umalloc generate``: the prefill's first token and digests)."""

    request_id: int
    figures: PlanFigures | None
    extra: object = None


class LocalPrefill:
    """The prefill side in this process: its arena, allocator, pattern, and a local backend pair.

    ``start`` allocates, fills, plans (leasing both sides) and submits — through ``gate`` when given (a
    :class:`~umalloc.WriteGate`: the submission waits until every producer of the plan's vectors signalled);
    ``finish_all`` waits, frees the prefill pages and returns the plan's figures. Both sides' allocators are used from this one thread.
    """

    name = "local"

    def __init__(self, spec: ArenaSpec, pattern: PagePattern, decode: MultiEndedAllocator, timer: PhaseTimer,
                 *, compaction: str, transfer_timeout_s: float, lease_deadline_s: float | None,
                 gate: WriteGate | None = None) -> None:
        from umalloc import get_backend

        self.arena = Arena(spec, zero=False)  # every byte read back is written first
        self.alloc = MultiEndedAllocator(self.arena, compaction=compaction)
        warm_up(self.alloc)
        self.pattern = pattern
        self.decode = decode
        self.timer = timer
        self.timeout_s = transfer_timeout_s
        self.deadline_s = lease_deadline_s
        self.src_layout = PeerLayout.from_arena(self.arena)
        self.dst_layout = PeerLayout.from_arena(decode.arena)
        self.src = get_backend("local", layout=self.src_layout)
        self.dst = get_backend("local", layout=self.dst_layout)
        self.src.register(self.arena.regions())
        self.dst.register(decode.arena.regions())
        self.peer = self.src.connect(self.dst.metadata())
        self.bytes_filled = 0
        self.max_leases = 0  # most leases (both sides) held at once, over the run
        self.step_leases = 0  # the same since the driver last reset it
        self.gate = gate

    def start(self, rs: RequestState, dst_vtokens: torch.Tensor | dict[str, torch.Tensor]) -> object | None:
        """Prefill ``rs`` and submit its plan (``dst_vtokens``: decode's virtual token ids, per end where they differ); ``None`` if the prefill arena is short (nothing changed)."""
        L = rs.req.input_tokens
        with self.timer.phase("allocator"):
            vt = alloc_sequence(self.alloc, L)
        if vt is None:
            return None
        with self.timer.phase("fill"):
            self.bytes_filled += fill_sequence(self.alloc, self.pattern, rs.rid, vt, L)
        with self.timer.phase("translate_plan"):
            try:
                plan = build_plan(str(rs.rid), self.alloc, vt, self.decode, dst_vtokens,
                                  src_layout=self.src_layout, dst_layout=self.dst_layout,
                                  deadline_s=self.deadline_s)
            except BaseException:
                with self.timer.phase("allocator"):
                    self.alloc.free(vt)
                raise
        # both sides' leases are held from here until the handle is terminal
        held = self.alloc.leases_active() + self.decode.leases_active()
        self.max_leases = max(self.max_leases, held)
        self.step_leases = max(self.step_leases, held)
        ticket: list = [plan, None, vt]

        def submit() -> object:
            with self.timer.phase("transfer"):
                ticket[1] = self.src.submit(plan, self.peer)
            return ticket[1]

        if self.gate is None:
            submit()
        else:  # posted once every producer of the plan's vectors signalled (maybe later, by their signal)
            self.gate.post(plan, submit)
        return ticket

    def finish_all(self, tickets: list) -> list[PlanFigures]:
        """Wait for every transfer of ``tickets`` and forget it (its plan's leases are released with it), then free every
        prompt (Note [Finishing a step's transfers]); the plans' figures, in order. A failure is raised (the
        first) once every handle was forgotten and every prompt freed."""
        first: BaseException | None = None
        try:
            with self.timer.phase("transfer"):
                for plan, handle, _vt in tickets:
                    if handle is None:  # its post still waits at the gate: never sent
                        first = first or InvariantError(f"request {plan.request_id}: finished while its post waits "
                                                        "for a producer at the write gate")
                        continue
                    try:
                        self.src.wait(handle, self.timeout_s)
                    except BaseException as exc:
                        first = first or exc
                    finally:
                        self.src.forget(handle)
        finally:
            # also when a transfer failed: the prompts' pages are freed (still-leased ones go pending until their
            # plan's leases are released, Note [Pending pages]), never leaked
            with self.timer.phase("allocator"):
                for _plan, _handle, vt in tickets:
                    self.alloc.free(vt)
        if first is not None:
            raise first
        return [PlanFigures(plan.total_bytes, {n: s.bytes for n, s in plan.stats_by_vector.items()},
                            plan.num_descriptors, plan.num_runs, plan.per_layer_descriptor_equivalent)
                for plan, _h, _vt in tickets]

    # ---- observers (the replay reads the prefill side only through these) -----------------------------------
    def stats(self) -> dict:
        """:meth:`MultiEndedAllocator.stats` of the prefill allocator."""
        return self.alloc.stats()

    def leases_active(self) -> int:
        return self.alloc.leases_active()

    def lease_counts(self) -> dict[str, int]:
        t = self.alloc.lease_table
        return {"leases_taken": t.leases_taken, "leases_expired": t.leases_expired,
                "leases_in_doubt": t.leases_in_doubt}

    def check_invariants(self) -> None:
        self.alloc.check_invariants()
        self.src.check_invariants()
        self.dst.check_invariants()

    def close(self, *, interrupted: bool = False) -> None:
        """Close both backends (idempotent); ``interrupted`` changes nothing here (no second process)."""
        self.src.close()
        self.dst.close()



__all__ = ["Arrival", "LocalPrefill", "PagePattern", "PlanFigures", "alloc_sequence", "fill_sequence", "swa_ends", "warm_up"]
