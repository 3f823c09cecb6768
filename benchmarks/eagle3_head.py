"""A random EAGLE-3 head in the speculators format, shaped for a target config (benchmarks: speed, never drafts
worth accepting; acceptance is replayed)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tgi_compat.modeling.models.eagle3_config import Eagle3Config

LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps")


def write_random_eagle3_head(folder: Path, target: dict, draft_vocab: int, seed: int = 0) -> Path:
    """config.json and model.safetensors of a one-layer head for `target` (a config.json dict), bf16; no embedding
    (the target's is shared), d2t mapping draft id i to target id i."""
    layer = {key: target[key] for key in LAYER_KEYS if key in target}
    layer |= dict(vocab_size=target["vocab_size"], max_position_embeddings=target.get("max_position_embeddings", 8192))
    layer |= dict(rope_theta=target.get("rope_theta", 10000.0), architectures=["LlamaForCausalLM"])
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": False,
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "random"}},
    }
    shapes = Eagle3Config.from_dict(config).expected_shapes(target["vocab_size"])
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        elif name.endswith(".weight") and name != "embed_tokens.weight":
            tensors[name] = (torch.randn(shape, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)
    tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64)
    named = {
        name.replace("layer.", "layers.0.", 1) if name.startswith("layer.") else name: t for name, t in tensors.items()
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(named, str(folder / "model.safetensors"))
    return folder
