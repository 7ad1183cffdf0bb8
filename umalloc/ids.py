"""Id arguments at the boundary: the one check that what a caller passes as ids is 1-D integer data, and its
conversion to numpy ``int64``.

* :func:`host_ids` takes a torch tensor (any device, dense), a numpy array, and where the caller allows them a
  list or tuple of ints, and returns a 1-D host numpy ``int64`` array: the input itself (or a view of it) when
  it already is one, else one converted copy. Bools, floats, complex, meta and sparse tensors, non-native byte
  orders, values that do not fit int64 (``uint64`` at or above ``2**63``) and other ranks are refused.
* :func:`id_batch` is its form for batches of request slots, lengths and pages (lists taken).
* :func:`count_arg` checks a page or request count (an int in ``[0, 2**63)``), :func:`check_strict` a ``strict``
  flag (a Python or numpy bool; ``0``, ``"no"``, ``None`` refused): both raise
  :class:`~umalloc.errors.UmallocValueError`.
* :func:`check_id_tensor` and :func:`check_id_dtype` are its pieces for callers that keep a tensor (on its
  device, in its dtype): the translators, the arena's page copies.
* ``accept`` names the dtypes a caller takes: ``"int64"``, ``"int32"`` (int64 or int32: vLLM's and SGLang's block
  tables) or ``"int"`` (any integer dtype whose values fit int64, converted once).
* Every refusal raises ``error`` (default :class:`~umalloc.errors.InvalidIdError`; the lease table passes
  :class:`~umalloc.errors.LeaseError`) with one message shape: ``"<name>: <what was given>; allowed <what is
  allowed>"``. Range rules (non-negative, below a table's length) stay with each caller, which knows them.
* This module imports nothing of umalloc but :mod:`umalloc.errors`, so every layer may use it. The first test of
  :func:`host_ids` is the hot path's (an int64 numpy array: one ``type(...) is`` and two attribute reads).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch

from umalloc.errors import InvalidIdError, UmallocError, UmallocValueError

#: What ``accept`` may name.
Accept = Literal["int64", "int32", "int"]

_NP_I64 = np.dtype(np.int64)
_T_I64 = torch.int64
_STRIDED = torch.strided
_I64_END = 1 << 63
_TORCH_INTS = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})
_TORCH_OK = {"int64": frozenset({torch.int64}), "int32": frozenset({torch.int64, torch.int32}), "int": _TORCH_INTS}
_NP_OK = {"int64": frozenset({_NP_I64}), "int32": frozenset({_NP_I64, np.dtype(np.int32)})}
_ALLOWED = {"int64": "int64", "int32": "int64 or int32",
            "int": "an integer dtype (int64, or int32 and narrower)"}


def check_id_dtype(dtype: object, name: str, accept: Accept = "int", error: type[UmallocError] = InvalidIdError
                   ) -> None:
    """Raise ``error`` unless ``dtype`` (a torch or numpy dtype) is one ``accept`` names."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_OK[accept]:
            raise error(f"{name}: dtype {dtype}; allowed {_ALLOWED[accept]}")
        return
    dt = np.dtype(dtype)  # type: ignore[call-overload]
    ok = dt.kind in "iu" if accept == "int" else dt in _NP_OK[accept]
    if not ok:
        raise error(f"{name}: numpy dtype {dt}; allowed {_ALLOWED[accept]}")
    if not dt.isnative:
        raise error(f"{name}: numpy dtype {dt.str}; allowed native int64 (or a narrower native integer dtype)")


def check_id_tensor(t: torch.Tensor, name: str, accept: Accept = "int",
                    error: type[UmallocError] = InvalidIdError) -> None:
    """Raise ``error`` unless ``t`` is a dense tensor holding values of a dtype ``accept`` names (any rank)."""
    if t.layout is not torch.strided or t.is_meta:  # no dense data to read (copying one raises untyped)
        raise error(f"{name}: a {t.layout} tensor on {t.device}; allowed a strided CPU or CUDA tensor (dense, "
                    f"holding values)")
    check_id_dtype(t.dtype, name, accept, error)


