"""A tiny random Idefics3 (transformers' own Idefics3Config and model, fp32: a 2-layer Llama text model, a 2-layer
SigLIP-like tower on 16-pixel tiles of 4 x 4 patches, pixel shuffle 2: 4 `<image>`s a tile) and its image processor
(longest edge 32, split into 16-pixel tiles), for the fallback's engine and server tests (tests/router/test_idefics3_engine.py,
tests/modeling/test_idefics3_fallback.py).
Its stand-in ids for the separator tokens sit at the top of the vocabulary beside `<image>`."""

from __future__ import annotations

import io
from collections.abc import Callable

from PIL import Image

from tests.modeling.helpers import TINY_SIZES, randomize
from tests.modeling.llava_next_helpers import uncached_greedy
from tests.modeling.qwen2_5_vl_helpers import png
from tgi_compat.api.protocol.images import DecodedImage
from tgi_compat.api.serving.image_fetch import ImageFetcher
from tgi_compat.api.serving.images import Placeholders, VisionPrompts
from tgi_compat.modeling.vision.idefics3 import Idefics3ImageTokens
from tgi_compat.router.request import GenerateRequest

TILE, PATCH, LONGEST = 16, 4, 32
VOCAB, NEW = 300, 6
IMAGE, FAKE, GLOBAL, NEWLINE = VOCAB - 1, VOCAB - 2, VOCAB - 3, 13
ROW_COL = 200  # <row_r_col_c> stand-ins: 200 + 10 * r + c
# (width, height): 50 x 30 -> 2 x 2 tiles + the global image; 20 x 60 -> 2 x 1 tiles + the global image
WIDE, TALL = png((200, 30, 60), (50, 30)), png((10, 220, 90), (20, 60))


def tiny_idefics3(vocab: int = VOCAB, image_token_id: int = IMAGE, seed: int = 0, **text_overrides):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    text = {**TINY_SIZES, "model_type": "llama", "vocab_size": vocab, **text_overrides}
    vision = {"model_type": "idefics3_vision", "image_size": TILE, "patch_size": PATCH, "hidden_size": 32}
    vision |= {"intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = Idefics3Config(text_config=text, vision_config=vision, image_token_id=image_token_id, scale_factor=2)
    return randomize(Idefics3ForConditionalGeneration(config), seed)


def image_processor():
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    return Idefics3ImageProcessorPil(
        size={"longest_edge": LONGEST}, max_image_size={"longest_edge": TILE}, do_image_splitting=True
    )


def saved_idefics3(folder) -> tuple[object, str]:
    """(a tiny_idefics3, the folder it is written to with its image processor)."""
    model = tiny_idefics3()
    model.save_pretrained(folder)
    image_processor().save_pretrained(folder)
    return model, str(folder)


def processed(images: list[bytes]):
    pictures = [[Image.open(io.BytesIO(data)).convert("RGB")] for data in images]
    return image_processor()(images=pictures, return_tensors="pt", return_row_col_info=True)


def image_ids(rows: int, columns: int, tile_tokens: int) -> list[int]:
    """TGI's image text (vision/idefics3.py) in stand-in ids: the `\\n`s as NEWLINE, one token each."""
    run = [IMAGE] * tile_tokens
    ids: list[int] = []
    for r in range(rows):
        for c in range(columns):
            ids += [FAKE, ROW_COL + 10 * (r + 1) + c + 1, *run]
        ids.append(NEWLINE)
    return ids + [NEWLINE, FAKE, GLOBAL, *run, FAKE]


def greedy_ids(model, ids: list[int], images: list[bytes], new_tokens: int) -> list[int]:
    """transformers' greedy ids, whole-sequence forwards with no cache and no stop at eos (the engine's ignore_eos)."""
    extra = {}
    if images:
        # one sample of all the images: the processor pads their tile counts to the largest
        inputs = image_processor()(
            images=[[Image.open(io.BytesIO(data)).convert("RGB") for data in images]], return_tensors="pt"
        )
        extra = {"pixel_values": inputs["pixel_values"], "pixel_attention_mask": inputs["pixel_attention_mask"]}
    return uncached_greedy(model, ids, extra, new_tokens)


TOKENS = Idefics3ImageTokens(IMAGE, 4, LONGEST, TILE)
PROMPTS = VisionPrompts(
    lambda i: Placeholders(TOKENS.text(i.height, i.width), TOKENS.count(i.height, i.width)),
    IMAGE,
    False,
    ImageFetcher(),
    interleaved=True,
)


def decoded(data: bytes) -> DecodedImage:
    width, height = Image.open(io.BytesIO(data)).size
    return DecodedImage(data, "image/png", width, height)


def engine_request(request_id: str, images: list[bytes]) -> tuple[GenerateRequest, list[int]]:
    """(a GenerateRequest of text and `images` in TGI's image text, its ids), its images placed as the API does."""
    ids: list[int] = [5, 6, 7]
    for k, data in enumerate(images):
        image = decoded(data)
        ids += image_ids(*TOKENS.grid(image.height, image.width), TOKENS.tile_tokens) + [10 + k, 11 + k]
    placed = PROMPTS.place(ids, [decoded(data) for data in images])
    return GenerateRequest(request_id, ids, max_new_tokens=NEW, ignore_eos=True, images=placed), ids


def check_images_beside_text(model, drain) -> None:
    """A request with WIDE then TALL (each `<image>` runs between separators) and a text-only one served in the same
    steps (`drain(requests)` -> ids by request id) each give transformers' greedy ids: on the CPU and the device."""
    both, ids = engine_request("both", [WIDE, TALL])
    text, text_ids = engine_request("text", [])
    assert [image.embeds is not None for image in both.images] == [True, True]
    out = drain([both, text])
    assert out["both"] == greedy_ids(model, ids, [WIDE, TALL], NEW)
    assert out["text"] == greedy_ids(model, text_ids, [], NEW)


def check_a_repeated_image_hits_the_prefix_cache(engine, request_of: Callable[[str], GenerateRequest]) -> None:
    """The same image-bearing request (`request_of(request_id)`) twice in a row: the second gives the first's ids, its
    image is not encoded again, and its whole image span (the tokens between its `<image>` runs too) is cached."""
    from benchmarks.device.steps import engine_tokens

    first = engine_tokens(engine, [request_of("first")])
    again = request_of("again")
    engine.add_request(again)
    tokens, cached = [], 0
    while engine.has_unfinished():
        for event in engine.step():
            tokens += event.token_ids
            cached = max(cached, event.num_cached_tokens)
    assert tokens == first["first"]
    assert engine.executor.batch_builder.images is not None and engine.executor.batch_builder.images.num_encoded == 1
    assert cached >= again.images[0].end
