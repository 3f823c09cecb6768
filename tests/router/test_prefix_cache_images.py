"""The image-aware prefix cache: a prompt's image placeholders are keyed by the image, so a repeated image
hits its KV and a different image behind the same placeholder ids never does."""

from __future__ import annotations

import hashlib

from router_fakes import drain_events, hash_engine

from tgi_compat.router.images import PromptImage, image_keyed_ids, whole_images
from tgi_compat.router.request import GenerateRequest

PLACEHOLDER = 40
PROMPT = [3, 4, 5, 6] + [PLACEHOLDER] * 8 + [7, 8, 9]  # text, one image of 8 placeholders, text


def image(data: bytes, offset: int = 4) -> PromptImage:
    return PromptImage(offset, 8, hashlib.sha256(data).hexdigest(), data)


def cached_tokens(events) -> int:
    return events[0].num_cached_tokens


def test_keys_follow_the_image_not_the_placeholder_ids():
    red, green = image(b"red"), image(b"green")
    assert image_keyed_ids(PROMPT, [red]) == image_keyed_ids(PROMPT, [image(b"red")])
    red_keys, green_keys = image_keyed_ids(PROMPT, [red]), image_keyed_ids(PROMPT, [green])
    assert red_keys[:4] == green_keys[:4] == PROMPT[:4] and red_keys[12:] == PROMPT[12:]
    assert not set(red_keys[4:12]) & set(green_keys[4:12])
    assert len(set(red_keys[4:12])) == 8 and max(red_keys[4:12]) < -(2**84)
    assert image_keyed_ids(PROMPT[:6], [red]) == red_keys[:6]  # a prefix keys as the whole does


def test_the_same_image_twice_hits_the_cache():
    engine = hash_engine()
    first = drain_events(engine, [GenerateRequest("first", PROMPT, max_new_tokens=3, images=[image(b"red")])])
    second = drain_events(engine, [GenerateRequest("again", PROMPT, max_new_tokens=3, images=[image(b"red")])])
    assert cached_tokens(first["first"]) == 0
    assert cached_tokens(second["again"]) == len(PROMPT) - 1  # all but the last, computed to sample


def test_a_different_image_never_shares_kv():
    engine = hash_engine()
    drain_events(engine, [GenerateRequest("red", PROMPT, max_new_tokens=3, images=[image(b"red")])])
    green = drain_events(engine, [GenerateRequest("green", PROMPT, max_new_tokens=3, images=[image(b"green")])])
    text = drain_events(engine, [GenerateRequest("text", PROMPT, max_new_tokens=3)])
    assert cached_tokens(green["green"]) == 4  # the text before the image only
    assert cached_tokens(text["text"]) == 4  # the placeholder ids as text are not the image either


def test_prefill_chunks_never_split_a_bidirectional_image():
    images = [PromptImage(4, 8, "a" * 64, b"a", bidirectional=True), PromptImage(14, 8, "b" * 64, b"b")]
    assert whole_images(0, 6, images) == 4  # stops before the image
    assert whole_images(4, 3, images) == 8  # starts at it: the whole image, past the budget
    assert whole_images(0, 12, images) == 12  # ends at its end
    assert whole_images(12, 5, images) == 5  # a causal image may be split


def test_an_interleaved_image_fills_only_its_embed_positions_and_keys_its_whole_span():
    # Idefics3-like: rows at span positions 0, 1, 4, 5; the two tokens between keep their own embeddings
    tiled = PromptImage(4, 6, hashlib.sha256(b"red").hexdigest(), b"red", embeds=(0, 1, 4, 5))
    assert tiled.rows_at(4, 10) == (slice(0, 4), [4, 5, 8, 9])
    assert tiled.rows_at(5, 9) == (slice(1, 3), [5, 8])  # a chunk cut inside it takes its own rows
    assert tiled.rows_at(6, 8) == (slice(2, 2), [])  # only separators: no rows
    assert image(b"red").rows_at(5, 7) == (slice(1, 3), [5, 6])  # one run: every position
    keys = image_keyed_ids(PROMPT, [tiled])
    assert all(key < 0 for key in keys[4:10]) and keys[10:] == PROMPT[10:]
