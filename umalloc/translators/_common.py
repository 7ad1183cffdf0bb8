"""Argument checking and the numpy pieces shared by every translator implementation.

* Every implementation validates its arguments through these helpers, so the same bad input raises the same
  typed error (with the same message shape) whichever implementation runs.
* Errors name the argument, the first offending position and value, and the allowed range.
* Nothing here allocates per page or loops in Python over pages, tokens or runs; error paths may be slow.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from umalloc.errors import InvalidIdError, TombstoneError, UmallocValueError
from umalloc.ids import check_id_dtype

#: The v2p entry of an unbound virtual page. Any negative entry is treated as unbound.
TOMBSTONE: int = -1
#: The physical page that unbound (tombstoned) entries map to in non-strict mode: the reserved sink page.
SINK_PAGE: int = 0

#: What translators accept as an index vector: an int64 or int32 torch tensor (dense, on a device that holds
#: data), or an int64 or int32 numpy array (wrapped zero-copy as a CPU tensor).
IndexLike = torch.Tensor | np.ndarray
#: A region group: a sequence of ``(base_addr, item_bytes)`` pairs, or a ``(K, 2)`` integer array.
RegionsLike = Sequence[Sequence[int]] | np.ndarray

#: The default of every ``strict`` argument, in every implementation (and in the allocator's ``translate``):
#: a tombstoned entry raises unless the caller asks for the sink explicitly with ``strict=False``.
STRICT_DEFAULT: bool = True

_U64_LIMIT = 1 << 64
_I64_MAX = (1 << 63) - 1
_I32_MAX = (1 << 31) - 1
#: Largest value each accepted id dtype holds (results must fit the ids' own dtype).
ID_MAX = {torch.int64: _I64_MAX, torch.int32: _I32_MAX, np.dtype(np.int64): _I64_MAX,
          np.dtype(np.int32): _I32_MAX}
#: Physical page ids a v2p entry may hold when the caller states no ``num_physical_pages``: below ``2**48``. No
#: arena has that many pages (``2**48`` pages of even one byte are 256 TiB, beyond every device's address
#: space), so a larger entry is a corrupt table, never a page: every translation refuses it (the entry checks).
MAX_PHYSICAL_PAGES = 1 << 48
_NP_ID_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))
_TORCH_OF = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


def strict_flag(strict: object) -> bool:
    """``strict`` as a bool, or raise :class:`UmallocValueError`: only ``True``/``False`` (or a numpy bool)
    are accepted, so ``strict=0``, ``1`` or ``"no"`` cannot pick a mode by accident."""
    if isinstance(strict, (bool, np.bool_)):
        return bool(strict)
    raise UmallocValueError(f"strict must be True or False, got {strict!r} ({type(strict).__name__})")


def check_dense(x: torch.Tensor, name: str) -> None:
    """Raise :class:`InvalidIdError` for a sparse/quantized layout or a meta tensor (no values to read)."""
    if x.layout is not torch.strided:
        raise InvalidIdError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
    if x.device.type == "meta":
        raise InvalidIdError(f"{name} is on meta, which holds no values: translators need CPU tensors or "
                             "tensors on a device with memory (cuda)")


def as_index_tensor(x: object, name: str, *, ndim: int | None = None, int64_only: bool = False) -> torch.Tensor:
    """Return ``x`` as an int64 (or int32) torch tensor without copying, or raise :class:`InvalidIdError`.

    A numpy array is wrapped zero-copy (``torch.from_numpy``; a read-only array too, the translators never
    write their inputs); a tensor is returned as is. ``int64_only`` refuses int32 (the v2p table).
    """
    accept = "int64" if int64_only else "int32"  # umalloc.ids: "int32" takes int64 or int32
    if isinstance(x, np.ndarray):
        check_id_dtype(x.dtype, name, accept)
        x = wrap_numpy(x)
    elif not isinstance(x, torch.Tensor):
        allowed = "int64" if int64_only else "int64 or int32"
        raise InvalidIdError(f"{name} must be an {allowed} torch.Tensor or numpy array, got {type(x).__name__}")
    check_id_dtype(x.dtype, name, accept)
    check_dense(x, name)
    if ndim is not None and x.dim() != ndim:
        raise InvalidIdError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    return x


def wrap_numpy(x: np.ndarray) -> torch.Tensor:
    """A CPU tensor over ``x``'s memory (no copy; torch's read-only warning is silenced: nothing writes it)."""
    if x.flags.writeable:
        return torch.from_numpy(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(x)


def positive_int(value: object, name: str) -> int:
    """Return ``value`` as a Python int in ``[1, 2**63 - 1]``, or raise :class:`UmallocValueError`."""
    if isinstance(value, (bool, np.bool_)):
        raise UmallocValueError(f"{name} must be an int in [1, {_I64_MAX}], got {value!r}")
    try:
        v = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise UmallocValueError(f"{name} must be an int in [1, {_I64_MAX}], got {value!r}") from None
    if not 1 <= v <= _I64_MAX:
        raise UmallocValueError(f"{name} must be an int in [1, {_I64_MAX}], got {v}")
    return v


def same_device(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Raise :class:`UmallocValueError` unless ``a`` and ``b`` live on the same device."""
    if a.device != b.device:
        raise UmallocValueError(f"{name_a} is on {a.device} but {name_b} is on {b.device}; they must match")


