"""Rotary embedding and the KV store of the step's token, fused into flash-decoding's stage 1 (a `NewTokenKV`
given to `decode_attention`): q arrives unrotated and each program rotates its query group in registers; the
program whose split holds the request's newest position also rotates that token's k and writes it and v into the
KV cache before its own reads. The separate rotary + KV-store kernel then has nothing left to do.

`NewTokenKV`'s tensors and strides travel as two tuples: `new_kv` = (new_k_ptr, new_v_ptr, slots_ptr, stride_nkb,
stride_nkh, stride_nvb, stride_nvh) and `rope` = (cos_ptr, sin_ptr, stride_cos, stride_sin).

A `QKVLoraDelta` (LORA) adds each LoRA row's low-rank q, k and v deltas, s_q @ B_q^T and so on, before the rotary:
the folded q|k|v projection's output holds every slot's shrunk values beside the base columns
(tgi_compat.modeling.lora.folding), and each program adds the columns of its own heads from its row's 3 x R of them,
so the LoRA step's q|k|v expand is no launch of its own (its tail and the launch after it were ~4.7 us a layer at
64 rows). Rotary is linear: a delta column's rotary partner is read as its own row of B. Its tensors and strides
travel as `lora` = (shrunk_ptr, slots_ptr, b_ptr, stride_sb, stride_bl, stride_bn, rank, k_col, v_col).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class NewTokenKV:
    """This step's token of each request, for the fused rotary path: unrotated k, v and the rope rows."""

    k: torch.Tensor  # [B, KVH, D], unrotated (a view of the fused qkv output)
    v: torch.Tensor  # [B, KVH, D]
    cos: torch.Tensor  # [B, D/2], this step's rows
    sin: torch.Tensor  # [B, D/2]
    slots: torch.Tensor  # [B], the KV slot of each request's newest position


@dataclass(frozen=True, slots=True)
class QKVLoraDelta:
    """The LoRA rows' q|k|v deltas of a step, not yet added (the fused rotary path adds them)."""

    shrunk: torch.Tensor  # [B, L * 3 * R]: each row's shrunk q, k and v under every slot (the folded output's tail)
    slots: torch.Tensor  # [B] int64: each row's slot, -1 for the base model
    b: torch.Tensor  # [L, (H + 2 * KVH) * D, R]: every slot's B, q's columns, then k's, then v's


