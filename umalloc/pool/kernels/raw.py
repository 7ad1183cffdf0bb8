"""The one module with pointer intrinsics: raw addresses in, numba array views out.

Rules (read before touching anything that imports this module)
================================================================
Who owns each array
    Every array whose address appears here belongs to one :class:`umalloc.pool.heap.Heap`: ``meta`` (int64
    ``(E, M_NFIELDS)``), ``h64`` (int64), ``h8`` (int8), one pin-count array per end (int32, lent to the
    :class:`~umalloc.leases.table.LeaseTable`) and the *root* vector (int64) that lists the others' addresses and
    lengths (Note [Heap root]). The heap allocates them once, in its constructor, and never rebinds, resizes or
    frees them while it lives; it refuses copy, deepcopy and pickle (a copy would carry addresses of another
    object's memory).
When addresses may change
    Never while the heap lives: numpy never moves an array's buffer, and no code resizes these arrays in place
    (``ndarray.resize`` is never called on them). A root address is valid exactly as long as the heap object that
    built it; the heap keeps the root alive itself.
What a caller must guarantee
    * ``root_a`` passed to a kernel is ``Heap.root_a`` of a heap the caller holds a reference to for the call.
    * An id argument passed as an ``int`` is :func:`address` of a *contiguous CPU int64 torch tensor* with at
      least ``n`` elements that the caller keeps alive until the kernel returns; an id argument passed as an
      array is a 1-D int64 numpy array (any strides, numba reads it through its own strides).
    * End and owner indices lie in ``[0, E)``; bind-mask offsets come from the heap's mask area.
    The compiled entry points (:mod:`umalloc.pool.kernels.ops`, Note [Direct entry]) do not type their
    arguments. With ``UMALLOC_DEBUG=1`` (read when an allocator is built) every direct-entry call is checked
    against these rules first (:func:`umalloc.pool.kernels.ops.checked_entries`) and a violation raises
    :class:`~umalloc.errors.InvalidIdError` instead of reading memory as the wrong type.

Byte copies of an arena (:func:`copy_pages`, :func:`copy_chunks`)
    The one other address used here is the base of a CPU arena's byte buffer (``Arena.data``), for compaction's
    row copies (:func:`umalloc.pool.compaction.copy_moves`). The caller holds the arena for the call and keeps
    source and destination ranges disjoint; :func:`copy_pages` checks every page against the buffer's rows
    before it copies, :func:`copy_chunks` takes byte ranges its caller built from checked runs. Both copy with
    ``memcpy`` (LLVM's intrinsic: the C library's copy at run time).

Note [Heap root]
~~~~~~~~~~~~~~~~
numba's dispatcher unboxes each array argument (about 0.2 us each, more for a tuple of arrays) but an int in
tens of ns. The hot kernels (``k_*``) therefore take one int, the address of a small int64 *root* vector:
``[meta address, E, h64 address, len, h8 address, len, (pin-count address, len) per end]``, and view the masters
with ``numba.carray``.

Note [Zero-copy tensor inputs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Batched id tensors reach the kernels as (address, length) of a validated contiguous CPU int64 tensor, viewed in
the kernel with ``numba.carray``; this skips ``Tensor.numpy()`` (about 1 us per tensor). The Python wrapper keeps
the tensor alive for the call. The page-level calls also take 1-D int64 numpy arrays, which numba unboxes itself
(:func:`_ids_view`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numba
import numpy as np
import torch
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from umalloc.errors import InvalidIdError
from umalloc.pool.kernels.layout import M_NFIELDS


def _ptr_intrinsic(elem: types.Type, doc: str) -> Any:
    """A numba intrinsic ``int -> elem*`` (the address of a validated buffer the caller keeps alive)."""

    @intrinsic
    def ptr(typingctx, addr):  # noqa: ARG001 - numba intrinsic signature
        if not isinstance(addr, types.Integer):
            return None
        sig = types.CPointer(elem)(addr)

        def codegen(context, builder, signature, args):  # noqa: ARG001
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(elem)))

        return sig, codegen

    ptr.__doc__ = doc
    return ptr


_i64_ptr = _ptr_intrinsic(types.int64, "``int -> int64*``")
_i32_ptr = _ptr_intrinsic(types.int32, "``int -> int32*``")
_i8_ptr = _ptr_intrinsic(types.int8, "``int -> int8*``")


@njit(cache=True, inline="always", error_model="numpy")
def _view(addr, n):
    """Inside a kernel: ``n`` int64s at address ``addr`` (Note [Zero-copy tensor inputs])."""
    return carray(_i64_ptr(addr), (n,))


def _ids_view(x, n):  # noqa: ARG001 - typed by the overload below
    """Inside a kernel: the int64 ids a caller passed, as an address (``int``, a validated contiguous torch
    tensor) or as a 1-D int64 numpy array (any strides); Note [Zero-copy tensor inputs]."""
    raise NotImplementedError("numba-only")


# not inline="always": numba's IR inlining of this overload miscompiled k_free (the owner's live-id counter
# stopped moving; tests/allocator/test_allocator.py caught it). The call costs nothing measurable.
@overload(_ids_view)
def _ids_view_impl(x, n):
    if isinstance(x, types.Integer):
        return lambda x, n: _view(x, n)
    if isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.int64:
        return lambda x, n: x
    return None


@intrinsic
def _memcpy(typingctx, dst_addr, src_addr, nbytes):  # noqa: ARG001 - numba intrinsic signature
    """``memcpy(dst, src, nbytes)`` on raw addresses (LLVM's ``llvm.memcpy``: a call to the C library's copy)."""
    if not all(isinstance(a, types.Integer) for a in (dst_addr, src_addr, nbytes)):
        return None
    sig = types.void(dst_addr, src_addr, nbytes)

    def codegen(context, builder, signature, args):  # noqa: ARG001
        d, s, n = args
        cgutils.raw_memcpy(builder, builder.inttoptr(d, cgutils.voidptr_t), builder.inttoptr(s, cgutils.voidptr_t),
                           n, 1)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def copy_pages(base, src, dst, row_bytes, rows):  # pragma: no cover - numba
    """Copy rows ``src[i] -> dst[i]`` (int64 ``(n,)`` each) of the byte buffer at address ``base`` (``rows`` rows
    of ``row_bytes``) on the calling thread: consecutive pages whose sources and destinations both advance by one
    are coalesced into one run, one ``memcpy`` per run. Returns ``-1 - i`` (nothing copied) if ``src[i]`` or
    ``dst[i]`` lies outside ``[0, rows)``, else the number of runs. The caller keeps the buffer alive and the two
    page sets disjoint (the module docstring). O(n + bytes)."""
    n = src.shape[0]
    for i in range(n):
        if src[i] < 0 or src[i] >= rows or dst[i] < 0 or dst[i] >= rows:
            return -1 - i
    runs = 0
    i = 0
    while i < n:
        j = i + 1
        while j < n and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        _memcpy(base + dst[i] * row_bytes, base + src[i] * row_bytes, (j - i) * row_bytes)
        runs += 1
        i = j
    return runs


@njit(cache=True, nogil=True, parallel=True)
def copy_chunks(base, chunks):  # pragma: no cover - numba
    """Copy byte ranges of the buffer at address ``base``: for each ``(src, dst, nbytes)`` row of ``chunks`` (int64
    ``(C, 3)``, byte offsets), one ``memcpy``; the rows spread over numba's threads. O(bytes)."""
    for i in numba.prange(chunks.shape[0]):
        _memcpy(base + chunks[i, 1], base + chunks[i, 0], chunks[i, 2])


