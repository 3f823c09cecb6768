"""A tiny random Qwen2.5-VL or Qwen2-VL (transformers' own config and model, fp32) and their image processor, for
the modeling and server tests of the family (tests/modeling/test_qwen2_5_vl*.py)."""

from __future__ import annotations

import hashlib
import io

import torch
from PIL import Image

from tests.modeling.helpers import TINY_SIZES, randomize

PATCH, MERGE = 14, 2
# added to a real tokenizer for a served tiny checkpoint: ids vocab-4 .. vocab-1, as tiny_qwen2_5_vl places them
IMAGE_TOKENS = ["<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
MIN_PIXELS, MAX_PIXELS = 28 * 28, 28 * 28 * 8  # up to 8 placeholders per image


# the family's two checkpoints (one native model, two vision towers), as tests parametrize over them
FAMILIES = ("qwen2_5_vl", "qwen2_vl")


def tiny_qwen2_5_vl(vocab: int, seed: int = 0, family: str = "qwen2_5_vl", **text_overrides):
    """Image tokens at the top of the vocabulary: video vocab-4, vision_start -3, vision_end -2, image_pad -1.
    `family` "qwen2_vl": Qwen2-VL's tower (whole-image attention in every block, LayerNorm, a GELU MLP) instead."""
    import transformers

    text = {
        **TINY_SIZES,
        "vocab_size": vocab,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,  # Qwen2.5-VL's default, which these tests were written against
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        **text_overrides,
    }
    tower = dict(depth=2, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2)
    if family == "qwen2_vl":  # hidden_size: the merger's output, the text model's width
        vision = dict(tower, embed_dim=32, mlp_ratio=2, hidden_size=TINY_SIZES["hidden_size"])
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        # an MLP width off the 64 grid, as the 7B's 3420: the encoder pads it (vision/qwen_vl_mlp.PaddedSwiGLU)
        vision = dict(
            tower, hidden_size=32, intermediate_size=60, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1]
        )
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    config = config_class(
        text_config=text,
        vision_config=vision,
        video_token_id=vocab - 4,
        vision_start_token_id=vocab - 3,
        vision_end_token_id=vocab - 2,
        image_token_id=vocab - 1,
        tie_word_embeddings=False,
    )
    return randomize(model_class(config), seed)


def image_processor():
    # Pillow's, as the server's (vision/processors.py), where torchvision is installed too
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH, merge_size=MERGE)


def saved_qwen2_5_vl(folder, vocab: int, family: str = "qwen2_5_vl", **text_overrides):
    """A tiny_qwen2_5_vl written with its image processor into `folder` as a checkpoint our loader reads; the model."""
    model = tiny_qwen2_5_vl(vocab, family=family, **text_overrides)
    model.save_pretrained(folder)
    image_processor().save_pretrained(folder)
    return model


def picture(color: tuple[int, int, int], size: tuple[int, int]) -> Image.Image:
    image = Image.new("RGB", size, color)
    for x in range(0, size[0], 5):  # a pattern, so that patches differ
        image.putpixel((x, (x * 7) % size[1]), (255 - color[0], 0, 255))
    return image


def reference_logits(model, ids: list[int], processed) -> torch.Tensor:
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model(
            input_ids=input_ids,
            pixel_values=processed["pixel_values"],
            image_grid_thw=processed["image_grid_thw"],
            mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
        )
    return out.logits[0].float()


def reference_greedy(model, ids: list[int], processed, max_new_tokens: int) -> list[int]:
    """transformers' greedy ids; `processed` None: a text-only prompt."""
    input_ids = torch.tensor([ids])
    images = {}
    if processed is not None:
        images = {
            "pixel_values": processed["pixel_values"],
            "image_grid_thw": processed["image_grid_thw"],
            "mm_token_type_ids": (input_ids == model.config.image_token_id).int(),
        }
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),  # no pad-id guess: every prompt token is real
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **images,
        )
    return out[0, len(ids) :].tolist()


def png(color: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    picture(color, size).save(out, format="PNG")
    return out.getvalue()


ENGINE_VOCAB, ENGINE_NEW = 300, 8
WIDE, TALL = png((200, 30, 60), (84, 56)), png((10, 220, 90), (50, 90))
GRIDS = {WIDE: (2, 3), TALL: (3, 2)}  # (rows, columns) of placeholders, by transformers' smart_resize


def engine_request(request_id: str, images: list[bytes]):
    """(a GenerateRequest of text and `images` as the API builds it for ENGINE_VOCAB's image tokens, its ids)."""
    from tgi_compat.router.images import PromptImage
    from tgi_compat.router.request import GenerateRequest

    start, end, image = ENGINE_VOCAB - 3, ENGINE_VOCAB - 2, ENGINE_VOCAB - 1
    ids, spans = [5, 6, 7], []
    for k, data in enumerate(images):
        rows, columns = GRIDS[data]
        ids += [start]
        digest = hashlib.sha256(data).hexdigest()
        spans.append(PromptImage(len(ids), rows * columns, digest, data, grid=(rows, columns)))
        ids += [image] * (rows * columns) + [end, 10 + k, 11 + k]
    return GenerateRequest(request_id, ids, max_new_tokens=ENGINE_NEW, ignore_eos=True, images=spans), ids


def engine_expected(model, ids: list[int], images: list[bytes]) -> list[int]:
    """transformers' greedy ids of an engine_request."""
    if not images:
        return reference_greedy(model, ids, None, ENGINE_NEW)
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    return reference_greedy(model, ids, image_processor()(images=pictures, return_tensors="pt"), ENGINE_NEW)


def check_two_images_beside_text(model, drain) -> None:
    """A request with WIDE then TALL and a text-only one served in the same steps (`drain(requests)` -> ids by
    request id) each give transformers' greedy ids: the engine test's check on the CPU and on the device."""
    both, ids = engine_request("both", [WIDE, TALL])
    text, text_ids = engine_request("text", [])
    out = drain([both, text])
    assert out["both"] == engine_expected(model, ids, [WIDE, TALL])
    assert out["text"] == engine_expected(model, text_ids, [])
