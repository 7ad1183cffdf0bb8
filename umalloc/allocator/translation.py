"""The allocator's translation service: translation and the read-only table views.

* :meth:`TranslationService.translate` / :meth:`~TranslationService.translate_pages` validate at the boundary (torch or
  numpy ids, ``int32`` and narrower converted once, ``strict`` a bool, default ``True``) and then translate with
  the translators, the one translation implementation: host ids through
  :func:`umalloc.translators.cpu.virtual_to_physical` (``_pages``) with the end's host master v2p row as the
  table, ids on the arena's CUDA device through :mod:`umalloc.translators.cuda` with the end's device mirror
  row (:mod:`umalloc.pool.mirror`) as the table.
* Note [Translate fast path]: contiguous 1-D int64 CPU tensors, ids and a caller-owned ``out`` of their
  length, in batches below the translators' parallel threshold (``PARALLEL_MIN_ITEMS``), go by address to the
  kernels' direct entry (``translate_addr``, Note [Direct entry] in :mod:`umalloc.pool.kernels.ops`), which
  runs the translators' one serial loop on the end's host master: no ``Tensor.numpy()`` (about 0.7 us each)
  and no array unboxing. Other 1-D int64 CPU ids (a tensor or a numpy array) with no ``out`` or a caller-owned
  contiguous one of the same kind go to the translator as numpy views (the translators' host fast path);
  every other input is validated and converted here first (:meth:`TranslationService._translate_checked`). A
  call refused on a fast path is then re-validated here, so a bad argument raises the allocator's own
  message; a range or tombstone error keeps the translator's message (which names the position, the value and
  the allowed range) behind ``"<call> on end '<end>': "``; ``out`` is untouched.
* :meth:`~TranslationService.v2p` / :meth:`~TranslationService.p2v` return read-only zero-copy views
  (:class:`~umalloc.allocator.arguments.ReadOnlyTable`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, NoReturn

import numpy as np
import torch

from umalloc.allocator.arguments import _I64, _NP_I64, _ids, _out, _out_arg, read_only_table
from umalloc.allocator.calls import KernelEntry
from umalloc.allocator.ends import EndIndex
from umalloc.errors import InvalidIdError, UmallocError
from umalloc.ids import check_strict, host_ids
from umalloc.pool.heap import Heap
from umalloc.translators import coalesce_runs
from umalloc.translators import cpu as host_translator
from umalloc.translators import cuda as device_translator

_Tensor = torch.Tensor


class _EndTables(NamedTuple):
    """What translating on one end needs, built once per end (the heap never rebinds its arrays)."""

    e: int
    name: str
    host: np.ndarray  # the end's host master v2p row, int64 (num_vpages(owner),)
    page_size: int
    device: torch.Tensor | None  # the end's device mirror row, or None without mirrors


class TranslationService:
    """Translation on every end of one allocator (reads the host masters and mirrors; owner thread, or any
    thread that orders its reads after the allocator calls it depends on).

    Args:
        heap: the allocator's heap. ends: its end index. entry: its kernel entry. mirrors: owner index -> device
            ``v2p`` block (empty without mirrors).

    Per end it keeps the tables one translation needs (:class:`_EndTables`), built on first use: the heap never
    rebinds its arrays and mirrors are written in place only.
    """

    __slots__ = ("_addr", "_end_tables", "_ends", "_heap", "_hot", "_mirror", "_root_a")

    def __init__(self, heap: Heap, ends: EndIndex, entry: KernelEntry, mirrors: dict[int, torch.Tensor]) -> None:
        self._heap = heap
        self._ends = ends
        self._hot, self._root_a, self._addr = entry.hot, entry.root_a, entry.addr  # the fast path's entry
        self._mirror = mirrors
        self._end_tables: dict[object, _EndTables] = {}

    def v2p(self, end: str) -> torch.Tensor:
        """``int64`` tensor ``(num_vpages(owner),)`` on the arena's device: physical page of each virtual page
        of ``end``'s owner, TOMBSTONE (-1) where unbound; entry 0 is the sink (0).

        A :class:`~umalloc.allocator.arguments.ReadOnlyTable` sharing the table's memory (zero-copy: it follows every later
        call): writes, in-place ops and passing it as ``out=`` raise InvalidIdError; ``.clone()`` gives a
        writable copy. On CPU it views the host master; on CUDA the device mirror refreshed by every call. O(1).
        """
        e = self._ends.end(end)
        o = self._heap.owner_of(e)
        row = self._ends.group[o].index(e)
        if self._mirror:
            return read_only_table(self._mirror[o][row])
        return read_only_table(torch.from_numpy(self._heap.host2d[o][row]))

    def p2v(self, end: str) -> torch.Tensor:
        """``int64`` CPU tensor ``(num_page_slots(end),)``: virtual page bound to each physical page, TOMBSTONE
        where none. A read-only view of the host master (as :meth:`v2p`). O(1)."""
        e = self._ends.end(end)
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

    def _tables(self, end: object) -> _EndTables:
        """The :class:`_EndTables` of ``end`` (built on first use). Raises UmallocValueError for an unknown end."""
        try:
            return self._end_tables[end]
        except (KeyError, TypeError):
            pass
        e = self._ends.end(end)  # type: ignore[arg-type]
        o = self._heap.owner_of(e)
        row = self._ends.group[o].index(e)
        tables = _EndTables(e, self._ends.names[e], self._heap.host2d[o][row], self._heap.page_size(e),
                            self._mirror[o][row] if self._mirror else None)
        self._end_tables[end] = tables
        return tables

    def _translate(self, ids: Any, end: str, strict: object, out: Any, *, pages: bool) -> Any:
        """Note [Translate fast path]; then :meth:`_translate_checked` for everything else."""
        t = self._tables(end)
        if strict is not True and strict is not False:
            strict = check_strict(strict, "translate_pages" if pages else "translate")
        kind = type(ids)
        ids_np: np.ndarray | None = None
        out_np: np.ndarray | None = None
        if kind is np.ndarray:
            if ids.dtype is _NP_I64 and ids.ndim == 1 and (out is None or type(out) is np.ndarray):
                ids_np, out_np = ids, (np.empty(ids.shape[0], np.int64) if out is None else out)
        elif kind is _Tensor and (out is None or type(out) is _Tensor):
            if (out is not None and ids.dtype is _I64 and out.dtype is _I64 and ids.dim() == 1 and out.dim() == 1
                    and ids.is_cpu and out.is_cpu and ids.is_contiguous() and out.is_contiguous()):
                # by address (Note [Translate fast path]); a refusal, or a batch for the parallel loop, goes on
                n = ids.shape[0]
                if 0 < n < host_translator.PARALLEL_MIN_ITEMS and out.shape[0] == n:
                    addr = self._addr
                    if self._hot.translate_addr(self._root_a, t.e, addr(ids), n, 1 if pages else t.page_size,
                                                strict, addr(out)) == 0:
                        return out
            try:
                ids_np = ids.numpy()
                out_np = None if out is None else out.numpy()
            except (TypeError, RuntimeError):  # not on the CPU, or not a plain dense tensor
                ids_np = None
            if ids_np is not None and not (ids_np.dtype is _NP_I64 and ids_np.ndim == 1 and
                                           (out_np is None or out_np.flags.c_contiguous)):
                ids_np = None
        if ids_np is None:
            return self._translate_checked(t, ids, strict, out, pages)
        try:
            if pages:
                res = host_translator.virtual_to_physical_pages(ids_np, t.host, out=out_np, strict=strict)
            else:
                res = host_translator.virtual_to_physical(ids_np, t.host, t.page_size, out=out_np, strict=strict)
        except UmallocError as exc:
            self._refused(exc, t, ids, out, pages)
        return res if out is None else out  # a fresh result (numpy for numpy ids), or the caller's out

    def _translate_checked(self, t: _EndTables, ids: Any, strict: bool, out: Any, pages: bool) -> Any:
        """Validate and convert every other input (int32 and narrower ids, strided numpy outputs, ids on the
        arena's CUDA device, a CUDA ``out`` for CPU ids), then translate with the translators."""
        where = "translate_pages" if pages else "translate"
        ps = 1 if pages else t.page_size
        if isinstance(ids, torch.Tensor) and ids.is_cuda and t.device is not None:
            ids_d, out_d = self._device_args(ids, out, where)
            try:
                if pages:
                    return device_translator.virtual_to_physical_pages(ids_d, t.device, out=out_d, strict=strict)
                return device_translator.virtual_to_physical(ids_d, t.device, ps, out=out_d, strict=strict)
            except UmallocError as exc:
                raise type(exc)(f"{where} on end {t.name!r}: {exc}") from None
        name = "vpages" if pages else "vtokens"
        if type(ids) is np.ndarray:
            toks_np = host_ids(ids, name)
            if out is None:
                out_np = np.empty(toks_np.shape[0], np.int64)
            elif type(out) is np.ndarray:
                out_np = _out_arg(out, toks_np.shape[0])[1]
            else:
                raise InvalidIdError(f"{where}: out={type(out).__name__} for numpy ids; allowed a writeable 1-D "
                                     f"int64 numpy array of shape ({toks_np.shape[0]},)")
            self._host_call(t, toks_np, out_np, strict, pages, where)
            return out_np if out is None else out
        toks = _ids(ids, name)
        n = toks.numel()
        cuda_out = isinstance(out, torch.Tensor) and out.is_cuda
        if out is not None:
            _out(out.cpu() if cuda_out else out, n)  # a CUDA out for CPU ids: same checks, result copied below
        res = torch.from_numpy(np.empty(n, np.int64)) if out is None or cuda_out else out
        self._host_call(t, toks.numpy(), res.numpy(), strict, pages, where)
        if cuda_out:
            return out.copy_(res)
        return res

    def _host_call(self, t: _EndTables, toks: np.ndarray, res: np.ndarray, strict: bool, pages: bool,
                   where: str) -> None:
        """The host translator on validated ids ``toks`` into ``res`` (int64, of their length)."""
        try:
            if pages:
                host_translator.virtual_to_physical_pages(toks, t.host, out=res, strict=strict)
            else:
                host_translator.virtual_to_physical(toks, t.host, t.page_size, out=res, strict=strict)
        except UmallocError as exc:
            raise type(exc)(f"{where} on end {t.name!r}: {exc}") from None

    @staticmethod
    def _device_args(ids: torch.Tensor, out: Any, where: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Checked device ids (int64, 1-D; int32 converted) and ``out`` (a caller-owned int64 tensor of the
        ids' shape on their device)."""
        if ids.layout is not torch.strided or ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 1:
            raise InvalidIdError(f"{where}: dtype {ids.dtype}, shape {tuple(ids.shape)}, layout {ids.layout}; "
                                 f"allowed 1-D torch.int64 (or int32)")
        if out is not None and (type(out) is not torch.Tensor or out.dtype is not torch.int64
                                or out.shape != ids.shape or out.device != ids.device):
            raise InvalidIdError(f"{where}: out must be a caller-owned int64 tensor of shape {tuple(ids.shape)} on "
                                 f"{ids.device}")
        return ids.to(torch.int64), out

    def _refused(self, exc: UmallocError, t: _EndTables, ids: Any, out: Any, pages: bool) -> NoReturn:
        """A fast-path call the translator refused: the allocator's own checks first (a bad argument raises
        their message), else the translator's error behind the call and the end."""
        where = "translate_pages" if pages else "translate"
        if out is not None:
            if type(out) is np.ndarray:
                _out_arg(out, ids.shape[0])
            else:
                _out(out, ids.shape[0])
        raise type(exc)(f"{where} on end {t.name!r}: {exc}") from None

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
        phys = self.translate_pages(vpages, end)
        return int(coalesce_runs(phys, phys).shape[0])


__all__ = ["TranslationService"]
