"""Non-causal attention over packed sequences (a vision encoder's windows or whole images, given by cu_seqlens):
every token sees all tokens of its own sequence and none of another's, all sequences in one launch.

The extend kernel (prefill.py) in its non-causal mode, each sequence a "request" with no cached prefix whose K/V
rows are read in place: its req_to_token row is just the sequence's own token indices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tgi_compat.kernels.attention.prefill import prefill_attention


def varlen_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    cu_seqlens: torch.Tensor,  # [B + 1] int32, on q's device
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    starts = cu_seqlens[:-1].long()
    lens = cu_seqlens[1:].long() - starts
    # a row past a sequence's length points at its own last token: read nowhere (masked), but in bounds
    table = (starts[:, None] + torch.arange(max_seqlen, device=q.device)).clamp_(max=q.shape[0] - 1).to(torch.int32)
    rows = torch.arange(starts.shape[0], device=q.device)
    return prefill_attention(q, k, v, table, rows, starts, lens, lens, max_seqlen, scale, causal=False)


def varlen_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    cu_seqlens: torch.Tensor,  # [B + 1]
    scale: float,
) -> torch.Tensor:
    """One block-diagonal sdpa over the whole pack (the CPU path: its [T, T] mask is small on the sizes a CPU
    serves)."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    sequence = torch.repeat_interleave(torch.arange(lens.shape[0], device=q.device), lens.to(q.device))
    mask = sequence[:, None] == sequence[None, :]
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.transpose(0, 1) for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
