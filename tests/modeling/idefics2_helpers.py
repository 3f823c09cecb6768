"""A tiny random Idefics2 (transformers' own Idefics2Config and model, fp32: a 2-layer Mistral text model, a 2-layer
SigLIP-like tower on images of up to 32 x 32 pixels in 4 x 4 patches, a 2-layer perceiver resampler of 4 latents: 4
`<image>`s a crop) and its image processor (shortest edge 16, longest 32, split into four crops and the whole
image), for the fallback's engine and server tests (tests/router/test_idefics2_engine.py,
tests/modeling/test_idefics2_fallback.py). Its stand-in id for `<fake_token_around_image>` sits beside `<image>`
at the top of the vocabulary."""

from __future__ import annotations

import io

from PIL import Image

from tests.modeling.helpers import TINY_SIZES, randomize
from tests.modeling.idefics3_helpers import decoded
from tests.modeling.llava_next_helpers import uncached_greedy
from tgi_compat.api.serving.image_fetch import ImageFetcher
from tgi_compat.api.serving.images import Placeholders, VisionPrompts
from tgi_compat.modeling.vision.idefics2 import Idefics2ImageTokens
from tgi_compat.router.request import GenerateRequest

VOCAB, NEW, LATENTS = 300, 6, 4
IMAGE, FAKE = VOCAB - 1, VOCAB - 2
TOKENS = Idefics2ImageTokens(IMAGE, LATENTS, splitting=True)
PROMPTS = VisionPrompts(
    lambda _: Placeholders(TOKENS.text, TOKENS.count), IMAGE, False, ImageFetcher(), None, True, TOKENS.merge_fakes
)


def tiny_idefics2(vocab: int = VOCAB, image_token_id: int = IMAGE, seed: int = 0, **text_overrides):
    from transformers import Idefics2Config, Idefics2ForConditionalGeneration

    text = {**TINY_SIZES, "model_type": "mistral", "vocab_size": vocab, **text_overrides}
    vision = {"image_size": 32, "patch_size": 4, "hidden_size": 32, "intermediate_size": 64}
    vision |= {"num_hidden_layers": 2, "num_attention_heads": 2}
    perceiver = {"hidden_size": TINY_SIZES["hidden_size"], "resampler_n_latents": LATENTS, "resampler_depth": 2}
    perceiver |= {"resampler_n_heads": 2, "resampler_head_dim": 16, "num_key_value_heads": 1}
    config = Idefics2Config(
        text_config=text, vision_config=vision, perceiver_config=perceiver, image_token_id=image_token_id
    )
    return randomize(Idefics2ForConditionalGeneration(config), seed)


def image_processor(splitting: bool = True):
    from transformers.models.idefics2.image_processing_pil_idefics2 import Idefics2ImageProcessorPil

    return Idefics2ImageProcessorPil(size={"shortest_edge": 16, "longest_edge": 32}, do_image_splitting=splitting)


def saved_idefics2(folder) -> tuple[object, str]:
    """(a tiny_idefics2, the folder it is written to with its image processor)."""
    model = tiny_idefics2()
    model.save_pretrained(folder)
    image_processor().save_pretrained(folder)
    return model, str(folder)


def greedy_ids(model, ids: list[int], images: list[bytes], new_tokens: int) -> list[int]:
    """transformers' greedy ids, whole-sequence forwards with no cache and no stop at eos (the engine's ignore_eos)."""
    extra = {}
    if images:  # one sample of all the images: the processor pads them to the largest
        pictures = [[Image.open(io.BytesIO(data)).convert("RGB") for data in images]]
        inputs = image_processor()(images=pictures, return_tensors="pt")
        extra = {"pixel_values": inputs["pixel_values"], "pixel_attention_mask": inputs["pixel_attention_mask"]}
    return uncached_greedy(model, ids, extra, new_tokens)


def image_ids() -> list[int]:
    """TGI's image text (vision/idefics2.py) in stand-in ids."""
    return [FAKE] + ([IMAGE] * LATENTS + [FAKE]) * 5


def engine_request(request_id: str, images: list[bytes], adjacent: bool = False) -> tuple[GenerateRequest, list[int]]:
    """(a GenerateRequest of text and `images` in TGI's image text, its ids), its images placed as the API does;
    `adjacent`: no text between the images, whose fake tokens merge into one."""
    ids: list[int] = [5, 6, 7]
    for k, _ in enumerate(images):
        if adjacent and k:
            ids.pop()  # the previous image's closing fake token opens this one
        ids += image_ids() + ([] if adjacent else [10 + k, 11 + k])
    placed = PROMPTS.place(ids, [decoded(data) for data in images])
    return GenerateRequest(request_id, ids, max_new_tokens=NEW, ignore_eos=True, images=placed), ids


def check_images_beside_text(model, drain) -> None:
    """Requests with two images (apart, and adjacent: sharing a fake token) and a text-only one, served in the same
    steps (`drain(requests)` -> ids by request id), each give transformers' greedy ids: on the CPU and the device."""
    from tests.modeling.idefics3_helpers import TALL, WIDE

    apart, apart_ids = engine_request("apart", [WIDE, TALL])
    adjacent, adjacent_ids = engine_request("adjacent", [TALL, WIDE], adjacent=True)
    text, text_ids = engine_request("text", [])
    assert [image.embeds is not None for image in apart.images + adjacent.images] == [True] * 4
    out = drain([apart, adjacent, text])
    assert out["apart"] == greedy_ids(model, apart_ids, [WIDE, TALL], NEW)
    assert out["adjacent"] == greedy_ids(model, adjacent_ids, [TALL, WIDE], NEW)
    assert out["text"] == greedy_ids(model, text_ids, [], NEW)
