"""The replay's configuration: :class:`ReplayConfig` (every option of ``umalloc replay``) and the default arena
sizes of a trace slice (:func:`default_arena_bytes`). The driver is :mod:`umalloc_replay.single.run`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from umalloc import ArenaSpec, UmallocValueError
from umalloc.geometry.presets import DEFAULT_PRESET, DRAFT_SLIDING, PRESETS
from umalloc_replay import DEFAULT_REQUESTS, DEFAULT_TOKEN_SCALE
from umalloc_replay.single.fit import request_peak_bytes, request_prompt_bytes
from umalloc_replay.single.layouts import parse_layout
from umalloc_replay.trace import Trace

#: Default decode arena: room for this many average requests at their peak (the rest waits or retracts).
DEFAULT_DECODE_CONCURRENCY = 6.0
#: Default prefill arena: this many times the largest prompt footprint.
DEFAULT_PREFILL_HEADROOM = 2.0

_MIB = 1 << 20


@dataclass(frozen=True)
class ReplayConfig:
    """Everything ``umalloc replay`` takes (the CLI options).

    Attributes:
        trace: trace file (``None``: the packaged Mooncake conversation trace); trace_format: ``"mooncake"``,
            ``"azure"`` or ``None`` (detect).
        model: preset name (:data:`umalloc.geometry.presets.PRESETS`); page_size: tokens per page; draft: include the
            drafter's end; draft_sliding: where the drafter's sliding layers go, ``"swa"``, ``"own"`` or
            ``"draft"`` (:func:`umalloc.geometry.presets.preset_ends`).
        prefill_arena_bytes, decode_arena_bytes: arena sizes (``None``: sized from the slice, see
            :func:`default_arena_bytes`).
        backend: ``"local"``, ``"nixl"`` or ``"mooncake"``.
        requests: replay N requests (``None``: :data:`DEFAULT_REQUESTS`) starting after ``skip`` rows of the
            trace; token_scale: divide token counts by K (``None``: :data:`DEFAULT_TOKEN_SCALE`).
        seed: KV pattern seed; max_batch: most requests decoding at once; compaction: allocator mode.
        check_every: ``check_invariants()`` every N steps on both sides (0: at the end only).
        layout: the decode arena's layout, ``"dynamic"``, ``"static[:RATIO]"``, ``"padded"`` or ``"vllm"``
            (:mod:`umalloc_replay.single.layouts`; the arena bytes are the same for every layout).
        verify_final: re-verify every live page of a request when it finishes.
        transfer_timeout_s: bound of each transfer wait; lease_deadline_s: deadline of plan leases.
    """

    trace: str | None = None
    trace_format: str | None = None
    model: str = DEFAULT_PRESET
    page_size: int = 16
    prefill_arena_bytes: int | None = None
    decode_arena_bytes: int | None = None
    backend: str = "local"
    requests: int | None = None
    skip: int = 0
    token_scale: int | None = None
    draft: bool = True
    draft_sliding: str = "swa"
    seed: int = 0
    max_batch: int = 64
    compaction: str = "lazy"
    check_every: int = 0
    layout: str = "dynamic"
    verify_final: bool = True
    transfer_timeout_s: float = 120.0
    lease_deadline_s: float | None = 600.0

    def resolved(self) -> ReplayConfig:
        """Validate and fill ``requests`` / ``token_scale`` defaults.

        Raises:
            UmallocValueError: naming the bad field and the allowed values.
        """
        if self.model not in PRESETS:
            raise UmallocValueError(f"model={self.model!r}: allowed one of {sorted(PRESETS)}")
        if self.backend not in ("local", "nixl", "mooncake"):
            raise UmallocValueError(f"backend={self.backend!r}: allowed 'local', 'nixl', 'mooncake'")
        for name in ("page_size", "max_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UmallocValueError(f"{name}={v!r}: allowed an int >= 1")
        for name in ("requests", "token_scale", "prefill_arena_bytes", "decode_arena_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise UmallocValueError(f"{name}={v!r}: allowed None or an int >= 1")
        for name in ("check_every", "skip"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UmallocValueError(f"{name}={v!r}: allowed an int >= 0")
        if self.draft_sliding not in DRAFT_SLIDING:
            raise UmallocValueError(f"draft_sliding={self.draft_sliding!r}: allowed one of {list(DRAFT_SLIDING)}")
        parse_layout(self.layout)
        d = asdict(self)
        d["requests"] = DEFAULT_REQUESTS if self.requests is None else self.requests
        d["token_scale"] = DEFAULT_TOKEN_SCALE if self.token_scale is None else self.token_scale
        return ReplayConfig(**d)


def _round_arena(nbytes: float) -> int:
    return int(math.ceil(nbytes / _MIB)) * _MIB


def default_arena_bytes(spec_ends: tuple, trace: Trace) -> tuple[int, int]:
    """Default ``(prefill, decode)`` arena bytes for a trace slice.

    Decode: room for :data:`DEFAULT_DECODE_CONCURRENCY` average requests at their peak, and at least 1.5 times
    the largest single request (so every request fits alone, with room for the allocator's placement); the
    slice then runs under memory pressure. Prefill: :data:`DEFAULT_PREFILL_HEADROOM` times the largest prompt.
    Both are floor + pages rounded up to MiB.
    """
    probe = ArenaSpec(spec_ends, arena_bytes=1 << 40)
    peaks = [request_peak_bytes(probe, r.input_tokens, r.output_tokens) for r in trace]
    prompts = [request_prompt_bytes(probe, r.input_tokens) for r in trace]
    floor = probe.floor_bytes
    slack = sum(e.page_bytes for e in spec_ends) * 2
    decode = max(DEFAULT_DECODE_CONCURRENCY * float(np.mean(peaks)), 1.5 * max(peaks)) + floor + slack
    prefill = DEFAULT_PREFILL_HEADROOM * max(prompts) + floor + slack
    return _round_arena(prefill), _round_arena(decode)


__all__ = ["DEFAULT_DECODE_CONCURRENCY", "DEFAULT_PREFILL_HEADROOM", "ReplayConfig", "default_arena_bytes"]
