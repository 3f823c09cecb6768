"""A vision model's prompt, as TGI's router builds it: each `![](...)` is loaded (fetched or decoded; the first
failure refuses the request) and replaced by the model's image text, whose placeholder tokens the engine fills
with the image's encoder rows. Gemma 3's image text is TGI's `\\n\\n<start_of_image>` + N `<image_soft_token>`
+ `<end_of_image>\\n\\n`; Qwen2.5-VL's and Qwen2-VL's is `<|vision_start|>` + one `<|image_pad|>` per merged
patch of the image as transformers' processor resizes it + `<|vision_end|>` (what TGI's model server runs; TGI's
router counts the original image's H * W / 196 pads inside Rust's quotes instead, see README); LLaVA-Next's
(transformers fallback) is one `<image>` per row its model packs; Idefics3's (fallback too) interleaves runs of
`<image>`s with row/column tokens (tgi_compat/modeling/vision/idefics3.py), Idefics2's with `<fake_token_around_image>`s
(vision/idefics2.py); Mllama's is one `<|image|>`, which its text cross-attends to
(tgi_compat/router/cross_attention.py). A text model never comes here, so its
prompts keep the markdown as text, as in TGI."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tgi_compat.api.protocol.errors import validation_error
from tgi_compat.api.protocol.images import DecodedImage, ImageRef, Resize, split_prompt
from tgi_compat.api.serving.image_fetch import ImageFetcher
from tgi_compat.modeling.config import QWEN_VL_MODELS, ModelConfig
from tgi_compat.router.images import PromptImage

_GEMMA3_IMAGE = "\n\n<start_of_image>{}<end_of_image>\n\n"
_QWEN_VL_IMAGE = "<|vision_start|>{}<|vision_end|>"  # TGI's server-side text (vlm_causal_lm.py), unquoted


@dataclass(frozen=True, slots=True)
class Placeholders:
    """What one image becomes in the prompt: the text the tokenizer reads, its placeholder tokens' count, and
    their (rows, columns) for an M-RoPE model (tgi_compat.router.mrope); None for any other."""

    text: str
    length: int
    grid: tuple[int, int] | None = None
    tiles: int | None = None  # Mllama's real tiles (tgi_compat/modeling/vision/mllama.py); None for any other


# an image (its decoded size) -> its placeholders: fixed for Gemma 3, by its resized size for Qwen2(.5)-VL
PlaceholdersOf = Callable[[DecodedImage], Placeholders]


@dataclass(frozen=True, slots=True)
class FamilyPrompts:
    """What a family's checkpoint makes of its images (VisionPrompts' fields but the fetcher and the limit)."""

    placeholders: PlaceholdersOf
    image_token_id: int
    bidirectional: bool = False
    interleaved: bool = False
    fixup: Callable[[str], str] | None = None
    kind: type[VisionPrompts] | None = None  # its own prompts class (PaliGemma's); None: the one `of` is called on
    resize: Resize | None = None


@dataclass(frozen=True, slots=True)
class VisionPrompts:
    placeholders: PlaceholdersOf
    image_token_id: int  # the placeholder token the encoder's rows replace
    bidirectional: bool  # placeholders attend to each other both ways (Gemma 3)
    fetcher: ImageFetcher
    max_images: int | None = None  # most images in one request (--max-images); None: no limit, as in TGI
    # placeholders are placed by each image's count, not by runs (Idefics3: row/column tokens between; Mllama: one each)
    interleaved: bool = False
    fixup: Callable[[str], str] | None = None  # TGI's rewrite of the whole expanded prompt (Idefics2's)
    # the host half of the model's image processor, run here where each image is decoded, so that the engine's process
    # only uploads its pixels (Qwen-VL's resize: vision/qwen_vl_pixels.py); None: the engine processes the file
    resize: Resize | None = None

    @classmethod
    def of(
        cls, model: ModelConfig, fetcher: ImageFetcher, folder: str | None = None, max_images: int | None = None
    ) -> VisionPrompts | None:
        """The prompts of a checkpoint whose images we serve; None for any other (its markdown stays text).
        `folder`: the checkpoint's, whose preprocessor_config.json sizes some families' images (_sized_by_checkpoint)."""
        build = _FAMILIES.get(model.multimodal_architecture or "")
        hf_config = model.multimodal_hf_config
        family = None if build is None or hf_config is None else build(hf_config, folder)
        if family is None:
            return None
        kind = family.kind or cls
        return kind(
            family.placeholders,
            family.image_token_id,
            family.bidirectional,
            fetcher,
            max_images,
            interleaved=family.interleaved,
            fixup=family.fixup,
            resize=family.resize,
        )

    async def expand(self, inputs: str, for_engine: bool = True) -> tuple[str, list[DecodedImage]]:
        """(the text to tokenize, its images in order), fetching off the event loop. `for_engine` False: the text
        alone is wanted (/tokenize), so the images are not resized."""
        chunks = split_prompt(inputs)
        refs = [chunk for chunk in chunks if isinstance(chunk, ImageRef)]
        if not refs:
            return self.fixed(self.text_piece(inputs) if inputs else inputs), []
        if self.max_images is not None and len(refs) > self.max_images:  # refused before anything is fetched
            raise validation_error(f"`inputs` must have at most {self.max_images} images. Given: {len(refs)}")
        loaded = await self.fetcher.load_all(refs, self.resize if for_engine else None)
        try:
            texts = iter([self.placeholders(image).text for image in loaded])
        except ValueError as error:  # a size the family's processor refuses (Qwen-VL's: an aspect ratio past 200)
            raise validation_error(f"invalid image: {error}") from error
        return self.fixed("".join(self.text_piece(c) if isinstance(c, str) else next(texts) for c in chunks)), loaded

    def fixed(self, prompt: str) -> str:
        """The prompt as TGI rewrites it once its images are expanded (with or without images)."""
        return prompt if self.fixup is None else self.fixup(prompt)

    def text_piece(self, text: str) -> str:
        """A run of the prompt's text between images, as TGI's model server takes it (PaliGemma wraps it)."""
        return text

    @property
    def adds_special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens to a prompt that asks for them (PaliGemma's never)."""
        return True

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
        if self.interleaved:
            return self._place_interleaved([start + i for start, length in runs for i in range(length)], loaded)
        images = loaded[len(loaded) - len(runs) :] if len(runs) <= len(loaded) else []
        placeholders = [self.placeholders(image) for image in images]
        if len(runs) > len(loaded) or any(length != p.length for (_, length), p in zip(runs, placeholders)):
            raise validation_error("the prompt's image placeholder tokens do not match its images")
        return [
            PromptImage(start, length, image.digest, data, self.bidirectional, p.grid, tiles=p.tiles, resized=resized)
            for (start, length), image, p in zip(runs, images, placeholders)
            for data, resized in [image.payload]
        ]

    def _place_interleaved(self, positions: list[int], loaded: list[DecodedImage]) -> list[PromptImage]:
        """Each of the last images takes its count of the placeholder positions, in order: its span runs from its
        first to its last, the tokens between keep their embeddings. An image cut by truncation leaves a count
        that the images do not add up to, and is refused."""
        placeholders = [self.placeholders(image) for image in loaded]
        counts = [p.length for p in placeholders]
        taken, first = 0, len(loaded)
        while first > 0 and taken < len(positions):
            first -= 1
            taken += counts[first]
        if taken != len(positions):
            raise validation_error("the prompt's image placeholder tokens do not match its images")
        images, at = [], 0
        for image, p in zip(loaded[first:], placeholders[first:]):
            mine, at = positions[at : at + p.length], at + p.length
            offset, length = mine[0], mine[-1] + 1 - mine[0]
            embeds = None if length == p.length else tuple(q - offset for q in mine)
            data, resized = image.payload
            images.append(
                PromptImage(
                    offset,
                    length,
                    image.digest,
                    data,
                    self.bidirectional,
                    embeds=embeds,
                    tiles=p.tiles,
                    resized=resized,
                )
            )
        return images


