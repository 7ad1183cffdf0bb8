"""Re-check of the bad-input classes of issue 26 items 19, 20 and 21: each case must raise a UmallocError and
change nothing it snapshots. Run: ``PYTHONPATH=$PWD .venv/bin/python scripts/check_issue26_inputs.py`` (exit 1 on
any untyped, silent or state-changing case)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from umalloc import build_receiver_half
from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.allocator.observe import snapshots_equal
from umalloc.backends import get_backend
from umalloc.errors import InvariantError, UmallocError
from umalloc.geometry.arena import Arena
from umalloc.leases.table import LeaseTable
from umalloc.requests.table import RequestTable
from umalloc.testing import tiny_spec
from umalloc.transfer.build import build_plan
from umalloc.transfer.rows import vector_rows
from umalloc.translators import get_translator

RESULTS: list[tuple[str, ...]] = []


def _eq(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b, strict=True))
    return snapshots_equal(a, b)


def case(name: str, fn: Callable[[], object], snap: Callable[[], object] = lambda: None) -> None:
    before = snap()
    try:
        fn()
    except InvariantError as e:  # a broken invariant is a bug, not a refusal
        RESULTS.append((name, "INVARIANT", type(e).__name__, str(e)[:60]))
    except UmallocError as e:
        RESULTS.append((name, "typed" if _eq(before, snap()) else "STATE-CHANGED", type(e).__name__))
    except Exception as e:  # noqa: BLE001 - the check classifies every exception
        RESULTS.append((name, "UNTYPED", type(e).__name__, str(e)[:60]))
    else:
        RESULTS.append((name, "SILENT"))


def item19() -> None:
    alloc = MultiEndedAllocator(Arena(tiny_spec(4096)))
    t = RequestTable(alloc, max_requests=4, max_tokens_per_request=64)
    s = t.new_requests(1)
    t.extend(s, torch.tensor([20]))

    def snap() -> object:
        return (alloc.snapshot(), t.snapshot())

    case("19 extend 2**63-1", lambda: t.extend(s, [2**63 - 1]), snap)
    case("19 tokens float slot", lambda: t.tokens(torch.tensor(0.7)), snap)
    case("19 pages float slot", lambda: t.pages(torch.tensor([0.7])), snap)
    for m in ("fork", "tokens", "pages"):
        case(f"19 {m} 2**63", lambda m=m: getattr(t, m)(2**63), snap)
    case("19 RequestTable(max_requests=2**40)",
         lambda: RequestTable(alloc, max_requests=2**40, max_tokens_per_request=4), snap)


def item20() -> None:
    ar = Arena(tiny_spec())
    for m in ("end", "page_bytes", "first_page", "top_page", "envelopes", "region_member"):
        case(f"20 Arena.{m}(['full'])", lambda m=m: getattr(ar, m)(["full"]), lambda: ar.data.clone())
    lt = LeaseTable({"full": 8})

    def lsnap() -> object:
        return (len(lt), lt.pin_count("full").copy())

    case("20 LeaseTable.expire('soon')", lambda: lt.expire("soon"), lsnap)
    case("20 LeaseTable(2**40)", lambda: LeaseTable({"full": 2**40}))
    case("20 is_pinned out of range", lambda: lt.is_pinned("full", [99]), lsnap)
    case("20 clock returns str", lambda: LeaseTable({"full": 8}, clock=lambda: "now").pin({"full": [1]},
                                                                                        deadline_s=1.0))
    case("20 Arena(device='cuda')", lambda: Arena(tiny_spec(), device="cuda"))
    case("20 mirror='cuda'", lambda: MultiEndedAllocator(Arena(tiny_spec()), mirror_device="cuda"))
    case("20 mirror='bogus'", lambda: MultiEndedAllocator(Arena(tiny_spec()), mirror_device="bogus"))
    case("20 pin_memory=True", lambda: Arena(tiny_spec(), pin_memory=True))
    a2 = MultiEndedAllocator(Arena(tiny_spec(640)))
    vp = a2.alloc_pages(2)
    ps = a2.spec.end("full").page_size
    seq = (vp[:, None] * ps + torch.arange(ps)).reshape(-1)
    case("20 expanded out=", lambda: a2.translate_pages(vp, "full", out=torch.zeros(1, dtype=torch.int64).expand(2)),
         a2.snapshot)
    case("20 build_plan(object())", lambda: build_plan("r", object(), seq, a2, seq), a2.snapshot)
    case("20 vector_rows(None)", lambda: vector_rows(None, 4, 0))
    for impl in ("reference", "cpu"):
        case(f"20 v2p 2**62 ({impl}, num_physical_pages)",
             lambda impl=impl: get_translator(impl=impl).virtual_to_physical_pages(
                 torch.tensor([1]), torch.tensor([0, 2**62]), num_physical_pages=8))
    case("20 overlapping destinations", lambda: build_plan("r", a2, seq, a2, torch.cat([seq[:ps], seq[:ps]])),
         a2.snapshot)


def item21() -> None:
    alloc = MultiEndedAllocator(Arena(tiny_spec(640)))
    vp = alloc.alloc_pages(2)
    ps = alloc.spec.end("full").page_size
    seq = (vp[:, None] * ps + torch.arange(ps)).reshape(-1)
    for n in ("local", "nixl", "mooncake"):
        try:
            b = get_backend(n)
        except UmallocError as e:
            RESULTS.append((f"21 {n}", "skip", type(e).__name__))
            continue

        def bsnap(b: Any = b) -> object:
            return (b.stats(), b.published_halves())

        for bad in (None, "x", {"a": 1}):
            case(f"21 {n}.publish_half({bad!r})", lambda b=b, bad=bad: b.publish_half(bad), bsnap)
        lease = alloc.lease({"full": vp[:1]})
        case(f"21 {n}.publish_half(Lease)", lambda b=b, lease=lease: b.publish_half(lease), bsnap)
        lease.release()
        half = build_receiver_half("h", alloc, seq)
        case(f"21 {n}.publish_half(unregistered memory)", lambda b=b, half=half: b.publish_half(half), bsnap)
        half.abort()
        b.close()


def main() -> int:
    item19()
    item20()
    item21()
    for r in RESULTS:
        print(*r)
    bad = [r for r in RESULTS if r[1] not in ("typed", "skip")]
    print(f"bad {len(bad)} of {len(RESULTS)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
