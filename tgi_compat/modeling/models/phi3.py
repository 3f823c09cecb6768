"""Phi-3 and Phi-4 (Phi3ForCausalLM): the Llama architecture with q/k/v and gate/up already fused in
the checkpoint, and LongRoPE scaling (in layers/rotary.py). The fused tensors are split into the
shards our fused projections load, so the model itself is LlamaForCausalLM unchanged, tensor
parallelism included: the parts are lazy ranges of the fused tensor, from which each rank reads
its heads of q, k and v and its slice of gate and up."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.models.llama import LlamaForCausalLM
from tgi_compat.modeling.weights.lazy import LazyTensor, narrow


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, *args, **kwargs):
        partial = config.hf_config.get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not supported by the native Phi-3 model")
        super().__init__(config, *args, **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None:
        super().load_weights(split_fused_projections(weights, self.config))


Weight = torch.Tensor | LazyTensor


def split_fused_projections(weights: Iterable[tuple[str, Weight]], config: ModelConfig) -> Iterator[tuple[str, Weight]]:
    """`self_attn.qkv_proj` -> q_proj, k_proj, v_proj and `mlp.gate_up_proj` -> gate_proj, up_proj (rows)."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    for name, tensor in weights:
        if ".self_attn.qkv_proj." in name:
            parts = {"q_proj": (0, q_size), "k_proj": (q_size, kv_size), "v_proj": (q_size + kv_size, kv_size)}
        elif ".mlp.gate_up_proj." in name:
            half = tensor.shape[0] // 2
            parts = {"gate_proj": (0, half), "up_proj": (half, half)}
        else:
            yield name, tensor
            continue
        fused = name.split(".")[-2]  # qkv_proj | gate_up_proj
        for part, (start, size) in parts.items():
            yield name.replace(f".{fused}.", f".{part}."), narrow(tensor, 0, start, size)
