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

import logging
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
logger = logging.getLogger(__name__)
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

    def workspace_bytes(self, tokens: int) -> int | None:
        """The encoder's most memory at once for `tokens` placeholders' images; None: not estimated (never ahead)."""
        ...


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
        self.num_encoded_ahead = 0  # of which by `encode_ahead`
        self._pending: OrderedDict[str, tuple[Future[dict[str, torch.Tensor]], float]] = OrderedDict()
        # rows `encode_ahead` queued on its stream, by digest: the event a step's stream waits on before reading them
        self._ahead: dict[str, torch.cuda.Event] = {}
        self._ahead_stream: torch.cuda.Stream | None = None

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def num_pending(self) -> int:
        """Images whose host work `prefetch` started and that no encoder call has taken yet."""
        return len(self._pending)

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

    def encode_ahead(self, images: Sequence[PromptImage], device: torch.device) -> int:
        """Encode, on a stream of their own, the images a coming step will take (the engine's guess) whose host work
        is done, so that the encoder runs beside the step in flight and the step that takes them finds them cached.
        Never waits on the host. Returns the images queued.

        On one stream the encoder and the prompt forwards run one after the other, and a step that brings new images
        waits for all of their encoder's kernels: 3 1024px Qwen2.5-VL images (~52 ms on an H100) before a 4,096-token
        prefill (~90 ms). The encoder's norms, window attention and SiLU-and-mul are memory-bound and its GEMMs small:
        beside a prefill's large GEMMs, on a stream of lower priority, they take the SMs the prefill leaves."""
        if device.type != "cuda" or self.encoder.workspace_bytes(1) is None:  # (the runner reserved none for it)
            return 0
        ready: dict[str, Future[dict[str, torch.Tensor]]] = {}
        for image in images:
            entry = self._pending.get(image.digest)
            if image.digest not in self._rows and image.digest not in ready and entry is not None and entry[0].done():
                ready[image.digest] = entry[0]
        if not ready:
            return 0
        if self._ahead_stream is None:
            self._ahead_stream = torch.cuda.Stream(device)  # (of the default priority, the steps' stream's: the lowest)
        try:
            processed = [future.result() for future in ready.values()]
            with torch.cuda.stream(self._ahead_stream), region("images.encode_ahead"):
                encoded = [_owned(rows) for rows in self.encoder.encode(processed)]
                done = torch.cuda.Event()
                done.record()
        except Exception:  # (its step encodes them itself, where a failure is contained to its requests)
            logger.exception("encoding %d images ahead of their step failed", len(ready))
            return 0
        for digest, rows in zip(ready, encoded):
            del self._pending[digest]
            self._rows[digest] = rows
            self._ahead[digest] = done
            self.num_bytes += rows.nbytes
        self.num_encoded += len(ready)
        self.num_encoded_ahead += len(ready)
        return len(ready)

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
            rows = self._rows[image.digest]
            if (done := self._ahead.pop(image.digest, None)) is not None:
                stream = torch.cuda.current_stream(rows.device)
                stream.wait_event(done)  # the step reads them once the encoder's stream has written them
                rows.record_stream(stream)  # and its reads finish before their memory is reused, once dropped
            out.append(rows)
        if len(self._rows) > self.capacity or self.num_bytes > self.max_bytes:
            own = len({image.digest for image in images})  # never this step's own, the most recent
            while len(self._rows) > own and (len(self._rows) > self.reserved or self.num_bytes > self.reserved_bytes):
                digest, rows = self._rows.popitem(last=False)
                self._ahead.pop(digest, None)  # (encoded ahead for a request that never came to a step)
                self.num_bytes -= rows.nbytes
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
