"""A tiny random Mllama (transformers' own MllamaConfig and model, fp32: a 4-layer text model whose layers 1 and 3
cross-attend, a 2 + 1 layer vision tower on 28-pixel tiles of 2 x 2 patches, up to 4 tiles an image) and its image
processor, for the engine and server tests (tests/router/test_mllama_engine.py, tests/modeling/test_mllama_server.py).
As in Llama 3.2 Vision, `<|image|>` is the first id past the logits' vocabulary."""

from __future__ import annotations

import io

import torch
from PIL import Image

from tests.modeling.helpers import randomize
from tests.modeling.idefics3_helpers import decoded
from tests.modeling.qwen2_5_vl_helpers import png
from tgi_compat.api.protocol.images import DecodedImage
from tgi_compat.api.serving.image_fetch import ImageFetcher
from tgi_compat.api.serving.images import Placeholders, VisionPrompts
from tgi_compat.modeling.vision.mllama import MllamaImageTokens
from tgi_compat.router.request import GenerateRequest

TILE, MAX_TILES = 28, 4
VOCAB, NEW = 300, 6  # the tokenizer's ids, `<|image|>` (VOCAB - 1) the last
IMAGE = VOCAB - 1
# (width, height): 50 x 30 -> 2 x 2 tiles (all 4), 20 x 60 -> 3 x 1 tiles (3 real, 1 padding)
WIDE, TALL = png((200, 30, 60), (50, 30)), png((10, 220, 90), (20, 60))


def tiny_mllama(vocab: int = VOCAB, seed: int = 0, eos_token_id: int = 2):
    """`vocab` counts `<|image|>`, the last id; the text model's logits cover the others."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    text = dict(vocab_size=vocab - 1, hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    text |= dict(num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1, 3])
    text |= dict(max_position_embeddings=512, bos_token_id=1, eos_token_id=eos_token_id, pad_token_id=0)
    vision = dict(image_size=TILE, patch_size=14, hidden_size=32, intermediate_size=64, attention_heads=2)
    vision |= dict(num_hidden_layers=2, num_global_layers=1, intermediate_layers_indices=[0, 1])
    vision |= dict(vision_output_dim=96, max_num_tiles=MAX_TILES)  # 32 * (1 + 2 intermediate layers)
    config = MllamaConfig(text_config=text, vision_config=vision, image_token_index=vocab - 1)
    model = randomize(MllamaForConditionalGeneration(config), seed)
    with torch.no_grad():  # gates wide open (tanh 0.96), so that what the text reads of its images shows in its ids
        for layer in config.text_config.cross_attention_layers:
            cross = model.model.language_model.layers[layer]
            cross.cross_attn_attn_gate.fill_(2.0)
            cross.cross_attn_mlp_gate.fill_(2.0)
    return model


def image_processor():
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    return MllamaImageProcessorPil(size={"height": TILE, "width": TILE}, max_image_tiles=MAX_TILES)


def saved_mllama(folder) -> tuple[object, str]:
    """(a tiny_mllama, the folder it is written to with its image processor)."""
    model = tiny_mllama()
    model.save_pretrained(folder)
    image_processor().save_pretrained(folder)
    return model, str(folder)


def reference_inputs(ids: list[int], images: list[bytes], image_token_id: int) -> dict[str, torch.Tensor]:
    """transformers' image inputs of one sample (MllamaProcessor's): its images, and the cross-attention mask of
    the tokens `ids`."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    pictures = [[Image.open(io.BytesIO(data)).convert("RGB") for data in images]]
    inputs = image_processor()(images=pictures, return_tensors="pt")
    mask = convert_sparse_cross_attention_mask_to_dense(
        [get_cross_attention_token_mask(ids, image_token_id)], inputs["num_tiles"], MAX_TILES, len(ids)
    )
    keys = ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")
    return {key: inputs[key] for key in keys} | {"cross_attention_mask": torch.tensor(mask)}


def generate_ids(model, ids: list[int], images: list[bytes], new_tokens: int) -> list[int]:
    """transformers' `generate`, greedy, with no stop at eos (the engine's ignore_eos)."""
    from transformers import GenerationConfig

    extra = reference_inputs(ids, images, model.config.image_token_id) if images else {}
    input_ids = torch.tensor([ids])
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config, **extra
        )
    return out[0, len(ids) :].tolist()


TOKENS = MllamaImageTokens(IMAGE, TILE, MAX_TILES)


def placeholders(image: DecodedImage) -> Placeholders:
    return Placeholders("<|image|>", 1, tiles=TOKENS.tiles(image.height, image.width))


PROMPTS = VisionPrompts(placeholders, IMAGE, bidirectional=False, fetcher=ImageFetcher(), interleaved=True)


def engine_request(request_id: str, ids: list[int], images: list[bytes]) -> GenerateRequest:
    """A GenerateRequest of `ids` (IMAGE where each of `images` sits), its images placed as the API does."""
    placed = PROMPTS.place(ids, [decoded(data) for data in images])
    return GenerateRequest(request_id, ids, max_new_tokens=NEW, ignore_eos=True, images=placed)


ONE = [1, 5, 6, IMAGE, 7, 8, 9]  # text before the image: its rows read every key, their MLP output dropped
THREE = [1, 5, IMAGE, 7, 8, IMAGE, IMAGE, 9, 10, 11]  # the last two back to back: the text after reads both
TEXT = [1, 5, 6, 7, 8]


def check_images_beside_text(model, drain) -> None:
    """A request with WIDE, TALL and WIDE again and a text-only one served in the same steps (`drain(requests)` -> ids
    by request id) each give transformers' `generate` ids alone: the engine test's check on the CPU and the device."""
    out = drain([engine_request("three", THREE, [WIDE, TALL, WIDE]), engine_request("text", TEXT, [])])
    assert out["three"] == generate_ids(model, THREE, [WIDE, TALL, WIDE], NEW)
    assert out["text"] == generate_ids(model, TEXT, [], NEW)
