"""Retraction: move a request's KV pages of every end into host memory, free them, and restore them later.

Policy:

* A retraction covers the id-owner end and *every* end bound to it (target, SWA window tail, draft, state):
  a draft's pages are never dropped. An end whose page was deliberately left unbound (an SWA page that left
  the window, tombstoned by ``unbind_end``) is recorded as unbound and stays unbound after restore.
* While the device -> host copy is in flight the pages are leased (Note [Leases and compaction] in
  :mod:`umalloc.leases.table`), so no compaction moves them and no reuse overwrites them; the pages are freed only
  after the copy has completed. If the copy fails, the lease is released and nothing is freed.
* Restore allocates fresh pages and writes the same bytes back. **Virtual ids are re-minted**: the returned
  virtual token ids differ in general from the retracted ones (same offsets inside each page, same order as
  the retracted tokens); the engine rewrites its block table (``req_to_token``) with them.
* Only the allocator's public API is used (``v2p``, ``lease``, ``free``, ``can_alloc``, ``alloc_pages``,
  ``bind_end``, ``translate_pages``, ``arena.envelopes``; the :class:`MultiEndedAllocator` protocol below); this module never imports the
  allocator: ``MultiEndedAllocator.retract/restore`` call in here.
* Restore is all-or-nothing: if any end lacks space it returns ``None`` and the allocator's live set is
  unchanged.
* A record is restored only into the geometry it was taken from (Note [Restore checks the whole record]).

Note [Restore checks the whole record]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A :class:`RetractedKV` carries the :class:`~umalloc.geometry.spec.EndSpec` of every end it holds. :func:`restore`
checks the *whole* record against the allocator before it allocates a single page: the owner is an id-owner
end; the record's ends are exactly the owner and its bound ends; every end's layers, page_size, owner and
role equal the allocator's (so page_bytes and the envelope layout agree; grow directions and the arena size may
differ: they decide placement, not bytes); and the record is self-consistent
(``bound`` is bool ``(num_pages,)`` and all-true on the owner, ``data`` is uint8 ``(bound.sum(), page_bytes)``,
``page_index`` covers ``[0, num_pages)``, ``token_offset`` lies in ``[0, page_size)``). Every difference is
listed in one :class:`~umalloc.errors.UmallocValueError`, and the allocator is untouched (its snapshot compares
equal). Checking afterwards would be too late: a mismatch found while binding or writing bytes would leave
pages allocated. Only then is space checked (``None`` for a shortage), so a foreign record is never mistaken
for a full arena. If a later step still fails (an end that ``can_alloc`` passed comes up short when bound on
its own, or a device error while writing bytes), every page allocated so far is freed again before returning
``None`` / re-raising: no page outlives a failed restore.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from umalloc.errors import InvalidIdError, NotAllocatedError, UmallocValueError
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndSpec
from umalloc.ids import host_ids
from umalloc.pool.pagestate import TOMBSTONE


class MultiEndedAllocator(Protocol):
    """What retraction uses of an allocator: only its public API (the allocator imports this module, never the
    other way round; ``MultiEndedAllocator.retract``/``restore`` call :func:`retract`/:func:`restore`)."""

    spec: ArenaSpec
    arena: Arena

    def num_vpages(self, owner: str | None = None) -> int: ...
    def v2p(self, end: str) -> torch.Tensor: ...
    def lease(self, pages: Mapping[str, torch.Tensor], *, deadline_s: float | None = None, tag: str = "") -> Any: ...
    def free(self, vtokens: torch.Tensor, *, owner: str | None = None) -> None: ...
    def can_alloc(self, num_pages_by_end: Mapping[str, int]) -> bool: ...
    def alloc_pages(self, num_pages: int, *, owner: str | None = None, bind: Sequence[str] | None = None) -> Any: ...
    def bind_end(self, end: str, vtokens: torch.Tensor) -> bool: ...
    def translate_pages(self, vpages: torch.Tensor, end: str, *, strict: bool = True) -> Any: ...


@dataclass(frozen=True)
class RetractedEnd:
    """Host copy of one end's pages of a retracted request.

    Attributes:
        bound: bool ``(num_pages,)``: which of the request's pages were bound on this end.
        data: uint8 CPU tensor ``(bound.sum(), page_bytes)``: the envelopes of the bound pages, in page order.
    """

    bound: np.ndarray
    data: torch.Tensor


@dataclass(frozen=True)
class RetractedKV:
    """A request's KV held in host memory by :func:`retract`.

    Attributes:
        owner: the id-owner end whose virtual ids the request used.
        page_size: tokens per page (of the owner and every bound end).
        num_pages: distinct virtual pages retracted.
        page_index: int64 ``(num_tokens,)``: for each retracted token (input order), its page's index in
            ``[0, num_pages)``.
        token_offset: int64 ``(num_tokens,)``: each token's offset inside its page.
        ends: end name -> :class:`RetractedEnd` (the owner and every bound end).
        old_vpages: int64 ``(num_pages,)``: the virtual pages the request had (for logs; never reused).
        specs: end name -> the :class:`~umalloc.geometry.spec.EndSpec` the end had at retract (the geometry
            :func:`restore` checks, Note [Restore checks the whole record]).
    """

    owner: str
    page_size: int
    num_pages: int
    page_index: np.ndarray
    token_offset: np.ndarray
    ends: dict[str, RetractedEnd]
    old_vpages: np.ndarray
    specs: dict[str, EndSpec]

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(int(e.data.numel()) for e in self.ends.values())

    def pages_by_end(self) -> dict[str, int]:
        """Pages each end needs at restore."""
        return {name: int(e.bound.sum()) for name, e in self.ends.items()}


def _resolve_owner(allocator: MultiEndedAllocator, owner: str | None) -> str:
    spec = allocator.spec
    owners = [e.name for e in spec.ends if e.owner is None]
    if owner is None:
        if len(owners) != 1:
            raise UmallocValueError(f"owner=None is ambiguous: allowed one of {owners}")
        return owners[0]
    if owner not in owners:
        raise UmallocValueError(f"owner={owner!r}: allowed an id-owner end, one of {owners}")
    return owner


def _bound_ends(allocator: MultiEndedAllocator, owner: str) -> list[str]:
    return [owner] + [e.name for e in allocator.spec.ends if e.owner == owner]


def retract(allocator: MultiEndedAllocator, vtokens: torch.Tensor | np.ndarray, *,
            owner: str | None = None) -> RetractedKV:
    """Copy every end's pages of a request to host memory, then free them in the arena.

    Args:
        allocator: the allocator holding the request.
        vtokens: 1-D integer tensor (any integer dtype, any device) or numpy array of the request's virtual
            token ids, as every other id call takes them; the pages containing them are retracted whole (page
            granularity, F01). Duplicates are allowed.
        owner: the id-owner end (``None``: the only one).

    Returns:
        :class:`RetractedKV` with CPU copies of the owner's and every bound end's envelopes (pinned host memory
        when the arena is on CUDA).

    Raises:
        InvalidIdError: bad dtype/shape, a token outside the owner's virtual id space, or in virtual page 0.
        NotAllocatedError: a page that is not live on the owner. Nothing changes on any error.

    Complexity: O(pages * page_bytes) bytes copied per end, one gather per end.

    >>> from umalloc.testing import small_allocator   # full (up, owner) + swa (down, bound), page_size 2
    >>> alloc = small_allocator()
    >>> t = alloc.alloc_extend(torch.tensor([0]), torch.tensor([3]), torch.tensor([-1]))   # 3 tokens, 2 pages
    >>> kv = retract(alloc, t)
    >>> kv.pages_by_end(), alloc.stats()["full"].live_pages, alloc.leases_active()
    ({'full': 2, 'swa': 2}, 0, 0)
    """
    owner = _resolve_owner(allocator, owner)
    toks = host_ids(vtokens, "retract: vtokens")  # a torch tensor or numpy array of any integer dtype
    page_size = allocator.spec.end(owner).page_size
    num_vpages = allocator.num_vpages(owner)
    if toks.size and (toks.min() < 0 or toks.max() >= num_vpages * page_size):
        raise InvalidIdError(f"virtual token ids of owner {owner!r}: allowed [0, {num_vpages * page_size - 1}]")
    vpages, page_index = np.unique(toks // page_size, return_inverse=True)
    vpages = vpages.astype(np.int64)
    if vpages.size and vpages[0] == 0:
        raise InvalidIdError(f"virtual page 0 of owner {owner!r} is reserved (the sink); allowed live pages >= 1")
    owner_v2p = allocator.v2p(owner).cpu().numpy()
    if vpages.size and (owner_v2p[vpages] == TOMBSTONE).any():
        bad = vpages[owner_v2p[vpages] == TOMBSTONE][:8].tolist()
        raise NotAllocatedError(f"virtual pages {bad} of owner {owner!r} are not live")
    arena = allocator.arena
    phys: dict[str, np.ndarray] = {}
    bound: dict[str, np.ndarray] = {}
    for end in _bound_ends(allocator, owner):
        p = allocator.v2p(end).cpu().numpy()[vpages]
        bound[end] = p != TOMBSTONE
        phys[end] = p[bound[end]].astype(np.int64)
    datas: dict[str, torch.Tensor] = {}
    on_cuda = arena.device.type == "cuda"
    with allocator.lease({e: torch.from_numpy(p) for e, p in phys.items() if p.size},
                         tag=f"retract:{owner}"):
        for end, p in phys.items():
            env = arena.envelopes(end)
            rows = env.index_select(0, torch.from_numpy(p).to(env.device))
            if on_cuda:
                host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
                host.copy_(rows, non_blocking=True)
            else:
                host = rows  # index_select already made a private CPU copy
            datas[end] = host
        if on_cuda:
            torch.cuda.current_stream(arena.device).synchronize()  # the copy has landed before the lease is released
    if vpages.size:
        allocator.free(torch.from_numpy(vpages * page_size), owner=owner)
    return RetractedKV(owner=owner, page_size=page_size, num_pages=int(vpages.size),
                       page_index=page_index.astype(np.int64).reshape(-1),
                       token_offset=(toks % page_size).astype(np.int64),
                       ends={e: RetractedEnd(bound[e], datas[e]) for e in phys}, old_vpages=vpages,
                       specs={e: allocator.spec.end(e) for e in phys})


_GEOMETRY_FIELDS = ("layers", "page_size", "owner", "role")  # what makes an end's bytes and ids mean the same


def _layers_text(layers: tuple) -> str:
    return ", ".join(f"{la.kind.value}(heads={la.num_kv_heads}, k={la.head_dim_k}, v={la.head_dim_v}, "
                     f"latent={la.latent_dim}, window={la.window_tokens}, {la.dtype.value})" for la in layers)


def _record_differences(allocator: MultiEndedAllocator, rec: RetractedKV) -> list[str]:
    """Every way ``rec`` does not fit ``allocator`` (empty: it fits). Reads only; O(num_tokens + num_pages)."""
    spec = allocator.spec
    diffs: list[str] = []
    owners = [e.name for e in spec.ends if e.owner is None]
    if rec.owner not in owners:
        return [f"owner {rec.owner!r} is not an id-owner end of this allocator (allowed one of {owners})"]
    expected = _bound_ends(allocator, rec.owner)
    ends = rec.ends if isinstance(rec.ends, dict) else {}
    specs = rec.specs if isinstance(rec.specs, dict) else {}
    if not isinstance(rec.ends, dict) or not isinstance(rec.specs, dict):
        diffs.append("ends and specs must be dicts keyed by end name")
    missing = [e for e in expected if e not in ends]
    extra = [e for e in ends if e not in expected]
    if missing:
        diffs.append(f"ends {missing} of owner {rec.owner!r} are missing from the record (its ends: {list(ends)})")
    if extra:
        diffs.append(f"ends {extra} are not ends of owner {rec.owner!r} here (allowed {expected})")
    if set(specs) != set(ends):
        diffs.append(f"specs name ends {sorted(specs)}, data names ends {sorted(ends)}")
    ps = spec.end(rec.owner).page_size
    if isinstance(rec.page_size, bool) or not isinstance(rec.page_size, (int, np.integer)) or rec.page_size != ps:
        diffs.append(f"page_size={rec.page_size!r}: this allocator's owner {rec.owner!r} has page_size={ps}")
    for name in (e for e in expected if e in ends and e in specs):
        mine, theirs = spec.end(name), specs[name]
        if not isinstance(theirs, EndSpec):
            diffs.append(f"specs[{name!r}]: allowed an EndSpec, got {type(theirs).__name__}")
            continue
        for f in _GEOMETRY_FIELDS:
            a, b = getattr(theirs, f), getattr(mine, f)
            if a != b:
                if f == "layers":
                    a, b = _layers_text(a), _layers_text(b)
                diffs.append(f"end {name!r}: {f} {a!r} in the record, {b!r} here")
        if theirs.page_bytes != mine.page_bytes:
            diffs.append(f"end {name!r}: page_bytes {theirs.page_bytes} in the record, {mine.page_bytes} here")
    n = rec.num_pages
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        return [*diffs, f"num_pages={n!r}: allowed an int >= 0"]
    n = int(n)
    pi, off = rec.page_index, rec.token_offset
    if not (isinstance(pi, np.ndarray) and pi.dtype == np.int64 and pi.ndim == 1):
        diffs.append("page_index: allowed a 1-D numpy int64 array")
    elif pi.size and (pi.min() < 0 or pi.max() >= n):
        diffs.append(f"page_index: values in [{pi.min()}, {pi.max()}], allowed [0, {n - 1}]")
    elif n and np.bincount(pi, minlength=n).min() == 0:
        diffs.append(f"page_index: pages {np.flatnonzero(np.bincount(pi, minlength=n) == 0)[:8].tolist()} "
                     f"of [0, {n}) hold no token")
    if not (isinstance(off, np.ndarray) and off.dtype == np.int64 and off.ndim == 1):
        diffs.append("token_offset: allowed a 1-D numpy int64 array")
    else:
        if isinstance(pi, np.ndarray) and off.shape != pi.shape:
            diffs.append(f"token_offset: shape {tuple(off.shape)}, page_index {tuple(pi.shape)}: allowed equal")
        if off.size and (off.min() < 0 or off.max() >= ps):
            diffs.append(f"token_offset: values in [{off.min()}, {off.max()}], allowed [0, {ps - 1}]")
    for name in (e for e in expected if e in ends):
        rec_end = ends[name]
        page_bytes = spec.end(name).page_bytes
        bound = getattr(rec_end, "bound", None)
        if not (isinstance(bound, np.ndarray) and bound.dtype == np.bool_ and bound.shape == (n,)):
            diffs.append(f"end {name!r}: bound must be a numpy bool array of shape ({n},) (num_pages)")
            continue
        if name == rec.owner and not bound.all():
            diffs.append(f"end {name!r}: the owner's pages must all be bound")
        data = getattr(rec_end, "data", None)
        want = (int(bound.sum()), page_bytes)
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or tuple(data.shape) != want:
            got = (f"{data.dtype} {tuple(data.shape)}" if isinstance(data, torch.Tensor)
                   else type(data).__name__)
            diffs.append(f"end {name!r}: data {got}, allowed torch.uint8 {want} (bound pages x page_bytes)")
    return diffs


def restore(allocator: MultiEndedAllocator, retracted: RetractedKV) -> torch.Tensor | None:
    """Allocate fresh pages on every end of a retracted request and write its bytes back.

    Virtual ids are re-minted: the result holds the request's NEW virtual token ids, int64 ``(num_tokens,)`` on
    the arena's device, in the order of the tokens given to :func:`retract`, each at the same offset inside its
    page as at retraction. Pages that were unbound on a bound end (tombstoned SWA pages) stay unbound.

    The whole record is checked against the allocator before anything is allocated (Note [Restore checks the
    whole record]); a record taken from an allocator of another geometry is refused.

    Returns:
        the new virtual token ids, or ``None`` if some end lacks space (the live set is then unchanged).

    Raises:
        UmallocValueError: ``retracted`` is not a :class:`RetractedKV`, or does not fit this allocator (another
        owner, end set, page_size, page_bytes, layout or role, or an inconsistent record); the message lists
        every difference. Nothing changes.

    Complexity: O(num_tokens + pages) checks, then O(pages * page_bytes) bytes copied per end, one scatter per
    end.

    >>> from umalloc.testing import small_allocator
    >>> alloc = small_allocator()
    >>> t = alloc.alloc_extend(torch.tensor([0]), torch.tensor([3]), torch.tensor([-1]))
    >>> alloc.arena.envelopes("swa")[alloc.translate_pages(torch.tensor([1, 2]), "swa")] = torch.tensor(
    ...     [[5], [6]], dtype=torch.uint8)
    >>> kv = retract(alloc, t)
    >>> _ = alloc.alloc_pages(1)                        # someone else takes virtual page 1 meanwhile
    >>> new = restore(alloc, kv)
    >>> new.tolist(), alloc.arena.envelopes("swa")[alloc.translate_pages(new[::2] // 2, "swa"), 0].tolist()
    ([4, 5, 6], [5, 6])
    """
    if not isinstance(retracted, RetractedKV):
        raise UmallocValueError(f"retracted={type(retracted).__name__}: allowed a RetractedKV from retract()")
    diffs = _record_differences(allocator, retracted)  # Note [Restore checks the whole record]: before any alloc
    if diffs:
        lines = "\n  - ".join(diffs)
        raise UmallocValueError(f"restore: the record does not fit this allocator (retract() and restore() must "
                                f"share one geometry), {len(diffs)} difference(s):\n  - {lines}")
    owner, ps = retracted.owner, retracted.page_size
    device = allocator.arena.device
    if retracted.num_pages == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    need = {e: n for e, n in retracted.pages_by_end().items() if n}
    if not allocator.can_alloc(need):
        return None
    # ends bound on every page are bound in the owner's own (all-or-nothing) call; only partly bound ends
    # (SWA pages that had left the window) are bound afterwards, page by page of theirs
    full = [e for e, rec in retracted.ends.items() if e != owner and rec.bound.all()]
    partial = [e for e, rec in retracted.ends.items() if e != owner and rec.bound.any() and not rec.bound.all()]
    new_vp = allocator.alloc_pages(retracted.num_pages, owner=owner, bind=full)
    if new_vp is None:
        return None
    new_vp_np = new_vp.cpu().numpy().astype(np.int64)
    new_tokens = torch.from_numpy(new_vp_np * ps).to(device)
    try:
        for end in partial:
            if not allocator.bind_end(end, torch.from_numpy(new_vp_np[retracted.ends[end].bound] * ps).to(device)):
                allocator.free(new_tokens, owner=owner)  # frees the owner's and every bound end's new pages
                return None
        arena = allocator.arena
        for end, rec in retracted.ends.items():
            if not rec.bound.any():
                continue
            p = allocator.translate_pages(torch.from_numpy(new_vp_np[rec.bound]).to(device), end, strict=True)
            env = arena.envelopes(end)
            env.index_copy_(0, p.to(env.device, torch.int64), rec.data.to(env.device, non_blocking=True))
    except BaseException:
        allocator.free(new_tokens, owner=owner)  # no page outlives a failed restore
        raise
    out = new_vp_np[retracted.page_index] * ps + retracted.token_offset
    return torch.from_numpy(out).to(device)


__all__ = ["RetractedEnd", "RetractedKV", "restore", "retract"]
