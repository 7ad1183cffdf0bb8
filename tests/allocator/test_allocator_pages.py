"""The page-level calls of MultiEndedAllocator (``alloc_pages(out=, index=)``, ``free_pages``, ``unbind_pages``)
under hostile input: memory safety of the block-table scatter/gather, typed errors that change nothing, the
page-level hot path (Note [Page-level hot path]) against the general path and against a model, leases (F11,
F12), two id owners, eager compaction.

Geometry (as tests/allocator/test_allocator.py): ``full`` (up, owner) + ``swa`` (down, bound), page_size 2, 32 B pages,
floor 32 B; an arena of ``B`` bytes has physical pages ``1 .. B/32 - 1`` shared by both ends and virtual pages
``1 .. B/32 - 1`` of ``full``. Every expected value below is worked out by hand or by the model in the test.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch
from allocator_helpers import T, draft_end, full_end, pages, swa_end

from umalloc.allocator.facade import MultiEndedAllocator, snapshots_equal
from umalloc.errors import (
    DoubleFreeError,
    InvalidIdError,
    NotAllocatedError,
    UmallocError,
    UmallocValueError,
)
from umalloc.geometry.spec import Grow
from umalloc.testing import seed_from_env

I64 = np.int64


def A(*xs: int) -> np.ndarray:
    return np.array(xs, I64)


@pytest.fixture(params=[False, True], ids=["hot-path", "checked-path"])
def checked(request) -> bool:
    """False: numpy calls take the page-level hot path; True (debug checks): the general path."""
    return request.param


@pytest.fixture
def sized_full_swa(checked_allocator, checked):
    """``sized_full_swa(arena_bytes)``: full (up, owner) + swa (down, bound), page_size 2, on the hot path or,
    with ``checked``, the general one (debug checks)."""
    def build(arena_bytes: int) -> MultiEndedAllocator:
        alloc = checked_allocator((full_end(), swa_end()), arena_bytes, debug_checks=checked)
        assert alloc._plain is not checked
        return alloc

    return build


# ---- memory safety ---------------------------------------------------------------------------------------------
def test_alloc_index_that_overlaps_the_table_never_writes_outside_it(sized_full_swa, checked) -> None:
    """``index`` is the table itself, or a slice of it: the kernel used to read slot j after writing page j-1,
    which may have overwritten that slot with a page id far past the table -- a write outside the buffer."""
    alloc = sized_full_swa(4096)
    assert alloc.alloc_pages(5).tolist() == [1, 2, 3, 4, 5]
    big = np.full(12, -9, I64)
    buf = big[:2]
    buf[:] = (1, 0)                       # slots 1, 0: page 6 -> slot 1, page 7 -> slot 0
    assert alloc.alloc_pages(2, out=buf, index=buf) is buf
    assert buf.tolist() == [7, 6] and (big[2:] == -9).all()
    big = np.full(12, -9, I64)
    table, idx = big[:4], big[2:4]
    idx[:] = (3, 2)                       # index is the tail of the table: page 8 -> slot 3, page 9 -> slot 2
    alloc.alloc_pages(2, out=table, index=idx)
    assert table.tolist() == [-9, -9, 9, 8] and (big[4:] == -9).all()
    t = torch.full((4,), -9, dtype=torch.int64)   # the general path: a torch table, a numpy index sharing it
    t[2:] = torch.tensor([1, 0])
    alloc.alloc_pages(2, out=t[:2], index=t[2:].numpy())
    assert t.tolist() == [11, 10, 1, 0]
    assert pages(alloc, T(6, 7, 8, 9, 10, 11), "full") == [6, 7, 8, 9, 10, 11]
    alloc.check_invariants()


@pytest.mark.parametrize("num_pages", [2**63, 2**64, np.uint64(2**64 - 1)], ids=["2**63", "2**64", "uint64-max"])
@pytest.mark.parametrize("with_out", [False, True], ids=["new", "out"])
def test_alloc_pages_refuses_a_count_an_int64_cannot_hold(sized_full_swa, checked, num_pages, with_out) -> None:
    """Used to leak numba's TypingError / OverflowError from the dispatcher (not a umalloc error)."""
    alloc = sized_full_swa(416)
    alloc.alloc_pages(1)
    snap = alloc.snapshot()
    out = np.full(3, -7, I64) if with_out else None
    with pytest.raises(UmallocValueError, match=r"allowed an int in \[0, 2\*\*63\)"):
        alloc.alloc_pages(num_pages, out=out)
    assert snapshots_equal(snap, alloc.snapshot())
    assert out is None or (out == -7).all()
    assert alloc.alloc_pages(2**62) is None and alloc.last_shortfall == {"full": 2**62 - 11}  # ids 2..12 free


