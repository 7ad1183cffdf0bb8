"""Bounded batches (Note [Bounded batches] in ``umalloc.transfer.descriptors``): descriptor batches cut into engine
submissions of at most ``max_batch_descriptors`` descriptors and ``max_batch_bytes`` bytes.

1. The pure cut (:func:`chunk_descriptors`) against hand-computed chunks, and against a plain-Python greedy
   reference on seeded random batches.
2. Every backend (local, NIXL, Mooncake; real engines over loopback) moves a batch of many descriptors under tiny
   caps: every destination byte equals a brute-force replay of the original descriptors over an independent
   re-creation of the source pattern, and the handle reports the number of submissions computed by hand.
3. Failure of a multi-chunk plan (receiver worker paused, then killed): the whole handle fails, the plan's leases
   end only once no chunk is in an engine (Mooncake: the chunk it holds lands after the deadline, queued chunks
   are never posted), and nothing stays pending or in doubt.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from backend_helpers import (
    BACKEND_PARAMS,
    DEADLINE_S,
    ENGINE_PARAMS,
    L_TOKENS,
    SEED,
    W,
    alloc_request,
    brute_apply,
    kv_pair,
    kv_side,
    kv_spec,
    seeded_bytes,
    tbytes,
    worker,
)

from umalloc.backends import get_backend
from umalloc.errors import TransferError, TransferTimeout, UmallocValueError
from umalloc.geometry.region import Region
from umalloc.testing import require_or_skip
from umalloc.transfer import PeerLayout, build_plan, build_send_plan
from umalloc.transfer.descriptors import MAX_BATCH_BYTES, MAX_BATCH_DESCRIPTORS, chunk_descriptors

pytestmark = pytest.mark.timeout(600)  # a hang guard: a loaded machine may take minutes


def rows(*triples) -> np.ndarray:
    return np.array(triples, dtype=np.uint64).reshape(-1, 3)


def as_lists(chunks) -> list[list[list[int]]]:
    return [c.tolist() for c in chunks]


# ==== 1. the pure cut ===========================================================================================


def test_defaults_are_mooncake_and_sglang_limits():
    assert (MAX_BATCH_DESCRIPTORS, MAX_BATCH_BYTES) == (2048, 1 << 30)


def test_descriptor_cap_only():
    d = rows(*[(100 * i, 1000 + 100 * i, 10) for i in range(7)])
    got = chunk_descriptors(d, 3, 1 << 30)
    assert as_lists(got) == [d[0:3].tolist(), d[3:6].tolist(), d[6:7].tolist()]
    assert all(c.dtype == np.uint64 and c.flags.c_contiguous and c.shape[1] == 3 for c in got)


def test_byte_cap_only():
    # lengths 300 300 300 100 600 50, cap 700 bytes: 300+300 (+300 > 700) | 300+100 (+600 > 700) | 600+50
    lens = [300, 300, 300, 100, 600, 50]
    d = rows(*[(i << 12, (i << 12) + 7, n) for i, n in enumerate(lens)])
    got = chunk_descriptors(d, 1000, 700)
    assert [c[:, 2].tolist() for c in got] == [[300, 300], [300, 100], [600, 50]]
    assert as_lists(got) == [d[0:2].tolist(), d[2:4].tolist(), d[4:6].tolist()]


def test_both_caps_bind():
    # max 3 descriptors, 1000 bytes: 250 x 5 -> 250 250 250 (3 rows) | 250 250; then 900 (+250 > 1000) | 250 + 1
    lens = [250] * 5 + [900, 250, 1]
    d = rows(*[(i << 12, (i << 12) + 8, n) for i, n in enumerate(lens)])
    got = chunk_descriptors(d, 3, 1000)
    assert [c[:, 2].tolist() for c in got] == [[250, 250, 250], [250, 250], [900], [250, 1]]


def test_a_descriptor_longer_than_the_byte_cap_is_cut_into_contiguous_pieces():
    d = rows((10_000, 50_000, 2_500))
    got = chunk_descriptors(d, 2, 1_000)
    assert as_lists(got) == [[[10_000, 50_000, 1_000]], [[11_000, 51_000, 1_000]], [[12_000, 52_000, 500]]]
    exact = chunk_descriptors(rows((0, 8, 3_000)), 5, 1_000)  # an exact multiple: three full pieces
    assert as_lists(exact) == [[[0, 8, 1_000]], [[1_000, 1_008, 1_000]], [[2_000, 2_008, 1_000]]]
    # pieces of one row and whole rows share a chunk when both caps allow: 400 | 1000 | 1000 | 500 300 100 | 100
    d = rows((0, 0, 400), (400, 400, 2500), (3000, 3000, 300), (4000, 4000, 100), (5000, 5000, 100))
    before = d.copy()
    got = chunk_descriptors(d, 3, 1000)
    assert as_lists(got) == [[[0, 0, 400]], [[400, 400, 1000]], [[1400, 1400, 1000]],
                             [[2400, 2400, 500], [3000, 3000, 300], [4000, 4000, 100]], [[5000, 5000, 100]]]
    assert np.array_equal(d, before)  # the input is never written
    one_byte = chunk_descriptors(rows((7, 9, 3)), 4, 1)  # 1-byte pieces, one per chunk under a 1-byte cap
    assert as_lists(one_byte) == [[[7, 9, 1]], [[8, 10, 1]], [[9, 11, 1]]]


def test_a_batch_that_is_not_an_n_by_3_uint64_array_is_refused():
    for bad in (np.zeros((2, 3), np.int64), np.zeros((2, 2), np.uint64), np.zeros(3, np.uint64), [[0, 0, 1]]):
        with pytest.raises(UmallocValueError, match=r"allowed an \(N, 3\) uint64 array"):
            chunk_descriptors(bad, 3, 1000)


def test_empty_batch_gives_no_chunk():
    assert chunk_descriptors(np.zeros((0, 3), np.uint64), 3, 1000) == []


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "3", None, 1 << 63, np.float64(2.0)])
def test_bad_caps_raise_typed_errors_and_change_nothing(bad):
    d = rows((0, 0, 10), (10, 10, 20))
    before = d.copy()
    for kw in ({"max_batch_descriptors": bad, "max_batch_bytes": 100},
               {"max_batch_descriptors": 3, "max_batch_bytes": bad}):
        with pytest.raises(UmallocValueError, match=next(k for k, v in kw.items() if v is bad)):
            chunk_descriptors(d, **kw)
    assert np.array_equal(d, before)
    with pytest.raises(UmallocValueError, match="max_batch_bytes"):  # and so does a backend's constructor
        get_backend("local", max_batch_bytes=bad)


@pytest.mark.parametrize("name", ["nixl", "mooncake"])
def test_engine_backends_refuse_bad_caps_before_the_engine_starts(name):
    require_or_skip(name)
    for kw in ({"max_batch_descriptors": 0}, {"max_batch_bytes": -5}, {"max_batch_bytes": True}):
        with pytest.raises(UmallocValueError, match=next(iter(kw))):
            get_backend(name, **kw)


def reference_chunks(d: np.ndarray, cap_n: int, cap_b: int) -> list[list[tuple[int, int, int]]]:
    """Plain-Python greedy reference: cut long rows byte by byte into cap_b pieces, then fill chunks in order."""
    pieces = []
    for s, t, n in d.tolist():
        off = 0
        while off < n:
            k = min(cap_b, n - off)
            pieces.append((s + off, t + off, k))
            off += k
    out: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    cur_bytes = 0
    for p in pieces:
        if cur and (len(cur) == cap_n or cur_bytes + p[2] > cap_b):
            out.append(cur)
            cur, cur_bytes = [], 0
        cur.append(p)
        cur_bytes += p[2]
    if cur:
        out.append(cur)
    return out


def test_random_batches_match_a_plain_python_greedy_reference():
    rng = np.random.default_rng(SEED)
    print(f"UMALLOC_SEED={SEED}")
    for _ in range(200):
        n = int(rng.integers(0, 40))
        d = np.stack([rng.integers(0, 1 << 40, n), rng.integers(0, 1 << 40, n), rng.integers(1, 5000, n)],
                     axis=1).astype(np.uint64).reshape(-1, 3)
        cap_n, cap_b = int(rng.integers(1, 8)), int(rng.integers(1, 6000))
        got = chunk_descriptors(d, cap_n, cap_b)
        assert [[tuple(r) for r in c.tolist()] for c in got] == reference_chunks(d, cap_n, cap_b)


# ==== 2. every backend, tiny caps ===============================================================================

#: Thirteen descriptors; with at most 3 descriptors and 1000 bytes per submission (hand-computed):
#: pieces 400 | 1000 1000 500 | 300 | 100 | 100 | 1000 | 999 | 1 | 1000 1000 1000 | 50 50 50 50 (17 pieces);
#: chunks [400] [1000] [1000] [500 300 100] [100] [1000] [999 1] [1000] [1000] [1000] [50 50 50] [50] -> 12.
LENS = [400, 2500, 300, 100, 100, 1000, 999, 1, 3000, 50, 50, 50, 50]
LENS_PARTS = 12


def scattered(src_base: int, dst_base: int, lens: list[int], nbytes: int, rng) -> np.ndarray:
    """Descriptors of ``lens`` from random source offsets to disjoint destination ranges in a random order (so
    the result does not depend on the order in which an engine lands the submissions)."""
    lens = np.array(lens, dtype=np.int64)
    order = rng.permutation(lens.size)
    gaps = rng.integers(1, 64, lens.size)
    dst_off = np.empty(lens.size, np.int64)
    dst_off[order] = np.cumsum(lens[order] + gaps[order]) - lens[order]
    assert int((dst_off + lens).max()) <= nbytes
    src_off = rng.integers(0, nbytes - int(lens.max()), lens.size)
    return np.stack([src_base + src_off, dst_base + dst_off, lens], axis=1).astype(np.uint64)


@pytest.mark.parametrize("name,kw", [
    pytest.param("local", {}, id="local"),
    pytest.param("nixl", {"mode": "oneshot"}, id="nixl-oneshot", marks=pytest.mark.backend),
    pytest.param("nixl", {"mode": "prepped"}, id="nixl-prepped", marks=pytest.mark.backend),
    pytest.param("mooncake", {}, id="mooncake", marks=pytest.mark.backend),
])
def test_tiny_caps_land_every_byte_and_count_the_submissions(name, kw, backend_factory):
    caps = {"max_batch_descriptors": 3, "max_batch_bytes": 1000}
    a, b = backend_factory(name, **kw, **caps), backend_factory(name)
    n = 64 << 10
    src, dst = seeded_bytes(n, SEED), seeded_bytes(n, SEED + 1)
    a.register([Region(src.data_ptr(), n)])
    b.register([Region(dst.data_ptr(), n)])
    peer = a.connect(b.metadata())
    rng = np.random.default_rng(SEED + 3)
    src_b = tbytes(seeded_bytes(n, SEED))  # an independent re-creation of the source pattern
    d = scattered(src.data_ptr(), dst.data_ptr(), LENS, n, rng)
    want = brute_apply(tbytes(seeded_bytes(n, SEED + 1)), dst.data_ptr(), src_b, src.data_ptr(), d)
    h = a.write_descriptors(d, peer)
    a.wait(h, DEADLINE_S)
    assert (h.state, h.num_descriptors, h.total_bytes, h.num_parts) == ("done", 13, sum(LENS), LENS_PARTS)
    a.forget(h)
    assert tbytes(dst) == want
    # 40 page-sized (256 B) descriptors with a page hint: 3 per submission (768 B) -> ceil(40 / 3) = 14; NIXL
    # "prepped" keeps posting prepared per-page lists, one request per chunk
    page = 256
    perm = rng.permutation(n // page)[:40]
    pages = np.stack([src.data_ptr() + rng.permutation(n // page)[:40] * page, dst.data_ptr() + perm * page,
                      np.full(40, page)], axis=1).astype(np.uint64)
    want = brute_apply(want, dst.data_ptr(), src_b, src.data_ptr(), pages)
    h = a.write_descriptors(pages, peer, item_bytes=page)
    a.wait(h, DEADLINE_S)
    assert (h.state, h.num_parts) == ("done", 14)
    if kw.get("mode") == "prepped":
        assert h.engine["mode"] == "prepped"
    a.forget(h)
    assert tbytes(dst) == want
    s = a.stats()
    assert (s["handles_done"], s["descriptors_posted"], s["bytes_posted"], s["engine_parts_posted"]) == (
        2, 13 + 40, sum(LENS) + 40 * page, LENS_PARTS + 14)
    a.check_invariants()


@pytest.mark.parametrize("name", BACKEND_PARAMS)
def test_default_caps_post_one_submission_per_2048_descriptors(name, backend_factory):
    """5000 one-byte descriptors under the defaults: ceil(5000 / 2048) = 3 submissions (the byte cap never binds)."""
    a, b = backend_factory(name), backend_factory(name)
    assert (a.max_batch_descriptors, a.max_batch_bytes) == (2048, 1 << 30)
    n = 5000
    src, dst = seeded_bytes(2 * n, SEED), torch.zeros(2 * n, dtype=torch.uint8)
    a.register([Region(src.data_ptr(), 2 * n)])
    b.register([Region(dst.data_ptr(), 2 * n)])
    peer = a.connect(b.metadata())
    k = np.arange(n, dtype=np.uint64)
    d = np.stack([src.data_ptr() + 2 * k, dst.data_ptr() + 2 * k + 1, np.ones(n, np.uint64)], axis=1)
    h = a.write_descriptors(d, peer)
    a.wait(h, DEADLINE_S)
    assert (h.state, h.num_parts) == ("done", 3)
    a.forget(h)
    want = torch.zeros(2 * n, dtype=torch.uint8)
    want[1::2] = seeded_bytes(2 * n, SEED)[0::2]
    assert torch.equal(dst, want)


@pytest.mark.parametrize("name", BACKEND_PARAMS)
def test_a_plan_under_tiny_caps_lands_exactly_and_releases_its_leases(name, backend_factory):
    """A real plan (target, SWA tail, draft) with one submission per piece of at most 48 bytes: the handle posts
    sum(ceil(nbytes / 48)) submissions over the plan's descriptors, every destination byte matches a brute-force
    replay, and the plan's leases are released once, when the last submission is done."""
    src_arena, src_alloc, a, dst_arena, dst_alloc, b = kv_pair(
        lambda n, **kw: backend_factory(n, max_batch_descriptors=1, max_batch_bytes=48, **kw), name)
    src_vt, dst_vt = alloc_request(src_alloc, L_TOKENS), alloc_request(dst_alloc, L_TOKENS)
    peer = a.connect(b.metadata())
    plan = build_plan("b-1", src_alloc, src_vt, dst_alloc, dst_vt)
    d = plan.descriptors()
    parts = sum(math.ceil(k / 48) for k in d[:, 2].tolist())
    assert parts > d.shape[0]  # some descriptors are longer than 48 bytes (pages of 128 and 64 bytes)
    want = brute_apply(tbytes(dst_arena.data), dst_arena.base_ptr, tbytes(src_arena.data), src_arena.base_ptr, d)
    h = a.submit(plan, peer)
    a.wait(h, DEADLINE_S)
    assert (h.state, h.num_parts, h.num_descriptors) == ("done", parts, d.shape[0])
    a.forget(h)
    assert tbytes(dst_arena.data) == want
    assert plan.state == "done" and src_alloc.leases_active() == 0 and dst_alloc.leases_active() == 0
    src_alloc.check_invariants()
    dst_alloc.check_invariants()


