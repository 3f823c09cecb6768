"""Gemma3ForConditionalGeneration: the Gemma 3 text model (models/gemma.py) beside its vision encoder
(modeling/vision/gemma3.py). The text model sees an image as its placeholder tokens, whose embeddings the
step's ForwardBatch.images replace, and which attend to each other both ways during prefill."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import ClassVar

import torch

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.layers.ops import TORCH_OPS, LayerOps
from tgi_compat.modeling.models.gemma import GemmaForCausalLM
from tgi_compat.modeling.models.weight_names import fused_name, load_packed_weights
from tgi_compat.modeling.parallel import NO_TP, TensorParallel
from tgi_compat.modeling.vision.gemma3 import Gemma3ImageTokens, Gemma3VisionEncoder
from tgi_compat.modeling.weights.lazy import LazyTensor

VISION_PREFIX = "vision."  # weights.loader.text_model_weights names the encoder's tensors under it


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    bidirectional_images: ClassVar[bool] = True  # an image's soft tokens, during prefill

    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TensorParallel = NO_TP):
        super().__init__(config, ops, tp)
        assert config.multimodal_hf_config is not None  # set by ModelConfig.text_model_of
        self.vision = Gemma3VisionEncoder(config.multimodal_hf_config)  # whole on every rank
        self.image_tokens = Gemma3ImageTokens.from_hf_config(config.multimodal_hf_config)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, tokens_per_image, hidden]: the rows of each image's placeholders."""
        return self.vision(pixel_values)

    def encode_processed(self, processed: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Gemma3ImageProcessor's tensors -> each image's rows [tokens_per_image, hidden]."""
        return list(self.encode_images(processed["pixel_values"]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None:
        load_packed_weights(self, weights, self.config.tie_word_embeddings, _resolve)


def _resolve(name: str) -> tuple[str, object]:
    # SigLIP's q/k/v stay apart: only the text model's are fused
    return (name, None) if name.startswith(VISION_PREFIX) else fused_name(name)
