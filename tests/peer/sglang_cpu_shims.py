"""What SGLang 0.5.23's KV-allocator modules need to import and run on a CPU-only machine (the peer venv of
scripts/peer_suite_sglang.sh). Nothing here changes an allocator's logic.

1. :func:`install_torchvision_stand_in`: ``sglang.srt.mem_cache.memory_pool`` imports the ``sglang.srt.configs``
   package, whose ``__init__`` imports model configs that run ``import torchvision.transforms`` at module top
   (``configs/deepseek_ocr.py``; ``multimodal/internvl_utils.py`` through ``configs/nano_nemotron_vl.py``).
   torchvision's PyPI wheels are CUDA builds that do not load against the CPU torch, so the venv has none; an
   import-only stand-in goes into ``sys.modules``: the modules ``torchvision``, ``torchvision.transforms``,
   ``torchvision.transforms.functional`` and ``torchvision.io`` with the two enums those configs read at import
   (``InterpolationMode``, ``ImageReadMode``); any other attribute is a function that raises. It is put in place
   only when no torchvision is installed, after transformers has cached ``is_torchvision_available() == False``
   (so transformers never takes a torchvision path).
2. :func:`cpu_unified_kernels`: SGLang's unified ``MultiEndedAllocator.alloc_extend``/``alloc_decode``
   (``allocator/unified_sub_pool.py``) launch the Triton kernels ``alloc_extend_kernel``/``alloc_decode_kernel``
   unconditionally; without a GPU driver Triton cannot launch. SGLang ships torch-native twins of those kernels
   (``alloc_extend_naive``/``alloc_decode_naive`` in ``allocator/paged.py``, the paged pool's CPU path). The shim
   rebinds the two names inside ``unified_sub_pool`` to launchers that run the twin on CPU tensors and the
   Triton kernel on CUDA ones.
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

APPLIED: list[str] = []


def _module(name: str, package: bool = False) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        m.__path__ = []
    return m


def install_torchvision_stand_in() -> bool:
    """Put the import-only torchvision stand-in in ``sys.modules`` (only when none is installed)."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return False
    try:
        from transformers.utils import import_utils

        if import_utils.is_torchvision_available():
            raise RuntimeError("transformers sees a torchvision although none is installed")
    except ImportError:
        pass

    def unavailable(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("torchvision is an import-only stand-in in this venv (tests/peer/sglang_cpu_shims.py)")

    def module_getattr(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return unavailable

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    class ImageReadMode(enum.Enum):
        UNCHANGED = 0
        GRAY = 1
        GRAY_ALPHA = 2
        RGB = 3
        RGB_ALPHA = 4

    tv = _module("torchvision", package=True)
    tv.__version__ = "0.0.0+import-only"
    transforms = _module("torchvision.transforms", package=True)
    functional = _module("torchvision.transforms.functional")
    io = _module("torchvision.io")
    transforms.InterpolationMode = functional.InterpolationMode = InterpolationMode
    io.ImageReadMode = ImageReadMode
    for m in (tv, transforms, functional, io):
        m.__getattr__ = module_getattr  # type: ignore[method-assign]
    tv.transforms, tv.io, transforms.functional = transforms, io, functional
    sys.modules.update({m.__name__: m for m in (tv, transforms, functional, io)})
    APPLIED.append("torchvision: import-only stand-in")
    return True


class _CpuOrTriton:
    """``kernel[grid](*args)`` launcher: SGLang's torch-native twin for CPU tensors, Triton for CUDA ones."""

    def __init__(self, triton_kernel: Any, cpu_fn: Any) -> None:
        self.triton_kernel = triton_kernel
        self.cpu_fn = cpu_fn

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any) -> Any:
            if args[0].is_cuda:
                return self.triton_kernel[grid](*args)
            return self.cpu_fn(*args)

        return launch


def cpu_unified_kernels() -> None:
    """Rebind ``unified_sub_pool.alloc_{extend,decode}_kernel`` to :class:`_CpuOrTriton` launchers. Idempotent."""
    from sglang.srt.mem_cache.allocator import paged
    from sglang.srt.mem_cache.allocator import unified_sub_pool as usp

    if isinstance(usp.alloc_extend_kernel, _CpuOrTriton):
        return

    def extend_cpu(prefix_lens: Any, seq_lens: Any, last_loc: Any, free_pages: Any, out: Any, _bs: Any,
                   page_size: int) -> None:
        paged.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out, page_size, out.device)

    def decode_cpu(seq_lens: Any, last_loc: Any, free_pages: Any, out: Any, _bs: Any, page_size: int) -> None:
        new_pages = int(((seq_lens - 1) % page_size == 0).sum())
        paged.alloc_decode_naive(seq_lens, last_loc, free_pages, out, page_size, new_pages)

    usp.alloc_extend_kernel = _CpuOrTriton(usp.alloc_extend_kernel, extend_cpu)
    usp.alloc_decode_kernel = _CpuOrTriton(usp.alloc_decode_kernel, decode_cpu)
    APPLIED.append("unified_sub_pool.alloc_{extend,decode}_kernel: SGLang's naive twins on CPU")


def prepare() -> None:
    """Everything the peer suite needs before importing SGLang's allocator modules."""
    install_torchvision_stand_in()
