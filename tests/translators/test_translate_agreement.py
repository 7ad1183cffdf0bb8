"""Conformance: every translator implementation and the allocator's own ``translate`` / ``translate_pages``
agree on real allocator tables with tombstones (freed pages, pages released on a bound end), strict and not.

Tables come from seeded random allocator histories (the seed is printed; override with ``UMALLOC_SEED``).
The expected values are the allocator's answers and a brute-force loop over its v2p table; errors must agree
in type (out of range -> InvalidIdError in every mode, a tombstone in strict mode -> TombstoneError; in a
batch with both, every implementation reports the range error; the allocator calls the cpu translator).
The cpu translator is also called exactly as a host fast path would: the numpy v2p master and an ``out=``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.errors import InvalidIdError, TombstoneError
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, LayerSpec
from umalloc.testing import seed_from_env
from umalloc.translators import cpu as cpu_impl
from umalloc.translators import cuda as cuda_impl
from umalloc.translators import reference as ref_impl

IMPLS = [
    pytest.param(ref_impl, "cpu", id="reference"),
    pytest.param(cpu_impl, "cpu", id="cpu"),
    pytest.param(cuda_impl, "cuda", id="cuda",
                 marks=pytest.mark.skipif(not cuda_impl.available(),
                                          reason=f"cuda translator: {cuda_impl.unavailable_reason()}")),
]


def full_swa_spec(page_size: int) -> ArenaSpec:
    """full (up, owner) + swa (down, bound, window two pages), 63 full pages' bytes past the floor."""
    full = EndSpec("full", (LayerSpec.mha(1, 4),), page_size=page_size)
    swa = EndSpec("swa", (LayerSpec.mha(1, 2, window_tokens=2 * page_size),), page_size=page_size,
                  grow=Grow.DOWN, owner="full", role=EndRole.SWA)
    return ArenaSpec((full, swa), arena_bytes=full.page_bytes * 64)


def random_history(alloc: MultiEndedAllocator, rng: np.random.Generator) -> None:
    """Allocate, free and release on the bound end at random, so both tables hold live pages and tombstones."""
    live: list[int] = []
    bound: set[int] = set()
    for _ in range(40):
        op = rng.integers(3)
        if op == 0 or not live:
            got = alloc.alloc_pages(int(rng.integers(1, 4)))
            if got is not None:
                live += got.tolist()
                bound |= set(got.tolist())
        elif op == 1:
            k = int(rng.integers(1, len(live) + 1))
            pick = rng.choice(live, size=k, replace=False).tolist()
            alloc.free_pages(torch.tensor(pick))
            live = [p for p in live if p not in pick]
            bound -= set(pick)
        elif bound:
            pick = rng.choice(sorted(bound), size=int(rng.integers(1, len(bound) + 1)), replace=False).tolist()
            alloc.unbind_pages("swa", torch.tensor(pick))
            bound -= set(pick)
    alloc.check_invariants()


