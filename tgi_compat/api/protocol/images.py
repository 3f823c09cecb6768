"""Images in a prompt, as TGI's router reads them (router/src/validation.rs `prepare_input`, `fetch_image`).

A vision model's prompt is text with images as markdown `![](url)`, found by TGI's own regex; the url is a
`data:<mime>;base64,<payload>` URL or an http(s) URL (fetched by tgi_compat.api.serving.image_fetch). OpenAI chat
`image_url` parts become the same markdown before templating (`image_markdown`). A text model never parses
them: there the markdown stays literal text, as in TGI. Errors carry TGI's texts (its `ValidationError`s, a 422);
the decoder's own message differs (Pillow's, not Rust's `image` crate's).
"""

from __future__ import annotations

import binascii
import hashlib
import io
import re
from collections.abc import Callable
from dataclasses import dataclass

import pybase64
from PIL import Image as PILImage
from PIL import UnidentifiedImageError

from tgi_compat.api.protocol.errors import TgiError, validation_error

IMAGE_MARKDOWN = re.compile(r"!\[\]\([^\)]*\)")  # TGI's regex, verbatim

# TGI's format_from_mimetype: a data URL whose mime type names one of these is decoded as that format
_FORMATS = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/jpg": "JPEG",
    "image/gif": "GIF",
    "image/webp": "WEBP",
    "image/tiff": "TIFF",
}


@dataclass(frozen=True, slots=True)
class ResizedImage:
    """An image as its model's encoder takes it, resized where it was decoded: RGB rows, uint8."""

    data: bytes
    height: int
    width: int

    @classmethod
    def of(cls, image: PILImage.Image) -> ResizedImage:
        """An RGB image's rows (one copy of its pixels, where numpy's array and then its bytes took two)."""
        return cls(image.tobytes(), image.height, image.width)


@dataclass(frozen=True, slots=True)
class Resize:
    """A model's host half of its image processor (Qwen-VL's): Pillow's resize of the decoded RGB image to the sides
    `sides` gives for its own, with the processor's filter."""

    sides: Callable[[int, int], tuple[int, int]]  # (height, width) -> resized (height, width); ValueError: refused
    resample: int  # the processor's Pillow filter

    def __call__(self, image: PILImage.Image) -> ResizedImage:
        height, width = self.sides(image.height, image.width)
        return ResizedImage.of(image.resize((width, height), resample=self.resample))


@dataclass(frozen=True, slots=True)
class DecodedImage:
    """A decoded image of a prompt: its bytes as sent, and what the model's processor and the cache need."""

    data: bytes
    mimetype: str
    width: int
    height: int
    resized: ResizedImage | None = None  # the model's `Resize` of it, where the model has one and it was asked for
    # sha256 of `data`, hex: what keys its encoder output and its prefix-cache tokens. Hashed once, where it is decoded
    # (a fetch thread), not each time a prompt places it on the event loop; "": hashed here
    digest: str = ""

    def __post_init__(self) -> None:
        if not self.digest:
            object.__setattr__(self, "digest", hashlib.sha256(self.data).hexdigest())

    @property
    def payload(self) -> tuple[bytes, tuple[int, int] | None]:
        """What the engine takes of it (PromptImage's `data` and `resized`): its resized pixels and their
        (height, width), or the file."""
        if self.resized is None:
            return self.data, None
        return self.resized.data, (self.resized.height, self.resized.width)

    def to_pil(self) -> PILImage.Image:
        """RGB pixels (RGBA and palette images flattened, as transformers' processors expect)."""
        with PILImage.open(io.BytesIO(self.data)) as image:
            return image.convert("RGB")


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One `![](url)` of a prompt: `markdown` is the whole match, as TGI's error texts quote it."""

    markdown: str

    @property
    def url(self) -> str:
        return self.markdown[len("![](") : -1]