@njit(cache=True, nogil=True)
def split_runs(runs, row_bytes, chunk_bytes, out):  # pragma: no cover - numba
    """The runs ``(src, dst, n)`` (rows of ``row_bytes``) as byte ranges ``(src, dst, nbytes)`` of at most
    ``chunk_bytes`` each, in order, into ``out`` (int64 ``(C, 3)`` with ``C >= sum(ceil(n * row_bytes /
    chunk_bytes))``); returns how many. O(runs + chunks)."""
    c = 0
    for i in range(runs.shape[0]):
        s = runs[i, 0] * row_bytes
        d = runs[i, 1] * row_bytes
        left = runs[i, 2] * row_bytes
        while left > 0:
            m = chunk_bytes if left > chunk_bytes else left
            out[c, 0] = s
            out[c, 1] = d
            out[c, 2] = m
            s += m
            d += m
            left -= m
            c += 1
    return c


# root vector (Note [Heap root]): addresses and lengths of the host masters
_R_META, _R_E, _R_H64, _R_N64, _R_H8, _R_N8, _R_PINS = range(7)


@njit(cache=True, inline="always", error_model="numpy")
def _heaps(root_a):
    """(meta, h64, h8) viewed from the root vector at address ``root_a`` (Note [Heap root])."""
    root = carray(_i64_ptr(root_a), (_R_PINS,))
    meta = carray(_i64_ptr(root[_R_META]), (root[_R_E], M_NFIELDS))
    h64 = carray(_i64_ptr(root[_R_H64]), (root[_R_N64],))
    h8 = carray(_i8_ptr(root[_R_H8]), (root[_R_N8],))
    return meta, h64, h8


