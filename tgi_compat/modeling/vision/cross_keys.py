"""A cross-attending vision model's (Mllama's) image keys: the model that makes them from the vision states
(tgi_compat.router.cross_attention keeps them per request), and the device memory kept for them, taken from what
the KV cache would take, which the scheduler holds its running requests to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import torch

from tgi_compat.modeling.config import CROSS_ATTENTION_MODELS, ModelConfig


class CrossProjector(Protocol):
    """A cross-attending model's (models/mllama.py): a request's images' vision states (`encode_processed`'s,
    concatenated) -> each cross-attention layer's keys and values (tgi_compat.router.cross_attention)."""

    max_tiles: int  # the tiles, real and padding, of every image's states
    image_kv_bytes: int  # the keys and values of one image, all its tiles, every cross-attention layer

    def cross_kv(self, states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


# the share of the memory the KV cache would take that a cross-attending model's image keys get instead
CROSS_KEYS_SHARE = 0.125


@dataclass(frozen=True, slots=True)
class CrossAttentionKeys:
    """A cross-attending model's image keys: the model that makes them, and how many images' keys the device keeps
    room for beside the KV cache, which the scheduler holds its running requests to (None: no bound, where the KV
    cache is not sized from the free memory: a fixed --max-batch-total-tokens, the CPU)."""

    projector: CrossProjector
    max_images: int | None = None

    @property
    def reserved_bytes(self) -> int:
        return 0 if self.max_images is None else self.max_images * self.projector.image_kv_bytes


def cross_attention_keys(config: ModelConfig, model: object, kv_budget: float | None) -> CrossAttentionKeys | None:
    """A cross-attending model's keys (None for any other model): their share of `kv_budget`, the bytes the KV
    cache would otherwise take (None: not read from the free memory, then no bound), room for one image at least."""
    if config.multimodal_architecture not in CROSS_ATTENTION_MODELS:
        return None
    projector = cast(CrossProjector, model)  # the registry's class of a cross-attending model (models/mllama.py)
    if kv_budget is None:
        return CrossAttentionKeys(projector)
    return CrossAttentionKeys(projector, max(1, int(kv_budget * CROSS_KEYS_SHARE) // projector.image_kv_bytes))
