"""Mllama (Llama 3.2 Vision) through transformers' own modules: its self-attention layers run on our paged KV cache
as the transformers fallback runs any decoder (models/transformers_fallback.py); its cross-attention layers attend
from the tokens of each request with images to that request's image keys and values, which the engine makes once
per request (tgi_compat/router/cross_attention.py) from the vision states encoded here, and keeps beside the KV
cache. Rows of requests without images skip those layers, as transformers' model does when it has no image; within
a request, which keys a row attends to and which rows drop the layer's MLP output are transformers' (its
cross-attention mask and full_text_row_masked_out_mask).

Under tensor parallelism (models/transformers_sharding.py) the cross-attention layers split by heads as the
self-attention layers do, so each rank's image keys and values hold its KV heads only; every rank makes its own from
the same vision states (rank 0's, sent with the step: parallel/cross_broadcast.py), the vision tower staying whole."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.forward_batch import CrossAttention, ForwardBatch
from tgi_compat.modeling.layers.ops import TORCH_OPS, LayerOps
from tgi_compat.modeling.models.transformers_fallback import KVCacheStep
from tgi_compat.modeling.models.transformers_vlm import TransformersForImageTextToText
from tgi_compat.modeling.parallel import NO_TP, TensorParallel

# transformers (5.25) gives Mllama no tensor-parallel plan: Llama's, with the cross-attention split by heads too
_SPLITS = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
_MLP = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
TP_PLAN = {f"layers.*.{attn}.{name}": style for attn in ("self_attn", "cross_attn") for name, style in _SPLITS.items()}
TP_PLAN |= {f"layers.*.mlp.{name}": style for name, style in _MLP.items()}


class MllamaForConditionalGeneration(TransformersForImageTextToText):
    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TensorParallel = NO_TP):
        super().__init__(config, ops, tp)
        text: Any = self.text_model()
        self.cross_layers: list[int] = list(text.cross_attention_layers)
        self.max_tiles: int = self.hf.config.vision_config.max_num_tiles
        # our KV cache holds the self-attention layers only (ModelConfig.num_layers): their attention reads its
        # cache by layer_idx, which transformers uses for nothing else here
        own = [layer for i, layer in enumerate(text.layers) if i not in self.cross_layers]
        for index, layer in enumerate(own):
            layer.self_attn.layer_idx = index
        keys = self.max_tiles * self.hf.model.vision_model.num_patches
        # the most KV heads a rank holds (shard_heads: an even split, or one each where they are fewer than ranks)
        kv_heads = -(-config.num_kv_heads // tp.size)
        per_key = len(self.cross_layers) * 2 * kv_heads * config.head_dim * self.hf.dtype.itemsize
        self.image_kv_bytes = keys * per_key

    def tp_plan(self, text_config: Any) -> dict[str, str] | None:
        return TP_PLAN

    def build_shard(self, model_class: Any, hf_config: Any, options: dict[str, Any]) -> nn.Module:
        """Mllama's attention takes its head_dim as hidden_size / heads, which this rank's fewer heads would make
        wrong: the model is built on the meta device, its attention resized to this rank's heads of the whole
        head_dim, then given (empty) memory; its only buffers, the rotary's, are made again."""
        text_config = hf_config.get_text_config()
        head_dim = self.config.head_dim
        with torch.device("meta"):
            hf = model_class.from_config(hf_config, **options)
            for i, layer in enumerate(hf.model.language_model.layers):
                cross = i in text_config.cross_attention_layers
                _resize_heads(layer.cross_attn if cross else layer.self_attn, head_dim, text_config, cross)
        device = torch.get_default_device()
        hf.to_empty(device=device)
        rotary = hf.model.language_model.rotary_emb
        hf.model.language_model.rotary_emb = type(rotary)(config=text_config)  # on the default device
        return hf

    def run_text(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, batch: ForwardBatch, step: KVCacheStep
    ) -> torch.Tensor:
        text: Any = self.text_model()
        hidden = text.embed_tokens(input_ids)[None]
        rotary = text.rotary_emb(hidden, position_ids=position_ids)
        for i, layer in enumerate(text.layers):
            if i not in self.cross_layers:
                hidden = layer(
                    hidden,
                    attention_mask=None,
                    position_ids=position_ids,
                    position_embeddings=rotary,
                    kv_cache_step=step,
                )
            elif batch.cross is not None:  # else no row reads an image: transformers skips the layer too
                hidden = _cross_attend(layer, self.cross_layers.index(i), hidden[0], batch.cross)[None]
        return text.norm(hidden)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Padded to the embedding's rows (ModelConfig.vocab_size), which no token is sampled from (sharded:
        TextModelShard.vocab_block pads this rank's block so)."""
        logits = super().compute_logits(hidden)
        if self.shard is not None:
            return logits
        return F.pad(logits, (0, self.config.vocab_size - logits.shape[-1]), value=float("-inf"))

    def encode_processed(self, processed: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        # kept on the host by the encoder cache (50 MiB an image for Llama-3.2-11B-Vision): a request's keys are made
        # from them once, on the device (cross_kv)
        return [states.cpu() for states in self.image_states(self.hf, processed)]

    @staticmethod
    @torch.inference_mode()
    def image_states(hf: Any, processed: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """transformers' Mllama `hf` on MllamaImageProcessor's pixel_values [N, 1, tiles, 3, H, W], aspect_ratio_ids
        and aspect_ratio_mask (one image a sample) -> each image's projected vision states [tiles * patches, hidden],
        its padding tiles' too."""
        model = hf.model
        vision = model.vision_model(
            pixel_values=processed["pixel_values"].to(hf.dtype),
            aspect_ratio_ids=processed["aspect_ratio_ids"],
            aspect_ratio_mask=processed["aspect_ratio_mask"],
        )
        return list(model.multi_modal_projector(vision.last_hidden_state).flatten(1, 3))

    @torch.inference_mode()
    def cross_kv(self, states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A request's images' states [N, hidden] -> each cross-attention layer's keys and values [N, kv_heads, D]."""
        layers: Any = self.text_model().layers
        states = states.to(self.hf.device)
        out = []
        for i in self.cross_layers:
            attn = layers[i].cross_attn
            shape = (len(states), attn.num_key_value_heads, attn.head_dim)
            out.append((attn.k_norm(attn.k_proj(states).view(shape)), attn.v_proj(states).view(shape)))
        return out


def _cross_attend(layer: Any, index: int, hidden: torch.Tensor, cross: CrossAttention) -> torch.Tensor:
    """transformers' MllamaCrossAttentionDecoderLayer (tanh-gated attention, then MLP) on the rows of `hidden` [T, h]
    that cross-attend, each run of them to its keys of the cross layer `index`; the other rows pass unchanged."""
    h = hidden.index_select(0, cross.rows)
    attn = layer.cross_attn
    q = attn.q_norm(attn.q_proj(layer.input_layernorm(h)).view(len(h), attn.num_heads, attn.head_dim))
    out = torch.empty_like(q)
    for run in cross.runs:
        keys, values = run.kv[index]
        lo, hi = run.keys
        rows = q[run.first : run.end].transpose(0, 1)  # [H, n, D]
        k, v = keys[lo:hi].transpose(0, 1), values[lo:hi].transpose(0, 1)  # [kv_heads, L, D]
        attended = F.scaled_dot_product_attention(rows, k, v, scale=attn.scaling, enable_gqa=True)
        out[run.first : run.end] = attended.transpose(0, 1)
    h = h + layer.cross_attn_attn_gate.tanh() * attn.o_proj(out.flatten(1))
    mlp = layer.mlp(layer.post_attention_layernorm(h)) * cross.follows_image
    h = h + layer.cross_attn_mlp_gate.tanh() * mlp
    return hidden.index_copy(0, cross.rows, h)


def _resize_heads(attn: Any, head_dim: int, text_config: Any, cross: bool) -> None:
    """An attention module built on the meta device at this rank's heads (`text_config`'s) -> the same heads of
    `head_dim`: its projections, scaling and (a `cross`-attention module's) q/k norms over head_dim."""
    hidden, heads, kv_heads = text_config.hidden_size, attn.num_heads, attn.num_key_value_heads
    attn.head_dim, attn.scaling = head_dim, head_dim**-0.5
    attn.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
    attn.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
    attn.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
    attn.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
    if cross:
        attn.q_norm = type(attn.q_norm)(head_dim, eps=text_config.rms_norm_eps)
        attn.k_norm = type(attn.k_norm)(head_dim, eps=text_config.rms_norm_eps)
