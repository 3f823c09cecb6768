"""The decoder every native family is built from: embedding -> N x (attention, feed-forward) -> norm.

A family file says only what differs: the feed-forward it plugs into each layer (SwiGLU, GeGLU, a
sparse MoE block), Gemma's extra norms, the embedding scale, a second rope for sliding layers and
the final logits. Input is the step's flat token batch; attention goes through the backend chosen
at startup. The residual stream travels as (hidden, residual) whose sum is the stream, so that each
residual add rides with the norm after it (one fused op on GPU). A layer whose output still owes a norm
(Gemma 2/3's post-feedforward norm) says so in `output_norm`: the next layer (or the final norm) runs it
with its own input norm, so that the norm, the add and the next norm are one op too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, cast

import torch
import torch.nn as nn

from tgi_compat.modeling.attention.base import AttentionBackend, AttentionParams, LayerQKV
from tgi_compat.modeling.aux_hidden import AuxHiddenStates, StreamReader
from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.forward_batch import ForwardBatch, ImageEmbeds
from tgi_compat.modeling.layers.embedding import LMHead, VocabEmbedding
from tgi_compat.modeling.layers.linear import Linear, QKVLinear
from tgi_compat.modeling.layers.norm import RMSNorm
from tgi_compat.modeling.layers.ops import LayerOps, RopeTables, sum_now
from tgi_compat.modeling.layers.rotary import RotaryEmbedding
from tgi_compat.modeling.models.weight_names import load_packed_weights
from tgi_compat.modeling.parallel import NO_TP, TensorParallel, shard_heads
from tgi_compat.modeling.weights.lazy import LazyTensor

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v [num_slots, num_kv_heads, head_dim]


class FeedForward(Protocol):
    """What a decoder layer needs of its MLP (dense, GeGLU or mixture of experts)."""

    def norm_and_forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, sum_over: TensorParallel | None
    ) -> tuple[torch.Tensor, torch.Tensor, TensorParallel | None]:
        """(mlp(norm(hidden + residual)), hidden + residual, sum_over): the MLP takes the norm in, so that it can
        run it with its first projection as one op. `sum_over` (in and out): the ranks over which the hidden
        state is still to be summed (LayerOps.row_parallel_linear), None where it is whole."""
        ...


class Attention(nn.Module):
    """Self-attention on the backend. `scale`, `sliding_window` and `softcap` are per-layer switches
    (None = the default); `config.qk_norm` adds Qwen3/Gemma 3's per-head q/k RMSNorm. Column-parallel
    q|k|v and row-parallel o under tensor parallelism: this rank's heads only."""

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
        self.params = AttentionParams(scale or config.head_dim**-0.5, sliding_window, softcap)
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
    ) -> tuple[torch.Tensor, TensorParallel | None]:
        num_tokens = qkv.shape[0]
        qk = qkv[:, : self.qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = self.ops.qk_norm(qk, self.num_heads, self.q_norm, self.k_norm)
        new = LayerQKV(qk, v, rope, self.ops, k_cache, v_cache)
        out = backend.rotate_store_and_attend(new, self.params)  # [T, H, D]
        flat = out.reshape(num_tokens, self.num_heads * self.head_dim)
        return self.ops.row_parallel_linear(flat, self.o_proj, self.tp)  # (output, ranks still to sum it over)


class DecoderLayer(nn.Module):
    """Pre-norm: input norm -> attention -> post-attention norm -> MLP, with the residual adds fused
    into the norms. Module names are the checkpoint's (`model.layers.N.<name>`)."""

    def __init__(self, config: ModelConfig, ops: LayerOps, self_attn: Attention, mlp: FeedForward):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = mlp
        self.ops = ops

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeTables,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
        owed_norm: RMSNorm | None = None,  # the previous layer's output_norm, still to apply to hidden
        sum_over: TensorParallel | None = None,  # the ranks hidden is still to be summed over (None: it is whole)
        read_stream: StreamReader | None = None,  # gets the stream entering the layer, whole
    ) -> tuple[torch.Tensor, torch.Tensor, TensorParallel | None]:
        # Each norm travels with the projection after it (and the residual add of the previous
        # sub-block, and under tensor parallelism the sum over the ranks, with the norm): one op each, which
        # the Triton ops fuse into one kernel where they can.
        qkv_proj = self.self_attn.qkv_proj
        if owed_norm is None:
            qkv, residual = self.ops.rms_norm_linear(hidden, residual, self.input_layernorm, qkv_proj, sum_over)
        else:
            assert residual is not None  # a layer before this one owes the norm
            hidden = sum_now(hidden, sum_over)
            qkv, residual = self.ops.norm_add_norm_linear(hidden, owed_norm, residual, self.input_layernorm, qkv_proj)
        if read_stream is not None:
            read_stream(residual)
        hidden, sum_over = self.self_attn(qkv, rope, k_cache, v_cache, backend)
        return self.feed_forward(hidden, residual, sum_over)

    def output_norm(self) -> RMSNorm | None:
        """The norm this layer's output hidden still needs before it joins the stream; None: it needs none."""
        return None

    def feed_forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, sum_over: TensorParallel | None
    ) -> tuple[torch.Tensor, torch.Tensor, TensorParallel | None]:
        """The attention output and the stream so far -> the layer's (hidden, residual, sum_over)."""
        return self.mlp.norm_and_forward(hidden, residual, self.post_attention_layernorm, sum_over)


