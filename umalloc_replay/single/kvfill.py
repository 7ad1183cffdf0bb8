"""Deterministic KV contents for the replay: fill pages (or single tokens) with a pattern and verify them.

Policy:

* The bytes of token position ``t`` of request ``r`` in layer ``l`` of end ``e`` are a pure function of
  ``(seed, e, r, t, l)`` and the byte offset inside the token's row, so any process (the prefill worker of a
  two-process backend included) that knows the arena spec and the seed writes, and any verifier recomputes,
  the same bytes. Nothing is stored to compare against.
* The function (Note [Pattern]) is a per-end random *table* of one page's words XORed with a per
  ``(request, page of the sequence, layer)`` 64-bit key (splitmix64). Every page of every request, every layer
  block and every row offset inside a page therefore gets different bytes; swapped pages, swapped layers,
  swapped tokens inside a page and stale bytes all show up as mismatches.
* Hot paths: on CPU arenas, page and token fills and verifies are compiled loops
  (:mod:`umalloc_replay.single.kvfill_kernels`: one write pass per fill, one read pass per verify, no expected buffer,
  one call per batch); on CUDA arenas, torch XORs written in place into the envelopes (one per layer block, or
  one per chunk of pages when the end's layers are uniform) and compared per chunk. Keys are computed in numpy
  ``uint64`` (``pages x layers`` of them, tiny). Torch batches are chunked to bound the temporary buffer.
* A page holds ``page_size`` consecutive positions of one sequence; :meth:`KVPattern.fill_pages` writes every
  slot of a page, including positions past the sequence's current end, so a partial last page is whole after
  prefill. The pattern is positional, so a later decode write of such a position writes the same bytes.

Note [Pattern]
~~~~~~~~~~~~~~
::

    word w of page (request r, sequence page s) of end e, w inside layer l's block (K rows then V rows):
        value(w) = T_e[w]  XOR  key(e, r, s, l)
    T_e      = page_words random words from PCG64(seed, e)   (the row offset / slot / K-vs-V dependence)
    key      = splitmix64 chain over (seed, e, r, s, l + 1)   (the request / position / layer dependence)
    token t sits in sequence page s = t // page_size at slot t % page_size.
    seed: the replay's --seed as 64 bits (umalloc_replay.seed64: itself in [0, 2**64), else hashed), so any int
    seed gives its own pattern.

Words are 8 bytes when every layer block and the page are multiples of 8 bytes (4, 2 or 1 otherwise).

Note [Token loop]
~~~~~~~~~~~~~~~~~
A decode step writes one token per request: on a row-uniform end that token's rows are the strided block
``envelopes.view(pages, layers, K/V, page_size, row)[page, :, :, slot, :]``. On CPU one compiled loop over the
batch writes (or compares) those blocks in place. On CUDA one ``bitwise_xor(table_tok[slot], key, out=that
block)`` per token is used: the fully vectorised form (gather the table rows, XOR, advanced-index scatter) ran at
0.2-0.9 GB/s on CPU against 2.5 GB/s for the per-token loop, its batch-sized temporaries being fresh allocations
whose page faults cost more than the copy; the per-token torch call in turn costs ~10 us, which the compiled loop
removes. Page fills work in place for the same reason, in :data:`CHUNK_BYTES` chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from umalloc import Arena, ArenaSpec, InvalidIdError, UmallocValueError
from umalloc.ids import host_ids
from umalloc.translators.runs import coalesce_runs
from umalloc_replay import seed64
from umalloc_replay.single import kvfill_kernels as _kernels

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_NP_WORD_DTYPES = {8: np.int64, 4: np.int32, 2: np.int16, 1: np.uint8}
#: Bytes one fill/verify chunk covers: small enough that the expected words stay in cache, so a fill is one
#: write pass over the arena and a verify one read pass.
CHUNK_BYTES = 1 << 20


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a ``uint64`` array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verify call.

    Attributes:
        checked_bytes: bytes compared.
        mismatched_pages: pages (page path) or tokens (token path) with at least one differing byte.
        mismatched_bytes: bytes that differ.
    """

    checked_bytes: int
    mismatched_pages: int = 0
    mismatched_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.mismatched_bytes == 0

    def __add__(self, other: VerifyResult) -> VerifyResult:
        return VerifyResult(self.checked_bytes + other.checked_bytes,
                            self.mismatched_pages + other.mismatched_pages,
                            self.mismatched_bytes + other.mismatched_bytes)


