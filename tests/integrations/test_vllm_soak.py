"""Soak: umalloc's vLLM block pool under vLLM's own ``Scheduler`` and ``KVCacheManager``.

:func:`soak` drives a stock vLLM ``Scheduler`` (built as vLLM's own scheduler tests build one: a ``ModelConfig``
from a local ``config.json``, no weights, a one-group full-attention ``KVCacheConfig``) step by step, standing
in for the model runner: each scheduled request whose prompt is fully computed samples one token, a
deterministic function of the request and the token's position, so two runs on the same inputs see the same
tokens. The workload: requests of mixed prompt and output lengths, some sharing prompt prefixes of whole blocks
(prefix-cache hits), arriving in seeded random bursts; some aborted (``finish_requests(...,
FINISHED_ABORTED)``) once they have generated a chosen number of tokens (mid-generation whatever the step), a
few aborted while still waiting; a pool of few blocks, so the scheduler preempts. With umalloc installed, the
pool's ``check_invariants()`` runs after every step; afterwards every block must be free again (the pool's free
count equals the start's, and after ``reset_prefix_cache()`` umalloc holds every block as free, none cached).

The oracle is the same driver on vLLM's stock ``BlockPool`` with the same inputs: every request's generated
tokens and finish reason are equal. With prefix caching off the scheduler's decisions depend only on block
counts, so the whole per-step schedule (tokens scheduled per request, finished ids, preempted ids) is equal too;
with prefix caching on, umalloc keeps cached blocks longer than vLLM (it evicts a cached block only when no
uncached one is free, by design), so hits and preemptions may differ and only the per-request results are
compared.

Skipped where vLLM is not importable (scripts/peer_suite_vllm.sh runs it in its vLLM venv). The short version
is the ``soak`` tests here; the long one is ``scripts/soak_vllm.py``. Seeded: ``UMALLOC_SEED`` (printed).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import random
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/peer_suite_vllm.sh runs these tests)")

from umalloc.integrations import vllm as umalloc_vllm  # noqa: E402

PEER = pathlib.Path(__file__).resolve().parents[1] / "peer"
MODEL = "facebook/opt-125m"
BLOCK_SIZE = 16
VOCAB = 50_000
EOS = 2                    # OPT's end-of-sequence id: never sampled (the sampler below draws from 10 ..)
PREFIXES = 8               # shared prompt prefixes (1-4 whole blocks)
MAX_MODEL_LEN = 2048


def seed_from_env(default: int = 20261205) -> int:
    return int(os.environ.get("UMALLOC_SEED", str(default)))


def model_dir(root: pathlib.Path) -> pathlib.Path:
    """A local model folder holding OPT-125M's ``config.json`` (tests/peer/vllm_model_snapshot.py's numbers):
    vLLM's ``ModelConfig`` reads it offline, no hub."""
    spec = importlib.util.spec_from_file_location("vllm_model_snapshot", PEER / "vllm_model_snapshot.py")
    assert spec is not None and spec.loader is not None
    snap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(snap)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(snap.MODELS[MODEL]))
    return root


