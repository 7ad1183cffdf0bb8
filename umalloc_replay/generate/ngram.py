"""The n-gram (prompt lookup) drafter of ``umalloc generate --draft --draft-method ngram``.

Policy:

* The drafter proposes from the request's own tokens (prompt, then every token emitted so far): for ``n`` from
  :data:`NGRAM_MAX_N` down to :data:`NGRAM_MIN_N`, the last ``n`` tokens are looked up among the earlier
  ``n``-grams of the context; at the first ``n`` with a match, the drafter copies up to ``k`` tokens that followed
  the **most recent** earlier occurrence (fewer when the context ends first). No match at any ``n``: no
  proposal, and the round is one plain target step (acceptance length 1).
* "Earlier" means an occurrence followed by at least one token: the occurrence starting at position ``j`` counts
  while ``j + n`` is below the context length, so the suffix never matches itself.
* :class:`NgramIndex` keeps, per ``n``, a dict from an ``n``-gram to its most recent start that has a follower,
  updated as tokens are appended: O(NGRAM_MAX_N) per token, O(NGRAM_MAX_N + k) per proposal.
* The drafter has no model and no KV: with it a run's arenas have no ``draft`` end and the plan no ``draft``
  vector. Its proposals are a function of the tokens alone, so once the speculative run's tokens equal the
  greedy reference, every round's acceptance is fixed too (the longest common prefix of the proposal and the
  reference's next tokens), and the acceptance-length check cannot fail while the token check passes.

Threading: an index belongs to one request on one thread. Units: tokens.
"""

from __future__ import annotations

from typing import Any

from umalloc import UmallocValueError

#: Longest and shortest n-gram the drafter looks up (longest first).
NGRAM_MAX_N = 3
NGRAM_MIN_N = 1
#: The drafters of ``--draft-method``: ``early-exit`` (the target's first layers, its KV on the plan) and
#: ``ngram`` (prompt lookup, no KV).
DRAFT_METHODS = ("early-exit", "ngram")


class NgramIndex:
    """Most-recent-occurrence index of a growing token context (module docstring).

    Args:
        tokens: the initial context (prompt ids, then any tokens already emitted).
        max_n, min_n: the n-gram sizes looked up, ``1 <= min_n <= max_n``.

    Raises:
        UmallocValueError: ``min_n`` or ``max_n`` out of range.
    """

    def __init__(self, tokens: list[int], max_n: int = NGRAM_MAX_N, min_n: int = NGRAM_MIN_N) -> None:
        if not 1 <= min_n <= max_n:
            raise UmallocValueError(f"n-gram sizes {min_n}..{max_n}: allowed 1 <= min_n <= max_n")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        #: n -> n-gram -> the latest start j whose n-gram has a follower (j + n < len(tokens))
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the context. O(len(tokens) * max_n)."""
        for t in tokens:
            p = len(self.tokens)  # t lands at position p: every n-gram ending at p - 1 gains a follower
            for n, last in self._last.items():
                if p >= n:
                    last[tuple(self.tokens[p - n: p])] = p - n
            self.tokens.append(int(t))

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest matching suffix
        (module docstring); ``[]`` when none matches or ``k`` is 0. O(max_n + k)."""
        if k <= 0:
            return []
        L = len(self.tokens)
        for n in range(self.max_n, self.min_n - 1, -1):
            if L < n:
                continue
            j = self._last[n].get(tuple(self.tokens[L - n:]))
            if j is not None:
                return self.tokens[j + n: j + n + k]
        return []


class NgramProposer:
    """The proposer of :func:`~umalloc_replay.generate.kv.speculative_decode` over an :class:`NgramIndex` of the
    request's prompt and its first token; the emitted tokens of every round join the context."""

    def __init__(self, prompt: list[int], first_token: int, max_n: int = NGRAM_MAX_N,
                 min_n: int = NGRAM_MIN_N) -> None:
        self.index = NgramIndex([*prompt, int(first_token)], max_n, min_n)

    def propose(self, last: int, k: int) -> list[int]:
        """Up to ``k`` tokens (``last`` is the context's last token already)."""
        return self.index.propose(k)

    def accepted(self, props: list[int], n_acc: int, emitted: list[int]) -> None:
        """Append the round's emitted tokens to the context."""
        self.index.extend(emitted)


def ngram_continue(model: Any, cache: Any, prompt: list[int], first_token: int, num_new_tokens: int,
                   draft_tokens: int) -> tuple[list[int], Any]:
    """Speculative greedy decoding with the n-gram drafter over ``cache`` (the target's KV of ``prompt``):
    ``num_new_tokens`` tokens from ``first_token`` and their
    :class:`~umalloc_replay.generate.kv.SpecFigures`. O(rounds) target forwards."""
    from umalloc_replay.generate.kv import speculative_decode

    return speculative_decode(model, cache, first_token, num_new_tokens, draft_tokens,
                              NgramProposer(prompt, first_token))


def reference_ngram(model: Any, geo: Any, prompt: list[int], num_new_tokens: int, draft_tokens: int,
                    page_size: int) -> tuple[list[int], Any]:
    """One process, no transfer: the target's prefill K/V into a cache as
    :func:`~umalloc_replay.generate.kv.reference_tokens` builds it, then :func:`ngram_continue`."""
    from umalloc_replay.generate.kv import cache_from_kv, prefill_kv, tail_start_tokens

    pre = prefill_kv(model, prompt)
    L = len(prompt)
    kv = {i: (pre.keys[i][:, tail_start_tokens(geo, i, L, page_size):],
              pre.values[i][:, tail_start_tokens(geo, i, L, page_size):]) for i in range(len(pre.keys))}
    return ngram_continue(model, cache_from_kv(model, geo, kv, L), prompt, pre.first_token, num_new_tokens,
                          draft_tokens)


__all__ = ["DRAFT_METHODS", "NGRAM_MAX_N", "NGRAM_MIN_N", "NgramIndex", "NgramProposer", "ngram_continue",
           "reference_ngram"]
