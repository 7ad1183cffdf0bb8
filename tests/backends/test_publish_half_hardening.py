"""``publish_half`` refuses what is not a receiver half, and a half whose memory the backend
never registered, on every backend (local, nixl, mooncake; the engines run for real here, UCX on loopback).
Nothing is kept on a refusal: ``published_halves()`` stays 0 and the half's lease takes no engine hold."""

from __future__ import annotations

import pytest
from backend_helpers import (
    L_TOKENS,
    alloc_request,
    kv_pair,
)

from umalloc.errors import RegistrationError, UmallocError, UmallocValueError
from umalloc.geometry.region import Region
from umalloc.transfer import build_receiver_half

ALL = ["local", "nixl", "mooncake"]


@pytest.mark.parametrize("name", ALL)
def test_publish_half_refuses_non_halves_typed(name, backend_factory) -> None:
    """None, a str, a dict and a Lease are refused with UmallocValueError (not AttributeError),
    and nothing is kept."""
    src_arena, src_alloc, a, dst_arena, dst_alloc, b = kv_pair(backend_factory, name)
    dvt = alloc_request(dst_alloc, L_TOKENS)
    half = build_receiver_half("r", dst_alloc, dvt, deadline_s=5.0)
    for bad in (None, "half", {"request_id": "r"}, half.lease, 7):
        with pytest.raises(UmallocValueError, match="ReceiverHalf"):
            b.publish_half(bad)
    assert b.published_halves() == 0
    half.abort()


@pytest.mark.parametrize("name", ALL)
def test_publish_half_refuses_memory_the_backend_never_registered(name, backend_factory) -> None:
    """F25: the receiver registers only the first 4 KiB of its arena; a half whose pages lie
    above it is refused with RegistrationError before any engine hold (so close() has nothing to settle that
    nothing fenced); a half of registered pages publishes."""
    src_arena, src_alloc, a, dst_arena, dst_alloc, b = kv_pair(
        backend_factory, name, dst_regions=lambda ar: [Region(ar.base_ptr, 4096)])
    dvt = alloc_request(dst_alloc, L_TOKENS)
    half = build_receiver_half("r", dst_alloc, dvt, deadline_s=5.0)
    top = max(int(p.max()) * dst_arena.page_bytes(e) for e, p in half.pages_by_end().items())
    assert top >= 4096, "the swa end grows down from the arena's top: its pages lie above the registered 4 KiB"
    with pytest.raises(RegistrationError, match="outside every region"):
        b.publish_half(half)
    assert b.published_halves() == 0 and half.state == "pending"
    assert not half.lease.in_doubt
    half.abort()
    assert half.lease.state in ("released", "settled")
    with pytest.raises(UmallocError):
        b.publish_half(object())
