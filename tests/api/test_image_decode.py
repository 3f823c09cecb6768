"""The API's image decoders in worker processes (tgi_compat/api/serving/image_decode.py): the same images, sizes,
resized pixels and refusal texts as the decode in the fetch thread; a dead worker is replaced; nothing is left in
/dev/shm."""

from __future__ import annotations

import io
import os
import re
import signal

import numpy as np
import pytest
from PIL import Image

from tgi_compat.api.protocol.errors import TgiError
from tgi_compat.api.protocol.images import DecodedImage, Resize, decode_image
from tgi_compat.api.serving import image_decode
from tgi_compat.api.serving.image_decode import ImageDecoder, decode_processes


def _file(fmt: str, mode: str, size: tuple[int, int], seed: int = 0) -> bytes:
    channels = len(mode)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode).save(out, format=fmt)
    return out.getvalue()


def _sides(height: int, width: int) -> tuple[int, int]:
    """A resize of Qwen-VL's kind: sides to multiples of 28, and a refusal past an aspect ratio of 200."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError("absolute aspect ratio must be smaller than 200")
    return max(28, round(height / 28) * 28), max(28, round(width / 28) * 28)


RESIZE = Resize(_sides, int(Image.Resampling.BICUBIC))


@pytest.fixture(scope="module")
def decoder():
    decoder = ImageDecoder(processes=2)
    assert len(decoder.warm()) == 2  # both workers up and answering, not the first one twice
    yield decoder
    decoder.close()


def _leftovers() -> set[str]:
    return {path.name for path in image_decode._SHM.glob("tgi-image-*")}


def _refusal(decode, *args) -> str:
    """decode(*args)'s refusal text, but the address Pillow names its file object by (`<_io.BytesIO object at 0x..>`)."""
    with pytest.raises(TgiError) as caught:
        decode(*args)
    assert caught.value.status == 422
    return re.sub(r"0x[0-9a-f]+", "0x", caught.value.message)


@pytest.mark.parametrize(
    ("fmt", "mime", "mode", "size"),
    [
        ("PNG", "image/png", "RGB", (61, 45)),
        ("PNG", "image/png", "RGBA", (30, 70)),
        ("JPEG", "image/jpeg", "RGB", (90, 33)),
        ("WEBP", None, "RGB", (40, 40)),  # a guessed mime type
        ("PNG", "image/png", "L", (29, 57)),
    ],
)
@pytest.mark.parametrize("resize", [RESIZE, None], ids=["resized", "validated"])
def test_a_worker_decodes_as_the_fetch_thread_does(decoder, fmt, mime, mode, size, resize):
    data = _file(fmt, mode, size)
    before = _leftovers()
    ours = decoder.decode(data, mime, resize, "digest")
    assert ours == decode_image(data, mime, resize, "digest")
    assert isinstance(ours, DecodedImage) and ours.data is data
    assert (ours.resized is not None) == (resize is not None)
    assert _leftovers() == before


def test_a_worker_refuses_with_the_fetch_threads_texts(decoder):
    truncated = _file("PNG", "RGB", (64, 64))[:200]
    not_png = _file("JPEG", "RGB", (20, 20))
    sliver = _file("PNG", "RGB", (201 * 2, 2))  # an aspect ratio the resize refuses, read from the header
    before = _leftovers()
    for data, mime in ((truncated, "image/png"), (not_png, "image/png"), (b"not an image", None), (sliver, None)):
        theirs = _refusal(decode_image, data, mime, RESIZE, "d")
        assert _refusal(decoder.decode, data, mime, RESIZE, "d") == theirs
        assert theirs.startswith("Input validation error: invalid image")
    assert _leftovers() == before


def test_a_dead_worker_is_replaced(decoder):
    data = _file("PNG", "RGB", (50, 50))
    expected = decode_image(data, "image/png", RESIZE, "d")
    assert decoder.decode(data, "image/png", RESIZE, "d") == expected
    for pid in list(decoder.pool._processes):  # (the executor's own map of its workers)
        os.kill(pid, signal.SIGKILL)
    assert decoder.decode(data, "image/png", RESIZE, "d") == expected


def test_no_room_for_the_files_decodes_in_the_thread(decoder, monkeypatch, tmp_path):
    """Where the files cannot be written (/dev/shm full: Docker's 64 MB), the image is decoded in the fetch thread."""
    monkeypatch.setattr(image_decode, "_SHM", tmp_path / "missing")
    data = _file("PNG", "RGB", (40, 30))
    assert decoder.decode(data, "image/png", RESIZE, "d") == decode_image(data, "image/png", RESIZE, "d")


def test_workers_only_where_the_host_has_cores_to_spare():
    assert [decode_processes(cpus) for cpus in (1, 2, 3, 4, 8, 16, 64)] == [0, 0, 0, 2, 4, 8, 8]
    assert ImageDecoder(0).decode(_file("PNG", "RGB", (9, 9)), "image/png", None, "d").width == 9
