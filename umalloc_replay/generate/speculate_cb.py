"""The speculative decode side of ``umalloc generate --draft``: the integration's
:class:`~umalloc.integrations.transformers.speculate.SpeculativeDecoder` over the in-place decode engine, with
the early-exit drafter (its KV received into the decode arena's ``draft`` end) or the n-gram drafter (no KV).

Policy: the early-exit drafter is a copy of the run's drafter model (the decoder switches its copy's attention
to transformers' paged path); the n-gram drafter keeps one :class:`~umalloc_replay.generate.ngram.NgramIndex` per
request, seeded at its first round with the prompt and the prefill's first token (the round's last token),
extended by every round's emitted tokens.

Threading: the engine's thread.
"""

from __future__ import annotations

import copy
from typing import Any

from umalloc_replay.generate.ngram import NgramIndex


class NgramTokens:
    """The n-gram drafter as a :class:`~umalloc.integrations.transformers.speculate.TokenProposer` over the
    requests' prompts (``prompts``: request id -> prompt token ids)."""

    def __init__(self, prompts: dict[int, list[int]]) -> None:
        self.prompts = prompts
        self.index: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, last: int, k: int) -> list[int]:
        """Up to ``k`` tokens by prompt lookup (:meth:`NgramIndex.propose`). O(max n + k)."""
        idx = self.index.get(request_id)
        if idx is None:
            idx = self.index[request_id] = NgramIndex([*self.prompts[int(request_id)], int(last)])
        return idx.propose(k)

    def accepted(self, request_id: str, props: list[int], n_acc: int, emitted: list[int]) -> None:
        """Append the round's emitted tokens to the request's context."""
        self.index[request_id].extend(emitted)


def speculative_stepper(engine: Any, draft_tokens: int, drafter: Any, prompts: dict[int, list[int]]) -> Any:
    """A :class:`~umalloc.integrations.transformers.speculate.SpeculativeDecoder` over ``engine``: the early-exit
    ``drafter`` (a model; its copy runs in place) or, with ``drafter`` None, the n-gram drafter over ``prompts``."""
    from umalloc.integrations.transformers.speculate import SpeculativeDecoder

    if drafter is not None:
        return SpeculativeDecoder(engine, draft_tokens, drafter=copy.deepcopy(drafter))
    return SpeculativeDecoder(engine, draft_tokens, proposer=NgramTokens(prompts))


__all__ = ["NgramTokens", "speculative_stepper"]
