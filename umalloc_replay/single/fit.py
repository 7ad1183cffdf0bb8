"""The replay's up-front fit check: a slice with a request that cannot run even alone is refused before anything
runs, with one message naming the largest such request and what to change.

* Two checks per request and side: its bytes (the empty allocator's joint placement plan,
  :meth:`MultiEndedAllocator.can_alloc`, of its peak on decode and its prompt on prefill, within the static
  pools when there are any), and its admission (:func:`~umalloc_replay.single.prefill.alloc_sequence` of its prompt,
  then freed, on an empty probe allocator: a floating band (the ``swa`` end between ``full`` and ``draft``, or
  the ``draft`` end) can split free space so that bytes that fit cannot be placed, Note [Stranded space] in
  :mod:`umalloc_replay.single.run`). A joint plan that refuses bytes the arena holds (its floor and one page
  per end aside) is named a placement too.
* Hints are given only where they help: ``--requests K`` when the first ``K`` requests of the slice fit;
  ``--compaction lazy`` when the refusal is a placement under ``--compaction off`` that lazy compaction places.
* The probes hold only tables (their arenas are never written).
"""

from __future__ import annotations

from umalloc import ARENA_ALIGN_BYTES, Arena, ArenaSpec, EndRole, MultiEndedAllocator, UmallocValueError
from umalloc_replay.single.layouts import sglang_swa_peak_pages
from umalloc_replay.single.prefill import alloc_sequence
from umalloc_replay.trace import Trace, TraceRequest
from umalloc_replay.workload import pages_held, peak_pages


def decode_peak_pages(spec: ArenaSpec, end: str, input_tokens: int, output_tokens: int, *, sglang: bool) -> int:
    """Most pages of ``end`` one request holds on the decode side: :func:`~umalloc_replay.workload.peak_pages`, or
    with ``sglang`` (the static layout) SGLang's batched SWA eviction on an SWA end
    (:func:`~umalloc_replay.single.layouts.sglang_swa_peak_pages`). O(1), O(output_tokens) for that case."""
    e = spec.end(end)
    if sglang and e.role is EndRole.SWA and e.window_tokens is not None:
        return sglang_swa_peak_pages(input_tokens, output_tokens, e.window_tokens, e.page_size)
    return peak_pages(spec, end, input_tokens, output_tokens)


def request_peak_bytes(spec: ArenaSpec, input_tokens: int, output_tokens: int) -> int:
    """Decode-side bytes one request holds at its peak (every end)."""
    return sum(peak_pages(spec, e.name, input_tokens, output_tokens) * e.page_bytes for e in spec.ends)


def request_prompt_bytes(spec: ArenaSpec, input_tokens: int) -> int:
    """Prefill-side bytes one prompt holds (every end; SWA window tail only)."""
    return sum(pages_held(spec, e.name, input_tokens) * e.page_bytes for e in spec.ends)


