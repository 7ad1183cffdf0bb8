"""CPU translators: numba-compiled loops over numpy views of CPU tensors.

* Same functions, arguments, results and errors as :mod:`umalloc.translators.reference`; CPU tensors only
  (numpy int64 arrays are accepted and wrapped zero-copy). Tensors are viewed through ``Tensor.numpy()``,
  so no input is copied unless it is non-contiguous.
* Each kernel is one ``@njit`` loop over a half-open chunk ``[lo, hi)``. For the batch-sized hot paths
  (``virtual_to_physical[_pages]``, ``tokens_to_pages``, ``pages_to_runs``) batches of at least
  :data:`PARALLEL_MIN_ITEMS` items split into one chunk per numba thread under ``prange``; smaller batches run
  the chunk on the calling thread. ``kernel_page_ids``, ``rank_local_positions`` and ``runs_to_descriptors``
  are single memory-bound passes on the calling thread (parallel twins cost more JIT time than they saved).
* Note [Parallel threshold]: on an idle 2-core machine the thread pool pays from about 10k items, but when
  other processes keep the cores busy (transfer-engine threads, other workers, CI neighbours) a parallel call
  waits for its second thread to be scheduled. Measured on the project's 2-core machines at 1M tokens: idle,
  2 threads were 1.3-2x faster than one; at load average 3-5, 5-10x *slower*. So with fewer than 4 numba
  threads batches stay on the calling thread by default; with 4 or more, batches from 128k items run in
  parallel. Override with the environment variable ``UMALLOC_CPU_PARALLEL_MIN_ITEMS`` (0: always
  parallel) or by assigning :data:`PARALLEL_MIN_ITEMS`.
* Validation first, then writes: a bad id raises before anything is written, so an ``out=`` aliasing the input
  survives the error unchanged, and no kernel ever reads outside the v2p table.
* Page sizes that are powers of two use shifts and masks; others divide.
* Kernels compile lazily on first use and are cached on disk (``cache=True``), so a process pays the JIT once
  per kernel and signature; all inputs are normalised to C-contiguous int64 so there is one signature each.

See Note [Tombstones map to the sink] in :mod:`umalloc.translators.reference`.
"""

from __future__ import annotations

import os

import numba
import numpy as np
import torch
from numba import njit, prange

from umalloc.errors import UmallocValueError
from umalloc.translators import _common as c

NAME = "cpu"

#: Environment variable overriding :data:`PARALLEL_MIN_ITEMS` (an int >= 0; 0 makes every batch parallel).
PARALLEL_ENV_VAR = "UMALLOC_CPU_PARALLEL_MIN_ITEMS"


