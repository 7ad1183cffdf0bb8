"""CPU translators: numba-compiled loops over numpy views of CPU tensors.

* Same functions, arguments, results and errors as :mod:`umalloc.translators.reference`; CPU tensors and
  numpy arrays only (int64 or int32 ids; read-only arrays too). Tensors are viewed through ``Tensor.numpy()``,
  so no input is copied unless it is int32 or non-contiguous.
* The fastest call for host tables (an allocator's numpy v2p master):
  ``virtual_to_physical[_pages](ids, v2p_numpy, ..., out=out, strict=strict)`` with 1-D contiguous int64 ids
  and ``out`` (numpy or a CPU tensor; a numpy ``out`` is written in place and returned, so numpy in, numpy out)
  costs a few attribute tests and one kernel call (Note [Host fast path] at :func:`_translate`).
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
  parallel) or by assigning :data:`PARALLEL_MIN_ITEMS`. A parallel launch never changes the caller's torch
  thread count (Note [Parallel kernels and torch threads]).
* Translation is a validation pass (range; tombstones when strict; entries too large for the ids' dtype) and a
  translating pass that runs only when nothing was counted, straight into ``out`` (into scratch first when
  ``out`` overlaps the ids shifted, or is int32 or strided), so ``out`` survives every error unchanged (also
  when it aliases the input), and no kernel ever reads outside the v2p table.
* Page sizes that are powers of two use shifts and masks; others divide.
* Kernels compile lazily on first use and are cached on disk (``cache=True``), so a process pays the JIT once
  per kernel and signature; all inputs are normalised to C-contiguous int64 so there is one signature each
  (a read-only table is a second one).

See Note [Tombstones map to the sink] in :mod:`umalloc.translators.reference`.
"""

from __future__ import annotations

import os
from typing import Any

import numba
import numpy as np
import torch
from numba import njit, prange, types

from umalloc.errors import InvalidIdError, UmallocValueError
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


_I64 = np.dtype(np.int64)
_I64_MAX = (1 << 63) - 1
_PAGE_MAX = c.MAX_PHYSICAL_PAGES - 1  # the largest v2p entry any translation takes (a physical page id)
_NP_IDS = (_I64, np.dtype(np.int32))
_TORCH_DTYPE = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
_CPU = torch.device("cpu")


def _host(x: object, name: str, *, ndim: int | None = None, int64_only: bool = False) -> np.ndarray:
    """``x`` (a CPU tensor or numpy array of int64/int32 ids) as a numpy array over the same memory.

    The common cases (a numpy array or dense CPU tensor of the right dtype) cost a few attribute checks;
    anything else goes through :func:`umalloc.translators._common.as_index_tensor` for the same typed errors
    as every implementation, plus :class:`UmallocValueError` for a tensor that is not on the CPU.
    """
    kind = type(x)
    if kind is np.ndarray:
        if (x.dtype == np.int64 or (x.dtype == np.int32 and not int64_only)) and (ndim is None or x.ndim == ndim):
            return x
    elif kind is torch.Tensor and x.is_cpu and x.layout is torch.strided:
        dt = x.dtype
        if (dt is torch.int64 or (dt is torch.int32 and not int64_only)) and (ndim is None or x.dim() == ndim):
            return x.numpy()
    t = c.as_index_tensor(x, name, ndim=ndim, int64_only=int64_only)
    return _cpu(t, name).numpy()


