"""The keys and values a cross-attending model's (Mllama's) requests attend to: their images' vision states projected
by each cross-attention layer, made once per request (at its first scheduled chunk, from the encoder cache's states)
and kept here, beside the paged KV cache, until the request gives back its row (finished, cancelled or preempted: a
preempted one makes them again when it runs again).

Which keys a token attends to is transformers' (MllamaProcessor's cross-attention mask): those of the last image at
or before it, and of the images just before that one with no token between them (consecutive `<|image|>`s), real
tiles only; a token after the prompt attends as its last token does. A token before the request's first image
attends to every key (its images' padding tiles too: transformers' mask lets such a row through whole) and its
cross-attention MLP output is dropped. The keys of a request are laid out as its images' real tiles in order, then
all their padding tiles, so that each token's keys are one range."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tgi_compat.modeling.forward_batch import CrossAttention, CrossRun
from tgi_compat.modeling.vision.cross_keys import CrossProjector
from tgi_compat.router.image_cache import EncoderCache
from tgi_compat.router.request import Request

# (its first row in the flat batch, its first and end position, its request) per chunk of a step
CrossChunk = tuple[int, int, int, Request]


@dataclass(slots=True)
class _Entry:
    request: Request  # held to see when it gives back its row
    entry_id: int  # unique in the store's life (CrossRun.entry)
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    positions: list[int]  # each image's `<|image|>` position, ascending
    keys: list[tuple[int, int]]  # each image's real tiles' keys
    run_first: list[int]  # per image: the first image of its consecutive `<|image|>` run

    @property
    def num_keys(self) -> int:
        return self.kv[0][0].shape[0]

    def keys_at(self, position: int) -> tuple[int, int] | None:
        """The keys a token at `position` attends to; None before the first image (all keys, MLP dropped)."""
        last = bisect_right(self.positions, position) - 1
        if last < 0:
            return None
        return self.keys[self.run_first[last]][0], self.keys[last][1]


class CrossAttentionStore:
    def __init__(self, images: EncoderCache, projector: CrossProjector) -> None:
        self.images = images
        self.projector = projector
        self._entries: dict[str, _Entry] = {}
        self._made = 0  # entries made so far: the next one's id

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """The device memory its keys and values hold."""
        return sum(t.nbytes for entry in self._entries.values() for kv in entry.kv for t in kv)

    def prune(self) -> None:
        """Drop the keys of every request that gave back its row."""
        for request_id in [key for key, entry in self._entries.items() if entry.request.row is None]:
            del self._entries[request_id]

    def step(self, chunks: Sequence[CrossChunk], device: torch.device) -> CrossAttention | None:
        """The step's CrossAttention: the rows of its chunks whose requests have images; None when none has."""
        self.prune()
        rows: list[int] = []
        follows: list[float] = []
        runs: list[CrossRun] = []
        made: list[tuple[int, torch.Tensor]] = []
        for offset, start, end, request in chunks:
            if not request.params.images:
                continue
            entry = self._entries.get(request.request_id)
            if entry is None:
                entry, states = self._make(request)
                self._entries[request.request_id] = entry
                made.append((entry.entry_id, states))
            # the positions where the keys change: the chunk's start and its images' positions inside it
            cuts = [start] + [p for p in entry.positions if start < p < end] + [end]
            for first, last in zip(cuts, cuts[1:]):
                keys = entry.keys_at(first)
                span = keys or (0, entry.num_keys)
                runs.append(CrossRun(len(rows), len(rows) + last - first, entry.kv, span, entry.entry_id))
                rows += range(offset + first - start, offset + last - start)
                follows += [0.0 if keys is None else 1.0] * (last - first)
        if not rows:
            return None
        dtype = runs[0].kv[0][0].dtype
        return CrossAttention(
            torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(follows, dtype=dtype)[:, None].to(device, non_blocking=True),
            runs,
            made,
            [entry.entry_id for entry in self._entries.values()],
        )

    def _make(self, request: Request) -> tuple[_Entry, torch.Tensor]:
        """A request's entry, and the vision states its keys are made from."""
        images = request.params.images
        real, padding, keys, at = [], [], [], 0
        for image, image_states in zip(images, self.images.features(images)):
            assert image.tiles is not None  # the API counts a cross-attending model's tiles (vision/mllama.py)
            split = image.tiles * (len(image_states) // self.projector.max_tiles)
            real.append(image_states[:split])
            padding.append(image_states[split:])
            keys.append((at, at + split))
            at += split
        states = torch.cat(real + padding)
        positions = [image.offset for image in images]
        run_first = [0] * len(images)
        for k in range(1, len(images)):
            run_first[k] = run_first[k - 1] if positions[k] == positions[k - 1] + 1 else k
        self._made += 1
        return _Entry(request, self._made - 1, self.projector.cross_kv(states), positions, keys, run_first), states
