"""Idefics3 through the real engine (scheduler, batch builder, encoder cache, the transformers fallback's runner) on a
tiny random checkpoint: each image's `<image>` runs are interleaved with row/column and global-image tokens that keep
their own embeddings (PromptImage.embeds, placed by the API's VisionPrompts). Greedy ids equal transformers' with two
images (2 x 2 and 2 x 1 tiles) beside a text-only request, whole and under 7-token prefill chunks (which cut runs and
separators alike); a repeated image is encoded once and hits the prefix cache; the count and text TGI writes match
transformers' processor and model."""

from __future__ import annotations

import pytest

from benchmarks.device.steps import engine_tokens
from tests.modeling.idefics3_helpers import (
    IMAGE,
    LONGEST,
    PROMPTS,
    TALL,
    TOKENS,
    WIDE,
    check_a_repeated_image_hits_the_prefix_cache,
    check_images_beside_text,
    decoded,
    engine_request,
    processed,
    saved_idefics3,
)
from tgi_compat.api.protocol.errors import TgiError
from tgi_compat.modeling.models.transformers_vlm import Idefics3ForImageTextToText
from tgi_compat.modeling.vision.idefics3 import Idefics3ImageTokens
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return saved_idefics3(tmp_path_factory.mktemp("idefics3-engine"))


def make_engine(folder: str, **limits) -> EngineCore:
    return EngineCore.from_config(EngineConfig(model_id=folder, device="cpu", dtype="float32", **limits))


@pytest.mark.parametrize("prefill", [4096, 7], ids=["whole", "chunked"])
def test_greedy_ids_equal_transformers_with_two_images(checkpoint, prefill):
    model, folder = checkpoint
    engine = make_engine(folder, max_batch_prefill_tokens=prefill)
    check_images_beside_text(model, lambda requests: engine_tokens(engine, requests))


def test_a_repeated_image_is_encoded_once_and_hits_the_prefix_cache(checkpoint):
    check_a_repeated_image_hits_the_prefix_cache(make_engine(checkpoint[1]), lambda id: engine_request(id, [WIDE])[0])


def test_counts_and_text_match_transformers_processor_and_model(tmp_path):
    """The grid is the processor's (return_row_col_info), the count the model's rows, the text TGI's."""
    model, folder = saved_idefics3(tmp_path)
    assert Idefics3ImageTokens.from_checkpoint(model.config.to_dict(), folder) == TOKENS
    inputs = processed([WIDE, TALL])
    rows = Idefics3ForImageTextToText.idefics3_rows(model, inputs)
    for k, (data, last_tile) in enumerate([(WIDE, "<row_2_col_2>"), (TALL, "<row_2_col_1>")]):
        image = decoded(data)
        assert TOKENS.grid(image.height, image.width) == (inputs["rows"][k][0], inputs["cols"][k][0])
        assert TOKENS.count(image.height, image.width) == len(rows[k])
        text = TOKENS.text(image.height, image.width)
        assert text.startswith("<fake_token_around_image><row_1_col_1><image>") and last_tile in text
        assert text.endswith("\n\n<fake_token_around_image><global-img>" + "<image>" * 4 + "<fake_token_around_image>")
        assert text.count("<image>") == len(rows[k])
    # do_image_splitting off: one tile, and TGI's text keeps its leading newline (transformers' has none)
    whole = Idefics3ImageTokens(IMAGE, 4, LONGEST, None)
    assert whole.grid(30, 50) == (0, 0) and whole.count(30, 50) == 4
    assert whole.text(30, 50) == "\n<fake_token_around_image><global-img>" + "<image>" * 4 + "<fake_token_around_image>"


def test_an_image_cut_by_truncation_is_refused():
    request, ids = engine_request("both", [WIDE])
    with pytest.raises(TgiError, match="do not match its images"):
        PROMPTS.place(ids[6:], [decoded(WIDE)])
