"""Graph-capturable translation: one kernel into a preallocated ``out``, no host synchronisation, no allocation.

Policy:

* For decode steps under CUDA graphs (``torch.cuda.CUDAGraph``): :func:`virtual_to_physical` and
  :func:`virtual_to_physical_pages` write into a caller-owned ``out`` of fixed address and read the table
  through its pointer on every launch, so a graph replayed after the table changed (the allocator's device
  mirror is refreshed in place, never reallocated) sees the new entries.
* Nothing is checked on the device before the write. Every lane is written; a bad lane goes to the sink
  page ``sink_page`` (default :data:`~umalloc.translators.SINK_PAGE` 0, the trash page padded writes may hit,
  Note [Tombstones map to the sink] in :mod:`umalloc.translators.reference`; pass a zero page, such as the one
  a request table mints, where padded lanes are read) and ORs a bit into a caller-owned device error flag
  (:class:`ErrorFlag`), which a later host call (:meth:`ErrorFlag.check`, outside the graph) reads and turns into
  the typed error. Strict checking before any write stays in the other translators.
* Flag bits: :data:`BAD_RANGE` (an id outside ``[0, len(v2p) * page_size)``: result ``sink * page_size``),
  :data:`BAD_TOMBSTONE` (``strict`` and a tombstoned entry: result ``sink * page_size + offset``),
  :data:`BAD_OVERFLOW` (an entry whose ids would not fit the ids' dtype: result ``sink * page_size + offset``).
  A tombstone with ``strict=False`` maps to the sink and sets nothing, as everywhere else.
* Note [Capturable arithmetic]: the one definition, branch-free, per lane with ``limit = len(v2p) * ps`` and
  ``pmax`` the largest entry whose ids fit the dtype::

      inb  = 0 <= t < limit;      tc = inb ? t : 0;       q = tc / ps;   r = tc - q * ps
      p    = inb ? v2p[q] : -1;   tomb = p < 0;           over = p > pmax
      out  = ((tomb | over) ? sink : p) * ps + r
      flag |= (!inb) * BAD_RANGE | (inb & tomb & strict) * BAD_TOMBSTONE | over * BAD_OVERFLOW

  :func:`reference_arithmetic` is exactly this in torch ops (any device; several kernels, also capturable) and
  is tested on CPU against :mod:`umalloc.translators.reference`; the CUDA kernel computes exactly the same
  expressions (the kernel tests compare the two bit for bit, flags included).
* Implementations: ``"cupy"`` (one ``RawKernel`` launched on torch's current stream with raw pointers -- no
  DLPack exchange, no cupy allocation, so nothing in the launch can synchronise or break a capture) and
  ``"torch"`` (:func:`reference_arithmetic`). ``impl="auto"`` takes cupy for CUDA tensors when it loads, else
  torch. Why cupy rather than Triton (both are on the target image): the kernel is compiled once by NVRTC
  (cached on disk), takes raw pointers, needs no JIT specialisation per argument value and shares the module
  of :mod:`umalloc.translators.cuda`; ``benchmarks/bench_gpu.py`` times it against torch indexing, the
  graph-replayed torch arithmetic and a Triton kernel of the same arithmetic, so the choice is checked there.
* Threading: calls only enqueue work on the current stream; the flag and ``out`` belong to the caller.
  Complexity O(n) device work, O(1) host work (argument checks read metadata only).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from umalloc.errors import InvalidIdError, TombstoneError, UmallocValueError
from umalloc.translators import _common as c
from umalloc.translators import cuda as _cuda

#: Error-flag bit: an id outside the table's id space (routed to physical id 0).
BAD_RANGE: int = 1
#: Error-flag bit: a tombstoned entry under ``strict=True`` (routed to the sink page).
BAD_TOMBSTONE: int = 2
#: Error-flag bit: an entry whose physical ids would not fit the ids' dtype (routed to the sink page).
BAD_OVERFLOW: int = 4

IMPLS: tuple[str, ...] = ("auto", "cupy", "torch")

_THREADS = 256
_MAX_BLOCKS = 65535 * 4

_cp: Any = None
_REASON: str | None = None
try:  # Note: a broken CUDA install can raise more than ImportError here.
    import cupy as _cp  # type: ignore[no-redef]
except Exception as exc:  # noqa: BLE001
    _REASON = f"cupy is not importable ({type(exc).__name__}: {exc})"

# One template, instantiated for int64 and int32 ids; every expression is Note [Capturable arithmetic].
_TEMPLATE = r"""
extern "C" __global__ void umalloc_v2p_graph_NAME(
        const ID_T* ids, long long n, const long long* tab, long long limit, long long ps,
        int strict, long long pmax, long long sink, ID_T* out, int* flag) {
    int bits = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long t = (long long)ids[i];
        int inb = (t >= 0) & (t < limit);
        long long tc = inb ? t : 0;
        long long q = tc / ps;
        long long r = tc - q * ps;
        long long p = inb ? tab[q] : -1;
        int tomb = p < 0;
        int over = p > pmax;
        out[i] = (ID_T)(((tomb | over) ? sink : p) * ps + r);
        bits |= (inb ? 0 : BAD_RANGE_V) | ((inb & tomb & strict) ? BAD_TOMBSTONE_V : 0)
                | (over ? BAD_OVERFLOW_V : 0);
    }
    if (bits) atomicOr(flag, bits);
}
"""


def _source() -> str:
    consts = {"BAD_RANGE_V": str(BAD_RANGE), "BAD_TOMBSTONE_V": str(BAD_TOMBSTONE),
              "BAD_OVERFLOW_V": str(BAD_OVERFLOW)}
    parts = []
    for name, ctype in (("i64", "long long"), ("i32", "int")):
        body = _TEMPLATE.replace("NAME", name).replace("ID_T", ctype)
        for k, v in consts.items():
            body = body.replace(k, v)
        parts.append(body)
    return "\n".join(parts)


_module: Any = None


def _kernel(dtype: torch.dtype) -> Any:
    """The compiled kernel for ``dtype`` ids (compiled once per process on first use: call once before a
    capture so compilation stays out of it)."""
    global _module
    if _module is None:
        _module = _cp.RawModule(code=_source())
    return _module.get_function("umalloc_v2p_graph_i64" if dtype == torch.int64 else "umalloc_v2p_graph_i32")


#: Why the cupy kernel cannot run here, or None when it can: the cuda translator's check (one cupy probe).
cupy_unavailable_reason = _cuda.unavailable_reason


class ErrorFlag:
    """A device-side error flag: one ``int32`` word on ``device`` that capturable translations OR bits into.

    Create it once, outside any graph (it allocates); :meth:`reset` and the translations are capturable;
    :meth:`check` and :meth:`value` read the word back (one synchronisation) and must run outside a capture.
    Not thread-safe: one flag per stream of work.

    >>> flag = ErrorFlag("cpu")
    >>> out = torch.empty(3, dtype=torch.int64)
    >>> virtual_to_physical(torch.tensor([0, 3, 99]), torch.tensor([2, 5]), 2, out=out, flag=flag).tolist()
    [4, 11, 0]
    >>> flag.value() == BAD_RANGE
    True
    """

    def __init__(self, device: torch.device | str) -> None:
        self.word = torch.zeros(1, dtype=torch.int32, device=torch.device(device))

    def reset(self) -> None:
        """Clear every bit (one device memset; capturable)."""
        self.word.zero_()

    def value(self) -> int:
        """The bits set since the last :meth:`reset` (reads the device: synchronises its stream)."""
        return int(self.word.item())

    def check(self, *, reset: bool = True) -> None:
        """Raise the typed error for the bits set since the last reset (then clear them when ``reset``).

        Raises:
            InvalidIdError: :data:`BAD_RANGE` or :data:`BAD_OVERFLOW` set (named in the message).
            TombstoneError: only :data:`BAD_TOMBSTONE` set.
        """
        bits = self.value()
        if reset and bits:
            self.reset()
        names = [n for b, n in ((BAD_RANGE, "an id out of range"), (BAD_TOMBSTONE, "a tombstoned entry (strict)"),
                                (BAD_OVERFLOW, "an entry whose ids overflow the ids' dtype")) if bits & b]
        if not names:
            return
        msg = f"a captured translation routed bad lanes to the sink: {', '.join(names)} (flag bits {bits})"
        if bits & (BAD_RANGE | BAD_OVERFLOW):
            raise InvalidIdError(msg)
        raise TombstoneError(msg)


def reference_arithmetic(ids: torch.Tensor, v2p: torch.Tensor, page_size: int, strict: bool,
                         out: torch.Tensor, flag: torch.Tensor, sink_page: int = c.SINK_PAGE) -> None:
    """Note [Capturable arithmetic] in torch ops: writes ``out`` (ids' dtype and shape), ORs into ``flag``
    (``int32 (1,)``). No host synchronisation; on CUDA its temporaries come from the caching allocator (or a
    graph's private pool). The specification the CUDA kernel is tested against."""
    t = ids.reshape(-1).to(torch.int64)
    limit = v2p.numel() * page_size
    pmax = c.max_entry(page_size, c.ID_MAX[ids.dtype])
    inb = (t >= 0) & (t < limit)
    tc = torch.where(inb, t, 0)
    q = torch.div(tc, page_size, rounding_mode="floor")
    r = tc - q * page_size
    p = torch.where(inb, v2p[q], -1) if v2p.numel() else torch.full_like(t, -1)
    tomb = p < 0
    over = p > pmax
    res = torch.where(tomb | over, sink_page, p) * page_size + r
    out.view(-1).copy_(res)
    bits = (~inb).any().to(torch.int32) * BAD_RANGE
    if strict:
        bits = bits + (inb & tomb).any().to(torch.int32) * BAD_TOMBSTONE
    bits = bits + over.any().to(torch.int32) * BAD_OVERFLOW
    flag.bitwise_or_(bits.reshape(1))


def _sink(sink_page: object, ps: int, dtype: torch.dtype) -> int:
    """``sink_page`` as an int whose ids ``sink * ps + offset`` fit ``dtype``, or raise UmallocValueError."""
    top = c.max_entry(ps, c.ID_MAX[dtype])
    if isinstance(sink_page, (bool, np.bool_)) or not isinstance(sink_page, (int, np.integer)) \
            or not 0 <= int(sink_page) <= top:
        raise UmallocValueError(f"sink_page={sink_page!r}: allowed an int in [0, {top}] (its ids must fit {dtype})")
    return int(sink_page)


def _args(ids: object, v2p: object, page_size: object, out: object, flag: object, strict: object,
          impl: object, name: str) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, ErrorFlag, bool, str]:
    """Host-only checks (metadata, no device reads): typed errors before anything is enqueued."""
    ids_t, tab, ps, flag_strict = c.translate_args(ids, v2p, page_size, out, name, strict)
    if out is None:
        raise UmallocValueError("out is required: a preallocated tensor of the ids' dtype, shape and device")
    if not isinstance(flag, ErrorFlag):
        raise UmallocValueError(f"flag must be an ErrorFlag, got {type(flag).__name__}")
    if flag.word.device != ids_t.device:
        raise UmallocValueError(f"flag is on {flag.word.device} but the ids are on {ids_t.device}; they must match")
    if impl not in IMPLS:
        raise UmallocValueError(f"impl={impl!r}: allowed {', '.join(IMPLS)}")
    if impl == "auto":
        impl = "cupy" if ids_t.device.type == "cuda" and cupy_unavailable_reason() is None else "torch"
    if impl == "cupy":
        reason = cupy_unavailable_reason()
        if reason is not None:
            raise UmallocValueError(f"impl='cupy' is unavailable: {reason}")
        if ids_t.device.type != "cuda":
            raise UmallocValueError(f"impl='cupy' needs CUDA tensors; the ids are on {ids_t.device}")
        for what, x in ((name, ids_t), ("v2p", tab), ("out", out)):
            if not isinstance(x, torch.Tensor) or not x.is_contiguous():
                raise InvalidIdError(f"impl='cupy' needs contiguous tensors (fixed addresses); {what} is strided")
    return ids_t, tab, ps, out, flag, flag_strict, str(impl)  # type: ignore[return-value]


def _launch(ids: torch.Tensor, tab: torch.Tensor, ps: int, strict: bool, out: torch.Tensor, flag: ErrorFlag,
            sink: int) -> None:
    n = ids.numel()
    if n == 0:
        return
    fn = _kernel(ids.dtype)
    dev = ids.device
    ptr = torch.cuda.current_stream(dev).cuda_stream
    stream = _cp.cuda.Stream.null if ptr == 0 else _cp.cuda.ExternalStream(ptr)
    pmax = c.max_entry(ps, c.ID_MAX[ids.dtype])
    grid = (max(1, min(_MAX_BLOCKS, (n + _THREADS - 1) // _THREADS)),)
    args = (np.uint64(ids.data_ptr()), np.int64(n), np.uint64(tab.data_ptr()), np.int64(tab.numel() * ps),
            np.int64(ps), np.int32(strict), np.int64(pmax), np.int64(sink), np.uint64(out.data_ptr()),
            np.uint64(flag.word.data_ptr()))
    with _cp.cuda.Device(dev.index if dev.index is not None else torch.cuda.current_device()), stream:
        fn(grid, (_THREADS,), args)


def _run(ids: torch.Tensor, tab: torch.Tensor, ps: int, out: torch.Tensor, flag: ErrorFlag, strict: bool,
         impl: str, sink: int) -> torch.Tensor:
    plain = tab.as_subclass(torch.Tensor)  # an allocator's read-only view reads the same memory
    if impl == "cupy":
        _launch(ids, plain, ps, strict, out, flag, sink)
    else:
        reference_arithmetic(ids, plain, ps, strict, out, flag.word, sink)
    return out


def virtual_to_physical(vtokens: c.IndexLike, v2p: c.IndexLike, page_size: int, *, out: torch.Tensor,
                        flag: ErrorFlag, strict: bool = c.STRICT_DEFAULT, impl: str = "auto",
                        sink_page: int = c.SINK_PAGE) -> torch.Tensor:
    """Capturable ``v2p[t // page_size] * page_size + t % page_size`` into ``out`` (Note [Capturable arithmetic]).

    Args:
        vtokens: int64 or int32 tensor of virtual token ids, any shape, on ``v2p``'s device (contiguous for
            cupy). Must not alias ``out`` under cupy (lanes are read and written by the same thread, so an
            exact alias is safe; a partial overlap is not).
        v2p: 1-D int64 table (``v2p[vpage]`` physical page or negative); read through its pointer at every
            launch, so keep its storage fixed (the allocator's :meth:`v2p` views are).
        page_size: tokens per page, >= 1.
        out: required tensor of ``vtokens``' dtype, shape and device; every lane is written. Returned.
        flag: the :class:`ErrorFlag` on the same device that bad lanes OR their bits into.
        strict: a bool; True flags tombstones (:data:`BAD_TOMBSTONE`), False maps them to the sink silently.
        impl: ``"auto"`` (cupy for CUDA tensors when it loads, else torch), ``"cupy"`` or ``"torch"``.
        sink_page: the physical page bad lanes and (non-strict) tombstones go to, default 0; its ids must fit
            the ids' dtype.

    Returns:
        ``out``.

    Raises (host checks only, before anything is enqueued):
        InvalidIdError: wrong dtype/rank/layout, a wrong ``out``, a strided tensor for cupy.
        UmallocValueError: missing ``out``, a bad ``flag``, ``impl``, ``strict`` or ``sink_page``, devices that differ,
            cupy unavailable when forced.

    O(n) device work; one kernel (cupy), no host synchronisation, no allocation (cupy).

    >>> flag = ErrorFlag("cpu")
    >>> virtual_to_physical(torch.tensor([2, 3]), torch.tensor([0, -1]), 2, out=torch.empty(2, dtype=torch.int64),
    ...                     flag=flag).tolist(), flag.value() == BAD_TOMBSTONE
    ([0, 1], True)
    """
    args = _args(vtokens, v2p, page_size, out, flag, strict, impl, "vtokens")
    ids_t, tab, ps, out_t, flag_o, flag_strict, which = args
    return _run(ids_t, tab, ps, out_t, flag_o, flag_strict, which, _sink(sink_page, ps, ids_t.dtype))


def virtual_to_physical_pages(vpages: c.IndexLike, v2p: c.IndexLike, *, out: torch.Tensor, flag: ErrorFlag,
                              strict: bool = c.STRICT_DEFAULT, impl: str = "auto",
                              sink_page: int = c.SINK_PAGE) -> torch.Tensor:
    """Capturable ``v2p[vpage]`` into ``out``: :func:`virtual_to_physical` with ``page_size = 1`` (same
    arguments, flags and errors).

    >>> flag = ErrorFlag("cpu")
    >>> virtual_to_physical_pages(torch.tensor([1, 0, 7]), torch.tensor([0, 4]), out=torch.empty(3,
    ...                           dtype=torch.int64), flag=flag).tolist()
    [4, 0, 0]
    """
    ids_t, tab, ps, out_t, flag_o, flag_strict, which = _args(vpages, v2p, 1, out, flag, strict, impl, "vpages")
    return _run(ids_t, tab, ps, out_t, flag_o, flag_strict, which, _sink(sink_page, 1, ids_t.dtype))


__all__ = ["BAD_OVERFLOW", "BAD_RANGE", "BAD_TOMBSTONE", "IMPLS", "ErrorFlag", "cupy_unavailable_reason",
           "reference_arithmetic", "virtual_to_physical", "virtual_to_physical_pages"]
