"""PaliGemma's prompts as TGI's model server writes them (vlm_causal_lm.py: `<image>`s, then `<bos>` + each run of
text + `\\n`, no special tokens added), the whole prompt one span that attends both ways and that the prefix cache
keys by all of its content; through the real app (the scripted engine) for /generate and /tokenize."""

from __future__ import annotations

import httpx

from tests.api.test_images import data_url, encoded
from tests.modeling.paligemma_helpers import tiny_paligemma
from tgi_compat.api.protocol.images import DecodedImage
from tgi_compat.api.serving.image_fetch import ImageFetcher
from tgi_compat.api.serving.images import Placeholders, PrefixLMPrompts, VisionPrompts
from tgi_compat.modeling.models.transformers_fallback import fallback_model_config
from tgi_compat.modeling.registry import describe_modeling_path
from tgi_compat.router.images import image_keyed_ids

RED, GREEN = (DecodedImage(data, "image/png", 1, 1) for data in (b"red", b"green"))


def test_the_checkpoint_gives_its_image_tokens_and_no_special_tokens():
    config = tiny_paligemma("gemma2").config.to_dict() | {"architectures": ["PaliGemmaForConditionalGeneration"]}
    prompts = VisionPrompts.of(fallback_model_config(config), ImageFetcher())
    assert isinstance(prompts, PrefixLMPrompts) and not prompts.adds_special_tokens
    assert prompts.image_token_id == 299 and prompts.placeholders(RED) == Placeholders("<image>" * 16, 16)
    described = describe_modeling_path("PaliGemmaForConditionalGeneration")
    assert described == "transformers modeling of its text model and vision encoder"


async def test_text_runs_are_wrapped_as_tgi_does():
    prompts = PrefixLMPrompts(lambda _: Placeholders("<i><i>", 2), 9, False, ImageFetcher(), interleaved=True)
    url = data_url(encoded("PNG"), "image/png")
    assert (await prompts.expand(f"![]({url})caption en"))[0] == "<i><i><bos>caption en\n"
    assert (await prompts.expand(f"Q![]({url})![]({url})"))[0] == "<bos>Q\n<i><i><i><i>"  # no text after: no <bos>
    assert await prompts.expand("text only") == ("<bos>text only\n", [])


def test_the_whole_prompt_is_one_span_keyed_by_all_of_it():
    prompts = PrefixLMPrompts(lambda _: Placeholders("<i><i>", 2), 9, False, ImageFetcher(), interleaved=True)
    ids = [9, 9, 9, 9, 2, 40, 41, 13]
    first, second = prompts.place(ids, [RED, GREEN])
    assert (first.offset, first.length, first.bidirectional, first.embeds, first.digest) == (
        0,
        8,
        True,
        (0, 1),
        RED.digest,
    )
    assert (second.offset, second.length, second.bidirectional) == (2, 2, False)
    keys = image_keyed_ids(ids, [first, second])
    assert keys == image_keyed_ids(ids, prompts.place(ids, [RED, GREEN]))  # the same prompt: the same keys
    other_question = [9, 9, 9, 9, 2, 40, 42, 13]
    assert image_keyed_ids(other_question, prompts.place(other_question, [RED, GREEN]))[0] != keys[0]
    assert image_keyed_ids(ids, prompts.place(ids, [RED, RED]))[0] != keys[0]  # another second image


async def test_generate_and_tokenize_send_the_model_servers_ids(engine, tokenizer):
    from scripted_engine import make_state

    from tgi_compat.api.server.app import create_app

    state = make_state(engine, tokenizer)
    image_token = tokenizer.encode_sync("<|endoftext|>", add_special_tokens=False)[0]
    state.vision = PrefixLMPrompts(
        lambda _: Placeholders("<|endoftext|>" * 3, 3), image_token, False, ImageFetcher(), interleaved=True
    )
    assert not state.special_tokens()
    url = data_url(encoded("PNG"), "image/png")
    expected = tokenizer.encode_sync("<|endoftext|>" * 3 + "<bos>caption en\n", add_special_tokens=False)
    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        inputs = f"![]({url})caption en"
        assert (await client.post("/generate", json={"inputs": inputs})).status_code == 200
        tokens = (await client.post("/tokenize", json={"inputs": inputs})).json()
    assert engine.requests[0].prompt_ids == expected == [token["id"] for token in tokens]
    (image,) = engine.requests[0].images
    assert (image.offset, image.length, image.bidirectional, image.embeds) == (0, len(expected), True, (0, 1, 2))
