"""The fuzz requirement: the seeded hostile-argument campaign of ``fuzz_public_calls`` over every public call
(allocator, arena, leases, request table, translators, plans, backends local / nixl / mooncake, the vLLM entry)
gives 0 untyped, 0 silent and 0 state-changed outcomes, and no broken invariant. The seed and the counts are
printed (``UMALLOC_SEED`` overrides the seed; ``python tests/fuzz/fuzz_public_calls.py`` runs it alone)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

_spec = importlib.util.spec_from_file_location("fuzz_public_calls", Path(__file__).with_name("fuzz_public_calls.py"))
assert _spec is not None and _spec.loader is not None
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)


def test_fuzz_every_public_call_gives_no_untyped_silent_or_state_changed_outcome() -> None:
    """The fuzz: 20 hostile calls per public call; every backend that runs here takes part."""
    seed = int(os.environ.get("UMALLOC_SEED", "2026"))
    res = fuzz.run(seed, rounds=20, backends=["local", "nixl", "mooncake"])
    print(fuzz.report(res))
    assert res.counts["typed"] > 0 and len(res.per_target) >= 90
    assert (res.counts["untyped"], res.counts["silent"], res.counts["state_changed"],
            res.counts["invariant_broken"]) == (0, 0, 0, 0), fuzz.report(res)
