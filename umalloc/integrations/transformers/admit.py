"""A decode engine on transformers' continuous batching whose requests arrive with their prompt's KV already in
the cache's pages (disaggregated prefill / decode).

:class:`DecodeEngine` builds transformers' own batch processor (scheduler, request states, IO builder, model
runner) over an :class:`~umalloc.integrations.transformers.cache.UmallocPagedCache` and steps it from the
caller's thread. A request joins in two calls:

1. :meth:`DecodeEngine.reserve_ends` gives the request its pages in the cache (its row of the cache's request
   table, the whole prompt, and for a model with sliding layers its ring, Note [Ring landing]) and returns their
   virtual token ids per id-owner end: the destination a transfer plan writes the prompt's KV into
   (``build_plan(..., engine.cache.alloc, dst_vtokens=...)``); :meth:`DecodeEngine.reserve` is its
   ``full``-end tensor for a full-attention model;
2. once the KV is there, :meth:`DecodeEngine.admit` puts a request state into the running batch as a request
   whose prompt was computed and whose first token (the prefill side's) is its last generated token: its next
   step is a one-token decode that reads the prompt's KV from those pages.

No ``DynamicCache``, no copy of the KV out of the arena and no prefill forward on the decode side.

Note [Admission seam]
~~~~~~~~~~~~~~~~~~~~~
transformers 5.23 has no public call that adds a request whose KV exists. Its scheduler treats a request it
finds in ``scheduler.active_requests`` with status ``DECODING`` as a request past its prefill: it schedules
``state.tokens_to_process`` (one token) at position ``state.position_offset``, asks the cache for one more
token (``can_store_request_tokens(state, 1)``: the cache grows the request's own row) and the IO builder asks
the cache for the rows of the ``position_offset`` past tokens, which are the received pages. So a request is
admitted by building a ``RequestState`` as transformers' own scheduler leaves one after a prefill in one step
(``remaining_prefill_tokens`` empty, ``position_offset`` = prompt length, status ``DECODING``, the first token
in ``generated_tokens`` and ``tokens_to_process``) and inserting it into ``active_requests`` between steps,
after the cache holds exactly the prompt's tokens for its id. The offloading manager's restore path was
considered and not used: it copies a request's blocks from a CPU swap pool by physical block id (a copy, and
refused by this cache, Note [Seams] 8 in :mod:`~umalloc.integrations.transformers.cache`). transformers' files
are not modified.

Note [Ring landing]
~~~~~~~~~~~~~~~~~~~
A model with sliding layers has two ends in the cache: ``full`` (the full-attention layers, the request's row of
``cache.table``) and ``swa``, whose pages are the request's ring (``cache.ring_table``): token ``t`` in ring
slot ``t % R`` (``R = cache.ring_tokens``: the window ``W``, or more for a cache built for speculative rounds),
slot ``s`` at offset ``s % page_size`` of the ring's page ``s // page_size`` (Note [Sliding ring] in
:mod:`~umalloc.integrations.transformers.rings`). The engine's first step after admission reads the ring slots of
the last ``min(L, W - 1)`` prompt tokens (``L`` the prompt length) and writes token ``L`` into slot ``L % R``. A
transfer plan sends the sliding layers' *window tail*: whole sequence pages ``j`` from ``f = swa_tail_start(L, W,
0, page_size) // page_size`` (the page holding token ``L - W``, or page 0) to the last, ``l = (L - 1) //
page_size``, token ``t`` at offset ``t % page_size`` of sequence page ``t // page_size``, into the destination's
virtual token ids per position. :meth:`DecodeEngine.reserve_ends` gives the ``swa`` owner, per tail position
``t``, the ring slot ``t % R``'s id, so each sequence page lands on the ring page its attention reads:

* ``L <= R``: slot ``t`` = position ``t``; sequence page ``j`` is ring page ``j`` (any window).
* ``L > R``, ``page_size`` divides ``R`` (``n = R / page_size`` ring pages): sequence page ``j`` lands on ring
  page ``j mod n``, offsets kept. When ``l - f < n`` every tail page has its own ring page. Otherwise (``l = f +
  n``, at most one more page than the ring has: ``R >= W``) the tail's first and last pages share ring page ``f mod
  n``: the ring needs the last page's offsets ``[0, r)`` (``r = L - l * page_size``, the prompt's last ``r``
  tokens) and the first page's offsets from ``L - W + 1 - f * page_size`` on, which lie above ``r - 1`` (``R > W -
  2``; offset ``r`` is slot ``L % R``, which the first step writes). A plan sends whole pages there (a page is one
  copy per layer block), so the last sequence page lands on a *staging* page of the ring table (one page, held by
  the engine, ``cache.staged_rings``) and the first on the shared ring page; :meth:`DecodeEngine.admit` copies the
  staging page's rows ``[0, r)`` of every sliding layer onto it (an in-arena copy of at most ``page_size`` tokens
  per sliding layer, nothing leaves the arena) and frees the staging page.
* ``L > R`` with ``R`` not a multiple of ``page_size`` (no speculation, a window that is not whole pages): ring
  slots do not keep a token's page offset, so no page-to-page plan lands the tail: refused
  (:func:`ring_landing_refusal`, :class:`UnsupportedCacheError`).

Positions before the tail's first page carry no ids a plan reads (zeros).

Threading: one thread drives the engine (the cache's rule). The engine switches the model it is given to paged
attention for its lifetime (:meth:`DecodeEngine.close` switches it back): give it a model no other code runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from umalloc import UmallocValueError
from umalloc.geometry.spec import swa_tail_start
from umalloc.integrations.transformers.cache import UmallocPagedCache
from umalloc.integrations.transformers.install import installed
from umalloc.integrations.transformers.options import CacheOptions, UnsupportedCacheError


class DecodeEngine:
    """transformers' continuous batching over an :class:`UmallocPagedCache`, stepped by the caller, admitting
    requests whose KV was received into its pages (module docstring).

    Args:
        model: a transformers causal LM (its own object: the engine switches its attention to paged).
        generation_config: greedy settings (``do_sample=False``); ``eos_token_id`` ``None`` decodes to
            ``max_new_tokens`` whatever the tokens.
        continuous_batching_config: transformers' ``ContinuousBatchingConfig`` (``use_async_batching=False``).
        options: the umalloc cache's :class:`CacheOptions`.

    Attributes:
        cache: the :class:`UmallocPagedCache`; processor: transformers' batch processor; states: request id ->
            its transformers ``RequestState`` (admitted requests, until :meth:`pop_finished`).
        steps: forwards run; step_tokens: number of requests in each forward's batch, in order.

    Raises:
        UnsupportedCacheError: the cache refuses the configuration (Note [Seams] 8 of the cache).
    """

    def __init__(self, model: Any, generation_config: Any, continuous_batching_config: Any,
                 options: CacheOptions | None = None) -> None:
        with installed(options):
            self.manager = model.init_continuous_batching(generation_config=generation_config,
                                                          continuous_batching_config=continuous_batching_config)
            self.processor = self.manager._create_batch_processor()
        self.manager.batch_processor = self.processor
        cache = self.processor.cache
        if not isinstance(cache, UmallocPagedCache):
            raise UnsupportedCacheError(f"the batch processor built a {type(cache).__name__}, not the umalloc cache")
        self.cache: UmallocPagedCache = cache
        self.model = model
        self.states: dict[str, Any] = {}
        self._reserved: dict[str, int] = {}
        #: request id -> (staging ring slot, ring vtokens to fill, staging vtokens to copy) (Note [Ring landing])
        self._staged: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self.steps = 0
        self.step_requests: list[int] = []
        self._closed = False

    # ---- admission ----------------------------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_tokens: int) -> torch.Tensor | None:
        """:meth:`reserve_ends` of a full-attention model: its int64 ``(prompt_tokens,)`` ``full``-end ids (token
        ``i`` at offset ``i % page_size`` of its page), or ``None`` when the arena has no room now.

        Raises:
            UnsupportedCacheError: a model with sliding layers (its ring needs :meth:`reserve_ends`).
            UmallocValueError: as :meth:`reserve_ends`.
        """
        if self.cache.window is not None:
            raise UnsupportedCacheError("reserve: the model has sliding layers; their ring needs destination ids "
                                        "of its own: allowed reserve_ends (Note [Ring landing])")
        ends = self.reserve_ends(request_id, prompt_tokens)
        return None if ends is None else ends["full"]

    def reserve_ends(self, request_id: str, prompt_tokens: int) -> dict[str, torch.Tensor] | None:
        """Give request ``request_id`` the cache pages of a ``prompt_tokens``-token prompt: its row in the cache's
        table and, with sliding layers, its ring (and a staging page where Note [Ring landing] needs one).
        Returns ``{id-owner end: int64 (prompt_tokens,) destination virtual token ids}``: ``full`` (every
        token, token ``i`` at offset ``i % page_size`` of its page) for a model with full-attention layers,
        ``swa`` (the window tail's positions on their ring slots) for one with sliding layers; ``None`` when the
        arena has no room now (nothing changed). O(pages).

        Raises:
            UnsupportedCacheError: a prompt the ring cannot receive page to page (:func:`ring_landing_refusal`).
            UmallocValueError: an id already reserved or admitted, or ``prompt_tokens`` < 1 or over what one
                request can hold.
        """
        c = self.cache
        n = int(prompt_tokens)
        if request_id in c.slots or request_id in self.states:
            raise UmallocValueError(f"reserve: request {request_id!r} already holds pages")
        if not 1 <= n <= c.max_tokens_per_request:
            raise UmallocValueError(f"reserve: prompt_tokens={n}: allowed 1..{c.max_tokens_per_request}")
        ps, w, rt_tokens = c.page_size, c.window, c.ring_tokens
        why = None if w is None else ring_landing_refusal(w, ps, n, rt_tokens)
        if why is not None:
            raise UnsupportedCacheError(f"reserve: request {request_id!r}: {why}")
        first, last = (0 if w is None else swa_tail_start(n, w, 0, ps) // ps), (n - 1) // ps
        staged = rt_tokens is not None and n > rt_tokens and last - first >= rt_tokens // ps
        rt = c.ring_table if c.ring_table is not None else c.table
        with c._timer:
            c.growth.flush()
            full_pages, swa_pages = c.growth.new_pages(None, 0, n)
            if not c.growth.fits_bytes(full_pages, swa_pages + int(staged)):
                return None
            stage = None
            if staged:
                got = rt.new_requests(1)
                if got is None or rt.extend(got, np.array([ps], np.int64)) is None:
                    if got is not None:
                        rt.free_requests(got)
                    c.growth.free_bytes_memo = None
                    return None
                stage = int(got[0])
            ok = c.growth.grow(request_id, None, 0, n)
            c.growth.free_bytes_memo = None
            if not ok:
                if stage is not None:
                    rt.free_requests([stage])
                return None
            c.counters.max_live_requests = max(c.counters.max_live_requests, len(c.slots))
            slot = c.slots[request_id]
            out: dict[str, torch.Tensor] = {}
            if c.has_full:
                out["full"] = _page_ids(c.table.pages(slot), ps, n)
            if w is not None and rt_tokens is not None:
                ring = _page_ids(rt.pages(c.ring_slots.get(slot, slot)), ps, min(n, rt_tokens))
                out["swa"] = vt = torch.zeros(n, dtype=torch.int64)
                lo = first * ps
                pos = torch.arange(lo, n, dtype=torch.int64)
                vt[lo:] = ring[pos % rt_tokens]
                if stage is not None:
                    r = n - last * ps
                    sv = _page_ids(rt.pages(stage), ps, ps)
                    vt[last * ps:] = sv[:r]
                    c.staged_rings.add(stage)
                    self._staged[request_id] = (stage, ring[(last * ps + torch.arange(r)) % rt_tokens], sv[:r])
        self._reserved[request_id] = n
        return out

    def release(self, request_id: str) -> None:
        """Free a reservation that will not be admitted (its transfer failed). No-op for an unknown id."""
        if self._reserved.pop(request_id, None) is not None:
            self._unstage(request_id)
            self.cache.free_blocks(request_id, no_cache=True)

    def _unstage(self, request_id: str) -> None:
        """Free request ``request_id``'s staging page, if it has one (Note [Ring landing])."""
        got = self._staged.pop(request_id, None)
        if got is None:
            return
        c = self.cache
        rt = c.ring_table if c.ring_table is not None else c.table
        c.staged_rings.discard(got[0])
        with c._timer:
            rt.free_requests([got[0]])
            c._forget_rows([], [got[0]])
            c.growth.free_bytes_memo = None

    def admit(self, request_id: str, prompt: list[int], first_token: int, max_new_tokens: int,
              eos_token_id: int | list[int] | None = None) -> Any:
        """Put reserved request ``request_id`` into the running batch, its prompt computed and ``first_token``
        generated (Note [Admission seam]); its next step decodes from the received KV. Returns its
        ``RequestState``. ``max_new_tokens`` counts ``first_token``.

        Raises:
            UmallocValueError: ``request_id`` not reserved, ``prompt`` not of the reserved length, or
                ``max_new_tokens`` < 2.
        """
        from transformers.generation.continuous_batching.requests import RequestState, RequestStatus

        n = self._reserved.get(request_id)
        if n is None:
            raise UmallocValueError(f"admit: request {request_id!r} was not reserved")
        if len(prompt) != n:
            raise UmallocValueError(f"admit: prompt of {len(prompt)} tokens; request {request_id!r} reserved {n}")
        if int(max_new_tokens) < 2:
            raise UmallocValueError(f"admit: max_new_tokens={max_new_tokens}: allowed >= 2 (the first token is "
                                    "the prefill's)")
        staged = self._staged.get(request_id)
        if staged is not None:   # the prompt's last tokens onto the ring page they share (Note [Ring landing])
            from umalloc.integrations.transformers.groups import SLIDING_ATTENTION

            with self.cache._timer:
                self.cache.cache_allocators[SLIDING_ATTENTION].copy_rows(staged[2], staged[1])
            self._unstage(request_id)
        del self._reserved[request_id]
        state = RequestState(request_id=request_id, initial_tokens=list(prompt), max_new_tokens=int(max_new_tokens),
                             eos_token_id=-1 if eos_token_id is None else eos_token_id, record_timestamps=True)
        state.remaining_prefill_tokens = []
        state.position_offset = n
        state.status = RequestStatus.DECODING   # leaves PENDING: transformers stamps the start of its lifespan
        state.generated_tokens = [int(first_token)]
        state.tokens_to_process = [int(first_token)]
        self.processor.scheduler.active_requests[request_id] = state
        self.states[request_id] = state
        return state

    def submit(self, request_id: str, prompt: list[int], max_new_tokens: int,
               eos_token_id: int | list[int] | None = None) -> Any:
        """Queue request ``request_id`` the stock way: transformers' scheduler prefills ``prompt`` on this side
        (a one-process continuous-batching run, the baseline of a disaggregated one). Returns its
        ``RequestState``; :meth:`finished` yields it like an admitted request.

        Raises:
            UmallocValueError: an id already reserved, admitted or submitted, an empty prompt, or
                ``max_new_tokens`` < 1.
        """
        from transformers.generation.continuous_batching.requests import RequestState

        if request_id in self.states or request_id in self._reserved:
            raise UmallocValueError(f"submit: request {request_id!r} already in the engine")
        if not prompt or int(max_new_tokens) < 1:
            raise UmallocValueError(f"submit: a prompt of {len(prompt)} tokens and max_new_tokens="
                                    f"{max_new_tokens}: allowed >= 1 each")
        state = RequestState(request_id=request_id, initial_tokens=list(prompt), max_new_tokens=int(max_new_tokens),
                             eos_token_id=-1 if eos_token_id is None else eos_token_id, record_timestamps=True)
        self.processor.scheduler.add_waiting_request(state)
        self.states[request_id] = state
        return state

    def running(self) -> int:
        """Requests in the batch (admitted or submitted, not finished)."""
        s = self.processor.scheduler
        return len(s.active_requests) + len(s.waiting_requests)

    # ---- running ------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One step of transformers' loop: schedule, forward, update. ``False`` when no request ran. A request
        that fails (e.g. :class:`~umalloc.integrations.transformers.options.RequestCannotFitError`) ends
        ``FAILED`` in :attr:`states`."""
        p = self.processor
        if not p.prepare_next_batch():
            return False
        self.step_requests.append(len(p.inputs_and_outputs.requests_in_batch))
        with torch.no_grad():
            p._generation_step(self.model)
        p.update_batch()
        self.steps += 1
        return True

    def finished(self) -> Iterator[tuple[str, Any]]:
        """(request id, state) of every admitted request that finished or failed, forgotten once yielded."""
        from transformers.generation.continuous_batching.requests import RequestStatus

        for rid in [r for r, s in self.states.items() if s.status >= RequestStatus.FINISHED]:
            yield rid, self.states.pop(rid)

    def close(self) -> None:
        """Free every request's pages and give the model its attention implementation back. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for rid in list(self._reserved):
            self.release(rid)
        self.cache.free_all_requests(clear_ledgers=True)
        orig = getattr(self.manager, "_original_attn_impl", None)
        if orig is not None:
            self.model.set_attn_implementation(orig)
            self.manager._original_attn_impl = None
        self.manager.batch_processor = None


def _page_ids(vpages: torch.Tensor, page_size: int, num_tokens: int) -> torch.Tensor:
    """int64 ``(num_tokens,)`` virtual token ids of a row's pages ``vpages``, token ``i`` at offset ``i %
    page_size`` of page ``i // page_size``."""
    p = vpages.to(torch.int64)
    return (p[:, None] * page_size + torch.arange(page_size, dtype=torch.int64)[None, :]).reshape(-1)[:num_tokens]


def ring_landing_refusal(window: int, page_size: int, prompt_tokens: int, ring: int | None = None) -> str | None:
    """Why a ``prompt_tokens``-token prompt's window tail cannot land page to page in a ring of ``ring`` slots
    (None: ``window``, no speculation) of ``page_size``-token pages (Note [Ring landing]), or ``None`` when it
    can. O(1).

    >>> ring_landing_refusal(32, 16, 100) is None, ring_landing_refusal(24, 16, 20) is None
    (True, True)
    >>> ring_landing_refusal(24, 16, 30)[:40], ring_landing_refusal(24, 16, 30, ring=32) is None
    ('sliding window 24 is not a multiple of p', True)
    """
    r = window if ring is None else ring
    if prompt_tokens <= r or r % page_size == 0:
        return None
    return (f"sliding window {window} is not a multiple of page_size {page_size}, so a prompt of {prompt_tokens} "
            f"tokens (over the window) puts tokens in ring slots at another page offset than in the plan's "
            f"sequence pages; allowed a page_size dividing {window}, or prompts of at most {window} tokens")


def reserved_pages(vtokens: torch.Tensor, page_size: int) -> np.ndarray:
    """The virtual pages of a reservation's ``vtokens`` (one per ``page_size`` tokens), int64. O(tokens)."""
    return (vtokens[::page_size] // page_size).numpy().astype(np.int64)


__all__ = ["DecodeEngine", "reserved_pages", "ring_landing_refusal"]
