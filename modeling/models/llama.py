"""The Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

Reads top to bottom like gpt-fast's model.py: the causal LM, the decoder layer, attention, MLP.
Input is the step's flat token batch; attention goes through the backend chosen at startup.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from modeling.attention.base import AttentionBackend
from modeling.config import ModelConfig
from modeling.forward_batch import ForwardBatch
from modeling.layers.embedding import LMHead, VocabEmbedding
from modeling.layers.linear import Linear, MergedLinear, QKVLinear
from modeling.layers.norm import RMSNorm
from modeling.layers.ops import TORCH_OPS, LayerOps
from modeling.layers.rotary import RotaryEmbedding
from modeling.models.weight_names import load_packed_weights

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v [num_slots, num_kv_heads, head_dim]
RopeTables = tuple[torch.Tensor, ...]  # whatever the chosen LayerOps.rope_tables builds


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS, decoder_layer: type[nn.Module] | None = None):
        """decoder_layer: built as decoder_layer(config, ops, layer index); the MoE families pass theirs."""
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, ops, decoder_layer or LlamaDecoderLayer)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        batch: ForwardBatch,
        kv_caches: KVCaches,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Returns the final hidden states [T, hidden]; logits come from compute_logits on R rows."""
        return self.model(input_ids, positions, kv_caches, backend)

    @property
    def max_positions(self) -> int:
        """Positions the rotary cache covers (the trained context, longer with dynamic scaling)."""
        return self.model.rotary_emb.cos_half.shape[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [R, hidden] -> [R, vocab] float32
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF name, tensor) pairs into the parameters, fusing q/k/v and gate/up on the way."""
        load_packed_weights(self, weights, self.config.tie_word_embeddings)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: LayerOps, decoder_layer: type[nn.Module]):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(decoder_layer(config, ops, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings, ops
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, backend: AttentionBackend
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary_emb.step_tables(positions)  # gathered once, shared by every layer
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, rope, k_cache, v_cache, backend)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: LayerOps, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(config, ops, sliding_window=config.sliding_window_of(layer))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = LlamaMLP(config, ops)
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
        # Each norm travels with the projection after it (and the residual add of the previous
        # sub-block with the norm): one op each, which the Triton ops fuse into one kernel at batch 1.
        qkv, residual = self.ops.rms_norm_linear(hidden, residual, self.input_layernorm, self.self_attn.qkv_proj)
        hidden = self.self_attn(qkv, rope, k_cache, v_cache, backend)
        gate_up, residual = self.ops.rms_norm_linear(
            hidden, residual, self.post_attention_layernorm, self.mlp.gate_up_proj
        )
        return self.mlp(gate_up), residual


class LlamaAttention(nn.Module):
    """Also Gemma's: `scale`, `sliding_window` and `softcap` are per-layer switches (None = the default)."""

    def __init__(
        self,
        config: ModelConfig,
        ops: LayerOps,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = scale or config.head_dim**-0.5
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.qk_size = (config.num_heads + config.num_kv_heads) * config.head_dim
        self.qkv_proj = QKVLinear(
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.qkv_bias
        )
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size, config.o_proj_bias)
        self.ops = ops
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 * H_kv) * D]: qkv_proj's output (the layer runs it with the norm)
        rope: RopeTables,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = qkv.shape[0]
        qk = qkv[:, : self.qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, _ = self.q_norm(qk[:, : self.num_heads])
            k, _ = self.k_norm(qk[:, self.num_heads :])
            qk = torch.cat((q, k), dim=1)
        out = backend.rotate_store_and_attend(
            qk, v, rope, self.ops, k_cache, v_cache, self.scale, self.sliding_window, self.softcap
        )  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: LayerOps):
        super().__init__()
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2, config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, config.mlp_bias)
        self.ops = ops

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up_proj's output [T, 2 * I] (the layer runs it with the norm) -> [T, hidden]."""
        return self.ops.silu_mul_linear(gate_up, self.down_proj)
