"""Plans between prefill DCP p and decode DCP d, with a draft that keeps logical rows.

Every source rank fills each row of its target/SWA pages with a code naming the *logical position* it holds
(row ``i`` of rank ``q`` of ``p`` is position ``i * p + q``) and its draft rows with their own positions. After
every (source rank, destination rank) plan has been executed by a plain memmove loop, each decode rank ``r`` of
``d`` must hold position ``j * d + r`` in its target row ``j`` (and the window's positions in its SWA rows), the
whole draft in logical rows, and untouched bytes wherever the receiver already held the prefix.
"""

from __future__ import annotations

import ctypes
import json

import pytest
import torch

from umalloc.allocator.facade import MultiEndedAllocator
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, KVDtype, LayerSpec
from umalloc.transfer import PeerLayout, build_receiver_half, build_send_plan, check_compatible, source_ranks

W = 5
F32 = KVDtype.FP32
SPEC = ArenaSpec((
    EndSpec("full", (LayerSpec.mha(1, 2, dtype=F32),), 2),                                   # 16 B/token
    EndSpec("swa", (LayerSpec.mha(1, 2, dtype=F32, window_tokens=W),), 2, Grow.DOWN, "full", EndRole.SWA),
    EndSpec("draft", (LayerSpec.mha(1, 2, dtype=F32),), 2, Grow.FLOAT, None, EndRole.DRAFT),  # own id owner
), arena_bytes=4096)
END_CODE = {"full": 1, "swa": 2, "draft": 3}
UNTOUCHED = float("nan")  # receivers start as 0xFF bytes: a NaN pattern no code equals


def code(end: str, position: int, kv: int) -> float:
    return float(END_CODE[end] * 100_000 + position * 10 + kv)


def rows_of(n: int, size: int, rank: int, L: int) -> list[int]:
    """Positions of local rows 0.. of a rank (brute force)."""
    return [x for x in range(L) if x % size == rank][:n] if size > 1 else list(range(L))[:n]


def extend(alloc, owner: str, seq_len: int, prefix: torch.Tensor | None = None) -> torch.Tensor:
    pre = 0 if prefix is None else prefix.numel()
    last = -1 if prefix is None else int(prefix[-1])
    t = alloc.alloc_extend(torch.tensor([pre]), torch.tensor([seq_len]), torch.tensor([last]), owner=owner)
    assert t is not None
    return t if prefix is None else torch.cat([prefix, t])


