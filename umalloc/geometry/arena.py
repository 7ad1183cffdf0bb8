"""The byte arena: one torch ``uint8`` tensor carved into ends, page envelopes and per-layer views.

Policy:

* Physical page ``p`` of end ``e`` occupies bytes ``[p * page_bytes(e), (p + 1) * page_bytes(e))`` of the
  arena; every end indexes from byte 0 (shared/DESIGN.md §2).
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

import torch

from umalloc.errors import InvalidIdError, UmallocValueError
from umalloc.geometry.region import DRAM, VRAM, Region, RegionMember
from umalloc.geometry.spec import ArenaSpec, EndSpec, LayerKind


class Arena:
    """One contiguous byte tensor holding every end of an :class:`ArenaSpec`.

    Args:
        spec: the validated arena spec.
        device: torch device for the bytes (``"cpu"`` default, ``"cuda"`` when asked).
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
        dev = torch.device(device)
        alloc = torch.zeros if zero else torch.empty
        self.data: torch.Tensor = alloc(spec.arena_bytes, dtype=torch.uint8, device=dev,
                                        pin_memory=pin_memory and dev.type == "cpu")
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
        except KeyError:
            self.spec.end(end)  # raises SpecError naming the allowed ends
            raise

    def first_page(self, end: str) -> int:
        """Lowest page of ``end`` above the reserved floor (see :meth:`ArenaSpec.first_page`)."""
        return self.spec.first_page(end)

    def top_page(self, end: str) -> int:
        """Highest page of ``end`` inside the arena."""
        return self.spec.top_page(end)

    def _check_page(self, end: str, ppage: int) -> None:
        top = self.top_page(end)
        if isinstance(ppage, bool) or not isinstance(ppage, int) or not 0 <= ppage <= top:
            raise InvalidIdError(f"physical page {ppage!r} of end {end!r}: allowed [0, {top}]")

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
        """Per-layer K and V views of ``end`` aliasing the arena.

        Returns:
            ``(k, v)``: tensors of the layer's dtype, shape ``(num_pages, page_size, num_kv_heads, head_dim)``
            with ``num_pages = top_page + 1`` (page 0 is the sink). For an MLA layer ``k`` is the latent cache
            of shape ``(num_pages, page_size, 1, latent_dim)`` and ``v`` is ``None``.

        Raises:
            InvalidIdError: if ``layer`` is out of range.
        """
        spec = self.end(end)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(spec.layers):
            raise InvalidIdError(f"layer {layer!r} of end {end!r}: allowed [0, {len(spec.layers) - 1}]")
        lspec = spec.layers[layer]
        k_off, v_off = spec.layer_offsets_bytes[layer]
        pb = spec.page_bytes
        ps = spec.page_size
        num_pages = self.top_page(end) + 1
        item = lspec.dtype.itemsize
        typed = self.data.view(lspec.dtype.torch_dtype)  # arena_bytes is 16-aligned, so this always works
        page_stride = pb // item

        def view(off_bytes: int, heads: int, head_dim: int) -> torch.Tensor:
            return typed.as_strided((num_pages, ps, heads, head_dim),
                                    (page_stride, heads * head_dim, head_dim, 1), off_bytes // item)

        if lspec.kind is LayerKind.MLA:
            return view(k_off, 1, lspec.latent_dim), None
        return (view(k_off, lspec.num_kv_heads, lspec.head_dim_k),
                view(v_off, lspec.num_kv_heads, lspec.head_dim_v))

    # ---- moves -----------------------------------------------------------------------------------------
    def copy_pages(self, end: str, dst_pages: torch.Tensor, src_pages: torch.Tensor) -> None:
        """Copy whole envelopes ``src_pages[i] -> dst_pages[i]`` of ``end`` in one batched gather/scatter.

        Args:
            dst_pages, src_pages: int64 tensors (any device) of equal shape ``(n,)``; ``dst_pages`` unique.
                Sources are read before any destination is written, so the sets may overlap.

        Complexity: O(n * page_bytes) bytes moved, one gather + one scatter.
        """
        if dst_pages.shape != src_pages.shape or dst_pages.dim() != 1:
            raise UmallocValueError(f"copy_pages: shapes {tuple(dst_pages.shape)} vs "
                                    f"{tuple(src_pages.shape)}: allowed equal 1-D shapes")
        if dst_pages.numel() == 0:
            return
        env = self.envelopes(end)
        dst = dst_pages.to(device=env.device, dtype=torch.int64)
        src = src_pages.to(device=env.device, dtype=torch.int64)
        env.index_copy_(0, dst, env.index_select(0, src))

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
