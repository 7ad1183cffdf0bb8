"""Greedy speculative decoding in a :class:`~umalloc.integrations.transformers.admit.DecodeEngine`, over the
requests' pages in place: a verify step that scores a request's last token and its draft tokens in one forward,
and an early-exit drafter whose KV lives in the cache's ``draft`` end.

:class:`SpeculativeDecoder` replaces the engine's one-token step with one *round* over every running request:

1. every request's row in the cache's table grows by ``k + 1`` tokens (``k = min(draft_tokens, tokens still to
   emit)``, and below the tokens one forward holds, ``cache.max_batch_tokens``), through the cache's own
   ``can_store_request_tokens`` (the pages of the ``draft`` end follow: it is bound to ``full``); a request the
   arena has no room for, or past the tokens or requests one forward holds, sits the round out (it waits, as a
   starved request waits in transformers' scheduler), and a round that no request can grow raises;
2. the proposer gives up to ``k`` draft tokens per request: the early-exit drafter (:class:`EarlyExitDrafter`,
   ``k`` batched forwards of the drafter model, each one token per request, reading and writing the drafter's
   K/V in the ``draft`` end's pages of the request), or a :class:`TokenProposer` without KV (n-gram);
3. one forward of the target over every request's ``[last, *drafts]`` (Note [Verify seam]) gives the target's
   greedy token at every position; the longest prefix of drafts equal to those tokens is accepted, plus the
   target's token after it (acceptance length ``accepted + 1``);
4. with every draft accepted the drafter runs once more on the last draft (it never ran on it); then every
   request's row is truncated to ``past + 1 + accepted`` tokens (the table frees the rejected tokens' pages on
   both ends; a sliding ring is cut to ``min(past + 1 + accepted, R)`` tokens), and the request state takes the
   emitted tokens; a request with ``max_new_tokens`` tokens finishes and frees its pages as the scheduler
   finishes one.

On a model with sliding layers the cache must be built for rounds of at least ``draft_tokens`` drafts
(``CacheOptions(speculative_tokens=k)``): its rings have ``R >= window + k`` slots, so the rejected drafts a round
wrote into the rings overwrote only positions outside every later step's window, and the truncation is the whole
rollback (Note [Sliding ring] in :mod:`~umalloc.integrations.transformers.rings`). A model whose every layer
slides runs with a :class:`TokenProposer` (the ``draft`` end is bound to a full-attention end).

Several requests verify in one forward (a block-diagonal mask, as transformers builds it for a prefill batch).
The tokens equal the engine's one-token steps whenever the target's multi-token forward ranks tokens as its
one-token forwards do; the rounds equal a one-process speculative run over a ``DynamicCache`` under the same
condition (``umalloc_replay.generate`` checks both).

Note [Verify seam]
~~~~~~~~~~~~~~~~~~
transformers 5.23's scheduler schedules a decoding request one token at a time and its IO builder asks for the
logits of each request's last position only (``logits_indices``). The verify forward is built with the same IO
builder (``inputs_and_outputs.prepare_batch_tensors``) from one ``FutureRequestState`` per request over a scratch
``RequestState`` (``position_offset`` = the request's cached tokens, ``tokens_to_process`` = last token and
drafts): the builder computes positions, cumulative lengths, the attention mask and, through the cache's
``extend_read_and_write_indices``, the rows the forward reads and writes in the request's pages (Note [Rows] of
:mod:`~umalloc.integrations.transformers.cache`). The model is then called without ``logits_to_keep``, so its
logits cover every position, and the greedy token of each is their argmax. The drafter's forwards use the same
builder and replace the read / write rows by those of the ``draft`` end (:class:`DraftPagedView`) and the
``cache`` argument by that view. The scheduler's own loop is not used while a decoder runs (its one-token
decode of the same requests would duplicate their tokens); transformers' files are not modified.

Note [Draft end]
~~~~~~~~~~~~~~~~
``CacheOptions(draft_layers=K)`` gives the cache's arena a ``draft`` end bound to ``full`` (K layers of the
model's KV heads and head dim; growing down, or floating between ``full`` and ``swa`` on a model with sliding
layers): a request's virtual page on ``full`` has its page on ``draft`` for as long as the request holds it, so a
transfer plan's ``draft`` vector writes the prompt's draft KV where the drafter reads it, a growth of the request
grows both, and a truncation frees both. The drafter's row of token ``t`` is ``v2p_draft[t // page_size] *
rows_per_page + t % page_size`` (its own page geometry). The end holds every token of every drafter layer, a
sliding one's included (no ring: the draft KV rolls back with the table); a sliding drafter layer reads the rows of
the ``min(past, window - 1)`` tokens before its step's, oldest first, then its step's own states: the rows and
order the target's sliding layers read from their rings, so the masks transformers' IO builder made for the
target's sliding layers fit (:meth:`DraftPagedView.rows`).

Threading: the engine's thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from umalloc import InvariantError, UmallocValueError
from umalloc.integrations.transformers.groups import FULL_ATTENTION, SENTINEL_ROW, SLIDING_ATTENTION, EndGroup
from umalloc.integrations.transformers.options import UnsupportedCacheError


class TokenProposer(Protocol):
    """A drafter without KV: proposes from token ids alone."""

    def propose(self, request_id: str, last: int, k: int) -> list[int]:
        """Up to ``k`` draft tokens after ``last`` (the request's last emitted token)."""
        ...

    def accepted(self, request_id: str, props: list[int], n_acc: int, emitted: list[int]) -> None:
        """The round's outcome: ``n_acc`` of ``props`` accepted, ``emitted`` the tokens the request took."""
        ...


class DraftPagedView:
    """The paged cache the drafter's attention reads and writes: K/V rows of the cache's ``draft`` end (Note
    [Draft end]). Built by :func:`draft_view` with transformers' ``PagedAttentionCache`` as a second base, for
    sdpa's ``isinstance`` test only (as the cache itself, Note [Seams] 9 of the cache module).

    Args:
        cache: the umalloc cache. layer_types: the drafter's attention type per layer (its ``draft`` end layers,
            in order). num_kv_heads, head_dim: its KV geometry. window: the sliding window (tokens) of its sliding
            layers, None without.
    """

    def __init__(self, cache: Any, layer_types: list[str], num_kv_heads: int, head_dim: int,
                 window: int | None = None) -> None:
        layers = list(range(len(layer_types)))
        self.layer_types = list(layer_types)
        self.window = window
        # one row view of the end per attention type: the same rows, a full or a sliding update (Note [Draft end])
        self.groups = {FULL_ATTENTION: EndGroup(cache, 0, FULL_ATTENTION, "draft", cache.table, layers,
                                                num_kv_heads, head_dim, None)}
        if window is not None:
            self.groups[SLIDING_ATTENTION] = EndGroup(cache, 1, SLIDING_ATTENTION, "draft", cache.table, layers,
                                                      num_kv_heads, head_dim, window)
        self.group = self.groups[FULL_ATTENTION]

    def rows(self, slot: int, past_length: int, query_length: int) -> tuple[list[int], list[int], list[int]]:
        """(full read rows, sliding read rows, write rows) of request ``slot`` on the ``draft`` end: a full layer
        reads tokens ``[0, past + query)``, a sliding one the ``min(past, window - 1)`` tokens before ``past`` then
        one ``SENTINEL_ROW`` per new token; both write ``[past, past + query)``. Computed from the tables every
        call (nothing kept)."""
        full = self.group.read_rows(slot, past_length, query_length, keep=False)
        m = past_length if self.window is None else min(past_length, self.window - 1)
        sliding = full[past_length - m: past_length] + [SENTINEL_ROW] * query_length
        return full, sliding, full[past_length: past_length + query_length]

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' per-layer cache call (``[1, kv_heads, q, head_dim]`` in, ``[1, kv_heads, read,
        head_dim]`` out), on the drafter's rows of the layer's attention type."""
        lt = self.layer_types[layer_idx]
        grp = self.groups[lt]
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][lt].to(torch.int32)
        kwargs["max_length_k"] = kwargs["max_length_k"][lt]
        k, v = (x.squeeze(0).transpose(0, 1) for x in (key_states, value_states))
        k, v = grp.update(k, v, layer_idx, kwargs["read_index"][grp.index], kwargs["write_index"][grp.index])
        return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)


def draft_view(cache: Any, drafter_config: Any) -> DraftPagedView:
    """A :class:`DraftPagedView` of ``cache``'s ``draft`` end for a drafter of ``drafter_config``.

    Raises:
        UnsupportedCacheError: the cache has no ``draft`` end, or one of another layer count or KV geometry.
    """
    from transformers.generation.continuous_batching import cache as cb_cache

    from umalloc.integrations.transformers.options import text_config_dims

    ends = {e.name: e for e in cache.arena.spec.ends}
    n = int(drafter_config.num_hidden_layers)
    heads, dim, groups, window = text_config_dims(drafter_config, cache.dtype)
    d = ends.get("draft")
    if d is None or len(d.layers) != n or d.layers[0].num_kv_heads != heads or d.layers[0].head_dim_k != dim:
        raise UnsupportedCacheError(f"the cache has no draft end of {n} layers x {heads} KV heads x {dim} dims "
                                    "(CacheOptions.draft_layers)")
    types = [FULL_ATTENTION] * n   # per drafter layer (a config may list types past its layers: unused)
    for lt, layers in groups.items():
        for i in layers:
            if i < n:
                types[i] = lt
    window = window if SLIDING_ATTENTION in types else None
    if window is not None and window != cache.window:   # its sliding reads use the masks of the target's
        raise UnsupportedCacheError(f"the drafter's sliding window {window} differs from the model's "
                                    f"{cache.window}; allowed the target's own layers")
    cls = type("UmallocDraftPagedView", (DraftPagedView, cb_cache.PagedAttentionCache), {})
    view: DraftPagedView = cls(cache, types, heads, dim, window)
    return view


@dataclass
class _Item:
    """One request in a round: its state, id, slot, cached tokens ``past``, last token, ``k`` and proposals."""

    state: Any
    rid: str
    slot: int
    past: int
    last: int
    k: int
    props: list[int] = field(default_factory=list)


def _forward(engine: Any, model: Any, entries: list[tuple[str, int, list[int]]],
             view: DraftPagedView | None = None) -> list[list[int]]:
    """One paged forward of ``model`` over ``entries`` (request id, cached tokens, tokens to run) through
    transformers' IO builder (Note [Verify seam]); with ``view``, on the ``draft`` end's rows. Returns each
    entry's greedy token at every position of its tokens."""
    from transformers.generation.continuous_batching.requests import FutureRequestState, RequestState

    p = engine.processor
    io = p.inputs_and_outputs
    futures = []
    for rid, past, toks in entries:
        st = RequestState(request_id=rid, initial_tokens=[])   # scratch: the builder advances its offset
        st.position_offset = past
        st.tokens_to_process = list(toks)
        futures.append(FutureRequestState(st, True, {}, len(toks)))
    q = sum(len(t) for _, _, t in entries)
    io.prepare_batch_tensors(futures, p.logit_processor, False, q, sum(past for _, past, _ in entries),
                             use_padding=False)
    kw = io.get_model_kwargs(use_padding=False)
    if view is not None:
        full: list[int] = []
        sliding: list[int] = []
        write: list[int] = []
        c = engine.cache
        for rid, past, toks in entries:
            f, s, w = view.rows(c.slots[rid], past, len(toks))
            full += f
            sliding += s
            write += w
        dev = c.arena.device
        kw["read_index"] = [torch.tensor(x, dtype=torch.int64, device=dev) for x in (full, sliding)]
        kw["write_index"] = [torch.tensor(write, dtype=torch.int64, device=dev)] * 2
        kw["cache"] = view
    kw.pop("logits_to_keep", None)
    logits = model(**kw).logits[0, :q]
    best = logits.float().argmax(-1).tolist()
    out, at = [], 0
    for _, _, toks in entries:
        out.append(best[at: at + len(toks)])
        at += len(toks)
    return out


