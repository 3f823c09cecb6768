"""Write Linear weights in compressed-tensors' formats (the ones compressed_tensors.py reads back).

int8 per channel  `weight` int8 [out, in], `weight_scale` [out, 1]      format naive-quantized
int4 per group    `weight_packed` int32 [out, in/8] (q + 8, nibble i = input 8j + i),
                  `weight_scale` [out, in/G], `weight_shape` [2]       format pack-quantized (symmetric)
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch
from safetensors.torch import save_file

from tgi_compat.modeling.layers.quantization.int8 import quantize_weight_int8

# the Linear weights that get quantized (embeddings, norms and the LM head stay in the model's dtype)
LINEAR_WEIGHT = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def int8_tensors(name: str, weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    q, scale = quantize_weight_int8(weight)
    stem = name.removesuffix(".weight")
    return {f"{stem}.weight": q, f"{stem}.weight_scale": scale[:, None].to(dtype)}


def int4_tensors(name: str, weight: torch.Tensor, dtype: torch.dtype, group_size: int) -> dict[str, torch.Tensor]:
    """Symmetric round-to-nearest per group, packed the compressed-tensors way."""
    out_features, in_features = weight.shape
    w = weight.float().reshape(out_features, -1, group_size)
    scale = (w.abs().amax(-1) / 7).clamp(min=1e-8).to(dtype).float()  # q in -7..7, no clipping
    q = (w / scale[..., None]).round().clamp(-8, 7).to(torch.int64).reshape(out_features, in_features) + 8
    nibbles = q.reshape(out_features, -1, 8)
    packed = nibbles[..., 0].clone()
    for i in range(1, 8):
        packed += nibbles[..., i] << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    stem = name.removesuffix(".weight")
    return {
        f"{stem}.weight_packed": packed,
        f"{stem}.weight_scale": scale.to(dtype),
        f"{stem}.weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64),
    }


def quantization_config(scheme: str, group_size: int = 128) -> dict[str, Any]:
    """config.json `quantization_config` for scheme: w8a16 | w8a8 | w4a16."""
    if scheme == "w4a16":
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size}
        activations, fmt = None, "pack-quantized"
    else:
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None}
        activations, fmt = None, "naive-quantized"
        if scheme == "w8a8":
            activations = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
            fmt = "int-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
    }


def write_checkpoint(
    folder: str, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor], quant: dict | None
) -> None:
    """model.safetensors and config.json (with `quantization_config` unless quant is None: a plain checkpoint)."""
    os.makedirs(folder, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config if quant is None else {**hf_config, "quantization_config": quant}, f, indent=2)
