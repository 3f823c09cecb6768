"""The encoder-output cache (LightLLM's `--cache_capacity`, `--cache_reserved_ratio`): the vision encoder's
rows of the last images seen, by content hash, so that an image that comes back (a chat that keeps sending one
picture, many questions on one page) is encoded once. Least recently used first out: when it holds more than
`capacity` images it drops to `capacity * reserved_ratio` of them in one sweep, as LightLLM does."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from tgi_compat.modeling.forward_batch import ImageEmbeds
from tgi_compat.router.images import PromptImage

# (its first row in the flat batch, its first and end position, its request's images) per chunk of a step
ChunkImages = tuple[int, int, int, Sequence[PromptImage]]
# image files -> each one's placeholder rows [tokens, hidden] (tgi_compat.modeling.vision.encoder.ImageEncoder)
EncodeImages = Callable[[Sequence[bytes]], list[torch.Tensor]]


class EncoderCache:
    def __init__(self, encode: EncodeImages, capacity: int = 200, reserved_ratio: float = 0.5) -> None:
        if capacity < 1 or not 0.0 <= reserved_ratio <= 1.0:
            raise ValueError(f"cache capacity {capacity} must be >= 1 and reserved ratio {reserved_ratio} in [0, 1]")
        self.encode = encode
        self.capacity = capacity
        self.reserved = int(capacity * reserved_ratio)
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # images run through the encoder (misses)

    def __len__(self) -> int:
        return len(self._rows)

    def features(self, images: Sequence[PromptImage]) -> list[torch.Tensor]:
        """Each image's rows, the misses encoded in one call."""
        missing = {image.digest: image.data for image in images if image.digest not in self._rows}
        if missing:
            for digest, rows in zip(missing, self.encode(list(missing.values()))):
                self._rows[digest] = rows
            self.num_encoded += len(missing)
        out = []
        for image in images:
            self._rows.move_to_end(image.digest)
            out.append(self._rows[image.digest])
        if len(self._rows) > self.capacity:
            while len(self._rows) > max(self.reserved, len(images)):  # never this step's own
                self._rows.popitem(last=False)
        return out

    def step_embeds(self, chunks: Sequence[ChunkImages], device: torch.device) -> ImageEmbeds | None:
        """The step's ImageEmbeds: the rows of every placeholder its chunks bring, None where there are none.
        Every image the step's chunks touch goes through one `features` call: the misses of all requests are
        encoded as one batch (one encoder call a step, not one a request)."""
        hits = [
            [image for image in images if image.offset < end and image.end > start] for _, start, end, images in chunks
        ]
        features = iter(self.features([image for hit in hits for image in hit]))
        token_index: list[int] = []
        rows: list[torch.Tensor] = []
        spans: list[list[tuple[int, int]]] = []
        for (offset, start, end, _), hit in zip(chunks, hits):
            spans.append([(max(i.offset, start), min(i.end, end)) for i in hit if i.bidirectional])
            for image, image_rows in zip(hit, features):
                first, last = max(image.offset, start), min(image.end, end)
                token_index += range(offset + first - start, offset + last - start)
                rows.append(image_rows[first - image.offset : last - image.offset])
        if not rows:
            return None
        index = torch.tensor(token_index, dtype=torch.int64).to(device, non_blocking=True)
        return ImageEmbeds(index, torch.cat(rows).to(device), spans)
