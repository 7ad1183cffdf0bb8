"""Run coalescing as host numpy: the one entry point for callers outside the translators.

* :func:`coalesce_runs` is the translators' ``pages_to_runs`` (the one run-coalescing implementation) with
  the result as a numpy ``int64 (R, 3)`` array of ``(src_start, dst_start, length)`` rows. Host inputs (numpy
  arrays, CPU tensors) go to :func:`umalloc.translators.cpu.pages_to_runs_numpy`; a tensor on another device,
  or an explicit ``translator``, goes to that implementation's ``pages_to_runs`` and the runs come back to the
  host. Transfer descriptors (page and row runs), the allocator's run count and the replay's page fills call
  it.
* ``page_size`` bounds runs to pages: a run never crosses a multiple of ``page_size`` on either side (token
  rows of two pages are not adjacent bytes). It coalesces the ids spread by one per page
  (``t + t // page_size``), so the one implementation serves both forms.
* The numba implementation is imported on the first call: importing :mod:`umalloc.translators` loads no
  kernel.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import torch

from umalloc.errors import InvalidIdError
from umalloc.translators._common import (
    IndexLike,
    first_true,
    positive_int,
    raise_negative,
    runs_args,
    wrap_numpy,
)
from umalloc.translators._dispatch import get_translator, load_impl

_I64 = np.dtype(np.int64)
_I64_MAX = (1 << 63) - 1
#: The host implementation, once loaded (``None`` until the first call).
_host: ModuleType | None = None


def coalesce_runs(src: IndexLike, dst: IndexLike, *, page_size: int | None = None,
                  translator: Any = None) -> np.ndarray:
    """Maximal runs of pairs ``(src[i], dst[i])`` contiguous on both sides, as host numpy.

    Args:
        src, dst: 1-D ids of equal length and one dtype (int64 or int32), >= 0: numpy arrays or tensors.
        page_size: None (runs of any length), or an int >= 1: no run crosses a multiple of it on either side.
        translator: the implementation that coalesces (a module satisfying
            :class:`~umalloc.translators.Translator`); None: the cpu one for host inputs, the device's
            (:func:`~umalloc.translators.get_translator`) for a tensor elsewhere.

    Returns:
        ``(R, 3)`` int64 numpy ``(src_start, dst_start, length)`` rows in input order, a fresh array the caller
        owns; ``(0, 3)`` for empty inputs.

    Raises:
        InvalidIdError: a negative id, a wrong dtype or rank, or with ``page_size`` an id too large to spread.
        UmallocValueError: unequal lengths or devices, ``page_size`` not an int >= 1.

    O(n).

    >>> coalesce_runs(np.array([3, 4, 5, 9]), np.array([7, 8, 2, 3])).tolist()
    [[3, 7, 2], [5, 2, 1], [9, 3, 1]]
    >>> coalesce_runs(np.array([2, 3, 4, 5]), np.array([6, 7, 8, 9]), page_size=4).tolist()
    [[2, 6, 2], [4, 8, 2]]
    """
    if page_size is None:
        return _pairs(src, dst, translator)
    ps = positive_int(page_size, "page_size")
    if not (type(src) is np.ndarray and type(dst) is np.ndarray and src.dtype is _I64 and dst.dtype is _I64
            and src.ndim == 1 and dst.shape == src.shape):
        src, dst = (t.to(torch.int64) for t in runs_args(src, dst))
    if src.shape[0] == 0:
        return np.empty((0, 3), dtype=np.int64)
    step = np.int64(ps)  # numpy scalars: arithmetic with them skips the Python-int conversion
    try:
        runs = _pairs(src + src // step, dst + dst // step, translator)
    except InvalidIdError as exc:  # a spread id is negative: a negative id, or one whose spread wrapped
        raise _bad_rows(src, dst, ps) or exc from None
    if ps < _I64_MAX:  # else no id reaches a page boundary: nothing was spread
        spread_step = np.int64(ps + 1)
        runs[:, 0] -= runs[:, 0] // spread_step
        runs[:, 1] -= runs[:, 1] // spread_step
    return runs


def _pairs(src: Any, dst: Any, translator: Any) -> np.ndarray:
    global _host
    if _host is None:
        _host = load_impl("cpu")
    if translator is None or translator is _host:
        if isinstance(src, torch.Tensor) and not src.is_cpu:
            translator = get_translator(src.device)
        else:
            return _host.pages_to_runs_numpy(src, dst)  # type: ignore[no-any-return]
    return translator.pages_to_runs(src, dst).cpu().numpy()  # type: ignore[no-any-return]


def _bad_rows(src: Any, dst: Any, ps: int) -> InvalidIdError | None:
    """The :class:`InvalidIdError` naming the first negative id, else the first id too large to spread."""
    for name, ids in (("src", src), ("dst", dst)):
        t = ids if isinstance(ids, torch.Tensor) else wrap_numpy(ids)
        if bool((t < 0).any()):
            try:
                raise_negative(t, name)
            except InvalidIdError as exc:
                return exc
    for name, ids in (("src", src), ("dst", dst)):
        t = ids if isinstance(ids, torch.Tensor) else wrap_numpy(ids)
        limit = (_I64_MAX // (ps + 1)) * ps + min(ps - 1, _I64_MAX % (ps + 1))
        if bool((t > limit).any()):
            i = first_true(t.reshape(-1) > limit)
            return InvalidIdError(f"{name}[{i}] = {int(t.reshape(-1)[i])} is too large to coalesce in pages "
                                  f"of {ps}: allowed ids <= {limit}")
    return None


__all__ = ["coalesce_runs"]