def _canonical_int64_lookalikes() -> list[np.ndarray]:
    """Native int64 arrays whose dtype object is not ``np.dtype(np.int64)``: an unpickled array (ids sent by
    another process), and ``np.longlong`` (``'q'``, a distinct dtype object on LP64)."""
    return [pickle.loads(pickle.dumps(np.zeros(0, I64))), np.zeros(0, np.longlong)]


@pytest.mark.parametrize("kind", ["unpickled", "longlong"])
def test_page_calls_take_native_int64_under_another_dtype_object(sized_full_swa, checked, kind) -> None:
    """Used to be refused with 'numpy dtype int64; allowed int64'."""
    proto = _canonical_int64_lookalikes()[["unpickled", "longlong"].index(kind)]

    def arr(*xs: int) -> np.ndarray:
        return np.array(xs, I64).astype(proto.dtype)

    alloc = sized_full_swa(416)
    out = arr(-1, -1, -1)
    assert alloc.alloc_pages(3, out=out) is out and out.tolist() == [1, 2, 3]
    table = arr(-1, -1, -1, -1)
    assert alloc.alloc_pages(2, out=table, index=arr(3, 0)) is table and table.tolist() == [5, -1, -1, 4]
    alloc.unbind_pages("swa", arr(2))
    alloc.unbind_pages("swa", table, index=arr(0))
    assert pages(alloc, T(1, 2, 3, 4, 5), "swa")[1] == 0 and pages(alloc, T(5), "swa") == [0]
    alloc.free_pages(arr(1, 2))
    alloc.free(arr(3 * 2 + 1))                          # a token of page 3
    alloc.free_pages(table, index=arr(3, 0))
    assert alloc.stats()["full"].live_pages == 0 and alloc.stats()["swa"].live_pages == 0
    with pytest.raises(InvalidIdError, match=">i8; allowed native int64"):   # byte-swapped stays refused
        alloc.free_pages(np.array([1], ">i8"))
    alloc.check_invariants()


@pytest.mark.parametrize("bad", ["meta", "sparse"])
def test_id_tensors_without_dense_data_are_refused_typed(sized_full_swa, checked, bad) -> None:
    """Used to leak torch's NotImplementedError (meta: 'Cannot copy out of meta tensor') / RuntimeError (sparse)."""
    alloc = sized_full_swa(416)
    vp = alloc.alloc_pages(2)
    snap = alloc.snapshot()
    if bad == "meta":
        ids = torch.ones(1, dtype=torch.int64, device="meta")
    else:
        ids = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1]), (1,), check_invariants=True)
    table = np.full(4, -1, I64)
    for call in (lambda: alloc.free_pages(ids), lambda: alloc.free(ids), lambda: alloc.unbind_pages("swa", ids),
                 lambda: alloc.free_pages(vp.numpy(), index=ids),
                 lambda: alloc.alloc_pages(1, out=table, index=ids)):
        with pytest.raises(InvalidIdError, match="dense"):
            call()
    assert snapshots_equal(snap, alloc.snapshot()) and (table == -1).all()


# ---- F11 / F12 on the page-level calls -------------------------------------------------------------------------
def test_an_expired_lease_is_reclaimed_by_a_numpy_page_call(checked_allocator) -> None:
    """F12: the hot path skips the lease tick only while no lease is active; a lease past its deadline is still
    active until a call reclaims it, so the first numpy call after the deadline takes the general path and does.
    416 B: full 1 2 and swa 11 12 for vpages 1 2."""
    now = [0.0]
    alloc = checked_allocator((full_end(), swa_end()), 416, debug_checks=False, clock=lambda: now[0])
    vp = alloc.alloc_pages(2, out=np.zeros(2, I64))
    assert vp.tolist() == [1, 2] and pages(alloc, T(1, 2), "swa") == [11, 12]
    alloc.lease({"full": T(1)}, deadline_s=1.0)
    alloc.free_pages(A(1))                                      # full page 1 pins: pending; swa 11 retreats
    assert alloc.stats()["full"].pending_pages == 1
    out = np.zeros(1, I64)
    alloc.alloc_pages(1, out=out)                                # before the deadline: page 1 stays pending
    assert out.tolist() == [1] and pages(alloc, T(1), "full") == [3] and pages(alloc, T(1), "swa") == [11]
    alloc.free_pages(A(1))                                      # full 3 at the frontier retreats, swa 11 too
    now[0] = 2.0
    assert alloc._plain and alloc._leasing.work               # expired, not yet reclaimed
    alloc.alloc_pages(1, out=out)                                # reclaims the lease, then drains hole 1
    assert out.tolist() == [1] and pages(alloc, T(1), "full") == [1]
    st = alloc.stats()["full"]
    assert (st.pending_pages, st.leases_expired) == (0, 1) and not alloc._leasing.work
    alloc.check_invariants()


