"""Qwen2.5-VL images through the real server (TGI's launcher, a tiny random checkpoint on the SmolLM2 tokenizer
with Qwen2.5-VL's image tokens added, transformers' Qwen2-VL image processor with small min/max_pixels): TGI's
integration-test shapes for qwen2_5_vl (markdown images in /generate inputs, OpenAI chat image_url parts; base64
png) give transformers' greedy ids, each image as `<|vision_start|>` + its grid's `<|image_pad|>`s +
`<|vision_end|>`; the same image twice hits the prefix cache and a different one never shares its KV. Qwen2-VL (the
same family with its own vision tower, and TGI's same image text) answers /generate and chat requests the same way."""

from __future__ import annotations

import base64
import functools
import io

import httpx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.modeling.qwen2_5_vl_helpers import (
    FAMILIES,
    IMAGE_TOKENS,
    image_processor,
    picture,
    reference_greedy,
    tiny_qwen2_5_vl,
)
from tests.modeling.vision_server import check_two_images, greedy_until_eos, serving, streamed_ids

NEW = 8


def data_url(color, size, fmt: str = "PNG") -> tuple[str, bytes, tuple[int, int]]:
    out = io.BytesIO()
    picture(color, size).save(out, format=fmt)
    mime = "image/png" if fmt == "PNG" else "image/jpeg"
    return f"data:{mime};base64,{base64.b64encode(out.getvalue()).decode()}", out.getvalue(), size


WIDE = data_url((200, 30, 60), (84, 56))  # 2 x 3 placeholders
TALL = data_url((10, 220, 90), (50, 90), "JPEG")  # 3 x 2
OTHER_WIDE = data_url((30, 30, 200), (84, 56))  # another picture of WIDE's size


def image_text(size: tuple[int, int]) -> str:
    """The image's text by transformers' processor: one pad per merged patch of its resized grid."""
    _, rows, columns = image_processor()(images=[picture((0, 0, 0), size)])["image_grid_thw"][0].tolist()
    return "<|vision_start|>" + "<|image_pad|>" * (rows * columns // 4) + "<|vision_end|>"


@pytest.fixture(scope="module", params=FAMILIES)
def served(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp(f"{request.param}-server")
    flags = "--enable-prefill-logprobs --enable-prompt-tokens-details"
    build = functools.partial(tiny_qwen2_5_vl, family=request.param)
    with serving(folder, IMAGE_TOKENS, IMAGE_TOKENS[3], build, image_processor(), flags) as s:
        yield s


# the tests of what the two families share past their prompts (the engine's paths): Qwen2.5-VL's server only
qwen2_5_vl_only = pytest.mark.parametrize("served", ["qwen2_5_vl"], indirect=True)


def greedy(served, text: str, images: list[bytes], add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, transformers' greedy ids) for `text` with its images already expanded."""

    def reference(model, ids: list[int], processed) -> list[int]:
        return reference_greedy(model, ids, processed, NEW)

    return greedy_until_eos(served, text, images, reference, add_special_tokens)


def test_generate_with_two_images_equals_transformers(served):
    check_two_images(served, greedy, image_text, [WIDE, TALL])


@qwen2_5_vl_only
def test_generate_stream(served):
    url = served[0]
    _, expected = greedy(served, f"Describe{image_text(TALL[2])}", [TALL[1]])
    body = {"inputs": f"Describe![]({TALL[0]})", "parameters": {"max_new_tokens": NEW}}
    assert streamed_ids(url, body) == expected


def chat(url: str, image: str, text: str = "Describe the image") -> dict:
    """TGI's integration-test request for qwen2_5_vl: an image_url part, then the question."""
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": text}]
    body = {"model": "tgi", "messages": [{"role": "user", "content": content}], "max_tokens": NEW, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()


def test_chat_image_url_equals_transformers(served):
    url, _, tokenizer, _ = served
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"![]({WIDE[0]})Describe the image"}], tokenize=False, add_generation_prompt=True
    )
    ids, expected = greedy(served, templated.replace(f"![]({WIDE[0]})", image_text(WIDE[2])), [WIDE[1]], False)
    response = chat(url, WIDE[0])
    assert response["usage"]["prompt_tokens"] == len(ids)
    assert response["usage"]["completion_tokens"] == len(expected)
    assert response["choices"][0]["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)


@qwen2_5_vl_only
def test_tokenize_shows_each_image_grid(served):
    url, model, tokenizer, _ = served
    tokens = httpx.post(f"{url}/tokenize", json={"inputs": f"Look![]({TALL[0]})"}, timeout=60).json()
    assert [t["id"] for t in tokens] == tokenizer(f"Look{image_text(TALL[2])}")["input_ids"]
    assert sum(t["id"] == model.config.image_token_id for t in tokens) == 6


@qwen2_5_vl_only
def test_the_same_image_hits_the_prefix_cache_and_another_never_shares_kv(served):
    url, model, tokenizer, _ = served
    question = "Which colour dominates this picture, and where?"
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"![]({WIDE[0]}){question}"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(templated.replace(f"![]({WIDE[0]})", image_text(WIDE[2])), add_special_tokens=False)["input_ids"]
    first_pad = ids.index(model.config.image_token_id)
    first = chat(url, WIDE[0], question)
    again = chat(url, WIDE[0], question)
    other = chat(url, OTHER_WIDE[0], question)
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, again, other)]
    assert cached[1] > first_pad + 6  # past the image: its placeholders' KV (and the text after) reused
    assert cached[2] <= first_pad  # another picture of the same size: nothing from its first placeholder on
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


