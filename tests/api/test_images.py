"""Images in prompts, TGI's way: the markdown regex, data URLs, fetching with the size cap and the SSRF guard, and
(beyond TGI) a deadline for the whole fetch, in threads of the fetcher's own."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from tgi_compat.api.protocol.errors import TgiError
from tgi_compat.api.protocol.images import (
    DecodedImage,
    ImageRef,
    Resize,
    image_markdown,
    split_prompt,
)
from tgi_compat.api.serving import image_fetch
from tgi_compat.api.serving.image_decode import ImageDecoder
from tgi_compat.api.serving.image_fetch import ImageFetcher
from tgi_compat.api.serving.images import Placeholders, VisionPrompts


def encoded(fmt: str, mode: str = "RGB", size: tuple[int, int] = (20, 12)) -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, (200, 30, 60, 128)[: len(mode)]).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def refusal(fetcher: ImageFetcher, markdown: str) -> str:
    with pytest.raises(TgiError) as caught:
        fetcher.load(ImageRef(markdown))
    assert caught.value.status == 422 and caught.value.error_type == "validation"
    return caught.value.message


def test_split_prompt_follows_tgi_regex():
    url = data_url(encoded("PNG"), "image/png")
    prompt = f"![]({url})What is this?![](https://a.b/c.png) and ![alt](x) stays text"
    assert split_prompt(prompt) == [
        ImageRef(f"![]({url})"),
        "What is this?",
        ImageRef("![](https://a.b/c.png)"),
        " and ![alt](x) stays text",
    ]
    assert split_prompt("no images") == ["no images"]
    assert split_prompt(image_markdown("https://x/y.jpg")) == [ImageRef("![](https://x/y.jpg)")]


@pytest.mark.parametrize(
    ("fmt", "mode", "mime"),
    [
        ("PNG", "RGB", "image/png"),
        ("JPEG", "RGB", "image/jpeg"),
        ("WEBP", "RGB", "image/webp"),
        ("PNG", "RGBA", "image/png"),
    ],
)
def test_data_urls_decode(fmt, mode, mime):
    data = encoded(fmt, mode)
    image = ImageFetcher().load(ImageRef(f"![]({data_url(data, mime)})"))
    assert (image.width, image.height, image.mimetype, image.data) == (20, 12, mime, data)
    assert image.to_pil().mode == "RGB"


def test_data_url_with_unlisted_mime_is_guessed():
    image = ImageFetcher().load(ImageRef(f"![]({data_url(encoded('PNG'), 'image/x-whatever')})"))
    assert (image.width, image.mimetype) == (20, "image/x-whatever")


class CountingDecoder(ImageDecoder):
    """The fetch thread's decode, each file it decodes noted."""

    def __init__(self) -> None:
        super().__init__(processes=0)
        self.files: list[bytes] = []

    def decode(self, data: bytes, *rest) -> DecodedImage:
        self.files.append(data)
        return super().decode(data, *rest)


def test_a_file_decoded_before_is_not_decoded_again_and_the_kept_bytes_stay_bounded():
    files = [encoded("PNG", size=(20 + i, 12)) for i in range(3)]
    decoder = CountingDecoder()
    decoded = decoder.files
    fetcher = ImageFetcher(decoded=image_fetch.DecodedImages(2 * max(map(len, files)), decoder))
    resize = Resize(lambda height, width: (1, 1), 0)  # what it makes is kept with the file

    def load(data: bytes, mime: str = "image/png", with_resize=resize):
        return fetcher.load(ImageRef(f"![]({data_url(data, mime)})"), with_resize)

    first = load(files[0])
    assert load(files[0]) is first and decoded == [files[0]]  # a chat's next turn: kept
    assert load(files[0], with_resize=None).resized is None and len(decoded) == 2  # resized or not: kept apart
    load(files[1])
    load(files[2])  # past the bound: the least recently used go
    assert fetcher.decoded.num_bytes <= fetcher.decoded.max_bytes
    load(files[0])
    assert decoded[-1] == files[0]
    with pytest.raises(TgiError):  # a failure is never kept: the same bytes fail again
        load(files[1][:30])
    with pytest.raises(TgiError):
        load(files[1][:30])


