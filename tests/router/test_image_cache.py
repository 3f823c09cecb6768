"""The encoder-output cache: misses encoded once per call, hits never; LightLLM's capacity and reserved ratio, and
a bound on the bytes of rows it keeps."""

from __future__ import annotations

import hashlib
from concurrent.futures import Future

import pytest
import torch

from tgi_compat.router.image_cache import EncoderCache
from tgi_compat.router.images import PromptImage


def image(name: str, offset: int = 0) -> PromptImage:
    data = name.encode()
    return PromptImage(offset, 2, hashlib.sha256(data).hexdigest(), data)


class Encoder:
    """The ImageEncoder seam: an image's "processed" tensor holds its file's length; each encode call is recorded
    as the files it encoded, each prefetch as the file it started."""

    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []
        self.started: list[bytes] = []

    def preprocess_async(self, data: bytes, resized: tuple[int, int] | None = None) -> Future[dict[str, torch.Tensor]]:
        self.started.append(data)
        future: Future[dict[str, torch.Tensor]] = Future()
        future.set_result({"data": torch.tensor(list(data)), "length": torch.tensor(float(len(data)))})
        return future

    def encode(self, processed):
        self.calls.append([bytes(p["data"].tolist()) for p in processed])
        return [torch.full((2, 3), p["length"].item()) for p in processed]


def test_misses_are_encoded_together_and_hits_never():
    encoder = Encoder()
    cache = EncoderCache(encoder, capacity=10)
    first = cache.features([image("a"), image("bb"), image("a", 5)])
    assert encoder.calls == [[b"a", b"bb"]] and [f[0, 0].item() for f in first] == [1.0, 2.0, 1.0]
    cache.features([image("bb"), image("a")])
    assert len(encoder.calls) == 1 and cache.num_encoded == 2


def test_overflow_keeps_the_reserved_share_most_recent_first():
    encoder = Encoder()
    cache = EncoderCache(encoder, capacity=4, reserved_ratio=0.5)
    for name in "abcd":
        cache.features([image(name)])
    cache.features([image("a")])  # a is now the most recent
    cache.features([image("e")])  # 5 > 4: down to 2, the most recent
    assert len(cache) == 2
    cache.features([image("a"), image("e")])
    assert cache.num_encoded == 5  # both kept
    cache.features([image("b")])
    assert cache.num_encoded == 6  # b was dropped


def test_past_its_bytes_it_keeps_the_reserved_share_of_them_but_never_the_steps_own():
    encoder = Encoder()
    row_bytes = 2 * 3 * 4  # one image's [2, 3] float32 rows
    cache = EncoderCache(encoder, capacity=100, reserved_ratio=0.5, max_bytes=4 * row_bytes)
    for name in "abcd":
        cache.features([image(name)])
    assert (len(cache), cache.num_bytes) == (4, 4 * row_bytes)
    cache.features([image("e")])  # 5 images' rows > 4's: down to 2 images' bytes, the most recent
    assert (len(cache), cache.num_bytes) == (2, 2 * row_bytes)
    cache.features([image("d"), image("e")])
    assert cache.num_encoded == 5
    step = [image(name) for name in "fghijk"]  # one step's six images, more than the bound: all kept
    assert len(cache.features(step)) == 6 and (len(cache), cache.num_bytes) == (6, 6 * row_bytes)
    cache.features([image("a")])  # the next step drops the rest down to the reserved share
    assert (len(cache), cache.num_bytes) == (2, 2 * row_bytes)


def test_each_kept_image_owns_its_rows_not_its_calls_whole_output():
    class Batched(Encoder):
        def encode(self, processed):
            self.calls.append([bytes(p["data"].tolist()) for p in processed])
            return list(torch.arange(len(processed) * 6, dtype=torch.float32).reshape(len(processed), 2, 3))

    cache = EncoderCache(Batched())
    first, second = cache.features([image("a"), image("b")])
    for rows in (first, second):
        assert rows.untyped_storage().nbytes() == rows.numel() * rows.element_size() == 24
    assert second.tolist() == [[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]] and cache.num_bytes == 48


def test_step_embeds_gather_each_chunks_placeholder_rows():
    cache = EncoderCache(Encoder())
    images = [PromptImage(1, 2, "x" * 64, b"xy", bidirectional=True), PromptImage(5, 2, "z" * 64, b"zzz")]
    # a chunk of positions [2, 6) sitting at rows 10.. of the flat batch, beside a text-only chunk
    embeds = cache.step_embeds([(0, 0, 4, []), (10, 2, 6, images)], torch.device("cpu"))
    assert embeds is not None
    assert embeds.token_index.tolist() == [10, 13]  # position 2 (image 1's second), position 5 (image 2's first)
    assert embeds.embeds[:, 0].tolist() == [2.0, 3.0]
    assert embeds.spans == [[], [(1, 3)]]  # from the span's start, its position 1 computed before
    assert cache.step_embeds([(0, 0, 4, [])], torch.device("cpu")) is None


def test_bad_limits_are_refused():
    with pytest.raises(ValueError):
        EncoderCache(Encoder(), capacity=0)
    with pytest.raises(ValueError):
        EncoderCache(Encoder(), max_bytes=-1)


def test_a_steps_misses_over_all_its_chunks_are_encoded_in_one_call():
    encoder = Encoder()
    cache = EncoderCache(encoder)
    cache.features([image("cached")])
    chunks = [(0, 0, 4, [image("a", 1)]), (4, 0, 8, [image("cached", 0), image("bb", 4)]), (12, 0, 3, [image("a")])]
    embeds = cache.step_embeds(chunks, torch.device("cpu"))
    assert encoder.calls == [[b"cached"], [b"a", b"bb"]]  # the step's two misses in one call, the hit in none
    assert embeds is not None and embeds.token_index.tolist() == [1, 2, 4, 5, 8, 9, 12, 13]
    assert embeds.embeds[:, 0].tolist() == [1.0, 1.0, 6.0, 6.0, 2.0, 2.0, 1.0, 1.0]


def test_a_queued_requests_images_are_prepared_once_ahead_of_their_step():
    encoder = Encoder()
    cache = EncoderCache(encoder)
    cache.features([image("cached")])
    cache.prefetch([image("a"), image("cached"), image("a", 4)])  # started once; a cached image never
    cache.prefetch([image("a")])  # already under way
    assert encoder.started == [b"cached", b"a"]
    first = cache.features([image("a"), image("bb")])  # the prefetched one and one started now, in one call
    assert encoder.started == [b"cached", b"a", b"bb"] and encoder.calls[-1] == [b"a", b"bb"]
    assert [f[0, 0].item() for f in first] == [1.0, 2.0]


def test_work_prepared_long_ago_is_dropped(monkeypatch):
    """A queued request cancelled before its step leaves its prepared images behind: they go after PENDING_TTL_S."""
    import tgi_compat.router.image_cache as image_cache

    encoder = Encoder()
    cache = EncoderCache(encoder)
    cache.prefetch([image("a")])
    now = image_cache.time.monotonic()
    monkeypatch.setattr(image_cache.time, "monotonic", lambda: now + image_cache.PENDING_TTL_S + 1)
    cache.prefetch([image("bb")])
    cache.features([image("a")])  # started again: the first one was dropped
    assert encoder.started == [b"a", b"bb", b"a"]
