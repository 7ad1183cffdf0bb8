"""The main job, ``umalloc replay``: a real request trace through a prefill arena and a decode arena.

Modules: :mod:`~umalloc_replay.trace` (trace parsers), :mod:`~umalloc_replay.single.kvfill` (deterministic KV
pattern fill and verify), :mod:`~umalloc_replay.workload` (request lifecycle, footprints, block table),
:mod:`~umalloc_replay.single.prefill` (the prefill side in process, sequence allocation),
:mod:`~umalloc_replay.single.remote` (the prefill side in a second process), :mod:`~umalloc_replay.report` (JSON report
schema and the final table), :mod:`~umalloc_replay.plot` (occupancy plot), :mod:`~umalloc_replay.single.layouts`
(dynamic / static / padded decode layouts and their byte accounting), :mod:`~umalloc_replay.single.fit` (the up-front
fit check), :mod:`~umalloc_replay.preflight` (argument, path and memory checks), :mod:`~umalloc_replay.signals`
(Ctrl-C and the second process), :mod:`~umalloc_replay.single.kvfill_kernels` (compiled pattern loops),
:mod:`~umalloc_replay.single.run` (the driver and its scheduler). The multi-rank transfer replay (one process per TP /
DCP rank on each side, ``--prefill-tp`` / ``--decode-tp`` / ``--prefill-dcp`` / ``--decode-dcp`` /
``--prefill-page-size``): :mod:`~umalloc_replay.multirank.ranks` (orchestration), :mod:`~umalloc_replay.multirank.rankside` (what
each rank runs), :mod:`~umalloc_replay.multirank.headpattern` (the pattern by global head and logical position),
:mod:`~umalloc_replay.multirank.ranks_report` (its report and table). ``umalloc generate`` (a random-weight model's KV
from a prefill side to a decode side, tokens compared with one process): :mod:`~umalloc_replay.generate.models`
(the tiny models and their arena ends), :mod:`~umalloc_replay.generate.kv` (prefill KV on pages, the one-process
reference's greedy and speculative decoding), :mod:`~umalloc_replay.generate.inplace` (the decode side:
continuous batching over the received pages in place), :mod:`~umalloc_replay.generate.child` (the prefill process),
:mod:`~umalloc_replay.generate.run` (the driver, report and table). The console script is :mod:`umalloc_replay.cli`.
"""

#: ``umalloc replay`` with no arguments replays this many requests of the packaged trace ...
DEFAULT_REQUESTS = 96
#: ... with every token count divided by this (about two minutes on a 2-core CPU machine).
DEFAULT_TOKEN_SCALE = 8
#: The multi-rank replay's defaults: requests, token scale and the cap on every scaled prompt.
DEFAULT_RANK_REQUESTS = 4
DEFAULT_RANK_TOKEN_SCALE = 64
DEFAULT_MAX_PROMPT_TOKENS = 256

#: The model presets of :data:`umalloc.geometry.presets.PRESETS` by name, the default one and those with a drafter, spelled out
#: here so that ``umalloc --help`` and argument errors import no torch (``tests/app/test_cli_start_up.py``
#: checks them against :data:`umalloc.geometry.presets.PRESETS`).
PRESET_NAMES = ("deepseek-v3", "gemma-3-12b", "gemma-3-12b-draft", "gpt-oss-20b", "llama-3-8b-eagle", "llama-3.1-8b",
                "qwen3-8b", "qwen3-8b-draft")
DEFAULT_PRESET_NAME = "gemma-3-12b-draft"
PRESETS_WITH_DRAFT = ("deepseek-v3", "gemma-3-12b-draft", "llama-3-8b-eagle", "qwen3-8b-draft")
#: Where a drafter's sliding-window layers may live (:data:`umalloc.geometry.presets.DRAFT_SLIDING`, spelled out
#: for the same reason), the first the default.
DRAFT_SLIDING = ("swa", "own", "draft")

#: ``umalloc generate``'s model names (:mod:`umalloc_replay.generate.models`), its default slice and scales:
#: the first DEFAULT_GENERATE_REQUESTS rows, prompts divided by DEFAULT_GENERATE_TOKEN_SCALE, outputs by
#: DEFAULT_GENERATE_OUTPUT_SCALE (seconds on a 2-core machine).
GENERATE_MODEL_NAMES = ("llama", "qwen3", "gemma3", "smollm2-135m", "gemma3-270m")
DEFAULT_GENERATE_MODEL = "gemma3-270m"
DEFAULT_GENERATE_REQUESTS = 8
DEFAULT_GENERATE_TOKEN_SCALE = 64
DEFAULT_GENERATE_OUTPUT_SCALE = 16
#: ``umalloc generate --draft``'s draft tokens proposed per verification.
DEFAULT_DRAFT_TOKENS = 4
#: Most tokens per page an arena end accepts (:class:`umalloc.EndSpec`'s ``page_size`` range is 1..this), spelled
#: out here so that ``--page-size`` is checked with the other arguments, before torch is imported
#: (``tests/app/test_cli_start_up.py`` checks it against :class:`umalloc.EndSpec`).
MAX_PAGE_SIZE_TOKENS = 1 << 16

_M64 = (1 << 64) - 1


def seed64(seed: int) -> int:
    """A ``--seed`` (any Python int) as the 64-bit unsigned seed the generators take: a seed in
    ``[0, 2**64)`` is itself; any other is the first 8 bytes (little-endian) of the blake2b digest of its
    decimal text, so seeds that differ anywhere give different generators (up to a 2**-64 collision chance).
    O(digits of ``seed``).

    >>> seed64(7), seed64(2**64) != seed64(0), 0 <= seed64(-1) < 2**64
    (7, True, True)
    """
    import hashlib

    seed = int(seed)
    if 0 <= seed <= _M64:
        return seed
    return int.from_bytes(hashlib.blake2b(str(seed).encode(), digest_size=8).digest(), "little")
