"""Running one allocator kernel call and finishing it, shared by the allocator's services.

* :class:`KernelEntry` holds what a call passes the kernels (the heap's root address, the direct entries, the
  address function for torch ids) and turns the error record a refused call leaves into its typed error.
  ``UMALLOC_DEBUG=1`` in the environment at construction selects the checked direct entries and lends the ids a
  direct entry reads by address (:func:`umalloc.pool.kernels.raw.lend`), so the check can bound them (Note
  [Direct entry] in :mod:`umalloc.pool.kernels.ops`).
* :class:`AfterCall` is what runs after a mutating call: the refresh of the owner's device ``v2p`` mirror for the
  virtual pages the call touched (:mod:`umalloc.pool.mirror`), and the invariant checks when ``debug_checks``
  is on. ``sync`` says whether there is anything to do at all; the hot paths test it first.

Both are built once per allocator; neither holds allocator state of its own beyond what their attributes name.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import numpy as np
import torch

from umalloc.pool.heap import Heap
from umalloc.pool.kernels import raw
from umalloc.pool.kernels.codes import raise_for
from umalloc.pool.kernels.ops import hot_entries
from umalloc.pool.mirror import make_mirrors, refresh


class KernelEntry:
    """The kernel entry points of one allocator (read-only after construction).

    Attributes:
        root_a: the heap's root address (every kernel's first argument). err: the kernels' error record.
        hot: the direct entries (checked ones under ``UMALLOC_DEBUG=1``). addr: torch tensor -> address.
        debug: whether ``UMALLOC_DEBUG=1`` was set at construction.
    """

    __slots__ = ("_meta", "_names", "addr", "debug", "err", "hot", "root_a")

    def __init__(self, heap: Heap) -> None:
        self.debug = os.environ.get("UMALLOC_DEBUG", "") == "1"
        self.hot: Any = hot_entries(self.debug)
        self.addr: Callable[[torch.Tensor], int] = raw.lend if self.debug else raw.address
        self.root_a: int = heap.root_a
        self.err: np.ndarray = heap.err
        self._meta = heap.meta
        self._names: Sequence[str] = heap.names

    def raise_error(self, where: str, *, pages: bool = False) -> NoReturn:
        """Raise the typed error the last kernel left in the error record (ids are virtual pages if ``pages``)."""
        raise_for(self.err, self._meta, self._names, where, pages=pages)
        raise AssertionError("unreachable")


class AfterCall:
    """Mirror refresh and debug checks after a mutating call (owner thread only).

    Args:
        heap: the allocator's heap (its ``host2d`` blocks and scratch area are read).
        device: the mirrors' device, or ``None`` for no mirror.
        debug_checks: run ``check`` after every mutating call.
        check: the allocator's invariant check.

    Attributes:
        mirrors: owner index -> its device ``v2p`` block (empty without mirrors). debug_checks: off inside
        :meth:`checks_off` (a trial). sync: mirrors or debug checks at construction (fixed).
    """

    __slots__ = ("_check", "_host2d", "_scratch", "debug_checks", "mirrors", "sync")

    def __init__(self, heap: Heap, device: torch.device | None, debug_checks: bool, check: Callable[[], None]) -> None:
        self._host2d = heap.host2d
        self._scratch = heap.scratch
        self._check = check
        self.mirrors: dict[int, torch.Tensor] = {} if device is None else make_mirrors(heap.host2d, device)
        self.debug_checks = debug_checks
        self.sync = bool(self.mirrors) or debug_checks

    def after(self, o: int, n_scratch: int) -> None:
        """Refresh owner ``o``'s mirror for the ``n_scratch`` virtual pages the kernel left in the scratch area;
        then the debug checks. O(rows * n_scratch) plus the checks."""
        if self.mirrors and n_scratch:
            refresh(self.mirrors[o], self._host2d[o], self._scratch[:n_scratch])
        if self.debug_checks:
            self._check()

    def refresh(self, o: int, vids: np.ndarray) -> None:
        """Refresh owner ``o``'s mirror at the virtual pages ``vids`` (nothing without mirrors)."""
        if self.mirrors:
            refresh(self.mirrors[o], self._host2d[o], vids)

    @contextlib.contextmanager
    def checks_off(self) -> Iterator[None]:
        """No debug checks inside the ``with`` block (a trial: the caller's tables are mid-change), back to the
        constructor's setting leaving it. O(1)."""
        debug = self.debug_checks
        self.debug_checks = False
        try:
            yield
        finally:
            self.debug_checks = debug

    def checks(self) -> None:
        """The debug checks, if on."""
        if self.debug_checks:
            self._check()

    def reload_mirrors(self) -> None:
        """Copy every host ``v2p`` block into its mirror (after the host tables were restored wholesale)."""
        for o, mirror in self.mirrors.items():
            mirror.copy_(torch.from_numpy(self._host2d[o]))


__all__ = ["AfterCall", "KernelEntry"]
