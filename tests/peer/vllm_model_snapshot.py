"""Write a local Hugging Face cache snapshot of the model configs vLLM's scheduler tests name, from the models'
published architecture numbers (nothing is downloaded: the peer suite runs with ``HF_HUB_OFFLINE=1``).

Only ``config.json`` (and ``generation_config.json``) are written: the scheduler tests build a ``ModelConfig``
(architecture, sizes, context length, dtype) and never load weights. ``facebook/opt-125m``'s numbers are those
of its published ``config.json`` (OPT-125M: 12 layers, 12 heads, hidden 768, FFN 3072, vocab 50272, 2048
positions).

Usage: ``python vllm_model_snapshot.py HF_HOME`` (idempotent).
"""

from __future__ import annotations

import json
import pathlib
import sys

#: a fixed snapshot name (the cache layout needs one; it names no real commit)
REVISION = "0" * 40

MODELS: dict[str, dict[str, object]] = {
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_dropout": 0.0,
        "activation_function": "relu", "attention_dropout": 0.0, "bos_token_id": 2, "do_layer_norm_before": True,
        "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072, "hidden_size": 768, "init_std": 0.02,
        "layerdrop": 0.0, "max_position_embeddings": 2048, "num_attention_heads": 12, "num_hidden_layers": 12,
        "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16", "use_cache": True, "vocab_size": 50272,
        "word_embed_proj_dim": 768, "enable_bias": True, "layer_norm_elementwise_affine": True,
    },
}


def write(hf_home: pathlib.Path) -> None:
    for name, config in MODELS.items():
        repo = hf_home / "hub" / f"models--{name.replace('/', '--')}"
        snap = repo / "snapshots" / REVISION
        snap.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION)
        (snap / "config.json").write_text(json.dumps(config, indent=1))
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        (snap / "generation_config.json").write_text(json.dumps(gen, indent=1))


if __name__ == "__main__":
    write(pathlib.Path(sys.argv[1]))
