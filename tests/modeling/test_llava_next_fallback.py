"""LLaVA-Next through the transformers fallback (models/transformers_vlm.py) behind the real server (TGI's launcher,
a tiny random checkpoint on the SmolLM2 tokenizer with `<image>` added): images in /generate inputs and OpenAI chat
image_url parts give transformers' greedy ids, each image as TGI's run of `<image>`s; /tokenize counts them as TGI
does. Llama 4 with images is refused at start with its reason."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch

from tests.modeling.llava_next_helpers import PATCH, PINPOINTS, TILE, image_processor, tiny_llava_next
from tests.modeling.qwen2_5_vl_helpers import picture
from tests.modeling.vision_server import check_two_images, generate_greedy, serving, streamed_ids
from tgi_compat.modeling.registry import UnsupportedArchitectureError, describe_modeling_path, modeling_path

NEW = 8


def tgi_count(height: int, width: int) -> int:
    """TGI's server and router count (vlm_causal_lm.get_number_of_features), transcribed with its grid swap."""
    from transformers.image_processing_utils import select_best_resolution

    best_height, best_width = select_best_resolution([height, width], PINPOINTS)
    npatches = TILE // PATCH
    num_patch_width, num_patch_height = best_height // TILE, best_width // TILE  # TGI's (LLaVA-NeXT issue 59)
    current_height, current_width = npatches * num_patch_height, npatches * num_patch_width
    if width / height > current_width / current_height:
        current_height -= 2 * ((current_height - (height * current_width) // width) // 2)
    else:
        current_width -= 2 * ((current_width - (width * current_height) // height) // 2)
    return current_height * current_width + current_height + npatches**2


def data_url(color, size) -> tuple[str, bytes, tuple[int, int]]:
    out = io.BytesIO()
    picture(color, size).save(out, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(out.getvalue()).decode()}", out.getvalue(), size


WIDE = data_url((200, 30, 60), (50, 30))  # (width, height): best grid 56 x 56, 14 placeholders
OTHER = data_url((30, 30, 200), (50, 30))  # another picture of WIDE's size
TALL = data_url((10, 220, 90), (20, 60))  # best grid 56 x 28 (not square): TGI's swapped count differs


def image_text(served, size: tuple[int, int]) -> str:
    """The image's text by transformers' processor: one `<image>` per row its model packs."""
    from transformers import LlavaNextProcessor

    processor = LlavaNextProcessor(image_processor(), served[2], patch_size=PATCH)
    width, height = size
    # no CLS row counted (num_additional_image_tokens 0), as the "default" feature strategy drops it
    return "<image>" * processor._get_number_of_features(height, width, TILE, TILE)


# prefill chunks of 16 tokens cut every image's placeholder run: each chunk takes its part of the image's rows
FLAGS = "--enable-prefill-logprobs --enable-prompt-tokens-details --max-batch-prefill-tokens 16"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava-next-server")
    with serving(folder, ["<image>"], "<image>", tiny_llava_next, image_processor(), FLAGS) as s:
        yield s


def greedy(served, text: str, images: list[bytes], add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, transformers' greedy ids) for `text` with its images already expanded."""
    return generate_greedy(served, text, images, ("pixel_values", "image_sizes"), NEW, add_special_tokens)


def test_generate_with_two_images_equals_transformers(served):
    check_two_images(served, greedy, lambda size: image_text(served, size), [WIDE, TALL])


def test_chat_image_url_streams_transformers_greedy(served):
    url, _, tokenizer, _ = served
    content = [{"type": "image_url", "image_url": {"url": WIDE[0]}}, {"type": "text", "text": "Describe the image"}]
    body = {"model": "tgi", "messages": [{"role": "user", "content": content}], "max_tokens": NEW, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"![]({WIDE[0]})Describe the image"}], tokenize=False, add_generation_prompt=True
    )
    ids, expected = greedy(served, templated.replace(f"![]({WIDE[0]})", image_text(served, WIDE[2])), [WIDE[1]], False)
    assert response["usage"]["prompt_tokens"] == len(ids)
    assert response["choices"][0]["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
    generate = {"inputs": f"Describe![]({WIDE[0]})", "parameters": {"max_new_tokens": NEW}}
    assert streamed_ids(url, generate) == greedy(served, f"Describe{image_text(served, WIDE[2])}", [WIDE[1]])[1]


def test_tokenize_counts_as_tgi(served):
    url, model, tokenizer, _ = served
    tokens = httpx.post(f"{url}/tokenize", json={"inputs": f"Look![]({WIDE[0]})"}, timeout=60).json()
    assert [t["id"] for t in tokens] == tokenizer("Look" + "<image>" * tgi_count(30, 50))["input_ids"]
    assert tgi_count(30, 50) == 14
    # a non-square best grid: transformers' count (its model's rows), where TGI's transposed grid counts otherwise
    tall = httpx.post(f"{url}/tokenize", json={"inputs": f"![]({TALL[0]})"}, timeout=60).json()
    assert sum(t["id"] == model.config.image_token_id for t in tall) == len(image_text(served, TALL[2])) // len(
        "<image>"
    )


def test_a_repeated_image_reuses_its_kv_and_another_never(served):
    url, model, tokenizer, _ = served
    question = "A long question about this picture, to be answered twice"
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": image_text(served, WIDE[2]) + question}],
        tokenize=False,
        add_generation_prompt=True,
    )
    first_image = tokenizer(templated, add_special_tokens=False)["input_ids"].index(model.config.image_token_id)
    cached = []
    for image in (WIDE, WIDE, OTHER):
        content = [{"type": "image_url", "image_url": {"url": image[0]}}, {"type": "text", "text": question}]
        body = {"model": "tgi", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        cached.append(response["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[1] >= first_image + 14  # past WIDE's 14 placeholders
    assert cached[2] <= first_image  # OTHER (WIDE's size) shares nothing from its first placeholder on


@pytest.mark.parametrize(
    "architecture, reason",
    [
        ("Llama4ForConditionalGeneration", "torchvision"),
    ],
)
def test_vision_families_refused_with_their_reason(architecture, reason):
    with pytest.raises(UnsupportedArchitectureError, match=reason):
        modeling_path(architecture)


def test_fallback_config_reads_the_nested_text_config():
    from tgi_compat.modeling.models.transformers_fallback import fallback_model_config

    d = tiny_llava_next(300).config.to_dict() | {"architectures": ["LlavaNextForConditionalGeneration"]}
    config = fallback_model_config(d)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert config.multimodal_architecture == "LlavaNextForConditionalGeneration"
    assert not config.renames_multimodal_weights  # transformers reads its own tensor names
    assert describe_modeling_path("LlavaNextForConditionalGeneration") == (
        "transformers modeling of its text model and vision encoder"
    )


def test_serves_random_weights_from_config_json_alone(tmp_path):
    """--load-format dummy (the GPU benchmarks'): transformers' tensor names, streamed into transformers' model."""
    from tests.modeling.helpers import full_logits
    from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

    config = tiny_llava_next(300).config
    config.architectures = ["LlavaNextForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    cfg = RunnerConfig(model_id=str(tmp_path), device="cpu", dtype="float32", num_kv_slots=64, show_progress=False)
    cfg.load_format = "dummy"
    logits = full_logits(ModelRunner(cfg), [1, 5, 9, 200])
    assert logits.shape == (4, 300) and torch.isfinite(logits).all() and logits.std() > 0