def check_slice_fits(trace: Trace, dec_spec: ArenaSpec, pre_spec: ArenaSpec, *, compaction: str,
                     token_scale: int, budget: dict[str, int] | None, layout_label: str) -> None:
    """Refuse a slice with a request that cannot fit (or be placed) even in an empty arena.

    Args:
        trace: the slice; dec_spec, pre_spec: the decode and prefill arenas; compaction: the allocator mode.
        token_scale: for the message; budget: static pools' pages per end (``None``: no pools);
        layout_label: the layout's name, for the message.

    Raises:
        UmallocValueError: naming the largest request that does not fit, its bytes, and what to change.

    Complexity: O(requests x ends) allocator calls on two empty probes.
    """
    probes = {side: MultiEndedAllocator(Arena(spec, zero=False), compaction=compaction)
              for side, spec in (("decode", dec_spec), ("prefill", pre_spec))}
    bad: dict[str, list[tuple[int, TraceRequest, bool]]] = {"decode": [], "prefill": []}
    for r in trace:
        for side, spec in (("decode", dec_spec), ("prefill", pre_spec)):
            probe = probes[side]
            if side == "decode":
                need = {e.name: decode_peak_pages(spec, e.name, r.input_tokens, r.output_tokens,
                                                  sglang=budget is not None) for e in spec.ends}
                nbytes = sum(n * spec.end(e).page_bytes for e, n in need.items())
                pooled = budget is None or all(n <= budget[e] for e, n in need.items())
            else:
                need = {e.name: pages_held(spec, e.name, r.input_tokens) for e in spec.ends}
                nbytes = request_prompt_bytes(spec, r.input_tokens)
                pooled = True
            if not pooled or not probe.can_alloc(need):
                # the joint plan refuses bytes an arena of this size holds: a float band splits the free space
                bad[side].append((nbytes, r, pooled and nbytes + _slack(spec) <= spec.arena_bytes))
                continue
            vt = alloc_sequence(probe, r.input_tokens)
            if vt is None:
                bad[side].append((nbytes, r, True))
            else:
                probe.free(vt)
    first_row = trace.requests[0].request_id
    for side, spec in (("decode", dec_spec), ("prefill", pre_spec)):
        if not bad[side]:
            continue
        have = spec.arena_bytes
        nbytes, r, placement = max(bad[side], key=lambda x: x[0])
        what = (f"request {r.request_id} ({r.input_tokens} prompt + {r.output_tokens} output tokens after token "
                f"scale {token_scale})")
        fit_before = min(x[1].request_id for x in bad[side]) - first_row
        fewer = f", or --requests {fit_before} (the requests before it fit)" if fit_before > 0 else ""
        if placement:
            lazy = "; --compaction lazy places it" if compaction == "off" and _places_lazily(spec, r) else ""
            raise UmallocValueError(
                f"{len(bad[side])} request(s) cannot be placed even in an empty {side} arena of {have:,} bytes; "
                f"the largest, {what}, holds {nbytes:,} bytes, which fit, but the allocator cannot place its "
                f"ends side by side (a floating band splits the free space): allowed a larger {side} "
                f"--arena-bytes, a larger --token-scale, --no-draft{fewer}{lazy}")
        if side == "decode" and budget is not None:
            raise UmallocValueError(
                f"{len(bad[side])} request(s) cannot fit even in an empty decode arena of {have:,} bytes with "
                f"the static pools of --layout {layout_label} (pages per end {budget}); the largest, {what}, "
                f"holds {nbytes:,} bytes at its peak: allowed a larger decode --arena-bytes, another RATIO, a "
                f"larger --token-scale{fewer}")
        raise UmallocValueError(
            f"{len(bad[side])} request(s) cannot fit even in an empty {side} arena of {have:,} bytes; the "
            f"largest, {what}, holds {nbytes:,} bytes at its peak: allowed --arena-bytes with {side} >= "
            f"~{nbytes + _slack(spec):,}, a larger --token-scale{fewer}")


def _slack(spec: ArenaSpec) -> int:
    """Bytes of ``spec``'s arena no request can use: its floor and one page per end."""
    return spec.floor_bytes + sum(e.page_bytes for e in spec.ends)


def slice_needs_bytes(ends: tuple, trace: Trace, side: str) -> int:
    """Bytes the ``side`` (``"decode"`` or ``"prefill"``) arena needs at least for ``trace``: its largest request
    (decode: at its peak; prefill: its prompt) plus the arena's floor and one page per end, rounded up to
    :data:`umalloc.ARENA_ALIGN_BYTES` (the figure :func:`check_slice_fits` names). O(requests x ends).

    >>> from umalloc.geometry.presets import preset_ends
    >>> from umalloc_replay.trace import Trace, TraceRequest
    >>> ends = preset_ends("llama-3.1-8b", page_size=16)
    >>> # one 2 MiB page per 16 tokens: a 17-token prompt holds 2 pages, the floor 1, one page per end 1
    >>> slice_needs_bytes(ends, Trace("t", "azure", 1, (TraceRequest(0, 0.0, 17, 1),)), "prefill") == 4 * (2 << 20)
    True
    """
    probe = ArenaSpec(ends, arena_bytes=1 << 40)
    if side == "decode":
        largest = max(request_peak_bytes(probe, r.input_tokens, r.output_tokens) for r in trace)
    else:
        largest = max(request_prompt_bytes(probe, r.input_tokens) for r in trace)
    nbytes = largest + probe.floor_bytes + sum(e.page_bytes for e in probe.ends)
    return -(-nbytes // ARENA_ALIGN_BYTES) * ARENA_ALIGN_BYTES


def _places_lazily(spec: ArenaSpec, r: TraceRequest) -> bool:
    """Whether an empty arena of ``spec`` with lazy compaction places request ``r``'s prompt."""
    probe = MultiEndedAllocator(Arena(spec, zero=False), compaction="lazy")
    return alloc_sequence(probe, r.input_tokens) is not None


__all__ = ["check_slice_fits", "decode_peak_pages", "request_peak_bytes", "request_prompt_bytes", "slice_needs_bytes"]