def host_ids(x: object, name: str, *, accept: Accept = "int", lists: bool = False, nonnegative: bool = False,
             error: type[UmallocError] = InvalidIdError) -> np.ndarray:
    """``x`` as a 1-D host numpy ``int64`` array (itself or a view where it already is one, else one copy).

    Args:
        x: a torch tensor (any device), a numpy array, or with ``lists`` a list or tuple of ints (Python or
            numpy integers, not bools).
        name: how messages name the argument (``"<call>: <argument>"`` reads best).
        accept: the dtypes taken (``"int64"``, ``"int32"`` for int64 or int32, ``"int"`` for any integer dtype).
        lists: whether a list or tuple of ints is taken.
        nonnegative: refuse negative values (physical ids); messages then name ``[0, 2**63 - 1]``.
        error: the error class raised.

    Raises:
        ``error``: another type, dtype or rank, a meta or sparse tensor, a non-native byte order, a value that
            does not fit int64 (or with ``nonnegative`` a negative one).

    >>> host_ids([3, 4], "ids", lists=True).tolist(), host_ids(np.array([5], dtype=np.uint8), "ids").dtype
    ([3, 4], dtype('int64'))
    """
    v: Any = x
    tx = type(v)
    if tx is np.ndarray and v.dtype is _NP_I64 and v.ndim == 1:
        a: np.ndarray = v
    elif tx is torch.Tensor and v.dtype is _T_I64 and v.dim() == 1 and v.is_cpu and v.layout is _STRIDED:
        a = v.numpy()  # integer tensors never require grad
    else:
        a = _convert(x, name, accept, lists, 0 if nonnegative else -_I64_END, error)
    if nonnegative and a.size and int(a.min()) < 0:
        raise error(f"{name}: negative id {int(a.min())}; allowed [0, {_I64_END - 1}]")
    return a


def _convert(x: object, name: str, accept: Accept, lists: bool, lo: int, error: type[UmallocError]
             ) -> np.ndarray:
    """:func:`host_ids` past its first tests: every check, and the one conversion."""
    if isinstance(x, torch.Tensor):
        check_id_tensor(x, name, accept, error)
        if x.dim() != 1:
            raise error(f"{name}: shape {tuple(x.shape)}; allowed 1-D")
        a = (x if x.is_cpu else x.cpu()).numpy()
    elif isinstance(x, np.ndarray):
        check_id_dtype(x.dtype, name, accept, error)
        if x.ndim != 1:
            raise error(f"{name}: shape {x.shape}; allowed 1-D")
        a = x
        if a.dtype.kind == "u" and a.dtype.itemsize == 8 and a.size and int(a.max()) >= _I64_END:
            raise error(f"{name}: value {int(a.max())} does not fit int64 (2**63 or more); allowed "
                        f"[{lo}, {_I64_END - 1}]")
    elif lists and isinstance(x, (list, tuple)):
        if all(type(v) is int or isinstance(v, np.integer) for v in x):
            if x and max(x) >= _I64_END:
                raise error(f"{name}: value {max(x)} does not fit int64 (2**63 or more); allowed "
                            f"[{lo}, {_I64_END - 1}]")
            if x and min(x) < lo:
                raise error(f"{name}: value {min(x)} is {'negative' if lo == 0 else 'below int64'}; allowed "
                            f"[{lo}, {_I64_END - 1}]")
            return np.array(x, dtype=np.int64) if x else np.zeros(0, dtype=np.int64)
        try:  # floats, bools, nested lists: numpy names the dtype or rank refused below
            a = np.asarray(x)
        except (TypeError, ValueError):
            a = np.asarray(x, dtype=object)
        check_id_dtype(a.dtype, name, accept, error)
        raise error(f"{name}: a list of shape {a.shape}; allowed a 1-D list of ints")
    else:
        kinds = "a 1-D integer torch tensor or numpy array" + (", or a list of ints" if lists else "")
        raise error(f"{name}: got {type(x).__name__}; allowed {kinds}")
    # native int64 under another dtype object (unpickled, np.longlong) becomes the canonical one
    return a.view(_NP_I64) if a.dtype == _NP_I64 else a.astype(_NP_I64)


def id_batch(x: object, name: str) -> np.ndarray:
    """A batch of ids (request slots, lengths, pages) as 1-D numpy int64: :func:`host_ids` taking any integer
    dtype and lists of ints. Values keep their sign: each caller checks its own range."""
    return host_ids(x, name, lists=True)



def check_strict(strict: object, where: str) -> bool:
    """``strict`` as a bool; anything but ``True``/``False`` (numpy bools too) raises UmallocValueError."""
    if strict is True or strict is False:
        return strict
    if isinstance(strict, np.bool_):
        return bool(strict)
    raise UmallocValueError(f"{where}: strict={strict!r}; allowed True or False")


def count_arg(value: object, name: str) -> int:
    """A page count given by a caller: an ``int`` or numpy integer in ``[0, 2**63)`` (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise UmallocValueError(f"{name}={value!r}: allowed an int in [0, 2**63)")
    v = int(value)
    if not 0 <= v < _I64_END:  # the kernels take an int64: a larger count must not reach them
        raise UmallocValueError(f"{name}={value!r}: allowed an int in [0, 2**63)")
    return v


__all__ = ["Accept", "check_id_dtype", "check_id_tensor", "check_strict", "count_arg", "host_ids", "id_batch"]
