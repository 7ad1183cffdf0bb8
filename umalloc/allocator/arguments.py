"""The allocator's argument and result forms at its boundary: ids and ``out=`` buffers as kernel arguments, and
the read-only tables it returns.

* Ids are 1-D integer tensors (``torch``, any device, dense) or 1-D integer numpy arrays. ``int64`` goes to the
  kernels as is (a contiguous CPU tensor by address, a numpy array as itself: Note [Zero-copy tensor inputs] in
  :mod:`umalloc.pool.kernels.raw`); other integer dtypes (``int32`` block tables of vLLM and SGLang, ``int16``,
  unsigned) are converted once to ``int64``, and values that do not fit (``uint64`` at or above ``2**63``) are
  refused. Bools, floats, complex, meta and sparse tensors are refused with
  :class:`~umalloc.errors.InvalidIdError`. The checks and conversions are :mod:`umalloc.ids` (the one id
  validator, with the count and ``strict`` arguments); this module adds the hot paths' first tests and the
  kernel arguments.
* Outputs (``out=``) are caller-owned ``int64`` buffers; a table the allocator returned
  (:class:`ReadOnlyTable`, or a view of one) is refused as ``out``.

The first test of each validator is the hot path's (one ``type(...) is`` and a few attribute reads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch

from umalloc.errors import InvalidIdError
from umalloc.ids import check_id_tensor, host_ids
from umalloc.pool.kernels.raw import address

_I64 = torch.int64
_Tensor = torch.Tensor
_NP_I64 = np.dtype(np.int64)


class ReadOnlyTable(torch.Tensor):
    """A torch tensor view of an allocator table that refuses writes.

    In-place operations (``t[i] = x``, ``t.copy_(...)``, ``t += 1``, any method ending in ``_``), ``out=``
    arguments naming it and passing it as an allocator ``out=`` raise :class:`~umalloc.errors.InvalidIdError`;
    ``.numpy()`` returns a read-only array. Reads, slices and arithmetic work as on any tensor (slices stay
    read-only; results of arithmetic are new tensors of this type too -- ``.clone()`` gives a writable copy
    as a plain tensor).
    """

    _MUTATORS: ClassVar[frozenset[str]] = frozenset({"__setitem__", "set_", "resize_", "data"})

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "clone":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        mutating = name in cls._MUTATORS or (name.endswith("_") and not name.startswith("__")) \
            or (name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__int__",
                                                                                "__invert__", "__iter__"))
        out = kwargs.get("out")
        if (mutating and args and isinstance(args[0], ReadOnlyTable)) or isinstance(out, ReadOnlyTable) or (
                isinstance(out, tuple) and any(isinstance(o, ReadOnlyTable) for o in out)):
            raise InvalidIdError(f"{name}: the allocator's tables are read-only; allowed reads, or .clone() for "
                                 f"a writable copy")
        res = super().__torch_function__(func, types, args, kwargs)
        if name == "numpy" and isinstance(res, np.ndarray):
            res.setflags(write=False)
        return res

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """``np.asarray(table)``: a read-only view (a copy when ``dtype`` differs), never a writable alias."""
        arr = self.numpy()
        return arr if dtype is None or np.dtype(dtype) == arr.dtype else arr.astype(dtype)

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: a DLPack capsule carries no read-only flag that torch or numpy honour."""
        raise InvalidIdError("__dlpack__: the allocator's tables are read-only and DLPack cannot say so; allowed "
                             ".numpy() (a read-only array) or .clone() (a writable copy)")


def read_only_table(t: torch.Tensor) -> ReadOnlyTable:
    """``t`` (an allocator master or mirror) as a :class:`ReadOnlyTable` sharing its memory. O(1)."""
    return t.as_subclass(ReadOnlyTable)  # type: ignore[return-value]


def _ids(t: object, name: str) -> torch.Tensor:
    """Validate 1-D integer ids given as a torch tensor; return a contiguous CPU ``int64`` tensor (itself when it
    already is one: the kernels read it in place). The first test is the hot path's."""
    if type(t) is _Tensor and t.dtype is _I64 and t.dim() == 1 and t.is_cpu and t.is_contiguous():
        return t
    if not isinstance(t, torch.Tensor):
        if type(t) is np.ndarray:
            return torch.from_numpy(host_ids(t, name))
        raise InvalidIdError(f"{name}: got {type(t).__name__}; allowed a 1-D integer torch tensor or numpy array")
    check_id_tensor(t, name)
    if t.dim() != 1:
        raise InvalidIdError(f"{name}: shape {tuple(t.shape)}; allowed a 1-D tensor")
    if t.dtype is not _I64:
        return t.to("cpu", _I64).contiguous()
    if not t.is_cpu or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    return t


