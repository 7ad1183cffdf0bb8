"""CUDA translators: cupy kernels over CUDA tensors shared zero-copy through DLPack.

* Same functions, arguments, results and errors as :mod:`umalloc.translators.reference`; CUDA tensors only.
* Importing this module never fails: without cupy or without a GPU, :func:`available` is False,
  :func:`unavailable_reason` says why, and every function raises :class:`UmallocValueError`.
* Kernels run on torch's current stream of the tensors' device (cupy is pointed at it through
  ``cupy.cuda.ExternalStream``), and outputs are torch tensors allocated by torch, so torch's caching allocator
  and stream semantics hold.
* Custom kernels only where a fused pass pays: ``virtual_to_physical`` / ``virtual_to_physical_pages``
  (validate, then gather) and the run-start flags of ``pages_to_runs``. The other functions are the torch
  reference running on the device, which is already one or two bandwidth-bound passes.
* Validation reads a small device counter back to the host, so each call synchronizes the stream once; a
  bad id raises before anything is written. These calls therefore cannot be captured in a CUDA graph: the
  capturable path (one kernel into a preallocated ``out``, bad lanes to the sink plus a device error flag) is
  :mod:`umalloc.translators.capture`.

See Note [Tombstones map to the sink] in :mod:`umalloc.translators.reference`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from umalloc.errors import UmallocValueError
from umalloc.translators import _common as c
from umalloc.translators import reference as _ref

NAME = "cuda"

_cp: Any = None
_REASON: str | None = None
try:  # Note: a broken CUDA install can raise more than ImportError here.
    import cupy as _cp  # type: ignore[no-redef]
except Exception as exc:  # noqa: BLE001
    _REASON = f"cupy is not importable ({type(exc).__name__}: {exc})"

_THREADS = 256
_MAX_BLOCKS = 65535

_SOURCE = r"""
extern "C" __global__ void umalloc_v2p_check(
        const long long* ids, long long n, const long long* tab, long long limit, long long ps,
        int strict, long long pmax, unsigned long long* counts) {
    unsigned long long outside = 0, tomb = 0, over = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long t = ids[i];
        if ((unsigned long long)t >= (unsigned long long)limit) {
            outside += 1;
        } else {
            long long p = tab[t / ps];
            if (strict && p < 0) tomb += 1;
            if (p > pmax) over += 1;
        }
    }
    if (outside) atomicAdd(&counts[0], outside);
    if (tomb) atomicAdd(&counts[1], tomb);
    if (over) atomicAdd(&counts[2], over);
}

extern "C" __global__ void umalloc_v2p_apply(
        const long long* ids, long long n, const long long* tab, long long ps, long long* out) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long t = ids[i];
        long long q = t / ps;
        long long p = tab[q];
        out[i] = (p > 0 ? p : 0) * ps + (t - q * ps);
    }
}