class EarlyExitDrafter:
    """The early-exit drafter in place: ``drafter`` (a transformers causal LM of the target's first layers,
    sdpa attention, owned by this object) reads and writes its K/V in the cache's ``draft`` end (Note [Draft
    end]). Its proposals for a batch are ``k`` batched forwards, one token per request each.

    Raises:
        UnsupportedCacheError: the cache's ``draft`` end does not fit the drafter (:func:`draft_view`).
    """

    def __init__(self, engine: Any, drafter: Any) -> None:
        self.engine, self.drafter = engine, drafter
        if drafter.config._attn_implementation != "sdpa":
            drafter.set_attn_implementation("sdpa")
        self.view = draft_view(engine.cache, drafter.config)

    def propose(self, items: list[_Item]) -> None:
        """Fill each item's ``props`` with ``k`` greedy drafter tokens. O(max k) forwards."""
        toks = {it.rid: it.last for it in items}
        for i in range(max((it.k for it in items), default=0)):
            run = [it for it in items if it.k > i]
            got = _forward(self.engine, self.drafter, [(it.rid, it.past + i, [toks[it.rid]]) for it in run],
                           self.view)
            for it, g in zip(run, got, strict=True):
                toks[it.rid] = int(g[0])
                it.props.append(toks[it.rid])

    def complete(self, items: list[_Item]) -> None:
        """Run the drafter on the last draft of the items whose every draft was accepted (its K/V at position
        ``past + k``). One forward."""
        if items:
            _forward(self.engine, self.drafter, [(it.rid, it.past + it.k, [it.props[-1]]) for it in items],
                     self.view)