def test_unbind_pages_of_a_leased_swa_page_goes_pending(sized_full_swa, checked) -> None:
    """F11 on the bound end: 416 B, swa 11 12 for vpages 1 2; the leased swa page 12 is unbound by page id."""
    alloc = sized_full_swa(416)
    alloc.alloc_pages(2)
    with alloc.lease({"swa": T(12)}):
        alloc.unbind_pages("swa", A(2))
        st = alloc.stats()["swa"]
        assert (st.live_pages, st.pending_pages) == (1, 1)
        out = np.zeros(1, I64)
        alloc.alloc_pages(1, out=out)
        assert out.tolist() == [3] and pages(alloc, T(3), "swa") == [10]  # not 12: it is pending
    assert alloc.stats()["swa"].pending_pages == 0
    alloc.check_invariants()


# ---- two owners; eager compaction ------------------------------------------------------------------------------
def test_numpy_page_calls_on_two_owners_need_the_owner(checked_allocator) -> None:
    """640 B: full (up, 32 B pages 1..19) and draft (down, its own id owner, 32 B pages, top 19)."""
    alloc = checked_allocator((full_end(), draft_end(ps=4, head_dim=2, grow=Grow.DOWN, owner=None)), 640, debug_checks=False)
    assert not alloc._plain
    out = np.zeros(2, I64)
    snap = alloc.snapshot()
    with pytest.raises(UmallocValueError, match="ambiguous"):
        alloc.alloc_pages(2, out=out)
    assert snapshots_equal(snap, alloc.snapshot()) and (out == 0).all()
    assert alloc.alloc_pages(2, owner="draft", out=out).tolist() == [1, 2]
    assert pages(alloc, T(1, 2), "draft") == [18, 19] and alloc.stats()["full"].live_pages == 0
    snap = alloc.snapshot()
    with pytest.raises(UmallocValueError, match="ambiguous"):
        alloc.free_pages(A(1))
    with pytest.raises(NotAllocatedError):                       # full's id 1 was never minted
        alloc.free_pages(A(1), owner="full")
    assert snapshots_equal(snap, alloc.snapshot())
    table = np.array([2, 1], I64)
    alloc.free_pages(table, owner="draft", index=A(1))
    assert alloc.stats()["draft"].live_pages == 1
    with pytest.raises(DoubleFreeError):
        alloc.free_pages(A(1), owner="draft")
    alloc.check_invariants()


def test_free_pages_under_eager_compaction_compacts_like_free(checked_allocator) -> None:
    """416 B: full 1 2 3 / swa 10 11 12. Freeing vpage 1 leaves full hole 1, which eager compaction fills with
    the far-edge page 3 (vpage 3); swa 10 sat at swa's moving edge and simply retreated."""
    alloc = checked_allocator((full_end(), swa_end()), 416, debug_checks=False, compaction="eager")
    assert not alloc._plain
    alloc.alloc_pages(3, out=np.zeros(3, I64))
    alloc.free_pages(A(1))
    assert pages(alloc, T(2, 3), "full") == [2, 1] and alloc.watermark("full") == 3
    assert pages(alloc, T(2, 3), "swa") == [11, 12]
    alloc.check_invariants()


# ---- the hot path, the general path and a model agree ----------------------------------------------------------
def _forms(rng: random.Random, ids: np.ndarray) -> np.ndarray | torch.Tensor:
    """The same ids in a form the page calls take: plain, strided, reversed-stride, read-only, unpickled numpy, or
    a torch tensor (contiguous or not)."""
    form = rng.choice(["plain", "strided", "reversed", "read-only", "unpickled", "torch", "torch-strided"])
    if form == "plain":
        return ids.copy()
    if form == "strided":
        wide = np.full(2 * ids.size + 1, 77, I64)
        wide[1::2] = ids
        return wide[1::2]
    if form == "reversed":
        return ids[::-1].copy()[::-1]
    if form == "read-only":
        c = ids.copy()
        c.flags.writeable = False
        return c
    if form == "unpickled":
        return pickle.loads(pickle.dumps(ids))
    if form == "torch":
        return torch.from_numpy(ids.copy())
    return torch.from_numpy(np.repeat(ids, 2))[::2]


