"""Random PEFT LoRA adapters written as PEFT saves them (adapter_config.json + adapter_model.safetensors), for
the embedded SmolLM2 or any Llama-shaped config. tests/modeling/test_lora_parity.py loads the same folders into
peft itself, which checks the format."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the embedded SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, intermediate 1536, 30 layers
SMOLLM2_SHAPES = dict(hidden=576, q=576, kv=192, intermediate=1536, num_layers=30)


def write_random_adapter(
    folder: Path,
    rank: int,
    seed: int,
    *,
    projections: tuple[str, ...] = ALL_PROJECTIONS,
    alpha: float | None = None,
    hidden: int,
    q: int,
    kv: int,
    intermediate: int,
    num_layers: int,
) -> Path:
    """lora_alpha = 2 r by default; A and B random (B is zero in a fresh PEFT adapter, which would change nothing)."""
    shapes = {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
        "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden),
    }  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for projection in projections:
            size_in, size_out = shapes[projection]
            block = "mlp" if projection in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{projection}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, size_in, generator=generator) / size_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(size_out, rank, generator=generator) * 0.2 / rank**0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha if alpha is not None else 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(projections),
        "bias": "none",
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def write_smollm2_adapter(folder: Path, rank: int, seed: int, **kwargs) -> Path:
    return write_random_adapter(folder, rank, seed, **SMOLLM2_SHAPES, **kwargs)
