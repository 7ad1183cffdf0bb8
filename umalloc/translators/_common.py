"""Argument checking and the numpy pieces shared by every translator implementation.

* Every implementation validates its arguments through these helpers, so the same bad input raises the same
  typed error (with the same message shape) whichever implementation runs.
* Errors name the argument, the first offending position and value, and the allowed range.
* Nothing here allocates per page or loops in Python over pages, tokens or runs; error paths may be slow.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from umalloc.errors import InvalidIdError, TombstoneError, UmallocValueError

#: The v2p entry of an unbound virtual page. Any negative entry is treated as unbound.
TOMBSTONE: int = -1
#: The physical page that unbound (tombstoned) entries map to in non-strict mode: the reserved sink page.
SINK_PAGE: int = 0

#: What translators accept as an index vector: an int64 torch tensor, or an int64 numpy array
#: (wrapped zero-copy as a CPU tensor).
IndexLike = torch.Tensor | np.ndarray
#: A region group: a sequence of ``(base_addr, item_bytes)`` pairs, or a ``(K, 2)`` integer array.
RegionsLike = Sequence[Sequence[int]] | np.ndarray

_U64_LIMIT = 1 << 64
_I64_MAX = (1 << 63) - 1


def as_index_tensor(x: object, name: str, *, ndim: int | None = None) -> torch.Tensor:
    """Return ``x`` as an int64 torch tensor without copying, or raise :class:`InvalidIdError`.

    A numpy array is wrapped zero-copy (``torch.from_numpy``); a tensor is returned as is.
    """
    if isinstance(x, np.ndarray):
        if x.dtype != np.int64:
            raise InvalidIdError(f"{name} must have dtype int64, got numpy {x.dtype}")
        x = torch.from_numpy(x) if x.flags.writeable else torch.from_numpy(x.copy())
    elif not isinstance(x, torch.Tensor):
        raise InvalidIdError(f"{name} must be an int64 torch.Tensor or numpy array, got {type(x).__name__}")
    if x.dtype != torch.int64:
        raise InvalidIdError(f"{name} must have dtype torch.int64, got {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise InvalidIdError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    return x


def positive_int(value: object, name: str) -> int:
    """Return ``value`` as a Python int >= 1, or raise :class:`UmallocValueError`."""
    if isinstance(value, bool):
        raise UmallocValueError(f"{name} must be an int >= 1, got {value!r}")
    try:
        v = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise UmallocValueError(f"{name} must be an int >= 1, got {value!r}") from None
    if v < 1:
        raise UmallocValueError(f"{name} must be an int >= 1, got {v}")
    return v


def same_device(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Raise :class:`UmallocValueError` unless ``a`` and ``b`` live on the same device."""
    if a.device != b.device:
        raise UmallocValueError(f"{name_a} is on {a.device} but {name_b} is on {b.device}; they must match")


def check_out(out: object, like: torch.Tensor) -> torch.Tensor:
    """Validate an ``out=`` tensor against the result it will hold (int64, ``like``'s shape and device)."""
    if not isinstance(out, torch.Tensor):
        raise UmallocValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != torch.int64:
        raise InvalidIdError(f"out must have dtype torch.int64, got {out.dtype}")
    if tuple(out.shape) != tuple(like.shape):
        raise InvalidIdError(f"out must have shape {tuple(like.shape)}, got {tuple(out.shape)}")
    if out.device != like.device:
        raise UmallocValueError(f"out is on {out.device} but the input is on {like.device}; they must match")
    return out