@dataclass
class RoundFigures:
    """Per request id: drafts accepted in each round, in order (acceptance length: this + 1); counts."""

    per_round: dict[str, list[int]] = field(default_factory=dict)
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0


class SpeculativeDecoder:
    """Greedy speculative rounds over a :class:`~umalloc.integrations.transformers.admit.DecodeEngine`'s running
    requests (module docstring). Give exactly one of ``drafter`` (a model: :class:`EarlyExitDrafter`, the cache
    built with ``CacheOptions(draft_layers=...)`` of its layer count) and ``proposer`` (a :class:`TokenProposer`).

    Attributes:
        figures: :class:`RoundFigures`.

    Raises:
        UmallocValueError: ``draft_tokens`` < 1, or not exactly one of ``drafter`` / ``proposer``.
        UnsupportedCacheError: a model with sliding layers whose cache was built for rounds of fewer than
            ``draft_tokens`` drafts (``CacheOptions.speculative_tokens``), or a cache whose ``draft`` end does not
            fit the drafter.
    """

    def __init__(self, engine: Any, draft_tokens: int, *, drafter: Any = None,
                 proposer: TokenProposer | None = None) -> None:
        if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 1:
            raise UmallocValueError(f"draft_tokens={draft_tokens!r}: allowed an int >= 1")
        if (drafter is None) == (proposer is None):
            raise UmallocValueError("SpeculativeDecoder: allowed exactly one of drafter (a model) and proposer")
        c = engine.cache
        if c.window is not None and c.options.speculative_tokens < draft_tokens:
            raise UnsupportedCacheError(
                f"speculative decoding in place: the model has sliding layers and the cache's rings were built for "
                f"rounds of {c.options.speculative_tokens} drafts (ring of {c.ring_tokens} slots, window "
                f"{c.window}): a rejected draft of {draft_tokens} would overwrite a position still in the window; "
                f"allowed CacheOptions(speculative_tokens >= {draft_tokens}) (Note [Sliding ring])")
        self.engine, self.draft_tokens, self.proposer = engine, draft_tokens, proposer
        self.early_exit = EarlyExitDrafter(engine, drafter) if drafter is not None else None
        self.figures = RoundFigures()

    def step(self) -> bool:
        """One round over every running request (module docstring); ``False`` when none runs.

        Raises:
            InvariantError: no running request can grow by its round's tokens (the arena holds none of them).
        """
        from transformers.generation.continuous_batching.requests import RequestStatus

        e = self.engine
        cache = e.cache
        sched = e.processor.scheduler
        states = [s for s in sched.active_requests.values() if s.status == RequestStatus.DECODING]
        if not states:
            return False
        cache.pool.try_to_free_sectors()   # the cache's step hook, as the scheduler runs it every step
        items: list[_Item] = []
        # one forward holds at most the IO builder's tokens and requests: the requests past them sit the round out
        room = int(cache.max_batch_tokens)
        seats = int(getattr(e.processor.inputs_and_outputs, "max_requests_per_batch", room) or room)
        for s in states:
            k = min(self.draft_tokens, s.max_new_tokens - s.generated_len(), int(cache.max_batch_tokens) - 1)
            if k + 1 > room or len(items) == seats:
                continue
            if cache.can_store_request_tokens(s, k + 1):
                room -= k + 1
                items.append(_Item(s, s.request_id, cache.slots[s.request_id], s.position_offset,
                                   s.generated_tokens[-1], k))
        if not items:
            raise InvariantError(f"no room for a speculative round of any of {len(states)} running requests")
        with torch.no_grad():
            if self.early_exit is not None:
                self.early_exit.propose(items)
            else:
                assert self.proposer is not None
                for it in items:
                    it.props = [int(t) for t in self.proposer.propose(it.rid, it.last, it.k)][: it.k]
            want = _forward(e, e.model, [(it.rid, it.past, [it.last, *it.props]) for it in items])
            n_acc = []
            for it, w in zip(items, want, strict=True):
                n = 0
                while n < len(it.props) and it.props[n] == w[n]:
                    n += 1
                n_acc.append(n)
            if self.early_exit is not None:
                self.early_exit.complete([it for it, n in zip(items, n_acc, strict=True) if it.props and n == it.k])
        truncate_requests(cache, [it.rid for it in items], [it.past + 1 + n for it, n in zip(items, n_acc,
                                                                                             strict=True)])
        now = time.perf_counter()
        f = self.figures
        for it, w, n in zip(items, want, n_acc, strict=True):
            emitted = it.props[:n] + [int(w[n])]
            if self.proposer is not None:
                self.proposer.accepted(it.rid, it.props, n, emitted)
            f.per_round.setdefault(it.rid, []).append(n)
            f.proposed += len(it.props)
            f.accepted += n
            f.rounds += 1
            s = it.state
            room = s.max_new_tokens - s.generated_len()
            s.generated_tokens.extend(emitted[:room])
            if s.record_timestamps:
                s._timestamps.extend([now] * min(room, len(emitted)))
            s.position_offset = it.past + 1 + n
            s.tokens_to_process = [s.generated_tokens[-1]]
            if s.generated_len() >= s.max_new_tokens:
                s.status = RequestStatus.FINISHED
                sched.finish_request(it.rid)
        e.steps += 1
        e.step_requests.append(len(items))
        return True