def _check_out(out: object, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """:func:`umalloc.translators._common.check_out` for CPU results, with a fast accept."""
    if (type(out) is torch.Tensor and out.dtype is dtype and out.is_cpu and out.layout is torch.strided
            and out.shape == shape and out.is_contiguous()):
        return
    c.check_out(out, shape, dtype, _CPU)


def _flat(a: np.ndarray) -> np.ndarray:
    """A C-contiguous 1-D int64 array over ``a`` (a copy only when ``a`` is int32 or not contiguous)."""
    return np.ascontiguousarray(a, dtype=np.int64).reshape(-1)


def _empty(num_items: int) -> np.ndarray:
    return np.empty(num_items, dtype=np.int64)


def _wrap(arr: np.ndarray, shape: tuple[int, ...] | torch.Size, dtype: np.dtype = _NP_IDS[0]) -> torch.Tensor:
    """A tensor over ``arr`` (no copy unless ``dtype`` is int32) with ``shape``."""
    if arr.dtype != dtype:
        arr = arr.astype(dtype)
    return torch.from_numpy(arr.reshape(shape))


def _shift_of(page_size: int) -> int:
    """log2(page_size) for powers of two, else -1 (divide)."""
    return page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1


def _parallel_batch(num_items: int) -> bool:
    """True when a batch of ``num_items`` runs on every numba thread (:data:`PARALLEL_MIN_ITEMS`)."""
    return num_items >= PARALLEL_MIN_ITEMS


def _chunks() -> int:
    """Chunks of a parallel batch: one per numba thread (starts numba's thread pool on first use)."""
    return max(1, numba.get_num_threads())


def _parallel(kernel, *args):  # noqa: ANN001, ANN202 - a numba dispatcher and its arguments
    """Run a ``parallel=True`` kernel on :func:`_chunks` chunks (the last argument) without changing the
    caller's threading.

    Note [Parallel kernels and torch threads]: numba's OpenMP threading layer sets the calling thread's
    OpenMP thread count (``omp_set_num_threads``) when it starts its thread pool (the first parallel launch,
    or the first ``numba.get_num_threads()``), and torch reads the same setting: after it,
    ``torch.get_num_threads()`` went from 1 to 2 and every later torch op of the caller ran on two threads.
    So the count is read before and restored after.
    """
    threads = torch.get_num_threads()
    try:
        return kernel(*args, _chunks())
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


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
def _shift_pmax(ps, id_max):
    """``(shift, pmax)``: log2(ps) for a power of two (else -1), and the largest v2p entry that is a physical
    page id whose ids ``p * ps + offset`` fit ``id_max`` (:func:`umalloc.translators._common.max_entry`)."""
    shift = -1
    if ps & (ps - 1) == 0:
        shift = 0
        while (np.int64(1) << shift) < ps:
            shift += 1
    return shift, min((id_max - (ps - 1)) // ps, _PAGE_MAX)


@njit(cache=True, nogil=True)
def _check_chunk(ids, tab, shift, ps, pmax, lo, hi):
    """Counts over ids [lo, hi): ``(outside [0, len(tab) * ps), in range but tombstoned, in range with an entry
    above pmax)``. Every id reads its entry (an id outside reads entry 0), so the body has no branch."""
    v = ids[lo:hi]
    limit = np.uint64(tab.shape[0]) * np.uint64(ps)
    zero = np.uint64(0)
    outside = 0
    tomb = 0
    over = 0
    if shift >= 0:  # pmax is 2**b - 1: one OR over the entries decides
        us = np.uint64(shift)
        acc = 0
        for k in range(v.shape[0]):
            u = np.uint64(v[k])
            inside = u < limit
            outside += not inside
            p = tab[(u if inside else zero) >> us]
            tomb += inside & (p < 0)
            acc |= max(p, 0)
        over = 1 if acc > pmax else 0
    else:
        ups = np.uint64(ps)
        for k in range(v.shape[0]):
            u = np.uint64(v[k])
            inside = u < limit
            outside += not inside
            p = tab[(u if inside else zero) // ups]
            tomb += inside & (p < 0)
            over += inside & (p > pmax)
    return outside, tomb, over


@njit(cache=True, nogil=True)
def _v2p_chunk(ids, tab, shift, ps, out, lo, hi):
    """Translate [lo, hi) into ``out``; every id must already be checked (:func:`_check_chunk`). Element ``k``
    is read before ``out[k]`` is written, so ``out`` may be ``ids`` itself (not a shifted view of it)."""
    v = ids[lo:hi]
    o = out[lo:hi]
    if shift >= 0:
        us = np.uint64(shift)
        mask = ps - 1
        for k in range(v.shape[0]):
            t = v[k]
            o[k] = (max(tab[np.uint64(t) >> us], 0) << shift) | (t & mask)
    else:
        ups = np.uint64(ps)
        for k in range(v.shape[0]):
            t = v[k]
            q = np.uint64(t) // ups
            o[k] = max(tab[q], 0) * ps + (t - np.int64(q) * ps)


@njit(cache=True, nogil=True)
def _target(ids, out):
    """``out``, or a fresh array when ``out`` overlaps ``ids`` other than element for element (addresses are
    compared, never dereferenced)."""
    n = ids.shape[0]
    a = ids.ctypes.data
    b = out.ctypes.data
    if a != b and a < b + 8 * n and b < a + 8 * n:
        return np.empty(n, dtype=np.int64), True
    return out, False


@njit(cache=True, nogil=True)
def _code(outside, tomb, over):
    """The error code of the counts (a range error first, then a tombstone, then an entry overflow)."""
    return 1 if outside else 2 if tomb else 3 if over else 0


#: :func:`_v2p_serial` takes exactly these: 1-D C-contiguous int64 ids and table (read-only or not), an int64
#: page size and id bound, a bool, a writeable 1-D C-contiguous int64 out. Compilation is disabled after this
#: signature, so numba's dispatcher checks every array's dtype, rank and layout (a TypeError for anything else:
#: the checked path takes it) at the cost of typing the call.
_IDS_C = types.Array(types.int64, 1, "C", readonly=True)
_OUT_C = types.Array(types.int64, 1, "C")
#: :func:`_v2p_serial`'s result for a call it does not take (out's length, a page size below 1, an empty
#: table, an id space beyond int64): the checked path raises the typed error.
_UNFIT = -1


@njit(cache=True, nogil=True)
def v2p_run(ids, tab, ps, id_max, strict, out):
    """The one serial translation loop, for any 1-D int64 ``ids``, ``tab`` and ``out`` array types (numba
    code only; :func:`_v2p_serial` is its typed entry, the allocator's direct entry calls it on views of
    validated buffers). Checks every id, then (only if nothing was counted) translates into ``out``. Returns
    0, an error code (1: an id outside, 2: a tombstone when strict, 3: an entry above the largest that fits
    ``id_max``) or :data:`_UNFIT`; ``out`` is untouched unless 0. O(n)."""
    n = ids.shape[0]
    nv = tab.shape[0]
    if out.shape[0] != n or ps < 1 or nv < 1 or ps > id_max // nv:
        return _UNFIT
    shift, pmax = _shift_pmax(ps, id_max)
    outside, tomb, over = _check_chunk(ids, tab, shift, ps, pmax, 0, n)
    code = _code(outside, tomb if strict else 0, over)
    if code == 0:
        dst, moved = _target(ids, out)
        _v2p_chunk(ids, tab, shift, ps, dst, 0, n)
        if moved:
            out[:] = dst
    return code


@njit((_IDS_C, _IDS_C, types.int64, types.int64, types.boolean, _OUT_C), cache=True, nogil=True)
def _v2p_serial(ids, tab, ps, id_max, strict, out):
    """:func:`v2p_run` for exactly the typed arguments above (numba's dispatcher checks them)."""
    return v2p_run(ids, tab, ps, id_max, strict, out)


_v2p_serial.disable_compile()


@njit(cache=True, nogil=True, parallel=True)
def _v2p_par(ids, tab, ps, id_max, strict, out, nchunks):
    n = ids.shape[0]
    shift, pmax = _shift_pmax(ps, id_max)
    res = np.zeros((nchunks, 3), dtype=np.int64)
    for k in prange(nchunks):
        lo, hi = _bounds(n, nchunks, k)
        a, b, d = _check_chunk(ids, tab, shift, ps, pmax, lo, hi)
        res[k, 0] = a
        res[k, 1] = b
        res[k, 2] = d
    code = _code(res[:, 0].sum(), res[:, 1].sum() if strict else 0, res[:, 2].sum())
    if code == 0:
        dst, moved = _target(ids, out)
        for k in prange(nchunks):
            lo, hi = _bounds(n, nchunks, k)
            _v2p_chunk(ids, tab, shift, ps, dst, lo, hi)
        if moved:
            out[:] = dst
    return code


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


def _translate(ids: Any, v2p: Any, page_size: object, out: Any, strict: object, name: str,
               unit: str, bound: object = None) -> torch.Tensor | np.ndarray:
    """The one host translation. Note [Host fast path]: ids given as a numpy array or a CPU tensor, a numpy
    table, ``out`` None or a numpy array or a CPU tensor, an int page size and a bool ``strict`` go straight to
    :func:`_v2p_serial`, whose fixed signature makes numba's dispatcher check dtypes, ranks and layouts (1-D
    C-contiguous int64, ``out`` writeable); anything it does not take, and batches from
    :data:`PARALLEL_MIN_ITEMS`, take :func:`_translate_checked`, which validates with the shared typed errors.
    ``out`` is never written on an error; ``bound`` (``num_physical_pages``) takes the checked path."""
    kind = type(ids)
    if (kind is np.ndarray or kind is torch.Tensor) and type(page_size) is int and (strict is True or strict is False) \
            and bound is None:
        try:
            ids_np = ids if kind is np.ndarray else ids.numpy()
            kout = type(out)
            res = (np.empty(ids_np.size, dtype=np.int64) if out is None else out if kout is np.ndarray
                   else out.numpy() if kout is torch.Tensor else None)
            code = (_UNFIT if res is None or ids_np.size >= PARALLEL_MIN_ITEMS
                    else _v2p_serial(ids_np, v2p, page_size, _I64_MAX, strict, res))
        except (TypeError, RuntimeError, OverflowError):  # not CPU data, or not the kernel's signature
            code = _UNFIT
        if code == 0:
            return torch.from_numpy(res) if out is None else out
        if code > 0:
            _raise_code(code, ids_np, v2p, page_size, name, unit)
    return _translate_checked(ids, v2p, page_size, out, strict, name, unit, bound)


def _translate_checked(ids: Any, v2p: Any, page_size: object, out: Any, strict: object, name: str,
                       unit: str, bound: object = None) -> torch.Tensor | np.ndarray:
    """:func:`_translate` for every other input: validate everything, then one kernel call into ``out`` (when
    it is int64 and contiguous) or into scratch that is then copied into ``out`` or returned."""
    flag = c.strict_flag(strict)
    ids_np = _host(ids, name)
    tab = _host(v2p, "v2p", ndim=1, int64_only=True)
    ps = c.positive_int(page_size, "page_size")
    dtype = ids_np.dtype
    out_np = None if out is None else _out_view(out, ids_np.shape, dtype)
    num_vpages = tab.shape[0]
    c.check_id_space(num_vpages, ps)
    c.check_physical_bound(tab, bound)
    flat = ids_np.reshape(-1) if dtype == np.int64 and ids_np.flags.c_contiguous else _flat(ids_np)
    n = flat.shape[0]
    direct = out_np is not None and dtype == np.int64 and out_np.flags.c_contiguous
    res = out_np.reshape(-1) if direct and out_np is not None else _empty(n)
    if n:
        if num_vpages == 0:
            c.raise_out_of_range(c.wrap_numpy(flat), 0, name, unit)
        if not tab.flags.c_contiguous:
            tab = np.ascontiguousarray(tab)
        id_max = c.ID_MAX[dtype]
        if _parallel_batch(n):
            code = _parallel(_v2p_par, flat, tab, ps, id_max, flag, res)
        else:
            code = _v2p_serial(flat, tab, ps, id_max, flag, res)
        if code:
            _raise_code(code, flat, tab, ps, name, unit, dtype)
    if out is None:
        return _wrap(res, ids_np.shape, dtype)
    if not direct:
        if out_np is not None:
            np.copyto(out_np, res.reshape(ids_np.shape), casting="unsafe")  # int32 results were checked to fit
        else:
            out.copy_(torch.from_numpy(res.reshape(ids_np.shape)))
    return out  # type: ignore[return-value]


def _out_view(out: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
    """A checked ``out=`` (:func:`umalloc.translators._common.check_out`): a numpy view of it to write into,
    or None for a non-contiguous tensor (written with ``copy_``)."""
    if type(out) is np.ndarray:
        c.check_out(out, shape, _TORCH_DTYPE[dtype], _CPU)
        return out
    _check_out(out, shape, _TORCH_DTYPE[dtype])
    if not out.is_contiguous():
        return None
    view = out.numpy()
    if not view.flags.writeable:
        raise InvalidIdError("out is read-only: allowed a writeable tensor")
    return view


def _raise_code(code: int, flat: np.ndarray, tab: np.ndarray, ps: int, name: str, unit: str,
                dtype: np.dtype = _I64) -> None:
    """Raise the error a kernel reported (1: range, 2: tombstone, 3: entry overflow), naming the first
    offender."""
    ids_t, tab_t = c.wrap_numpy(flat), c.wrap_numpy(tab)
    if code == 1:
        c.raise_out_of_range(ids_t, tab.shape[0] * ps, name, unit)
    if code == 2:
        c.raise_tombstone(ids_t, tab_t, ps, name)
    c.raise_entry_overflow(ids_t.to(_TORCH_DTYPE[dtype]), tab_t, ps, name, c.ID_MAX[dtype])


def virtual_to_physical(
    vtokens: c.IndexLike,
    v2p: c.IndexLike,
    page_size: int,
    *,
    out: torch.Tensor | np.ndarray | None = None,
    strict: bool = c.STRICT_DEFAULT,
    num_physical_pages: int | None = None,
) -> torch.Tensor | np.ndarray:
    """Numba version of :func:`umalloc.translators.reference.virtual_to_physical` (CPU tensors and numpy
    arrays only; the fastest call for host tables, e.g. an allocator's numpy v2p master).

    Two O(n) passes over ``vtokens`` (validate, including entry overflow; translate into ``out`` or a fresh
    array), parallel from :data:`PARALLEL_MIN_ITEMS` tokens. ``out``: a CPU tensor or a writeable numpy array
    of the ids' dtype and shape (returned). Raises exactly what the reference raises, plus
    :class:`UmallocValueError` for a non-CPU tensor; ``out`` is untouched on every error. Thread-safe for
    distinct ``out`` (no shared state).

    >>> virtual_to_physical(torch.tensor([0, 1, 3, 4, 5]), torch.tensor([5, -1, 2]), 2, strict=False)
    tensor([10, 11,  1,  4,  5])
    """
    return _translate(vtokens, v2p, page_size, out, strict, "vtokens", "token", num_physical_pages)


def virtual_to_physical_pages(
    vpages: c.IndexLike,
    v2p: c.IndexLike,
    *,
    out: torch.Tensor | np.ndarray | None = None,
    strict: bool = c.STRICT_DEFAULT,
    num_physical_pages: int | None = None,
) -> torch.Tensor | np.ndarray:
    """Numba version of :func:`umalloc.translators.reference.virtual_to_physical_pages` (CPU only).

    >>> virtual_to_physical_pages(torch.tensor([2, 1, 0]), torch.tensor([5, -1, 2]), strict=False)
    tensor([2, 0, 5])
    """
    return _translate(vpages, v2p, 1, out, strict, "vpages", "page", num_physical_pages)


def tokens_to_pages(tokens: c.IndexLike, page_size: int) -> torch.Tensor:
    """Numba version of :func:`umalloc.translators.reference.tokens_to_pages` (CPU tensors only). O(n).

    >>> tokens_to_pages(torch.tensor([8, 9, 10, 11, 0, 1, 2, 3]), 4)
    tensor([2, 0])
    """
    tok_t, ps = c.tokens_args(tokens, page_size)
    _cpu(tok_t, "tokens")
    tok = _flat(tok_t.numpy())
    num_pages = tok.shape[0] // ps
    res = _empty(num_pages)
    if num_pages:
        shift = _shift_of(ps)
        if _parallel_batch(tok.shape[0]):
            bad = _parallel(_t2p_par, tok, ps, shift, res)
        else:
            bad = _t2p_chunk(tok, ps, shift, res, 0, num_pages)
        if bad:
            c.raise_misaligned(c.wrap_numpy(tok), ps)
    return _wrap(res, (num_pages,), tok_t.numpy().dtype)


def pages_to_runs(src_pages: c.IndexLike, dst_pages: c.IndexLike) -> torch.Tensor:
    """Numba version of :func:`umalloc.translators.reference.pages_to_runs` (CPU tensors and numpy arrays):
    :func:`pages_to_runs_numpy` with the result as a tensor.

    >>> pages_to_runs(torch.tensor([3, 4, 5, 9]), torch.tensor([7, 8, 2, 3]))
    tensor([[3, 7, 2],
            [5, 2, 1],
            [9, 3, 1]])
    """
    return torch.from_numpy(pages_to_runs_numpy(src_pages, dst_pages))


def pages_to_runs_numpy(src_pages: c.IndexLike, dst_pages: c.IndexLike) -> np.ndarray:
    """:func:`pages_to_runs` returning a numpy ``int64 (R, 3)`` array: the one run-coalescing implementation on
    the host (compaction, the descriptor builders and :func:`pages_to_runs` call it). Two 1-D int64 numpy
    arrays of one length are taken as they are (no torch wrapper either way); anything else is validated as
    :func:`pages_to_runs` validates it, with the same typed errors.

    One O(n) pass (parallel from :data:`PARALLEL_MIN_ITEMS` pages) writes runs into an ``(n, 3)`` scratch
    array; chunks are then moved together (one ``memmove`` per chunk after the first) and the array is shrunk
    in place to ``(R, 3)``. Only the rows written are ever touched, so the scratch costs address space, not
    memory traffic. Raises InvalidIdError (a negative id, a bad dtype or rank), UmallocValueError (unequal
    lengths, a tensor not on the CPU).

    >>> pages_to_runs_numpy(np.array([3, 4, 5, 9]), np.array([7, 8, 2, 3])).tolist()
    [[3, 7, 2], [5, 2, 1], [9, 3, 1]]
    """
    if not (type(src_pages) is np.ndarray and type(dst_pages) is np.ndarray and src_pages.dtype is _I64
            and dst_pages.dtype is _I64 and src_pages.ndim == 1 and dst_pages.shape == src_pages.shape):
        src_t, dst_t = c.runs_args(src_pages, dst_pages)
        _cpu(src_t, "src_pages")
        _cpu(dst_t, "dst_pages")
        src, dst = _flat(src_t.numpy()), _flat(dst_t.numpy())
    else:  # any strides: the kernel indexes by them
        src, dst = src_pages, dst_pages
    n = src.shape[0]
    if n == 0:
        return np.empty((0, 3), dtype=np.int64)
    runs = np.empty((n, 3), dtype=np.int64)
    if not _parallel_batch(n):
        num_runs, neg = _runs_chunk(src, dst, runs, 0, n)
    else:
        counts = _parallel(_runs_par, src, dst, runs)
        nchunks = counts.shape[0]
        neg = bool(counts[:, 1].any())
        num_runs = int(counts[0, 0])
        for k in range(1, nchunks):  # over chunks (a handful), never over runs
            lo = k * n // nchunks
            cnt = int(counts[k, 0])
            if cnt and lo != num_runs:
                runs[num_runs : num_runs + cnt] = runs[lo : lo + cnt]  # overlapping copies are memmoves
            num_runs += cnt
    if neg:
        if bool((src < 0).any()):
            c.raise_negative(c.wrap_numpy(src), "src_pages")
        c.raise_negative(c.wrap_numpy(dst), "dst_pages")
    runs.resize((num_runs, 3), refcheck=False)  # shrinks in place (realloc); no view of runs exists
    return runs


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
    dtype = tok_t.numpy().dtype
    tok = _flat(tok_t.numpy())
    n = tok.shape[0]
    res = _empty(n)
    if n == 0:
        return _wrap(res, tok_t.shape, dtype)
    neg, hi = _kernel_ids_chunk(tok, ps, _shift_of(ps), ps * layers, res)
    if neg:
        c.raise_negative(c.wrap_numpy(tok), "tokens")
    c.check_kernel_ids_fit(int(hi), ps, layers, c.ID_MAX[dtype])
    return _wrap(res, tok_t.shape, dtype)


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
    dtype = pos_t.numpy().dtype
    pos = _flat(pos_t.numpy())
    shift = _shift_of(d)
    owned, neg = _dcp_count(pos, d, r, shift)
    if neg:
        c.raise_negative(c.wrap_numpy(pos), "positions")
    indices = _empty(owned)
    rows = _empty(owned)
    if owned:
        _dcp_fill(pos, d, r, shift, indices, rows)
    return torch.from_numpy(indices), _wrap(rows, (owned,), dtype)
