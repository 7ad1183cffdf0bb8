"""Compaction planning: which live pages move into which holes so a band's watermark can retreat.

Policy:

* Planning is pure: the planners read an end's page ``state`` (:mod:`umalloc.pool.pagestate`) and the lease pin
  counts and return the moves; they change nothing. :func:`apply_plan` (or the allocator) executes a plan.
* A *survivor walk* with two pointers picks the moves: one pointer walks the live pages from the band's far
  edge toward the anchor, the other the holes from the anchor outward; the walk takes the next (source, hole)
  while the hole is nearer the anchor than the source and the move budget lasts. So a budget of ``k`` moves
  the ``k`` farthest movable pages into the ``k`` nearest holes.
* The chosen pages are paired *order-preserving*: ``src_pages`` and ``dst_pages`` are both ascending and
  ``src_pages[i] -> dst_pages[i]``. Any pairing of the chosen sets is legal (every chosen hole is nearer the
  anchor than every chosen source); this one keeps physically contiguous runs contiguous, so blocks of a
  request stay few transfer descriptors and a flush copies whole runs.
* Pinned pages (leases) and pending pages (freed while pinned) are walls (Note [Leases and compaction] in
  :mod:`umalloc.leases.table`): they are never a source, never a destination, and the watermark never retreats past
  them. Live pages between the anchor and the farthest wall never move: moving them could not lower the
  watermark, so it would be wasted bytes.
* After the moves the watermark retreats past every trailing unpinned hole, also when the budget allowed no
  move (a free retreat).
* Applying a plan: copy the bytes ``src -> dst`` in ONE batched envelope copy per flush (:func:`copy_moves`:
  one ``memcpy`` per coalesced run on CPU, on the calling thread or split over the caller's torch thread count;
  run-wise or gather/scatter on CUDA; it never changes the
  caller's threading, Note [Compaction copies and threads]), then rewrite ``p2v``/``v2p`` and the states;
  virtual ids never change, only the physical page behind them. Pages between the old and the new watermark
  become gap.
* Planning is one O(band) numba pass with no allocation beyond the result (a 64k-page band plans in 0.2-0.8
  ms on one CPU core here); applying is O(moved pages * page_bytes) bytes.

Exact orders (asserted by tests/pool/test_compaction.py)::

    up-end, band [first, wm)                 anchor = first, far edge = wm - 1
      walk sources : live unpinned pages above the highest wall, highest first
      walk holes   : unpinned holes in the band, lowest first
      new wm       : 1 + highest page still live / pending / pinned after the moves (first if none)

    down-end, band (wm, top]                 anchor = top, far edge = wm + 1 (next to the gap)
      walk sources : live unpinned pages below the lowest wall, lowest first
      walk holes   : unpinned holes in the band, highest first
      new wm       : (lowest page still live / pending / pinned after the moves) - 1 (top if none)

    every plan: src_pages ascending, dst_pages ascending, src_pages[i] -> dst_pages[i]

    float end, band [lo, hi)                 free_edge="high": anchor = lo, like an up-end -> new hi
                                             free_edge="low" : anchor = hi - 1, like a down-end -> new lo

Example (up-end, first = 1, wm = 9; L live, . hole, P live and pinned)::

    page   1 2 3 4 5 6 7 8       wall: 3; walk sources above it, highest first: 8, 7, 5; walk holes,
    state  L . P . L . L L       lowest first: 2, 4, 6; takes (8, 2), (7, 4), stops at (5, 6): 6 is farther
    after  L L P L L . . .       than 5. Moves, order-preserving: 7->2, 8->4. Trailing holes: wm = 6

Note [Page moves and pins]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A move is legal only if neither end of it is pinned: a lease publishes addresses, so the bytes at a pinned page
must stay where they are (source side) and nothing else may land there (destination side). The planners take
the pin counts as an argument instead of a boolean gate so that one pinned page blocks only itself and the
watermark behind it, never the whole end (the coarse gate of public systems was left closed by abort paths).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numba
import numpy as np
import torch

from umalloc.errors import InvariantError, UmallocValueError
from umalloc.pool.kernels import raw
from umalloc.pool.pagestate import PAGE_GAP, PAGE_HOLE, PAGE_LIVE, PAGE_PENDING, TOMBSTONE
from umalloc.translators.cpu import pages_to_runs, pages_to_runs_numpy

if TYPE_CHECKING:
    from collections.abc import Iterator

    from umalloc.geometry.arena import Arena

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.setflags(write=False)

#: ``grow`` labels a plan carries.
UP = "up"
DOWN = "down"
FLOAT = "float"


@dataclass(frozen=True)
class MovePlan:
    """Moves planned for one end; unpacks as ``src_pages, dst_pages, new_watermark`` (up/down) or
    ``src_pages, dst_pages, new_lo, new_hi`` (float).

    Attributes:
        grow: ``"up"``, ``"down"`` or ``"float"``.
        src_pages: int64 ``(n,)`` physical pages to move from, in move order.
        dst_pages: int64 ``(n,)`` physical pages to move to; ``dst_pages[i]`` receives ``src_pages[i]``.
        old_lo, old_hi: the band before, as a half-open page range ``[old_lo, old_hi)``.
        new_lo, new_hi: the band after the moves and the retreat.
        skipped_pinned: walls (pinned or pending pages) lying beyond the nearest usable hole, i.e. pages a walk
            without leases would have had to consider moving.
    """

    grow: str
    src_pages: np.ndarray
    dst_pages: np.ndarray
    old_lo: int
    old_hi: int
    new_lo: int
    new_hi: int
    skipped_pinned: int

    @property
    def num_moves(self) -> int:
        return int(self.src_pages.size)

    @property
    def new_watermark(self) -> int:
        """Up-end: the new ``wm`` of band ``[first, wm)``; down-end: the new ``wm`` of band ``(wm, top]``."""
        if self.grow == UP:
            return self.new_hi
        if self.grow == DOWN:
            return self.new_lo - 1
        raise UmallocValueError("new_watermark: a float band has two edges; use new_lo/new_hi")

    @property
    def retreated_pages(self) -> int:
        """Pages the band gave back to the gap."""
        return (self.old_hi - self.old_lo) - (self.new_hi - self.new_lo)

    def __iter__(self) -> Iterator[object]:
        if self.grow == FLOAT:
            return iter((self.src_pages, self.dst_pages, self.new_lo, self.new_hi))
        return iter((self.src_pages, self.dst_pages, self.new_watermark))


# ---- validation -----------------------------------------------------------------------------------------
def _check_arrays(state: np.ndarray, pins: np.ndarray) -> None:
    if not isinstance(state, np.ndarray) or state.ndim != 1 or state.dtype != np.int8:
        raise UmallocValueError(f"state: allowed a 1-D int8 numpy array, got {type(state).__name__} "
                                f"{getattr(state, 'dtype', '')}")
    if not isinstance(pins, np.ndarray) or pins.shape != state.shape or pins.dtype.kind not in "iu":
        raise UmallocValueError(f"pins: allowed an integer numpy array of shape {state.shape}, got "
                                f"{type(pins).__name__} {getattr(pins, 'dtype', '')} {getattr(pins, 'shape', '')}")


def _check_budget(budget_pages: int | None) -> int:
    if budget_pages is None:
        return 1 << 62
    if isinstance(budget_pages, bool) or not isinstance(budget_pages, (int, np.integer)) or budget_pages < 0:
        raise UmallocValueError(f"budget_pages={budget_pages!r}: allowed None or an int >= 0")
    return int(budget_pages)


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        raise UmallocValueError(f"{name}={value!r}: allowed an int in [{lo}, {hi}]")
    return int(value)


@numba.njit(cache=True, nogil=True)
def _walk(state: np.ndarray, pins: np.ndarray, anchor: int, n: int, step: int, budget: int,
          src: np.ndarray, dst: np.ndarray) -> tuple[int, int, int, int]:  # pragma: no cover - numba
    """Survivor walk over the band pages ``anchor + step * i``, ``i in [0, n)`` (``i = 0`` nearest the anchor).

    Writes the chosen relative indices to ``src`` (descending) and ``dst`` (ascending) and returns
    ``(k, new_len, skipped, bad)``: k moves, the band keeps relative indices ``[0, new_len)`` after them,
    ``skipped`` walls beyond the nearest usable hole, ``bad`` the first relative index whose state is neither
    hole, live nor pending (-1 if none; then nothing else is meaningful). One pass to validate and find the
    farthest wall, one two-pointer pass, one short retreat scan: O(n), no allocation.
    """
    last_wall = -1
    first_hole = -1
    for i in range(n):
        st = state[anchor + step * i]
        if st != PAGE_HOLE and st != PAGE_LIVE and st != PAGE_PENDING:
            return 0, 0, 0, i
        if st == PAGE_PENDING or pins[anchor + step * i] > 0:
            last_wall = i
        elif st == PAGE_HOLE and first_hole < 0:
            first_hole = i
    skipped = 0
    if first_hole >= 0:
        for i in range(first_hole + 1, last_wall + 1):
            p = anchor + step * i
            if state[p] == PAGE_PENDING or pins[p] > 0:
                skipped += 1
    d = 0
    s = n - 1
    k = 0
    while k < budget:
        while d < n and not (state[anchor + step * d] == PAGE_HOLE and pins[anchor + step * d] == 0):
            d += 1
        while s > last_wall and not (state[anchor + step * s] == PAGE_LIVE and pins[anchor + step * s] == 0):
            s -= 1
        if s <= last_wall or d >= s:
            break
        src[k] = s
        dst[k] = d
        k += 1
        d += 1
        s -= 1
    # Every page at or beyond the nearest source is a hole after the moves (beyond the farthest wall there are
    # only unpinned holes and live pages, and the walk took every live one); every destination lies nearer.
    i = n - 1
    floor = -1
    if k:
        i = src[k - 1] - 1
        floor = dst[k - 1]
    while i > floor:
        p = anchor + step * i
        if state[p] == PAGE_HOLE and pins[p] == 0:
            i -= 1
        else:
            break
    return k, i + 1, skipped, -1


def _run_walk(state: np.ndarray, pins: np.ndarray, anchor: int, n: int, step: int,
              budget: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """:func:`_walk` plus the error path; returns ``(src_rel ascending, dst_rel ascending, new_len, skipped)``
    paired order-preserving in relative coordinates."""
    if n == 0:
        return _EMPTY, _EMPTY, 0, 0
    src = np.empty(n, np.int64)
    dst = np.empty(n, np.int64)
    k, new_len, skipped, bad = _walk(state, pins, anchor, n, step, budget, src, dst)
    if bad >= 0:
        page = anchor + step * bad
        raise InvariantError(f"page {page} inside the band has state {int(state[page])}; a band holds only "
                             f"holes ({PAGE_HOLE}), live ({PAGE_LIVE}) and pending ({PAGE_PENDING}) pages")
    return src[:k][::-1].copy(), dst[:k].copy(), int(new_len), int(skipped)


def plan_up(state: np.ndarray, pins: np.ndarray, first_page: int, watermark: int,
            budget_pages: int | None = None) -> MovePlan:
    """Plan compaction of an up-end band ``[first_page, watermark)`` toward ``first_page``.

    Args:
        state: int8 ``(num_page_slots,)`` page states (:mod:`umalloc.pool.pagestate`); band pages must be hole, live or
            pending.
        pins: integer ``(num_page_slots,)`` pin counts (:meth:`LeaseTable.pin_count`).
        first_page: lowest handable page (``ArenaSpec.first_page``).
        watermark: the band's exclusive upper edge.
        budget_pages: at most this many moves (``None``: unlimited; 0 plans only the free retreat).

    Returns:
        :class:`MovePlan` (unpacks as ``src_pages, dst_pages, new_watermark``). The walk takes sources among
        the live unpinned pages above the highest wall, highest first, and holes among the unpinned holes,
        lowest first, while hole < source and the budget lasts; the chosen pages are returned ascending and
        paired order-preserving (``src_pages[i] -> dst_pages[i]``). ``new_watermark`` = 1 + the highest page
        still live/pending/pinned after the moves (``first_page`` if none).

    Raises:
        UmallocValueError: bad array, range or budget. InvariantError: a band page that is reserved or gap.

    Complexity: O(watermark - first_page), one numba pass.

    >>> from umalloc.pool.pagestate import PAGE_HOLE as H, PAGE_LIVE as L, PAGE_GAP as G, PAGE_RESERVED as R
    >>> state = np.array([R, L, H, L, H, L, L, G], dtype=np.int8)
    >>> src, dst, wm = plan_up(state, np.zeros(8, np.int32), 1, 7)
    >>> src.tolist(), dst.tolist(), wm
    ([5, 6], [2, 4], 5)
    """
    _check_arrays(state, pins)
    first = _check_int("first_page", first_page, 0, state.size)
    wm = _check_int("watermark", watermark, first, state.size)
    budget = _check_budget(budget_pages)
    src, dst, new_len, skipped = _run_walk(state, pins, first, wm - first, 1, budget)
    return MovePlan(UP, src + first, dst + first, first, wm, first, first + new_len, skipped)


def plan_down(state: np.ndarray, pins: np.ndarray, top_page: int, watermark: int,
              budget_pages: int | None = None) -> MovePlan:
    """Plan compaction of a down-end band ``(watermark, top_page]`` toward ``top_page`` (the mirror of
    :func:`plan_up`: the far edge is the band's LOW edge, next to the gap).

    Returns:
        :class:`MovePlan` (unpacks as ``src_pages, dst_pages, new_watermark``). The walk takes sources among
        the live unpinned pages below the lowest wall, lowest first, and holes among the unpinned holes,
        highest first, while hole > source and the budget lasts; the chosen pages are returned ascending and
        paired order-preserving. ``new_watermark`` = (lowest page still live/pending/pinned after the moves) - 1
        (``top_page`` if none).

    Raises:
        UmallocValueError: bad array, range or budget. InvariantError: a band page that is reserved or gap.

    Complexity: O(top_page - watermark), one numba pass.

    >>> from umalloc.pool.pagestate import PAGE_HOLE as H, PAGE_LIVE as L, PAGE_GAP as G, PAGE_RESERVED as R
    >>> state = np.array([R, G, L, L, H, L, H, L], dtype=np.int8)     # band (1, 7]
    >>> src, dst, wm = plan_down(state, np.zeros(8, np.int32), 7, 1)
    >>> src.tolist(), dst.tolist(), wm      # walk: (2, 6), (3, 4); order-preserving: 2->4, 3->6
    ([2, 3], [4, 6], 3)
    """
    _check_arrays(state, pins)
    top = _check_int("top_page", top_page, 0, state.size - 1)
    wm = _check_int("watermark", watermark, -1, top)
    budget = _check_budget(budget_pages)
    src, dst, new_len, skipped = _run_walk(state, pins, top, top - wm, -1, budget)
    # relative ascending is physical descending: reverse both to keep src/dst ascending (still order-preserving)
    return MovePlan(DOWN, (top - src)[::-1].copy(), (top - dst)[::-1].copy(), wm + 1, top + 1,
                    top + 1 - new_len, top + 1, skipped)


def plan_float(state: np.ndarray, pins: np.ndarray, lo: int, hi: int, *, free_edge: str,
               budget_pages: int | None = None) -> MovePlan:
    """Plan compaction of a floating band ``[lo, hi)``, freeing space at ``free_edge``.

    ``free_edge="high"`` compacts toward ``lo`` exactly like :func:`plan_up` (the band's high edge retreats);
    ``free_edge="low"`` compacts toward ``hi - 1`` exactly like :func:`plan_down` (the low edge rises).

    Returns:
        :class:`MovePlan` (unpacks as ``src_pages, dst_pages, new_lo, new_hi``).

    >>> from umalloc.pool.pagestate import PAGE_HOLE as H, PAGE_LIVE as L, PAGE_GAP as G
    >>> state = np.array([G, G, L, H, L, H, G, G], dtype=np.int8)     # band [2, 6)
    >>> tuple(plan_float(state, np.zeros(8, np.int32), 2, 6, free_edge="low"))[2:]
    (4, 6)
    """
    _check_arrays(state, pins)
    lo_ = _check_int("lo", lo, 0, state.size)
    hi_ = _check_int("hi", hi, lo_, state.size)
    if free_edge == "high":
        p = plan_up(state, pins, lo_, hi_, budget_pages)
    elif free_edge == "low":
        p = plan_down(state, pins, hi_ - 1, lo_ - 1, budget_pages) if hi_ > lo_ else \
            MovePlan(DOWN, _EMPTY, _EMPTY, lo_, hi_, lo_, hi_, 0)
    else:
        raise UmallocValueError(f"free_edge={free_edge!r}: allowed 'low' or 'high'")
    return MovePlan(FLOAT, p.src_pages, p.dst_pages, lo_, hi_, p.new_lo, p.new_hi, p.skipped_pinned)


# ---- execution --------------------------------------------------------------------------------------------
#: On CUDA, plans with at most this many runs are copied run by run (one memcpy each), else gather/scatter.
MAX_RUNWISE_COPIES = 32
#: CPU copies of at least this many bytes may use several threads, if the caller's torch thread count allows
#: (Note [Compaction copies and threads]); smaller ones always run on the calling thread. torch's own copy
#: splits from 32 KiB; a numba parallel region costs tens of microseconds to enter, so 1 MiB.
PARALLEL_COPY_MIN_BYTES = 1 << 20
#: A parallel CPU copy of at most this many runs is torch's ``copy_`` per run (its own threads, as a plain copy).
MAX_TORCH_RUNS = 8
#: A parallel CPU copy of more runs splits them into byte ranges of at most this size (about four per thread) and at
#: least ``_MIN_CHUNK_BYTES``, so threads share long and short runs alike.
_MIN_CHUNK_BYTES = 64 << 10


def _copy_rows_cpu(env: torch.Tensor, src: np.ndarray, dst: np.ndarray) -> None:
    """Whole-row copies of a contiguous CPU ``uint8 (rows, page_bytes)`` view (Note [Compaction copies and
    threads]): below ``PARALLEL_COPY_MIN_BYTES`` or with one torch thread, one numba pass on the calling thread
    that checks every page, coalesces runs and ``memcpy``s each (:func:`umalloc.pool.kernels.raw.copy_pages`);
    else the runs (:func:`umalloc.translators.cpu.pages_to_runs_numpy`) copied by torch's own ``copy_`` when
    they are at most ``MAX_TORCH_RUNS``, or split into byte ranges ``memcpy``d on ``min(torch, numba)`` threads.
    Raises InvariantError for a page outside the rows (nothing copied)."""
    rows, pb = int(env.shape[0]), int(env.shape[1])
    base = int(env.data_ptr())
    threads = torch.get_num_threads()
    nbytes = int(src.size) * pb
    if threads < 2 or nbytes < PARALLEL_COPY_MIN_BYTES:
        r = int(raw.copy_pages(base, src, dst, pb, rows))
        if r < 0:
            i = -1 - r
            raise InvariantError(f"copy_moves: page {int(src[i])} -> {int(dst[i])} outside the end's {rows} page "
                                 f"slots")
        return
    if int(min(src.min(), dst.min())) < 0 or int(max(src.max(), dst.max())) >= rows:
        raise InvariantError(f"copy_moves: a page outside the end's {rows} page slots")
    runs = pages_to_runs_numpy(src, dst)
    if runs.shape[0] <= MAX_TORCH_RUNS:
        for s0, d0, m in runs.tolist():
            env[d0:d0 + m].copy_(env[s0:s0 + m])
        return
    chunk = max(_MIN_CHUNK_BYTES, -(-nbytes // (4 * threads)))
    chunks = np.empty((runs.shape[0] + nbytes // chunk + 1, 3), np.int64)
    c = int(raw.split_runs(runs, pb, chunk, chunks))
    numba_threads = numba.get_num_threads()  # starts numba's pool (which may reset torch's count: restored below)
    try:
        numba.set_num_threads(min(threads, numba_threads))
        raw.copy_chunks(base, chunks[:c])
    finally:
        numba.set_num_threads(numba_threads)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def copy_moves(arena: Arena, end: str, src_pages: np.ndarray, dst_pages: np.ndarray) -> int:
    """Copy whole envelopes ``src_pages[i] -> dst_pages[i]`` of ``end`` as one batched copy; returns bytes.

    The two page sets must be disjoint (a plan's sources are live pages, its destinations holes), so the copy
    order does not matter. CPU: the pages coalesced into runs, one ``memcpy`` per run on the calling thread, or
    from ``PARALLEL_COPY_MIN_BYTES`` on at most ``torch.get_num_threads()`` threads (few runs: torch's ``copy_``
    per run; many: byte ranges ``memcpy``d by numba; Note [Compaction copies and threads]); every page is checked
    to lie inside the end's page slots first (InvariantError otherwise, nothing copied). CUDA:
    run-wise ``copy_`` when the plan has at most
    ``MAX_RUNWISE_COPIES`` runs (:func:`umalloc.translators.cpu.pages_to_runs`, the one run-coalescing
    implementation), else one ``index_select`` + ``index_copy_``. Complexity: O(n * page_bytes).

    Note [Compaction copies and threads]
        The caller's torch thread count is the copy's thread budget: with 1 thread (the replay) the copy stays
        on the calling thread and no thread pool starts; with more, copies from ``PARALLEL_COPY_MIN_BYTES`` run
        on torch's threads (at most ``MAX_TORCH_RUNS`` runs: torch's ``copy_`` per run, as a plain copy of those
        bytes) or on ``min(torch, numba)`` numba threads (more runs: byte ranges of about a quarter of a
        thread's share), and both counts are restored afterwards (tested). Under numba's OpenMP layer, starting the
        thread pool sets the calling thread's OpenMP thread count, which torch shares: a copy that started
        the pool regardless of the caller's budget would raise a 1-thread caller to 2 threads, and its token
        loop runs 3-5x slower on 2 cores (``umalloc replay --compaction eager`` 6x slower than lazy on 30
        requests). ``benchmarks/bench_compaction.py`` prints the copy against a torch copy of the same bytes
        at one and two threads in the same run.
    """
    n = int(src_pages.size)
    if n == 0:
        return 0
    env = arena.envelopes(end)
    pb = int(env.shape[1])
    if env.device.type == "cpu" and env.is_contiguous():
        _copy_rows_cpu(env, np.ascontiguousarray(src_pages, dtype=np.int64),
                       np.ascontiguousarray(dst_pages, dtype=np.int64))
        return n * pb
    runs = pages_to_runs(src_pages, dst_pages)
    if runs.shape[0] <= MAX_RUNWISE_COPIES:
        for s0, d0, m in runs.tolist():
            env[d0:d0 + m].copy_(env[s0:s0 + m])
    else:
        src_t = torch.from_numpy(np.ascontiguousarray(src_pages, dtype=np.int64)).to(env.device, non_blocking=True)
        dst_t = torch.from_numpy(np.ascontiguousarray(dst_pages, dtype=np.int64)).to(env.device, non_blocking=True)
        env.index_copy_(0, dst_t, env.index_select(0, src_t))
    return n * pb


def apply_plan(arena: Arena, end: str, plan: MovePlan, *, state: np.ndarray, p2v: np.ndarray,
               v2p: np.ndarray, pins: np.ndarray | None = None) -> int:
    """Execute ``plan`` on ``end``: one batched envelope copy ``src -> dst``, then the host tables.

    After it returns: ``p2v[dst] = old p2v[src]``, ``p2v[src] = TOMBSTONE``, ``v2p[vpage] = dst`` for each moved
    virtual page, ``state[dst] = LIVE``, ``state[src] = HOLE``, and the pages between the old and the new band
    edges are ``GAP``. The caller still owns: the watermark variable(s), device mirrors of ``v2p``, free-hole
    bookkeeping and counters. Virtual ids are unchanged.

    Args:
        arena: the arena holding ``end``'s bytes.
        end: end name.
        plan: a plan from :func:`plan_up` / :func:`plan_down` / :func:`plan_float` computed on these arrays
            with no change in between.
        state: int8 ``(num_page_slots(end),)``; p2v: int64 ``(num_page_slots(end),)``; v2p: int64
            ``(num_vpages(owner),)``; all modified in place.
        pins: optional pin counts, to re-check that no moved page is pinned (Note [Page moves and pins]).

    Returns:
        bytes moved (``num_moves * page_bytes``).

    Raises:
        InvariantError: the plan no longer matches the tables (a source not live, a destination not an
            unpinned hole, a pinned page, a retreated page still occupied). Nothing changes in that case.

    Complexity: O(n * page_bytes) for the copy + O(n + retreated pages) table writes.
    """
    src, dst = plan.src_pages, plan.dst_pages
    if src.shape != dst.shape:
        raise InvariantError("plan: src_pages and dst_pages differ in length")
    src = np.ascontiguousarray(src, dtype=np.int64)
    dst = np.ascontiguousarray(dst, dtype=np.int64)
    band = np.array([plan.old_lo, plan.new_lo, plan.new_hi, plan.old_hi], np.int64)
    fault = int(_plan_fault(state, _EMPTY_PINS if pins is None else pins, pins is not None, p2v, v2p.shape[0], src,
                            dst, band))
    if fault:
        raise InvariantError(f"plan for {end!r}: {_FAULTS[fault]}")
    moved_bytes = copy_moves(arena, end, src, dst) if src.size else 0
    _rewrite_tables(state, p2v, v2p, src, dst, band)
    return moved_bytes


_EMPTY_PINS = np.zeros(0, np.int32)
_FAULTS = {1: "a source page is not live", 2: "a destination page is not a hole",
           3: "moves a pinned page (Note [Page moves and pins])",
           4: "the band would retreat past an occupied page", 5: "the band would retreat past a pinned page",
           6: "a live source page has no virtual page", 7: "a page or band edge outside the end's page slots"}


@numba.njit(cache=True, nogil=True)
def _plan_fault(state, pins, has_pins, p2v, num_vpages, src, dst, band):  # pragma: no cover - numba
    """The first fault of a plan against the tables (a key of ``_FAULTS``), 0 if none; reads only.
    O(moves + retreated pages)."""
    slots = state.shape[0]
    if band[0] < 0 or band[0] > band[1] or band[2] > band[3] or band[3] > slots:
        return 7
    for i in range(src.shape[0]):
        if src[i] < 0 or src[i] >= slots or dst[i] < 0 or dst[i] >= slots:
            return 7
    for i in range(src.shape[0]):
        if state[src[i]] != PAGE_LIVE:
            return 1
    for i in range(dst.shape[0]):
        if state[dst[i]] != PAGE_HOLE:
            return 2
    if has_pins:
        for i in range(src.shape[0]):
            if pins[src[i]] > 0 or pins[dst[i]] > 0:
                return 3
    if band[0] != band[1] or band[2] != band[3]:
        after = state.copy()
        for i in range(src.shape[0]):
            after[src[i]] = PAGE_HOLE
        for i in range(dst.shape[0]):
            after[dst[i]] = PAGE_LIVE
        for lo, hi in ((band[0], band[1]), (band[2], band[3])):
            for p in range(lo, hi):
                if after[p] != PAGE_HOLE:
                    return 4
                if has_pins and pins[p] > 0:
                    return 5
    for i in range(src.shape[0]):
        if p2v[src[i]] < 0 or p2v[src[i]] >= num_vpages:   # TOMBSTONE included
            return 6
    return 0


@numba.njit(cache=True, nogil=True)
def _rewrite_tables(state, p2v, v2p, src, dst, band):  # pragma: no cover - numba
    """After the bytes moved: ``p2v`` / ``v2p`` / states of the moved pages, and the retreated pages' states."""
    for i in range(src.shape[0]):
        vp = p2v[src[i]]
        p2v[dst[i]] = vp
        v2p[vp] = dst[i]
    for i in range(src.shape[0]):
        p2v[src[i]] = TOMBSTONE
        state[src[i]] = PAGE_HOLE
    for i in range(dst.shape[0]):
        state[dst[i]] = PAGE_LIVE
    for p in range(band[0], band[1]):
        state[p] = PAGE_GAP
    for p in range(band[2], band[3]):
        state[p] = PAGE_GAP


# ---- reporting --------------------------------------------------------------------------------------------
@dataclass
class CompactionReport:
    """What one or more compaction flushes did. Reports add up with ``+``.

    Attributes:
        pages_moved: pages copied to a new physical page.
        bytes_moved: bytes copied (``pages * page_bytes`` summed over ends).
        pages_skipped_pinned: walls met (see :attr:`MovePlan.skipped_pinned`), summed over flushes.
        flushes: batched copies issued (plans with at least one move).
        retreated_pages: pages given back to the gap.
        watermarks: end -> the watermark after the last flush (float end: ``(lo, hi)``).
        moved_by_end: end -> pages moved.

    >>> r = CompactionReport(pages_moved=2, bytes_moved=64, flushes=1, watermarks={"full": 3})
    >>> s = r + CompactionReport(pages_moved=1, bytes_moved=16, flushes=1, watermarks={"swa": 9})
    >>> s.pages_moved, s.bytes_moved, s.flushes, s.watermarks
    (3, 80, 2, {'full': 3, 'swa': 9})
    """

    pages_moved: int = 0
    bytes_moved: int = 0
    pages_skipped_pinned: int = 0
    flushes: int = 0
    retreated_pages: int = 0
    watermarks: dict[str, int | tuple[int, int]] = field(default_factory=dict)
    moved_by_end: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_plan(cls, end: str, plan: MovePlan, page_bytes: int) -> CompactionReport:
        """The report of applying ``plan`` to ``end`` (whose pages are ``page_bytes`` each)."""
        wm: int | tuple[int, int] = (plan.new_lo, plan.new_hi) if plan.grow == FLOAT else plan.new_watermark
        return cls(pages_moved=plan.num_moves, bytes_moved=plan.num_moves * page_bytes,
                   pages_skipped_pinned=plan.skipped_pinned, flushes=1 if plan.num_moves else 0,
                   retreated_pages=plan.retreated_pages, watermarks={end: wm},
                   moved_by_end={end: plan.num_moves} if plan.num_moves else {})

    def __add__(self, other: CompactionReport) -> CompactionReport:
        if not isinstance(other, CompactionReport):
            return NotImplemented
        moved = dict(self.moved_by_end)
        for end, n in other.moved_by_end.items():
            moved[end] = moved.get(end, 0) + n
        return CompactionReport(
            pages_moved=self.pages_moved + other.pages_moved,
            bytes_moved=self.bytes_moved + other.bytes_moved,
            pages_skipped_pinned=self.pages_skipped_pinned + other.pages_skipped_pinned,
            flushes=self.flushes + other.flushes,
            retreated_pages=self.retreated_pages + other.retreated_pages,
            watermarks={**self.watermarks, **other.watermarks},
            moved_by_end=moved,
        )


__all__ = ["CompactionReport", "MovePlan", "apply_plan", "copy_moves", "plan_down", "plan_float", "plan_up"]
