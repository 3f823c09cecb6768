"""A step's tokens grouped by adapter slot: the sorted token index and the segment table the kernels read.

Fixed sizes: [T] and [--max-loras], built on the device without a host sync by a counting sort (compares, a sum,
two cumsums, a gather and a scatter: every op capturable), so a decode CUDA graph builds them itself from its
static [N] slot input. Tokens of base rows sort last and belong to no segment.
"""

from __future__ import annotations

import torch

from tgi_compat.kernels.lora.segments import LoraSegments
from tgi_compat.modeling.forward_batch import ForwardBatch, ForwardMode

LoraStep = LoraSegments  # a step's segments, in the kernels' own type


def build_lora_step(batch: ForwardBatch, request_slots: torch.Tensor, max_loras: int) -> LoraStep:
    """request_slots: [B] int64, each request's slot, -1 for the base model."""
    if batch.mode == ForwardMode.DECODE:
        token_slots = request_slots
    else:
        token_slots = torch.repeat_interleave(request_slots, batch.q_lens, output_size=batch.num_tokens)
    return lora_step(token_slots, max_loras)


def lora_step(token_slots: torch.Tensor, max_loras: int) -> LoraStep:
    """token_slots: [T] int64, each token's slot, -1 for the base model. A stable counting sort over
    max_loras + 1 bins (the base tokens' bin last): O(T * L) work, tiny at decode sizes."""
    keys = torch.where(token_slots < 0, max_loras, token_slots)
    bins = torch.arange(max_loras + 1, dtype=keys.dtype, device=keys.device)
    in_bin = (keys[None, :] == bins[:, None]).to(torch.int64)  # [L + 1, T]
    counts = in_bin.sum(1)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_bin = in_bin.cumsum(1).gather(0, keys[None, :])[0] - 1  # earlier tokens of the same slot
    where = starts.gather(0, keys) + rank_in_bin  # each token's place in the sorted order: a permutation
    token_order = torch.empty_like(keys).scatter_(0, where, torch.arange(keys.shape[0], device=keys.device))
    return LoraStep(token_order, starts[:max_loras], counts[:max_loras], token_slots)
