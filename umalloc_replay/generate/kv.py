"""A model's real KV on umalloc pages, computed by a prefill forward and written into arena pages (the prefill
side), and the one-process reference: the same KV in a transformers cache, continued greedily or speculatively.

Policy:

* :func:`prefill_kv` runs one forward over a prompt with a transformers ``DynamicCache`` whose sliding layers
  record their past, so every layer's K/V of every prompt token comes back (``[kv_heads, L, head_dim]``), with
  the first generated token (greedy).
* Pages hold the envelope layout of :mod:`umalloc.geometry.arena` (``kv_views``: ``(page, slot, head, dim)``);
  a sequence page ``j`` holds tokens ``[j * page_size, (j + 1) * page_size)``, slots past the prompt zero. The
  ``full`` end holds every page of the prompt, the ``swa`` end the window tail from
  ``swa_tail_start(L, W, 0, page_size)`` (the pages the transfer plan sends).
* :class:`ModelKV` is the prefill side's pattern (the ``fill_pages`` interface of
  :class:`~umalloc_replay.single.kvfill.KVPattern`, so the replay's prefill plumbing carries it) and records
  a blake2b digest of the envelopes it wrote per end (:func:`digest_pages`; the decode side digests the pages it
  received in place, :func:`~umalloc_replay.generate.inplace.received_digests`).
* :func:`cache_from_kv` builds the one-process reference's cache from a prefill's K/V (a full layer gets all
  ``L`` tokens, a sliding layer its window tail with ``L`` tokens seen): the oracle the decode side's tokens and
  acceptance are compared with. The decode side never builds one: it attends over the received pages in place.
* Faults (:data:`FAULTS`, tests only): ``swap_kv_heads`` writes KV heads 0 and 1 of the first full layer
  swapped; ``swa_tail_start`` writes the sliding tail one page early (sequence page ``j`` gets page ``j - 1``'s
  tokens); ``stale_draft`` leaves the drafter's KV unwritten (zeros: the pages' bytes before the drafter's
  forward). The digest covers what was written, so only the token check sees the first two; a stale draft
  cannot change the tokens (speculative verification keeps the target's output) and shows only as a different
  draft acceptance.

Threading: one thread per process. Units: tokens, bytes; tensors float32 on CPU.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from umalloc import Arena, ArenaSpec, InvariantError, UmallocValueError
from umalloc.geometry.spec import swa_tail_start
from umalloc_replay.generate.models import ModelGeometry, end_layers

#: The faults :class:`ModelKV` can write (module docstring).
FAULTS = ("swap_kv_heads", "swa_tail_start", "stale_draft")


@dataclass
class PrefillKV:
    """One prompt's prefill: the greedy first token and every layer's K and V, each ``[kv_heads, L, head_dim]``."""

    first_token: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def seq_len_tokens(self) -> int:
        return int(self.keys[0].shape[1])


def prefill_kv(model: Any, prompt: list[int]) -> PrefillKV:
    """Forward ``prompt`` once (module docstring). O(L^2) attention; no grad."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    layers: list[Any] = list(cache.layers)  # DynamicLayer / DynamicSlidingWindowLayer for these models
    for layer in layers:
        if layer.is_sliding:
            layer.activate_past_recording()
    with torch.no_grad():
        # the logits of the last position only, as transformers' generate() asks for them (the prompt's other
        # positions' logits are most of a small model's prefill: its vocabulary projection)
        out = model(input_ids=torch.tensor([prompt], dtype=torch.long), past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
    first = int(out.logits[0, -1].argmax())
    return PrefillKV(first, [la.keys[0].clone() for la in layers], [la.values[0].clone() for la in layers])


def tail_start_tokens(geo: ModelGeometry, layer: int, seq_len_tokens: int, page_size: int) -> int:
    """First token of ``layer`` a cache is built from: 0 for a full layer, the SWA window tail's start for a
    sliding one (umalloc's :func:`~umalloc.geometry.spec.swa_tail_start`, the tail the plan sends)."""
    if geo.layer_types[layer] != "sliding_attention":
        return 0
    assert geo.window_tokens is not None
    return swa_tail_start(seq_len_tokens, geo.window_tokens, 0, page_size)


def cache_from_kv(model: Any, geo: ModelGeometry, kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
                  seq_len_tokens: int) -> Any:
    """A ``DynamicCache`` holding ``kv[layer] = (k, v)`` (``[kv_heads, T, head_dim]``: the layer's tokens from
    :func:`tail_start_tokens` to ``seq_len_tokens``) as if the model had run ``seq_len_tokens`` tokens.

    Raises:
        UmallocValueError: a layer missing, or a full layer without all ``seq_len_tokens`` tokens.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    layers: list[Any] = list(cache.layers)
    for i, layer in enumerate(layers):
        if i not in kv:
            raise UmallocValueError(f"cache_from_kv: layer {i} has no K/V")
        k, v = kv[i]
        if not layer.is_sliding and k.shape[1] != seq_len_tokens:
            raise UmallocValueError(f"cache_from_kv: full layer {i} has {k.shape[1]} tokens, needs {seq_len_tokens}")
        layer.update(k[None].contiguous(), v[None].contiguous())
        if layer.is_sliding:
            layer.cumulative_length = seq_len_tokens
        layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
    return cache


def greedy_continue(model: Any, cache: Any, first_token: int, num_new_tokens: int) -> list[int]:
    """``num_new_tokens`` greedy tokens, the first being ``first_token`` (the prefill's), each later one from one
    forward of the previous token over ``cache`` (which grows). O(num_new_tokens) forwards."""
    out = [int(first_token)]
    tok = int(first_token)
    with torch.no_grad():
        for _ in range(num_new_tokens - 1):
            logits = model(input_ids=torch.tensor([[tok]], dtype=torch.long), past_key_values=cache,
                           use_cache=True).logits
            tok = int(logits[0, -1].argmax())
            out.append(tok)
    return out


def reference_tokens(model: Any, geo: ModelGeometry, prompt: list[int], num_new_tokens: int,
                     page_size: int) -> list[int]:
    """One process, no transfer: :func:`prefill_kv`, :func:`cache_from_kv` from its K/V, :func:`greedy_continue`."""
    pre = prefill_kv(model, prompt)
    L = len(prompt)
    kv = {}
    for i in range(len(pre.keys)):
        lo = tail_start_tokens(geo, i, L, page_size)
        kv[i] = (pre.keys[i][:, lo:], pre.values[i][:, lo:])
    return greedy_continue(model, cache_from_kv(model, geo, kv, L), pre.first_token, num_new_tokens)


def reference_speculative(model: Any, drafter: Any, geo: ModelGeometry, prompt: list[int], num_new_tokens: int,
                          draft_tokens: int, page_size: int) -> tuple[list[int], SpecFigures]:
    """One process, no transfer, speculative: both models' prefill K/V (:func:`prefill_kv`) into caches as
    :func:`reference_tokens` builds them, then :func:`speculative_continue`. Its per-round acceptance is what a PD
    run whose draft KV arrived intact must reproduce exactly."""
    from umalloc_replay.generate.models import geometry_of

    caches = []
    for m, g in ((model, geo), (drafter, geometry_of(drafter))):
        pre = prefill_kv(m, prompt)
        kv = {i: (pre.keys[i][:, tail_start_tokens(g, i, len(prompt), page_size):],
                  pre.values[i][:, tail_start_tokens(g, i, len(prompt), page_size):]) for i in range(len(pre.keys))}
        caches.append((pre.first_token, cache_from_kv(m, g, kv, len(prompt))))
    return speculative_continue(model, drafter, caches[0][1], caches[1][1], caches[0][0], num_new_tokens,
                                draft_tokens)


def _pages_of(x: torch.Tensor, lo_token: int, num_pages: int, page_size: int) -> torch.Tensor:
    """``x`` (``[heads, L, dim]``) tokens ``[lo_token, lo_token + num_pages * page_size)`` as
    ``[num_pages, page_size, heads, dim]``, zero past ``L`` and before 0."""
    h, L, d = x.shape
    out = torch.zeros(num_pages * page_size, h, d, dtype=x.dtype)
    a, b = max(0, lo_token), min(L, lo_token + num_pages * page_size)
    if b > a:
        out[a - lo_token: b - lo_token] = x[:, a:b].transpose(0, 1)
    return out.view(num_pages, page_size, h, d)


def digest_pages(arena: Arena, end: str, ppages: torch.Tensor) -> str:
    """blake2b (32 hex digits) of physical pages ``ppages``' envelopes on ``end``, in the order given. O(bytes)."""
    return hashlib.blake2b(arena.envelopes(end)[ppages].numpy().tobytes(), digest_size=16).hexdigest()



class ModelKV:
    """The prefill side's KV source: ``fill_pages`` writes a prompt's real KV (:func:`prefill_kv`, computed at
    the request's first call) into arena pages.

    Args:
        model, geo: the model and its geometry; spec: the arena spec (ends from
            :func:`~umalloc_replay.generate.models.arena_ends`).
        prompts: request id -> prompt token ids.
        fault: ``None`` or one of :data:`FAULTS`.

    Attributes:
        first_tokens: request id -> greedy first token; digests: request id -> {end: digest of the envelopes
            written, in sequence-page order}; prefill_s: seconds spent in prefill forwards.

    Raises:
        UmallocValueError: an unknown fault, or a request id without a prompt.
    """

    def __init__(self, model: Any, geo: ModelGeometry, spec: ArenaSpec, prompts: dict[int, list[int]],
                 fault: str | None = None, drafter: Any = None, *, late_draft: bool = False,
                 gate: Any = None) -> None:
        if fault is not None and fault not in FAULTS:
            raise UmallocValueError(f"fault {fault!r}: allowed None or one of {FAULTS}")
        if late_draft and drafter is None:
            raise UmallocValueError("late_draft: allowed with a drafter")
        self.model, self.geo, self.spec, self.fault, self.drafter = model, geo, spec, fault, drafter
        self.late_draft, self.gate = late_draft, gate
        self._late: dict[int, tuple[Arena, torch.Tensor, torch.Tensor]] = {}
        self.prompts = prompts
        self.layers = ends_of(geo, drafter)
        self.first_tokens: dict[int, int] = {}
        self.digests: dict[int, dict[str, str]] = {}
        self._kv: dict[int, dict[str, PrefillKV]] = {}
        self.prefill_s = 0.0

    def forward(self, request_id: int) -> tuple[dict[str, PrefillKV], float]:
        """The prefill forwards of ``request_id`` (the target's; the drafter's too unless ``late_draft``) and their
        seconds, changing nothing here: any thread may run it while another uses the arena (the models' weights
        are only read). :meth:`adopt` records the result. Raises :class:`UmallocValueError`: no prompt."""
        import time

        if request_id not in self.prompts:
            raise UmallocValueError(f"request {request_id}: no prompt")
        t0 = time.perf_counter()
        pre = {"target": prefill_kv(self.model, self.prompts[request_id])}
        if self.drafter is not None and not self.late_draft:
            pre["draft"] = prefill_kv(self.drafter, self.prompts[request_id])
        return pre, time.perf_counter() - t0

    def adopt(self, request_id: int, pre: dict[str, PrefillKV], seconds: float) -> None:
        """Record :meth:`forward`'s result for ``request_id``: :meth:`fill_pages` writes it without a forward."""
        self.prefill_s += seconds
        self._kv[request_id] = pre
        self.first_tokens[request_id] = pre["target"].first_token
        self.digests[request_id] = {}

    def _prefill(self, request_id: int) -> dict[str, PrefillKV]:
        if request_id not in self._kv:
            self.adopt(request_id, *self.forward(request_id))
        return self._kv[request_id]

    def fill_pages(self, arena: Arena, end: str, request_id: int, seq_pages: torch.Tensor | np.ndarray,
                   ppages: torch.Tensor | np.ndarray) -> int:
        """Write sequence pages ``seq_pages`` (ascending, contiguous) of ``request_id``'s KV on ``end`` into
        physical pages ``ppages`` (int64 ``(n,)``); returns bytes written (whole envelopes)."""
        source, layers = self.layers[end]
        sp = torch.as_tensor(np.asarray(seq_pages), dtype=torch.int64)
        pp = torch.as_tensor(np.asarray(ppages), dtype=torch.int64)
        if source == "draft" and self.late_draft:  # the drafter's forward runs later (write_late_draft)
            self._prefill(request_id)
            self._late[request_id] = (arena, sp, pp)
            return self._wrote(request_id, end, int(sp.numel()) * arena.page_bytes(end), digest=None)
        pre = self._prefill(request_id)[source]
        ps = self.spec.end(end).page_size
        n = int(sp.numel())
        lo = int(sp[0]) * ps if n else 0
        if end == "swa" and self.fault == "swa_tail_start":
            lo -= ps
        for i, layer in enumerate(layers):
            k, v = pre.keys[layer], pre.values[layer]
            if end == "draft" and self.fault == "stale_draft":
                k, v = torch.zeros_like(k), torch.zeros_like(v)
            if end == "full" and i == 0 and self.fault == "swap_kv_heads":
                k, v = k[[1, 0, *range(2, k.shape[0])]], v[[1, 0, *range(2, v.shape[0])]]
            kview, vview = arena.kv_views(end, i)
            kview[pp] = _pages_of(k, lo, n, ps)
            assert vview is not None
            vview[pp] = _pages_of(v, lo, n, ps)
        return self._wrote(request_id, end, n * arena.page_bytes(end), digest=digest_pages(arena, end, pp))

    def _wrote(self, request_id: int, end: str, nbytes: int, digest: str | None) -> int:
        """Record ``end`` of ``request_id`` as handled (``digest``: of what was written; ``None``: left to a
        later producer); once every end is, drop the prefill K/V and signal the target's producer."""
        got = self.digests[request_id]
        got[end] = digest  # type: ignore[assignment]
        if len(got) == len(self.layers):
            del self._kv[request_id]  # every end written (or left to the late drafter): the K/V is in the arena
            if self.gate is not None:
                self.gate.signal(str(request_id), "target")
        return nbytes

    def write_late_draft(self, request_id: int) -> list:
        """With ``late_draft``: run the drafter's forward for ``request_id`` now and write its KV into the draft
        pages recorded at fill time, then signal the ``draft`` producer at the gate; returns what that signal
        posted (the gate's deferred submissions). Raises :class:`UmallocValueError` for a request with no
        pending draft."""
        if request_id not in self._late:
            raise UmallocValueError(f"request {request_id}: no late draft pending")
        arena, sp, pp = self._late.pop(request_id)
        import time

        t0 = time.perf_counter()
        pre = prefill_kv(self.drafter, self.prompts[request_id])
        self.prefill_s += time.perf_counter() - t0
        ps = self.spec.end("draft").page_size
        lo = int(sp[0]) * ps if sp.numel() else 0
        for i, layer in enumerate(self.layers["draft"][1]):
            k, v = pre.keys[layer], pre.values[layer]
            if self.fault == "stale_draft":
                k, v = torch.zeros_like(k), torch.zeros_like(v)
            kview, vview = arena.kv_views("draft", i)
            assert vview is not None
            kview[pp] = _pages_of(k, lo, int(sp.numel()), ps)
            vview[pp] = _pages_of(v, lo, int(sp.numel()), ps)
        self.digests[request_id]["draft"] = digest_pages(arena, "draft", pp)
        return [] if self.gate is None else self.gate.signal(str(request_id), "draft")

    def outputs(self, request_ids: list[int]) -> dict[int, dict]:
        """``{rid: {"first_token", "digests"}}`` of written requests, forgotten here once returned."""
        return {rid: {"first_token": self.first_tokens.pop(rid), "digests": self.digests.pop(rid)}
                for rid in request_ids}


def ends_of(geo: ModelGeometry, drafter: Any = None) -> dict[str, tuple[str, list[int]]]:
    """End name -> (``"target"`` or ``"draft"``, that model's layers the end holds, in the end's order)."""
    out = {end: ("target", layers) for end, layers in end_layers(geo).items()}
    if drafter is not None:
        out["draft"] = ("draft", list(range(int(drafter.config.num_hidden_layers))))
    return out


KV = dict[int, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class SpecFigures:
    """Speculative decoding counts of one request: verification rounds, draft tokens proposed and accepted."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    #: drafts accepted in each verification round, in order (acceptance length of a round: this + 1)
    per_round: list[int] = field(default_factory=list)


class ModelProposer:
    """The proposer of an early-exit drafter model over its own cache ``draft_cache``: each round ``k`` greedy
    tokens, one drafter forward each; after verification its cache is cropped to the accepted tokens (the
    drafter, full attention only, crops plainly), or, all ``k`` accepted, run once more on the last proposal
    (the drafter never ran on it)."""

    def __init__(self, drafter: Any, draft_cache: Any) -> None:
        self.drafter, self.draft_cache = drafter, draft_cache

    def propose(self, last: int, k: int) -> list[int]:
        """``k`` greedy drafter tokens after ``last``. O(k) drafter forwards."""
        props: list[int] = []
        tok = last
        for _ in range(k):
            lg = self.drafter(input_ids=torch.tensor([[tok]]), past_key_values=self.draft_cache,
                              use_cache=True).logits
            tok = int(lg[0, -1].argmax())
            props.append(tok)
        return props

    def accepted(self, props: list[int], n_acc: int, emitted: list[int]) -> None:
        """Keep ``last`` and the ``n_acc`` accepted proposals in the drafter's cache."""
        k = len(props)
        if n_acc == k:  # every proposal accepted: the drafter never ran on its last one
            self.drafter(input_ids=torch.tensor([[props[-1]]]), past_key_values=self.draft_cache, use_cache=True)
        else:  # the drafter ran on `last` and props[:k-1]; keep `last` and the accepted ones
            self.draft_cache.crop(-(k - 1 - n_acc))


def speculative_decode(model: Any, cache: Any, first_token: int, num_new_tokens: int, draft_tokens: int,
                       proposer: Any) -> tuple[list[int], SpecFigures]:
    """Greedy speculative decoding: ``num_new_tokens`` tokens starting with ``first_token``, equal to
    :func:`greedy_continue`'s when the target's multi-token verification ranks tokens as its one-token steps do.

    Each round ``proposer.propose(last, k)`` returns up to ``k = min(draft_tokens, tokens still to emit)``
    proposals (none is allowed: the round is then one plain target step); the target scores the last token and
    the proposals in one forward over ``cache``; the longest prefix of proposals equal to the target's own greedy
    choices is accepted, plus the target's token after it; ``cache`` is cropped to the accepted tokens (its
    sliding layers record their past so the crop can roll them back) and ``proposer.accepted(props, n_acc,
    emitted)`` follows (``emitted``: the round's tokens). Every target forward is one round (acceptance length
    ``n_acc + 1``). O(rounds) target forwards plus the proposer's work."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()
    out = [int(first_token)]
    fig = SpecFigures()
    with torch.no_grad():
        while len(out) < num_new_tokens:
            k = min(draft_tokens, num_new_tokens - len(out))
            last = out[-1]
            props = [int(t) for t in proposer.propose(last, k)]
            if len(props) > k:
                raise InvariantError(f"proposer returned {len(props)} proposals for at most {k}")
            m = len(props)
            lg = model(input_ids=torch.tensor([[last, *props]]), past_key_values=cache, use_cache=True).logits
            want = lg[0].argmax(-1).tolist()
            n_acc = 0
            while n_acc < m and props[n_acc] == want[n_acc]:
                n_acc += 1
            emitted = props[:n_acc] + [int(want[n_acc])]
            out += emitted
            fig.rounds += 1
            fig.proposed += m
            fig.accepted += n_acc
            fig.per_round.append(n_acc)
            cache.crop(-(m - n_acc))  # keep `last` and the accepted proposals (crop(0) keeps all)
            proposer.accepted(props, n_acc, emitted)
    return out[:num_new_tokens], fig


def speculative_continue(model: Any, drafter: Any, cache: Any, draft_cache: Any, first_token: int,
                         num_new_tokens: int, draft_tokens: int) -> tuple[list[int], SpecFigures]:
    """:func:`speculative_decode` with an early-exit drafter model over ``draft_cache``
    (:class:`ModelProposer`): ``draft_tokens`` proposals every round; ``draft_cache``'s sliding layers record
    their past, as ``cache``'s do, so a rejected proposal's rows can be cropped. O(rounds) target forwards,
    O(tokens) drafter forwards."""
    for layer in draft_cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()
    return speculative_decode(model, cache, first_token, num_new_tokens, draft_tokens,
                              ModelProposer(drafter, draft_cache))


def first_difference(got: list[int], want: list[int]) -> int | None:
    """First position where two token lists differ (a length difference counts at the shorter's length), or
    ``None`` when equal."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


__all__ = ["FAULTS", "KV", "ModelKV", "ModelProposer", "PrefillKV", "SpecFigures", "cache_from_kv", "ends_of",
           "first_difference", "greedy_continue", "prefill_kv", "reference_speculative",
           "reference_tokens", "speculative_continue", "speculative_decode", "tail_start_tokens"]
