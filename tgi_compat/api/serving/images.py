"""A vision model's prompt, as TGI's router builds it: each `![](...)` is loaded (fetched or decoded; the first
failure refuses the request) and replaced by the model's image text, whose placeholder tokens the engine fills
with the image's encoder rows. Gemma 3's image text is TGI's `\\n\\n<start_of_image>` + N `<image_soft_token>`
+ `<end_of_image>\\n\\n`; a text model never comes here, so its prompts keep the markdown as text, as in TGI."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tgi_compat.api.protocol.errors import validation_error
from tgi_compat.api.protocol.images import DecodedImage, ImageRef, split_prompt
from tgi_compat.api.serving.image_fetch import ImageFetcher
from tgi_compat.modeling.config import ModelConfig
from tgi_compat.router.images import PromptImage

_GEMMA3_IMAGE = "\n\n<start_of_image>{}<end_of_image>\n\n"


@dataclass(frozen=True, slots=True)
class VisionPrompts:
    image_text: str  # what one image becomes in the text the tokenizer reads
    image_token_id: int  # the placeholder token the encoder's rows replace
    tokens_per_image: int
    bidirectional: bool  # placeholders attend to each other both ways (Gemma 3)
    fetcher: ImageFetcher

    @classmethod
    def of(cls, model: ModelConfig, fetcher: ImageFetcher) -> VisionPrompts | None:
        """The prompts of a checkpoint whose images we serve; None for any other (its markdown stays text)."""
        if model.multimodal_architecture != "Gemma3ForConditionalGeneration" or model.multimodal_hf_config is None:
            return None
        from tgi_compat.modeling.vision.gemma3 import Gemma3ImageTokens

        tokens = Gemma3ImageTokens.from_hf_config(model.multimodal_hf_config)
        text = _GEMMA3_IMAGE.format("<image_soft_token>" * tokens.tokens_per_image)
        return cls(text, tokens.image_token_id, tokens.tokens_per_image, True, fetcher)

    async def expand(self, inputs: str) -> tuple[str, list[DecodedImage]]:
        """(the text to tokenize, its images in order), fetching off the event loop."""
        chunks = split_prompt(inputs)
        refs = [chunk for chunk in chunks if isinstance(chunk, ImageRef)]
        if not refs:
            return inputs, []
        loaded = await asyncio.to_thread(lambda: [self.fetcher.load(ref) for ref in refs])
        return "".join(chunk if isinstance(chunk, str) else self.image_text for chunk in chunks), loaded

    def place(self, ids: list[int], loaded: list[DecodedImage]) -> list[PromptImage]:
        """The engine's images of the tokenized (maybe left-truncated) prompt: each placeholder run is one of the
        last images; a run cut by truncation, or placeholder tokens typed as text, refuse the request."""
        runs: list[tuple[int, int]] = []  # (first position, length)
        for position, token in enumerate(ids):
            if token != self.image_token_id:
                continue
            if runs and sum(runs[-1]) == position:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((position, 1))
        if len(runs) > len(loaded) or any(length != self.tokens_per_image for _, length in runs):
            raise validation_error("the prompt's image placeholder tokens do not match its images")
        images = loaded[len(loaded) - len(runs) :]
        return [
            PromptImage(start, length, image.digest, image.data, self.bidirectional)
            for (start, length), image in zip(runs, images)
        ]
