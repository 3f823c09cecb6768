"""Flash-decoding's merge of the splits by log-sum-exp: stage 2 as its own kernel, or in stage 1 by the program
that draws the last ticket of its (request, KV head) (`merge_splits`, a `split_counter` given to
`decode_attention`: one launch instead of two, which pays where a decode step is a chain of few-microsecond
kernels, small batches).

Stage 1's partials travel as one tuple, `partials` = (mid_out_ptr, mid_lse_ptr, stride_mb, stride_mh, stride_ms,
stride_lb, stride_lh) (mid_out [B, H, splits, D] and mid_lse [B, H, splits], fp32), and the output as
`output` = (out_ptr, stride_ob, stride_oh) (out [B, H, D]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.pdl import launch_options

# A step's split count (and so the partial LSEs' strides) follows its batch size, and in an eager mixed
# step its metadata tensors are views at any offset (the ticket counter is kv_lens when unused):
# specialised on them (== 1, divisible by 16, 16-byte aligned), the kernel compiled again mid-serving
# whenever a new combination came (~1 s on an H200, every running request stalled). They are loop
# bounds, scalar offsets and scalar loads: nothing to gain.
RUNTIME_SPLIT_ARGS = ["num_splits", "stride_lb", "stride_lh"]


@triton.jit
def merge_splits(
    partials,
    output,
    req,
    kv_head,
    num_work,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE_G: tl.constexpr,  # GROUP rounded up to a power of two
    MERGE_CHUNK: tl.constexpr,  # splits per iteration
):
    """Log-sum-exp merge of splits [0, num_work) of one KV head's query heads into out. The partials
    come from other programs of this launch: read at L2 (.cg), never from a possibly stale L1 line."""
    mid_out_ptr, mid_lse_ptr, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh = partials
    out_ptr, stride_ob, stride_oh = output
    offs_g = tl.arange(0, MERGE_G)
    offs_c = tl.arange(0, MERGE_CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    lse_rows = mid_lse_ptr + req * stride_lb + heads[:, None] * stride_lh  # [G, 1]
    part_rows = mid_out_ptr + req * stride_mb + heads[:, None, None] * stride_mh + offs_d[None, None, :]  # [G, 1, D]
    m = tl.full([MERGE_G], float("-inf"), tl.float32)
    total = tl.zeros([MERGE_G], tl.float32)
    acc = tl.zeros([MERGE_G, BLOCK_D], tl.float32)
    for first in range(0, num_work, MERGE_CHUNK):
        splits = first + offs_c
        mask = mask_g[:, None] & (splits < num_work)[None, :]  # [G, C]
        lse = tl.load(lse_rows + splits[None, :], mask=mask, other=float("-inf"), cache_modifier=".cg")
        lse = tl.where(mask_g[:, None], lse, 0.0)  # padding heads: finite, so no NaN (never stored)
        m_new = tl.maximum(m, tl.max(lse, 1))  # finite: split 0 always has work
        weights = tl.exp(lse - m_new[:, None])  # [G, C]
        parts = tl.load(
            part_rows + splits[None, :, None] * stride_ms,
            mask=mask[:, :, None] & mask_d[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )  # [G, C, D]
        alpha = tl.exp(m - m_new)
        acc = acc * alpha[:, None] + tl.sum(parts * weights[:, :, None], 1)
        total = total * alpha + tl.sum(weights, 1)
        m = m_new
    out = acc / total[:, None]
    out_ptrs = out_ptr + req * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


@triton.jit(do_not_specialize=RUNTIME_SPLIT_ARGS, do_not_specialize_on_alignment=RUNTIME_SPLIT_ARGS)
def _decode_stage2_kernel(
    mid_out_ptr,  # [B, H, num_splits, D] fp32
    mid_lse_ptr,  # [B, H, num_splits] fp32
    out_ptr,  # [B, H, D]
    num_splits,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the splits come from stage 1
        tl.extra.cuda.gdc_launch_dependents()
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + req * stride_lb + head * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))  # empty splits carry -inf -> weight 0; split 0 is never empty
    parts = tl.load(
        mid_out_ptr + req * stride_mb + head * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
        mask=(weights[:, None] > 0) & mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + req * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def merge_chunk(group_pad: int, block_d: int) -> int:
    """Splits merged per iteration: about 4096 fp32 partial elements in registers (32 per thread)."""
    return max(1, min(16, 4096 // (group_pad * block_d)))


def launch_stage2(mid_out: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, num_splits: int, pdl: bool) -> None:
    """`_decode_stage2_kernel` over (B, H): each (request, head)'s splits merged into out."""
    batch, num_heads, head_dim = out.shape
    block_d = triton.next_power_of_2(head_dim)
    _decode_stage2_kernel[(batch, num_heads)](
        mid_out,
        mid_lse,
        out,
        num_splits,
        *mid_out.stride()[:3],
        *mid_lse.stride()[:2],
        *out.stride()[:2],
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        USE_PDL=pdl,
        num_warps=4 if block_d >= 128 else 2,
        **launch_options(pdl),
    )


def split_outputs(
    q: torch.Tensor,
    num_splits: int,
    out: torch.Tensor | None,
    mid_out: torch.Tensor | None,
    mid_lse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output [B, H, D] and the flash-decoding scratch (partials [B, H, splits, D], log-sum-exps [B, H, splits],
    fp32) of q [B, H, D]: the caller's where given (a CUDA graph's static buffers), else fresh."""
    batch, num_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    if mid_out is None:
        mid_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    if mid_lse is None:
        mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    return out, mid_out, mid_lse
