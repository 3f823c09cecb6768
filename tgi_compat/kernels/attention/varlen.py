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
    """One sdpa per distinct sequence length over all the sequences of that length (the CPU path: an image's
    windows are nearly all of one length, so a few calls a layer, and memory is that of the sequences' own scores,
    never a [T, T] mask)."""
    bounds = cu_seqlens.tolist()
    starts: dict[int, list[int]] = {}
    for start, end in zip(bounds, bounds[1:]):
        starts.setdefault(end - start, []).append(start)
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for length, firsts in starts.items():
        rows = torch.tensor(firsts, device=q.device)[:, None] + torch.arange(length, device=q.device)  # [n, L]
        qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))  # [n, H, L, D]
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2)
    return out