def truncate_requests(cache: Any, request_ids: list[str], num_tokens: list[int]) -> None:
    """Roll requests back to ``num_tokens`` tokens each in ``cache``'s table (pages past them freed on every end,
    :meth:`~umalloc.requests.table.RequestTable.truncate`) and their sliding rings to ``min(num_tokens, R)``
    tokens (Note [Sliding ring] in :mod:`~umalloc.integrations.transformers.rings`); a request holding no more
    is left as is. One call per table. O(requests + dropped tokens).

    Raises:
        UmallocValueError: an id holding no pages.
    """
    with cache._timer:
        cache.growth.flush()
        slots, keep = [], []
        for rid, n in zip(request_ids, num_tokens, strict=True):
            slot = cache.slots.get(rid)
            if slot is None:
                raise UmallocValueError(f"truncate: request {rid!r} holds no pages")
            if cache.growth.held[slot] > n:
                slots.append(slot)
                keep.append(n)
        if not slots:
            return
        r = cache.ring_tokens
        cut = [(s, cache.growth.table_tokens(n)) for s, n in zip(slots, keep, strict=True)
               if cache.growth.table_tokens(n) < cache.growth.table_tokens(cache.growth.held[s])]
        if cut:
            cache.table.truncate(np.array([s for s, _ in cut], np.int64), np.array([n for _, n in cut], np.int64))
        rings = []
        if cache.ring_table is not None and r is not None:
            rings = [(cache.ring_slots[s], n) for s, n in zip(slots, keep, strict=True)
                     if n < min(cache.growth.held[s], r)]
            if rings:
                cache.ring_table.truncate(np.array([g for g, _ in rings], np.int64),
                                          np.array([n for _, n in rings], np.int64))
        for s, n in zip(slots, keep, strict=True):
            cache.growth.held[s] = n
        cache.growth.free_bytes_memo = None
        cache._forget_rows(slots, [g for g, _ in rings] + ([s for s, _ in cut] if not cache.has_full else []))


__all__ = ["DraftPagedView", "EarlyExitDrafter", "RoundFigures", "SpeculativeDecoder", "TokenProposer",
           "draft_view", "truncate_requests"]
