"""A tiny random LLaVA-Next (transformers' own LlavaNextConfig and model, fp32: a 2-layer Llama text model, a 2-layer
CLIP tower on 28-pixel tiles of 2 x 2 patches) and its image processor, for the fallback's server, engine and GPU
tests (tests/modeling/test_llava_next_fallback.py, tests/router/test_llava_next_engine.py,
tests/gpu/test_llava_next_gpu.py)."""

from __future__ import annotations

import hashlib
import io

import torch
from PIL import Image

from tests.modeling.helpers import TINY_SIZES, randomize
from tests.modeling.qwen2_5_vl_helpers import png

TILE, PATCH = 28, 14  # 2 x 2 patches per tile
PINPOINTS = [[28, 56], [56, 28], [56, 56]]  # the tile grids, (height, width)
ENGINE_VOCAB, ENGINE_NEW = 300, 6


def tiny_llava_next(vocab: int, seed: int = 0, **text_overrides):
    """`<image>` is the top of the vocabulary."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    text = {**TINY_SIZES, "model_type": "llama", "vocab_size": vocab, **text_overrides}
    vision = {"model_type": "clip_vision_model", "image_size": TILE, "patch_size": PATCH, "projection_dim": 32}
    vision |= {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = LlavaNextConfig(
        text_config=text, vision_config=vision, image_token_index=vocab - 1, image_grid_pinpoints=PINPOINTS
    )
    return randomize(LlavaNextForConditionalGeneration(config), seed)


def image_processor():
    # Pillow's, as the server's (vision/processors.py), where torchvision is installed too
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    size = {"height": TILE, "width": TILE}
    return LlavaNextImageProcessorPil(size={"shortest_edge": TILE}, crop_size=size, image_grid_pinpoints=PINPOINTS)


def saved_llava_next(folder) -> tuple[object, str]:
    """(a tiny_llava_next of ENGINE_VOCAB, the folder it is written to with its image processor)."""
    model = tiny_llava_next(ENGINE_VOCAB)
    model.save_pretrained(folder)
    image_processor().save_pretrained(folder)
    return model, str(folder)


def processed(images: list[bytes]):
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    return image_processor()(images=pictures, return_tensors="pt")


def feature_rows(model, data: bytes) -> int:
    """The rows transformers' model packs for the image: its placeholders' count."""
    from tgi_compat.modeling.models.transformers_vlm import TransformersForImageTextToText

    return len(TransformersForImageTextToText.image_rows(model, processed([data]))[0])


def greedy_ids(model, ids: list[int], images: list[bytes], new_tokens: int) -> list[int]:
    """transformers' greedy ids, whole-sequence forwards with no cache and no stop at eos (the engine's ignore_eos)."""
    extra = {}
    if images:
        inputs = processed(images)
        extra = {"pixel_values": inputs["pixel_values"], "image_sizes": inputs["image_sizes"]}
    return uncached_greedy(model, ids, extra, new_tokens)


def uncached_greedy(model, ids: list[int], image_inputs: dict, new_tokens: int) -> list[int]:
    """Greedy ids of a transformers vision model given its image inputs, one whole-sequence forward a token."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            out.append(int(model(input_ids=torch.tensor([out]), **image_inputs).logits[0, -1].argmax()))
    return out[len(ids) :]


WIDE, TALL = png((200, 30, 60), (50, 30)), png((10, 220, 90), (20, 60))  # 14 and 17 placeholders


def engine_request(model, request_id: str, images: list[bytes]):
    """(a GenerateRequest of text and `images` as the API builds it for ENGINE_VOCAB's `<image>`, its ids)."""
    from tgi_compat.router.images import PromptImage
    from tgi_compat.router.request import GenerateRequest

    ids, spans = [5, 6, 7], []
    for k, data in enumerate(images):
        rows = feature_rows(model, data)
        spans.append(PromptImage(len(ids), rows, hashlib.sha256(data).hexdigest(), data))
        ids += [model.config.image_token_id] * rows + [10 + k, 11 + k]
    return GenerateRequest(request_id, ids, max_new_tokens=ENGINE_NEW, ignore_eos=True, images=spans), ids


def check_images_beside_text(model, drain) -> None:
    """A request with WIDE then TALL and a text-only one served in the same steps (`drain(requests)` -> ids by
    request id) each give transformers' greedy ids: the engine test's check on the CPU and on the device."""
    both, ids = engine_request(model, "both", [WIDE, TALL])
    text, text_ids = engine_request(model, "text", [])
    out = drain([both, text])
    assert out["both"] == greedy_ids(model, ids, [WIDE, TALL], ENGINE_NEW)
    assert out["text"] == greedy_ids(model, text_ids, [], ENGINE_NEW)