extern "C" __global__ void umalloc_run_starts(
        const long long* src, const long long* dst, long long n, unsigned char* starts,
        unsigned long long* neg) {
    unsigned long long bad = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long s = src[i], d = dst[i];
        if (s < 0 || d < 0) bad += 1;
        starts[i] = (i == 0 || s - src[i - 1] != 1 || d - dst[i - 1] != 1) ? 1 : 0;
    }
    if (bad) atomicAdd(neg, bad);
}
"""

_module: Any = None


def _kernels() -> Any:
    """The compiled kernel module (compiled once per process, on first use; cupy caches it on disk)."""
    global _module
    if _module is None:
        _module = _cp.RawModule(code=_SOURCE)
    return _module


def unavailable_reason() -> str | None:
    """Why this implementation cannot run here, or None when it can."""
    if _REASON is not None:
        return _REASON
    try:
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        if _cp.cuda.runtime.getDeviceCount() < 1:
            return "cupy sees no CUDA device"
    except Exception as exc:  # noqa: BLE001 - any driver/runtime failure means unavailable
        return f"CUDA runtime unusable ({type(exc).__name__}: {exc})"
    return None


def available() -> bool:
    """True when cupy imports and both torch and cupy see a CUDA device."""
    return unavailable_reason() is None


def supports_device(device: torch.device | str) -> bool:
    """True only for CUDA devices."""
    return torch.device(device).type == "cuda"


def _require(*named: tuple[str, torch.Tensor]) -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise UmallocValueError(f"the cuda translator is unavailable: {reason}")
    for name, t in named:
        if t.device.type != "cuda":
            raise UmallocValueError(f"the cuda translator needs CUDA tensors; {name} is on {t.device}")


class _OnTorchStream:
    """Context: cupy's current device and stream become torch's current ones for ``device``."""

    def __init__(self, device: torch.device) -> None:
        self._device = _cp.cuda.Device(
            device.index if device.index is not None else torch.cuda.current_device()
        )
        ptr = torch.cuda.current_stream(device).cuda_stream
        # torch's default stream is the legacy null stream (pointer 0): use cupy's own handle for it.
        self._stream = _cp.cuda.Stream.null if ptr == 0 else _cp.cuda.ExternalStream(ptr)

    def __enter__(self) -> _OnTorchStream:
        self._device.__enter__()
        self._stream.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stream.__exit__(*exc)
        self._device.__exit__(*exc)


def _cupy(t: torch.Tensor) -> Any:
    """Zero-copy cupy view of a contiguous CUDA tensor (call inside :class:`_OnTorchStream`)."""
    return _cp.from_dlpack(t)


def _grid(n: int) -> tuple[int]:
    return (max(1, min(_MAX_BLOCKS, (n + _THREADS - 1) // _THREADS)),)


def _translate(ids_in, tab_t, ps, out, strict, name, unit):
    _require((name, ids_in), ("v2p", tab_t))
    ids_t = ids_in.to(torch.int64)
    id_max = c.ID_MAX[ids_in.dtype]
    ids_c = ids_t.contiguous()
    tab_c = tab_t.contiguous()
    n = ids_c.numel()
    limit = tab_c.numel() * ps
    result = torch.empty(ids_t.shape, dtype=torch.int64, device=ids_t.device)
    if n:
        mod = _kernels()
        with _OnTorchStream(ids_t.device):
            ids, tab, res = _cupy(ids_c.view(-1)), _cupy(tab_c), _cupy(result.view(-1))
            counts = _cp.zeros(3, dtype=_cp.uint64)
            pmax = np.int64(c.max_entry(ps, id_max))
            args = (ids, np.int64(n), tab, np.int64(limit), np.int64(ps), np.int32(strict), pmax, counts)
            mod.get_function("umalloc_v2p_check")(_grid(n), (_THREADS,), args)
            outside, tomb, over = (int(v) for v in counts.get())  # the one synchronization
            if outside:
                c.raise_out_of_range(ids_t, limit, name, unit)
            if tomb:
                c.raise_tombstone(ids_t, tab_t, ps, name)
            if over:
                c.raise_entry_overflow(ids_in, tab_t, ps, name, id_max)
            args = (ids, np.int64(n), tab, np.int64(ps), res)
            mod.get_function("umalloc_v2p_apply")(_grid(n), (_THREADS,), args)
    return c.deliver(result, out, ids_in.dtype)


def virtual_to_physical(
    vtokens: c.IndexLike,
    v2p: c.IndexLike,
    page_size: int,
    *,
    out: torch.Tensor | None = None,
    strict: bool = c.STRICT_DEFAULT,
    num_physical_pages: int | None = None,
) -> torch.Tensor:
    """CUDA version of :func:`umalloc.translators.reference.virtual_to_physical` (CUDA tensors only).

    One validation kernel, one synchronization, one gather kernel into a fresh tensor, then a copy into
    ``out`` when given (so ``out`` may alias the input).
    """
    vt, tab, ps, flag = c.translate_args(vtokens, v2p, page_size, out, "vtokens", strict)
    c.check_physical_bound(tab, num_physical_pages)
    return _translate(vt, tab, ps, out, flag, "vtokens", "token")


def virtual_to_physical_pages(
    vpages: c.IndexLike,
    v2p: c.IndexLike,
    *,
    out: torch.Tensor | None = None,
    strict: bool = c.STRICT_DEFAULT,
    num_physical_pages: int | None = None,
) -> torch.Tensor:
    """CUDA version of :func:`umalloc.translators.reference.virtual_to_physical_pages` (CUDA tensors only)."""
    vp, tab, _, flag = c.translate_args(vpages, v2p, 1, out, "vpages", strict)
    c.check_physical_bound(tab, num_physical_pages)
    return _translate(vp, tab, 1, out, flag, "vpages", "page")


def pages_to_runs(src_pages: c.IndexLike, dst_pages: c.IndexLike) -> torch.Tensor:
    """CUDA version of :func:`umalloc.translators.reference.pages_to_runs` (CUDA tensors only).

    One fused kernel writes run-start flags and counts negative ids; torch then compacts the starts.
    """
    src_t, dst_t = c.runs_args(src_pages, dst_pages)
    _require(("src_pages", src_t), ("dst_pages", dst_t))
    n = src_t.numel()
    if n == 0:
        return torch.empty((0, 3), dtype=torch.int64, device=src_t.device)
    src_c, dst_c = src_t.to(torch.int64).contiguous(), dst_t.to(torch.int64).contiguous()
    flags = torch.empty(n, dtype=torch.uint8, device=src_t.device)
    with _OnTorchStream(src_t.device):
        neg = _cp.zeros(1, dtype=_cp.uint64)
        args = (_cupy(src_c), _cupy(dst_c), np.int64(n), _cupy(flags), neg)
        _kernels().get_function("umalloc_run_starts")(_grid(n), (_THREADS,), args)
        if int(neg.get()[0]):
            if bool((src_c < 0).any()):
                c.raise_negative(src_c, "src_pages")
            c.raise_negative(dst_c, "dst_pages")
    starts = torch.nonzero(flags).reshape(-1)
    ends = torch.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1] = n
    return torch.stack([src_c[starts], dst_c[starts], ends - starts], dim=1)


def tokens_to_pages(tokens: c.IndexLike, page_size: int) -> torch.Tensor:
    """:func:`umalloc.translators.reference.tokens_to_pages` on CUDA tensors (torch ops on the device)."""
    tok = c.as_index_tensor(tokens, "tokens", ndim=1)
    _require(("tokens", tok))
    return _ref.tokens_to_pages(tok, page_size)


def runs_to_descriptors(
    runs: c.IndexLike, src_regions: c.RegionsLike, dst_regions: c.RegionsLike
) -> np.ndarray:
    """:func:`umalloc.translators.reference.runs_to_descriptors`: runs are copied to the host, descriptors are
    host numpy ``uint64`` arrays for the transfer engine."""
    return _ref.runs_to_descriptors(runs, src_regions, dst_regions)


def kernel_page_ids(tokens: c.IndexLike, page_size: int, layers_per_page: int) -> torch.Tensor:
    """:func:`umalloc.translators.reference.kernel_page_ids` on CUDA tensors (torch ops on the device)."""
    tok = c.as_index_tensor(tokens, "tokens")
    _require(("tokens", tok))
    return _ref.kernel_page_ids(tok, page_size, layers_per_page)


def rank_local_positions(
    positions: c.IndexLike, dcp_size: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`umalloc.translators.reference.rank_local_positions` on CUDA tensors (torch ops on the device)."""
    pos = c.as_index_tensor(positions, "positions", ndim=1)
    _require(("positions", pos))
    return _ref.rank_local_positions(pos, dcp_size, rank)
