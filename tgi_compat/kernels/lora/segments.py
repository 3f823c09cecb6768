"""A step's tokens grouped by adapter slot, as the LoRA kernels read them (built by tgi_compat.modeling.lora.step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LoraSegments:
    token_order: torch.Tensor  # [T] int64: flat token indices, LoRA tokens sorted by slot, base tokens last
    seg_start: torch.Tensor  # [L] int64: first index into token_order of each slot's tokens
    seg_len: torch.Tensor  # [L] int64: each slot's token count (0: no row of this step uses it)
    token_slots: torch.Tensor  # [T] int64: each token's slot, -1 for the base model (the folded expand's reference)
