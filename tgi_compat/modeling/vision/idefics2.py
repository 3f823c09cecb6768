"""Idefics2's image text (served by the transformers fallback, models/transformers_vlm.py), as TGI's router and
model server both write it: `<fake_token_around_image>` + N `<image>` + `<fake_token_around_image>`, five times over
when the image processor splits images (four crops, then the whole image), and any two `<fake_token_around_image>`s
in a row of the prompt merged into one (adjacent images share it). N is the perceiver resampler's latents: TGI
hard-codes 64, which every released checkpoint has. Only the `<image>`s take encoder rows (each crop's latents in
order, the whole image's last); the `<fake_token_around_image>`s between them keep their embeddings
(PromptImage.embeds)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FAKE, IMAGE = "<fake_token_around_image>", "<image>"
_SPLIT_IMAGES = 4 + 1  # the processor's four crops and the whole image


@dataclass(frozen=True, slots=True)
class Idefics2ImageTokens:
    image_token_id: int
    latents: int  # `<image>`s per crop: the perceiver resampler's latents
    splitting: bool  # the image processor's do_image_splitting

    @classmethod
    def from_checkpoint(cls, d: dict[str, Any], folder: str) -> Idefics2ImageTokens:
        """From config.json `d` and the checkpoint's preprocessor_config.json (the processor the encoder runs)."""
        from transformers import Idefics2Config

        from tgi_compat.modeling.vision.processors import image_processor

        c = Idefics2Config(**{key: value for key, value in d.items() if key != "model_type"})
        perceiver: Any = c.perceiver_config  # a config object once Idefics2Config has read it
        splitting = bool(image_processor(folder).do_image_splitting)
        return cls(c.image_token_id, perceiver.resampler_n_latents, splitting)

    @property
    def count(self) -> int:
        """An image's `<image>`s, whatever its size."""
        return self.latents * (_SPLIT_IMAGES if self.splitting else 1)

    @property
    def text(self) -> str:
        run = IMAGE * self.latents
        return FAKE + f"{run}{FAKE}" * (_SPLIT_IMAGES if self.splitting else 1)

    @staticmethod
    def merge_fakes(prompt: str) -> str:
        """TGI's fix-up of the whole prompt (its image_tokens_fixup): two fake tokens in a row become one."""
        return prompt.replace(FAKE + FAKE, FAKE)
