"""Phi-3 and Phi-4 (Phi3ForCausalLM): the Llama architecture with q/k/v and gate/up already fused in
the checkpoint, and LongRoPE scaling (in layers/rotary.py). The fused tensors are split into the
shards our fused projections load, so the model itself is LlamaForCausalLM unchanged."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from modeling.config import ModelConfig
from modeling.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    supports_tensor_parallel = False  # split_fused_projections reads whole tensors, not rank slices

    def __init__(self, config: ModelConfig, *args, **kwargs):
        partial = config.hf_config.get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not supported by the native Phi-3 model")
        super().__init__(config, *args, **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_fused_projections(weights, self.config))


def split_fused_projections(
    weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """`self_attn.qkv_proj` -> q_proj, k_proj, v_proj and `mlp.gate_up_proj` -> gate_proj, up_proj (rows)."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    for name, tensor in weights:
        if ".self_attn.qkv_proj." in name:
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q_size, kv_size, kv_size])):
                yield name.replace(".qkv_proj.", f".{part}."), chunk
        elif ".mlp.gate_up_proj." in name:
            for part, chunk in zip(("gate_proj", "up_proj"), tensor.chunk(2)):
                yield name.replace(".gate_up_proj.", f".{part}."), chunk
        else:
            yield name, tensor