def check_out(out: object, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> None:
    """Validate an ``out=`` against the result it will hold: the ids' ``dtype``, ``shape`` and ``device``, a
    dense tensor, or for CPU ids a writeable numpy array (the host form, written in place and returned)."""
    if isinstance(out, np.ndarray):
        if device.type != "cpu":
            raise UmallocValueError(f"out is a numpy array (host memory) but the input is on {device}; they must "
                                    "match")
        if out.dtype not in _NP_ID_DTYPES or _TORCH_OF[out.dtype] != dtype:
            raise InvalidIdError(f"out must have the ids' dtype {dtype}, got numpy {out.dtype}")
        if tuple(out.shape) != tuple(shape):
            raise InvalidIdError(f"out must have shape {tuple(shape)}, got {out.shape}")
        if not out.flags.writeable:
            raise InvalidIdError("out is a read-only numpy array: allowed a writeable one")
        if any(st == 0 and n > 1 for st, n in zip(out.strides, out.shape, strict=True)):
            raise InvalidIdError("out has a stride-0 (broadcast) dimension: several results would share one "
                                 "element; allowed an out whose elements are distinct memory")
        return
    if not isinstance(out, torch.Tensor):
        raise UmallocValueError(f"out must be a torch.Tensor (or, for CPU ids, a numpy array), got "
                                f"{type(out).__name__}")
    if out.dtype != dtype:
        raise InvalidIdError(f"out must have the ids' dtype {dtype}, got {out.dtype}")
    check_dense(out, "out")
    if tuple(out.shape) != tuple(shape):
        raise InvalidIdError(f"out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if any(st == 0 and n > 1 for st, n in zip(out.stride(), out.shape, strict=True)):
        raise InvalidIdError("out has a stride-0 (expanded) dimension: several results would share one element; "
                             "allowed an out whose elements are distinct memory")
    if out.device != device:
        raise UmallocValueError(f"out is on {out.device} but the input is on {device}; they must match")


def check_id_space(num_vpages: int, page_size: int) -> None:
    """Raise :class:`UmallocValueError` unless ``num_vpages * page_size`` virtual token ids fit in int64."""
    if num_vpages * page_size > _I64_MAX:
        raise UmallocValueError(
            f"len(v2p)={num_vpages} pages of page_size={page_size} tokens overflow int64 token ids: "
            f"allowed page_size <= {_I64_MAX // num_vpages}"
        )


def check_physical_bound(v2p: torch.Tensor | np.ndarray, num_physical_pages: object) -> None:
    """Refuse a v2p table holding an entry that is not a physical page id of a space of ``num_physical_pages``
    pages: an entry ``>= num_physical_pages`` (negative entries are tombstones). ``None``: no bound (the
    translators then know only the id dtype's range). Called before anything is written. O(len(v2p)).

    Raises:
        UmallocValueError: ``num_physical_pages`` not None or an int in ``[0, 2**63)``.
        InvalidIdError: an entry at or above the bound, named with its index.
    """
    if num_physical_pages is None:
        return
    if isinstance(num_physical_pages, (bool, np.bool_)) or not isinstance(num_physical_pages, (int, np.integer)) \
            or not 0 <= int(num_physical_pages) <= _I64_MAX:
        raise UmallocValueError(f"num_physical_pages={num_physical_pages!r}: allowed None or an int in "
                                f"[0, {_I64_MAX}]")
    n = int(num_physical_pages)
    tab = v2p if isinstance(v2p, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v2p))
    bad = tab >= n
    if tab.numel() and bool(bad.any()):
        i = first_true(bad)
        raise InvalidIdError(f"v2p[{i}] = {int(tab[i])} is not a physical page id: allowed entries < "
                             f"num_physical_pages={n} (negative entries are tombstones)")


def max_entry(page_size: int, id_max: int) -> int:
    """Largest v2p entry ``p`` that is a physical page id (below :data:`MAX_PHYSICAL_PAGES`) whose physical ids
    ``p * page_size + offset`` (offset < page_size) fit ``id_max``."""
    return min((id_max - (page_size - 1)) // page_size, MAX_PHYSICAL_PAGES - 1)


def translate_args(
    ids: object, v2p: object, page_size: object, out: object, name: str, strict: object
) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """Checked ``(ids, v2p, page_size, strict)`` of ``virtual_to_physical[_pages]`` (``name``: the ids'
    argument name).

    Also checks ``out`` against ``ids`` and that the virtual id space ``len(v2p) * page_size`` fits in int64.
    """
    flag = strict_flag(strict)
    ids_t = as_index_tensor(ids, name)
    tab = as_index_tensor(v2p, "v2p", ndim=1, int64_only=True)
    ps = positive_int(page_size, "page_size")
    same_device(name, ids_t, "v2p", tab)
    if out is not None:
        check_out(out, ids_t.shape, ids_t.dtype, ids_t.device)
    check_id_space(tab.numel(), ps)
    return ids_t, tab, ps, flag


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


def deliver(result: torch.Tensor, out: torch.Tensor | np.ndarray | None,
            dtype: torch.dtype = torch.int64) -> torch.Tensor | np.ndarray:
    """``result`` as ``dtype``, or ``out`` after copying ``result`` into it (``out`` was checked by
    :func:`check_out`; every value already fits ``dtype``)."""
    if isinstance(out, np.ndarray):
        np.copyto(out, result.numpy(), casting="unsafe")
        return out
    if out is not None:
        return out.copy_(result)
    return result if result.dtype == dtype else result.to(dtype)


def first_true(mask: torch.Tensor) -> int:
    """Flat position of the first True in ``mask`` (error paths only; syncs on CUDA)."""
    return int(torch.nonzero(mask.reshape(-1))[0, 0])


# --- error raisers: computed on the error path only, so the message can name the first offender -----------


def raise_out_of_range(ids: torch.Tensor, limit: int, name: str, unit: str) -> None:
    """Raise :class:`InvalidIdError` naming the first id of ``ids`` outside ``[0, limit)``."""
    flat = ids.reshape(-1)
    i = first_true((flat < 0) | (flat >= limit))
    raise InvalidIdError(
        f"{name}[{i}] = {int(flat[i])} is out of range for virtual {unit} ids: allowed [0, {limit})"
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


def raise_entry_overflow(ids: torch.Tensor, v2p: torch.Tensor, page_size: int, name: str, id_max: int) -> None:
    """Raise :class:`InvalidIdError` naming the first id of ``ids`` whose v2p entry is too large: at or above
    :data:`MAX_PHYSICAL_PAGES`, or its physical ids do not fit ``id_max`` (int64, or int32 for int32 ids): never
    wrapped, never clamped."""
    flat = ids.reshape(-1).to(torch.int64)
    vpages = torch.div(flat, page_size, rounding_mode="floor")
    limit = max_entry(page_size, id_max)
    i = first_true(v2p[vpages] > limit)
    vpage = int(vpages[i])
    entry = int(v2p[vpage])
    why = ("is not a physical page id (at or above MAX_PHYSICAL_PAGES = 2**48)" if entry >= MAX_PHYSICAL_PAGES
           else f"times page_size={page_size} does not fit {ids.dtype}")
    raise InvalidIdError(
        f"{name}[{i}] = {int(flat[i])} lies in virtual page {vpage}, whose v2p entry {entry} {why}: allowed v2p "
        f"entries <= {limit}"
    )


def raise_result_overflow(result_max: int, id_max: int, name: str, dtype: object) -> None:
    """Raise :class:`InvalidIdError`: a result id ``result_max`` does not fit the input's dtype."""
    raise InvalidIdError(
        f"a result id derived from {name} is {result_max}, which does not fit {name}'s dtype {dtype}: "
        f"allowed results in [0, {id_max}] (pass int64 ids)"
    )


def raise_negative(ids: torch.Tensor, name: str) -> None:
    """Raise :class:`InvalidIdError` naming the first negative id of ``ids``."""
    flat = ids.reshape(-1)
    i = first_true(flat < 0)
    raise InvalidIdError(f"{name}[{i}] = {int(flat[i])} is negative: allowed ids >= 0")


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


def check_kernel_ids_fit(max_token: int, page_size: int, layers_per_page: int, id_max: int = _I64_MAX) -> None:
    """Raise :class:`InvalidIdError` if the kernel ids of the page holding ``max_token`` do not fit ``id_max``
    (int64, or int32 for int32 tokens); the message names the largest token allowed."""
    stride = page_size * layers_per_page
    if (max_token // page_size) * stride + page_size - 1 > id_max:
        top = ((id_max - (page_size - 1)) // stride) * page_size + page_size - 1
        raise InvalidIdError(
            f"tokens id {max_token} with page_size={page_size} and layers_per_page={layers_per_page} overflows "
            f"the kernel id range [0, {id_max}]: allowed tokens in [0, {top}]"
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
    """Checked ``(src_pages, dst_pages)`` of ``pages_to_runs``: 1-D int64 or int32 (one dtype for both), same
    device, equal lengths."""
    src = as_index_tensor(src_pages, "src_pages", ndim=1)
    dst = as_index_tensor(dst_pages, "dst_pages", ndim=1)
    if src.dtype != dst.dtype:
        raise InvalidIdError(f"src_pages and dst_pages must share one dtype, got {src.dtype} and {dst.dtype}")
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
        check_dense(runs, "runs")
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
        if not 1 <= item < _U64_LIMIT:
            raise UmallocValueError(f"{name}[{k}] item_bytes={item} must lie in [1, 2**64)")
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
