"""The encoder-output cache (LightLLM's `--cache_capacity`, `--cache_reserved_ratio`): the vision encoder's
rows of the last images seen, by content hash, so that an image that comes back (a chat that keeps sending one
picture, many questions on one page) is encoded once. Least recently used first out: when it holds more than
`capacity` images it drops to `capacity * reserved_ratio` of them in one sweep, as LightLLM does; and likewise
past `max_bytes` of rows, which live on the device (the runner leaves them out of the KV cache's budget): 200
images of one 12-megapixel photo each would be 22 GiB of Qwen2.5-VL-7B rows.

An image's host work (decoding, the image processor) starts when its request is queued (`prefetch`, in the
encoder's threads), so that the step that needs it waits for the encoder alone, which takes all the step's misses
in one call."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Protocol

import torch

from tgi_compat.modeling.forward_batch import ImageEmbeds
from tgi_compat.modeling.step_profiler import region
from tgi_compat.router.config import IMAGE_CACHE_BYTES
from tgi_compat.router.images import PromptImage

# (its first row in the flat batch, its first and end position, its request's images) per chunk of a step
ChunkImages = tuple[int, int, int, Sequence[PromptImage]]
PENDING_MAX = 64  # images prepared ahead at once (host memory: ~26 MB each for a 1024px Qwen2.5-VL image)
PENDING_TTL_S = 60.0  # one prepared this long ago (its request cancelled while queued, say) is dropped


def _owned(rows: torch.Tensor) -> torch.Tensor:
    """The rows in storage of their own: an image's rows are a view of its encoder call's output (all of the call's
    images), which would otherwise stay allocated, uncounted, as long as any one of them is kept."""
    return rows if rows.untyped_storage().nbytes() == rows.nbytes else rows.clone()


class ImageEncoder(Protocol):
    """tgi_compat.modeling.vision.encoder.ImageEncoder: an image file (or the pixels the API resized, PromptImage's
    `resized`) -> the processor's tensors (host threads); the tensors of several images -> each one's placeholder
    rows [tokens, hidden], in one encoder call."""

    def preprocess_async(
        self, data: bytes, resized: tuple[int, int] | None = None
    ) -> Future[dict[str, torch.Tensor]]: ...

    def encode(self, processed: Sequence[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]: ...


class EncoderCache:
    def __init__(
        self,
        encoder: ImageEncoder,
        capacity: int = 200,
        reserved_ratio: float = 0.5,
        max_bytes: int = IMAGE_CACHE_BYTES,
    ) -> None:
        if capacity < 1 or not 0.0 <= reserved_ratio <= 1.0 or max_bytes < 0:
            raise ValueError(
                f"cache capacity {capacity} must be >= 1, reserved ratio {reserved_ratio} in [0, 1]"
                f" and bytes {max_bytes} >= 0"
            )
        self.encoder = encoder
        self.capacity = capacity
        self.reserved = int(capacity * reserved_ratio)
        self.max_bytes = max_bytes
        self.reserved_bytes = int(max_bytes * reserved_ratio)
        self.num_bytes = 0  # of the rows held
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # images run through the encoder (misses)
        self._pending: OrderedDict[str, tuple[Future[dict[str, torch.Tensor]], float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def prefetch(self, images: Sequence[PromptImage]) -> None:
        """Start the host work of a queued request's images that are neither cached nor under way."""
        now = time.monotonic()
        while self._pending and next(iter(self._pending.values()))[1] < now - PENDING_TTL_S:
            self._pending.popitem(last=False)
        for image in images:
            if (
                image.digest not in self._rows
                and image.digest not in self._pending
                and len(self._pending) < PENDING_MAX
            ):
                self._pending[image.digest] = (self.encoder.preprocess_async(image.data, image.resized), now)

    def features(self, images: Sequence[PromptImage]) -> list[torch.Tensor]:
        """Each image's rows, the misses encoded in one call."""
        missing = {image.digest: image for image in images if image.digest not in self._rows}
        if missing:
            # all the misses' host work under way (prefetched, or started here) before waiting on any
            started = [self._pending.pop(digest, None) for digest in missing]
            futures = [
                entry[0] if entry is not None else self.encoder.preprocess_async(image.data, image.resized)
                for entry, image in zip(started, missing.values())
            ]
            with region("images.wait_preprocess"):
                processed = [future.result() for future in futures]
            with region("images.encode"):
                encoded = self.encoder.encode(processed)
            for digest, rows in zip(missing, encoded):
                self._rows[digest] = _owned(rows)
                self.num_bytes += rows.nbytes
            self.num_encoded += len(missing)
        out = []
        for image in images:
            self._rows.move_to_end(image.digest)
            out.append(self._rows[image.digest])
        if len(self._rows) > self.capacity or self.num_bytes > self.max_bytes:
            own = len({image.digest for image in images})  # never this step's own, the most recent
            while len(self._rows) > own and (len(self._rows) > self.reserved or self.num_bytes > self.reserved_bytes):
                self.num_bytes -= self._rows.popitem(last=False)[1].nbytes
        return out

    def step_embeds(self, chunks: Sequence[ChunkImages], device: torch.device) -> ImageEmbeds | None:
        """The step's ImageEmbeds: the rows of every placeholder its chunks bring, None where there are none.
        Every image the step's chunks touch goes through one `features` call: the misses of all requests are
        encoded as one batch (one encoder call a step, not one a request)."""
        hits = [
            [image for image in images if image.offset < end and image.end > start] for _, start, end, images in chunks
        ]
        encoded_before = self.num_encoded
        features = iter(self.features([image for hit in hits for image in hit]))
        token_index: list[int] = []
        rows: list[torch.Tensor] = []
        spans: list[list[tuple[int, int]]] = []
        for (offset, start, end, _), hit in zip(chunks, hits):
            # from the span's start, cached part included: a sliding window must not hide it (PaliGemma 2)
            spans.append([(i.offset, min(i.end, end)) for i in hit if i.bidirectional])
            for image, image_rows in zip(hit, features):
                taken, positions = image.rows_at(max(image.offset, start), min(image.end, end))
                token_index += [offset + position - start for position in positions]
                rows.append(image_rows[taken])
        if not rows:
            return None
        index = torch.tensor(token_index, dtype=torch.int64).to(device, non_blocking=True)
        return ImageEmbeds(index, torch.cat(rows).to(device), spans, encoded=self.num_encoded > encoded_before)
