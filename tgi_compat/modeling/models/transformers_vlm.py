"""A vision-language checkpoint (LLaVA-Next, Idefics3) through transformers' own modeling: its text model runs on our KV
cache as models/transformers_fallback.py runs any decoder, its vision tower and projector are transformers' (sdpa
attention, once per image at admission), and each image's feature rows replace its placeholder tokens' embeddings
(ForwardBatch.images, chunk by chunk under chunked prefill), as transformers' `masked_scatter` does. Idefics3's rows
go to its `<image>`s only, between its row/column tokens (PromptImage.embeds); Idefics2's between its fake tokens."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.forward_batch import ForwardBatch
from tgi_compat.modeling.layers.ops import TORCH_OPS, LayerOps
from tgi_compat.modeling.models.transformers_fallback import ATTENTION_NAME, TransformersForCausalLM
from tgi_compat.modeling.parallel import NO_TP, TensorParallel

# Each family's image rows are get_image_features' pooler_output, one entry per image, as transformers 5.25 (the
# lock's) hands them back; 5.17 gave other shapes, and a step with an image failed (session 36, on the GPU machine).
MIN_TRANSFORMERS = "5.25"


def check_transformers_version(architecture: str) -> None:
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise RuntimeError(
            f"{architecture} runs through transformers' own vision modeling, which needs transformers >= "
            f"{MIN_TRANSFORMERS}; this is {transformers.__version__} (pip install 'transformers>={MIN_TRANSFORMERS}')"
        )


class TransformersForImageTextToText(TransformersForCausalLM):
    bidirectional_images: ClassVar[bool] = False

    def __init__(self, config: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TensorParallel = NO_TP):
        check_transformers_version(config.multimodal_architecture or config.architecture)
        super().__init__(config, ops, tp)

    def model_class(self) -> Any:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText

    @staticmethod
    def attention_implementation() -> dict[str, str]:
        # only the text model attends over our KV cache; the vision tower sees one image's patches at a time
        return {"": "sdpa", "text_config": ATTENTION_NAME, "vision_config": "sdpa"}

    def text_model(self) -> nn.Module:
        return self.hf.model.language_model

    def text_inputs(self, input_ids: torch.Tensor, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        embeds = self.hf.get_input_embeddings()(input_ids)
        if batch.images is not None:
            embeds = embeds.index_copy(0, batch.images.token_index, batch.images.embeds.to(embeds.dtype))
        return {"inputs_embeds": embeds[None]}

    @functools.cached_property
    def _renamings(self) -> list[Any]:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        return [rule for rule in get_model_conversion_mapping(self.hf) if isinstance(rule, WeightRenaming)]

    def model_name(self, name: str) -> str:
        from transformers.core_model_loading import rename_source_key

        return rename_source_key(name, self._renamings, [])[0]

    def encode_processed(self, processed: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        return self.image_rows(self.hf, processed)

    @staticmethod
    @torch.inference_mode()
    def image_rows(hf: Any, processed: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """transformers' LLaVA-Next `hf` on LlavaNextImageProcessor's pixel_values [N, tiles, 3, H, W] and
        image_sizes [N, 2] -> each image's packed rows (tiles, padding cut, newline rows), one per `<image>`
        placeholder (vision/llava_next.py counts them)."""
        c = hf.config
        features = hf.model.get_image_features(
            pixel_values=processed["pixel_values"].to(hf.dtype),
            image_sizes=processed["image_sizes"],
            vision_feature_layer=c.vision_feature_layer,
            vision_feature_select_strategy=c.vision_feature_select_strategy,
        )
        rows: Any = features.pooler_output  # a tuple of each image's rows, though typed as one tensor
        return list(rows)


class Idefics3ForImageTextToText(TransformersForImageTextToText):
    def text_model(self) -> nn.Module:
        return self.hf.model.text_model

    def encode_processed(self, processed: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        return self.idefics3_rows(self.hf, processed)

    @staticmethod
    @torch.inference_mode()
    def idefics3_rows(hf: Any, processed: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """transformers' Idefics3 `hf` on Idefics3ImageProcessor's pixel_values [N, tiles, 3, H, W] (all-zero
        tiles pad an image with fewer) and pixel_attention_mask -> each image's rows: its tiles', then its global
        image's, one per `<image>` (vision/idefics3.py counts them)."""
        features = hf.model.get_image_features(
            pixel_values=processed["pixel_values"].to(hf.dtype),
            pixel_attention_mask=processed["pixel_attention_mask"],
        )
        return list(features.pooler_output)


class Idefics2ForImageTextToText(Idefics3ForImageTextToText):
    """Idefics3's text model and image rows (its get_image_features packs each image's crops as Idefics3's tiles);
    the perceiver resampler between the tower and the text model attends with sdpa too."""

    @staticmethod
    def attention_implementation() -> dict[str, str]:
        return {**TransformersForImageTextToText.attention_implementation(), "perceiver_config": "sdpa"}


class PaliGemmaForImageTextToText(TransformersForImageTextToText):
    """Its text model rotates positions from 1, as transformers' and TGI's do (vision/paligemma.py)."""

    bidirectional_images: ClassVar[bool] = True  # the whole prompt before its text (PrefixLMPrompts)

    def encode_processed(self, processed: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        return self.paligemma_rows(self.hf, processed)

    @staticmethod
    @torch.inference_mode()
    def paligemma_rows(hf: Any, processed: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """transformers' PaliGemma `hf` on SiglipImageProcessor's pixel_values [N, 3, H, W] -> each image's rows:
        the SigLIP tower's last hidden state through the projector, one per `<image>`."""
        features = hf.model.get_image_features(pixel_values=processed["pixel_values"].to(hf.dtype))
        return list(features.pooler_output)

    def text_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions + 1


# the fallback's vision-language class of each checkpoint architecture (config.FALLBACK_VISION_MODELS)
VISION_CLASSES: dict[str, type[TransformersForImageTextToText]] = {
    "LlavaNextForConditionalGeneration": TransformersForImageTextToText,
    "Idefics3ForConditionalGeneration": Idefics3ForImageTextToText,
    "Idefics2ForConditionalGeneration": Idefics2ForImageTextToText,
    "PaliGemmaForConditionalGeneration": PaliGemmaForImageTextToText,
}
