"""The Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

Reads top to bottom like gpt-fast's model.py: the causal LM, the decoder layer, attention, MLP.
Input is the step's flat token batch; attention goes through the backend chosen at startup.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

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
from modeling.parallel import NO_TP, TensorParallel, shard_heads, split_evenly

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v [num_slots, num_kv_heads, head_dim]
RopeTables = tuple[torch.Tensor, ...]  # whatever the chosen LayerOps.rope_tables builds


class LlamaForCausalLM(nn.Module):
    # Column/row-parallel attention and MLP, vocab-parallel embedding. Subclasses whose layers are
    # not built from LlamaAttention + LlamaMLP set it False.
    supports_tensor_parallel = True

    def __init__(
        self,
        config: ModelConfig,
        ops: LayerOps = TORCH_OPS,
        tp: TensorParallel = NO_TP,
        decoder_layer: Callable[..., nn.Module] | None = None,
    ):
        """decoder_layer: built as decoder_layer(config, ops, layer index); the MoE families pass theirs."""
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, ops, decoder_layer or functools.partial(LlamaDecoderLayer, tp=tp), tp)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied, tp=tp)

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
    def __init__(self, config: ModelConfig, ops: LayerOps, decoder_layer: Callable[..., nn.Module], tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
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
    def __init__(self, config: ModelConfig, ops: LayerOps, layer: int, tp: TensorParallel = NO_TP):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(config, ops, sliding_window=config.sliding_window_of(layer), tp=tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = LlamaMLP(config, ops, tp)
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
    """Also Gemma's: `scale`, `sliding_window` and `softcap` are per-layer switches (None = the default).
    Column-parallel q|k|v and row-parallel o under tensor parallelism: this rank's heads only."""

    def __init__(
        self,
        config: ModelConfig,
        ops: LayerOps,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        *,
        tp: TensorParallel = NO_TP,
    ):
        super().__init__()
        heads = shard_heads(config.num_heads, config.num_kv_heads, tp)
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = scale or config.head_dim**-0.5
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.qk_size = (self.num_heads + self.num_kv_heads) * config.head_dim
        self.qkv_proj = QKVLinear(
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.qkv_bias, tp=tp
        )
        self.o_proj = Linear(
            config.num_heads * config.head_dim,
            config.hidden_size,
            config.o_proj_bias,
            in_slice=heads.q_heads.scaled(config.head_dim),
            tp=tp,
        )
        self.tp = tp
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
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim)))


class LlamaMLP(nn.Module):
    """Column-parallel gate|up and row-parallel down under tensor parallelism."""

    def __init__(self, config: ModelConfig, ops: LayerOps, tp: TensorParallel = NO_TP):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size] * 2, config.mlp_bias, tp=tp)
        self.down_proj = Linear(
            size, config.hidden_size, config.mlp_bias, in_slice=split_evenly(size, tp.size, tp.rank), tp=tp
        )
        self.ops = ops
        self.tp = tp

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up_proj's output [T, 2 * I] (the layer runs it with the norm) -> [T, hidden]."""
        # the all-reduce sits here, not in down_proj: the fused GEMV op reads down_proj's weight directly
        return self.tp.all_reduce(self.ops.silu_mul_linear(gate_up, self.down_proj))
