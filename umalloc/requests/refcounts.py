"""The state of a :class:`~umalloc.requests.table.RequestTable` as arrays, and the numba kernels over them.

One concept: who holds which virtual page. Per request slot (``rq``, int64 ``[2 + NB, R]``): its length, whether
the slot is in use, and per bound end ``b`` its *front* (the first page index it holds there). Per virtual page
(``pg``, int32 ``[3 + NB, NV]``): its holder count, the engine's references, its state (not the table's, held,
cached) and per bound end the requests holding it there. The cached pages form a doubly linked LRU list in
``lru`` (int64 ``[2, NV]``: previous / next; virtual page 0 is the sentinel). ``r2p`` (int64 ``[R, MP]``) and
``r2t`` (``[R, MT]``, int32 or int64) are the per-request page and token tables. Every kernel takes numpy arrays
and scalars, writes results into ``info`` (int64: error code, position, value, then counts) and bounds every
write by the shapes it is given. :func:`check_state` recomputes every count from the tables (O(R * MT + NV)).

The policies (what a front is, when a page is copied or cached) are the table's: Notes in
:mod:`umalloc.requests.table`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from numba import njit

from umalloc.errors import (
    DoubleFreeError,
    InvalidIdError,
    InvariantError,
    NotAllocatedError,
    UmallocValueError,
)
from umalloc.pool.pagestate import TOMBSTONE

# ---- per-request rows of ``rq`` (int64 [2 + NB, R]) and per-page rows of ``pg`` (int32 [3 + NB, NV]) --------
RQ_LEN, RQ_INUSE, RQ_FRONT = 0, 1, 2
PG_REF, PG_ENG, PG_STATE, PG_NEED = 0, 1, 2, 3
#: page states (``pg[PG_STATE]``)
PAGE_NOT_MANAGED, PAGE_HELD, PAGE_CACHED = 0, 1, 2
LRU_PREV, LRU_NEXT = 0, 1   # LRU links (int64 [2, NV]); virtual page 0 is the list's sentinel

# ---- kernel result slots (``info``, int64) -----------------------------------------------------------------
I_CODE, I_POS, I_VAL, I_PAGES, I_TOTAL, I_NCOW, I_NFREED, I_NCACHED, I_REL = range(9)
E_RANGE, E_FREE_SLOT, E_DUP, E_NEG, E_LONG, E_TRUNC = range(1, 7)   # 0: ok


# ---- kernels. Each validates its whole batch before it writes anything (``k_grow_plan`` writes only after its
# validation loop has passed) ----------------------------------------------------------------------------------
@njit(cache=True)
def _fail(info, code, pos, value):
    info[I_CODE] = code
    info[I_POS] = pos
    info[I_VAL] = value


@njit(cache=True)
def check_slots(rq, slots, mark, info):
    """Every slot in range, in use and once; ``mark`` is left all zero."""
    R = rq.shape[1]
    n = slots.shape[0]
    ok = True
    for i in range(n):
        s = slots[i]
        if s < 0 or s >= R:
            _fail(info, E_RANGE, i, s)
            ok = False
            break
        if rq[RQ_INUSE, s] == 0:
            _fail(info, E_FREE_SLOT, i, s)
            ok = False
            break
        if mark[s] != 0:
            _fail(info, E_DUP, i, s)
            ok = False
            break
        mark[s] = 1
    for i in range(n):
        s = slots[i]
        if 0 <= s < R:
            mark[s] = 0
    return ok


@njit(cache=True)
def _lru_push(lru, vp):
    tail = lru[LRU_PREV, 0]
    lru[LRU_NEXT, tail] = vp
    lru[LRU_PREV, vp] = tail
    lru[LRU_NEXT, vp] = 0
    lru[LRU_PREV, 0] = vp


@njit(cache=True)
def _lru_unlink(lru, vp):
    p = lru[LRU_PREV, vp]
    n = lru[LRU_NEXT, vp]
    lru[LRU_NEXT, p] = n
    lru[LRU_PREV, n] = p
    lru[LRU_PREV, vp] = 0
    lru[LRU_NEXT, vp] = 0


@njit(cache=True)
def k_new(rq, n, out):
    """The ``n`` lowest free slots into ``out``, marked in use; nothing changes (returns -1) if fewer are free."""
    R = rq.shape[1]
    c = 0
    for s in range(R):
        if c == n:
            break
        if rq[RQ_INUSE, s] == 0:
            out[c] = s
            c += 1
    if c < n:
        return -1
    for i in range(n):
        rq[RQ_INUSE, out[i]] = 1
    return n


@njit(cache=True)
def k_grow_plan(rq, pg, r2p, slots, ext, ps, mt, win, mark, cow, rel, info):
    """Validate an extend batch; count its fresh pages (copies included, Note [Copy-on-write]) and tokens; list,
    per windowed bound end, the pages whose last holder there leaves when the window advances (Note [Windows]).
    Changes nothing: :func:`k_window_apply` advances the windows once the caller has made room."""
    info[:] = 0
    if not check_slots(rq, slots, mark, info):
        return
    n = slots.shape[0]
    k = 0
    total = 0
    for i in range(n):
        s = slots[i]
        L = rq[RQ_LEN, s]
        e = ext[i]
        if e < 0:
            _fail(info, E_NEG, i, e)
            return
        if e > mt - L:   # not L + e > mt: that sum may overflow int64
            _fail(info, E_LONG, i, e)
            info[I_PAGES] = L
            return
        if e > 0:
            k += (L + e + ps - 1) // ps - (L + ps - 1) // ps
            total += e
    # copy-on-write decisions, in batch order (a shared partial page's count drops by one per copy)
    ncow = 0
    for i in range(n):
        cow[i] = 0
        s = slots[i]
        L = rq[RQ_LEN, s]
        if ext[i] > 0 and L % ps != 0:
            vp = r2p[s, (L - 1) // ps]
            if pg[PG_REF, vp] > 1:
                cow[i] = 1
                pg[PG_REF, vp] -= 1
                ncow += 1
    for i in range(n):
        if cow[i]:
            s = slots[i]
            pg[PG_REF, r2p[s, (rq[RQ_LEN, s] - 1) // ps]] += 1
    info[I_PAGES] = k + ncow
    info[I_TOTAL] = total
    info[I_NCOW] = ncow
    # the window unbinds, listed without changing anything: counts drop for the listing, then come back
    for b in range(win.shape[0]):
        W = win[b]
        c = 0
        if W > 0:
            for i in range(n):
                if ext[i] == 0:
                    continue
                s = slots[i]
                tail = max(0, rq[RQ_LEN, s] - W) // ps
                for j in range(rq[RQ_FRONT + b, s], tail):
                    vp = r2p[s, j]
                    pg[PG_NEED + b, vp] -= 1
                    if pg[PG_NEED + b, vp] == 0:
                        rel[b, c] = vp
                        c += 1
            for i in range(n):
                if ext[i] == 0:
                    continue
                s = slots[i]
                for j in range(rq[RQ_FRONT + b, s], max(0, rq[RQ_LEN, s] - W) // ps):
                    pg[PG_NEED + b, r2p[s, j]] += 1
        info[I_REL + b] = c


@njit(cache=True)
def k_window_apply(rq, pg, r2p, slots, ext, ps, win):
    """Advance every windowed bound end of a planned extend batch (the unbinds :func:`k_grow_plan` listed, which
    the caller has made on the allocator): fronts move to the window tail and the counts drop."""
    for b in range(win.shape[0]):
        W = win[b]
        if W <= 0:
            continue
        for i in range(slots.shape[0]):
            if ext[i] == 0:
                continue
            s = slots[i]
            tail = max(0, rq[RQ_LEN, s] - W) // ps
            f = rq[RQ_FRONT + b, s]
            if tail > f:
                for j in range(f, tail):
                    pg[PG_NEED + b, r2p[s, j]] -= 1
                rq[RQ_FRONT + b, s] = tail


@njit(cache=True)
def _fresh(pg, vp, nb):
    pg[PG_REF, vp] = 1
    pg[PG_ENG, vp] = 0
    pg[PG_STATE, vp] = PAGE_HELD
    for b in range(nb):
        pg[PG_NEED + b, vp] = 1


@njit(cache=True)
def k_grow_apply(rq, pg, r2p, r2t, slots, ext, ps, cow, pages, out, flat, cowpairs, rel, info):
    """Hand out the tokens of a planned extend batch: copies first, then each request's partial page, then its
    fresh pages (``pages`` in order). Lists the copied pages' bound-end unbinds after the window's ones."""
    nb = rel.shape[0]
    mt = r2t.shape[1]
    want_flat = flat.shape[0] > 0
    for b in range(nb):
        info[I_REL + b] = 0
    c = 0
    o = 0
    f = 0
    ncow = 0
    n = slots.shape[0]
    for i in range(n):
        e = ext[i]
        if e == 0:
            continue
        s = slots[i]
        L = rq[RQ_LEN, s]
        if cow[i]:
            j = (L - 1) // ps
            old = r2p[s, j]
            new = pages[c]
            c += 1
            pg[PG_REF, old] -= 1
            _fresh(pg, new, nb)
            for b in range(nb):
                if j >= rq[RQ_FRONT + b, s]:
                    pg[PG_NEED + b, old] -= 1
                    if pg[PG_NEED + b, old] == 0:
                        rel[b, info[I_REL + b]] = old
                        info[I_REL + b] += 1
                else:  # the request does not hold its last page there (a short window): unbind the copy
                    pg[PG_NEED + b, new] = 0
                    rel[b, info[I_REL + b]] = new
                    info[I_REL + b] += 1
            cowpairs[0, ncow] = old
            cowpairs[1, ncow] = new
            ncow += 1
            r2p[s, j] = new
            for p in range(j * ps, L):
                r2t[s, p] = new * ps + p % ps
                if want_flat:
                    flat[o + f] = s * mt + p
                    f += 1
        p = L
        while p < L + e:   # page by page: token t = vp * ps + (p - j * ps), one division per page
            j = p // ps
            if p == j * ps:
                vp = pages[c]
                c += 1
                r2p[s, j] = vp
                _fresh(pg, vp, nb)
            else:
                vp = r2p[s, j]
            stop = min(L + e, (j + 1) * ps)
            shift = (vp - j) * ps
            for q in range(p, stop):
                r2t[s, q] = shift + q
                out[o + q - p] = shift + q
            if want_flat:
                for q in range(p, stop):
                    flat[o + f + q - p] = s * mt + q
            o += stop - p
            p = stop
        rq[RQ_LEN, s] = L + e
    info[I_TOTAL] = o + f


@njit(cache=True)
def k_drop(rq, pg, r2p, r2t, lru, slots, keep, ps, cache, clear, pad, freed, rel, info):
    """Drop each slot's pages past ``keep[i]`` tokens, last page first (free / truncate). Pages whose count
    reaches 0 are freed, or cached if ``cache`` and full; bound-end holds that reach 0 on pages that stay
    (held or cached) are listed for release."""
    nb = rel.shape[0]
    nf = 0
    nc = 0
    for b in range(nb):
        info[I_REL + b] = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        L = rq[RQ_LEN, s]
        kt = keep[i]
        kp = (kt + ps - 1) // ps
        full = L // ps
        for j in range((L + ps - 1) // ps - 1, kp - 1, -1):
            vp = r2p[s, j]
            pg[PG_REF, vp] -= 1
            gone = pg[PG_REF, vp] == 0
            keep_it = gone and cache and j < full
            for b in range(nb):
                if j >= rq[RQ_FRONT + b, s]:
                    pg[PG_NEED + b, vp] -= 1
                    if pg[PG_NEED + b, vp] == 0 and (keep_it or not gone):
                        rel[b, info[I_REL + b]] = vp
                        info[I_REL + b] += 1
            if gone:
                if keep_it:
                    pg[PG_STATE, vp] = PAGE_CACHED
                    _lru_push(lru, vp)
                    nc += 1
                else:
                    pg[PG_STATE, vp] = PAGE_NOT_MANAGED
                    freed[nf] = vp
                    nf += 1
            r2p[s, j] = 0
        for p in range(kt, L):
            r2t[s, p] = pad
        rq[RQ_LEN, s] = kt
        for b in range(nb):
            if rq[RQ_FRONT + b, s] > kp:
                rq[RQ_FRONT + b, s] = kp
        if clear:
            rq[RQ_INUSE, s] = 0
            for b in range(nb):
                rq[RQ_FRONT + b, s] = 0
    info[I_NFREED] = nf
    info[I_NCACHED] = nc


@njit(cache=True)
def k_fork(rq, pg, r2p, r2t, src, n, ps, win):
    """Open the lowest free slot sharing the first ``n`` tokens of ``src`` (validated); -1 if none is free."""
    c = -1
    for s in range(rq.shape[1]):
        if rq[RQ_INUSE, s] == 0:
            c = s
            break
    if c < 0:
        return -1
    kp = (n + ps - 1) // ps
    rq[RQ_INUSE, c] = 1
    rq[RQ_LEN, c] = n
    for j in range(kp):
        vp = r2p[src, j]
        r2p[c, j] = vp
        pg[PG_REF, vp] += 1
    for p in range(n):
        r2t[c, p] = r2t[src, p]
    for b in range(win.shape[0]):
        f = rq[RQ_FRONT + b, src]
        if win[b] > 0:
            f = max(f, max(0, n - win[b]) // ps)
        f = min(f, kp)
        rq[RQ_FRONT + b, c] = f
        for j in range(f, kp):
            pg[PG_NEED + b, r2p[src, j]] += 1
    return c


@njit(cache=True)
def k_check_truncate(rq, slots, keep, mark, info):
    info[:] = 0
    if not check_slots(rq, slots, mark, info):
        return
    for i in range(slots.shape[0]):
        if keep[i] < 0 or keep[i] > rq[RQ_LEN, slots[i]]:
            _fail(info, E_TRUNC, i, keep[i])
            return


@njit(cache=True)
def k_evict(pg, lru, n, out):
    """Take up to ``n`` pages from the LRU head (state -> not managed); returns how many."""
    c = 0
    while c < n:
        vp = lru[LRU_NEXT, 0]
        if vp == 0:
            break
        _lru_unlink(lru, vp)
        pg[PG_STATE, vp] = PAGE_NOT_MANAGED
        out[c] = vp
        c += 1
    return c


@njit(cache=True)
def k_lru_walk(lru, out, limit):
    """The first ``min(limit, cached)`` pages of the LRU list, head first, into ``out`` (``limit`` at most its
    length; ``out`` may be empty when only the count is wanted, then nothing is written); returns how many.
    O(pages walked)."""
    c = 0
    vp = lru[LRU_NEXT, 0]
    write = out.shape[0] > 0
    while vp != 0 and c < limit:
        if write:
            out[c] = vp
        c += 1
        vp = lru[LRU_NEXT, vp]
    return c


@njit(cache=True)
def k_unref(pg, lru, vps, cache, freed):
    """Engine references dropped (validated by the caller): pages reaching 0 are cached (in order) or listed
    in ``freed``; returns how many were freed."""
    nf = 0
    for i in range(vps.shape[0]):
        vp = vps[i]
        pg[PG_ENG, vp] -= 1
        pg[PG_REF, vp] -= 1
        if pg[PG_REF, vp] == 0:
            if cache:
                pg[PG_STATE, vp] = PAGE_CACHED
                _lru_push(lru, vp)
            else:
                pg[PG_STATE, vp] = PAGE_NOT_MANAGED
                freed[nf] = vp
                nf += 1
    return nf


@njit(cache=True)
def k_revive(pg, lru, vps):
    for i in range(vps.shape[0]):
        vp = vps[i]
        if pg[PG_STATE, vp] == PAGE_CACHED:
            _lru_unlink(lru, vp)
            pg[PG_STATE, vp] = PAGE_HELD
        pg[PG_ENG, vp] += 1
        pg[PG_REF, vp] += 1



def raise_for_code(info: np.ndarray, where: str, what: str, max_requests: int, max_tokens_per_request: int) -> None:
    """Raise the typed error for the result code a table kernel left in ``info[:4]`` (code, position, value,
    tokens held) of a call named ``where`` on argument ``what``."""
    code, pos, val = (int(x) for x in info[:3])
    if code == E_RANGE:
        raise InvalidIdError(f"{where}: {what}[{pos}]={val} is out of range; allowed [0, {max_requests})")
    if code == E_FREE_SLOT:
        cls = DoubleFreeError if where == "free_requests" else NotAllocatedError
        raise cls(f"{where}: {what}[{pos}]={val} is not a live request (never created or already freed)")
    if code == E_DUP:
        raise InvalidIdError(f"{where}: {what}[{pos}]={val} appears twice in the batch; allowed each slot once")
    if code == E_NEG:
        raise UmallocValueError(f"{where}: extend_lens[{pos}]={val}; allowed >= 0")
    if code == E_LONG:
        held, mt = int(info[3]), max_tokens_per_request
        raise UmallocValueError(f"{where}: extend_lens[{pos}]={val} on the request at {what}[{pos}] holding "
                                f"{held} tokens; allowed at most {mt - held} (max_tokens_per_request={mt})")
    if code == E_TRUNC:
        raise UmallocValueError(f"{where}: num_tokens[{pos}]={val}; allowed [0, the request's length]")
    raise InvariantError(f"{where}: unknown kernel result {code}")

def check_state(rq, pg, lru, r2p, r2t, ps: int, zero: int, pad: int, where: str) -> None:
    """Recompute the table's counts from its page tables and compare (``where`` names the table in messages).

    Raises :class:`~umalloc.errors.InvariantError` naming the first broken invariant: ``rows`` (free slots empty;
    a live request's first ``ceil(len / ps)`` pages held and distinct, the rest empty; ``r2t`` = page * ps + offset
    on ``[0, len)``, ``pad`` past it; fronts within the extent), ``counts`` (holders and per-end holders equal the
    requests holding each page, the engine's references and the table for page ``zero``), ``held`` (held iff the
    count is positive: a page held by no one is a leak) and ``cached`` (no holder; exactly the LRU list).
    O(R * MT + NV).
    """
    NV = pg.shape[1]
    NB = pg.shape[0] - PG_NEED
    R, MP = r2p.shape

    def bad(inv: str, msg: str) -> InvariantError:
        return InvariantError(f"[{inv}] {where}: {msg}")

    lens = rq[RQ_LEN]
    kp = -(-lens // ps)
    col = np.arange(MP)[None, :]
    inside = col < kp[:, None]
    if np.any((rq[RQ_INUSE] == 0) & ((lens != 0) | np.any(rq[RQ_FRONT:] != 0, axis=0))):
        raise bad("rows", "a free slot holds tokens or a front")
    if np.any(inside & ((r2p < 1) | (r2p >= NV))) or np.any(~inside & (r2p != 0)):
        raise bad("rows", "a page entry is out of range inside an extent or set outside it")
    held_rows = r2p[inside]
    if held_rows.size and np.any(pg[PG_STATE, held_rows] != PAGE_HELD):
        raise bad("rows", "a request holds a page that is not held")
    for s in np.flatnonzero(kp > 1).tolist():
        row = r2p[s, : kp[s]]
        if np.unique(row).size != row.size:
            raise bad("rows", f"request {s} holds a page twice")
    pos = np.arange(r2t.shape[1])[None, :]
    within = pos < lens[:, None]
    want = np.where(within, r2p[np.arange(R)[:, None], np.minimum(pos // ps, MP - 1)] * ps + pos % ps,
                    pad)
    if not np.array_equal(r2t.astype(np.int64), want):
        raise bad("rows", "req_to_token differs from page * page_size + offset (or the pad past the length)")
    if NB and np.any(rq[RQ_FRONT:] > kp[None, :]):
        raise bad("rows", "a bound-end front lies past the request's extent")
    ref = np.bincount(held_rows, minlength=NV).astype(np.int64) + pg[PG_ENG]
    if zero:
        ref[zero] += 1
    if not np.array_equal(ref, pg[PG_REF]):
        v = int(np.flatnonzero(ref != pg[PG_REF])[0])
        raise bad("counts", f"page {v}: count {int(pg[PG_REF, v])}, holders {int(ref[v])}")
    for b in range(NB):
        on_b = inside & (col >= rq[RQ_FRONT + b][:, None])
        need = np.bincount(r2p[on_b], minlength=NV)
        if zero:
            need[zero] += 1
        if not np.array_equal(need, pg[PG_NEED + b]):
            v = int(np.flatnonzero(need != pg[PG_NEED + b])[0])
            raise bad("counts", f"page {v} on bound end {b}: count {int(pg[PG_NEED + b, v])}, "
                                f"requests holding it there {int(need[v])}")
    st = pg[PG_STATE]
    if np.any((st == PAGE_HELD) != (pg[PG_REF] > 0)):
        v = int(np.flatnonzero((st == PAGE_HELD) != (pg[PG_REF] > 0))[0])
        raise bad("held", f"page {v}: state {int(st[v])} with {int(pg[PG_REF, v])} holders (a page held by no "
                          f"one is a leak)")
    cached = np.flatnonzero(st == PAGE_CACHED)
    walk: list[int] = []
    vp = int(lru[LRU_NEXT, 0])
    while vp and len(walk) <= NV:
        walk.append(vp)
        if int(lru[LRU_PREV, int(lru[LRU_NEXT, vp])]) != vp:
            raise bad("cached", f"LRU links broken after page {vp}")
        vp = int(lru[LRU_NEXT, vp])
    if sorted(walk) != cached.tolist():
        raise bad("cached", f"the LRU list {walk[:8]} differs from the cached pages {cached[:8].tolist()}")
    if cached.size and (np.any(pg[PG_ENG, cached] != 0) or (NB and np.any(pg[PG_NEED:, cached] != 0))):
        raise bad("cached", "a cached page has a holder")


def check_against_allocator(pg, v2p: dict, exclusive: bool, where: str) -> None:
    """Compare the table's page states with the allocator's tables: ``v2p`` maps the owner end first, then each
    bound end in ``pg``'s order, to its ``v2p`` array (TOMBSTONE where unbound).

    Raises :class:`~umalloc.errors.InvariantError`: ``owner-live`` (a managed page not live on the owner: freed
    behind the table; with ``exclusive``, a live owner page the table does not manage: allocated outside it or
    leaked) or ``bound`` (a managed page bound on a bound end iff a request holds it there). O(NV * ends).
    """
    (owner, owner_v2p), *bound = v2p.items()
    managed = pg[PG_STATE] != PAGE_NOT_MANAGED
    live = owner_v2p != TOMBSTONE
    live[0] = False
    if np.any(managed & ~live):
        v = int(np.flatnonzero(managed & ~live)[0])
        raise InvariantError(f"[owner-live] {where}: managed page {v} is not live on {owner!r} (freed behind the "
                             f"table)")
    if exclusive and np.any(live & ~managed):
        v = int(np.flatnonzero(live & ~managed)[0])
        raise InvariantError(f"[owner-live] {where}: page {v} is live on {owner!r} but held by no one the table "
                             f"knows (allocated outside it, or leaked)")
    for b, (end, end_v2p) in enumerate(bound):
        on_b = end_v2p != TOMBSTONE
        wrong = managed & (on_b != (pg[PG_NEED + b] > 0))
        if np.any(wrong):
            v = int(np.flatnonzero(wrong)[0])
            raise InvariantError(f"[bound] {where}: page {v} on {end!r}: bound {bool(on_b[v])}, requests holding "
                                 f"it there {int(pg[PG_NEED + b, v])}")


@dataclass(frozen=True)
class RequestTableStats:
    """Fixed-schema counters of a :class:`RequestTable` (pages are the owner end's virtual pages).

    Attributes:
        live_requests / free_slots: slots in use / free. tokens: sum of the live requests' lengths.
        held_pages: managed pages with a holder (the zero page included); shared_pages: those with more than one.
        engine_refs: engine references (``retain`` / ``reclaim``) outstanding, summed over pages.
        cached_pages: cached (count 0, evictable) pages now; free_pages: what the owner end can allocate now
            (``available_pages``); reclaimable_pages: what eviction can return (= ``cached_pages``).
        pages_cached / pages_reclaimed / pages_evicted / pages_copied: totals since creation (pages entering the
            cache, revived from it, evicted from it, copied on write).
    """

    live_requests: int
    free_slots: int
    tokens: int
    held_pages: int
    shared_pages: int
    engine_refs: int
    cached_pages: int
    free_pages: int
    reclaimable_pages: int
    pages_cached: int
    pages_reclaimed: int
    pages_evicted: int
    pages_copied: int

    @classmethod
    def of(cls, rq: np.ndarray, pg: np.ndarray, max_requests: int, owner_capacity: dict[str, int],
           counters: dict[str, int]) -> RequestTableStats:
        """The stats of a table's request rows ``rq``, page rows ``pg``, its owner's :meth:`capacity
        <umalloc.requests.table.RequestTable.capacity>` entry and its totals. O(max_requests + pages)."""
        live = int(np.count_nonzero(rq[RQ_INUSE]))
        held = pg[PG_STATE] == PAGE_HELD
        return cls(
            live_requests=live, free_slots=max_requests - live, tokens=int(rq[RQ_LEN].sum()),
            held_pages=int(np.count_nonzero(held)), shared_pages=int(np.count_nonzero(held & (pg[PG_REF] > 1))),
            engine_refs=int(pg[PG_ENG].sum()), cached_pages=owner_capacity["reclaimable_pages"],
            free_pages=owner_capacity["free_pages"], reclaimable_pages=owner_capacity["reclaimable_pages"],
            pages_cached=counters["cached"], pages_reclaimed=counters["reclaimed"],
            pages_evicted=counters["evicted"], pages_copied=counters["copied"])

    def to_dict(self) -> dict[str, int]:
        return asdict(self)