class _EndPattern:
    """Precomputed per-end pattern data (table, word geometry, per-slot token word offsets)."""

    def __init__(self, spec: ArenaSpec, end_index: int, seed: int) -> None:
        end = spec.ends[end_index]
        self.name = end.name
        self.page_size = end.page_size
        self.page_bytes = end.page_bytes
        blocks = []  # (start_byte, stop_byte) per layer: its K block then its V block
        offs = end.layer_offsets_bytes
        for i, (k_off, _v_off) in enumerate(offs):
            stop = offs[i + 1][0] if i + 1 < len(offs) else end.page_bytes
            blocks.append((k_off, stop))
        align = 0
        for a, b in blocks:
            align = math.gcd(align, a)
            align = math.gcd(align, b)
        # every token row (K or V) must also be word aligned for the token path
        for layer in end.layers:
            align = math.gcd(align, layer.k_token_bytes)
            if layer.v_token_bytes:
                align = math.gcd(align, layer.v_token_bytes)
        self.word_bytes = next(w for w in (8, 4, 2, 1) if align % w == 0)
        wb = self.word_bytes
        self.dtype = _WORD_DTYPES[wb]
        self.page_words = end.page_bytes // wb
        self.num_layers = len(end.layers)
        self.blocks_words = [(a // wb, b // wb) for a, b in blocks]
        #: layer l's words are [bounds[l], bounds[l + 1]) of a page (the compiled verify's block table)
        self.bounds = np.array([a for a, _ in self.blocks_words] + [self.page_words], dtype=np.int64)
        sizes = {b - a for a, b in self.blocks_words}
        self.uniform = len(sizes) == 1 and self.blocks_words[0][0] == 0
        rng = np.random.Generator(np.random.PCG64([seed64(seed), end_index]))
        table = rng.integers(0, 1 << 63, size=self.page_words, dtype=np.int64, endpoint=False)
        if wb != 8:
            table = table.astype(_NP_WORD_DTYPES[wb], casting="unsafe")
        self.table = torch.from_numpy(np.ascontiguousarray(table))
        end_key = int(_mix64(np.array([end_index + 1], dtype=np.uint64))[0])
        self.base_key = int(_mix64(np.array([seed64(seed) ^ end_key], dtype=np.uint64))[0])
        # Token path. Row-uniform ends (every layer has the same K row and V row width, V equal to K or absent)
        # view their envelopes as (pages, layers, rows, page_size, row_words): one token is [:, :, :, slot, :].
        rows = {(x.k_token_bytes, x.v_token_bytes) for x in end.layers}
        self.row_shape: tuple[int, int, int] | None = None
        self.table_tok: torch.Tensor | None = None
        if self.uniform and len(rows) == 1:
            ((kb, vb),) = rows
            if vb in (0, kb) and kb % wb == 0:
                nr = 1 if vb == 0 else 2
                self.row_shape = (self.num_layers, nr, kb // wb)
                t5 = self.table.view(self.num_layers, nr, self.page_size, kb // wb)
                self.table_tok = t5.permute(2, 0, 1, 3).contiguous()   # (page_size, layers, rows, row_words)
        # Generic token path: per slot, the word offsets of that token's rows inside a page, and their layers.
        per_word = []
        word_layer = []
        row_len = []
        for li, layer in enumerate(end.layers):
            k_off, v_off = offs[li]
            for off_b, row_b in ((k_off, layer.k_token_bytes), (v_off, layer.v_token_bytes)):
                if row_b == 0:
                    continue
                n = row_b // wb
                per_word.append(np.arange(n, dtype=np.int64) + off_b // wb)
                word_layer.append(np.full(n, li, dtype=np.int64))
                row_len.append(np.full(n, n, dtype=np.int64))
        self.entry_words = sum(len(x) for x in per_word)
        self._generic = (np.concatenate(per_word), np.concatenate(row_len), np.concatenate(word_layer))
        self._slot_offsets: torch.Tensor | None = None

    def slot_offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Generic token path: ``(page_size, entry_words)`` int64 word offsets of each slot's rows inside a page
        and the ``(entry_words,)`` layer of each of those words (built lazily, cached)."""
        base, row_len, layers = self._generic
        if self._slot_offsets is None:
            slots = np.arange(self.page_size, dtype=np.int64)[:, None]
            self._slot_offsets = torch.from_numpy(base[None, :] + slots * row_len[None, :])
        return self._slot_offsets, torch.from_numpy(layers)


class KVPattern:
    """The deterministic KV pattern of every end of one arena geometry (Note [Pattern]).

    Args:
        spec: the arena spec (both sides of a transfer share its ends' geometry; ``arena_bytes`` is unused).
        seed: pattern seed (int; the replay's ``--seed``).

    >>> from umalloc.geometry.spec import EndSpec, LayerSpec
    >>> spec = ArenaSpec((EndSpec("full", (LayerSpec.mha(1, 4),) * 2, page_size=2),), arena_bytes=1024)
    >>> arena = Arena(spec)
    >>> pat = KVPattern(spec, seed=7)
    >>> pat.fill_pages(arena, "full", 3, torch.tensor([0, 1]), torch.tensor([5, 2]))
    128
    >>> pat.verify_pages(arena, "full", 3, torch.tensor([0, 1]), torch.tensor([5, 2])).ok
    True
    >>> pat.verify_pages(arena, "full", 4, torch.tensor([0, 1]), torch.tensor([5, 2])).mismatched_pages
    2
    """

    def __init__(self, spec: ArenaSpec, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise UmallocValueError(f"seed={seed!r}: allowed an int")
        self.spec = spec
        self.seed = seed
        self._ends = {e.name: _EndPattern(spec, i, seed) for i, e in enumerate(spec.ends)}

    def _end(self, end: str) -> _EndPattern:
        try:
            return self._ends[end]
        except KeyError:
            raise UmallocValueError(f"end {end!r}: allowed one of {sorted(self._ends)}") from None

    # ---- keys ------------------------------------------------------------------------------------------
    def page_keys(self, end: str, request_ids: np.ndarray | int, seq_pages: np.ndarray) -> np.ndarray:
        """Keys of ``(request, sequence page, layer)``: ``int64 (len(seq_pages), num_layers)`` (the uint64 bit
        pattern). ``request_ids``: an int or int64 ``(len(seq_pages),)``. O(pages x layers)."""
        ep = self._end(end)
        sp = np.asarray(seq_pages, dtype=np.int64).astype(np.uint64)
        r = np.broadcast_to(np.asarray(request_ids, dtype=np.int64), sp.shape).astype(np.uint64)
        h = _mix64(np.uint64(ep.base_key) ^ (r * np.uint64(0xD1B54A32D192ED03)))
        h = _mix64(h ^ (sp * np.uint64(0x8CB92BA72F3D8DD7)))
        lay = np.arange(1, ep.num_layers + 1, dtype=np.uint64) * np.uint64(0xA24BAED4963EE407)
        k = _mix64(h[:, None] ^ lay[None, :])
        return k.view(np.int64)

    def _keys_torch(self, ep: _EndPattern, request_id: int, seq_pages: np.ndarray) -> torch.Tensor:
        k = self.page_keys(ep.name, request_id, seq_pages)
        if ep.word_bytes != 8:
            k = k.astype(_NP_WORD_DTYPES[ep.word_bytes], casting="unsafe")
        return torch.from_numpy(np.ascontiguousarray(k))

    # ---- page path -------------------------------------------------------------------------------------
    def expected_pages(self, end: str, request_id: int, seq_pages: torch.Tensor | np.ndarray,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Expected words of whole pages: ``(len(seq_pages), page_words)`` of the end's word dtype (CPU).

        ``seq_pages`` are page indices inside the sequence (position // page_size), int64. O(pages x page_bytes).
        """
        ep = self._end(end)
        sp = host_ids(seq_pages, "seq_pages", accept="int64")
        n = len(sp)
        if out is None:
            out = torch.empty((n, ep.page_words), dtype=ep.dtype)
        keys = self._keys_torch(ep, request_id, sp)
        if ep.uniform:
            nl = ep.num_layers
            torch.bitwise_xor(ep.table.view(1, nl, -1), keys.view(n, nl, 1), out=out.view(n, nl, -1))
        else:
            for li, (a, b) in enumerate(ep.blocks_words):
                torch.bitwise_xor(ep.table[a:b].unsqueeze(0), keys[:, li:li + 1], out=out[:, a:b])
        return out

    def _env_words(self, arena: Arena, ep: _EndPattern) -> torch.Tensor:
        env = arena.envelopes(ep.name)
        return env.view(ep.dtype) if ep.word_bytes != 1 else env

    @staticmethod
    def _chunks(ep: _EndPattern, n: int) -> list[tuple[int, int, int, int]]:
        """``(page offset, page count, layer lo, layer hi)`` chunks of about :data:`CHUNK_BYTES` covering ``n``
        pages (several pages per chunk when pages are small; layer groups of one page when they are large and
        the end is uniform)."""
        nl = ep.num_layers
        if ep.page_bytes <= CHUNK_BYTES or not ep.uniform:
            k = max(1, CHUNK_BYTES // ep.page_bytes)
            return [(i, min(k, n - i), 0, nl) for i in range(0, n, k)]
        lk = max(1, nl * CHUNK_BYTES // ep.page_bytes)
        return [(i, 1, l0, min(nl, l0 + lk)) for i in range(n) for l0 in range(0, nl, lk)]

    @staticmethod
    def _table(ep: _EndPattern, device: torch.device, name: str = "table") -> torch.Tensor:
        """``ep.<name>`` (``table`` or ``table_tok``) on ``device``; copies to other devices are cached."""
        host = getattr(ep, name)
        assert host is not None
        if device.type == "cpu":
            return host
        cached = ep.__dict__.setdefault("_dev_" + name, {})
        if device not in cached:
            cached[device] = host.to(device)
        return cached[device]

    def _run_chunks(self, arena: Arena, ep: _EndPattern, request_id: int, sp: np.ndarray, pp: torch.Tensor):
        """Yield ``(dst, expected_fn)`` per chunk: ``dst`` the arena words of the chunk, ``expected_fn(out)`` writes
        the expected words of the chunk into ``out`` (a tensor shaped like ``dst``)."""
        env = self._env_words(arena, ep)
        dev = env.device
        table = self._table(ep, dev)
        nl = ep.num_layers
        # runs of ascending pages: the library's coalescing of the pairs (position in sp, page)
        for j, p0, n in coalesce_runs(np.arange(pp.shape[0]), pp.numpy()).tolist():
            keys = self._keys_torch(ep, request_id, sp[j:j + n]).to(dev)   # (n, nl)
            if ep.uniform:
                run = env[p0:p0 + n].view(n, nl, -1)
                t3 = table.view(1, nl, -1)
                for i, c, l0, l1 in self._chunks(ep, n):
                    k = keys[i:i + c, l0:l1, None]
                    t = t3[:, l0:l1]
                    yield run[i:i + c, l0:l1], (lambda out, t=t, k=k: torch.bitwise_xor(t, k, out=out))
            else:
                run = env[p0:p0 + n]
                for i, c, _l0, _l1 in self._chunks(ep, n):
                    k = keys[i:i + c]

                    def exp(out: torch.Tensor, k: torch.Tensor = k) -> None:
                        for li, (a, b) in enumerate(ep.blocks_words):
                            torch.bitwise_xor(table[a:b].unsqueeze(0), k[:, li:li + 1], out=out[:, a:b])

                    yield run[i:i + c], exp

    def fill_pages(self, arena: Arena, end: str, request_id: int, seq_pages: torch.Tensor | np.ndarray,
                   ppages: torch.Tensor | np.ndarray) -> int:
        """Write the pattern of sequence pages ``seq_pages`` of ``request_id`` into physical pages ``ppages`` of
        ``end`` (whole envelopes, every slot). Returns bytes written.

        Args:
            arena: the arena holding ``end`` (CPU or CUDA).
            seq_pages, ppages: int64 ``(n,)``; ``ppages`` inside ``[first_page, top_page]`` (the sink and the
                reserved floor are never written).

        Raises:
            InvalidIdError: shapes differ or a physical page is out of range (nothing written).

        Complexity: O(n x page_bytes): one write pass over the pages, in cache-sized chunks written in place.
        """
        ep = self._end(end)
        sp = host_ids(seq_pages, "seq_pages", accept="int64")
        pp = self._check_ppages(arena, ep, ppages, len(sp))
        env = self._env_words(arena, ep)
        if env.device.type == "cpu":
            _kernels.fill_pages(env.numpy(), pp.numpy(), ep.table.numpy(),
                                self._keys_torch(ep, request_id, sp).numpy(), ep.bounds)
            return len(sp) * ep.page_bytes
        for dst, exp in self._run_chunks(arena, ep, request_id, sp, pp):
            exp(dst)
        return len(sp) * ep.page_bytes

    def verify_pages(self, arena: Arena, end: str, request_id: int, seq_pages: torch.Tensor | np.ndarray,
                     ppages: torch.Tensor | np.ndarray) -> VerifyResult:
        """Compare physical pages ``ppages`` of ``end`` with the pattern of ``seq_pages`` of ``request_id``.

        Returns:
            :class:`VerifyResult` (``checked_bytes = n x page_bytes``; mismatches counted per page and byte).

        Raises:
            InvalidIdError: shapes differ or a physical page is out of range.

        Complexity: O(n x page_bytes): one read pass over the pages (expected words built per cache-sized chunk).
        """
        ep = self._end(end)
        sp = host_ids(seq_pages, "seq_pages", accept="int64")
        pp = self._check_ppages(arena, ep, ppages, len(sp))
        env = self._env_words(arena, ep)
        if env.device.type == "cpu":
            per_page = np.zeros(len(sp), dtype=np.int64)
            nbad = _kernels.verify_pages(env.numpy(), pp.numpy(), ep.table.numpy(),
                                         self._keys_torch(ep, request_id, sp).numpy(), ep.bounds, ep.word_bytes,
                                         per_page)
            return VerifyResult(len(sp) * ep.page_bytes, int(nbad), int(per_page.sum()))
        buf: torch.Tensor | None = None
        bad: dict[tuple[int, int], int] = {}
        for dst, exp in self._run_chunks(arena, ep, request_id, sp, pp):
            if buf is None or buf.numel() < dst.numel() or buf.device != dst.device:
                buf = torch.empty(max(dst.numel(), CHUNK_BYTES // ep.word_bytes), dtype=ep.dtype, device=dst.device)
            want = buf[: dst.numel()].view(dst.shape)
            exp(want)
            if torch.equal(want, dst):
                continue
            nb = (want.contiguous().view(torch.uint8).view(dst.shape[0], -1)
                  != dst.contiguous().view(torch.uint8).view(dst.shape[0], -1)).sum(dim=1).cpu()
            # chunks of one page may be layer groups: key the count by the page's address
            base = int(dst.data_ptr())
            for r in range(dst.shape[0]):
                if int(nb[r]):
                    page = (base - arena.base_ptr) // ep.page_bytes + r
                    bad[(page, 0)] = bad.get((page, 0), 0) + int(nb[r])
        return VerifyResult(len(sp) * ep.page_bytes, len(bad), sum(bad.values()))

    # ---- token path ------------------------------------------------------------------------------------
    def _token_keys(self, ep: _EndPattern, request_ids: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        k = self.page_keys(ep.name, request_ids, positions // ep.page_size)
        if ep.word_bytes != 8:
            k = k.astype(_NP_WORD_DTYPES[ep.word_bytes], casting="unsafe")
        return torch.from_numpy(np.ascontiguousarray(k))

    def expected_tokens(self, end: str, request_ids: np.ndarray | int, positions: np.ndarray) -> torch.Tensor:
        """Expected words of single tokens: ``(B, entry_words)`` of the end's word dtype, layer-major (layer 0
        K row, layer 0 V row, layer 1 K row, ...). ``request_ids`` is an int or int64 ``(B,)``.
        O(B x entry_bytes)."""
        ep = self._end(end)
        pos = host_ids(positions, "positions", accept="int64")
        rids = np.broadcast_to(np.asarray(request_ids, dtype=np.int64), pos.shape)
        keys = self._token_keys(ep, rids, pos)
        slots = torch.from_numpy(pos % ep.page_size)
        if ep.table_tok is not None:
            vals = ep.table_tok.index_select(0, slots) ^ keys[:, :, None, None]
            return vals.view(len(pos), -1)
        offs, word_layer = ep.slot_offsets()
        return ep.table[offs[slots]] ^ keys[:, word_layer]

    def _token_slots(self, ep: _EndPattern, positions: np.ndarray, ptokens: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        ps = ep.page_size
        slots = torch.from_numpy(positions % ps)
        if not torch.equal(slots, ptokens % ps):
            raise InvalidIdError("fill/verify tokens: a physical token's slot differs from its position's slot "
                                 f"(position % {ps} != ptoken % {ps})")
        return ptokens // ps, slots

    def _token_rows(self, arena: Arena, ep: _EndPattern, request_ids: np.ndarray | int, pos: np.ndarray,
                    pt: torch.Tensor):
        """Per token ``b``: ``(expected_fn, dst)``, where ``dst`` is the strided view of token ``b``'s rows in the
        arena and ``expected_fn(out)`` writes its expected words into ``out`` (shaped like ``dst``). Row-uniform
        ends only (Note [Token loop])."""
        assert ep.row_shape is not None
        pages, slots = self._token_slots(ep, pos, pt)
        env = self._env_words(arena, ep)
        dev = env.device
        nl, nr, rw = ep.row_shape
        env5 = env.view(env.shape[0], nl, nr, ep.page_size, rw)
        rids = np.broadcast_to(np.asarray(request_ids, dtype=np.int64), pos.shape)
        keys = self._token_keys(ep, rids, pos).to(dev)[:, :, None, None]
        table = self._table(ep, dev, "table_tok")
        for b, (pg, sl) in enumerate(zip(pages.tolist(), slots.tolist(), strict=True)):
            yield (lambda out, t=table[sl], k=keys[b]: torch.bitwise_xor(t, k, out=out)), env5[pg, :, :, sl, :]

    def _cpu_token_args(self, arena: Arena, ep: _EndPattern, request_ids: np.ndarray | int, pos: np.ndarray,
                        pt: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """Arguments of the compiled token loops (:mod:`umalloc_replay.single.kvfill_kernels`): ``(env5, pages, slots,
        table_tok, keys)`` as numpy views, or ``None`` when they do not apply (a CUDA arena or an end that is not
        row-uniform)."""
        env = self._env_words(arena, ep)
        if ep.row_shape is None or env.device.type != "cpu":
            return None
        pages, slots = self._token_slots(ep, pos, pt)
        nl, nr, rw = ep.row_shape
        env5 = env.view(env.shape[0], nl, nr, ep.page_size, rw).numpy()
        rids = np.broadcast_to(np.asarray(request_ids, dtype=np.int64), pos.shape)
        return (env5, pages.numpy(), slots.numpy(), ep.table_tok.numpy(),  # type: ignore[union-attr]
                self._token_keys(ep, rids, pos).numpy())

    def _token_words(self, arena: Arena, ep: _EndPattern, request_ids: np.ndarray | int, pos: np.ndarray,
                     pt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Generic token path: ``(arena words flattened, flat word indices (B, entry_words) on the arena's
        device, expected words (B, entry_words) on the CPU)``."""
        pages, slots = self._token_slots(ep, pos, pt)
        env = self._env_words(arena, ep).reshape(-1)
        offs, _ = ep.slot_offsets()
        flat = (pages.unsqueeze(1) * ep.page_words + offs[slots]).to(env.device)
        return env, flat, self.expected_tokens(ep.name, request_ids, pos)

    def fill_tokens(self, arena: Arena, end: str, request_ids: np.ndarray | int, positions: np.ndarray,
                    ptokens: torch.Tensor | np.ndarray) -> int:
        """Write the pattern of single tokens (every layer's K and V rows) of one or more requests.

        Args:
            arena: the arena holding ``end``.
            end: end name.
            request_ids: an int, or int64 ``(B,)`` (one per token).
            positions: int64 ``(B,)`` token positions inside their sequences.
            ptokens: int64 ``(B,)`` physical token ids of ``end`` (``ppage * page_size + slot``), with
                ``ptoken % page_size == position % page_size``; distinct.

        Returns: bytes written (``B x entry_bytes``).

        Raises:
            InvalidIdError: mismatched shapes/slots or a physical page out of ``[first_page, top_page]``.

        Complexity: O(B x entry_bytes): one XOR per token into its strided rows on row-uniform ends (Note [Token
        loop]); otherwise one gather of table rows, one XOR, one scatter.
        """
        ep = self._end(end)
        pos = host_ids(positions, "positions", accept="int64")
        pt = self._check_ptokens(arena, ep, ptokens, len(pos))
        if len(pos) == 0:
            return 0
        cpu = self._cpu_token_args(arena, ep, request_ids, pos, pt)
        if cpu is not None:
            _kernels.fill_tokens(*cpu)
        elif ep.row_shape is not None:
            for exp, dst in self._token_rows(arena, ep, request_ids, pos, pt):
                exp(dst)
        else:
            env, flat, vals = self._token_words(arena, ep, request_ids, pos, pt)
            env.index_copy_(0, flat.reshape(-1), vals.reshape(-1).to(env.device))
        return len(pos) * ep.entry_words * ep.word_bytes

    def verify_tokens(self, arena: Arena, end: str, request_ids: np.ndarray | int, positions: np.ndarray,
                      ptokens: torch.Tensor | np.ndarray) -> VerifyResult:
        """Compare single tokens (every layer's rows) with the pattern; ``mismatched_pages`` counts tokens here.
        Arguments as :meth:`fill_tokens`. O(B x entry_bytes)."""
        ep = self._end(end)
        pos = host_ids(positions, "positions", accept="int64")
        pt = self._check_ptokens(arena, ep, ptokens, len(pos))
        if len(pos) == 0:
            return VerifyResult(0)
        nbytes = len(pos) * ep.entry_words * ep.word_bytes
        cpu = self._cpu_token_args(arena, ep, request_ids, pos, pt)
        if cpu is not None:
            per_tok = np.zeros(len(pos), dtype=np.int64)
            nbad = _kernels.verify_tokens(*cpu, ep.word_bytes, per_tok)
            return VerifyResult(nbytes, int(nbad), int(per_tok.sum()))
        if ep.row_shape is not None:
            buf: torch.Tensor | None = None
            bad_tok = bad_bytes = 0
            for exp, got in self._token_rows(arena, ep, request_ids, pos, pt):
                if buf is None:
                    buf = torch.empty(got.shape, dtype=ep.dtype, device=got.device)
                exp(buf)
                if not torch.equal(buf, got):
                    bad_tok += 1
                    bad_bytes += int((buf.view(torch.uint8) != got.contiguous().view(torch.uint8)).sum())
            return VerifyResult(nbytes, bad_tok, bad_bytes)
        env, flat, vals = self._token_words(arena, ep, request_ids, pos, pt)
        got = env.index_select(0, flat.reshape(-1)).cpu().view(flat.shape)
        if torch.equal(got, vals):
            return VerifyResult(nbytes)
        diff = got.contiguous().view(torch.uint8).view(len(pos), -1) != vals.view(torch.uint8).view(len(pos), -1)
        bad_bytes_per_tok = diff.sum(dim=1)
        return VerifyResult(nbytes, int((bad_bytes_per_tok > 0).sum()), int(bad_bytes_per_tok.sum()))

    # ---- checks ----------------------------------------------------------------------------------------
    def _check_ppages(self, arena: Arena, ep: _EndPattern, ppages, n: int) -> torch.Tensor:
        pp = torch.from_numpy(host_ids(ppages, "ppages", accept="int64"))
        if pp.numel() != n:
            raise InvalidIdError(f"ppages: shape {tuple(pp.shape)}; allowed ({n},)")
        top = arena.top_page(ep.name)
        first = arena.first_page(ep.name)
        if n and (int(pp.min()) < first or int(pp.max()) > top):
            raise InvalidIdError(f"physical pages of end {ep.name!r}: allowed [{first}, {top}], got "
                                 f"[{int(pp.min())}, {int(pp.max())}]")
        return pp

    def _check_ptokens(self, arena: Arena, ep: _EndPattern, ptokens, n: int) -> torch.Tensor:
        pt = torch.from_numpy(host_ids(ptokens, "ptokens", accept="int64"))
        if pt.numel() != n:
            raise InvalidIdError(f"ptokens: shape {tuple(pt.shape)}; allowed ({n},)")
        if n:
            pages = torch.unique(pt // ep.page_size)
            self._check_ppages(arena, ep, pages, int(pages.numel()))
        return pt


__all__ = ["CHUNK_BYTES", "KVPattern", "VerifyResult"]