def _out(out: object, n: int | None, name: str = "out") -> torch.Tensor:
    """Validate a preallocated output: contiguous CPU ``torch.int64`` of shape ``(n,)`` (any length if ``n`` is
    None: the kernel checks it), caller-owned (not a :class:`ReadOnlyTable`)."""
    if type(out) is _Tensor and out.dtype is _I64 and out.dim() == 1 and out.is_cpu and out.is_contiguous() \
            and (n is None or out.numel() == n):
        return out
    if isinstance(out, ReadOnlyTable):
        raise InvalidIdError(f"{name}: a table returned by the allocator (read-only); allowed a caller-owned "
                             f"contiguous CPU torch.int64 tensor")
    if isinstance(out, torch.Tensor) and out.layout is torch.strided and not out.is_meta and out.dtype is _I64 \
            and out.dim() == 1 and out.is_cpu and out.is_contiguous() and (n is None or out.numel() == n):
        return out
    desc = (f"{out.dtype}, shape {tuple(out.shape)}, {out.device}" if isinstance(out, torch.Tensor)
            else type(out).__name__)
    shape = "(n,)" if n is None else f"({n},)"
    raise InvalidIdError(f"{name}: {desc}; allowed a contiguous CPU torch.int64 tensor of shape {shape}")


def _id_arg(t: object, name: str, addr: Callable[[torch.Tensor], int] = address) -> tuple[Any, Any, int]:
    """Validate 1-D integer ids given as a torch tensor or a numpy array; return ``(keepalive, kernel argument,
    length)``: a contiguous CPU int64 tensor goes by address, a numpy int64 array as itself (Note [Zero-copy
    tensor inputs]); other integer dtypes are converted once."""
    tt = type(t)
    if tt is _Tensor:
        if t.dtype is _I64 and t.dim() == 1 and t.is_cpu and t.is_contiguous():  # type: ignore[attr-defined]
            return t, addr(t), t.numel()  # type: ignore[arg-type, attr-defined]
    elif tt is np.ndarray:
        if t.dtype is _NP_I64 and t.ndim == 1:  # type: ignore[attr-defined]
            return t, t, t.shape[0]  # type: ignore[attr-defined]
        v = host_ids(t, name)
        return v, v, v.shape[0]
    c = _ids(t, name)
    return c, addr(c), c.numel()


def _hot_index(table: np.ndarray, index: object) -> tuple[Any, int]:
    """The ``(index array, length)`` a page-level hot-path gather passes its kernel: ``(table, -1)`` (a dummy,
    unread) without ``index``, ``(None, 0)`` when ``index`` is not a 1-D native numpy int64 array (the general
    path then validates it). Note [Page-level hot path] in :mod:`umalloc.allocator.facade`."""
    if index is None:
        return table, -1
    if type(index) is np.ndarray and index.dtype is _NP_I64 and index.ndim == 1:
        return index, index.shape[0]
    return None, 0


def _out_arg(out: object, n: int | None, addr: Callable[[torch.Tensor], int] = address) -> tuple[Any, Any, int]:
    """Validate a preallocated page output: a writeable 1-D native int64 numpy array or a contiguous CPU
    ``torch.int64`` tensor (as :func:`_out`) of ``n`` elements, or of any length for ``n = None`` (a block table
    written through ``index=``); return ``(out, kernel argument, length)``."""
    if type(out) is np.ndarray:
        if out.dtype == _NP_I64 and out.ndim == 1 and (n is None or out.shape[0] == n) and out.flags.writeable:
            return out, out.view(_NP_I64), out.shape[0]
        allowed = "(the block table index= points into)" if n is None else f"of shape ({n},)"
        raise InvalidIdError(f"out: numpy {out.dtype.str}, shape {out.shape}, writeable={out.flags.writeable}; "
                             f"allowed a writeable 1-D native int64 array {allowed}")
    res = _out(out, n)
    return res, addr(res), res.numel()


__all__ = ["ReadOnlyTable", "read_only_table"]
