"""Loading a prompt's images: data URLs decoded, http(s) URLs fetched with TGI's size cap and an SSRF guard.

TGI fetches any URL; we refuse hosts that resolve to a private, loopback, link-local or otherwise non-global
address (every redirect hop is checked again) unless `allow_private` is set. The check resolves the name before
urllib connects, so a name that re-resolves between the two (DNS rebinding) is not caught.

A fetch's body must arrive within `timeout_s` of its start (TGI's fetch has no limit), checked between reads of
`timeout_s` at most each: a server that sends a byte every few seconds would otherwise hold its thread for as long
as it likes (with this, twice `timeout_s` at most).

The images last decoded are kept by their file's hash (`DecodedImages`): a chat sends its picture again with every
turn, and its decode and resize would otherwise be paid every turn.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import ipaddress
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tgi_compat.api.protocol.images import (
    DecodedImage,
    ImageRef,
    Resize,
    fetch_failed,
    image_too_large,
    invalid_image_content,
    read_data_url,
)
from tgi_compat.api.serving.image_decode import ImageDecoder, decode_processes

TGI_MAX_IMAGE_FETCH_SIZE = 1024 * 1024 * 1024  # TGI's --max-image-fetch-size default: 1 GiB
READ_BYTES = 1 << 20  # read a body this much at a time, the deadline checked between reads
FETCH_THREADS = 16
# files plus resized pixels of the images kept decoded: 40 of a 1024px noise PNG with its 1036px Qwen-VL pixels
DECODED_IMAGES_BYTES = 256 << 20
# Images read at once (base64, hash, decode, resize), of the fetch threads: one a core. More share the GIL round-robin
# and all finish late together (`python -m benchmarks.image_burst`, session 40, 16 1024px PNGs on the idle 2-core
# machine: first / median / last back at 60 / 308 / 510 ms with 2 at once, 375-394 / 472-531 / 552-601 with 16; on the
# 16-core H100 host, 32 PNGs: 178 / 458 / 754 with 8, 363 / 620 / 680 with 16)
DECODES_AT_ONCE = min(FETCH_THREADS, os.cpu_count() or 1)


def _fetch_threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="image-fetch")  # (threads start with the first fetch)


class DecodedImages:
    """The last images decoded (and resized), by their file's hash, mime type and whether they were resized; least
    recently used out past `max_bytes` of files and pixels. Shared by the fetch threads."""

    def __init__(self, max_bytes: int = DECODED_IMAGES_BYTES, decoder: ImageDecoder | None = None) -> None:
        self.max_bytes = max_bytes
        # in processes of the API's own where the host has the cores (image_decode.py)
        self.decoder = decoder if decoder is not None else ImageDecoder(decode_processes())
        self.num_bytes = 0
        self._images: OrderedDict[tuple[str, str | None, bool], DecodedImage] = OrderedDict()
        self._lock = threading.Lock()

    def decode(self, data: bytes, mimetype: str | None, resize: Resize | None) -> DecodedImage:
        """decode_image's, or the one kept of the same file (a file that failed to decode is never kept)."""
        digest = hashlib.sha256(data).hexdigest()
        key = (digest, mimetype, resize is not None)
        with self._lock:
            if (kept := self._images.get(key)) is not None:
                self._images.move_to_end(key)
                return kept
        image = self.decoder.decode(data, mimetype, resize, digest)
        size = _size(image)
        with self._lock:
            if key not in self._images and size <= self.max_bytes:
                self._images[key] = image
                self.num_bytes += size
                while self.num_bytes > self.max_bytes:
                    self.num_bytes -= _size(self._images.popitem(last=False)[1])
        return image


def _size(image: DecodedImage) -> int:
    return len(image.data) + (0 if image.resized is None else len(image.resized.data))


@dataclass(frozen=True, slots=True)
class ImageFetcher:
    max_bytes: int = TGI_MAX_IMAGE_FETCH_SIZE
    allow_private: bool = False
    timeout_s: float = 30.0
    # threads of its own: slow image servers may hold these, never the event loop's default ones, which render chat
    # templates and read grammars (6 of them on 2 cores)
    threads: ThreadPoolExecutor = field(default_factory=_fetch_threads, compare=False, repr=False)
    decoded: DecodedImages = field(default_factory=DecodedImages, compare=False, repr=False)
    # held while an image is read (base64, its hash, its decode and resize); a fetch's download waits outside it
    decoding: threading.Semaphore = field(
        default_factory=lambda: threading.Semaphore(DECODES_AT_ONCE), compare=False, repr=False
    )

    async def load_all(self, refs: Sequence[ImageRef], resize: Resize | None = None) -> list[DecodedImage]:
        """Every image of a prompt, in order, loaded (and resized, where given) in the fetcher's threads."""
        return await asyncio.get_running_loop().run_in_executor(
            self.threads, lambda: [self.load(ref, resize) for ref in refs]
        )

    def load(self, ref: ImageRef, resize: Resize | None = None) -> DecodedImage:
        """The image a `![](...)` names (blocking: the caller runs it off the event loop)."""
        if ref.markdown.startswith(("![](http://", "![](https://")):
            data = self.fetch(ref.url)
            with self.decoding:
                return self.decoded.decode(data, None, resize)
        if ref.markdown.startswith("![](data:"):
            with self.decoding:
                return self.decoded.decode(*read_data_url(ref), resize)
        raise invalid_image_content(ref.markdown)

    def fetch(self, url: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        self.check_host(url)
        opener = urllib.request.build_opener(_CheckedRedirects(self))
        try:
            with opener.open(url, timeout=self.timeout_s) as response:
                declared = response.headers.get("Content-Length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise image_too_large(int(declared), self.max_bytes)
                data = self._read(response, deadline)
        except urllib.error.HTTPError as error:
            raise fetch_failed(f"HTTP status {error.code} for url ({url})") from error
        except (urllib.error.URLError, OSError) as error:
            raise fetch_failed(f"error sending request for url ({url}): {error}") from error
        if len(data) > self.max_bytes:
            raise image_too_large(len(data), self.max_bytes)
        return data

    def _read(self, response: http.client.HTTPResponse, deadline: float) -> bytes:
        """The body up to one byte past the cap (which tells an over-long one), within the deadline."""
        chunks: list[bytes] = []
        size = 0
        while size <= self.max_bytes:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the body took longer than {self.timeout_s:g} s")
            chunk = response.read1(min(READ_BYTES, self.max_bytes + 1 - size))  # (one read: timeout_s at most)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)

    def check_host(self, url: str) -> None:
        if self.allow_private:
            return
        host = urllib.parse.urlsplit(url).hostname
        if not host:
            raise fetch_failed(f"no host in url ({url})")
        try:
            addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
        except OSError as error:
            raise fetch_failed(f"cannot resolve {host}: {error}") from error
        private = sorted(a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_global)
        if private:
            raise fetch_failed(
                f"{host} resolves to a non-public address ({private[0]}); see --allow-private-image-urls"
            )


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Every redirect target passes the same host check as the first URL."""

    def __init__(self, fetcher: ImageFetcher):
        self.fetcher = fetcher

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.fetcher.check_host(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)
