"""Bitmaps in the int64 heap: hole bitmaps per end and free-virtual-id bitmaps per owner (numba, inlined).

Bit ``i`` of the bitmap at ``h64[base:]`` is bit ``i & 63`` of word ``base + (i >> 6)``. Taking bits scans a word
at a time (``trailing_zeros`` / ``leading_zeros``), so draining ``k`` holes costs O(k + words skipped).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros


@njit(cache=True, inline="always", error_model="numpy")
def _bset(h64, base, i):
    h64[base + (i >> 6)] |= np.int64(1) << (i & 63)


@njit(cache=True, inline="always", error_model="numpy")
def _bclr(h64, base, i):
    h64[base + (i >> 6)] &= ~(np.int64(1) << (i & 63))


@njit(cache=True, inline="always", error_model="numpy")
def _pop_low(h64, base, start, k, out, out_off):
    """Take the ``k`` lowest set bits ``>= start`` of the bitmap at ``h64[base:]`` (clearing them), write their
    indices ascending to ``out[out_off: out_off + k]``; return one past the last. A word at a time."""
    w = start >> 6
    word = h64[base + w]
    mask = np.int64(-1) << (start & 63)
    keep = word & ~mask  # bits below start are not ours to take
    word &= mask
    last = start - 1
    for j in range(k):
        while word == 0:
            h64[base + w] = keep
            keep = 0
            w += 1
            word = h64[base + w]
        last = (w << 6) + trailing_zeros(word)
        out[out_off + j] = last
        word &= word - 1
    h64[base + w] = keep | word
    return last + 1


@njit(cache=True, inline="always", error_model="numpy")
def _pop_high(h64, base, start, k, out, out_off):
    """Take the ``k`` highest set bits ``<= start`` (clearing them), write their indices ascending to
    ``out[out_off: out_off + k]``; return one below the lowest taken."""
    w = start >> 6
    b0 = start & 63
    word = h64[base + w]
    mask = np.int64(-1) if b0 == 63 else (np.int64(1) << (b0 + 1)) - 1
    keep = word & ~mask  # bits above start are not ours to take
    word &= mask
    last = start + 1
    t = out_off + k - 1
    for _ in range(k):
        while word == 0:
            h64[base + w] = keep
            keep = 0
            w -= 1
            word = h64[base + w]
        b = 63 - leading_zeros(word)
        last = (w << 6) + b
        out[t] = last
        t -= 1
        word &= ~(np.int64(1) << b)
    h64[base + w] = keep | word
    return last - 1



def pack_bits(bits: np.ndarray) -> np.ndarray:
    """Bool array (length a multiple of 64) -> int64 words, bit ``i`` of word ``w`` = element ``64 w + i``."""
    return np.packbits(bits, bitorder="little").view("<i8").astype(np.int64)


def unpack_bits(words: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` bits of int64 ``words`` as a bool array (the inverse of :func:`pack_bits`)."""
    return np.unpackbits(words.astype("<i8").view(np.uint8), bitorder="little")[:n].astype(bool)