@dataclass(frozen=True, slots=True)
class PrefixLMPrompts(VisionPrompts):
    """PaliGemma's (tgi_compat/modeling/vision/paligemma.py): `<bos>` + text + `\\n` for each run of text, no special
    tokens added, and the whole prompt one span that attends both ways (`prefix_lm_images`)."""

    def text_piece(self, text: str) -> str:
        from tgi_compat.modeling.vision.paligemma import PaliGemmaImageTokens

        return PaliGemmaImageTokens.text_piece(text)

    @property
    def adds_special_tokens(self) -> bool:
        return False

    def place(self, ids: list[int], loaded: list[DecodedImage]) -> list[PromptImage]:
        return prefix_lm_images(ids, VisionPrompts.place(self, ids, loaded))


def prefix_lm_images(ids: list[int], images: list[PromptImage]) -> list[PromptImage]:
    """The prompt's images (each one run of placeholders, in order) with the first one's span widened to the whole
    prompt, which attends both ways: its rows still go to its own placeholders (`embeds`), and the prefix cache keys
    the span by the hash of all the prompt's ids and images, since each position's K/V depends on all of them."""
    if not images:
        return images
    first = images[0]
    content = hashlib.sha256(" ".join([*(image.digest for image in images), *map(str, ids)]).encode())
    own = range(first.length) if first.embeds is None else first.embeds
    embeds = tuple(first.offset + position for position in own)
    whole = PromptImage(0, len(ids), first.digest, first.data, True, embeds=embeds, key=content.hexdigest())
    return [whole, *images[1:]]


# Each family's builder: (its config.json, its checkpoint folder) -> its prompts; None where it needs the folder and
# has none. Each imports its family's vision module only when chosen: Gemma 3's and Qwen-VL's load the model layers
# and Triton, which the API process otherwise never imports.
FamilyBuilder = Callable[[dict[str, Any], str | None], FamilyPrompts | None]