def test_bad_images_get_tgi_texts():
    fetcher = ImageFetcher()
    assert refusal(fetcher, "![](ftp://x/y.png)") == "Input validation error: invalid image content: ![](ftp://x/y.png)"
    assert refusal(fetcher, "![](data:image/png,abc)") == "Input validation error: invalid image content: image/png,abc"
    assert refusal(fetcher, "![](data:image/png;hex,00)") == "Input validation error: invalid image content: hex,00"
    assert refusal(fetcher, "![](data:image/png;base64,YQ==;x)") == (  # TGI's split on ';' gives three parts
        "Input validation error: invalid image content: image/png;base64,YQ==;x"
    )
    # pybase64 decodes; the standard library's strict decoder says what is wrong
    assert refusal(fetcher, "![](data:image/png;base64,@@@)") == (
        "Input validation error: base64 encoding is invalid: Only base64 data is allowed"
    )
    assert refusal(fetcher, "![](data:image/png;base64,YWJjZA)") == (
        "Input validation error: base64 encoding is invalid: Incorrect padding"
    )
    truncated = encoded("PNG")[:40]
    assert refusal(fetcher, f"![]({data_url(truncated, 'image/png')})").startswith(
        "Input validation error: invalid image: "
    )
    not_png = encoded("JPEG")  # the declared format is the one decoded, as in TGI
    assert refusal(fetcher, f"![]({data_url(not_png, 'image/png')})").startswith(
        "Input validation error: invalid image"
    )


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height 1-bit pixels, with no pixel data."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def test_a_decompression_bomb_is_refused_before_decoding():
    """400 million pixels claimed in a 45-byte file: a validation error (422), not a server error."""
    bomb = data_url(png_header_only(20000, 20000), "image/png")
    assert refusal(ImageFetcher(), f"![]({bomb})").startswith(
        "Input validation error: invalid image: Image size (400000000 pixels) exceeds limit"
    )


class _Images(BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, bytes, dict[str, str]]] = {}

    def do_GET(self) -> None:
        status, body, headers = self.routes[self.path]
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    png = encoded("PNG")
    _Images.routes = {
        "/ok.png": (200, png, {"Content-Length": str(len(png))}),
        "/unsized.png": (200, png, {"Connection": "close"}),  # no Content-Length: the body is counted
        "/missing.png": (404, b"", {"Content-Length": "0"}),
        "/moved": (302, b"", {"Location": "/ok.png", "Content-Length": "0"}),
        "/text": (200, b"hello", {"Content-Length": "5"}),
    }
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_fetch_with_size_cap(image_server):
    size = len(encoded("PNG"))
    fetcher = ImageFetcher(max_bytes=size, allow_private=True)
    assert fetcher.load(ImageRef(f"![]({image_server}/ok.png)")).mimetype == "image/png"
    assert fetcher.load(ImageRef(f"![]({image_server}/moved)")).width == 20
    small = ImageFetcher(max_bytes=size - 1, allow_private=True)
    too_large = f"Input validation error: Image size {size} bytes exceeds maximum allowed size of {size - 1} bytes"
    assert refusal(small, f"![]({image_server}/ok.png)") == too_large
    assert refusal(small, f"![]({image_server}/unsized.png)") == too_large
    assert refusal(fetcher, f"![]({image_server}/missing.png)").startswith(
        "Input validation error: Could not fetch image: HTTP status 404"
    )
    assert refusal(fetcher, f"![]({image_server}/text)").startswith("Input validation error: invalid image: ")


DRIP_S = 0.1


