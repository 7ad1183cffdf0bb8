"""Kernel result codes and their decoding into typed errors.

Every kernel validates its whole batch before it writes anything; on misuse it writes
``[code, position, value, extra]`` (plus, for a shortfall, one deficit per end) to the heap's error area and
returns without changing state. :func:`raise_for` turns that record into the typed error of
:mod:`umalloc.errors` the public API documents (the range a message names is the range the kernel checked).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

from umalloc.errors import (
    DoubleFreeError,
    InvalidIdError,
    InvariantError,
    NotAllocatedError,
    TombstoneError,
)
from umalloc.pool.kernels.layout import M_ERROFF, M_NV, M_OWNER, M_PS

# ---- kernel result codes (err[0]) --------------------------------------------------------------------------
OK, E_SHORT, _E_RANGE, _E_RESERVED, _E_NOTALLOC, _E_DOUBLE, _E_UNBOUND, _E_BOUND = range(8)
_E_LENS, _E_LAST_OFFSET, _E_LAST_NOPREFIX, _E_TAIL_SHARED, _E_TAIL_UNBOUND, _E_TOMB, _E_OUT, E_IDS, _E_INDEX = \
    range(8, 17)


@njit(cache=True, error_model="numpy")
def _fail(meta, h64, code, pos, value, extra):
    """Record a misuse (``code`` at batch position ``pos``, offending ``value``, ``extra``); returns ``code``."""
    b = meta[0, M_ERROFF]
    h64[b] = code
    h64[b + 1] = pos
    h64[b + 2] = value
    h64[b + 3] = extra
    return code


def id_limit(meta: np.ndarray, e: int, pages: bool = False) -> int:
    """One past the largest id end ``e`` accepts: its owner's virtual pages (or tokens)."""
    o = int(meta[e, M_OWNER])
    return int(meta[o, M_NV] * (1 if pages else meta[o, M_PS]))


def raise_for(err: np.ndarray, meta: np.ndarray, names: Sequence[str], where: str, *, pages: bool = False) -> None:
    """Raise the typed error the last kernel left in ``err`` (ids are virtual pages if ``pages``)."""
    code, pos, value, extra = (int(x) for x in err[:4])
    name = names[extra] if 0 <= extra < len(names) else "?"
    if code == _E_RANGE:
        raise InvalidIdError(f"{where}: id {value} at position {pos} is out of range for end {name!r}: "
                             f"allowed [0, {id_limit(meta, extra, pages)})")
    what = f"virtual page {value}" if pages else f"token {value}"
    in_page = "is a virtual page" if pages else "is in a virtual page"
    if code == _E_RESERVED:
        raise InvalidIdError(f"{where}: {what} at position {pos} lies in virtual page 0 (reserved, the "
                             f"sink); allowed live virtual pages >= 1")
    if code == _E_NOTALLOC:
        raise NotAllocatedError(f"{where}: {what} at position {pos} {in_page} of {name!r} "
                                f"that was never allocated")
    if code == _E_DOUBLE:
        raise DoubleFreeError(f"{where}: {what} at position {pos} {in_page} of {name!r} "
                              f"that is already free")
    if code == _E_UNBOUND:
        raise NotAllocatedError(f"{where}: {what} at position {pos} is not bound on end {name!r} "
                                f"(already unbound, or never bound); strict=False skips such pages")
    if code == _E_BOUND:
        raise InvalidIdError(f"{where}: {what} at position {pos} is already bound on end {name!r}; "
                             f"allowed only live pages unbound on that end")
    if code == _E_LENS:
        raise InvalidIdError(f"{where}: request {pos} has prefix_len={value}, seq_len={extra}; allowed "
                             f"0 <= prefix_len <= seq_len (seq_len >= 1 for decode)")
    if code == _E_LAST_NOPREFIX:
        raise InvalidIdError(f"{where}: request {pos} has no prefix but last_loc={value}; allowed -1")
    if code == _E_LAST_OFFSET:
        raise InvalidIdError(f"{where}: request {pos}: last_loc={value} is not at the page offset of token "
                             f"position {extra - 1} (page arithmetic uses absolute positions, F07)")
    if code == _E_TAIL_SHARED:
        raise InvalidIdError(f"{where}: request {pos} extends the partial page of last_loc={value}, which "
                             f"another request of the batch extends too")
    if code == _E_TAIL_UNBOUND:
        raise NotAllocatedError(f"{where}: request {pos}: the partial tail page of last_loc={value} is not "
                                f"bound on end {name!r}, which this call binds")
    if code == _E_TOMB:
        raise TombstoneError(f"{where}: id {value} at position {pos} is tombstoned (unbound) on end "
                             f"{name!r}; strict=False maps it to the sink")
    if code == _E_INDEX:
        raise InvalidIdError(f"{where}: index[{pos}] = {value} is outside the block table: allowed "
                             f"[0, {extra})")
    if code == _E_OUT:
        raise InvalidIdError(f"{where}: out has {value} elements; allowed exactly {extra} (the new tokens)")
    raise InvariantError(f"{where}: unknown kernel result code {code}")
