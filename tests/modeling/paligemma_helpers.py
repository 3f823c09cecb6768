"""A tiny random PaliGemma (transformers' own PaliGemmaConfig and model, fp32: a 2-layer Gemma or Gemma 2 text model
whose embeddings are scaled down so that its greedy ids vary, a 2-layer SigLIP tower on 16-pixel images of 4 x 4
patches: 16 `<image>`s an image) and its image processor, for the fallback's engine tests
(tests/router/test_paligemma_engine.py). Its stand-in ids: `<image>` at the top of the vocabulary, `<bos>` 2, `\\n` 13.
The reference is transformers' model given the processor's token_type_ids: 0 over the prompt (which attends both
ways), 1 over the generated tokens."""

from __future__ import annotations

import io

import torch
from PIL import Image

from tests.modeling.helpers import TINY_SIZES, randomize
from tests.modeling.idefics3_helpers import decoded
from tgi_compat.api.serving.image_fetch import ImageFetcher
from tgi_compat.api.serving.images import Placeholders, PrefixLMPrompts
from tgi_compat.router.request import GenerateRequest

VOCAB, NEW, PER_IMAGE, SIDE = 300, 6, 16, 16
IMAGE, BOS, NEWLINE = VOCAB - 1, 2, 13
PROMPTS = PrefixLMPrompts(
    lambda _: Placeholders("<image>" * PER_IMAGE, PER_IMAGE), IMAGE, False, ImageFetcher(), interleaved=True
)


def tiny_paligemma(model_type: str = "gemma", vocab: int = VOCAB, seed: int = 0):
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    text = {**TINY_SIZES, "model_type": model_type, "vocab_size": vocab, "head_dim": 16}
    vision = {"model_type": "siglip_vision_model", "image_size": SIDE, "patch_size": 4, "hidden_size": 32}
    vision |= {"intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    hidden = TINY_SIZES["hidden_size"]
    config = PaliGemmaConfig(
        text_config=text, vision_config=vision, image_token_index=vocab - 1, projection_dim=hidden, hidden_size=hidden
    )
    model = randomize(PaliGemmaForConditionalGeneration(config), seed)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.2)  # Gemma scales them by sqrt(hidden): else one token wins
    return model


def image_processor():
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    return SiglipImageProcessorPil(size={"height": SIDE, "width": SIDE})


def saved_paligemma(folder, model_type: str = "gemma") -> tuple[object, str]:
    """(a tiny_paligemma, the folder it is written to with its image processor)."""
    model = tiny_paligemma(model_type)
    model.save_pretrained(folder)
    image_processor().save_pretrained(folder)
    return model, str(folder)


def greedy_ids(model, ids: list[int], images: list[bytes], new_tokens: int) -> list[int]:
    """transformers' greedy ids, whole-sequence forwards with no cache and no stop at eos (the engine's ignore_eos)."""
    extra = {}
    if images:
        pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        extra["pixel_values"] = image_processor()(images=pictures, return_tensors="pt")["pixel_values"]
    out = list(ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            types = torch.tensor([[0] * len(ids) + [1] * (len(out) - len(ids))])
            logits = model(input_ids=torch.tensor([out]), token_type_ids=types, **extra).logits
            out.append(int(logits[0, -1].argmax()))
    return out[len(ids) :]


def engine_request(request_id: str, images: list[bytes], text: list[int]) -> tuple[GenerateRequest, list[int]]:
    """(a GenerateRequest of `images` then `text` as TGI's model server writes it, its ids), placed as the API does."""
    ids = [IMAGE] * (PER_IMAGE * len(images)) + [BOS, *text, NEWLINE]
    placed = PROMPTS.place(ids, [decoded(data) for data in images])
    return GenerateRequest(request_id, ids, max_new_tokens=NEW, ignore_eos=True, images=placed), ids