def write_rows(alloc, end: str, vt: torch.Tensor, positions: list[int]) -> None:
    k, v = alloc.arena.kv_views(end, 0)
    phys = alloc.translate(vt[: len(positions)], end)
    for tok, x in zip(phys.tolist(), positions, strict=True):
        k[tok // 2, tok % 2] = code(end, x, 0)
        v[tok // 2, tok % 2] = code(end, x, 1)


def read_rows(alloc, end: str, vt: torch.Tensor, rows: list[int]) -> list[list[float]]:
    k, v = alloc.arena.kv_views(end, 0)
    phys = alloc.translate(vt[rows], end)
    return [[float(k[t // 2, t % 2, 0, 0]), float(v[t // 2, t % 2, 0, 0])] for t in phys.tolist()]


class Prefill:
    def __init__(self, q: int, p: int, L: int):
        self.alloc = MultiEndedAllocator(Arena(SPEC), debug_checks=True)
        mine = [x for x in range(L) if x % p == q]
        self.vt = {"full": extend(self.alloc, "full", len(mine)), "draft": extend(self.alloc, "draft", L)}
        write_rows(self.alloc, "full", self.vt["full"], mine)
        write_rows(self.alloc, "swa", self.vt["full"], mine)
        write_rows(self.alloc, "draft", self.vt["draft"], list(range(L)))
        # the prefill drops SWA pages wholly below its window tail: rows before the page of its first row >= L - W
        first = next((i for i, x in enumerate(mine) if x >= L - W), len(mine))
        if first // 2:
            self.alloc.unbind_end("swa", self.vt["full"][: (first // 2) * 2])
        self.layout = PeerLayout.from_arena(self.alloc.arena, dcp_rank=q, dcp_size=p)


class Decode:
    def __init__(self, r: int, d: int, L: int, P: int):
        arena = Arena(SPEC)
        arena.data.fill_(0xFF)
        self.alloc = MultiEndedAllocator(arena, debug_checks=True)
        self.mine = [x for x in range(L) if x % d == r]
        held = sum(1 for x in self.mine if x < P)
        pre = extend(self.alloc, "full", held) if held else None
        self.vt = {"full": extend(self.alloc, "full", len(self.mine), pre)}
        pre_d = extend(self.alloc, "draft", P) if P else None
        self.vt["draft"] = extend(self.alloc, "draft", L, pre_d)
        self.layout = PeerLayout.from_arena(arena, dcp_rank=r, dcp_size=d)


@pytest.mark.parametrize("p,d", [(1, 8), (8, 8), (1, 1), (2, 4), (4, 2)])
@pytest.mark.parametrize("L,P", [(37, 0), (37, 13), (45, 0)])
def test_dcp_plans_deliver_rank_local_rows_and_the_full_draft(p, d, L, P):
    prefills = [Prefill(q, p, L) for q in range(p)]
    decodes = [Decode(r, d, L, P) for r in range(d)]
    check_compatible(prefills[0].layout, decodes[-1].layout)  # DCP sizes may differ
    for r, dec in enumerate(decodes):
        half = build_receiver_half("req", dec.alloc, dec.vt, seq_len_tokens=L, prefix_tokens=P, layout=dec.layout)
        wire = json.loads(json.dumps(half.to_dict()))
        senders = source_ranks(r, d, p)
        for q, pre in enumerate(prefills):
            plan = build_send_plan("req", pre.alloc, pre.vt, wire, dec.layout, src_layout=pre.layout)
            # only the ranks listed by source_ranks send anything, and the draft comes from exactly one of them
            assert plan.vectors["target"].empty == (q not in senders["sharded"])
            assert plan.vectors["draft"].empty == (q not in senders["replicated"] or P == L)
            for s, t, n in plan.descriptors().tolist():
                ctypes.memmove(t, s, n)
            plan.complete()
            assert pre.alloc.leases_active() == 0
        half.complete()
        assert dec.alloc.leases_active() == 0
        # target rows: position j * d + r in local row j, from whichever prefill rank held it
        mine = dec.mine
        got = read_rows(dec.alloc, "full", dec.vt["full"], list(range(len(mine))))
        for j, x in enumerate(mine):
            if x >= P:
                assert got[j] == [code("full", x, 0), code("full", x, 1)], (r, j, x)
            else:
                assert all(v != v for v in got[j]), f"rank {r} row {j} (position {x} < P) was overwritten"
        # SWA rows: the window's positions arrived; the receiver's prefix rows are untouched
        in_window = [j for j, x in enumerate(mine) if x >= max(P, L - W)]
        got = read_rows(dec.alloc, "swa", dec.vt["full"], in_window)
        assert got == [[code("swa", mine[j], 0), code("swa", mine[j], 1)] for j in in_window]
        held = [j for j, x in enumerate(mine) if x < P]
        assert all(v != v for row in read_rows(dec.alloc, "swa", dec.vt["full"], held) for v in row)
        # the draft keeps logical rows on every decode rank
        got = read_rows(dec.alloc, "draft", dec.vt["draft"], list(range(L)))
        assert got[P:] == [[code("draft", x, 0), code("draft", x, 1)] for x in range(P, L)]
        assert all(v != v for row in got[:P] for v in row)
        dec.alloc.check_invariants()


def test_p8_d8_is_page_to_page_and_p1_d8_row_by_row():
    L = 37
    pre1, pre8 = Prefill(0, 1, L), Prefill(3, 8, L)
    dec = Decode(3, 8, L, 0)
    half = build_receiver_half("req", dec.alloc, dec.vt, seq_len_tokens=L, layout=dec.layout)
    # rank 3 of 8 holds positions 3, 11, 19, 27, 35: 5 rows = 3 pages of 2 rows
    assert half.vectors["target"].row_hi == 5 and len(half.vectors["target"].pages) == 3
    same = build_send_plan("req", pre8.alloc, pre8.vt, half, dec.layout, src_layout=pre8.layout)
    assert (same.vectors["target"].num_pages, same.vectors["target"].num_rows) == (3, 0)
    regather = build_send_plan("req", pre1.alloc, pre1.vt, half, dec.layout, src_layout=pre1.layout)
    v = regather.vectors["target"]
    assert (v.num_pages, v.num_rows) == (0, 5)
    # rows of positions 3, 11, ... are 8 apart on the prefill: no two coalesce; K and V per row
    assert regather.stats_by_vector["target"].descriptors == 5 * 2
    ps = 2
    src_phys = pre1.alloc.translate(pre1.vt["full"][[3, 11, 19, 27, 35]], "full")
    assert v.src_rows.tolist() == src_phys.tolist()
    dst_pages = half.vectors["target"].pages.tolist()
    assert v.dst_rows.tolist() == [dst_pages[j // ps] * ps + j % ps for j in range(5)]
    same.abort()
    regather.abort()
    half.abort()