def build_scheduler(model_path: pathlib.Path, *, num_blocks: int, prefix_caching: bool,
                    max_num_seqs: int, max_num_batched_tokens: int) -> Any:
    """vLLM's ``Scheduler`` with a ``KVCacheManager`` of ``num_blocks`` blocks of ``BLOCK_SIZE`` tokens (whatever
    ``BlockPool`` class vLLM's coordinator module names at the call: umalloc's once installed)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model=str(model_path), dtype="float16", seed=0, skip_tokenizer_init=True,
                               max_model_len=MAX_MODEL_LEN)
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
                                       is_encoder_decoder=False, watermark=0.0)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, cache_dtype="auto",
                               enable_prefix_caching=prefix_caching)
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    cache_config.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(vllm_config)
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=BLOCK_SIZE,
                     log_stats=True, structured_output_manager=StructuredOutputManager(vllm_config))


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    abort_after: int | None    # abort once this many tokens were generated (0: while waiting); None: never


def workload(num_requests: int, seed: int) -> list[Req]:
    """Seeded requests: 40% start with one of ``PREFIXES`` shared prefixes (1-4 whole blocks) plus a 1-40 token
    tail, the others 1-200 random tokens, a few 300-600; 1-48 new tokens; ~10% aborted after 1 .. max-1 generated
    tokens, ~3% aborted while waiting."""
    rng = random.Random(seed)

    def rnd(n: int) -> list[int]:
        return [rng.randrange(10, VOCAB) for _ in range(n)]

    prefixes = [rnd(BLOCK_SIZE * rng.randint(1, 4)) for _ in range(PREFIXES)]
    reqs = []
    for i in range(num_requests):
        u = rng.random()
        if u < 0.4:
            prompt = rng.choice(prefixes) + rnd(rng.randint(1, 40))
        elif u < 0.95:
            prompt = rnd(rng.randint(1, 200))
        else:
            prompt = rnd(rng.randint(300, 600))
        new = rng.randint(1, 48)
        v = rng.random()
        abort = rng.randint(1, new - 1) if v < 0.10 and new >= 2 else 0 if v < 0.13 else None
        reqs.append(Req(f"r{i}", prompt, new, abort))
    return reqs


def token(rid: str, position: int) -> int:
    """The token the stand-in model samples for request ``rid`` at output ``position`` (never EOS)."""
    return 10 + (int(rid[1:]) * 7919 + position * 104729) % (VOCAB - 10)


@dataclass
class SoakResult:
    """What one :func:`soak` run did and left."""

    umalloc: bool
    prefix_caching: bool
    seed: int
    requests: int = 0
    steps: int = 0
    seconds: float = 0.0
    tokens: dict[str, list[int]] = field(default_factory=dict)        # every request's output tokens
    reasons: dict[str, str] = field(default_factory=dict)             # request id -> finish status name
    aborted_running: int = 0
    aborted_waiting: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    schedule: list[tuple[Any, ...]] = field(default_factory=list)     # per step: (scheduled, finished, preempted)
    free_at_start: int = 0
    free_at_end: int = 0
    leaks: dict[str, int] = field(default_factory=dict)


def soak(reqs: list[Req], model_path: pathlib.Path, *, use_umalloc: bool, prefix_caching: bool, seed: int,
         num_blocks: int = 64, max_num_seqs: int = 24, max_num_batched_tokens: int = 256,
         max_outstanding: int = 48, minutes: float | None = None, log: Any = None) -> SoakResult:
    """Run ``reqs`` through one vLLM ``Scheduler`` (umalloc's pool installed, or vLLM's stock one); arrivals in
    seeded random bursts of 0-4 per step, none while ``max_outstanding`` requests are unfinished (arrivals keep
    pace with the scheduler for the whole run instead of queueing at once); ``minutes``: stop admitting once
    that much wall time passed (the rest are not run). Returns the :class:`SoakResult` (with ``use_umalloc``, the leak figures)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    rng = random.Random(seed + 1)
    res = SoakResult(use_umalloc, prefix_caching, seed)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    if use_umalloc:
        umalloc_vllm.install()
    try:
        sched = build_scheduler(model_path, num_blocks=num_blocks, prefix_caching=prefix_caching,
                                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    finally:
        if use_umalloc:
            umalloc_vllm.uninstall()
    pool = sched.kv_cache_manager.block_pool
    assert (type(pool).__name__ == "UmallocBlockPool") == use_umalloc, type(pool)
    res.free_at_start = pool.get_num_free_blocks()
    by_id = {r.rid: r for r in reqs}
    live: dict[str, Any] = {}
    t0 = time.perf_counter()
    deadline = None if minutes is None else t0 + 60 * minutes
    i = 0
    while i < len(reqs) or live:
        if i < len(reqs) and deadline is not None and time.perf_counter() >= deadline:
            reqs = reqs[:i]
        burst = rng.randint(0, 4)   # drawn every step, admitted or not: the same draws for both pools
        for r in reqs[i:i + burst] if len(live) < max_outstanding else ():
            params = SamplingParams(max_tokens=r.max_tokens)
            params.update_from_generation_config({}, EOS)
            req = Request(request_id=r.rid, prompt_token_ids=r.prompt, mm_features=None, sampling_params=params,
                          pooling_params=None, block_hasher=hasher)
            sched.add_request(req)
            live[r.rid] = req
            res.requests += 1
            i += 1
            if r.abort_after == 0:   # aborted while waiting (before its first schedule)
                sched.finish_requests(r.rid, RequestStatus.FINISHED_ABORTED)
                res.aborted_waiting += 1
        out = sched.schedule()
        scheduled = out.num_scheduled_tokens
        sampled = []
        for rid in scheduled:
            req = live[rid]
            sampled.append([token(rid, req.num_output_tokens)] if req.num_computed_tokens >= req.num_tokens else [])
        ids = list(scheduled)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: k for k, rid in enumerate(ids)},
                                sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={}, pooler_output=[])
        sched.update_from_output(out, mro)
        preempted = sorted(out.preempted_req_ids or ())
        res.preemptions += len(preempted)
        for rid in list(live):
            req = live[rid]
            ab = by_id[rid].abort_after
            if req.is_finished():
                continue
            if ab and req.num_output_tokens >= ab:
                sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                res.aborted_running += 1
        done = []
        for rid, req in live.items():
            if req.is_finished():
                res.tokens[rid] = list(req.output_token_ids)
                res.reasons[rid] = req.status.name
                done.append(rid)
        for rid in done:
            del live[rid]
        res.schedule.append((tuple(sorted(scheduled.items())), tuple(sorted(out.finished_req_ids)),
                             tuple(preempted)))
        res.steps += 1
        # tokens a request starting (or restarting after a preemption) found computed: its prefix-cache hit
        res.prefix_hit_tokens += sum(n.num_computed_tokens for n in out.scheduled_new_reqs)
        if use_umalloc:
            pool.check_invariants()
        if log is not None and res.steps % 2000 == 0:
            log(f"  step {res.steps}: {res.requests} requests admitted, {len(res.tokens)} done, "
                f"{res.preemptions} preemptions")
    res.seconds = time.perf_counter() - t0
    res.free_at_end = pool.get_num_free_blocks()
    if use_umalloc:
        pool.check_invariants()
        res.leaks["blocks_not_free"] = res.free_at_start - res.free_at_end
        res.leaks["requests_in_scheduler"] = len(sched.requests)
        assert pool.reset_prefix_cache()
        pool.check_invariants()
        res.leaks["cached_after_reset"] = pool.refs.num_cached
        res.leaks["held_after_reset"] = num_blocks - 1 - pool.refs.num_free
    return res