def _sized_by_checkpoint(build: Callable[[dict[str, Any], str], FamilyPrompts]) -> FamilyBuilder:
    """A family whose images the checkpoint's preprocessor_config.json sizes: no prompts without its folder."""
    return lambda hf_config, folder: None if folder is None else build(hf_config, folder)


def _gemma3(hf_config: dict[str, Any], folder: str | None) -> FamilyPrompts:
    from tgi_compat.modeling.vision.gemma3 import Gemma3ImageTokens

    tokens = Gemma3ImageTokens.from_hf_config(hf_config)
    count = tokens.tokens_per_image
    fixed = Placeholders(_GEMMA3_IMAGE.format("<image_soft_token>" * count), count)
    return FamilyPrompts(lambda _: fixed, tokens.image_token_id, bidirectional=True)


def _qwen_vl(hf_config: dict[str, Any], folder: str) -> FamilyPrompts:
    from tgi_compat.modeling.vision.processors import image_processor
    from tgi_compat.modeling.vision.qwen2_5_vl import PlaceholderGrid, QwenVLImageTokens
    from tgi_compat.modeling.vision.qwen_vl_pixels import DevicePatchify

    processor = image_processor(folder)
    grid_of = PlaceholderGrid.of(processor)
    patchify = DevicePatchify.of(processor)  # the engine's ImageEncoder makes the same one of the same folder

    def qwen(image: DecodedImage) -> Placeholders:
        rows, columns = grid_of(image.height, image.width)
        text = _QWEN_VL_IMAGE.format("<|image_pad|>" * (rows * columns))
        return Placeholders(text, rows * columns, (rows, columns))

    resize = None if patchify is None else Resize(patchify.sides, patchify.resample)
    return FamilyPrompts(qwen, QwenVLImageTokens.from_hf_config(hf_config).image_token_id, resize=resize)


def _llava_next(hf_config: dict[str, Any], folder: str | None) -> FamilyPrompts:
    from tgi_compat.modeling.vision.llava_next import LlavaNextImageTokens

    llava = LlavaNextImageTokens.from_hf_config(hf_config)

    def llava_next(image: DecodedImage) -> Placeholders:
        count = llava.count(image.height, image.width)
        return Placeholders("<image>" * count, count)  # TGI's image text, no markers around it

    return FamilyPrompts(llava_next, llava.image_token_id)


def _idefics3(hf_config: dict[str, Any], folder: str) -> FamilyPrompts:
    from tgi_compat.modeling.vision.idefics3 import Idefics3ImageTokens

    idefics = Idefics3ImageTokens.from_checkpoint(hf_config, folder)

    def idefics3(image: DecodedImage) -> Placeholders:
        return Placeholders(idefics.text(image.height, image.width), idefics.count(image.height, image.width))

    return FamilyPrompts(idefics3, idefics.image_token_id, interleaved=True)


def _idefics2(hf_config: dict[str, Any], folder: str) -> FamilyPrompts:
    from tgi_compat.modeling.vision.idefics2 import Idefics2ImageTokens

    idefics2 = Idefics2ImageTokens.from_checkpoint(hf_config, folder)
    fixed = Placeholders(idefics2.text, idefics2.count)
    return FamilyPrompts(
        lambda _: fixed, idefics2.image_token_id, interleaved=True, fixup=Idefics2ImageTokens.merge_fakes
    )


def _paligemma(hf_config: dict[str, Any], folder: str | None) -> FamilyPrompts:
    from tgi_compat.modeling.vision.paligemma import PaliGemmaImageTokens

    pali = PaliGemmaImageTokens.from_hf_config(hf_config)
    fixed = Placeholders(pali.text, pali.tokens_per_image)
    # interleaved: adjacent images' runs are one run, each image takes its count of it
    return FamilyPrompts(lambda _: fixed, pali.image_token_id, interleaved=True, kind=PrefixLMPrompts)


def _mllama(hf_config: dict[str, Any], folder: str) -> FamilyPrompts:
    from tgi_compat.modeling.vision.mllama import MllamaImageTokens

    mllama = MllamaImageTokens.from_checkpoint(hf_config, folder)

    def mllama_image(image: DecodedImage) -> Placeholders:
        return Placeholders("<|image|>", 1, tiles=mllama.tiles(image.height, image.width))

    # interleaved: back-to-back `<|image|>`s are as many images, not one run
    return FamilyPrompts(mllama_image, mllama.image_token_id, interleaved=True)


# the vision checkpoints whose images we serve (ModelConfig.multimodal_architecture) -> their family's builder
_FAMILIES: dict[str, FamilyBuilder] = {
    "Gemma3ForConditionalGeneration": _gemma3,
    **{name: _sized_by_checkpoint(_qwen_vl) for name in QWEN_VL_MODELS},
    "LlavaNextForConditionalGeneration": _llava_next,
    "Idefics3ForConditionalGeneration": _sized_by_checkpoint(_idefics3),
    "Idefics2ForConditionalGeneration": _sized_by_checkpoint(_idefics2),
    "PaliGemmaForConditionalGeneration": _paligemma,
    "MllamaForConditionalGeneration": _sized_by_checkpoint(_mllama),
}
