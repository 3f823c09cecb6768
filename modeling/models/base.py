"""The interface every model family in modeling/models implements: what ModelRunner calls."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from modeling.attention.base import AttentionBackend
from modeling.config import ModelConfig
from modeling.forward_batch import ForwardBatch
from modeling.layers.ops import LayerOps
from modeling.weights.lazy import LazyTensor


class CausalLM(Protocol):
    def __init__(self, config: ModelConfig, ops: LayerOps) -> None: ...

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The final hidden states [T, hidden]."""
        ...

    @property
    def max_positions(self) -> int:
        """Positions the rotary cache covers."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, vocab] (under tensor parallelism this rank's vocabulary block, [R, padded vocab / N])."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None: ...

    def eval(self) -> CausalLM: ...

    def modules(self) -> Iterator[nn.Module]: ...
