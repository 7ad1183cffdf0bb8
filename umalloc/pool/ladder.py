"""The shortfall ladder: pure planning of compaction and float slides that let a short allocation fit.

Policy (Note [Shortfall], Note [Float slide]); every function here reads arrays and returns plans, nothing is
changed and no allocator object is involved (the allocator applies what :func:`plan_shortfall` returns):

Note [Shortfall]
~~~~~~~~~~~~~~~~
When an end cannot place its pages the ladder is: drain its holes, grow into the gap (both inside the one
planning kernel, for every end of the call at once); then -- unless ``compaction="off"`` -- plan room within
the move budget: compact the nearest present neighbour bounding each short end (the end above an up end frees
its low edge, the end below a down end its high edge; a float end as the case may be) and slide a float
neighbour away (Note [Float slide]). That plan is dry-run through the same planner first; only if the
allocation then fits does anything move, and the allocation is planned once more. Otherwise ``None`` with
nothing changed. ``MultiEndedAllocator.last_shortfall`` names each short end with its own deficit (F20).
``compaction="eager"`` also compacts the ends a ``free``/``unbind_end`` touched, right after it. Capacity
queries count holes and reachable gap only: never pending pages, never what compaction might free.

Note [Float slide]
~~~~~~~~~~~~~~~~~~
Compaction packs a band toward its anchor but cannot move a float end's band as a whole, so a float placed
early can wall in its neighbour for good. When an up (down) end falls short and its nearest present neighbour
above (below) is a float end, the ladder shifts the float: its pages at the edge facing the short end move, in
order, into the gap just past its other edge (one batched envelope copy), by just enough pages for the short
end's request. Pinned or pending pages never move (then there is no slide), and the slide counts against the
move budget.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from umalloc.pool.compaction import MovePlan, plan_down, plan_float, plan_up
from umalloc.pool.kernels.layout import (
    G_DOWN,
    G_FLOAT,
    G_UP,
    M_FIRST,
    M_GROW,
    M_HI,
    M_HOLES,
    M_LO,
    M_PB,
    M_TOP,
)
from umalloc.pool.kernels.placement import plan_band_growth
from umalloc.pool.pagestate import PAGE_GAP, PAGE_HOLE, PAGE_LIVE


def plan_end(meta: np.ndarray, e: int, state: np.ndarray, pins: np.ndarray, budget: int | None,
             free_edge: str = "high") -> MovePlan:
    """The compaction plan of end ``e`` (:mod:`umalloc.pool.compaction`'s planners); a float end frees
    ``free_edge``. O(band)."""
    g = int(meta[e, M_GROW])
    lo, hi = int(meta[e, M_LO]), int(meta[e, M_HI])
    if g == G_UP:
        return plan_up(state, pins, int(meta[e, M_FIRST]), hi, budget)
    if g == G_DOWN:
        return plan_down(state, pins, int(meta[e, M_TOP]), lo - 1, budget)
    return plan_float(state, pins, lo, hi, free_edge=free_edge, budget_pages=budget)


def state_after(state: np.ndarray, plan: MovePlan) -> np.ndarray:
    """An end's page states after ``plan`` (simulated on a copy)."""
    st = state.copy()
    if plan.num_moves:
        st[plan.src_pages] = PAGE_HOLE
        st[plan.dst_pages] = PAGE_LIVE
    st[plan.old_lo: plan.new_lo] = PAGE_GAP
    st[plan.new_hi: plan.old_hi] = PAGE_GAP
    return st


def neighbour_plans(meta: np.ndarray, chain: Sequence[int], short: Collection[int], states: Sequence[np.ndarray],
                    pins: Sequence[np.ndarray], budget: int | None) -> dict[int, MovePlan]:
    """Compaction plans for the nearest present ends that bound each short end's growth: the end above an up
    (or float) end frees its low edge, the end below a down (or float) end its high edge. One plan per end (the
    first short end in chain order decides a float's direction)."""
    plans: dict[int, MovePlan] = {}
    for pos, x in enumerate(chain):
        if x not in short:
            continue
        g = int(meta[x, M_GROW])
        dirs = []
        if g != G_DOWN:
            dirs.append((range(pos + 1, len(chain)), "low"))     # neighbour above: free its low edge
        if g != G_UP:
            dirs.append((range(pos - 1, -1, -1), "high"))        # neighbour below: free its high edge
        for rng, edge in dirs:
            for j in rng:
                n = chain[j]
                if meta[n, M_GROW] == G_FLOAT and meta[n, M_LO] == meta[n, M_HI]:
                    continue  # an empty float bounds nothing
                if n not in plans:
                    plan = plan_end(meta, n, states[n], pins[n], budget, edge)
                    if plan.num_moves or plan.retreated_pages:
                        plans[n] = plan
                break
    return plans


def float_slides(meta: np.ndarray, chain: Sequence[int], short: Collection[int], k: int, meta2: np.ndarray,
                 states: Sequence[np.ndarray], pins: Sequence[np.ndarray], budget: int | None, floor_bytes: int,
                 arena_bytes: int) -> dict[int, int]:
    """Note [Float slide]: for each short up (down) end whose nearest present neighbour above (below) is a float
    end, the pages that float must shift up (down, negative) so the short end's ``k`` pages fit below (above)
    it. ``states`` are the page states after the neighbour plans; updates ``meta2`` (bands) for the dry run. A
    slide is skipped if it would move a pinned or pending page, leave the arena, or exceed the move budget."""
    out: dict[int, int] = {}
    for pos, x in enumerate(chain):
        g = int(meta[x, M_GROW])
        if x not in short or g == G_FLOAT:
            continue
        step = 1 if g == G_UP else -1
        f = -1
        j = pos + step
        while 0 <= j < len(chain):
            n = chain[j]
            if meta[n, M_GROW] != G_FLOAT or meta2[n, M_LO] < meta2[n, M_HI]:
                f = n
                break
            j += step
        if f < 0 or meta[f, M_GROW] != G_FLOAT or f in out:
            continue
        need_x = max(0, k - int(meta2[x, M_HOLES]))
        pbx, pbf = int(meta2[x, M_PB]), int(meta2[f, M_PB])
        lo, hi = int(meta2[f, M_LO]), int(meta2[f, M_HI])
        if g == G_UP:
            m = -(-(int(meta2[x, M_HI]) + need_x) * pbx // pbf) - lo
            src = np.arange(lo, lo + m)
            dst_lo, dst_hi = hi, hi + m
        else:
            m = hi - (int(meta2[x, M_LO]) - need_x) * pbx // pbf
            src = np.arange(hi - m, hi)
            dst_lo, dst_hi = lo - m, lo
        if m <= 0 or m > hi - lo or (budget is not None and m > budget):
            continue
        if dst_lo < int(meta[f, M_FIRST]) or dst_hi > int(meta[f, M_TOP]) + 1:
            continue
        # the destination must lie in the gap before the next present end on the float's far side
        fpos = list(chain).index(f)
        far = range(fpos + 1, len(chain)) if g == G_UP else range(fpos - 1, -1, -1)
        bound = arena_bytes if g == G_UP else floor_bytes
        for jj in far:
            nn = chain[jj]
            if meta[nn, M_GROW] != G_FLOAT or meta2[nn, M_LO] < meta2[nn, M_HI]:
                bound = int(meta2[nn, M_LO] * meta2[nn, M_PB]) if g == G_UP else int(meta2[nn, M_HI] * meta2[nn, M_PB])
                break
        if (g == G_UP and dst_hi * pbf > bound) or (g == G_DOWN and dst_lo * pbf < bound):
            continue
        st = states[f]
        if not ((st[src] == PAGE_LIVE).all() and (pins[f][src] == 0).all()
                and (st[dst_lo:dst_hi] == PAGE_GAP).all()):
            continue
        out[f] = m * step
        meta2[f, M_LO], meta2[f, M_HI] = lo + m * step, hi + m * step
    return out


def slide_plan(lo: int, hi: int, shift: int) -> tuple[MovePlan, int, int]:
    """The move plan of a float band ``[lo, hi)`` shifted by ``shift`` pages (Note [Float slide]), and the
    widened band ``[wide_lo, wide_hi)`` it is applied over (the destination gap pages first become holes)."""
    m = abs(shift)
    if shift > 0:
        src, dst = np.arange(lo, lo + m, dtype=np.int64), np.arange(hi, hi + m, dtype=np.int64)
        wide = (lo, hi + m)
    else:
        src, dst = np.arange(hi - m, hi, dtype=np.int64), np.arange(lo - m, lo, dtype=np.int64)
        wide = (lo - m, hi)
    return MovePlan("float", src, dst, wide[0], wide[1], lo + shift, hi + shift, 0), wide[0], wide[1]


def plan_shortfall(meta: np.ndarray, chain: Sequence[int], bind: np.ndarray, short: Collection[int], k: int,
                   states: Sequence[np.ndarray], pins: Sequence[np.ndarray], budget: int | None, floor_bytes: int,
                   arena_bytes: int) -> tuple[dict[int, MovePlan], dict[int, int]] | None:
    """Note [Shortfall]: the neighbour compaction plans and float slides that make ``k`` pages fit on every end
    with ``bind[e]`` set, dry-run through the same band planner; ``None`` if nothing helps or it would still
    not fit (then nothing may move). ``short`` holds the short ends' indices; ``states``/``pins`` the ends'
    page states and pin counts (read only). O(ends * band)."""
    plans = neighbour_plans(meta, chain, short, states, pins, budget)
    E = meta.shape[0]
    meta2 = meta.copy()
    after = list(states)
    for e, plan in plans.items():
        meta2[e, M_LO], meta2[e, M_HI] = plan.new_lo, plan.new_hi
        after[e] = state_after(states[e], plan)
        meta2[e, M_HOLES] = int(np.count_nonzero(after[e][plan.new_lo: plan.new_hi] == PAGE_HOLE))
    slides = float_slides(meta, chain, short, k, meta2, after, pins, budget, floor_bytes, arena_bytes)
    if not plans and not slides:
        return None
    need = np.zeros(E, np.int64)
    for e in range(E):
        if bind[e]:
            need[e] = max(0, k - int(meta2[e, M_HOLES]))
    nlo, nhi, deficit = np.empty(E, np.int64), np.empty(E, np.int64), np.empty(E, np.int64)
    if plan_band_growth(meta2, np.asarray(chain, np.int64), need, nlo, nhi, deficit) > 0:
        return None  # compaction within the budget would not make it fit: move nothing
    return plans, slides


__all__ = ["float_slides", "neighbour_plans", "plan_end", "plan_shortfall", "slide_plan", "state_after"]
