"""Idefics3 through the transformers fallback (models/transformers_vlm.py) behind the real server (TGI's launcher, a
tiny random checkpoint on the SmolLM2 tokenizer with Idefics3's image tokens added): images in /generate inputs give
transformers' greedy ids, each image as TGI's text of row/column tokens around its tiles' `<image>` runs, cut by
16-token prefill chunks; /tokenize counts them as TGI does."""

from __future__ import annotations

import httpx
import pytest

from tests.modeling.idefics3_helpers import LONGEST, TILE, image_processor, tiny_idefics3
from tests.modeling.test_llava_next_fallback import TALL, WIDE
from tests.modeling.vision_server import check_two_images, generate_greedy, serving
from tgi_compat.modeling.registry import describe_modeling_path
from tgi_compat.modeling.vision.idefics3 import Idefics3ImageTokens

NEW = 8
FLAGS = "--enable-prefill-logprobs --max-batch-prefill-tokens 16"
TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>"]
TOKENS += [f"<row_{r}_col_{c}>" for r in range(1, 3) for c in range(1, 3)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("idefics3-server")

    def build(vocab: int, **text_overrides):
        return tiny_idefics3(vocab, vocab - len(TOKENS), **text_overrides)  # `<image>`: the first token added

    with serving(folder, TOKENS, "<image>", build, image_processor(), FLAGS) as s:
        yield s


def image_text(served, size: tuple[int, int]) -> str:
    width, height = size
    return Idefics3ImageTokens(served[1].config.image_token_id, 4, LONGEST, TILE).text(height, width)


def greedy(served, text: str, images: list[bytes], add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, transformers' greedy ids) for `text` with its images already expanded."""
    return generate_greedy(served, text, images, ("pixel_values", "pixel_attention_mask"), NEW, add_special_tokens)


def test_generate_with_two_images_equals_transformers(served):
    assert describe_modeling_path("Idefics3ForConditionalGeneration") == (
        "transformers modeling of its text model and vision encoder"
    )
    check_two_images(served, greedy, lambda size: image_text(served, size), [WIDE, TALL])


def test_tokenize_counts_as_tgi(served):
    url, model, tokenizer, _ = served
    tokens = httpx.post(f"{url}/tokenize", json={"inputs": f"Look![]({WIDE[0]})"}, timeout=60).json()
    ids = [t["id"] for t in tokens]
    assert ids == tokenizer("Look" + image_text(served, WIDE[2]))["input_ids"]
    assert ids.count(model.config.image_token_id) == (2 * 2 + 1) * 4  # 2 x 2 tiles and the global image
    tall = [t["id"] for t in httpx.post(f"{url}/tokenize", json={"inputs": f"![]({TALL[0]})"}, timeout=60).json()]
    assert tall.count(model.config.image_token_id) == (2 * 1 + 1) * 4
