"""Random PEFT LoRA adapters of a Llama-shaped config on disk, on every projection (benchmarks/device/lora.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.shapes import attention_heads

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adapted projection, in PEFT's names."""
    heads, kv_heads, head_dim = attention_heads(config)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }  # fmt: skip


def write_peft_adapter(folder: Path, config: dict, rank: int, seed: int) -> Path:
    """adapter_config.json + adapter_model.safetensors as PEFT saves them (bf16, A and B random: B is zero in a
    fresh PEFT adapter, which would change nothing), written directly so that no `peft` install is needed."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for projection, (size_in, size_out) in projection_shapes(config).items():
            block = "mlp" if projection in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{projection}"
            a = torch.randn(rank, size_in, generator=generator) / size_in**0.5
            b = torch.randn(size_out, rank, generator=generator) * 0.2 / rank**0.5
            tensors[f"{prefix}.lora_A.weight"] = a.bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = b.bfloat16()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(PROJECTIONS), "bias": "none", "base_model_name_or_path": "random-llama",
    }  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
    return folder
