"""The docs' three examples (README.md's, and docs/usage.md's two) and a transfer plan through the local
backend, written against the public face (``import umalloc``) and checked by mypy in strict mode
(``scripts/test.sh``): every ``assert_type`` fails the check if a name the face exports reaches the type checker
as ``Any``. ``test_public_face.py`` runs them."""

from __future__ import annotations

import numpy as np
import torch
from typing_extensions import assert_type

from umalloc import (
    Arena,
    EndStats,
    Lease,
    MultiEndedAllocator,
    PeerLayout,
    RequestTable,
    RequestTableStats,
    TransferPlan,
    build_plan,
    get_backend,
)
from umalloc.backends.handle import TransferHandle
from umalloc.backends.protocol import TransferBackend
from umalloc.geometry.presets import preset_arena_spec


def token_ids() -> dict[str, tuple[int, int]]:
    """README.md's example: token-level calls, translation, a lease; returns live and peak pages."""
    spec = preset_arena_spec("gemma-3-12b-draft", arena_bytes=256 << 20, page_size=16)
    alloc = MultiEndedAllocator(Arena(spec))
    assert_type(alloc, MultiEndedAllocator)
    vtok = alloc.alloc_extend(prefix_lens=torch.tensor([0, 0]), seq_lens=torch.tensor([40, 7]),
                              last_loc=torch.tensor([-1, -1]))
    assert vtok is not None
    assert_type(vtok, torch.Tensor)
    req0, req1 = vtok[:40], vtok[40:]
    step = alloc.alloc_decode(seq_lens=torch.tensor([41, 8]), last_loc=torch.stack([req0[-1], req1[-1]]))
    assert step is not None
    phys_full = alloc.translate(req0, "full")
    assert_type(phys_full, torch.Tensor)
    alloc.translate(req0, "swa")
    address = alloc.arena.page_address("full", int(phys_full[0]) // 16)
    assert_type(address, int)
    with alloc.lease({"full": torch.unique(phys_full.div(16, rounding_mode="floor"))}, deadline_s=5.0) as lease:
        assert_type(lease, Lease)
        alloc.free(torch.cat([req0, step[:1]]))
    alloc.free(torch.cat([req1, step[1:]]))
    alloc.check_invariants()
    stats = alloc.stats()
    assert_type(stats, dict[str, EndStats])
    return {end: (s.live_pages, s.peak_live_pages) for end, s in stats.items()}


def page_ids() -> list[list[int]]:
    """docs/usage.md's first example: page-level calls straight into a numpy block table."""
    alloc = MultiEndedAllocator(Arena(preset_arena_spec("gemma-3-12b-draft", arena_bytes=256 << 20,
                                                        page_size=16)))
    block_table = np.zeros((4, 8), np.int64)
    flat = block_table.reshape(-1)
    alloc.alloc_pages(5, out=flat, index=np.array([0, 1, 2, 8, 9]))
    alloc.unbind_pages("swa", flat, index=np.array([0]))
    alloc.free_pages(flat, index=np.array([8, 9]))
    rows: list[list[int]] = block_table[:2].tolist()
    return rows


def request_table() -> tuple[list[int], int, int]:
    """docs/usage.md's second example: the request table (extend, decode, truncate, fork, free with the cache)."""
    alloc = MultiEndedAllocator(Arena(preset_arena_spec("gemma-3-12b-draft", arena_bytes=256 << 20,
                                                        page_size=16)))
    table = RequestTable(alloc, max_requests=8, max_tokens_per_request=4096)
    assert_type(table, RequestTable)
    slots = table.new_requests(2)
    assert slots is not None
    table.extend(slots, torch.tensor([40, 7]))
    table.decode(slots)
    table.truncate(slots[:1], torch.tensor([32]))
    child = table.fork(int(slots[0]), 16)
    assert child is not None
    assert_type(child, int)
    table.free_requests(slots[:1], cache=True)
    table.check_invariants()
    st = table.stats()
    assert_type(st, RequestTableStats)
    tokens: list[int] = table.num_tokens(torch.tensor([child, int(slots[1])])).tolist()
    return tokens, st.held_pages, st.cached_pages


def transfer_plan() -> tuple[int, bool]:
    """A 40-token request of every end moved between two allocators by a plan over the local backend; returns
    the bytes the plan names and whether the receiver's full-attention pages hold the sender's bytes."""
    spec = preset_arena_spec("gemma-3-12b-draft", arena_bytes=64 << 20, page_size=16)
    src, dst = MultiEndedAllocator(Arena(spec)), MultiEndedAllocator(Arena(spec))
    src.arena.data.copy_(torch.randint(0, 256, (spec.arena_bytes,), generator=torch.Generator().manual_seed(7),
                                       dtype=torch.uint8))
    one = torch.tensor([0]), torch.tensor([40]), torch.tensor([-1])
    src_vtok, dst_vtok = src.alloc_extend(*one), dst.alloc_extend(*one)
    assert src_vtok is not None and dst_vtok is not None
    sender = get_backend("local", layout=PeerLayout.from_arena(src.arena))
    receiver = get_backend("local", layout=PeerLayout.from_arena(dst.arena))
    assert_type(sender, TransferBackend)
    try:
        sender.register(src.arena.regions())
        receiver.register(dst.arena.regions())
        peer = sender.connect(receiver.metadata())
        plan = build_plan("req-0", src, src_vtok, dst, dst_vtok)
        assert_type(plan, TransferPlan)
        handle = sender.submit(plan, peer)
        assert_type(handle, TransferHandle)
        sender.wait(handle, 10.0)
        sender.forget(handle)
    finally:
        sender.close()
        receiver.close()
    src_pages = src.translate_pages(torch.unique(src_vtok // 16), "full")
    dst_pages = dst.translate_pages(torch.unique(dst_vtok // 16), "full")
    same = bool(torch.equal(src.arena.envelopes("full")[src_pages], dst.arena.envelopes("full")[dst_pages]))
    return plan.total_bytes, same