class _Drip(BaseHTTPRequestHandler):
    """An image server that sends its headers, then one byte every DRIP_S seconds until the client leaves."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "1000000")
        self.end_headers()
        try:
            while True:
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(DRIP_S)
        except OSError:
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def drip_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Drip)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_body_that_drips_fails_at_the_fetchs_deadline(drip_server):
    started = time.monotonic()
    message = refusal(ImageFetcher(allow_private=True, timeout_s=1.0), f"![]({drip_server}/slow.png)")
    assert message.startswith("Input validation error: Could not fetch image: ") and "longer than 1 s" in message
    assert time.monotonic() - started < 2.5  # (a byte a read: each read came well within the timeout)


def test_slow_image_servers_never_hold_the_event_loops_own_threads(drip_server):
    """20 fetches stuck on a slow server, more than the loop's default threads on 2 cores (6): a chat template
    rendered meanwhile (asyncio.to_thread) is not kept waiting behind them."""
    prompts = VisionPrompts(lambda _: Placeholders("<img>", 1), 9, False, ImageFetcher(allow_private=True, timeout_s=1))

    async def main() -> None:
        fetches = [asyncio.create_task(prompts.expand(f"![]({drip_server}/{i}.png)")) for i in range(20)]
        await asyncio.sleep(0.2)  # all under way
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "rendered"), 0.5) == "rendered"
        assert all(isinstance(r, TgiError) for r in await asyncio.gather(*fetches, return_exceptions=True))

    asyncio.run(main())


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "10.1.2.3", "192.168.0.1", "169.254.169.254", "[::1]"])
def test_private_addresses_are_refused(image_server, host):
    message = refusal(ImageFetcher(), f"![](http://{host}/ok.png)")
    assert message.startswith("Input validation error: Could not fetch image: ")
    assert "non-public address" in message


async def test_a_text_model_keeps_image_markdown_as_text(client, engine, tokenizer):
    """TGI parses images for vision models only: elsewhere `![](...)` is prompt text, never fetched."""
    inputs = "![](http://127.0.0.1:1/never-fetched.png) and ![](data:image/png;base64,@@@)"
    response = await client.post("/generate", json={"inputs": inputs, "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 200
    assert engine.requests[0].prompt_ids == tokenizer.encode_sync(inputs) and engine.requests[0].images == []
    tokens = (await client.post("/tokenize", json={"inputs": inputs})).json()
    assert [token["id"] for token in tokens] == tokenizer.encode_sync(inputs)


def test_placeholders_must_match_the_images():
    """Each placeholder run is one whole image, the last ones when `truncate` cut the first; placeholder tokens
    typed as text, or a run cut by truncation, refuse the request."""
    fixed = Placeholders("<img>", 3)
    prompts = VisionPrompts(lambda _: fixed, image_token_id=9, bidirectional=True, fetcher=ImageFetcher())
    red, green = (DecodedImage(data, "image/png", 1, 1) for data in (b"red", b"green"))
    placed = prompts.place([1, 9, 9, 9, 2, 9, 9, 9, 3], [red, green])
    assert [(image.offset, image.length, image.data, image.bidirectional) for image in placed] == [
        (1, 3, b"red", True),
        (5, 3, b"green", True),
    ]
    assert [image.data for image in prompts.place([2, 9, 9, 9, 3], [red, green])] == [b"green"]  # left-truncated
    for ids in ([9, 9, 2, 9, 9, 9], [1, 9, 9, 9, 2, 9, 9, 9, 9, 9, 9]):
        with pytest.raises(TgiError, match="placeholder tokens do not match"):
            prompts.place(ids, [red, green])


def test_qwen_placeholders_carry_each_image_grid():
    """Qwen2.5-VL: each image's run is as long as its own grid (dynamic resolution), and the grid travels with it
    (the engine's M-RoPE positions)."""

    def by_size(image: DecodedImage) -> Placeholders:
        return Placeholders(
            "<img>" * image.width * image.height, image.width * image.height, (image.height, image.width)
        )

    prompts = VisionPrompts(by_size, image_token_id=9, bidirectional=False, fetcher=ImageFetcher())
    wide, tall = DecodedImage(b"wide", "image/png", 3, 1), DecodedImage(b"tall", "image/png", 1, 2)
    placed = prompts.place([1, 9, 9, 9, 2, 9, 9, 3], [wide, tall])
    assert [(image.offset, image.length, image.grid, image.bidirectional) for image in placed] == [
        (1, 3, (1, 3), False),
        (5, 2, (2, 1), False),
    ]
    with pytest.raises(TgiError, match="placeholder tokens do not match"):
        prompts.place([1, 9, 9, 2, 9, 9, 9, 3], [wide, tall])


def test_more_images_than_max_images_are_refused_before_any_fetch():
    class NoFetch(ImageFetcher):
        def load(self, ref: ImageRef) -> DecodedImage:
            raise AssertionError("fetched")

    prompts = VisionPrompts(lambda _: Placeholders("<img>", 1), 9, False, NoFetch(), max_images=1)
    inputs = "![](http://example.com/a.png)a![](http://example.com/b.png)"
    with pytest.raises(TgiError, match="`inputs` must have at most 1 images. Given: 2") as refused:
        asyncio.run(prompts.expand(inputs))
    assert refused.value.status == 422
