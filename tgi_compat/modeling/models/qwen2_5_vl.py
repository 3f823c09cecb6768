"""Qwen2_5_VLForConditionalGeneration and Qwen2VLForConditionalGeneration, one family: the Qwen2 text model
(models/llama.py's layers) with M-RoPE (layers/mrope.py) beside the checkpoint's vision encoder
(modeling/vision/qwen2_5_vl.py: Qwen2.5-VL's windowed tower or Qwen2-VL's). The text model sees an image as its
`<|image_pad|>` placeholders, whose embeddings the step's ForwardBatch.images replace (causal attention, as in
transformers); a step with images or with text after one rotates by ForwardBatch.rope_positions (t, h, w)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import ClassVar

import torch

from tgi_compat.modeling.attention.base import AttentionBackend
from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.forward_batch import ForwardBatch
from tgi_compat.modeling.layers.mrope import MRotaryEmbedding
from tgi_compat.modeling.layers.ops import TORCH_OPS, LayerOps
from tgi_compat.modeling.models.decoder import DecoderForCausalLM, DecoderModel, KVCaches
from tgi_compat.modeling.models.llama import llama_layer
from tgi_compat.modeling.models.weight_names import fused_name, load_packed_weights
from tgi_compat.modeling.parallel import NO_TP, TensorParallel
from tgi_compat.modeling.vision.qwen2_5_vl import VISION_TOWERS, QwenVLImageTokens, QwenVLVisionEncoder
from tgi_compat.modeling.weights.lazy import LazyTensor

VISION_PREFIX = "vision."  # weights.loader.text_model_weights names the encoder's tensors under it
_DEFAULT_MROPE_SECTION = [16, 24, 24]  # transformers' default (both families' released head_dim 128)


class Qwen2_5_VLForConditionalGeneration(DecoderForCausalLM):
    bidirectional_images: ClassVar[bool] = False

    # the text model's layers are Llama's; the vision encoder runs on rank 0 only (the engine's encoder cache), and
    # StepBroadcast carries its rows and the M-RoPE positions to the other ranks
    supports_tensor_parallel = True

    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TensorParallel = NO_TP):
        assert config.multimodal_hf_config is not None and config.multimodal_architecture is not None  # text_model_of
        layers = (llama_layer(config, ops, i, tp) for i in range(config.num_layers))
        rope = MRotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
            ops,
            config.rope_scaling.mrope_section or _DEFAULT_MROPE_SECTION,
        )
        super().__init__(config, DecoderModel(config, ops, layers, rope, tp=tp), tp)
        tower = VISION_TOWERS[config.multimodal_architecture]
        self.vision = QwenVLVisionEncoder(config.multimodal_hf_config, tower)
        self.image_tokens = QwenVLImageTokens.from_hf_config(config.multimodal_hf_config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: KVCaches,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        rope_positions = positions if batch.rope_positions is None else batch.rope_positions
        return self.model(input_ids, rope_positions, kv_caches, backend, batch.images)

    def encode_processed(self, processed: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The image processor's outputs -> each image's placeholder rows [(h / 2) * (w / 2), hidden]."""
        return self.vision(processed)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None:
        load_packed_weights(self, weights, self.config.tie_word_embeddings, _resolve)


def _resolve(name: str) -> tuple[str, object]:
    # the vision blocks' fused qkv and their MLP stay as transformers has them: only the text model's are fused
    return (name, None) if name.startswith(VISION_PREFIX) else fused_name(name)
