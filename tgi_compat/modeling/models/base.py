"""The interface every model family in tgi_compat/modeling/models implements: what ModelRunner calls."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from tgi_compat.modeling.attention.base import AttentionBackend
from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.forward_batch import ForwardBatch
from tgi_compat.modeling.layers.ops import LayerOps
from tgi_compat.modeling.pooler import PoolerConfig
from tgi_compat.modeling.weights.lazy import LazyTensor


class CausalLM(Protocol):
    supports_tensor_parallel: bool  # a class attribute: its layers shard over --num-shard ranks (built with tp=)

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


class PoolingLM(CausalLM, Protocol):
    """A pooling model (models/pooling.py): one vector per prompt instead of logits."""

    task: str  # "embed" | "classify" | "reward"
    pooler: PoolerConfig

    def pool(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """[T, hidden] of a step of whole prompts -> [B, output] (an embedding, or the head's scores)."""
        ...
