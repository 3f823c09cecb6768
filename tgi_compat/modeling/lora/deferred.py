"""A folded q|k|v projection's output whose LoRA expand is left to attention (decode sizes of a LoRA step): the
Triton backend's fused rotary adds each row's q, k and v deltas inside flash-decoding's programs
(tgi_compat.kernels.attention.decode_rotary.QKVLoraDelta), so the expand is no launch of its own; every other path
(prefill-sized steps, per-head norms, other backends) expands first, as the projection would have."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgi_compat.kernels.attention.decode_rotary import QKVLoraDelta
from tgi_compat.modeling.lora.step import LoraStep
from tgi_compat.modeling.lora.weights import LoraWeights


@dataclass(frozen=True, slots=True)
class DeferredQKVDelta:
    full: torch.Tensor  # [T, N + L * 3 * R]: the folded projection's output, its N base columns first
    step: LoraStep
    weights: LoraWeights

    def kernel_delta(self) -> QKVLoraDelta:
        columns = self.weights.b.shape[1]
        return QKVLoraDelta(self.full[:, columns:], self.step.token_slots, self.weights.b)

    def expanded(self) -> torch.Tensor:
        """[T, N]: the base columns with each LoRA row's deltas added (the folded expand)."""
        return self.weights.expand_folded(self.full, self.step)
