"""The Gemma family: Gemma (1), Gemma 2 and Gemma 3 text, one module with config switches.

What differs from Llama, and where it lives here:
- embeddings scaled by sqrt(hidden_size) (rounded to the model dtype, as transformers does);
- RMSNorm scales by (1 + w): the checkpoint's w is stored as 1 + w at load, so the shared RMSNorm
  and its fused GPU ops run unchanged;
- GeGLU MLP (tanh-approximated GELU);
- Gemma 2/3: a norm after attention and after the MLP too ("sandwich" norms), attention scaled by
  query_pre_attn_scalar, a sliding window on the layers that `layer_types` marks;
- Gemma 2: attention logits and final logits soft-capped (c * tanh(x / c));
- Gemma 3: per-head q/k norm, and local (sliding) layers rotate with their own rope base.
The attention itself is the shared LlamaAttention with per-layer switches.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.silu_mul import silu_mul
from modeling.attention.base import AttentionBackend
from modeling.config import ModelConfig, RopeScaling
from modeling.forward_batch import ForwardBatch
from modeling.layers.embedding import LMHead, VocabEmbedding
from modeling.layers.linear import Linear, MergedLinear, default_weight_loader
from modeling.layers.norm import RMSNorm
from modeling.layers.ops import TORCH_OPS, LayerOps
from modeling.layers.rotary import RotaryEmbedding
from modeling.models.llama import KVCaches, LlamaAttention, RopeTables
from modeling.models.weight_names import load_packed_weights

_EXACT_GELU = {"gelu"}  # every other GELU name Gemma configs use is the tanh approximation


@dataclass(frozen=True, slots=True)
class GemmaKnobs:
    """Gemma's config.json fields beyond ModelConfig."""

    sandwich_norms: bool  # Gemma 2/3: post-attention and post-MLP norms
    attention_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    gelu_approximate: str  # "tanh" | "none"
    local_rope_theta: float | None  # Gemma 3: rope base of the sliding layers
    global_rope: tuple[float, RopeScaling]  # rope base and scaling of the full-attention layers

    @classmethod
    def from_config(cls, config: ModelConfig) -> GemmaKnobs:
        d = config.hf_config
        is_gemma1 = config.architecture == "GemmaForCausalLM"
        scalar = d.get("query_pre_attn_scalar") or config.head_dim
        activation = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        local_theta, global_rope = _gemma3_ropes(d) if config.architecture == "Gemma3ForCausalLM" else (None, None)
        return cls(
            sandwich_norms=not is_gemma1,
            attention_scale=scalar**-0.5,
            attn_softcap=d.get("attn_logit_softcapping"),
            final_softcap=d.get("final_logit_softcapping"),
            gelu_approximate="none" if activation in _EXACT_GELU else "tanh",
            local_rope_theta=local_theta,
            global_rope=global_rope or (config.rope_theta, config.rope_scaling),
        )


def _gemma3_ropes(d: dict[str, Any]) -> tuple[float, tuple[float, RopeScaling]]:
    """(local rope base, (global rope base, global scaling)) from a transformers 5 per-layer-type
    `rope_parameters` or a transformers 4 config (rope_theta + rope_scaling, rope_local_base_freq)."""
    params = d.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention", {})
        return float(local.get("rope_theta", 10000.0)), (float(full["rope_theta"]), RopeScaling.from_dict(full))
    global_theta = float(params.get("rope_theta", d.get("rope_theta", 1_000_000.0)))
    scaling = RopeScaling.from_dict(d.get("rope_scaling") or params)
    return float(d.get("rope_local_base_freq", 10000.0)), (global_theta, scaling)


def load_gemma_norm(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
    """Gemma norms scale by (1 + w); storing 1 + w lets the shared RMSNorm scale by it directly."""
    default_weight_loader(param, loaded.float() + 1.0)


class GemmaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.config = config
        self.knobs = GemmaKnobs.from_config(config)
        self.model = GemmaModel(config, self.knobs, ops)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.weight_loader = load_gemma_norm

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        batch: ForwardBatch,
        kv_caches: KVCaches,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, backend)

    @property
    def max_positions(self) -> int:
        return self.model.global_rope.cos_half.shape[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [R, vocab] float32
        cap = self.knobs.final_softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, weights, self.config.tie_word_embeddings)


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, knobs: GemmaKnobs, ops: LayerOps):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # a 0-dim tensor in the model dtype: transformers rounds sqrt(hidden) to it before scaling
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, knobs, ops, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        max_positions = config.max_position_embeddings
        theta, scaling = knobs.global_rope
        self.global_rope = RotaryEmbedding(config.head_dim, theta, scaling, max_positions, ops)
        self.local_rope = None
        if knobs.local_rope_theta is not None:
            self.local_rope = RotaryEmbedding(
                config.head_dim, knobs.local_rope_theta, RopeScaling(), max_positions, ops
            )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, backend: AttentionBackend
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale  # [T, hidden]
        global_tables = self.global_rope.step_tables(positions)
        local_tables = self.local_rope.step_tables(positions) if self.local_rope is not None else global_tables
        residual = None
        for layer, (k_cache, v_cache) in zip(cast(Iterable[GemmaDecoderLayer], self.layers), kv_caches):
            rope = local_tables if layer.self_attn.sliding_window else global_tables
            hidden, residual = layer(hidden, residual, rope, k_cache, v_cache, backend)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, knobs: GemmaKnobs, ops: LayerOps, layer: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, ops)
        self.self_attn = LlamaAttention(
            config,
            ops,
            scale=knobs.attention_scale,
            sliding_window=config.sliding_window_of(layer),
            softcap=knobs.attn_softcap,
        )
        # Gemma 1 names its pre-MLP norm post_attention_layernorm (as Llama); Gemma 2/3 norm the
        # attention output with it and have a pre- and a post-feedforward norm besides.
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops)
        self.sandwich_norms = knobs.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, ops)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, ops)
        self.mlp = GemmaMLP(config, knobs.gelu_approximate)
        self.ops = ops

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeTables,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (hidden, residual): the stream is their sum, as in LlamaDecoderLayer."""
        qkv, residual = self.ops.rms_norm_linear(hidden, residual, self.input_layernorm, self.self_attn.qkv_proj)
        hidden = self.self_attn(qkv, rope, k_cache, v_cache, backend)
        pre_mlp_norm = self.post_attention_layernorm
        if self.sandwich_norms:
            hidden, _ = self.post_attention_layernorm(hidden)
            pre_mlp_norm = self.pre_feedforward_layernorm
        gate_up, residual = self.ops.rms_norm_linear(hidden, residual, pre_mlp_norm, self.mlp.gate_up_proj)
        hidden = self.mlp(gate_up)
        if self.sandwich_norms:
            hidden, _ = self.post_feedforward_layernorm(hidden)
        return hidden, residual


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig, gelu_approximate: str):
        super().__init__()
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2, config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, config.mlp_bias)
        self.gelu_approximate = gelu_approximate

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up_proj's output [T, 2 * I] -> [T, hidden]."""
        if gate_up.is_cuda and self.gelu_approximate == "tanh":
            return self.down_proj(silu_mul(gate_up, gelu_tanh=True))  # one kernel instead of three
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.gelu_approximate) * up)
