"""Idefics2 through the transformers fallback (models/transformers_vlm.py) behind the real server (TGI's launcher, a
tiny random checkpoint on the SmolLM2 tokenizer with Idefics2's image tokens added): images in /generate inputs give
transformers' greedy ids, each image as TGI's text of fake tokens around its crops' `<image>` runs (adjacent images
sharing one), cut by 16-token prefill chunks; /tokenize counts them as TGI does."""

from __future__ import annotations

import httpx
import pytest

from tests.modeling.idefics2_helpers import LATENTS, image_processor, tiny_idefics2
from tests.modeling.test_llava_next_fallback import TALL, WIDE
from tests.modeling.vision_server import check_two_images, generate_details, generate_greedy, serving
from tgi_compat.modeling.registry import describe_modeling_path
from tgi_compat.modeling.vision.idefics2 import Idefics2ImageTokens

NEW = 8
FLAGS = "--enable-prefill-logprobs --max-batch-prefill-tokens 16"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("idefics2-server")

    def build(vocab: int, **text_overrides):
        return tiny_idefics2(vocab, vocab - 2, **text_overrides)  # `<image>`: the first token added

    with serving(folder, ["<image>", "<fake_token_around_image>"], "<image>", build, image_processor(), FLAGS) as s:
        yield s


def tokens(served) -> Idefics2ImageTokens:
    return Idefics2ImageTokens(served[1].config.image_token_id, LATENTS, splitting=True)


def greedy(served, text: str, images: list[bytes]) -> tuple[list[int], list[int]]:
    """(prompt ids, transformers' greedy ids) for `text` with its images already expanded."""
    return generate_greedy(served, text, images, ("pixel_values", "pixel_attention_mask"), NEW, True)


def test_generate_with_images_equals_transformers(served):
    assert describe_modeling_path("Idefics2ForConditionalGeneration") == (
        "transformers modeling of its text model and vision encoder"
    )
    check_two_images(served, greedy, lambda _: tokens(served).text, [WIDE, TALL])
    # adjacent images: TGI's prompt has one fake token between them
    text = tokens(served).merge_fakes(f"Two{tokens(served).text * 2}?")
    ids, expected = greedy(served, text, [TALL[1], WIDE[1]])
    assert generate_details(served[0], f"Two![]({TALL[0]})![]({WIDE[0]})?", len(expected)) == (ids, expected)


def test_tokenize_counts_as_tgi(served):
    url, model, tokenizer, _ = served
    found = httpx.post(f"{url}/tokenize", json={"inputs": f"Look![]({WIDE[0]})![]({TALL[0]})"}, timeout=60).json()
    ids = [t["id"] for t in found]
    assert ids == tokenizer(tokens(served).merge_fakes("Look" + tokens(served).text * 2))["input_ids"]
    assert ids.count(model.config.image_token_id) == 2 * 5 * LATENTS  # four crops and the whole image, each
