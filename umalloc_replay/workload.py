"""Request lifecycle and footprints for the replay: what a request holds on each end, and the block table.

Policy:

* A request moves ``waiting -> transferring -> running -> (retracted -> running)* -> done``, strictly in trace
  order for admission (head of line: a request that does not fit makes the ones behind it wait too).
* Decode writes one token per step into the KV of every end; after ``output_tokens`` steps the request holds
  ``input_tokens + output_tokens`` tokens and finishes.
* Footprints follow the agreed SWA formula (:meth:`MultiEndedAllocator.swa_tail_start`, F19): an end whose every
  layer slides keeps the pages from ``floor_to_page(max(0, L - W))``; every other end keeps the whole sequence.
  Decode unbinds the SWA pages that left the window *before* it allocates the step's token, so an SWA end
  never holds more than ``cdiv(W, page_size) + 1`` pages of a request (``swa_pages_per_seq``).
* The block table (:class:`BlockTable`) is SGLang's ``req_to_token``: one row of virtual token ids per request
  slot (int64, ``-1`` unused), so decode gathers the whole batch's ``last_loc`` in one indexing op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from umalloc import ArenaSpec, EndRole, InvariantError, RetractedKV, UmallocValueError
from umalloc.geometry.spec import pages_for_tokens, swa_pages_per_seq, swa_tail_start
from umalloc_replay.trace import TraceRequest

WAITING = "waiting"
TRANSFERRING = "transferring"
RUNNING = "running"
RETRACTED = "retracted"
DONE = "done"


def first_kept_page(spec: ArenaSpec, end: str, seq_len: int) -> int:
    """First sequence page of ``end`` a request of ``seq_len`` tokens keeps (0 unless every layer slides)."""
    e = spec.end(end)
    w = e.window_tokens
    if w is None or e.role is not EndRole.SWA:
        return 0
    return swa_tail_start(seq_len, w, 0, e.page_size) // e.page_size


def pages_held(spec: ArenaSpec, end: str, seq_len: int) -> int:
    """Pages of ``end`` a request of ``seq_len`` tokens holds (whole sequence, or the SWA window tail).

    >>> from umalloc.geometry.presets import preset_arena_spec
    >>> spec = preset_arena_spec("gemma-3-12b-draft", 1 << 30, page_size=16)
    >>> pages_held(spec, "full", 1500), pages_held(spec, "swa", 1500), pages_held(spec, "draft", 1500)
    (94, 65, 94)
    """
    e = spec.end(end)
    return pages_for_tokens(seq_len, e.page_size) - first_kept_page(spec, end, seq_len)


def peak_pages(spec: ArenaSpec, end: str, input_tokens: int, output_tokens: int) -> int:
    """Most pages of ``end`` a request holds over its life on the decode side (prompt, then one token per step,
    SWA pages unbound before each step's allocation)."""
    e = spec.end(end)
    final = input_tokens + output_tokens
    full = pages_for_tokens(final, e.page_size)
    if e.window_tokens is None or e.role is not EndRole.SWA:
        return full
    return min(full, max(pages_held(spec, end, input_tokens), swa_pages_per_seq(e.window_tokens, e.page_size)))


@dataclass
class RequestState:
    """One request of the replay.

    Attributes:
        req: the trace request (scaled token counts).
        state: one of ``waiting``, ``transferring``, ``running``, ``retracted``, ``done``.
        slot: row of the :class:`BlockTable` while the request holds decode pages, else -1.
        seq_len: tokens in the decode KV (``input_tokens`` after the transfer, +1 per decode step).
        generated: decode steps done.
        swa_lo_page: per SWA end, the first sequence page still bound there (pages below it were unbound).
        retracted: the host copy while retracted.
        admitted_step: scheduler step of the (last) admission; retraction picks the newest.
    """

    req: TraceRequest
    state: str = WAITING
    slot: int = -1
    seq_len: int = 0
    generated: int = 0
    swa_lo_page: dict[str, int] = field(default_factory=dict)
    retracted: RetractedKV | None = None
    admitted_step: int = -1

    @property
    def rid(self) -> int:
        return self.req.request_id

    @property
    def finished(self) -> bool:
        return self.generated >= self.req.output_tokens


class BlockTable:
    """``req_to_token``: int64 ``(max_slots, max_tokens)`` virtual token ids per request slot (``-1`` unused).

    Raises:
        UmallocValueError: bad sizes; :class:`InvariantError` when no slot is free (the scheduler bounds the
            batch) or a row overflows.

    >>> bt = BlockTable(2, 4)
    >>> s = bt.acquire(); bt.write(s, 0, torch.tensor([8, 9])); bt.row(s, 2).tolist()
    [8, 9]
    """

    def __init__(self, max_slots: int, max_tokens: int) -> None:
        if max_slots < 1 or max_tokens < 1:
            raise UmallocValueError(f"BlockTable({max_slots}, {max_tokens}): allowed sizes >= 1")
        self.table = torch.full((max_slots, max_tokens), -1, dtype=torch.int64)
        self._free = list(range(max_slots - 1, -1, -1))

    def acquire(self) -> int:
        if not self._free:
            raise InvariantError("BlockTable: no free slot (the scheduler admits at most max_slots requests)")
        return self._free.pop()

    def release(self, slot: int) -> None:
        self.table[slot].fill_(-1)
        self._free.append(slot)

    def write(self, slot: int, start: int, vtokens: torch.Tensor) -> None:
        n = vtokens.numel()
        if start + n > self.table.shape[1]:
            raise InvariantError(f"BlockTable row {slot}: {start + n} tokens > {self.table.shape[1]}")
        self.table[slot, start:start + n] = vtokens

    def row(self, slot: int, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` virtual token ids of ``slot`` (a view)."""
        return self.table[slot, :num_tokens]

    def vpages(self, slot: int, page_size: int, page_lo: int, page_hi: int) -> torch.Tensor:
        """Virtual pages of sequence pages ``[page_lo, page_hi)`` (the first token of each page // page_size)."""
        toks = self.table[slot, page_lo * page_size: page_hi * page_size: page_size]
        if toks.numel() != page_hi - page_lo or bool((toks < 0).any()):
            raise InvariantError(f"BlockTable row {slot}: pages [{page_lo}, {page_hi}) not all allocated")
        return torch.div(toks, page_size, rounding_mode="floor")

    def gather(self, slots: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """``table[slots[i], positions[i]]`` for every i: int64 ``(B,)``."""
        return self.table[torch.from_numpy(slots), torch.from_numpy(positions)]


__all__ = ["DONE", "RETRACTED", "RUNNING", "TRANSFERRING", "WAITING", "BlockTable", "RequestState",
           "first_kept_page", "pages_held", "peak_pages", "swa_tail_start"]
