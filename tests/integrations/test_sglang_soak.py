"""The short soak of the umalloc SGLang allocator classes (tests/integrations/sglang_soak.py): long differential op
streams against SGLang's own classes, ``check_invariants()`` after every op, nothing leaked at the end. Runs in
the SGLang peer suite (scripts/peer_suite_sglang.sh; skips without SGLang); the long run is
``scripts/soak_sglang.py``. Seeded: ``UMALLOC_SEED`` (printed)."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("sglang")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peer"))

import sglang_cpu_shims  # noqa: E402

sglang_cpu_shims.prepare()  # before any SGLang allocator module is imported

from sglang_differential import SCENARIOS, TokenScenario  # noqa: E402
from sglang_soak import DIFFERENTIAL_OPS, soak  # noqa: E402

SEED = int(os.environ.get("UMALLOC_SEED", "38"))
#: the short run: one sequence 20x the differential's length per case (the script runs 100x, many sequences)
OPS = int(os.environ.get("UMALLOC_SGLANG_SOAK_OPS", str(20 * DIFFERENTIAL_OPS)))
CASES = [("token", 1), ("paged", 16), ("swa", 16), ("unified", 1), ("unified", 16)]


@pytest.mark.soak
@pytest.mark.parametrize(("kind", "page_size"), CASES, ids=[f"{k}-ps{p}" for k, p in CASES])
def test_soak_short_leaks_nothing_and_matches_sglang(kind: str, page_size: int) -> None:
    print(f"\nseed={SEED} (override with UMALLOC_SEED)")
    res = soak(kind, page_size, 1, OPS, SEED)
    print(res.summary())
    assert not res.failures, res.failures
    assert res.ops == OPS and res.invariant_checks >= OPS + 1  # after every op and after the teardown
    assert res.leaked_tokens_sglang == 0  # the oracle: SGLang's class got every token back
    assert res.leaked_tokens_umalloc == 0


class _LeaksOneSlot(TokenScenario):
    """The token scenario with one slot taken on the umalloc side after the teardown freed everything."""

    def teardown(self) -> None:
        super().teardown()
        self.sides[1].alloc.alloc(1)


@pytest.mark.soak
def test_soak_counts_a_leaked_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SCENARIOS, "token-leak", _LeaksOneSlot)
    res = soak("token-leak", 1, 2, 20, SEED)
    assert res.leaked_tokens_umalloc == 2 and res.leaked_pages_umalloc == 2  # one slot per sequence
    assert res.leaked_tokens_sglang == 0
    assert len(res.failures) == 2 and all("available" in f for f in res.failures)  # the teardown check saw it