def lora_delta_args(
    lora: QKVLoraDelta | None, q: torch.Tensor, num_kv_heads: int
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """Stage 1's QKVLoraDelta tensors and its strides, rank and k / v column offsets (placeholders without one)."""
    if lora is None:
        return (q,) * 3, (0,) * 6
    batch, num_heads, head_dim = q.shape
    num_slots, columns, rank = lora.b.shape
    assert columns == (num_heads + 2 * num_kv_heads) * head_dim and lora.b.stride(2) == 1, lora.b.shape
    assert lora.shrunk.shape == (batch, num_slots * 3 * rank) and lora.shrunk.stride(1) == 1, lora.shrunk.shape
    assert lora.slots.shape == (batch,)
    k_col = num_heads * head_dim
    strides = (lora.shrunk.stride(0), lora.b.stride(0), lora.b.stride(1), rank, k_col, k_col + num_kv_heads * head_dim)
    return (lora.shrunk, lora.slots, lora.b), strides


def lora_block_r(lora: QKVLoraDelta | None) -> int:
    return 16 if lora is None else max(16, triton.next_power_of_2(lora.b.shape[2]))


def new_token_args(
    new_token: NewTokenKV | None, q: torch.Tensor, num_kv_heads: int
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """Stage 1's NewTokenKV tensors and strides (placeholders that are never read without one)."""
    if new_token is None:
        return (q,) * 5, (0,) * 6
    k, v, cos, sin = new_token.k, new_token.v, new_token.cos, new_token.sin
    batch, _, head_dim = q.shape
    assert k.shape == v.shape == (batch, num_kv_heads, head_dim) and k.stride(2) == 1 and v.stride(2) == 1
    assert cos.shape == sin.shape == (batch, head_dim // 2) and cos.stride(1) == 1 and sin.stride(1) == 1
    assert head_dim % 2 == 0 and new_token.slots.shape == (batch,)
    tensors = (k, v, cos, sin, new_token.slots)
    return tensors, (*k.stride()[:2], *v.stride()[:2], cos.stride(0), sin.stride(0))


@triton.jit
def _partner(offs_d, HALF: tl.constexpr):
    """Each column's rotary partner in the rotate-half layout."""
    return tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)


@triton.jit
def _rotate_rows(
    ptr, row_offsets, mask_rows, cos, sin, offs_d, dx, dpair, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
    ADD: tl.constexpr,
):  # fmt: skip
    """Rows of head vectors at ptr + row_offsets, rotated in fp32 (rotate-half layout): [ROWS, BLOCK_D].
    cos/sin are [BLOCK_D]: entry d holds the table's entry d mod HALF. ADD: dx and dpair ([ROWS, BLOCK_D] fp32,
    a LoRA delta at each column and at its partner) are added to the rows first."""
    partner = _partner(offs_d, HALF)
    mask = mask_rows[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(ptr + row_offsets[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    pair = tl.load(ptr + row_offsets[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD:
        x += dx
        pair += dpair
    return x * cos[None, :] + pair * tl.where(offs_d < HALF, -sin, sin)[None, :]


@triton.jit
def _lora_columns(b_slot_ptr, stride_bn, columns, mask, s, offs_r, mask_r):
    """sum over r of B[columns, r] * s[r], fp32, for `columns` [BLOCK_D] of one slot's B."""
    tile = tl.load(
        b_slot_ptr + columns[:, None] * stride_bn + offs_r[None, :], mask=mask[:, None] & mask_r[None, :], other=0.0
    )
    return tl.sum(tile.to(tl.float32) * s[None, :], axis=1)


@triton.jit
def _lora_head(b_slot_ptr, stride_bn, first_column, offs_d, mask_d, s, offs_r, mask_r, HALF: tl.constexpr):
    """One head's delta [BLOCK_D] and its partners' [BLOCK_D] (the columns its rotary pairs it with)."""
    delta = _lora_columns(b_slot_ptr, stride_bn, first_column + offs_d, mask_d, s, offs_r, mask_r)
    pair = _lora_columns(b_slot_ptr, stride_bn, first_column + _partner(offs_d, HALF), mask_d, s, offs_r, mask_r)
    return delta, pair


@triton.jit
def _lora_row(lora, req, BLOCK_R: tl.constexpr):
    """What the row's deltas need: (its slot's B, B's row stride, k's and v's first column, its shrunk q, k and v
    [BLOCK_R] fp32 (zeros for a base row), offs_r, mask_r)."""
    shrunk_ptr, slots_ptr, b_ptr, stride_sb, stride_bl, stride_bn, rank, k_col, v_col = lora
    slot = tl.load(slots_ptr + req)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = (offs_r < rank) & (offs_r * 0 + slot >= 0)  # (a vector: the interpreter)
    slot = tl.maximum(slot, 0).to(tl.int64)
    row = shrunk_ptr + req.to(tl.int64) * stride_sb + slot * 3 * rank + offs_r
    s_q = tl.load(row, mask=mask_r, other=0.0).to(tl.float32)
    s_k = tl.load(row + rank, mask=mask_r, other=0.0).to(tl.float32)
    s_v = tl.load(row + 2 * rank, mask=mask_r, other=0.0).to(tl.float32)
    return b_ptr + slot * stride_bl, stride_bn, k_col, v_col, s_q, s_k, s_v, offs_r, mask_r


@triton.jit
def _store_new_token_kv(
    new_k_ptr, new_v_ptr, head_kv, slot, cos, sin, stride_kh, stride_vh, lora_row, HEAD_DIM: tl.constexpr,
    LORA: tl.constexpr,
):  # fmt: skip
    """Rotates one request's new k of this KV head; writes it and its v into the token's KV slot.
    new_k_ptr / new_v_ptr point at the request's row; stride_kh / stride_vh are their head strides.
    LORA: the row's k and v deltas are added first (lora_row: _lora_row's)."""
    k_cache_ptr, v_cache_ptr, stride_ks, stride_ckh, stride_vs, stride_cvh, kv_head, offs_d, mask_d = head_kv
    one_row = tl.arange(0, 1)  # row offset 0: [1, BLOCK_D] tiles
    mask = (offs_d < HEAD_DIM)[None, :]
    dk, dk_pair, dv = 0.0, 0.0, 0.0
    if LORA:
        b_slot, stride_bn, k_col, v_col, s_q, s_k, s_v, offs_r, mask_r = lora_row
        dk, dk_pair = _lora_head(b_slot, stride_bn, k_col + kv_head * HEAD_DIM, offs_d, mask_d, s_k, offs_r, mask_r,
                                 HEAD_DIM // 2)  # fmt: skip
        dk, dk_pair = dk[None, :], dk_pair[None, :]
        dv = _lora_columns(b_slot, stride_bn, v_col + kv_head * HEAD_DIM + offs_d, mask_d, s_v, offs_r, mask_r)[None, :]
    k_row = new_k_ptr + kv_head * stride_kh
    k = _rotate_rows(k_row, one_row, one_row == 0, cos, sin, offs_d, dk, dk_pair, HEAD_DIM // 2, HEAD_DIM, LORA)
    v = tl.load(new_v_ptr + kv_head * stride_vh + offs_d[None, :], mask=mask)
    if LORA:
        v = v.to(tl.float32) + dv
    k_dst = k_cache_ptr + slot * stride_ks + kv_head * stride_ckh + offs_d[None, :]
    v_dst = v_cache_ptr + slot * stride_vs + kv_head * stride_cvh + offs_d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotated_query(
    q_ptr, q_rows, mask_g, req, kv_len, start, end, head_kv, new_kv, rope, lora, HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_D: tl.constexpr, LORA: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """The program's query group [GROUP_PAD, BLOCK_D], rotated (q_ptr's dtype), with its LoRA deltas (LORA). The
    program whose split [start, end) holds the request's newest position also stores that token's rotated k and its
    v, before its own gathers read their slot."""
    k_cache_ptr, v_cache_ptr, stride_ks, stride_kh, stride_vs, stride_vh, kv_head, offs_d, mask_d = head_kv
    new_k_ptr, new_v_ptr, slots_ptr, stride_nkb, stride_nkh, stride_nvb, stride_nvh = new_kv
    cos_ptr, sin_ptr, stride_cos, stride_sin = rope
    offs_half = offs_d % (HEAD_DIM // 2)
    cos = tl.load(cos_ptr + req * stride_cos + offs_half, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + req * stride_sin + offs_half, mask=mask_d, other=0.0).to(tl.float32)
    dq, dq_pair = 0.0, 0.0
    lora_row = lora  # (not read without LORA)
    if LORA:
        lora_row = _lora_row(lora, req, BLOCK_R)
        b_slot, stride_bn, k_col, v_col, s_q, s_k, s_v, offs_r, mask_r = lora_row
        offs_g = tl.arange(0, GROUP_PAD)
        dq = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
        dq_pair = tl.zeros_like(dq)
        for g in tl.static_range(GROUP):
            first = (kv_head * GROUP + g) * HEAD_DIM
            delta, pair = _lora_head(b_slot, stride_bn, first, offs_d, mask_d, s_q, offs_r, mask_r, HEAD_DIM // 2)
            dq = tl.where((offs_g == g)[:, None], delta[None, :], dq)
            dq_pair = tl.where((offs_g == g)[:, None], pair[None, :], dq_pair)
    q = _rotate_rows(q_ptr, q_rows, mask_g, cos, sin, offs_d, dq, dq_pair, HEAD_DIM // 2, HEAD_DIM, LORA)
    q = q.to(q_ptr.dtype.element_ty)
    if (start < end) & (end == kv_len):  # this split holds the newest position
        slot = tl.load(slots_ptr + req).to(tl.int64)
        new_k, new_v = new_k_ptr + req * stride_nkb, new_v_ptr + req * stride_nvb
        _store_new_token_kv(new_k, new_v, head_kv, slot, cos, sin, stride_nkh, stride_nvh, lora_row, HEAD_DIM, LORA)
        tl.debug_barrier()  # every thread's cache stores precede this program's gathers of that slot
    return q
