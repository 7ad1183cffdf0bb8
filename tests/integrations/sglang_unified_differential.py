"""The unified hybrid-SWA differential: umalloc's ``UmallocUnifiedSWATokenToKVPoolAllocator`` and SGLang 0.5.23's
``UnifiedSWATokenToKVPoolAllocator`` over the same ``UnifiedKVPool`` geometry, driven by one seeded op sequence
(see tests/integrations/sglang_differential.py for the runner and the shared ops).

Each sequence draws: eager or lazy compaction, the full end growing down (SGLang's ``init_unified_swa_pools``) or
up (its peer benchmark's layout), 1-3 full layers against 1-2 SWA layers (different page bytes per end), the
buffer sized for 12-40 full and 6-40 SWA pages, and legacy capacities given or derived. Ops: batched
``alloc_extend`` (new and continuing requests), ``alloc_decode`` (not at page size 1: SGLang's decode counts no
new page there), page-aligned ``alloc``, frees of whole requests in and out of free groups (``free`` /
``free_segment`` for the window tail, ``free_full_segment`` for the evicted head), page-aligned truncation,
SWA eviction of out-of-window pages (``free_swa_segment``), and in lazy mode ``flush_opportunistic`` and the move
gate (``set_host_transfer_move_gate`` / ``set_disagg_move_gate`` with a callable the sequence opens and closes; the flush op is SGLang's urgent
flush on its side, see ``op_flush``), and the scheduler's pricing calls (``op_plan``: ``reclaim_plan``,
``can_reserve``, ``prealloc_ceiling_fits``, ``max_new_tokens_for_memory``, whose results must be equal).

Compared after every op (the equivalence):

* refusals (``None`` on one side iff on the other) and id counts;
* ``available_size``, ``full_available_size``, ``swa_available_size``, ``conserve_full/swa_available_size``;
* virtual token ids up to a relabelling of virtual pages (same tokens share a page, same offsets), and for
  each end the physical token ids of the live tokens (``translate_kv_loc`` / ``translate_loc_from_full_to_swa``)
  up to a relabelling of that end's physical pages;
* which tokens have an SWA page: exactly the tokens past each request's evicted head, on both sides;
* the KV data followed every compaction move: each side's KV pool is SGLang's ``FakeUnifiedSWAKVPool``
  (``buf[slot]`` = the virtual token stored there, ``move_physical_pages`` copies it); every token's marker is
  written at its physical slot when it is allocated and must be found at its current physical slot after every
  op, on both ends;
* umalloc's invariants (``check_invariants``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from sglang_differential import (
    Differ,
    PagedScenario,
    Side,
    check_relabelling,
    sglang_module,
    swa_evict,
    swa_free_requests,
    swa_truncate,
)

import umalloc.integrations.sglang as um_sglang

CONTEXT_READY: list[bool] = []


def prepare_unified_context() -> None:
    """SGLang's runtime context for its allocators (its fixtures' ``setup_allocator_context``) and the CPU twins
    of its unified extend/decode kernels (tests/peer/sglang_cpu_shims.py). Idempotent."""
    if not CONTEXT_READY:
        sglang_module("sglang.test.unified_allocator_fixtures").setup_allocator_context()
        import sglang_cpu_shims  # on the path now: sglang_module put tests/peer there

        sglang_cpu_shims.cpu_unified_kernels()  # SGLang's unified extend/decode launch Triton: its CPU twins
        CONTEXT_READY.append(True)


class UnifiedScenario(PagedScenario):
    """``UnifiedSWATokenToKVPoolAllocator`` against umalloc's unified class (module docstring)."""

    kind = "unified"

    def build(self) -> tuple[Side, Side]:
        prepare_unified_context()
        rng, ps = self.rng, self.page_size
        ump = sglang_module("sglang.srt.mem_cache.unified_memory_pool")
        fixtures = sglang_module("sglang.test.unified_allocator_fixtures")
        stock = sglang_module("sglang.srt.mem_cache.allocator.unified_hybrid_swa").UnifiedSWATokenToKVPoolAllocator
        self.lazy = rng.random() < 0.6
        self.window = rng.randint(1, 3 * ps + 4)
        self.evicted: dict[int, int] = {}
        self.gate_open = True
        full_grow = rng.choice(["down", "up"])
        layers = (rng.randint(1, 3), rng.randint(1, 2))
        specs = [ump.MHASubPoolSpec(name=name, layer_num=n, head_num=1, head_dim=8, store_dtype=torch.float16,
                                    grow_direction=grow)
                 for name, n, grow in (("full", layers[0], full_grow),
                                       ("swa", layers[1], "up" if full_grow == "down" else "down"))]
        full_tokens, swa_tokens = rng.randint(12, 40) * ps, rng.randint(6, 40) * ps
        total = full_tokens * specs[0].entry_bytes() + swa_tokens * specs[1].entry_bytes()
        legacy = rng.random() < 0.5
        caps = dict(full_max_total_num_tokens=full_tokens, swa_max_total_num_tokens=swa_tokens) if legacy else {}
        self.describe = (f"lazy={self.lazy} full_grow={full_grow} layers={layers} full_tokens={full_tokens} "
                         f"swa_tokens={swa_tokens} legacy={legacy} window={self.window}")
        pool = ump.UnifiedKVPool(total_bytes=total, sub_pool_specs=specs, device="cpu",
                                 enable_memory_saver=False, page_size=ps)
        sides = []
        for name, cls in (("SGLang", stock), ("umalloc", um_sglang.UmallocUnifiedSWATokenToKVPoolAllocator)):
            kv = fixtures.FakeUnifiedSWAKVPool(pool)
            alloc = cls(unified_buffer=pool, kvcache=kv, device="cpu", page_size=ps, need_sort=self.need_sort,
                        lazy_compaction=self.lazy, **caps)
            side = Side(name, alloc)
            side.kv = kv  # type: ignore[attr-defined]
            sides.append(side)
        if self.lazy:
            setter = rng.choice(["set_host_transfer_move_gate", "set_disagg_move_gate"])
            for side in sides:
                getattr(side.alloc, setter)(lambda: self.gate_open)
        return sides[0], sides[1]

    @property
    def ops(self) -> list[Callable[[], None]]:
        ops = [self.op_extend, self.op_extend, self.op_alloc, self.op_free, self.op_truncate, self.op_evict,
               self.op_evict, self.op_plan]
        if self.page_size > 1:
            ops += [self.op_decode, self.op_decode, self.op_decode]
        if self.lazy:
            ops += [self.op_flush, self.op_gate]
        return ops

    # ---- ops ------------------------------------------------------------------------------------------------
    def both(self, call: Callable[[Side], Any], what: str) -> list[Any]:
        out = super().both(call, what)
        self.stats["refused, gate closed"] += out[0] is None and self.lazy and not self.gate_open
        if out[0] is not None:
            for side, t in zip(self.sides, out, strict=True):
                self._stamp(side, t.to(torch.int64))
        return out

    def _stamp(self, side: Side, tokens: torch.Tensor) -> None:
        if tokens.numel() == 0:
            return
        kv = side.kv  # type: ignore[attr-defined]
        kv.full_kv_pool.buf[side.alloc.translate_kv_loc(tokens)] = tokens
        bound = self._bound(side, tokens)
        if bool(bound.any()):
            kv.swa_kv_pool.buf[side.alloc.translate_loc_from_full_to_swa(tokens[bound])] = tokens[bound]

    def _bound(self, side: Side, tokens: torch.Tensor) -> torch.Tensor:
        if side.name == "umalloc":
            return side.alloc.swa_bound(tokens)
        return side.alloc.swa_attn_allocator.virtual_to_physical[tokens // self.page_size] > 0

    def op_alloc(self) -> None:
        ps = self.page_size
        n = ps * self.rng.randint(0, 4)
        got = self.both(lambda s: s.alloc.alloc(n), f"alloc({n})")
        if got[0] is None or got[0].numel() == 0:
            return
        self._append([self.new_rid()], [got[0].numel()], got)

    def op_evict(self) -> None:
        swa_evict(self)

    def op_plan(self) -> None:
        """The scheduler's pricing calls, none of which changes state: ``reclaim_plan`` (with evictable counts,
        ``empty_pool``, ``prefer_swa``), ``can_reserve`` (with ``require_token_slack``), ``prealloc_ceiling_fits``
        and ``max_new_tokens_for_memory``, with demands from negative through past the pool (and fractional)."""
        rng, ps = self.rng, self.page_size
        cap = 44 * ps
        avail = self.sides[0].alloc.available_size()

        def demand() -> float:  # mostly near what fits now, where eviction decides
            kind = rng.random()
            if kind < 0.05:
                return -1
            n = rng.randint(0, cap) if kind < 0.35 else max(0, avail + rng.randint(-4 * ps, 16 * ps))
            return n + 0.5 if rng.random() < 0.2 else n

        for _ in range(3):
            full = demand()
            self._plan_once(full, demand() if rng.random() < 0.9 else full, cap)
        args = dict(input_tokens=rng.randint(0, cap), max_new_tokens=rng.randint(0, cap), token_capacity=cap,
                    sliding_window_size=rng.choice([None, 0, self.window, rng.randint(1, cap)]),
                    chunk_size=rng.choice([None, rng.randint(1, cap)]))
        got = self.both_same(lambda s: s.alloc.max_new_tokens_for_memory(**args),
                             f"max_new_tokens_for_memory({args})")
        self.stats["max_new_tokens capped"] += got is not None and got < args["max_new_tokens"]
        self.both_same(lambda s: s.alloc.swa_capacity_and_available(full_capacity=cap, swa_capacity=cap),
                       "swa_capacity_and_available")
        n = rng.randint(1, 4)
        prefix = torch.tensor([rng.randint(0, cap) for _ in range(n)])
        seq = prefix + torch.tensor([rng.randint(0, 3 * ps) for _ in range(n)])
        shard = rng.choice([1, 1, 1, 2])
        got = self.both_same(lambda s: s.alloc.get_extend_allocation_demand(
            prefix, seq, conservative_num_tokens=cap, shard_size=shard),
            f"get_extend_allocation_demand({prefix.tolist()}, {seq.tolist()}, shard_size={shard})")
        self.stats["extend demands"] += got > 0

    def _plan_once(self, full: float, swa: float, cap: int) -> None:
        rng, ps = self.rng, self.page_size
        kw: dict[str, Any] = dict(full_evictable_tokens=rng.randint(-ps, cap),
                                  swa_evictable_tokens=rng.randint(-ps, cap), empty_pool=rng.random() < 0.2)
        prefer = rng.random() < 0.4
        plan = self.both_same(lambda s: s.alloc.reclaim_plan(full, swa, prefer_swa=prefer, **kw),
                              f"reclaim_plan({full}, {swa}, prefer_swa={prefer}, {kw})")
        self.stats["plans refused"] += plan is None
        self.stats["plans evicting"] += plan not in (None, (0, 0))
        slack = rng.random() < 0.5
        self.both_same(lambda s: s.alloc.can_reserve(full, swa, require_token_slack=slack, **kw),
                       f"can_reserve({full}, {swa}, slack={slack}, {kw})")
        self.both_same(lambda s: s.alloc.prealloc_ceiling_fits(full, swa), f"prealloc_ceiling_fits({full}, {swa})")

    def both_same(self, call: Callable[[Side], Any], what: str) -> Any:
        """``call`` on both sides; raises Differ unless the results are equal. Returns SGLang's."""
        a, b = (call(side) for side in self.sides)
        if a != b:
            raise Differ(f"{what} [{self.describe}]: SGLang {a!r} vs umalloc {b!r}")
        return a

    def op_flush(self) -> None:
        """umalloc's ``flush_opportunistic`` against SGLang's urgent flush of both sub-pools (the pass its
        ``ensure_capacity`` runs): both pack every live page and return all holes to the gap. SGLang's own
        non-urgent pass leaves the moved pages' sources as holes until its next flush (docs/engines.md, "SGLang")."""
        sg, um = self.sides
        if not sg.alloc.full_attn_allocator.moves_blocked():
            sg.alloc.full_attn_allocator.flush_for_allocation()
            sg.alloc.swa_attn_allocator.flush_for_allocation()
        um.alloc.flush_opportunistic()
        self.stats["flushes"] += 1

    def op_gate(self) -> None:
        self.gate_open = not self.gate_open
        self.stats["gate closed"] += not self.gate_open

    def free_requests(self, rids: list[int], grouped: bool) -> None:
        # drawn once per request: both sides free it the same way
        plain = {rid: self.rng.random() < 0.5 for rid in rids}
        swa_free_requests(self, rids, grouped, lambda rid, done: plain[rid])

    def op_truncate(self) -> None:
        swa_truncate(self)

    # ---- the comparison ------------------------------------------------------------------------------------
    def compare(self, what: str) -> None:
        what = f"{what} [{self.describe}]"
        sg, um = self.sides
        for name in ("available_size", "full_available_size", "swa_available_size",
                     "conserve_full_available_size", "conserve_swa_available_size"):
            a, b = getattr(sg.alloc, name)(), getattr(um.alloc, name)()
            if a != b:
                raise Differ(f"{what}: {name} {a} vs {b}")
        check_relabelling(sg.rows, um.rows, self.page_size, f"{what} (virtual ids)")
        phys: list[list[dict[int, torch.Tensor]]] = [[{}, {}], [{}, {}]]
        rids = sorted(sg.rows)
        if rids:  # all live tokens of a side in one batch: one translate and one KV read per end
            lens = [sg.rows[r].numel() for r in rids]
            done = torch.cat([torch.arange(n) >= self.evicted.get(r, 0) for r, n in zip(rids, lens, strict=True)])
            for i, side in enumerate(self.sides):
                kv = side.kv  # type: ignore[attr-defined]
                row = torch.cat([side.rows[r] for r in rids])
                bound = self._bound(side, row)
                if not torch.equal(bound, done):
                    raise Differ(f"{what}: {side.name}: SWA pages not exactly past each request's evicted head")
                full = side.alloc.translate_kv_loc(row)
                if not torch.equal(kv.full_kv_pool.buf[full], row):
                    raise Differ(f"{what}: {side.name}: full KV did not follow the page moves")
                swa = torch.zeros_like(row)
                swa[done] = side.alloc.translate_loc_from_full_to_swa(row[done])
                if not torch.equal(kv.swa_kv_pool.buf[swa[done]], row[done]):
                    raise Differ(f"{what}: {side.name}: SWA KV did not follow the page moves")
                for r, f, w, d in zip(rids, torch.split(full, lens), torch.split(swa, lens),
                                      torch.split(done, lens), strict=True):
                    phys[i][0][r], phys[i][1][r] = f, w[d]
        check_relabelling(phys[0][0], phys[1][0], self.page_size, f"{what} (full physical)")
        check_relabelling(phys[0][1], phys[1][1], self.page_size, f"{what} (SWA physical)")
        um.alloc.check_invariants()

    def teardown(self) -> None:
        super().teardown()
        self.stats["pages moved (umalloc)"] += self.sides[1].alloc.pages_moved
        self.stats["lazy"] += self.lazy


__all__ = ["UnifiedScenario", "prepare_unified_context"]
