"""What the engine uses of a model runner: tgi_compat.modeling.runner.ModelRunner, or a hand-made one in tests."""

from __future__ import annotations

from typing import Protocol

import torch

from tgi_compat.modeling.forward_batch import ForwardBatch
from tgi_compat.modeling.parallel.vocab_logits import GreedyChoice


class Runner(Protocol):
    num_kv_slots: int  # KV capacity in tokens
    max_seq_len: int  # positions one request may hold (the length of a req_to_token row)
    dtype: torch.dtype
    device: torch.device

    def forward(self, batch: ForwardBatch) -> torch.Tensor | GreedyChoice:
        """Logits [R, vocab] for the rows batch.logits_indices, in the weights' dtype or float32; or, for a
        `greedy_only` batch, each row's greedy choice (a vocab-parallel runner, which never gathers its logits)."""
        ...

    def close(self) -> None:
        """Release the other tensor-parallel ranks, if any."""
        ...
