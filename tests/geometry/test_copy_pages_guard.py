"""Arena.copy_pages with an allocator on the arena (Note [Guarded destinations]): a destination pinned by a lease or
pending is refused unless ``overwrite=True``; live pages the caller allocated are written as before; numpy ids are
validated as every id argument. Expected bytes are the fill values written by the test itself."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from umalloc.errors import InvalidIdError, UmallocValueError
from umalloc.testing import small_allocator


def filled():  # type: ignore[no-untyped-def]
    alloc = small_allocator()
    env = alloc.arena.envelopes("full")
    for p in range(env.shape[0]):
        env[p].fill_(p)
    return alloc, env


def firsts(env: torch.Tensor) -> list[int]:
    return [int(env[p, 0]) for p in range(env.shape[0])]


def test_a_leased_destination_is_refused_unless_overwrite() -> None:
    alloc, env = filled()
    vp = alloc.alloc_pages(3)  # virtual 1, 2, 3 -> physical 1, 2, 3 of full
    pp = alloc.translate_pages(vp, "full")
    lease = alloc.lease({"full": pp[2:]})
    before = alloc.arena.data.clone()
    with pytest.raises(InvalidIdError, match=r"dst_pages\[1\] = 3 of end 'full' is in use"):
        alloc.arena.copy_pages("full", pp[1:], pp[:2])
    assert torch.equal(alloc.arena.data, before)
    alloc.arena.copy_pages("full", pp[1:], pp[:2], overwrite=True)
    assert firsts(env)[1:4] == [1, 1, 2]
    lease.release()
    alloc.arena.copy_pages("full", pp[2:], pp[:1])  # the lease was released: page 3 is the caller's again
    assert firsts(env)[3] == 1


def test_a_pending_destination_is_refused() -> None:
    alloc, env = filled()
    pp = alloc.translate_pages(alloc.alloc_pages(2), "full")
    lease = alloc.lease({"full": pp[1:]})
    alloc.free_pages(torch.tensor([2]))  # freed while pinned: pending
    lease_pages = pp[1:]
    with pytest.raises(InvalidIdError, match="in use"):
        alloc.arena.copy_pages("full", lease_pages, pp[:1])
    lease.release()  # the page becomes a hole: nobody's bytes
    alloc.arena.copy_pages("full", lease_pages, pp[:1])
    assert firsts(env)[2] == 1


def test_fresh_pages_the_caller_allocated_are_written() -> None:
    """A fork copying its parent's pages into the pages it just allocated (the transformers ring copy)."""
    alloc, env = filled()
    src = alloc.translate_pages(alloc.alloc_pages(2), "swa")
    dst = alloc.translate_pages(alloc.alloc_pages(2), "swa")
    alloc.arena.copy_pages("swa", dst, src)
    swa = alloc.arena.envelopes("swa")
    assert [int(swa[int(p), 0]) for p in dst] == [int(p) for p in src]


def test_numpy_ids_are_validated_as_every_id_argument() -> None:
    alloc, env = filled()
    before = alloc.arena.data.clone()
    bad = [np.array([2.0]), np.array([True]), np.array([[2]]), np.array([2**63], dtype=np.uint64),
           np.array([2], dtype=">i8"), np.array(["2"])]
    for ids in bad:
        with pytest.raises(InvalidIdError, match="dst_pages"):
            alloc.arena.copy_pages("full", ids, np.array([1]))
    with pytest.raises(InvalidIdError, match=r"src_pages: shape \(1, 1\)"):
        alloc.arena.copy_pages("full", torch.tensor([2]), torch.tensor([[1]]))
    with pytest.raises(UmallocValueError, match="overwrite"):
        alloc.arena.copy_pages("full", np.array([2]), np.array([1]), overwrite=1)  # type: ignore[arg-type]
    assert torch.equal(alloc.arena.data, before)
    # any integer dtype, as the rest of the API: uint8, int16 numpy; int16 torch
    alloc.arena.copy_pages("full", np.array([2], dtype=np.uint8), np.array([5], dtype=np.int16))
    alloc.arena.copy_pages("full", torch.tensor([3], dtype=torch.int16), torch.tensor([6], dtype=torch.int16))
    assert firsts(env)[2:4] == [5, 6]


def test_the_guard_keeps_no_allocator_alive() -> None:
    alloc, env = filled()
    arena = alloc.arena
    del alloc
    gc.collect()
    arena.copy_pages("full", torch.tensor([2]), torch.tensor([1]))  # no allocator: nothing guarded
    assert firsts(env)[2] == 1
    from umalloc import MultiEndedAllocator

    again = MultiEndedAllocator(arena)  # the arena is free for a new allocator
    pp = again.translate_pages(again.alloc_pages(1), "full")
    with again.lease({"full": pp}):
        with pytest.raises(InvalidIdError, match="in use"):
            arena.copy_pages("full", pp, torch.tensor([3]))
