"""Llama 4 (Scout, Maverick) through transformers' modeling on our KV cache (models/transformers_fallback.py).

Its local layers attend within chunks of `attention_chunk_size` tokens: the fallback passes each layer's chunk to
our backend (AttentionParams.attention_chunk), as transformers' chunked mask does. Its NoPE layers scale their
queries by position ("attention temperature tuning"); transformers counts those positions from 0 in each forward
(its cache's length), which holds for none of our flat batch's tokens but a whole prompt's, so that scaling is
switched off in its modules and applied here from each token's own position (KVCacheStep.query_scales)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.layers.ops import TORCH_OPS, LayerOps
from tgi_compat.modeling.models.transformers_fallback import TransformersForCausalLM


@dataclass(frozen=True, slots=True)
class QueryTemperature:
    """Llama 4's attention temperature tuning: the queries of `layers` times log1p(floor((p + 1) / floor_scale))
    * attn_scale + 1 at position p."""

    layers: tuple[int, ...]
    attn_scale: float
    floor_scale: float

    @classmethod
    def take_from(cls, text_model: Any) -> QueryTemperature:
        """The tuned layers of transformers' Llama4TextModel, their own tuning switched off."""
        layers = []
        for index, layer in enumerate(text_model.layers):
            attention: Any = layer.self_attn
            if attention.attn_temperature_tuning and not attention.use_rope:
                attention.attn_temperature_tuning = False
                layers.append(index)
        config: Any = text_model.config
        return cls(tuple(layers), config.attn_scale, config.floor_scale)

    def scales(self, positions: torch.Tensor) -> dict[int, torch.Tensor]:
        if not self.layers:
            return {}
        scale = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return dict.fromkeys(self.layers, scale)


class Llama4ForCausalLM(TransformersForCausalLM):
    """The text-only checkpoint (`Llama4ForCausalLM`)."""

    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS):
        super().__init__(config, ops)
        self.temperature = QueryTemperature.take_from(self.text_model())

    def text_model(self) -> nn.Module:
        return self.hf.model  # its base_model_prefix names no attribute of the text-only class

    def query_scales(self, positions: torch.Tensor) -> Mapping[int, torch.Tensor]:
        return self.temperature.scales(positions)