@qwen2_5_vl_only
def test_an_image_past_the_processors_aspect_ratio_is_refused_and_the_server_keeps_serving(served):
    url = served[0]
    sliver, _, _ = data_url((9, 9, 9), (300, 1))  # transformers' smart_resize refuses ratios past 200
    message = "Input validation error: invalid image: absolute aspect ratio must be smaller than 200, got 300.0"
    generate = {"inputs": f"![]({sliver})Hi", "parameters": {"max_new_tokens": 2}}
    content = [{"type": "image_url", "image_url": {"url": sliver}}, {"type": "text", "text": "Hi"}]
    for route, body in [
        ("/generate", generate),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": content}], "max_tokens": 2}),
        ("/tokenize", {"inputs": generate["inputs"]}),
    ]:
        response = httpx.post(f"{url}{route}", json=body, timeout=60)
        assert (response.status_code, response.json()) == (422, {"error": message, "error_type": "validation"})
    assert chat(url, WIDE[0])["choices"][0]["finish_reason"] in ("length", "stop")


SIDES = [1, 2, 3, 27, 28, 29, 100, 201, 400]  # around the 28-pixel patch pair; ratios past the processor's 200
MODES = ["RGB", "RGBA", "L", "LA", "P", "1", "I;16", "I", "CMYK"]
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif", "BMP": "image/bmp"}


def image_file(size: tuple[int, int], mode: str, form: str) -> bytes:
    out = io.BytesIO()
    try:
        Image.new(mode, size).save(out, format=form)
    except (OSError, ValueError, KeyError):  # a mode the format cannot hold: RGB then
        out = io.BytesIO()
        Image.new("RGB", size, (9, 99, 199)).save(out, format=form)
    return out.getvalue()


def as_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@st.composite
def image_urls(draw: st.DrawFn) -> str:
    """A data URL of an image of any size (extreme aspect ratios too), mode and format, labelled with its own mime
    type or another's, sometimes cut short or with a byte flipped."""
    form = draw(st.sampled_from(sorted(FORMATS)))
    data = bytearray(
        image_file((draw(st.sampled_from(SIDES)), draw(st.sampled_from(SIDES))), draw(st.sampled_from(MODES)), form)
    )
    damage = draw(st.sampled_from(["none", "none", "none", "cut", "flip"]))
    if damage == "cut":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif damage == "flip":
        at = draw(st.integers(0, len(data) - 1))
        data[at] ^= 1 << draw(st.integers(0, 7))
    return as_url(
        bytes(data), FORMATS[form] if draw(st.booleans()) else draw(st.sampled_from(sorted(FORMATS.values())))
    )


@qwen2_5_vl_only
@settings(max_examples=40, derandomize=True, deadline=None, database=None)
@given(url=image_urls(), chat_route=st.booleans())
@example(url=as_url(image_file((1, 400), "RGB", "PNG"), "image/png"), chat_route=False)  # ratios past 200: 422
@example(url=as_url(image_file((400, 2), "L", "PNG"), "image/png"), chat_route=True)
def test_any_image_file_is_served_or_refused_as_tgi_refuses_it(served, url, chat_route):
    if chat_route:
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]
        route, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    else:
        route, body = "/generate", {"inputs": f"![]({url})Hi", "parameters": {"max_new_tokens": 2}}
    response = httpx.post(f"{served[0]}{route}", json=body, timeout=60)
    if response.status_code == 422:
        error = response.json()
        assert error["error_type"] == "validation" and error["error"].startswith("Input validation error: "), error
    else:
        assert response.status_code == 200, response.text
