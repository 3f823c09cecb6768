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
The attention and the layer body are the shared decoder's (models/decoder.py), with per-layer switches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tgi_compat.modeling.config import ModelConfig, RopeScaling
from tgi_compat.modeling.layers.linear import default_weight_loader
from tgi_compat.modeling.layers.norm import RMSNorm
from tgi_compat.modeling.layers.ops import TORCH_OPS, LayerOps, sum_now
from tgi_compat.modeling.layers.rotary import RotaryEmbedding
from tgi_compat.modeling.layers.triton_ops import triton_gelu_tanh_mul_linear
from tgi_compat.modeling.models.decoder import Attention, DecoderForCausalLM, DecoderLayer, DecoderModel
from tgi_compat.modeling.models.llama import GatedMLP
from tgi_compat.modeling.parallel import NO_TP, TensorParallel
from tgi_compat.modeling.weights.lazy import LazyTensor, take

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


def load_gemma_norm(param: nn.Parameter, loaded: torch.Tensor | LazyTensor, shard: object = None) -> None:
    """Gemma norms scale by (1 + w); storing 1 + w lets the shared RMSNorm scale by it directly."""
    default_weight_loader(param, take(loaded).float() + 1.0)


class GemmaForCausalLM(DecoderForCausalLM):
    supports_tensor_parallel = True

    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TensorParallel = NO_TP):
        knobs = GemmaKnobs.from_config(config)
        theta, scaling = knobs.global_rope
        max_positions = config.max_position_embeddings
        local_rope = None
        if knobs.local_rope_theta is not None:
            local_rope = RotaryEmbedding(config.head_dim, knobs.local_rope_theta, RopeScaling(), max_positions, ops)
        model = DecoderModel(
            config,
            ops,
            (gemma_layer(config, knobs, ops, i, tp) for i in range(config.num_layers)),
            RotaryEmbedding(config.head_dim, theta, scaling, max_positions, ops),
            tp=tp,
            embed_scale=config.hidden_size**0.5,
            local_rotary_emb=local_rope,
        )
        super().__init__(config, model, tp)
        self.knobs = knobs
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.weight_loader = load_gemma_norm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()  # [R, vocab]: the cap's tanh in float32
        cap = self.knobs.final_softcap
        return cap * torch.tanh(logits / cap) if cap else logits


def gemma_layer(
    config: ModelConfig, knobs: GemmaKnobs, ops: LayerOps, layer: int, tp: TensorParallel = NO_TP
) -> DecoderLayer:
    attention = Attention(
        config,
        ops,
        scale=knobs.attention_scale,
        sliding_window=config.sliding_window_of(layer),
        softcap=knobs.attn_softcap,
        tp=tp,
    )
    mlp = GemmaMLP(config, ops, knobs.gelu_approximate, tp)
    # Gemma 1 is pre-norm like Llama (its pre-MLP norm is named post_attention_layernorm too)
    layer_cls = SandwichNormDecoderLayer if knobs.sandwich_norms else DecoderLayer
    return layer_cls(config, ops, attention, mlp)


class SandwichNormDecoderLayer(DecoderLayer):
    """Gemma 2/3: post_attention_layernorm norms the attention output, and a pre- and a
    post-feedforward norm wrap the MLP.

    Each post-sublayer norm runs with the residual add and the next pre-norm as one op (at a decode row, in
    the next projection's GEMV): the attention output's inside the layer, the MLP output's in the next
    layer (`output_norm`), so a layer launches no norm kernel of its own."""

    def __init__(self, config: ModelConfig, ops: LayerOps, self_attn: Attention, mlp: GemmaMLP):
        super().__init__(config, ops, self_attn, mlp)
        self.mlp: GemmaMLP = mlp
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def output_norm(self) -> RMSNorm:
        return self.post_feedforward_layernorm

    def feed_forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, sum_over: TensorParallel | None
    ) -> tuple[torch.Tensor, torch.Tensor, TensorParallel | None]:
        """(the MLP output, not yet post-feedforward-normed; the stream up to it; None: the output is summed)."""
        return self.mlp.norm_and_forward(
            hidden, residual, self.pre_feedforward_layernorm, sum_over, hidden_norm=self.post_attention_layernorm
        )


class GemmaMLP(GatedMLP):
    """GeGLU: gate|up, GELU(gate) * up, down. Not a LlamaMLP: LoRA adapts only SwiGLU feed-forwards."""

    def __init__(self, config: ModelConfig, ops: LayerOps, gelu_approximate: str, tp: TensorParallel = NO_TP):
        super().__init__(config, ops, tp)
        self.gelu_approximate = gelu_approximate

    def norm_and_forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        norm: RMSNorm,
        sum_over: TensorParallel | None,
        hidden_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, TensorParallel | None]:
        """FeedForward's, and with `hidden_norm` (the sandwich layers' post-attention norm) the stream is
        residual + hidden_norm(hidden) instead. The output is summed over the ranks here."""
        if hidden_norm is None:
            gate_up, residual = self.ops.rms_norm_linear(hidden, residual, norm, self.gate_up_proj, sum_over)
        else:
            hidden = sum_now(hidden, sum_over)
            gate_up, residual = self.ops.norm_add_norm_linear(hidden, hidden_norm, residual, norm, self.gate_up_proj)
        if gate_up.is_cuda and self.gelu_approximate == "tanh":  # at a decode row, one GEMV for all of it
            out = triton_gelu_tanh_mul_linear(gate_up, self.down_proj)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            out = self.down_proj(F.gelu(gate, approximate=self.gelu_approximate) * up)
        return self.tp.all_reduce(out), residual, None
