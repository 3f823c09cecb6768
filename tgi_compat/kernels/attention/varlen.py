"""Non-causal attention over packed sequences (a vision encoder's windows or whole images, given by cu_seqlens):
every token sees all tokens of its own sequence and none of another's, all sequences in one launch.

`varlen_attention`: the extend kernel (prefill.py) in its non-causal mode, each sequence a "request" with no cached
prefix whose K/V rows are read in place: its req_to_token row is just the sequence's own token indices.
`varlen_attention_flash`: torch's FlashAttention-2 varlen op (bf16/fp16 only), the same contract.
`grouped_sdpa`: one sdpa per distinct sequence length (the CPU path and the reference, `varlen_attention_ref`).
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
    block_m: int = 64,  # the kernel's tiles, swept by benchmarks/device/vision_encoder.py
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    starts = cu_seqlens[:-1].long()
    lens = cu_seqlens[1:].long() - starts
    # a row past a sequence's length points at its own last token: read nowhere (masked), but in bounds
    table = (starts[:, None] + torch.arange(max_seqlen, device=q.device)).clamp_(max=q.shape[0] - 1).to(torch.int32)
    rows = torch.arange(starts.shape[0], device=q.device)
    return prefill_attention(
        q,
        k,
        v,
        table,
        rows,
        starts,
        lens,
        lens,
        max_seqlen,
        scale,
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        causal=False,
    )


def varlen_attention_flash(
    q: torch.Tensor,  # [T, H, D], bf16 or fp16
    k: torch.Tensor,  # [T, H, D]
    v: torch.Tensor,  # [T, H, D]
    cu_seqlens: torch.Tensor,  # [B + 1] int32, on q's device
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """torch's FlashAttention varlen (torch >= 2.10: non-causal by default there and in 2.11+'s window_size form)."""
    from torch.nn.attention.varlen import varlen_attn

    out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale)
    assert isinstance(out, torch.Tensor)  # no return_aux: the output alone
    return out


LengthGroups = tuple[torch.Tensor, ...]  # per distinct sequence length L: the token rows [n, L] of its sequences


def length_groups(cu_seqlens: torch.Tensor, device: torch.device) -> LengthGroups:
    """cu_seqlens (on the host) -> `grouped_sdpa`'s rows, built once for every layer that attends these spans."""
    bounds = cu_seqlens.tolist()
    starts: dict[int, list[int]] = {}
    for start, end in zip(bounds, bounds[1:]):
        starts.setdefault(end - start, []).append(start)
    rows = (torch.tensor(firsts)[:, None] + torch.arange(length) for length, firsts in starts.items())
    return tuple(r.to(device, non_blocking=True) for r in rows)


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: LengthGroups, scale: float) -> torch.Tensor:
    """One sdpa per distinct sequence length over all the sequences of that length (an image's windows are nearly
    all of one length, so a few calls a layer, and memory is that of the sequences' own scores, never a [T, T]
    mask)."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for rows in groups:
        qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))  # [n, H, L, D]
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2)
    return out


def varlen_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    cu_seqlens: torch.Tensor,  # [B + 1]
    scale: float,
) -> torch.Tensor:
    return grouped_sdpa(q, k, v, length_groups(cu_seqlens.cpu(), q.device), scale)