def summary(res: SoakResult) -> str:
    return (f"pool={'umalloc' if res.umalloc else 'stock'} prefix_caching={res.prefix_caching} seed={res.seed} "
            f"requests={res.requests} steps={res.steps} seconds={res.seconds:.1f} "
            f"finished={sum(v == 'FINISHED_LENGTH_CAPPED' for v in res.reasons.values())} "
            f"aborted(running)={res.aborted_running} aborted(waiting)={res.aborted_waiting} "
            f"preemptions={res.preemptions} prefix_hit_tokens={res.prefix_hit_tokens} "
            f"free blocks start/end={res.free_at_start}/{res.free_at_end} leaks={sum(res.leaks.values())}")


def compare(um: SoakResult, stock: SoakResult) -> list[str]:
    """What differs between the umalloc run and the stock one (empty: nothing): per-request tokens and finish
    reasons always; with prefix caching off, the per-step schedule too."""
    problems = []
    if um.tokens != stock.tokens:
        diff = sorted(k for k in um.tokens.keys() | stock.tokens.keys() if um.tokens.get(k) != stock.tokens.get(k))
        problems.append(f"tokens differ for {len(diff)} requests, e.g. {diff[:5]}")
    if um.reasons != stock.reasons:
        problems.append("finish reasons differ")
    if not um.prefix_caching and um.schedule != stock.schedule:
        step = next((k for k, (a, b) in enumerate(zip(um.schedule, stock.schedule, strict=False)) if a != b),
                    min(len(um.schedule), len(stock.schedule)))
        problems.append(f"schedules differ from step {step} (steps {um.steps} vs {stock.steps})")
    return problems


# ---- the short version (peer suite) ---------------------------------------------------------------------------
SHORT_REQUESTS = 1000


@pytest.mark.soak
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-caching", "prefix-caching"])
def test_soak_short(prefix_caching: bool, tmp_path: pathlib.Path) -> None:
    """Arrivals, aborts mid-generation and while waiting, preemptions under a tight pool, prefix hits;
    umalloc's invariants after every step; every block free at the end; results equal stock vLLM's."""
    seed = seed_from_env()
    print(f"seed={seed}")
    path = model_dir(tmp_path / "model")
    reqs = workload(SHORT_REQUESTS, seed)
    um = soak(reqs, path, use_umalloc=True, prefix_caching=prefix_caching, seed=seed)
    stock = soak(reqs, path, use_umalloc=False, prefix_caching=prefix_caching, seed=seed)
    print(summary(um))
    print(summary(stock))
    assert um.requests == stock.requests == len(reqs)
    assert compare(um, stock) == []
    assert all(v == 0 for v in um.leaks.values()), um.leaks
    assert um.free_at_end == um.free_at_start
    # the workload exercised what it claims (each figure counted by vLLM's scheduler, not by the pool)
    assert um.preemptions > 0 and um.aborted_running > 0 and um.aborted_waiting > 0
    if prefix_caching:
        assert um.prefix_hit_tokens > 0
    # every request either ran to its max_tokens or was aborted; aborted ones stopped at their abort point
    for r in reqs:
        if r.abort_after is None:
            assert um.reasons[r.rid] == "FINISHED_LENGTH_CAPPED" and len(um.tokens[r.rid]) == r.max_tokens
        else:
            assert um.reasons[r.rid] == "FINISHED_ABORTED" and len(um.tokens[r.rid]) == r.abort_after
            assert um.tokens[r.rid] == [token(r.rid, k) for k in range(r.abort_after)]
