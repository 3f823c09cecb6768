"""Gemma 3's vision encoder: the SigLIP tower and the multimodal projector, transformers' own modules built
from the checkpoint's config.json, so their outputs are transformers' by construction. It runs once per image
(at admission); its rows replace the image's placeholder embeddings in the text model (ForwardBatch.images)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from tgi_compat.modeling.layers.linear import default_weight_loader


@dataclass(frozen=True, slots=True)
class Gemma3ImageTokens:
    """How an image appears in the prompt: TGI's `\\n\\n<start_of_image>` + N soft tokens + `<end_of_image>\\n\\n`."""

    image_token_id: int
    tokens_per_image: int  # 256 in every released checkpoint (TGI hard-codes it)

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> Gemma3ImageTokens:
        return cls(d.get("image_token_index", d.get("image_token_id", 262144)), d.get("mm_tokens_per_image", 256))


class Gemma3VisionEncoder(nn.Module):
    """pixel_values [N, 3, H, W] (Gemma3ImageProcessor's) -> [N, tokens_per_image, text hidden]."""

    def __init__(self, hf_config: dict[str, Any]):
        super().__init__()
        from transformers import AutoModel, Gemma3Config
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        config = Gemma3Config(**{key: value for key, value in hf_config.items() if key != "model_type"})
        dtype = torch.get_default_dtype()  # the runner builds the model under the serving dtype
        self.vision_tower = AutoModel.from_config(config.vision_config, dtype=dtype)
        self.multi_modal_projector = Gemma3MultiModalProjector(config).to(dtype)
        for param in self.parameters():  # loaded by models/weight_names.load_packed_weights, as ours are
            param.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        tower = self.vision_tower(pixel_values=pixel_values.to(self.multi_modal_projector.mm_input_projection_weight))
        return self.multi_modal_projector(tower.last_hidden_state)