def split_prompt(inputs: str) -> list[str | ImageRef]:
    """The prompt as TGI's chunks: text runs and image references, in order (no empty text runs)."""
    chunks: list[str | ImageRef] = []
    start = 0
    for match in IMAGE_MARKDOWN.finditer(inputs):
        if match.start() != start:
            chunks.append(inputs[start : match.start()])
        chunks.append(ImageRef(match.group()))
        start = match.end()
    if start != len(inputs):
        chunks.append(inputs[start:])
    return chunks


def image_markdown(url: str) -> str:
    """An OpenAI `image_url` part as TGI renders it into the templated prompt."""
    return f"![]({url})"


def read_data_url(ref: ImageRef) -> tuple[bytes, str]:
    """`![](data:<mime>;base64,<payload>)` -> (the file, its mime type): TGI's checks and texts, in its order."""
    # Offsets into the markdown, and one copy of the payload for the decoder: each slice of a 4 MB string is a fresh
    # allocation whose pages fault in, GIL held (three of them and str.split took ~4 ms an image; a burst's fetch
    # threads queue behind each other's). TGI splits on ';' and wants two parts: exactly one ';'.
    markdown, start = ref.markdown, len("![](data:")
    first = markdown.find(";", start, -1)
    if first < 0 or markdown.find(";", first + 1, -1) >= 0:
        raise invalid_image_content(markdown[start:-1])
    mimetype = markdown[start:first]
    if not markdown.startswith("base64,", first + 1):
        raise invalid_image_content(markdown[first + 1 : -1])
    digits = markdown[first + 1 + len("base64,") : -1]
    try:
        # pybase64: SIMD, and it lets go of the GIL (the standard library's decode holds it: ~10 ms a 3 MB image, which
        # a burst's other decodes then queue behind)
        data = pybase64.b64decode(digits, validate=True)
    except binascii.Error:
        raise validation_error(f"base64 encoding is invalid: {_base64_error(digits)}") from None
    return data, mimetype


def _base64_error(digits: str) -> str:
    """The standard library's account of what is wrong with the digits (pybase64 says only that a digit is bad)."""
    try:
        binascii.a2b_base64(digits, strict_mode=True)
    except binascii.Error as error:
        return str(error)
    return "Non-base64 digit found"


# what Pillow (and a resize's refusal, a ValueError) raises for a file that is not a whole image it can size
DECODE_ERRORS = (UnidentifiedImageError, OSError, ValueError, SyntaxError, PILImage.DecompressionBombError)


def decode_image(data: bytes, mimetype: str | None, resize: Resize | None = None, digest: str = "") -> DecodedImage:
    """Decode fully (a truncated file fails here, not in the engine), then `resize` the pixels (where given) while
    they are decoded. `mimetype` None: guessed from the bytes, as TGI does for fetched images; a data URL's mime type
    outside TGI's list is guessed too but kept. A size that `resize` refuses (Qwen-VL's: an aspect ratio past 200)
    is invalid too. `digest`: the file's sha256 where the caller has it."""
    declared = _FORMATS.get(mimetype or "")
    try:
        with PILImage.open(io.BytesIO(data), formats=[declared] if declared else None) as image:
            image.load()
            width, height, found = image.width, image.height, image.format
            # (convert copies an image that is RGB already)
            resized = None if resize is None else resize(image if image.mode == "RGB" else image.convert("RGB"))
    except DECODE_ERRORS as error:
        # (a bomb: a header claiming over twice Pillow's MAX_IMAGE_PIXELS, refused before any pixel is decoded)
        raise validation_error(f"invalid image: {error}") from error
    if mimetype is None:
        mimetype = PILImage.MIME.get(found or "", "application/octet-stream")
    return DecodedImage(data, mimetype, width, height, resized, digest)


def invalid_image_content(content: str) -> TgiError:
    return validation_error(f"invalid image content: {content}")


def image_too_large(size: int, limit: int) -> TgiError:
    return validation_error(f"Image size {size} bytes exceeds maximum allowed size of {limit} bytes")


def fetch_failed(cause: str) -> TgiError:
    return validation_error(f"Could not fetch image: {cause}")
