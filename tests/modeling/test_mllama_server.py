"""Mllama behind the real server (TGI's launcher, a tiny random checkpoint on the SmolLM2 tokenizer with `<|image|>`
added): a base64 image in /generate inputs and an OpenAI chat image_url part each give transformers' greedy ids,
the image as TGI's one `<|image|>` token, counted as TGI counts it (details.prefill, usage.prompt_tokens)."""

from __future__ import annotations

import base64

import httpx
import pytest

from tests.modeling.mllama_helpers import WIDE, generate_ids, image_processor, tiny_mllama
from tests.modeling.vision_server import generate_details, greedy_until_eos, serving

NEW = 8
# prefill chunks of 8 tokens: the text after the image is read over several steps
FLAGS = "--enable-prefill-logprobs --max-batch-prefill-tokens 8"
WIDE_URL = f"data:image/png;base64,{base64.b64encode(WIDE).decode()}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mllama-server")
    with serving(folder, ["<|image|>"], "<|image|>", tiny_mllama, image_processor(), FLAGS) as s:
        yield s


def greedy(served, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, transformers' `generate` ids to the first eos) for `text` (with `<|image|>` for WIDE)."""
    return greedy_until_eos(
        served, text, [WIDE], lambda model, ids, _: generate_ids(model, ids, [WIDE], NEW), add_special_tokens
    )


def test_generate_with_an_image_equals_transformers(served):
    ids, expected = greedy(served, "A picture:<|image|>What is in it?")
    prefill, generated = generate_details(served[0], f"A picture:![]({WIDE_URL})What is in it?", NEW)
    assert prefill == ids and ids.count(served[1].config.image_token_id) == 1  # TGI's one token an image
    assert generated == expected


def test_chat_image_url_answers_transformers_greedy(served):
    url, _, tokenizer, _ = served
    content = [{"type": "image_url", "image_url": {"url": WIDE_URL}}, {"type": "text", "text": "Describe the image"}]
    body = {"model": "tgi", "messages": [{"role": "user", "content": content}], "max_tokens": NEW, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": "<|image|>Describe the image"}], tokenize=False, add_generation_prompt=True
    )
    ids, expected = greedy(served, templated, add_special_tokens=False)
    assert response["usage"]["prompt_tokens"] == len(ids)
    assert response["choices"][0]["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