@pytest.mark.parametrize("name", ENGINE_PARAMS)
def test_a_plan_under_tiny_caps_between_processes(name, backend_workers, backend_factory):
    """The sender here (3 descriptors, 100 bytes per submission), the receiver in the shared worker: every byte
    of the worker's arena matches a brute-force replay of the plan over its bytes before the transfer."""
    w = worker(backend_workers, name)
    w.call("reset_backend")
    spec = kv_spec()
    src_arena, src_alloc = kv_side(spec, SEED)
    a = backend_factory(name, layout=PeerLayout.from_arena(src_arena), max_batch_descriptors=3,
                        max_batch_bytes=100)
    a.register(src_arena.regions())
    w.run(W + "kv_setup", PeerLayout.from_arena(src_arena).to_dict(), seed=SEED + 1)
    peer = a.connect(w.call("metadata"))
    half = w.run(W + "kv_receiver_half", "b-2", w.run(W + "kv_alloc", {"full": L_TOKENS, "draft": L_TOKENS}))
    plan = build_send_plan("b-2", src_alloc, alloc_request(src_alloc, L_TOKENS), half, a.peer_layout(peer))
    before = w.run(W + "kv_arena_bytes")
    want = brute_apply(before, a.peer_layout(peer).arena_base_ptr, tbytes(src_arena.data), src_arena.base_ptr,
                       plan.descriptors())
    h = a.submit(plan, peer)
    a.wait(h, DEADLINE_S)
    assert h.state == "done" and h.num_parts >= 2
    a.forget(h)
    assert w.run(W + "kv_arena_bytes") == want
    assert plan.state == "done" and src_alloc.leases_active() == 0
    assert w.run(W + "kv_finish_half", "b-2") == 0
    a.check_invariants()


