"""Soak of the umalloc SGLang allocator classes: the differential op streams (sglang_differential.py,
sglang_unified_differential.py) run long against SGLang's own classes, with a leak account at the end.

:func:`soak` runs ``sequences`` seeded sequences of ``ops`` ops each for one class and page size. Every op is
compared with SGLang's class as the differential does (refusals, available sizes, page layout up to a relabelling)
and umalloc's ``check_invariants()`` runs after every op. After each sequence's teardown (every request freed):
the move gate is opened and both sides flushed (unified class, lazy mode), then each side's free tokens are read
again and set against what the same allocator reported before its first op: the difference is the tokens that
side leaked (SGLang's own class is the oracle that the teardown frees everything). Needs SGLang (the peer venv of
scripts/peer_suite_sglang.sh); the short run is tests/integrations/test_sglang_soak.py, the long one
scripts/soak_sglang.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sglang_differential import Differ, Scenario, scenario_class

from umalloc.errors import InvariantError

#: the differential's ops per sequence (tests/integrations/test_integration_sglang.py); the soak runs 100x that
DIFFERENTIAL_OPS = 50
SOAK_OPS = 100 * DIFFERENTIAL_OPS


@dataclass
class SoakResult:
    """What :func:`soak` ran and found for one class and page size (tokens leaked are summed over sequences)."""

    kind: str
    page_size: int
    sequences: int = 0
    ops: int = 0
    invariant_checks: int = 0
    seconds: float = 0.0
    leaked_tokens_umalloc: int = 0
    leaked_tokens_sglang: int = 0
    failures: list[str] = field(default_factory=list)
    modes: dict[str, int] = field(default_factory=dict)

    @property
    def leaked_pages_umalloc(self) -> int:
        return -(-self.leaked_tokens_umalloc // self.page_size)

    def summary(self) -> str:
        modes = "".join(f", {k} {v}" for k, v in sorted(self.modes.items()))
        return (f"soak {self.kind} page_size={self.page_size}: {self.sequences} sequences, {self.ops} ops, "
                f"{self.seconds:.1f} s, check_invariants held {self.invariant_checks}x, "
                f"{'slots' if self.page_size == 1 else 'pages'} leaked {self.leaked_pages_umalloc} "
                f"(SGLang's class: {self.leaked_tokens_sglang} tokens), {len(self.failures)} failed{modes}")


def _free_tokens(alloc: Any) -> int:
    return int(alloc.available_size())


def _settle(sc: Scenario) -> None:
    """Open the move gate and flush both sides (unified class in lazy mode), so holes count as free."""
    if getattr(sc, "lazy", False):
        sc.gate_open = True  # type: ignore[attr-defined]
        sg, um = sc.sides
        sg.alloc.full_attn_allocator.flush_for_allocation()
        sg.alloc.swa_attn_allocator.flush_for_allocation()
        um.alloc.flush_opportunistic()


def soak(kind: str, page_size: int, sequences: int, ops: int, seed: int) -> SoakResult:
    """Run ``sequences`` sequences of ``ops`` ops of class ``kind`` (``token``, ``paged``, ``swa``, ``unified``)
    at ``page_size``; sequence ``k`` is seeded ``seed * 1_000_003 + k`` (as the differential). A sequence that
    differs from SGLang or breaks an invariant is recorded in ``failures`` and the run goes on."""
    res = SoakResult(kind, page_size)
    t0 = time.perf_counter()
    for k in range(sequences):
        s = seed * 1_000_003 + k
        sc = scenario_class(kind)(s, page_size, ops)
        sg, um = sc.sides
        before = (_free_tokens(sg.alloc), _free_tokens(um.alloc))
        checks = [0]
        check = um.alloc.check_invariants

        def counted(check: Any = check, checks: list[int] = checks) -> None:
            checks[0] += 1
            check()

        um.alloc.check_invariants = counted
        try:
            sc.run()
            _settle(sc)
            um.alloc.check_invariants()
        except (Differ, InvariantError) as exc:
            res.failures.append(f"seed {s}: {type(exc).__name__}: {exc}")
        res.leaked_tokens_sglang += before[0] - _free_tokens(sg.alloc)
        res.leaked_tokens_umalloc += before[1] - _free_tokens(um.alloc)
        res.sequences += 1
        res.ops += ops
        res.invariant_checks += checks[0]
        if hasattr(sc, "lazy"):
            mode = "lazy" if sc.lazy else "eager"
            res.modes[mode] = res.modes.get(mode, 0) + 1
    res.seconds = time.perf_counter() - t0
    return res


__all__ = ["DIFFERENTIAL_OPS", "SOAK_OPS", "SoakResult", "soak"]
