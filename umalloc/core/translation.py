"""The allocator's translation and table views (a part of :class:`~umalloc.core.allocator.MultiEndedAllocator`).

* :meth:`TranslationPart.translate` / :meth:`~TranslationPart.translate_pages` validate at the boundary (torch or
  numpy ids, ``int32`` and narrower converted once, ``strict`` a bool, default ``True``) and then call
  :meth:`TranslationPart._translate_ids`, THE one host translation of the allocator (one numba kernel over the
  host masters that checks every id before it writes). It is the swap point for :mod:`umalloc.translators`:
  ``_translate_ids(toks, e, strict, res, pages, where, *, res_np=None) -> None``.
* Ids on the arena's CUDA device are translated there against the device mirror (:mod:`umalloc.core.mirror`).
* :meth:`~TranslationPart.v2p` / :meth:`~TranslationPart.p2v` return read-only zero-copy views
  (:class:`~umalloc.core.ids.ReadOnlyTable`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import torch

from umalloc.core.heap import Heap
from umalloc.core.ids import _I64, _id_arg, _ids, _out, _out_arg, check_strict, read_only_table
from umalloc.core.kernels.codes import _OK
from umalloc.core.kernels.layout import _NV, _OWNER, _PS
from umalloc.core.kernels.ops import _k_translate
from umalloc.core.kernels.raw import address
from umalloc.core.mirror import translate_on_device
from umalloc.errors import InvalidIdError


class TranslationPart:
    """Translation methods of the allocator facade (the attributes below are set by its constructor)."""

    _heap: Heap
    _meta: np.ndarray
    _err: np.ndarray
    _names: tuple[str, ...]
    _group: dict[int, tuple[int, ...]]
    _host2d: dict[int, np.ndarray]
    _mirror: dict[int, torch.Tensor]
    _root_a: int
    _end_index: Callable[[str], int]
    _raise: Callable[..., NoReturn]

    def v2p(self, end: str) -> torch.Tensor:
        """``int64`` tensor ``(num_vpages(owner),)`` on the arena's device: physical page of each virtual page
        of ``end``'s owner, TOMBSTONE (-1) where unbound; entry 0 is the sink (0).

        A :class:`~umalloc.core.ids.ReadOnlyTable` sharing the table's memory (zero-copy: it follows every later
        call): writes, in-place ops and passing it as ``out=`` raise InvalidIdError; ``.clone()`` gives a
        writable copy. On CPU it views the host master; on CUDA the device mirror refreshed by every call. O(1).
        """
        e = self._end_index(end)
        o = int(self._meta[e, _OWNER])
        row = self._group[o].index(e)
        if self._mirror:
            return read_only_table(self._mirror[o][row])
        return read_only_table(torch.from_numpy(self._host2d[o][row]))

    def p2v(self, end: str) -> torch.Tensor:
        """``int64`` CPU tensor ``(num_page_slots(end),)``: virtual page bound to each physical page, TOMBSTONE
        where none. A read-only view of the host master (as :meth:`v2p`). O(1)."""
        e = self._end_index(end)
        return read_only_table(torch.from_numpy(self._heap.end_tables(e)[0]))

    def translate(self, vtokens: torch.Tensor | np.ndarray, end: str, *, strict: bool = True,
                  out: torch.Tensor | np.ndarray | None = None) -> torch.Tensor | np.ndarray:
        """Physical token ids of ``end`` for virtual token ids: ``v2p[end][t // ps] * ps + t % ps``.

        Args:
            vtokens: ``(n,)`` virtual token ids of ``end``'s owner: a 1-D integer torch tensor (``int64``; int32
                and narrower are converted) or numpy array. CPU ids are translated on the host masters; ids on
                the arena's CUDA device are translated there against the device mirror.
            strict: ``True`` (default): a tombstoned (unbound) page raises :class:`TombstoneError`; ``False``
                maps it to the sink (page 0). Virtual page 0 (padding) always maps to the sink. A bool.
            out: optional preallocated ``int64 (n,)`` output on the ids' device (CUDA-graph-stable pointers);
                a writeable int64 numpy array for numpy ids. Untouched when the call raises.

        Returns:
            ``int64 (n,)``: a torch tensor for torch ids, a numpy array for numpy ids (``out`` if given).

        Raises:
            InvalidIdError: bad dtype/shape, an id outside the owner's id space (in every mode, F15), a bad or
            read-only ``out``. TombstoneError: strict mode and an unbound page. UmallocValueError: a non-bool
            ``strict``, an unknown end.

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()
        >>> t = alloc.alloc_extend(torch.tensor([0]), torch.tensor([3]), torch.tensor([-1]))
        >>> alloc.translate(t, "full").tolist(), alloc.translate(t, "swa").tolist()
        ([2, 3, 4], [16, 17, 18])
        """
        return self._translate(vtokens, end, strict, out, pages=False)

    def translate_pages(self, vpages: torch.Tensor | np.ndarray, end: str, *, strict: bool = True,
                        out: torch.Tensor | np.ndarray | None = None) -> torch.Tensor | np.ndarray:
        """Physical pages of ``end`` for virtual pages (``(n,)``, the forms :meth:`translate` takes: torch or
        numpy, as :meth:`free_pages` takes them); modes, results and errors as :meth:`translate`.

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()
        >>> alloc.translate_pages(alloc.alloc_pages(2), "swa").tolist()
        [8, 9]
        >>> alloc.translate_pages(np.array([1, 2], np.int32), "full").tolist()
        [1, 2]
        """
        return self._translate(vpages, end, strict, out, pages=True)

    def _translate(self, ids: Any, end: str, strict: object, out: Any, *, pages: bool) -> Any:
        """Validation at the boundary, then :meth:`_translate_ids` (the one translation call)."""
        e = self._end_index(end)
        where = "translate_pages" if pages else "translate"
        strict = check_strict(strict, where)
        if type(ids) is np.ndarray:
            _, toks_np, n = _id_arg(ids, "vpages" if pages else "vtokens")
            if out is None:
                res_np = np.empty(n, np.int64)
            elif type(out) is np.ndarray:
                res_np = _out_arg(out, n)[1]
            else:
                raise InvalidIdError(f"{where}: out={type(out).__name__} for numpy ids; allowed a writeable 1-D "
                                     f"int64 numpy array of shape ({n},)")
            direct = res_np.flags.c_contiguous
            self._translate_ids(torch.from_numpy(np.ascontiguousarray(toks_np)), e, strict,
                                torch.from_numpy(res_np) if direct else None, pages, where,
                                res_np=None if direct else res_np)
            return res_np if out is None else out
        if isinstance(ids, torch.Tensor) and ids.is_cuda and self._mirror:
            o = int(self._meta[e, _OWNER])
            ps = 1 if pages else int(self._meta[e, _PS])
            return translate_on_device(self._mirror[o][self._group[o].index(e)], ids, ps,
                                       int(self._meta[o, _NV]) * ps, strict, out, self._names[e], where)
        toks = _ids(ids, "vpages" if pages else "vtokens")
        n = toks.numel()
        if out is not None and (not isinstance(out, torch.Tensor) or not out.is_cuda):
            res = _out(out, n)
        else:
            if out is not None:
                _out(out.cpu(), n)  # a CUDA out for CPU ids: same checks, result copied over below
            res = torch.empty(n, dtype=_I64)
        self._translate_ids(toks, e, strict, res, pages, where)
        if out is not None and out.is_cuda:
            out.copy_(res)
            return out
        return res

    # ---- the allocator's own translation, isolated (the translators of umalloc.translators may replace it) -----
    def _translate_ids(self, toks: torch.Tensor, e: int, strict: bool, res: torch.Tensor | None, pages: bool,
                       where: str, *, res_np: np.ndarray | None = None) -> None:
        """THE host translation of the allocator: ``res[i] = v2p[e][toks[i] // ps] * ps + toks[i] % ps``
        (``ps = 1`` if ``pages``), from the host masters, in one numba kernel that checks every id before it
        writes (``res`` untouched on error). ``toks``: validated contiguous CPU int64 ``(n,)``; ``res``: a
        contiguous CPU int64 ``(n,)`` (or None with ``res_np``, a strided numpy int64 output written after a
        contiguous temporary). Raises the typed errors of :meth:`translate`. O(n)."""
        n = toks.numel()
        tmp = res if res is not None else torch.empty(n, dtype=_I64)
        _k_translate(self._root_a, e, address(toks), n, address(tmp), strict, pages)  # the dispatcher
        if self._err[0] != _OK:
            self._raise(where)
        if res is None and res_np is not None:
            res_np[:] = tmp.numpy()

    def num_contiguous_runs(self, vpages: torch.Tensor, end: str) -> int:
        """How many runs of consecutive ascending physical pages ``vpages`` (in the given order) forms on ``end``
        (the descriptor count of a transfer of these pages, per region pair). 0 for an empty input.

        Raises: as :meth:`translate_pages` (strict).

        >>> from umalloc.testing import small_allocator
        >>> alloc = small_allocator()
        >>> vp = alloc.alloc_pages(4)
        >>> alloc.num_contiguous_runs(vp, "full"), alloc.num_contiguous_runs(vp.flip(0), "full")
        (1, 4)
        """
        res = self.translate_pages(vpages, end)
        phys = res if isinstance(res, np.ndarray) else res.cpu().numpy()
        if phys.size == 0:
            return 0
        return int(1 + np.count_nonzero(phys[1:] != phys[:-1] + 1))



__all__ = ["TranslationPart"]
