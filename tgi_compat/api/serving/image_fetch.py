"""Loading a prompt's images: data URLs decoded, http(s) URLs fetched with TGI's size cap and an SSRF guard.

TGI fetches any URL; we refuse hosts that resolve to a private, loopback, link-local or otherwise non-global
address (every redirect hop is checked again) unless `allow_private` is set. The check resolves the name before
urllib connects, so a name that re-resolves between the two (DNS rebinding) is not caught.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from tgi_compat.api.protocol.images import (
    DecodedImage,
    ImageRef,
    decode_data_url,
    decode_image,
    fetch_failed,
    image_too_large,
    invalid_image_content,
)

TGI_MAX_IMAGE_FETCH_SIZE = 1024 * 1024 * 1024  # TGI's --max-image-fetch-size default: 1 GiB


@dataclass(frozen=True, slots=True)
class ImageFetcher:
    max_bytes: int = TGI_MAX_IMAGE_FETCH_SIZE
    allow_private: bool = False
    timeout_s: float = 30.0

    def load(self, ref: ImageRef) -> DecodedImage:
        """The image a `![](...)` names (blocking: the caller runs it off the event loop)."""
        if ref.markdown.startswith(("![](http://", "![](https://")):
            return decode_image(self.fetch(ref.url), None)
        if ref.markdown.startswith("![](data:"):
            return decode_data_url(ref)
        raise invalid_image_content(ref.markdown)

    def fetch(self, url: str) -> bytes:
        self.check_host(url)
        opener = urllib.request.build_opener(_CheckedRedirects(self))
        try:
            with opener.open(url, timeout=self.timeout_s) as response:
                declared = response.headers.get("Content-Length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise image_too_large(int(declared), self.max_bytes)
                data = response.read(self.max_bytes + 1)  # one byte past the cap tells an over-long body
        except urllib.error.HTTPError as error:
            raise fetch_failed(f"HTTP status {error.code} for url ({url})") from error
        except (urllib.error.URLError, OSError) as error:
            raise fetch_failed(f"error sending request for url ({url}): {error}") from error
        if len(data) > self.max_bytes:
            raise image_too_large(len(data), self.max_bytes)
        return data

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
