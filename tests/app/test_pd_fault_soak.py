"""PD fault soak (umalloc_replay.faults): the prefill -> decode hand-off under a killed and restarted prefill side,
a peer stalled past the lease deadlines and decode cancellations while KV is in flight. The short version runs
here; the long one is ``scripts/soak_pd_faults.py``. Seeded: ``UMALLOC_SEED`` (printed)."""

from __future__ import annotations

import pytest

from umalloc.errors import UmallocValueError
from umalloc.testing import seed_from_env
from umalloc_replay.faults import FAULTS, fault_soak, fault_table, summary


def _accounted(res, n: int) -> None:
    """Every request ends exactly one way: completed (verified), cancelled, or failed."""
    done, cancelled, failed = set(res.completed), set(res.cancelled), set(res.failed)
    assert len(done) == len(res.completed) and len(cancelled) == len(res.cancelled)
    assert not done & cancelled and not done & failed and not cancelled & failed
    assert done | cancelled | failed == set(range(n))


@pytest.mark.soak
def test_fault_soak_short() -> None:
    """Every fault kind injected and survived; completed requests identical to the pattern, lost ones retried and
    never decoded (their pages held stale bytes: decoding them would have been wrong); no page or lease left."""
    seed = seed_from_env(20261205)
    n = 600
    res = fault_soak(n, seed, p_kill=0.05, p_stall=0.05, p_cancel=0.08)
    print(summary(res))
    print(fault_table(res))
    assert res.requests == n
    _accounted(res, n)
    for k in FAULTS:
        assert res.injected[k] > 0 and res.survived[k] == res.injected[k], (k, res.injected, res.survived)
        assert res.requests_hit[k] > 0, k
    assert res.prefill_lives == res.injected["prefill_killed"] + 1
    assert res.retries == res.requests_hit["prefill_killed"] + res.requests_hit["peer_stalled"]
    assert len(res.cancelled) == res.requests_hit["decode_cancelled"]
    assert res.mismatched_pages == 0 and res.bytes_verified > 0
    assert res.stale_pages_seen > 0, "no lost request's pages held stale bytes: the check could not fail"
    assert res.failed == []     # four attempts each: no request lost four times at these rates and this seed
    assert res.leaks == {"decode_pages": 0, "decode_leases": 0, "prefill_pages": 0, "prefill_leases": 0}


def test_a_request_lost_more_than_max_attempts_is_reported_failed() -> None:
    """Prefill killed at every step, one attempt each: every request is reported failed, none decoded, nothing
    left behind."""
    res = fault_soak(12, 3, p_kill=1.0, p_stall=0.0, p_cancel=0.0, max_attempts=1)
    _accounted(res, 12)
    assert sorted(res.failed) == list(range(12)) and res.completed == [] and res.retries == 0
    assert res.bytes_verified == 0 and sum(res.leaks.values()) == 0


@pytest.mark.parametrize("kwargs", [dict(num_requests=0), dict(max_attempts=0), dict(max_batch=0),
                                    dict(p_kill=-0.1), dict(p_stall=1.5), dict(p_kill=0.6, p_cancel=0.6)])
def test_bad_arguments_are_refused(kwargs: dict) -> None:
    args = dict(num_requests=5, seed=1) | kwargs
    with pytest.raises(UmallocValueError):
        fault_soak(**args)


@pytest.mark.backend
@pytest.mark.soak
def test_remote_fault_soak_short_nixl() -> None:
    """A real prefill process (NIXL) SIGKILLed with KV in flight and restarted, decode cancellations: the lost
    requests are retried, every completed one is identical, nothing is left: no page, lease or process."""
    from umalloc.testing import require_or_skip
    from umalloc_replay.faults_remote import remote_fault_soak, remote_summary

    require_or_skip("nixl")
    seed = seed_from_env(20261205)
    res = remote_fault_soak("nixl", 40, seed, p_kill=0.2, p_cancel=0.2)
    print(remote_summary(res))
    _accounted(res, 40)
    assert res.injected["prefill_killed"] > 0 and res.injected["decode_cancelled"] > 0
    assert res.survived == res.injected
    assert len(res.children) == res.injected["prefill_killed"] + 1
    assert res.mismatched_pages == 0 and res.bytes_verified > 0
    assert all(v == 0 for v in res.leaks.values()), res.leaks
