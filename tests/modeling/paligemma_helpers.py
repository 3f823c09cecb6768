"""A tiny random PaliGemma (transformers' own PaliGemmaConfig and model, fp32: a 2-layer Gemma or Gemma 2 text model
whose embeddings are scaled down so that its greedy ids vary (Gemma 2's sliding window 8 tokens, under the prompts'
length), a 2-layer SigLIP tower on 16-pixel images of 4 x 4
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
    if model_type == "gemma2":  # a window shorter than the prompts: the prefix still attends both ways past it
        text["sliding_window"] = 8
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


def check_images_beside_text(model, drain) -> None:
    """A request with one image and one with two (each one bidirectional span over its whole prompt) served in the
    same steps (`drain(requests)` -> ids by request id) each give transformers' greedy ids: on the CPU and the
    device."""
    from tests.modeling.idefics3_helpers import TALL, WIDE

    one, one_ids = engine_request("one", [WIDE], [40, 41, 42])
    two, two_ids = engine_request("two", [TALL, WIDE], [50, 51])
    spans = [(image.offset, image.length, image.bidirectional) for image in two.images]
    assert spans == [(0, len(two_ids), True), (PER_IMAGE, PER_IMAGE, False)]
    out = drain([one, two])
    assert out["one"] == greedy_ids(model, one_ids, [WIDE], NEW)
    assert out["two"] == greedy_ids(model, two_ids, [TALL, WIDE], NEW)