@njit(cache=True, inline="always", error_model="numpy")
def _pins_of(root_a, e):
    """End ``e``'s per-page pin counts (int32, owned by the heap, lent to the lease table)."""
    root = carray(_i64_ptr(root_a), (_R_PINS + 2 * (e + 1),))
    return carray(_i32_ptr(root[_R_PINS + 2 * e]), (root[_R_PINS + 2 * e + 1],))


def build_root(meta: np.ndarray, h64: np.ndarray, h8: np.ndarray, pins: Sequence[np.ndarray]) -> np.ndarray:
    """The root vector naming ``meta``, ``h64``, ``h8`` and each end's pins (Note [Heap root]); the caller (the
    heap) owns every array and keeps them and the result alive together. Raises InvalidIdError if an array does
    not have the dtype, layout and shape the kernels view it with."""
    E = meta.shape[0]
    for name, arr, dt in (("meta", meta, np.int64), ("h64", h64, np.int64), ("h8", h8, np.int8)):
        if arr.dtype != dt or not arr.flags.c_contiguous:
            raise InvalidIdError(f"heap array {name}: {arr.dtype}, contiguous={arr.flags.c_contiguous}; "
                                 f"allowed contiguous {np.dtype(dt)}")
    if meta.shape != (E, M_NFIELDS) or len(pins) != E:
        raise InvalidIdError(f"heap meta {meta.shape} with {len(pins)} pin arrays; allowed ({E}, {M_NFIELDS}), {E}")
    root = np.zeros(_R_PINS + 2 * E, np.int64)
    root[[_R_META, _R_E, _R_H64, _R_N64, _R_H8, _R_N8]] = (meta.ctypes.data, E, h64.ctypes.data, h64.size,
                                                            h8.ctypes.data, h8.size)
    for i, p in enumerate(pins):
        if p.dtype != np.int32 or not p.flags.c_contiguous or p.ndim != 1:
            raise InvalidIdError(f"pin counts of end {i}: {p.dtype} {p.shape}; allowed contiguous 1-D int32")
        root[_R_PINS + 2 * i: _R_PINS + 2 * i + 2] = (p.ctypes.data, p.size)
    return root


def root_address(root: np.ndarray) -> int:
    """The address kernels take for a root vector built by :func:`build_root`."""
    return int(root.ctypes.data)


#: ``address(t)``: the data address of a validated contiguous CPU torch tensor (``Tensor.data_ptr``, unbound, so
#: a call costs what the method call costs). The allocator passes ids to kernels only through this or
#: :func:`lend` (debug mode).
address = torch.Tensor.data_ptr

# debug mode (UMALLOC_DEBUG=1): every address handed to a kernel is recorded with its byte length until the
# checked entry point has verified the call (Note [Direct entry] in umalloc.pool.kernels.ops)
_lent: dict[int, int] = {}


def lend(t: torch.Tensor) -> int:
    """Debug-mode :data:`address`: records ``[address, address + nbytes)`` so the checked entry points can bound
    every access through it (:func:`check_lent`)."""
    if not (isinstance(t, torch.Tensor) and t.is_cpu and t.is_contiguous() and t.dtype == torch.int64):
        raise InvalidIdError(f"lend: {type(t).__name__}; allowed a contiguous CPU torch.int64 tensor")
    a = t.data_ptr()
    _lent[a] = max(_lent.get(a, 0), t.numel() * 8)
    return a


def check_lent(name: str, addr: object, n: object) -> None:
    """Raise InvalidIdError unless ``addr`` was lent (:func:`lend`) with room for ``n`` int64s."""
    if type(addr) is not int or type(n) is not int:
        raise InvalidIdError(f"{name}: address {addr!r}, length {n!r}; allowed ints")
    if n < 0 or _lent.get(addr, -1) < 8 * n:
        raise InvalidIdError(f"{name}: {n} int64s at an address with {_lent.get(addr, 0)} lent bytes; allowed "
                             f"a lent contiguous CPU int64 buffer of at least {8 * max(n, 0)} bytes")


def forget_lent() -> None:
    """Drop the debug-mode lending records (after a checked call)."""
    _lent.clear()


__all__ = ["address", "build_root", "check_lent", "copy_chunks", "copy_pages", "forget_lent", "lend", "root_address",
           "split_runs"]
