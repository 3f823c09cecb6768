"""Idefics2 through the real engine (scheduler, batch builder, encoder cache, the transformers fallback's runner) on a
tiny random checkpoint: each image's `<image>` runs (four crops and the whole image) are interleaved with fake tokens
that keep their own embeddings (PromptImage.embeds, placed by the API's VisionPrompts). Greedy ids equal
transformers' with one image, and with two (apart, and adjacent, sharing a fake token) beside a text-only request,
whole and under 7-token prefill chunks; a repeated image is encoded once and hits the prefix cache; the count TGI
writes is transformers' processor's and model's."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from benchmarks.device.steps import engine_tokens
from tests.modeling import idefics2_helpers as idefics2
from tests.modeling.idefics3_helpers import TALL, WIDE, check_a_repeated_image_hits_the_prefix_cache
from tests.router.test_idefics3_engine import make_engine
from tgi_compat.modeling.models.transformers_vlm import Idefics2ForImageTextToText
from tgi_compat.modeling.vision.idefics2 import Idefics2ImageTokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return idefics2.saved_idefics2(tmp_path_factory.mktemp("idefics2-engine"))


def test_greedy_ids_equal_transformers_with_one_image(checkpoint):
    model, folder = checkpoint
    request, ids = idefics2.engine_request("one", [WIDE])
    assert ids.count(idefics2.TOKENS.image_token_id) == idefics2.TOKENS.count == 20
    assert engine_tokens(make_engine(folder), [request])["one"] == idefics2.greedy_ids(model, ids, [WIDE], idefics2.NEW)


@pytest.mark.parametrize("prefill", [4096, 7], ids=["whole", "chunked"])
def test_greedy_ids_equal_transformers_with_two_images_beside_text(checkpoint, prefill):
    model, folder = checkpoint
    engine = make_engine(folder, max_batch_prefill_tokens=prefill)
    idefics2.check_images_beside_text(model, lambda requests: engine_tokens(engine, requests))


def test_a_repeated_image_is_encoded_once_and_hits_the_prefix_cache(checkpoint):
    check_a_repeated_image_hits_the_prefix_cache(
        make_engine(checkpoint[1]), lambda id: idefics2.engine_request(id, [WIDE])[0]
    )


def test_count_and_text_match_transformers_processor_and_model(tmp_path):
    model, folder = idefics2.saved_idefics2(tmp_path)
    assert Idefics2ImageTokens.from_checkpoint(model.config.to_dict(), folder) == idefics2.TOKENS
    for data in (WIDE, TALL):
        inputs = idefics2.image_processor()(images=[[Image.open(io.BytesIO(data)).convert("RGB")]], return_tensors="pt")
        assert len(Idefics2ForImageTextToText.idefics3_rows(model, inputs)[0]) == idefics2.TOKENS.count
    fake, run = "<fake_token_around_image>", "<image>" * 4
    assert idefics2.TOKENS.text == fake + (run + fake) * 5  # transformers' processor's text, TGI's too
    whole = Idefics2ImageTokens(idefics2.TOKENS.image_token_id, 4, splitting=False)
    assert (whole.text, whole.count) == (fake + run + fake, 4)
    assert idefics2.TOKENS.merge_fakes(f"a{whole.text}{whole.text}b") == f"a{fake}{run}{fake}{run}{fake}b"


async def test_adjacent_images_share_a_fake_token_as_in_tgi():
    from tests.modeling.test_llava_next_fallback import TALL as TALL_URL
    from tests.modeling.test_llava_next_fallback import WIDE as WIDE_URL

    text, images = await idefics2.PROMPTS.expand(f"![]({WIDE_URL[0]})![]({TALL_URL[0]})?")
    assert (
        len(images) == 2
        and text == idefics2.TOKENS.text + idefics2.TOKENS.text[len("<fake_token_around_image>") :] + "?"
    )
