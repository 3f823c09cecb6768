"""A step's tokens grouped by adapter slot: the sorted token index and the segment table the kernels read.

Fixed sizes: [T] and [--max-loras], built on the device without a host sync, so the same tensors can be the
inputs of a captured CUDA graph. Tokens of base rows sort last and belong to no segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgi_compat.modeling.forward_batch import ForwardBatch, ForwardMode


@dataclass(frozen=True, slots=True)
class LoraStep:
    token_order: torch.Tensor  # [T] int64: flat token indices, LoRA tokens sorted by slot, base tokens last
    seg_start: torch.Tensor  # [L] int64: first index into token_order of each slot's tokens
    seg_len: torch.Tensor  # [L] int64: each slot's token count (0: no row of this step uses it)


def build_lora_step(batch: ForwardBatch, request_slots: torch.Tensor, max_loras: int) -> LoraStep:
    """request_slots: [B] int64, each request's slot, -1 for the base model."""
    if batch.mode == ForwardMode.DECODE:
        token_slots = request_slots
    else:
        token_slots = torch.repeat_interleave(request_slots, batch.q_lens, output_size=batch.num_tokens)
    keys = torch.where(token_slots < 0, max_loras, token_slots)  # base tokens: one bin past the slots
    token_order = torch.argsort(keys, stable=True)
    counts = torch.zeros(max_loras + 1, dtype=torch.int64, device=keys.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    seg_len = counts[:max_loras]
    return LoraStep(token_order, torch.cumsum(seg_len, 0) - seg_len, seg_len)