def _parallel_min_items_from_env(default: int) -> int:
    text = os.environ.get(PARALLEL_ENV_VAR, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise UmallocValueError(f"{PARALLEL_ENV_VAR}={text!r}: allowed an int >= 0")
    return value


#: A threshold no batch reaches: every batch stays on the calling thread.
NEVER_PARALLEL = 1 << 62

#: Batches with at least this many items run on every numba thread; smaller ones on the caller's thread.
#: Default: 128k items with 4+ numba threads, else never (Note [Parallel threshold]).
PARALLEL_MIN_ITEMS = _parallel_min_items_from_env(
    1 << 17 if numba.config.NUMBA_NUM_THREADS >= 4 else NEVER_PARALLEL  # type: ignore[attr-defined]
)


def available() -> bool:
    """True: importing this module already required numba."""
    return True


def unavailable_reason() -> str | None:
    """None: the module imported, so numba is present."""
    return None


def supports_device(device: torch.device | str) -> bool:
    """True only for the CPU device."""
    return torch.device(device).type == "cpu"


# --- helpers ------------------------------------------------------------------------------------------------


def _cpu(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_cpu:
        raise UmallocValueError(f"the cpu translator needs CPU tensors; {name} is on {t.device}")
    return t


def _flat(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous 1-D numpy view of a CPU tensor (a copy only when ``t`` is not contiguous).

    Goes through numpy rather than torch view ops: on small batches torch's per-op overhead dominates.
    """
    return np.ascontiguousarray(t.numpy()).reshape(-1)


def _empty(num_items: int) -> np.ndarray:
    return np.empty(num_items, dtype=np.int64)


def _wrap(arr: np.ndarray, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """A tensor over ``arr`` (no copy) with ``shape``."""
    return torch.from_numpy(arr.reshape(shape))


def _shift_of(page_size: int) -> int:
    """log2(page_size) for powers of two, else -1 (divide)."""
    return page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1


def _chunks(num_items: int) -> int:
    """How many chunks to split ``num_items`` into: 1 below the threshold, else one per numba thread."""
    return 1 if num_items < PARALLEL_MIN_ITEMS else max(1, numba.get_num_threads())


def _out_target(out: torch.Tensor, ids: np.ndarray, tab: np.ndarray) -> np.ndarray | None:
    """``out``'s memory as a flat array when a kernel may write there directly, else None.

    Safe when ``out`` is contiguous and either overlaps neither input or is exactly ``ids`` (element ``i`` is
    read before it is written, by the same thread). Partial overlaps go through a temporary.
    """
    if not out.is_contiguous():
        return None
    res = out.numpy().reshape(-1)
    if np.may_share_memory(res, tab):
        return None
    if np.may_share_memory(res, ids) and res.ctypes.data != ids.ctypes.data:
        return None
    return res


# --- kernels ------------------------------------------------------------------------------------------------
# Every *_chunk function handles items [lo, hi) on the calling thread; the *_par twin runs one chunk per
# prange iteration. Two habits keep the loops at memory speed (each measured at about 2x on these machines):
# * loop bodies avoid data-dependent branches (flags are added, not tested): on random page lists a
#   mispredicted branch per item costs more than the memory traffic;
# * loops index chunk views from 0 and index tables with unsigned ids, so numba's negative-index wraparound
#   code disappears (it cannot be proven dead for a signed index of unknown sign).


@njit(cache=True, nogil=True)
def _bounds(n, nchunks, k):
    return k * n // nchunks, (k + 1) * n // nchunks


@njit(cache=True, nogil=True)
def _check_chunk(ids, tab, shift, ps, strict, lo, hi):
    """(#ids outside [0, len(tab) * ps), #in-range ids whose page is tombstoned when strict)."""
    v = ids[lo:hi]
    limit = np.uint64(tab.shape[0] * ps)
    zero = np.uint64(0)
    outside = 0
    tomb = 0
    if not strict:
        for k in range(v.shape[0]):
            outside += np.uint64(v[k]) >= limit
    elif shift >= 0:
        us = np.uint64(shift)
        for k in range(v.shape[0]):
            u = np.uint64(v[k])
            inside = u < limit
            outside += not inside
            tomb += inside & (tab[(u if inside else zero) >> us] < 0)
    else:
        ups = np.uint64(ps)
        for k in range(v.shape[0]):
            u = np.uint64(v[k])
            inside = u < limit
            outside += not inside
            tomb += inside & (tab[(u if inside else zero) // ups] < 0)
    return outside, tomb


@njit(cache=True, nogil=True)
def _v2p_chunk(ids, tab, shift, ps, out, lo, hi):
    """Translate [lo, hi) into ``out``; every id must already be in range (see :func:`_check_chunk`)."""
    v = ids[lo:hi]
    o = out[lo:hi]
    if shift >= 0:
        us = np.uint64(shift)
        mask = ps - 1
        for k in range(v.shape[0]):
            t = v[k]
            p = tab[np.uint64(t) >> us]
            o[k] = (max(p, 0) << shift) | (t & mask)
    else:
        ups = np.uint64(ps)
        for k in range(v.shape[0]):
            t = v[k]
            q = np.uint64(t) // ups
            o[k] = max(tab[q], 0) * ps + (t - np.int64(q) * ps)


@njit(cache=True, nogil=True)
def _v2p_serial(ids, tab, shift, ps, strict, out):
    """Validate every id, then (only if all are valid) translate into ``out``. Returns the two error counts."""
    n = ids.shape[0]
    outside, tomb = _check_chunk(ids, tab, shift, ps, strict, 0, n)
    if outside == 0 and tomb == 0:
        _v2p_chunk(ids, tab, shift, ps, out, 0, n)
    return outside, tomb


@njit(cache=True, nogil=True, parallel=True)
def _v2p_par(ids, tab, shift, ps, strict, out, nchunks):
    n = ids.shape[0]
    res = np.zeros((nchunks, 2), dtype=np.int64)
    for k in prange(nchunks):
        lo, hi = _bounds(n, nchunks, k)
        a, b = _check_chunk(ids, tab, shift, ps, strict, lo, hi)
        res[k, 0] = a
        res[k, 1] = b
    outside = res[:, 0].sum()
    tomb = res[:, 1].sum()
    if outside == 0 and tomb == 0:
        for k in prange(nchunks):
            lo, hi = _bounds(n, nchunks, k)
            _v2p_chunk(ids, tab, shift, ps, out, lo, hi)
    return outside, tomb


@njit(cache=True, nogil=True)
def _t2p_chunk(tok, ps, shift, out, lo, hi):
    """Pages [lo, hi): write each group's page id; return how many groups are not one aligned page."""
    tv = tok[lo * ps : hi * ps]
    o = out[lo:hi]
    bad = 0
    for g in range(o.shape[0]):
        seg = tv[g * ps : (g + 1) * ps]
        base = seg[0]
        wrong = base < 0
        if shift >= 0:
            wrong |= (base & (ps - 1)) != 0
            o[g] = base >> shift
        else:
            wrong |= base % ps != 0
            o[g] = base // ps
        for j in range(1, seg.shape[0]):
            wrong |= seg[j] != base + j
        bad += wrong
    return bad


@njit(cache=True, nogil=True, parallel=True)
def _t2p_par(tok, ps, shift, out, nchunks):
    res = np.zeros(nchunks, dtype=np.int64)
    for k in prange(nchunks):
        lo, hi = _bounds(out.shape[0], nchunks, k)
        res[k] = _t2p_chunk(tok, ps, shift, out, lo, hi)
    return res.sum()


@njit(cache=True, nogil=True)
def _runs_chunk(src, dst, out, lo, hi):
    """Write the runs that start in [lo, hi) to ``out`` rows ``lo, lo + 1, ...``; the last may extend past hi.

    Returns ``(number of runs written, whether any id in [lo, hi) is negative)``. At most ``hi - lo`` rows are
    written. Branch-free body: every item rewrites the row of the run it belongs to with
    ``(src - offset, dst - offset, offset + 1)``, so the last write of each run leaves its start and length.
    Negative ids are detected through the OR of all ids (negative iff some id is).
    """
    n = src.shape[0]
    acc = 0
    i0 = lo
    if i0 > 0:  # items continuing a run that an earlier chunk owns (and measures) are skipped
        while i0 < hi and src[i0] - src[i0 - 1] == 1 and dst[i0] - dst[i0 - 1] == 1:
            acc |= src[i0] | dst[i0]
            i0 += 1
    if i0 >= hi:
        return 0, acc < 0
    sv = src[i0:hi]
    dv = dst[i0:hi]
    o = out[lo:]
    cur = 0
    cur_start = 0
    prev_s = sv[0]
    prev_d = dv[0]
    acc |= prev_s | prev_d
    o[0, 0] = prev_s
    o[0, 1] = prev_d
    o[0, 2] = 1
    for k in range(1, sv.shape[0]):
        s = sv[k]
        d = dv[k]
        acc |= s | d
        f = (s - prev_s != 1) | (d - prev_d != 1)
        prev_s = s
        prev_d = d
        cur += f
        cur_start = k if f else cur_start
        off = k - cur_start
        o[cur, 0] = s - off
        o[cur, 1] = d - off
        o[cur, 2] = off + 1
    j = hi  # the last run may continue into later chunks
    while j < n and src[j] - src[j - 1] == 1 and dst[j] - dst[j - 1] == 1:
        j += 1
    o[cur, 2] = j - i0 - cur_start
    return cur + 1, acc < 0


@njit(cache=True, nogil=True, parallel=True)
def _runs_par(src, dst, out, nchunks):
    """Chunk k writes its runs from row ``lo_k`` on (it has at most ``hi_k - lo_k`` of them)."""
    res = np.zeros((nchunks, 2), dtype=np.int64)
    for k in prange(nchunks):
        lo, hi = _bounds(src.shape[0], nchunks, k)
        a, b = _runs_chunk(src, dst, out, lo, hi)
        res[k, 0] = a
        res[k, 1] = b
    return res


@njit(cache=True, nogil=True)
def _desc_chunk(runs, src_base, dst_base, item, out):
    """Region-major descriptors: row ``k * R + i`` is run ``i`` in region pair ``k``."""
    r = runs.shape[0]
    for k in range(item.shape[0]):
        it = item[k]
        sb = src_base[k]
        db = dst_base[k]
        o = out[k * r : (k + 1) * r]
        for i in range(r):
            o[i, 0] = sb + np.uint64(runs[i, 0]) * it
            o[i, 1] = db + np.uint64(runs[i, 1]) * it
            o[i, 2] = np.uint64(runs[i, 2]) * it


@njit(cache=True, nogil=True)
def _kernel_ids_chunk(tok, ps, shift, stride, out):
    """Write kernel ids; return (#negative tokens, max token)."""
    neg = 0
    hi_tok = 0
    if shift >= 0:
        mask = ps - 1
        for i in range(tok.shape[0]):
            t = tok[i]
            neg += t < 0
            hi_tok = max(hi_tok, t)
            out[i] = (t >> shift) * stride + (t & mask)
    else:
        for i in range(tok.shape[0]):
            t = tok[i]
            neg += t < 0
            hi_tok = max(hi_tok, t)
            q = t // ps
            out[i] = q * stride + (t - q * ps)
    return neg, hi_tok


@njit(cache=True, nogil=True)
def _dcp_count(pos, d, r, shift):
    """(#owned positions, #negative positions). ``shift`` = log2(d) when d is a power of two, else -1."""
    owned = 0
    neg = 0
    if shift >= 0:
        mask = d - 1
        for i in range(pos.shape[0]):
            p = pos[i]
            neg += p < 0
            owned += (p >= 0) & ((p & mask) == r)
    else:
        ud = np.uint64(d)
        ur = np.uint64(r)
        for i in range(pos.shape[0]):
            p = pos[i]
            neg += p < 0
            owned += (p >= 0) & (np.uint64(p) % ud == ur)
    return owned, neg


@njit(cache=True, nogil=True)
def _dcp_fill(pos, d, r, shift, indices, rows):
    """Fill owned positions' indices and local rows; every position must be >= 0."""
    j = 0
    if shift >= 0:
        mask = d - 1
        for i in range(pos.shape[0]):
            p = pos[i]
            if (p & mask) == r:
                indices[j] = i
                rows[j] = p >> shift
                j += 1
    else:
        ud = np.uint64(d)
        ur = np.uint64(r)
        for i in range(pos.shape[0]):
            u = np.uint64(pos[i])
            q = u // ud
            if u - q * ud == ur:
                indices[j] = i
                rows[j] = np.int64(q)
                j += 1


# --- public functions -----------------------------------------------------------------------------------


def _translate(ids_t, tab_t, ps, out, strict, name, unit):
    _cpu(ids_t, name)
    _cpu(tab_t, "v2p")
    ids = _flat(ids_t)
    tab = _flat(tab_t)
    n = ids.shape[0]
    res = _out_target(out, ids, tab) if out is not None else None
    direct = res is not None
    if not direct:
        res = _empty(n)
    if n:
        nchunks = _chunks(n)
        shift = _shift_of(ps)
        if nchunks == 1:
            outside, tomb = _v2p_serial(ids, tab, shift, ps, bool(strict), res)
        else:
            outside, tomb = _v2p_par(ids, tab, shift, ps, bool(strict), res, nchunks)
        if outside:
            c.raise_out_of_range(ids_t, tab.shape[0] * ps, name, unit)
        if tomb:
            c.raise_tombstone(ids_t, tab_t, ps, name)
    if out is None:
        return _wrap(res, ids_t.shape)
    if not direct:
        out.copy_(_wrap(res, out.shape))
    return out


def virtual_to_physical(
    vtokens: c.IndexLike,
    v2p: c.IndexLike,
    page_size: int,
    *,
    out: torch.Tensor | None = None,
    strict: bool = False,
) -> torch.Tensor:
    """Numba version of :func:`umalloc.translators.reference.virtual_to_physical` (CPU tensors only).

    Two passes over ``vtokens`` (validate, then translate), each O(n), parallel from
    :data:`PARALLEL_MIN_ITEMS` tokens. Raises exactly what the reference raises, plus
    :class:`UmallocValueError` for a non-CPU tensor.

    >>> virtual_to_physical(torch.tensor([0, 1, 3, 4, 5]), torch.tensor([5, -1, 2]), 2)
    tensor([10, 11,  1,  4,  5])
    """
    vt, tab, ps = c.translate_args(vtokens, v2p, page_size, out, "vtokens")
    return _translate(vt, tab, ps, out, strict, "vtokens", "token")


def virtual_to_physical_pages(
    vpages: c.IndexLike,
    v2p: c.IndexLike,
    *,
    out: torch.Tensor | None = None,
    strict: bool = False,
) -> torch.Tensor:
    """Numba version of :func:`umalloc.translators.reference.virtual_to_physical_pages` (CPU tensors only).

    >>> virtual_to_physical_pages(torch.tensor([2, 1, 0]), torch.tensor([5, -1, 2]))
    tensor([2, 0, 5])
    """
    vp, tab, _ = c.translate_args(vpages, v2p, 1, out, "vpages")
    return _translate(vp, tab, 1, out, strict, "vpages", "page")


def tokens_to_pages(tokens: c.IndexLike, page_size: int) -> torch.Tensor:
    """Numba version of :func:`umalloc.translators.reference.tokens_to_pages` (CPU tensors only). O(n).

    >>> tokens_to_pages(torch.tensor([8, 9, 10, 11, 0, 1, 2, 3]), 4)
    tensor([2, 0])
    """
    tok_t, ps = c.tokens_args(tokens, page_size)
    _cpu(tok_t, "tokens")
    tok = _flat(tok_t)
    num_pages = tok.shape[0] // ps
    res = _empty(num_pages)
    if num_pages:
        shift = _shift_of(ps)
        nchunks = _chunks(tok.shape[0])
        if nchunks == 1:
            bad = _t2p_chunk(tok, ps, shift, res, 0, num_pages)
        else:
            bad = _t2p_par(tok, ps, shift, res, nchunks)
        if bad:
            c.raise_misaligned(tok_t, ps)
    return torch.from_numpy(res)


def pages_to_runs(src_pages: c.IndexLike, dst_pages: c.IndexLike) -> torch.Tensor:
    """Numba version of :func:`umalloc.translators.reference.pages_to_runs` (CPU tensors only).

    One O(n) pass (parallel from :data:`PARALLEL_MIN_ITEMS` pages) writes runs into an ``(n, 3)`` scratch
    array; chunks are then moved together (one ``memmove`` per chunk after the first) and the array is shrunk
    in place to ``(R, 3)``. Only the rows written are ever touched, so the scratch costs address space, not
    memory traffic.

    >>> pages_to_runs(torch.tensor([3, 4, 5, 9]), torch.tensor([7, 8, 2, 3]))
    tensor([[3, 7, 2],
            [5, 2, 1],
            [9, 3, 1]])
    """
    src_t, dst_t = c.runs_args(src_pages, dst_pages)
    _cpu(src_t, "src_pages")
    _cpu(dst_t, "dst_pages")
    src, dst = _flat(src_t), _flat(dst_t)
    n = src.shape[0]
    if n == 0:
        return torch.from_numpy(np.empty((0, 3), dtype=np.int64))
    runs = np.empty((n, 3), dtype=np.int64)
    nchunks = _chunks(n)
    if nchunks == 1:
        num_runs, neg = _runs_chunk(src, dst, runs, 0, n)
    else:
        counts = _runs_par(src, dst, runs, nchunks)
        neg = bool(counts[:, 1].any())
        num_runs = int(counts[0, 0])
        for k in range(1, nchunks):  # over chunks (a handful), never over runs
            lo = k * n // nchunks
            cnt = int(counts[k, 0])
            if cnt and lo != num_runs:
                runs[num_runs : num_runs + cnt] = runs[lo : lo + cnt]  # overlapping copies are memmoves
            num_runs += cnt
    if neg:
        if bool((src_t < 0).any()):
            c.raise_negative(src_t, "src_pages")
        c.raise_negative(dst_t, "dst_pages")
    runs.resize((num_runs, 3), refcheck=False)  # shrinks in place (realloc); no view of runs exists
    return torch.from_numpy(runs)


def runs_to_descriptors(
    runs: c.IndexLike, src_regions: c.RegionsLike, dst_regions: c.RegionsLike
) -> np.ndarray:
    """Numba version of :func:`umalloc.translators.reference.runs_to_descriptors`.

    Accepts runs on any device (copied to the host). One O(K * R) filling pass.

    >>> runs_to_descriptors(torch.tensor([[3, 7, 2]]), [(1000, 64)], [(2000, 64)])
    array([[1192, 2448,  128]], dtype=uint64)
    """
    arr, src_base, dst_base, item = c.descriptor_args(runs, src_regions, dst_regions)
    r, k = arr.shape[0], item.shape[0]
    out = np.empty((k * r, 3), dtype=np.uint64)
    if r and k:
        _desc_chunk(arr, src_base, dst_base, item, out)
    return out


def kernel_page_ids(tokens: c.IndexLike, page_size: int, layers_per_page: int) -> torch.Tensor:
    """Numba version of :func:`umalloc.translators.reference.kernel_page_ids` (CPU tensors only). O(n).

    >>> kernel_page_ids(torch.tensor([0, 5, 9]), 4, 3)
    tensor([ 0, 13, 25])
    """
    tok_t, ps, layers = c.kernel_ids_args(tokens, page_size, layers_per_page)
    _cpu(tok_t, "tokens")
    tok = _flat(tok_t)
    n = tok.shape[0]
    res = _empty(n)
    if n == 0:
        return _wrap(res, tok_t.shape)
    neg, hi = _kernel_ids_chunk(tok, ps, _shift_of(ps), ps * layers, res)
    if neg:
        c.raise_negative(tok_t, "tokens")
    hi = int(hi)
    c.check_kernel_ids_fit(hi, ps, layers)
    return _wrap(res, tok_t.shape)


def rank_local_positions(
    positions: c.IndexLike, dcp_size: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numba version of :func:`umalloc.translators.reference.rank_local_positions` (CPU tensors only).

    Returns ``(indices, local_rows)`` exactly as the reference does. Two O(n) passes.

    >>> rank_local_positions(torch.tensor([4, 5, 6, 7, 9]), 2, 1)
    (tensor([1, 3, 4]), tensor([2, 3, 4]))
    """
    pos_t, d, r = c.dcp_args(positions, dcp_size, rank)
    _cpu(pos_t, "positions")
    pos = _flat(pos_t)
    shift = _shift_of(d)
    owned, neg = _dcp_count(pos, d, r, shift)
    if neg:
        c.raise_negative(pos_t, "positions")
    indices = _empty(owned)
    rows = _empty(owned)
    if owned:
        _dcp_fill(pos, d, r, shift, indices, rows)
    return torch.from_numpy(indices), torch.from_numpy(rows)