class DecoderModel(nn.Module):
    """Embedding -> layers -> final norm. `embed_scale` multiplies the embeddings (Gemma's sqrt(hidden));
    `local_rotary_emb`, when given, rotates the sliding-window layers (Gemma 3) instead of `rotary_emb`."""

    def __init__(
        self,
        config: ModelConfig,
        ops: LayerOps,
        layers: Iterable[DecoderLayer],
        rotary_emb: RotaryEmbedding,
        *,
        tp: TensorParallel = NO_TP,
        embed_scale: float | None = None,
        local_rotary_emb: RotaryEmbedding | None = None,
    ):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        # a 0-dim tensor in the model dtype: transformers rounds the scale to it before multiplying
        self.embed_scale: torch.Tensor | None
        self.register_buffer(
            "embed_scale", None if embed_scale is None else torch.tensor(embed_scale), persistent=False
        )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.rotary_emb = rotary_emb
        self.local_rotary_emb = local_rotary_emb
        # per layer: does it rotate with local_rotary_emb (built once: no lookup per step)
        self.uses_local_rope = tuple(
            local_rotary_emb is not None and layer.self_attn.params.sliding_window is not None
            for layer in self.decoder_layers
        )
        # the norm owed at each layer's input (the layer before's output_norm), then the one owed at the
        # final norm; a tuple, so that the modules are not registered twice
        outputs = [layer.output_norm() for layer in self.decoder_layers]
        self.owed_norms: tuple[RMSNorm | None, ...] = (None, *outputs)
        self.aux_hidden: AuxHiddenStates | None = None  # capture_aux_hidden; None: off
        # per layer, then for the final norm: what reads the stream entering it (the output of the layer before it)
        # into the auxiliary hidden states; None: nothing (all None with them off). Made once, not per forward.
        self.aux_readers: tuple[StreamReader | None, ...] = (None,) * (len(self.layers) + 1)

    def capture_aux_hidden(self, states: AuxHiddenStates) -> None:
        """From now on each forward writes the output of `states.layers` into `states` (an EAGLE-3 head's input)."""
        if any(norm is not None for norm in self.owed_norms):  # (the stream is not hidden + residual there)
            raise ValueError("auxiliary hidden states need a decoder without post-feedforward norms (Llama-like)")
        self.aux_hidden = states
        self.aux_readers = (None, *states.readers(len(self.layers)))

    @property
    def decoder_layers(self) -> Iterable[DecoderLayer]:
        return cast(Iterable[DecoderLayer], self.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        backend: AttentionBackend,
        images: ImageEmbeds | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        if images is not None:  # image features stand in for their placeholders' (scaled) embeddings
            hidden = hidden.index_copy(0, images.token_index, images.embeds.to(hidden.dtype))
        rope = self.rotary_emb.step_tables(positions)  # gathered once, shared by every layer
        local_rope = rope if self.local_rotary_emb is None else self.local_rotary_emb.step_tables(positions)
        residual, sum_over = None, None
        # EAGLE-3: a layer's output is read where the next layer (or the final norm) adds it to the stream, whole:
        # under tensor parallelism the sum over the ranks is only done there (fused with the norm), so reading
        # it as the layer ends would see this rank's part, and summing it earlier would change the arithmetic
        if self.aux_hidden is not None:
            self.aux_hidden.start_step(hidden.shape[0])
        layers = zip(self.layers, self.uses_local_rope, self.owed_norms, kv_caches, self.aux_readers)
        for layer, is_local, owed, (k_cache, v_cache), read_stream in layers:
            hidden, residual, sum_over = layer(
                hidden,
                residual,
                local_rope if is_local else rope,
                k_cache,
                v_cache,
                backend,
                owed,
                sum_over,
                read_stream,
            )
        hidden = sum_now(hidden, sum_over)  # once a step: the last layer's sum on its own
        final_owed = self.owed_norms[-1]
        if final_owed is not None:  # once a step: the last layer's post-feedforward norm on its own
            hidden, _ = final_owed(hidden)
        hidden, stream = self.norm(hidden, residual)
        if (read_last := self.aux_readers[-1]) is not None and stream is not None:
            read_last(stream)
        return hidden


class DecoderStack(nn.Module):
    """A DecoderModel over a step's flat batch: what the causal LMs and the pooling models (models/pooling.py) share."""

    # Column/row-parallel attention and MLP, vocab-parallel embedding: families whose layers are all
    # sharded (Llama's) set it True.
    supports_tensor_parallel = False

    def __init__(self, config: ModelConfig, model: DecoderModel):
        super().__init__()
        self.config = config
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        batch: ForwardBatch,
        kv_caches: KVCaches,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Returns the final hidden states [T, hidden]; logits come from compute_logits on R rows."""
        return self.model(input_ids, positions, kv_caches, backend, batch.images)

    @property
    def max_positions(self) -> int:
        """Positions the rotary cache covers (the trained context, longer with dynamic scaling)."""
        return self.model.rotary_emb.cos_half.shape[0]


class DecoderForCausalLM(DecoderStack):
    """A DecoderModel and its LM head: the CausalLM interface (models/base.py) of every native family."""

    def __init__(self, config: ModelConfig, model: DecoderModel, tp: TensorParallel = NO_TP):
        super().__init__(config, model)
        tied = model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied, tp=tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [R, hidden] -> [R, vocab] in the weights' dtype
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None:
        """Copy (HF name, tensor) pairs into the parameters, fusing q/k/v and gate/up on the way."""
        load_packed_weights(self, weights, self.config.tie_word_embeddings)
