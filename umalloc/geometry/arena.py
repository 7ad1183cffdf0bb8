"""The byte arena: one torch ``uint8`` tensor carved into ends, page envelopes and per-layer views.

Policy:

* Physical page ``p`` of end ``e`` occupies bytes ``[p * page_bytes(e), (p + 1) * page_bytes(e))`` of the
  arena; every end indexes from byte 0 (docs/architecture.md, "Terms": arena).
* The lowest ``floor_bytes`` are the reserved floor. Page 0 of every end lies inside it: the *sink* that
  padded lanes may write and nobody reads. Pages below :meth:`ArenaSpec.first_page` are never handed out.
* One page is one contiguous envelope holding every layer of the end (Note [Page-major envelope] in
  :mod:`umalloc.geometry.spec`); per-layer K/V views alias the arena with strides, so kernels and transfers see the
  same bytes.
* A transfer backend registers the whole arena once as one :class:`~umalloc.geometry.region.Region` and addresses a
  page as ``base + physical_page * page_bytes``.

::

    byte 0                                                                    arena_bytes
    | floor (sink) | up-end pages 1, 2, ... ->      free gap      <- ... top-1, top down-end |
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch

from umalloc.errors import ArenaMemoryError, InvalidIdError, UmallocValueError
from umalloc.geometry.region import DRAM, VRAM, Region, RegionMember
from umalloc.geometry.spec import ArenaSpec, EndSpec, LayerKind
from umalloc.ids import check_id_tensor, host_ids

#: What :meth:`Arena.guard_pages` installs: ``(end, physical pages int64 (n,)) -> bool (n,)``, True where
#: :meth:`Arena.copy_pages` must not write without ``overwrite=True``.
PageGuard = Callable[[str, np.ndarray], np.ndarray]

#: Device types an arena may live on.
ARENA_DEVICE_TYPES = ("cpu", "cuda")


def _arena_device(device: object) -> torch.device:
    """``device`` as a ``torch.device`` of type cpu or cuda, or raise :class:`UmallocValueError`."""
    allowed = "allowed 'cpu', 'cuda' or 'cuda:N' (a str or torch.device)"
    if not isinstance(device, (str, torch.device)):
        raise UmallocValueError(f"device={device!r}: {allowed}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UmallocValueError(f"device={device!r} is not a torch device: {allowed}") from None
    if dev.type not in ARENA_DEVICE_TYPES:
        raise UmallocValueError(f"device={device!r}: an arena's bytes must be addressable memory; {allowed}")
    return dev


class Arena:
    """One contiguous byte tensor holding every end of an :class:`ArenaSpec`.

    Args:
        spec: the validated arena spec.
        device: torch device for the bytes: ``"cpu"`` (default) or a CUDA device (``"cuda"``, ``"cuda:N"``, a
            ``torch.device``). Any other device (``"meta"``, which holds no bytes, ``"mps"``, ...) raises
            :class:`UmallocValueError`: transfer backends address the bytes by pointer.
        zero: fill with zeros at creation (default True; ``False`` leaves ``torch.empty`` contents).
        pin_memory: allocate CPU bytes in pinned memory (faster host<->device copies).

    Attributes:
        spec: the :class:`ArenaSpec`.
        data: ``torch.uint8`` tensor of shape ``(arena_bytes,)`` on ``device``.

    >>> from umalloc.geometry.spec import EndSpec, LayerSpec
    >>> a = Arena(ArenaSpec((EndSpec("full", (LayerSpec.mha(1, 4),), page_size=2),), arena_bytes=128))
    >>> a.page_bytes("full"), a.first_page("full"), a.top_page("full")
    (32, 1, 3)
    >>> a.page_offset_bytes("full", 2)
    64
    """

    def __init__(self, spec: ArenaSpec, device: str | torch.device = "cpu", *, zero: bool = True,
                 pin_memory: bool = False) -> None:
        if not isinstance(spec, ArenaSpec):
            raise UmallocValueError(f"spec={spec!r}: allowed an ArenaSpec")
        self.spec = spec
        self._guard: Callable[[], PageGuard | None] | None = None  # Note [Guarded destinations]
        dev = _arena_device(device)
        if type(pin_memory) is not bool or type(zero) is not bool:
            raise UmallocValueError(f"zero={zero!r}, pin_memory={pin_memory!r}: allowed True or False")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise UmallocValueError(f"device={device!r}: no CUDA device is available here; allowed 'cpu'")
        if pin_memory and dev.type == "cpu" and not torch.cuda.is_available():
            raise UmallocValueError("pin_memory=True: pinned host memory needs a CUDA device, and none is "
                                    "available here; allowed pin_memory=False")
        alloc = torch.zeros if zero else torch.empty
        try:
            self.data: torch.Tensor = alloc(spec.arena_bytes, dtype=torch.uint8, device=dev,
                                            pin_memory=pin_memory and dev.type == "cpu")
        except (RuntimeError, MemoryError, TypeError, OverflowError) as exc:   # torch: RuntimeError, or a size past int64
            raise ArenaMemoryError(f"arena_bytes={spec.arena_bytes} on {dev}: could not be allocated "
                                   f"({str(exc).splitlines()[0][:120]})") from None
        self._page_bytes = {e.name: e.page_bytes for e in spec.ends}

    # ---- geometry -------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def arena_bytes(self) -> int:
        return self.spec.arena_bytes

    @property
    def floor_bytes(self) -> int:
        return self.spec.floor_bytes

    @property
    def base_ptr(self) -> int:
        """Address of byte 0 of the arena (host or device pointer)."""
        return int(self.data.data_ptr())

    def end(self, name: str) -> EndSpec:
        return self.spec.end(name)

    def page_bytes(self, end: str) -> int:
        """Bytes of one page (envelope) of ``end``."""
        try:
            return self._page_bytes[end]
        except (KeyError, TypeError):
            self.spec.end(end)  # raises SpecError naming the allowed ends
            raise

    def first_page(self, end: str) -> int:
        """Lowest page of ``end`` above the reserved floor (see :meth:`ArenaSpec.first_page`)."""
        return self.spec.first_page(end)

    def top_page(self, end: str) -> int:
        """Highest page of ``end`` inside the arena."""
        return self.spec.top_page(end)

    def _check_page(self, end: str, ppage: int) -> None:
        self.spec.end(end)   # a bad end name raises SpecError before any lookup
        top = self.top_page(end)
        if isinstance(ppage, bool) or not isinstance(ppage, int) or not 0 <= ppage <= top:
            raise InvalidIdError(f"physical page {ppage!r} of end {end!r}: allowed a Python int in [0, {top}]")

    def page_offset_bytes(self, end: str, ppage: int) -> int:
        """Byte offset of physical page ``ppage`` of ``end`` from the arena's start. O(1).

        Raises:
            InvalidIdError: if ``ppage`` is outside ``[0, top_page(end)]``.
        """
        self._check_page(end, ppage)
        return ppage * self._page_bytes[end]

    def page_address(self, end: str, ppage: int) -> int:
        """Byte address ``base_ptr + ppage * page_bytes`` of a physical page. O(1)."""
        return self.base_ptr + self.page_offset_bytes(end, ppage)

    # ---- views -----------------------------------------------------------------------------------------
    def envelopes(self, end: str) -> torch.Tensor:
        """All page envelopes of ``end`` as a ``uint8`` view of shape ``(top_page + 1, page_bytes)``.

        Row ``p`` aliases bytes ``[p * page_bytes, (p + 1) * page_bytes)``. Row 0 is the sink.
        """
        pb = self.page_bytes(end)
        n = self.top_page(end) + 1
        return self.data[: n * pb].view(n, pb)

    def envelope(self, end: str, ppage: int) -> torch.Tensor:
        """One page's envelope: ``uint8`` view of shape ``(page_bytes,)``."""
        off = self.page_offset_bytes(end, ppage)
        return self.data[off: off + self._page_bytes[end]]

    def kv_views(self, end: str, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-layer K and V views of a page-major ``end`` (``head_groups == 1``) aliasing the arena.

        Returns:
            ``(k, v)``: tensors of the layer's dtype, shape ``(num_pages, page_size, num_kv_heads, head_dim)``
            with ``num_pages = top_page + 1`` (page 0 is the sink). For an MLA layer ``k`` is the latent cache
            of shape ``(num_pages, page_size, 1, latent_dim)`` and ``v`` is ``None``.

        Raises:
            InvalidIdError: if ``layer`` is out of range.
            UmallocValueError: the end is head-group-outer (``head_groups > 1``): its heads have no single stride,
                use :meth:`kv_group_views`.
        """
        spec = self.end(end)
        if spec.head_groups != 1:
            raise UmallocValueError(f"end {end!r} has head_groups={spec.head_groups}: its heads have no single "
                                    "stride; use kv_group_views (num_pages, head_groups, page_size, "
                                    "heads_per_group, head_dim)")
        k, v = self.kv_group_views(end, layer)
        return k[:, 0], None if v is None else v[:, 0]

    def kv_group_views(self, end: str, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-layer K and V views of ``end`` aliasing the arena, for either envelope (Note [Head-group-outer
        envelope] in :mod:`umalloc.geometry.spec`).

        Returns:
            ``(k, v)``: tensors of the layer's dtype, shape ``(num_pages, head_groups, page_size,
            heads_per_group, head_dim)`` (rank-local head ``h`` is ``[:, h // heads_per_group, :,
            h % heads_per_group]``); an MLA layer's ``k`` is ``(num_pages, 1, page_size, 1, latent_dim)`` and
            ``v`` is ``None``. Views, not copies: writes land in the arena. O(1).

        Raises:
            InvalidIdError: if ``layer`` is out of range.
        """
        spec = self.end(end)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(spec.layers):
            raise InvalidIdError(f"layer {layer!r} of end {end!r}: allowed [0, {len(spec.layers) - 1}]")
        lspec = spec.layers[layer]
        groups = spec.head_groups
        ps = spec.page_size
        num_pages = self.top_page(end) + 1
        item = lspec.dtype.itemsize
        typed = self.data.view(lspec.dtype.torch_dtype)  # arena_bytes is 16-aligned, so this always works
        page_stride = spec.page_bytes // item
        group_stride = page_stride // groups
        blocks = {b.kv: b for b in spec.blocks if b.group == 0 and b.layer == layer}

        def view(kv: str, heads: int, head_dim: int) -> torch.Tensor:
            return typed.as_strided((num_pages, groups, ps, heads, head_dim),
                                    (page_stride, group_stride, heads * head_dim, head_dim, 1),
                                    blocks[kv].offset_bytes // item)

        if lspec.kind is LayerKind.MLA:
            return view("k", 1, lspec.latent_dim), None
        heads = lspec.num_kv_heads // groups
        return view("k", heads, lspec.head_dim_k), view("v", heads, lspec.head_dim_v)

    # ---- moves -----------------------------------------------------------------------------------------
    def guard_pages(self, guard: PageGuard | None) -> None:
        """Install (or with ``None`` remove) the guard :meth:`copy_pages` asks about its destinations: the
        allocator that owns this arena installs one naming the pages whose bytes are in use elsewhere (Note
        [Guarded destinations]). Held weakly when it is a bound method (the arena keeps no allocator alive)."""
        if guard is None:
            self._guard = None
        elif hasattr(guard, "__self__") and hasattr(guard, "__func__"):
            self._guard = weakref.WeakMethod(guard)  # type: ignore[arg-type]
        else:
            self._guard = lambda: guard

    # Note [Guarded destinations]
    # copy_pages overwrites whole envelopes. A destination whose bytes somebody else still uses -- pinned by a
    # lease (a transfer in flight reads or writes it) or pending (freed while pinned: the transfer has not let
    # go) -- is refused unless the caller says ``overwrite=True``. Live pages the caller allocated are its own to
    # write (a fork copying its parent's ring into the pages it just allocated, a caller compacting by hand):
    # which request a page belongs to is the caller's table's business, not the arena's.
    def copy_pages(self, end: str, dst_pages: torch.Tensor | np.ndarray, src_pages: torch.Tensor | np.ndarray, *,
                   overwrite: bool = False) -> None:
        """Copy whole envelopes ``src_pages[i] -> dst_pages[i]`` of ``end`` in one batched gather/scatter.

        Args:
            end: an end of the spec.
            dst_pages, src_pages: 1-D integer tensors (any integer dtype, any device) or numpy arrays (any
                integer dtype, values that fit int64) of equal length, validated as every id argument
                (:func:`umalloc.ids.host_ids`); every id in ``[first_page(end), top_page(end)]`` (never the sink
                page 0 or another reserved-floor page); ``dst_pages`` unique. Sources are read before any
                destination is written, so the sets may overlap.
            overwrite: write even destinations the arena's allocator reports in use -- pinned by a lease or
                pending (Note [Guarded destinations]); default False refuses them.

        Raises:
            InvalidIdError: a non-integer dtype (floats are never truncated), a meta or sparse tensor, another
                rank, an id outside the allowed range (the message names it), a repeated destination, a
                destination in use without ``overwrite=True`` (the message names the page).
            UmallocValueError: unequal shapes, ``overwrite`` not a bool. SpecError: an unknown end.
            Every check runs before any byte moves.

        Complexity: O(n * page_bytes) bytes moved, one gather + one scatter; O(n log n) validation.

        >>> from umalloc.geometry.spec import EndSpec, LayerSpec
        >>> a = Arena(ArenaSpec((EndSpec("full", (LayerSpec.mha(1, 4),), page_size=2),), arena_bytes=128))
        >>> a.copy_pages("full", torch.tensor([2]), torch.tensor([0]))
        Traceback (most recent call last):
        ...
        umalloc.errors.InvalidIdError: copy_pages: src_pages[0] = 0 of end 'full' is out of range: allowed [1, 3]
        """
        lo, hi = self.first_page(end), self.top_page(end)
        if type(overwrite) is not bool:
            raise UmallocValueError(f"copy_pages: overwrite={overwrite!r}; allowed True or False")
        dst = _page_ids(dst_pages, "dst_pages")
        src = _page_ids(src_pages, "src_pages")
        if dst.shape != src.shape or dst.dim() != 1:
            raise UmallocValueError(f"copy_pages: shapes {tuple(dst.shape)} vs "
                                    f"{tuple(src.shape)}: allowed equal 1-D shapes")
        if dst.numel() == 0:
            return
        for name, ids in (("dst_pages", dst), ("src_pages", src)):
            bad = (ids < lo) | (ids > hi)
            if bool(bad.any()):
                i = int(torch.nonzero(bad)[0, 0])
                raise InvalidIdError(f"copy_pages: {name}[{i}] = {int(ids[i])} of end {end!r} is out of range: "
                                     f"allowed [{lo}, {hi}]")
        uniq = torch.unique(dst)
        if uniq.numel() != dst.numel():
            counts = torch.bincount(dst - lo)
            page = int(torch.nonzero(counts > 1)[0, 0]) + lo
            raise InvalidIdError(f"copy_pages: dst_pages names page {page} of end {end!r} more than once: "
                                 "allowed distinct destinations")
        guard = None if overwrite or self._guard is None else self._guard()
        if guard is not None:
            held = guard(end, dst.cpu().numpy())
            if held.any():
                i = int(np.argmax(held))
                raise InvalidIdError(f"copy_pages: dst_pages[{i}] = {int(dst[i])} of end {end!r} is in use (pinned "
                                     f"by a lease or pending): allowed destinations nobody else reads or writes, "
                                     f"or overwrite=True")
        env = self.envelopes(end)
        env.index_copy_(0, dst.to(env.device), env.index_select(0, src.to(env.device)))

    # ---- registration ----------------------------------------------------------------------------------
    def region(self) -> Region:
        """The whole arena as one region (what a transfer backend registers)."""
        kind = VRAM if self.device.type == "cuda" else DRAM
        dev = str(self.device) if self.device.type != "cuda" else f"cuda:{self.device.index or 0}"
        return Region(self.base_ptr, self.arena_bytes, dev, kind)

    def regions(self) -> list[Region]:
        """Every region a backend must register for this arena (one: the whole arena)."""
        return [self.region()]

    def region_member(self, end: str) -> RegionMember:
        """The arena region with ``item_bytes = page_bytes(end)``: index ``p`` addresses page ``p``."""
        return RegionMember(self.region(), self.page_bytes(end))


def _page_ids(ids: object, name: str) -> torch.Tensor:
    """``ids`` as a 1-D int64 tensor (on its device), validated as every id argument: numpy through
    :func:`umalloc.ids.host_ids`, torch any integer dtype; :class:`InvalidIdError` for a float, bool or other
    dtype, another rank, a meta or sparse tensor, another type."""
    if isinstance(ids, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(host_ids(ids, f"copy_pages: {name}")))
    if not isinstance(ids, torch.Tensor):
        raise InvalidIdError(f"copy_pages: {name}: got {type(ids).__name__}; allowed a 1-D integer torch tensor "
                             f"or numpy array")
    check_id_tensor(ids, f"copy_pages: {name}")
    if ids.dim() != 1:
        raise InvalidIdError(f"copy_pages: {name}: shape {tuple(ids.shape)}; allowed 1-D")
    return ids.to(torch.int64)
