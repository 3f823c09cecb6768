"""The Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

The shared decoder (models/decoder.py) with a SwiGLU MLP; the config switches live in ModelConfig.
Every layer is sharded under tensor parallelism: column-parallel q|k|v and gate|up, row-parallel o
and down, a vocab-parallel embedding and head.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.layers.linear import Linear, MergedLinear
from tgi_compat.modeling.layers.norm import RMSNorm
from tgi_compat.modeling.layers.ops import TORCH_OPS, LayerOps
from tgi_compat.modeling.layers.rotary import RotaryEmbedding
from tgi_compat.modeling.models.decoder import Attention, DecoderForCausalLM, DecoderLayer, DecoderModel
from tgi_compat.modeling.parallel import NO_TP, TensorParallel, split_evenly


class LlamaForCausalLM(DecoderForCausalLM):
    supports_tensor_parallel = True

    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TensorParallel = NO_TP):
        layers = (llama_layer(config, ops, i, tp) for i in range(config.num_layers))
        super().__init__(config, DecoderModel(config, ops, layers, llama_rope(config, ops), tp=tp), tp)


def llama_layer(config: ModelConfig, ops: LayerOps, layer: int, tp: TensorParallel = NO_TP) -> DecoderLayer:
    attention = Attention(config, ops, sliding_window=config.sliding_window_of(layer), tp=tp)
    return DecoderLayer(config, ops, attention, LlamaMLP(config, ops, tp))


def llama_rope(config: ModelConfig, ops: LayerOps) -> RotaryEmbedding:
    return RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings, ops)


class GatedMLP(nn.Module):
    """gate|up and down projections: column-parallel gate|up and row-parallel down under tensor parallelism.
    Each gated feed-forward (SwiGLU here, Gemma's GeGLU) adds its activation."""

    def __init__(self, config: ModelConfig, ops: LayerOps, tp: TensorParallel = NO_TP):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size] * 2, config.mlp_bias, tp=tp)
        self.down_proj = Linear(
            size, config.hidden_size, config.mlp_bias, in_slice=split_evenly(size, tp.size, tp.rank), tp=tp
        )
        self.ops = ops
        self.tp = tp


class LlamaMLP(GatedMLP):
    """SwiGLU."""

    def norm_and_forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, sum_over: TensorParallel | None
    ) -> tuple[torch.Tensor, torch.Tensor, TensorParallel | None]:
        gate_up, residual = self.ops.rms_norm_linear(hidden, residual, norm, self.gate_up_proj, sum_over)  # [T, 2I]
        # the sum sits here, not in down_proj: the fused GEMV op reads down_proj's weight directly (and may send
        # its rows of the sum to the other ranks itself), or the next norm takes it
        out, sum_over = self.ops.silu_mul_row_parallel_linear(gate_up, self.down_proj, self.tp)
        return out, residual, sum_over