class PageModel:
    """Virtual-page state of ``full`` (ids 1..nv-1) and which are bound on ``swa``, with the documented errors in
    the documented order (per position: index slot, then range, page 0, liveness, binding)."""

    def __init__(self, nv: int, capacity: int) -> None:
        self.nv, self.capacity = nv, capacity
        self.state = ["never"] * nv
        self.swa: set[int] = set()

    def live(self) -> list[int]:
        return [v for v in range(1, self.nv) if self.state[v] == "live"]

    def alloc(self, k: int) -> list[int] | None:
        free = [v for v in range(1, self.nv) if self.state[v] != "live"]
        if k > len(free) or len(self.live()) + len(self.swa) + 2 * k > self.capacity:
            return None
        for v in free[:k]:
            self.state[v] = "live"
            self.swa.add(v)
        return free[:k]

    def _pages(self, table: np.ndarray, index: np.ndarray | None, unbind: bool, strict: bool) -> list[int]:
        got: list[int] = []
        for i in range(len(table) if index is None else len(index)):
            if index is not None and not 0 <= index[i] < len(table):
                raise InvalidIdError("index")
            v = int(table[i if index is None else index[i]])
            if not 0 <= v < self.nv or v == 0:
                raise InvalidIdError("range")
            if self.state[v] != "live":
                raise DoubleFreeError("freed") if self.state[v] == "freed" else NotAllocatedError("never")
            if unbind and v not in self.swa:
                if strict:
                    raise NotAllocatedError("unbound")
                continue
            if v not in got:
                got.append(v)
        return got

    def free(self, table: np.ndarray, index: np.ndarray | None) -> None:
        for v in self._pages(table, index, False, False):
            self.state[v] = "freed"
            self.swa.discard(v)

    def unbind(self, table: np.ndarray, index: np.ndarray | None, strict: bool) -> None:
        for v in self._pages(table, index, True, strict):
            self.swa.discard(v)


def test_hot_path_general_path_and_mirror_path_agree_with_a_model(checked_allocator) -> None:
    """Random page calls (valid and invalid, every id form) on three allocators: the hot path, the general path
    (debug checks) and the general path with a CPU v2p mirror. Each must give the model's pages, errors and table,
    the same snapshot, and the mirror must equal the host table. 1024 B: 31 physical pages, virtual ids 1..31."""
    seed = seed_from_env(20240611)
    rng = random.Random(seed)
    NS = 12                                                       # block-table slots
    for _ in range(4):
        allocs = [checked_allocator((full_end(), swa_end()), 1024, debug_checks=debug, mirror_device=mirror)
                  for debug, mirror in ((False, None), (True, None), (False, "cpu"))]
        assert allocs[0]._plain and not allocs[1]._plain
        tables = [np.full(NS, -1, I64) for _ in allocs]
        model, mtable = PageModel(32, 31), np.full(NS, -1, I64)
        for step in range(80):
            op = rng.choice(["alloc", "alloc-index", "free", "free-index", "unbind", "unbind-index"])
            k = rng.randint(0, 4)
            if rng.random() < 0.9:
                slots = A(*rng.sample(range(NS), k))
            else:
                slots = A(*[rng.randint(-2, NS + 1) for _ in range(k)])
            ids = A(*[rng.choice(model.live() or [1]) if rng.random() < 0.8 else rng.randint(-1, 33)
                      for _ in range(k)])
            strict = rng.random() < 0.5
            form_seed = rng.random()
            want: object
            try:
                if op == "alloc":
                    want = model.alloc(k)
                elif op == "alloc-index":
                    if any(not 0 <= s < NS for s in slots):
                        raise InvalidIdError("index")
                    got = model.alloc(k)
                    for j, v in enumerate(got or ()):
                        mtable[slots[j]] = v                      # a repeated slot keeps the last page
                    want = got is None
                elif op == "free":
                    want = model.free(ids, None)
                elif op == "free-index":
                    want = model.free(mtable, slots)
                elif op == "unbind":
                    want = model.unbind(ids, None, strict)
                else:
                    want = model.unbind(mtable, slots, strict)
            except UmallocError as e:
                want = type(e)
            for alloc, table in zip(allocs, tables, strict=True):
                form = random.Random(form_seed)
                try:
                    if op == "alloc":
                        out = np.full(k, -5, I64)
                        res = alloc.alloc_pages(k, out=out)
                        got = None if res is None else out.tolist()
                    elif op == "alloc-index":
                        got = alloc.alloc_pages(k, out=table, index=_forms(form, slots)) is None
                    elif op == "free":
                        got = alloc.free_pages(_forms(form, ids))
                    elif op == "free-index":
                        got = alloc.free_pages(table, index=_forms(form, slots))
                    elif op == "unbind":
                        got = alloc.unbind_pages("swa", _forms(form, ids), strict=strict)
                    else:
                        got = alloc.unbind_pages("swa", table, index=_forms(form, slots), strict=strict)
                except UmallocError as e:
                    got = type(e)
                assert got == want, (seed, step, op, k, slots, ids, strict)
                assert np.array_equal(table, mtable), (seed, step, op)
            for alloc in allocs[1:]:
                assert snapshots_equal(allocs[0].snapshot(), alloc.snapshot()), (seed, step, op)
            mirrored = allocs[2]
            for end in ("full", "swa"):
                assert np.array_equal(mirrored.v2p(end).numpy(), mirrored.ends[end].v2p), (seed, step, end)
            allocs[0].check_invariants()
