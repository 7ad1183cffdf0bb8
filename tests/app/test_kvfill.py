"""The replay's deterministic KV pattern: exact bytes against a pure-Python brute force of Note [Pattern],
detection of corruption, token writes touching exactly one token's rows, and bad input changing nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from umalloc.errors import InvalidIdError
from umalloc.geometry.arena import Arena
from umalloc.geometry.spec import ArenaSpec, EndRole, EndSpec, Grow, LayerSpec
from umalloc_replay.single.kvfill import KVPattern

M64 = (1 << 64) - 1


def mix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def brute_key(seed: int, end_index: int, request: int, seq_page: int, layer: int) -> int:
    base = mix((seed & M64) ^ mix(end_index + 1))
    h = mix(base ^ ((request * 0xD1B54A32D192ED03) & M64))
    h = mix(h ^ ((seq_page * 0x8CB92BA72F3D8DD7) & M64))
    return mix(h ^ (((layer + 1) * 0xA24BAED4963EE407) & M64))


def brute_table(seed: int, end_index: int, page_words: int) -> list[int]:
    rng = np.random.Generator(np.random.PCG64([seed, end_index]))
    return [int(x) for x in rng.integers(0, 1 << 63, size=page_words, dtype=np.int64)]


def brute_page_bytes(spec: ArenaSpec, end_index: int, seed: int, request: int, seq_page: int) -> bytes:
    """Every byte of one page, word by word, from the documented formula (8-byte little-endian words)."""
    end = spec.ends[end_index]
    table = brute_table(seed, end_index, end.page_bytes // 8)
    offs = [k for k, _ in end.layer_offsets_bytes] + [end.page_bytes]
    out = bytearray()
    for w, t in enumerate(table):
        layer = max(i for i in range(len(end.layers)) if offs[i] <= w * 8)
        out += ((t ^ brute_key(seed, end_index, request, seq_page, layer)) & M64).to_bytes(8, "little")
    return bytes(out)


def small_spec() -> ArenaSpec:
    # full: 2 MHA layers, 1 head x 4 dims bf16 -> 8 B K row + 8 B V row per layer -> 32 B/token, 64 B pages
    full = EndSpec("full", (LayerSpec.mha(1, 4),) * 2, page_size=2)
    # swa: 1 sliding layer, 1 head x 8 dims -> 32 B/token
    swa = EndSpec("swa", (LayerSpec.mha(1, 8, window_tokens=4),), page_size=2, grow=Grow.DOWN, owner="full",
                  role=EndRole.SWA)
    # draft: mixed widths (not row-uniform): 4 dims then 8 dims -> generic token path
    draft = EndSpec("draft", (LayerSpec.mha(1, 4), LayerSpec.mha(1, 8)), page_size=2, grow=Grow.FLOAT,
                    owner="full", role=EndRole.DRAFT)
    return ArenaSpec((full, swa, draft), arena_bytes=64 * 40)


@pytest.mark.parametrize("end_index", [0, 1, 2])
def test_page_bytes_match_brute_force(end_index):
    spec = small_spec()
    name = spec.ends[end_index].name
    arena = Arena(spec)
    pat = KVPattern(spec, seed=11)
    first = spec.first_page(name)
    seq_pages = torch.tensor([0, 3, 1], dtype=torch.int64)
    ppages = torch.tensor([first + 4, first, first + 1], dtype=torch.int64)
    n = pat.fill_pages(arena, name, 5, seq_pages, ppages)
    pb = spec.end(name).page_bytes
    assert n == 3 * pb
    env = arena.envelopes(name)
    for s, p in zip(seq_pages.tolist(), ppages.tolist(), strict=True):
        assert bytes(env[p].numpy().tobytes()) == brute_page_bytes(spec, end_index, 11, 5, s)
    assert pat.verify_pages(arena, name, 5, seq_pages, ppages).ok


def test_token_fill_touches_exactly_one_token_and_matches_brute_force():
    spec = small_spec()
    pat = KVPattern(spec, seed=3)
    for end_index, end in enumerate(spec.ends):
        arena = Arena(spec)
        before = arena.data.clone()
        ps = end.page_size
        p = spec.first_page(end.name) + 2
        position = 7  # sequence page 3, slot 1
        pat.fill_tokens(arena, end.name, 9, np.array([position]), torch.tensor([p * ps + position % ps]))
        page = brute_page_bytes(spec, end_index, 3, 9, position // ps)
        changed = torch.nonzero(arena.data != before).flatten().tolist()
        # brute force: the byte offsets of token slot 1's K and V rows in every layer
        want = []
        for layer, (k_off, v_off) in zip(end.layers, end.layer_offsets_bytes, strict=True):
            for off, row in ((k_off, layer.k_token_bytes), (v_off, layer.v_token_bytes)):
                want += range(off + (position % ps) * row, off + (position % ps + 1) * row)
        got_bytes = arena.data.numpy().tobytes()
        base = p * end.page_bytes
        assert set(changed) <= {base + o for o in want}
        assert all(got_bytes[base + o] == page[o] for o in want)
        assert pat.verify_tokens(arena, end.name, 9, np.array([position]),
                                 torch.tensor([p * ps + position % ps])).ok


def test_tokens_of_many_requests_in_one_call():
    spec = small_spec()
    arena = Arena(spec)
    pat = KVPattern(spec, seed=1)
    ps = 2
    f = spec.first_page("full")
    rids = np.array([4, 5, 4], dtype=np.int64)
    pos = np.array([0, 3, 1], dtype=np.int64)
    pt = torch.tensor([f * ps, (f + 1) * ps + 1, f * ps + 1])
    pat.fill_tokens(arena, "full", rids, pos, pt)
    # request 4 filled positions 0 and 1 = its whole sequence page 0 in page f: equals the brute-force page
    assert arena.envelopes("full")[f].numpy().tobytes() == brute_page_bytes(spec, 0, 1, 4, 0)
    assert pat.verify_tokens(arena, "full", 5, np.array([3]), torch.tensor([(f + 1) * ps + 1])).ok
    assert not pat.verify_tokens(arena, "full", 4, np.array([3]), torch.tensor([(f + 1) * ps + 1])).ok


def test_corruption_is_detected_exactly():
    spec = small_spec()
    arena = Arena(spec)
    pat = KVPattern(spec, seed=0)
    f = spec.first_page("full")
    sp = torch.arange(4)
    pp = torch.arange(f, f + 4)
    pat.fill_pages(arena, "full", 1, sp, pp)
    pb = spec.end("full").page_bytes
    arena.data[(f + 2) * pb + 17] ^= 0xFF  # one byte of one page
    r = pat.verify_pages(arena, "full", 1, sp, pp)
    assert (r.mismatched_pages, r.mismatched_bytes, r.checked_bytes) == (1, 1, 4 * pb)
    arena.data[(f + 2) * pb + 17] ^= 0xFF
    # two pages swapped: both differ
    swapped = torch.tensor([f, f + 2, f + 1, f + 3])
    r = pat.verify_pages(arena, "full", 1, sp, swapped)
    assert r.mismatched_pages == 2
    # another request, another end's pattern, stale zeros: all differ
    assert pat.verify_pages(arena, "full", 2, sp, pp).mismatched_pages == 4
    assert pat.verify_pages(arena, "full", 1, sp, pp + 6).mismatched_pages == 4


def test_different_inputs_give_different_bytes():
    spec = small_spec()
    pat = KVPattern(spec, seed=0)
    pages = {}
    for r in (0, 1):
        for s in (0, 1):
            pages[(r, s)] = pat.expected_pages("full", r, np.array([s], dtype=np.int64)).numpy().tobytes()
    assert len(set(pages.values())) == 4
    other_seed = KVPattern(spec, seed=1).expected_pages("full", 0, np.array([0], dtype=np.int64))
    assert other_seed.numpy().tobytes() != pages[(0, 0)]
    # layers of one page differ (uniform end: layer 0 block vs layer 1 block)
    half = len(pages[(0, 0)]) // 2
    assert pages[(0, 0)][:half] != pages[(0, 0)][half:]


def test_any_seed_gives_its_own_pattern_and_64_bit_seeds_keep_the_formula():
    """The replay's ``--seed`` takes any int: a seed past 64 bits (or negative) gets a pattern of its own, not the
    one of the seed it equals modulo 2**64; a seed inside 64 bits keeps the documented formula."""
    spec = small_spec()
    page = np.array([0], dtype=np.int64)

    def first_page(seed: int) -> bytes:
        return KVPattern(spec, seed=seed).expected_pages("full", 0, page).numpy().tobytes()

    assert first_page(2**64 + 5) != first_page(5)
    assert first_page(-1) != first_page(2**64 - 1)
    assert first_page(10**40) != first_page(10**40 + 1)
    assert first_page(2**64 - 1) == brute_page_bytes(spec, 0, 2**64 - 1, 0, 0)


def test_bad_input_raises_and_writes_nothing():
    spec = small_spec()
    arena = Arena(spec)
    pat = KVPattern(spec, seed=0)
    before = arena.data.clone()
    f = spec.first_page("full")
    with pytest.raises(InvalidIdError):  # the sink / floor
        pat.fill_pages(arena, "full", 0, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(InvalidIdError):  # past the top
        pat.fill_pages(arena, "full", 0, torch.tensor([0]), torch.tensor([spec.top_page("full") + 1]))
    with pytest.raises(InvalidIdError):  # shapes differ
        pat.fill_pages(arena, "full", 0, torch.tensor([0, 1]), torch.tensor([f]))
    with pytest.raises(InvalidIdError):  # int32
        pat.fill_pages(arena, "full", 0, torch.tensor([0], dtype=torch.int32), torch.tensor([f]))
    with pytest.raises(InvalidIdError):  # slot of the physical token != slot of the position
        pat.fill_tokens(arena, "full", 0, np.array([1]), torch.tensor([f * 2]))
    assert torch.equal(arena.data, before)