# ==== 3. a failed chunk fails the whole handle ==================================================================


def _settled(alloc) -> int:
    st = alloc.stats()
    return sum(st[e].pending_pages + st[e].in_doubt_pages for e in st)


@pytest.mark.parametrize("name", ENGINE_PARAMS)
def test_multi_chunk_plan_deadline_then_dead_peer(name, backend_workers, backend_factory):
    """A plan in chunks of 2 descriptors to the victim worker.

    1. Receiver paused, ``wait`` deadline: the handle fails at once; while an engine holds a chunk (Mooncake
       cannot cancel) the plan stays pending with its lease; the chunks not yet handed to the engine are never
       posted: after the receiver resumes, exactly the first chunk (the plan's first 2 descriptors) has landed.
    2. Receiver killed while the chunks are pending: the handle fails with a TransferError (not a timeout), the
       plan fails and nothing stays pending or in doubt.
    """
    w = worker(backend_workers, name, "victim")
    spec = kv_spec()
    src_arena, src_alloc = kv_side(spec, SEED)
    a = backend_factory(name, layout=PeerLayout.from_arena(src_arena), max_batch_descriptors=2)
    a.register(src_arena.regions())
    w.run(W + "kv_setup", PeerLayout.from_arena(src_arena).to_dict(), seed=SEED + 1)
    peer = a.connect(w.call("metadata"))  # a fresh connection: NIXL's first WRITE needs the target
    src_bytes = tbytes(src_arena.data)

    def new_plan(rid: str):
        half = w.run(W + "kv_receiver_half", rid, w.run(W + "kv_alloc", {"full": L_TOKENS, "draft": L_TOKENS}))
        return build_send_plan(rid, src_alloc, alloc_request(src_alloc, L_TOKENS), half, a.peer_layout(peer))

    # 1. deadline on a paused receiver
    plan = new_plan("b-3")
    d = plan.descriptors()
    assert d.shape[0] >= 3
    before = w.run(W + "kv_arena_bytes")
    w.pause()
    try:
        h = a.submit(plan, peer)
        assert h.num_parts == math.ceil(d.shape[0] / 2)
        with pytest.raises(TransferTimeout):
            a.wait(h, 0.5)
        # outcome not known (F24): in doubt, the plan keeps its lease (Mooncake: the first chunk is in the
        # engine, the others were withdrawn; NIXL: every part was handed over and stays in the engine)
        assert h.state == "in_doubt" and h.draining
        assert (plan.state, src_alloc.leases_active()) == ("pending", 1)
        a.forget(h)
    finally:
        w.resume()
    assert a.drain(h, DEADLINE_S) and not h.draining
    assert src_alloc.leases_active() == 0 and _settled(src_alloc) == 0
    base = a.peer_layout(peer).arena_base_ptr
    if name == "mooncake":  # only the chunk the engine held landed: the first two descriptors; not every byte
        assert plan.state == "failed" and "withdrawn" in str(plan.error)
        assert isinstance(plan.error.__context__, TransferTimeout)
        assert w.run(W + "kv_arena_bytes") == brute_apply(before, base, src_bytes, src_arena.base_ptr, d[:2])
    else:  # every part NIXL was handed finished DONE: the engine's outcome
        assert plan.state == "done" and h.state == "done"
        assert w.run(W + "kv_arena_bytes") == brute_apply(before, base, src_bytes, src_arena.base_ptr, d)
    assert w.run(W + "kv_finish_half", "b-3", plan.state == "done") == 0

    # 2. the receiver dies while the chunks are pending
    md = w.call("metadata")
    a.disconnect(peer)
    peer = a.connect(md)  # NIXL: a fresh connection stalls on the paused receiver
    plan = new_plan("b-4")
    w.pause()
    h = a.submit(plan, peer)
    time.sleep(0.2)
    assert a.poll(h) == "pending" and h.num_parts == math.ceil(plan.num_descriptors / 2)
    w.kill()
    with pytest.raises(TransferError) as e:
        a.wait(h, DEADLINE_S)
    assert not isinstance(e.value, TransferTimeout)  # the dead peer failed it, not the deadline
    a.forget(h)
    assert a.drain(h, DEADLINE_S)
    assert plan.state == "failed" and src_alloc.leases_active() == 0 and _settled(src_alloc) == 0
    s = a.stats()
    assert (s["open_handles"], s["pending_handles"], s["draining_handles"]) == (0, 0, 0)
    src_alloc.check_invariants()
    a.check_invariants()
