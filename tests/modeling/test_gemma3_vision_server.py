"""Gemma 3 images through the real server (TGI's launcher, a tiny random checkpoint on the SmolLM2 tokenizer with
Gemma 3's image tokens added): TGI's request shapes for gemma3 (base64 png/jpeg/RGBA, /generate, streaming, chat
image_url) give transformers' greedy ids and TGI's token counts; /tokenize shows the placeholder tokens; bad
images and more than --max-images get TGI's 422 texts, and the server keeps serving; private addresses are never
fetched."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from tests.modeling.helpers import image_greedy
from tests.modeling.test_gemma3_multimodal import tiny_multimodal
from tests.modeling.vision_server import greedy_until_eos, serving, streamed_ids

NEW = 10
IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]  # ids vocab-3, -2, -1 (tiny_multimodal)
IMAGE_TEXT = "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"  # TGI's, 4 soft tokens here


def data_url(mode: str, fmt: str, color) -> tuple[str, bytes]:
    picture = Image.new(mode, (36, 28), color)
    picture.putpixel((2, 3), (255, 255, 0, 255)[: len(mode)])
    out = io.BytesIO()
    picture.save(out, format=fmt)
    mime = "image/png" if fmt == "PNG" else "image/jpeg"
    return f"data:{mime};base64,{base64.b64encode(out.getvalue()).decode()}", out.getvalue()


PNG = data_url("RGB", "PNG", (200, 30, 60))
JPEG = data_url("RGB", "JPEG", (10, 220, 90))
RGBA = data_url("RGBA", "PNG", (0, 0, 0, 0))  # TGI's test: an empty transparent image


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-vision-server")
    processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    flags = "--enable-prefill-logprobs --max-images 2"
    with serving(folder, IMAGE_TOKENS, IMAGE_TOKENS[2], tiny_multimodal, processor, flags) as s:
        yield s


def greedy(served, text: str, images: list[bytes], add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, transformers' greedy ids) for `text` with its images already expanded to IMAGE_TEXT."""

    def reference(model, ids: list[int], processed) -> list[int]:
        return image_greedy(model, ids, processed["pixel_values"], NEW)

    return greedy_until_eos(served, text, images, reference, add_special_tokens)


def test_generate_with_images_equals_transformers(served):
    url = served[0]
    inputs = f"![]({PNG[0]})What is this?![]({JPEG[0]})And this?"
    ids, expected = greedy(served, f"{IMAGE_TEXT}What is this?{IMAGE_TEXT}And this?", [PNG[1], JPEG[1]])
    body = {"inputs": inputs, "parameters": {"max_new_tokens": NEW, "decoder_input_details": True}}
    response = httpx.post(f"{url}/generate", json=body, timeout=120).json()
    assert [token["id"] for token in response["details"]["tokens"]] == expected
    assert [token["id"] for token in response["details"]["prefill"]] == ids  # TGI's count: placeholders included


def test_generate_stream_with_a_jpeg(served):
    url = served[0]
    _, expected = greedy(served, f"Describe{IMAGE_TEXT}", [JPEG[1]])
    body = {"inputs": f"Describe![]({JPEG[0]})", "parameters": {"max_new_tokens": NEW}}
    assert streamed_ids(url, body) == expected


def test_chat_image_url_rgba_counts_tgi_prompt_tokens(served):
    url, _, tokenizer, _ = served
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": RGBA[0]}}, {"type": "text", "text": "What is it?"}],
        }
    ]
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"![]({RGBA[0]})What is it?"}], tokenize=False, add_generation_prompt=True
    )
    ids, expected = greedy(served, templated.replace(f"![]({RGBA[0]})", IMAGE_TEXT), [RGBA[1]], False)
    body = {"model": "tgi", "messages": messages, "max_tokens": NEW, "temperature": 0.0}  # 0: greedy (TGI)
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    assert response["usage"]["prompt_tokens"] == len(ids)
    assert response["usage"]["completion_tokens"] == len(expected)
    assert response["choices"][0]["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)


def test_tokenize_shows_the_placeholder_tokens(served):
    url, model, tokenizer, _ = served
    inputs = f"Look![]({PNG[0]})"
    tokens = httpx.post(f"{url}/tokenize", json={"inputs": inputs}, timeout=60).json()
    assert [t["id"] for t in tokens] == tokenizer(f"Look{IMAGE_TEXT}")["input_ids"]
    assert sum(t["id"] == model.config.image_token_id for t in tokens) == 4


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ("![](data:image/png;base64,@@@)x", "Input validation error: base64 encoding is invalid: "),
        (
            f"![](data:image/png;base64,{base64.b64encode(b'not an image').decode()})x",
            "Input validation error: invalid image: ",
        ),
        ("![](data:image/png,abc)x", "Input validation error: invalid image content: image/png,abc"),
        (
            "![](http://127.0.0.1:1/cat.png)x",
            "Input validation error: Could not fetch image: 127.0.0.1 resolves to a non-public",
        ),
        (
            "![](http://169.254.169.254/latest/meta-data)x",
            "Input validation error: Could not fetch image: 169.254.169.254",
        ),
    ],
)
def test_bad_images_get_tgi_422(served, inputs, message):
    url = served[0]
    response = httpx.post(f"{url}/generate", json={"inputs": inputs, "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert response.status_code == 422
    assert response.json()["error_type"] == "validation"
    assert response.json()["error"].startswith(message)


def test_more_images_than_max_images_get_a_422_and_the_server_keeps_serving(served):
    url = served[0]
    body = {"inputs": f"![]({PNG[0]})a![]({JPEG[0]})b![]({PNG[0]})c", "parameters": {"max_new_tokens": 2}}
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code == 422
    assert response.json() == {
        "error": "Input validation error: `inputs` must have at most 2 images. Given: 3",
        "error_type": "validation",
    }
    body["inputs"] = f"![]({PNG[0]})a![]({JPEG[0]})b"
    assert httpx.post(f"{url}/generate", json=body, timeout=60).status_code == 200
