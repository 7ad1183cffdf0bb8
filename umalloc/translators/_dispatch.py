"""The :class:`Translator` protocol and :func:`get_translator`, which picks an implementation.

* Implementations are modules (``reference``, ``cpu``, ``cuda``) exposing the same functions; the protocol
  lists them with their exact signatures and a test checks every module against it.
* Choice order: the ``impl`` argument, else the ``UMALLOC_TRANSLATOR`` environment variable, else the fastest
  available for the device (cpu -> numba ``cpu``, cuda -> cupy ``cuda``, anything else or a missing
  dependency -> ``reference``).
* A forced choice is never silently replaced: an unknown name, an implementation that cannot load here, or one
  that cannot run on the requested device raises :class:`UmallocValueError` saying why.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from umalloc.errors import UmallocValueError
from umalloc.translators._common import STRICT_DEFAULT, IndexLike, RegionsLike

#: Names accepted by ``impl=`` and ``UMALLOC_TRANSLATOR``.
IMPL_NAMES: tuple[str, ...] = ("reference", "cpu", "cuda")
#: Environment variable that forces an implementation (``reference``, ``cpu``, ``cuda``; empty or ``auto``
#: means automatic choice).
ENV_VAR = "UMALLOC_TRANSLATOR"


@runtime_checkable
class Translator(Protocol):
    """What every translator implementation provides (see :mod:`umalloc.translators.reference` for the
    semantics, shapes, dtypes and errors of each function). ``strict`` is a bool (``True``/``False`` only)
    with the one default :data:`~umalloc.translators.STRICT_DEFAULT` (True) in every implementation."""

    NAME: str

    def available(self) -> bool: ...

    def unavailable_reason(self) -> str | None: ...

    def supports_device(self, device: torch.device | str) -> bool: ...

    def virtual_to_physical(
        self,
        vtokens: IndexLike,
        v2p: IndexLike,
        page_size: int,
        *,
        out: torch.Tensor | np.ndarray | None = None,
        strict: bool = STRICT_DEFAULT,
        num_physical_pages: int | None = None,
    ) -> torch.Tensor | np.ndarray: ...

    def virtual_to_physical_pages(
        self,
        vpages: IndexLike,
        v2p: IndexLike,
        *,
        out: torch.Tensor | np.ndarray | None = None,
        strict: bool = STRICT_DEFAULT,
        num_physical_pages: int | None = None,
    ) -> torch.Tensor | np.ndarray: ...

    def tokens_to_pages(self, tokens: IndexLike, page_size: int) -> torch.Tensor: ...

    def pages_to_runs(self, src_pages: IndexLike, dst_pages: IndexLike) -> torch.Tensor: ...

    def runs_to_descriptors(
        self, runs: IndexLike, src_regions: RegionsLike, dst_regions: RegionsLike
    ) -> np.ndarray: ...

    def kernel_page_ids(self, tokens: IndexLike, page_size: int, layers_per_page: int) -> torch.Tensor: ...

    def rank_local_positions(
        self, positions: IndexLike, dcp_size: int, rank: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


#: Implementations already loaded and found runnable (a process-wide cache: availability does not change).
_loaded: dict[str, ModuleType] = {}


def load_impl(name: str) -> ModuleType:
    """Import implementation ``name`` and check it can run here, or raise :class:`UmallocValueError`. A
    runnable implementation is remembered, so later calls cost one dict lookup."""
    module = _loaded.get(name) if type(name) is str else None
    if module is not None:
        return module
    if name not in IMPL_NAMES:
        raise UmallocValueError(f"unknown translator {name!r}: allowed {', '.join(IMPL_NAMES)}")
    try:
        module = importlib.import_module(f"umalloc.translators.{name}")
    except ImportError as exc:
        raise UmallocValueError(f"translator {name!r} is unavailable: {exc}") from exc
    reason = module.unavailable_reason()
    if reason is not None:
        raise UmallocValueError(f"translator {name!r} is unavailable: {reason}")
    _loaded[name] = module
    return module


def available_impls() -> list[str]:
    """Names of the implementations that can run on this machine, in :data:`IMPL_NAMES` order."""
    names = []
    for name in IMPL_NAMES:
        try:
            load_impl(name)
        except UmallocValueError:
            continue
        names.append(name)
    return names


def get_translator(device: torch.device | str | None = None, impl: str | None = None) -> Translator:
    """The translator implementation to use for tensors on ``device``.

    Args:
        device: where the index tensors live (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``);
            None means CPU.
        impl: force ``"reference"``, ``"cpu"`` or ``"cuda"``; None defers to ``UMALLOC_TRANSLATOR``, then
            to the automatic choice (``"auto"`` or empty also means automatic).

    Returns:
        The implementation module (it satisfies :class:`Translator`).

    Raises:
        UmallocValueError: an unknown name, a forced implementation that is unavailable here (the message
            says why), or one that cannot run on ``device``.

    >>> get_translator("cpu", impl="reference").NAME
    'reference'
    """
    choice = impl if impl is not None else os.environ.get(ENV_VAR, "")
    key = (device, choice) if device is None or type(device) is str else None
    if key is not None:
        hit = _chosen.get(key)
        if hit is not None:
            return hit  # type: ignore[return-value]
    module = _choose(torch.device(device) if device is not None else torch.device("cpu"), impl, choice)
    if key is not None:
        _chosen[key] = module
    return module  # type: ignore[return-value]


#: get_translator's answers per (device string or None, forced choice): the environment is read on every call,
#: the device parsed and the implementation checked once per pair.
_chosen: dict[tuple[str | None, str], ModuleType] = {}


def _choose(dev: torch.device, impl: str | None, choice: str) -> ModuleType:
    choice = choice.strip().lower()
    if choice and choice != "auto":
        source = "impl" if impl is not None else ENV_VAR
        module = load_impl(choice) if choice in IMPL_NAMES else None
        if module is None:
            raise UmallocValueError(
                f"{source}={choice!r} is not a translator: allowed {', '.join(IMPL_NAMES)}"
            )
        if not module.supports_device(dev):
            raise UmallocValueError(f"translator {choice!r} (from {source}) cannot run on device {dev}")
        return module
    preferred = {"cpu": "cpu", "cuda": "cuda"}.get(dev.type)
    if preferred is not None:
        try:
            return load_impl(preferred)
        except UmallocValueError:
            pass
    return load_impl("reference")