def brute_force(vtokens: list[int], v2p: list[int], ps: int) -> list[int]:
    return [(max(v2p[t // ps], 0)) * ps + t % ps for t in vtokens]


def outcome(fn, *args, **kwargs):
    try:
        return "ok", fn(*args, **kwargs).cpu().tolist()
    except TombstoneError:
        return "tombstone", None
    except InvalidIdError:
        return "range", None


@pytest.mark.parametrize(("impl", "device"), IMPLS)
@pytest.mark.parametrize("page_size", [2, 3])
def test_translators_agree_with_the_allocator(make_allocator, impl, device, page_size):
    seed = seed_from_env(20261201) + page_size
    rng = np.random.default_rng(seed)
    for _ in range(5):
        alloc = make_allocator(full_swa_spec(page_size))
        random_history(alloc, rng)
        nv = alloc.num_vpages()
        for end in ("full", "swa"):
            v2p_host = alloc.v2p(end).numpy().copy()
            assert (v2p_host < 0).any(), "the history must leave tombstones"
            v2p_dev = torch.from_numpy(v2p_host).to(device)
            for strict in (False, True):
                for _ in range(8):
                    n = int(rng.integers(0, 12))
                    vt = rng.integers(-1, nv * page_size + 1 if rng.random() < 0.2 else nv * page_size, size=n)
                    vp = vt // page_size if rng.random() < 0.5 else vt
                    for ids, pages in ((vt, False), (vp, True)):
                        ids_t = torch.from_numpy(ids.astype(np.int64))
                        ids_d = ids_t.to(device)
                        if pages:
                            want = outcome(alloc.translate_pages, ids_t, end, strict=strict)
                            got = outcome(impl.virtual_to_physical_pages, ids_d, v2p_dev, strict=strict)
                        else:
                            want = outcome(alloc.translate, ids_t, end, strict=strict)
                            got = outcome(impl.virtual_to_physical, ids_d, v2p_dev, page_size, strict=strict)
                        limit = nv if pages else nv * page_size
                        if ((ids < 0) | (ids >= limit)).any():
                            # documented translator order: range errors first, over the whole batch; the
                            # allocator's kernel raises at the first bad position (a tombstone may come first)
                            assert got[0] == "range" and want[0] in ("range", "tombstone"), ids.tolist()
                            want = got
                        assert got == want, (end, strict, pages, ids.tolist())
                        if want[0] == "ok":
                            assert want[1] == brute_force(ids.tolist(), v2p_host.tolist(), 1 if pages else page_size)
                        if impl is cpu_impl:  # the host fast path: numpy master table, out= tensor
                            out = torch.full((ids.size,), -7, dtype=torch.int64)
                            table = alloc.v2p(end).numpy()
                            if pages:
                                fast = outcome(impl.virtual_to_physical_pages, ids_t, table, out=out, strict=strict)
                            else:
                                fast = outcome(impl.virtual_to_physical, ids_t, table, page_size, out=out,
                                               strict=strict)
                            assert fast == want
                            if want[0] != "ok":
                                assert out.tolist() == [-7] * ids.size  # a refused call writes nothing


@pytest.mark.parametrize("page_size", [2, 3])
def test_allocator_translate_into_a_torch_out_agrees_with_brute_force(make_allocator, page_size):
    """The allocator's by-address path (contiguous CPU int64 torch ids and ``out=``): the same answers as a
    brute-force loop over the v2p table and the same error types as the reference translator; a refused call
    writes nothing into ``out``; ``out`` may be the ids themselves."""
    seed = seed_from_env(20261201) + 10 * page_size
    rng = np.random.default_rng(seed)
    for _ in range(5):
        alloc = make_allocator(full_swa_spec(page_size))
        random_history(alloc, rng)
        nv = alloc.num_vpages()
        for end in ("full", "swa"):
            v2p_host = alloc.v2p(end).numpy().copy()
            v2p_t = torch.from_numpy(v2p_host)
            for strict in (False, True):
                for _ in range(8):
                    n = int(rng.integers(1, 12))
                    hi = nv * page_size + 1 if rng.random() < 0.2 else nv * page_size
                    vt = rng.integers(-1 if rng.random() < 0.2 else 0, hi, size=n).astype(np.int64)
                    for ids, pages in ((vt, False), (vt // page_size, True)):
                        ids_t = torch.from_numpy(ids.copy())
                        ps = 1 if pages else page_size
                        call = alloc.translate_pages if pages else alloc.translate
                        if pages:
                            want = outcome(ref_impl.virtual_to_physical_pages, ids_t, v2p_t, strict=strict)
                        else:
                            want = outcome(ref_impl.virtual_to_physical, ids_t, v2p_t, page_size, strict=strict)
                        out = torch.full((n,), -7, dtype=torch.int64)
                        got = outcome(call, ids_t, end, strict=strict, out=out)
                        if got[0] == "ok":
                            assert want[0] == "ok" and got[1] == out.tolist()
                            assert out.tolist() == brute_force(ids.tolist(), v2p_host.tolist(), ps)
                            same = ids_t.clone()
                            assert call(same, end, strict=strict, out=same) is same  # out aliasing the ids
                            assert same.tolist() == out.tolist()
                        else:
                            assert got[0] == want[0] and out.tolist() == [-7] * n  # a refused call writes nothing
