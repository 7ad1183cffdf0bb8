"""The prefix index of :class:`~umalloc.integrations.transformers.cache.UmallocPagedCache`: content hash of a full
page of tokens -> the virtual page holding its K/V, and back (Note [Seams] 7 there).

A page's hash chains its parent's (the page before it in the request), so equal hashes mean equal token prefixes.
The index holds no pages: the cache's request table does (held or cached); the index forgets a page when the table
evicts it (``on_evict``) or when its request is freed without caching. Hashes are chained blake2b digests, stable
across processes.

Threading: the scheduler's thread only, as the cache.

Note [Sliding prefix]
~~~~~~~~~~~~~~~~~~~~~
With sliding layers beside full ones, a prefix hit shares the full-attention pages through ``table`` (reference
counts, as without sliding layers) and gives the request a ring holding a live request's (the donor's) ring pages
of the prefix: shared copy-on-write, or copied when the ring is not whole pages (Note [Shared rings] in
:mod:`~umalloc.integrations.transformers.rings`), so no write into a ring slot ever reaches another request's
bytes. A hit of ``p`` tokens needs a donor holding the matched pages as its first ones whose ring still holds
positions ``[max(0, p - window), p)``: one holding at most ``R + max(0, p - window)`` tokens (``R`` its ring's
slots, Note [Sliding ring] in :mod:`~umalloc.integrations.transformers.rings`) (held, so including tokens
allocated for a forward not yet run; :func:`ring_donor`). The match is cut to the longest prefix a donor can give:
without speculation (``R`` = window) a prefix longer than the window is given only by a donor holding exactly that
prefix. No donor, no hit (the request prefills it all). Freed full-attention pages are not cached (no live ring
could give their window), so their hashes go with their last holder. The hit saves the prefix's forward (every
layer), its full-attention pages and, shared, its ``ceil(min(p, R) / page_size)`` ring pages
(``counters.ring_pages_shared``) until a ring's first write into them copies them (``counters.ring_cow_copies``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable, Sequence

from umalloc import InvariantError


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """A chained 64-bit content hash of one full page of tokens (blake2b of the parent's hash and the tokens)."""
    h = hashlib.blake2b(digest_size=8)
    if parent is not None:
        h.update(parent.to_bytes(8, "little", signed=False))
    h.update(array("i", tokens).tobytes())
    return int.from_bytes(h.digest(), "little", signed=False)


def ring_donor(matched: Sequence[int], holders: Iterable[tuple[int, int, Sequence[int]]], window: int,
               page_size: int, ring: int | None = None) -> tuple[int, int]:
    """The live request whose sliding ring still holds the K/V of the longest part of a matched prefix (Note
    [Sliding prefix]): ``(slot, pages)`` of the best of
    ``holders`` (``(slot, tokens held, its full-attention pages)``), ``(-1, 0)`` if none.

    A holder of ``held`` tokens whose first ``k`` pages are ``matched[:k]`` can give a prefix of ``p = k *
    page_size`` tokens when its ring (``ring`` slots, None: ``window``) still holds positions ``[max(0, p -
    window), p)`` unoverwritten, which holds when ``held <= ring + max(0, p - window)`` (a ring slot ``t % ring``
    is rewritten only by position ``t + ring``); a shorter part only lowers that bound, so the holder gives its
    whole match or nothing. O(holders * matched)."""
    r = window if ring is None else ring
    best, best_pages = -1, 0
    for slot, held, pages in holders:
        k = 0
        for a, b in zip(matched, pages, strict=False):
            if a != b:
                break
            k += 1
        if held > r + max(0, k * page_size - window):   # its ring rewrote part of the prefix's window
            k = 0
        if k > best_pages:
            best, best_pages = slot, k
    return best, best_pages


class PrefixIndex:
    """Content hash <-> virtual page, one-to-one.

    Attributes:
        hash_to_vpage / vpage_to_hash: the index (read them; change them through the methods).
    """

    def __init__(self) -> None:
        self.hash_to_vpage: dict[int, int] = {}
        self.vpage_to_hash: dict[int, int] = {}

    def match(self, prompt_ids: Sequence[int], page_size: int) -> list[int]:
        """The indexed pages of the longest indexed prefix of ``prompt_ids``, whole pages, never its last token.
        O(matched pages * page_size)."""
        matched: list[int] = []
        parent: int | None = None
        for b in range((len(prompt_ids) - 1) // page_size):
            parent = block_hash(parent, list(prompt_ids[b * page_size:(b + 1) * page_size]))
            vp = self.hash_to_vpage.get(parent)
            if vp is None:
                break
            matched.append(vp)
        return matched

    def complete(self, pages: list[int], tokens: Sequence[int], num_new: int, page_size: int,
                 share: Callable[[int, int], None]) -> int:
        """Index the first ``num_new`` full pages of a request (``pages``, its virtual pages, ``tokens`` its
        tokens) that have no hash yet; a page whose hash is already indexed under another page not in ``pages``
        is replaced by it: ``share(page_index, indexed_page)`` does the swap in the request table, and ``pages``
        is updated. Returns the pages replaced. O(pages + num_new * page_size)."""
        parent: int | None = None
        replaced = 0
        for i, vp in enumerate(pages):
            h = self.vpage_to_hash.get(vp)
            if h is None:
                chunk = tokens[i * page_size:(i + 1) * page_size]
                if num_new == 0 or len(chunk) < page_size:
                    break
                h = block_hash(parent, chunk)
                num_new -= 1
                indexed = self.hash_to_vpage.get(h)
                if indexed is None:
                    self.hash_to_vpage[h] = vp
                    self.vpage_to_hash[vp] = h
                elif indexed not in pages:
                    share(i, indexed)
                    pages[i] = indexed
                    replaced += 1
            parent = h
        return replaced

    def forget(self, vpages: Iterable[int]) -> None:
        """Drop these pages from the index (those not indexed are ignored). O(len(vpages))."""
        for vp in vpages:
            h = self.vpage_to_hash.pop(vp, None)
            if h is not None and self.hash_to_vpage.get(h) == vp:
                del self.hash_to_vpage[h]

    def clear(self) -> None:
        self.hash_to_vpage.clear()
        self.vpage_to_hash.clear()

    def check(self, kept: set[int]) -> None:
        """Raise :class:`~umalloc.errors.InvariantError` unless the index is one-to-one and every indexed page is
        in ``kept`` (the pages held or cached by the table). O(indexed pages)."""
        for vp, h in self.vpage_to_hash.items():
            if vp not in kept or self.hash_to_vpage.get(h) != vp:
                raise InvariantError(f"hash-index: virtual page {vp} is indexed but neither held nor cached, or its "
                                     "hash maps elsewhere")
        if len(self.hash_to_vpage) != len(self.vpage_to_hash):
            raise InvariantError("hash-index: hash -> page and page -> hash differ in size")


__all__ = ["PrefixIndex", "block_hash", "ring_donor"]