def translate_args(
    ids: object, v2p: object, page_size: object, out: object, name: str
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Checked ``(ids, v2p, page_size)`` of ``virtual_to_physical[_pages]`` (``name``: the ids' argument name).

    Also checks ``out`` against ``ids`` and that the virtual id space ``len(v2p) * page_size`` fits in int64.
    """
    ids_t = as_index_tensor(ids, name)
    tab = as_index_tensor(v2p, "v2p", ndim=1)
    ps = positive_int(page_size, "page_size")
    same_device(name, ids_t, "v2p", tab)
    if out is not None:
        check_out(out, ids_t)
    if tab.numel() * ps > _I64_MAX:
        raise UmallocValueError(
            f"len(v2p)={tab.numel()} pages of page_size={ps} tokens overflow int64 token ids: "
            f"allowed page_size <= {_I64_MAX // tab.numel()}"
        )
    return ids_t, tab, ps


def kernel_ids_args(tokens: object, page_size: object, layers_per_page: object) -> tuple[torch.Tensor, int, int]:
    """Checked ``(tokens, page_size, layers_per_page)`` of ``kernel_page_ids``; one page's kernel rows
    (``page_size * layers_per_page``) must fit in int64."""
    tok = as_index_tensor(tokens, "tokens")
    ps = positive_int(page_size, "page_size")
    layers = positive_int(layers_per_page, "layers_per_page")
    if ps * layers > _I64_MAX:
        raise UmallocValueError(
            f"page_size={ps} times layers_per_page={layers} overflows int64: allowed a product <= {_I64_MAX}"
        )
    return tok, ps, layers


def deliver(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``result``, or ``out`` after copying ``result`` into it (``out`` was checked by :func:`translate_args`)."""
    return result if out is None else out.copy_(result)


def first_true(mask: torch.Tensor) -> int:
    """Flat position of the first True in ``mask`` (error paths only; syncs on CUDA)."""
    return int(torch.nonzero(mask.reshape(-1))[0, 0])


# --- error raisers: computed on the error path only, so the message can name the first offender -----------


def raise_out_of_range(ids: torch.Tensor, limit: int, name: str, unit: str) -> None:
    """Raise :class:`InvalidIdError` naming the first id of ``ids`` outside ``[0, limit)``."""
    flat = ids.reshape(-1)
    i = first_true((flat < 0) | (flat >= limit))
    raise InvalidIdError(
        f"{name}[{i}] = {int(flat[i])} is out of range: virtual {unit} ids must lie in [0, {limit})"
    )


def raise_tombstone(ids: torch.Tensor, v2p: torch.Tensor, page_size: int, name: str) -> None:
    """Raise :class:`TombstoneError` naming the first id of ``ids`` whose v2p entry is unbound."""
    flat = ids.reshape(-1)
    vpages = torch.div(flat, page_size, rounding_mode="floor")
    i = first_true(v2p[vpages] < 0)
    vpage = int(vpages[i])
    raise TombstoneError(
        f"strict translation: {name}[{i}] = {int(flat[i])} lies in virtual page {vpage}, "
        f"whose v2p entry is {int(v2p[vpage])} (tombstoned, unbound)"
    )


def raise_negative(ids: torch.Tensor, name: str) -> None:
    """Raise :class:`InvalidIdError` naming the first negative id of ``ids``."""
    flat = ids.reshape(-1)
    i = first_true(flat < 0)
    raise InvalidIdError(f"{name}[{i}] = {int(flat[i])} is negative: ids must be >= 0")


def raise_misaligned(tokens: torch.Tensor, page_size: int) -> None:
    """Raise :class:`InvalidIdError` naming the first segment of ``tokens`` that is not one whole page."""
    groups = tokens.reshape(-1, page_size)
    first = groups[:, :1]
    expect = first + torch.arange(page_size, dtype=torch.int64, device=tokens.device)
    bad = (first[:, 0] < 0) | (first[:, 0] % page_size != 0) | (groups != expect).any(dim=1)
    g = first_true(bad)
    seg = groups[g].tolist()
    raise InvalidIdError(
        f"tokens[{g * page_size}:{(g + 1) * page_size}] = {seg} is not one page-aligned page: "
        f"each segment must be p*{page_size} .. p*{page_size}+{page_size - 1} for some page p >= 0"
    )


def check_kernel_ids_fit(max_token: int, page_size: int, layers_per_page: int) -> None:
    """Raise :class:`InvalidIdError` if the kernel id of the page holding ``max_token`` overflows int64."""
    if (max_token // page_size) * page_size * layers_per_page + page_size - 1 > _I64_MAX:
        raise InvalidIdError(
            f"tokens id {max_token} times layers_per_page={layers_per_page} overflows int64 (max {_I64_MAX})"
        )


# --- tokens_to_pages / pages_to_runs / rank_local_positions argument checks --------------------------------


def tokens_args(tokens: object, page_size: object) -> tuple[torch.Tensor, int]:
    """Checked ``(tokens, page_size)`` of ``tokens_to_pages``: 1-D int64, a whole number of pages."""
    tok = as_index_tensor(tokens, "tokens", ndim=1)
    ps = positive_int(page_size, "page_size")
    if tok.numel() % ps != 0:
        raise InvalidIdError(
            f"tokens has {tok.numel()} entries, not a multiple of page_size={ps}: "
            "a trailing partial page is misaligned"
        )
    return tok, ps


def runs_args(src_pages: object, dst_pages: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked ``(src_pages, dst_pages)`` of ``pages_to_runs``: 1-D int64, same device, equal lengths."""
    src = as_index_tensor(src_pages, "src_pages", ndim=1)
    dst = as_index_tensor(dst_pages, "dst_pages", ndim=1)
    same_device("src_pages", src, "dst_pages", dst)
    if src.numel() != dst.numel():
        raise UmallocValueError(
            f"src_pages and dst_pages must have equal lengths, got {src.numel()} and {dst.numel()}"
        )
    return src, dst


def dcp_args(positions: object, dcp_size: object, rank: object) -> tuple[torch.Tensor, int, int]:
    """Checked ``(positions, dcp_size, rank)`` of ``rank_local_positions``."""
    pos = as_index_tensor(positions, "positions", ndim=1)
    d = positive_int(dcp_size, "dcp_size")
    try:
        r = operator.index(rank)  # type: ignore[arg-type]
    except TypeError:
        raise UmallocValueError(f"rank must be an int in [0, {d}), got {rank!r}") from None
    if isinstance(rank, bool) or not 0 <= r < d:
        raise UmallocValueError(f"rank must be an int in [0, {d}), got {rank!r}")
    return pos, d, r


# --- runs_to_descriptors ----------------------------------------------------------------------------------


def descriptor_args(
    runs: object, src_regions: object, dst_regions: object
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Checked ``runs_to_descriptors`` arguments: ``(runs (R, 3) int64, src_base, dst_base, item_bytes)``, the
    last three uint64 ``(K,)``; every descriptor's last byte fits in uint64."""
    arr = runs_as_numpy(runs)
    check_runs_values(arr)
    src_base, dst_base, item = parse_regions(src_regions, dst_regions)
    check_descriptor_overflow(arr, src_base, dst_base, item)
    return arr, src_base, dst_base, item


def runs_as_numpy(runs: object) -> np.ndarray:
    """``runs`` as a C-contiguous ``(R, 3)`` int64 numpy array (CUDA tensors are copied to the host)."""
    if isinstance(runs, torch.Tensor):
        if runs.dtype != torch.int64:
            raise InvalidIdError(f"runs must have dtype int64, got {runs.dtype}")
        arr = runs.detach().cpu().numpy()
    elif isinstance(runs, np.ndarray):
        if runs.dtype != np.int64:
            raise InvalidIdError(f"runs must have dtype int64, got numpy {runs.dtype}")
        arr = runs
    else:
        raise InvalidIdError(f"runs must be an int64 (R, 3) tensor or numpy array, got {type(runs).__name__}")
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise InvalidIdError(f"runs must have shape (R, 3), got {arr.shape}")
    return np.ascontiguousarray(arr)


def check_runs_values(runs: np.ndarray) -> None:
    """Raise :class:`InvalidIdError` for a negative start or a run of fewer than one page (error path)."""
    bad = (runs[:, 0] < 0) | (runs[:, 1] < 0) | (runs[:, 2] < 1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InvalidIdError(
            f"runs[{i}] = {runs[i].tolist()} is invalid: src_start and dst_start must be >= 0 "
            "and num_pages >= 1"
        )


def parse_regions(src_regions: object, dst_regions: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate paired region groups; return ``(src_base, dst_base, item_bytes)`` as uint64 ``(K,)`` arrays."""
    src = _region_list(src_regions, "src_regions")
    dst = _region_list(dst_regions, "dst_regions")
    if len(src) != len(dst):
        raise UmallocValueError(
            f"src_regions has {len(src)} regions but dst_regions has {len(dst)}; they pair by position"
        )
    for k, ((_, si), (_, di)) in enumerate(zip(src, dst, strict=True)):
        if si != di:
            raise UmallocValueError(
                f"region pair {k}: src item_bytes={si} != dst item_bytes={di}; a pair must step equally"
            )
    src_base = np.array([b for b, _ in src], dtype=np.uint64)
    dst_base = np.array([b for b, _ in dst], dtype=np.uint64)
    item = np.array([i for _, i in src], dtype=np.uint64)
    return src_base, dst_base, item


def _region_list(regions: object, name: str) -> list[tuple[int, int]]:
    if isinstance(regions, np.ndarray):
        if regions.ndim != 2 or regions.shape[1] != 2 or regions.dtype.kind not in "iu":
            raise UmallocValueError(
                f"{name} must be a (K, 2) integer array, got {regions.dtype} {regions.shape}"
            )
        regions = regions.tolist()
    if isinstance(regions, (str, bytes)) or not isinstance(regions, Sequence):
        raise UmallocValueError(f"{name} must be a sequence of (base_addr, item_bytes) pairs")
    out: list[tuple[int, int]] = []
    for k, pair in enumerate(regions):
        try:
            base, item = pair
            base, item = operator.index(base), operator.index(item)
        except (TypeError, ValueError):
            raise UmallocValueError(
                f"{name}[{k}] = {pair!r} is not a (base_addr, item_bytes) int pair"
            ) from None
        if not 0 <= base < _U64_LIMIT:
            raise UmallocValueError(f"{name}[{k}] base_addr={base} must lie in [0, 2**64)")
        if item < 1:
            raise UmallocValueError(f"{name}[{k}] item_bytes={item} must be >= 1")
        out.append((base, item))
    return out


def check_descriptor_overflow(
    runs: np.ndarray, src_base: np.ndarray, dst_base: np.ndarray, item: np.ndarray
) -> None:
    """Raise :class:`InvalidIdError` if any descriptor's last byte would not fit in uint64."""
    if runs.shape[0] == 0 or item.shape[0] == 0:
        return
    counts = runs[:, 2].astype(np.uint64)
    src_end = int((runs[:, 0].astype(np.uint64) + counts).max())
    dst_end = int((runs[:, 1].astype(np.uint64) + counts).max())
    for k in range(item.shape[0]):  # loops over regions (K is small), never over runs
        it = int(item[k])
        for side, base, end in (("src", int(src_base[k]), src_end), ("dst", int(dst_base[k]), dst_end)):
            if base + end * it > _U64_LIMIT:
                raise InvalidIdError(
                    f"region pair {k}: {side} page {end} * item_bytes {it} + base {base} overflows uint64"
                )


def descriptors_numpy(
    runs: np.ndarray, src_base: np.ndarray, dst_base: np.ndarray, item: np.ndarray
) -> np.ndarray:
    """Broadcast ``K`` region pairs over ``R`` runs into one region-major ``(K * R, 3)`` uint64 array."""
    k, r = item.shape[0], runs.shape[0]
    out = np.empty((k, r, 3), dtype=np.uint64)
    u = runs.astype(np.uint64)
    it = item[:, None]
    np.multiply(u[None, :, 0], it, out=out[:, :, 0])
    out[:, :, 0] += src_base[:, None]
    np.multiply(u[None, :, 1], it, out=out[:, :, 1])
    out[:, :, 1] += dst_base[:, None]
    np.multiply(u[None, :, 2], it, out=out[:, :, 2])
    return out.reshape(k * r, 3)
