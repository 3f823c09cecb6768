"""Reference attention in plain PyTorch: correct for EXTEND, DECODE and MIXED batches, GQA native.

Each step gathers every request's K/V through req_to_token into a padded [B, max_kv] block once
per layer (one index op, no per-request Python loop) and runs SDPA with a mask that is causal
relative to each token's position. Decode (one token per request) needs no query padding at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from modeling.attention.base import AttentionBackend
from modeling.forward_batch import ForwardBatch, ForwardMode


@dataclass
class TorchAttentionMetadata:
    out_slots: torch.Tensor  # [T] slots of the new tokens
    kv_slots: torch.Tensor  # [B, max_kv] slot of every key of every request (padding masked)
    mask: torch.Tensor | None  # [B, 1, max_q, max_kv] bool, True = may attend; None = all keys
    # Scatter between the flat batch and the padded [B, max_q] query block; None when it is a plain view.
    token_req: torch.Tensor | None  # [T] request of each token
    token_offset: torch.Tensor | None  # [T] index of each token inside its request's new tokens
    batch_size: int
    max_q_len: int


class TorchAttentionBackend(AttentionBackend):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_rows: int,
        max_seq_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = device
        self.dtype = dtype
        self.metadata: TorchAttentionMetadata | None = None

    def init_forward_metadata(self, batch: ForwardBatch, req_to_token: torch.Tensor) -> None:
        num_reqs, max_q, max_kv = batch.batch_size, batch.max_q_len, batch.max_kv_len
        key_pos = torch.arange(max_kv, device=batch.kv_lens.device)  # [max_kv]
        kv_slots = req_to_token[batch.req_rows, :max_kv].long()  # [B, max_kv]
        if batch.mode == ForwardMode.DECODE:
            mask = None if num_reqs == 1 else (key_pos[None, :] < batch.kv_lens[:, None]).view(num_reqs, 1, 1, max_kv)
            token_req = token_offset = None
        else:
            prefix = batch.kv_lens - batch.q_lens  # [B]
            query_pos = prefix[:, None] + torch.arange(max_q, device=prefix.device)[None, :]  # [B, max_q]
            mask = (key_pos[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)  # [B, 1, max_q, max_kv]
            token_req = token_offset = None
            if num_reqs > 1:
                token_req = torch.repeat_interleave(
                    torch.arange(num_reqs, device=prefix.device), batch.q_lens, output_size=batch.num_tokens
                )
                token_offset = torch.arange(batch.num_tokens, device=prefix.device) - batch.q_start[token_req]
        self.metadata = TorchAttentionMetadata(
            out_slots=batch.out_slots,
            kv_slots=kv_slots,
            mask=mask,
            token_req=token_req,
            token_offset=token_offset,
            batch_size=num_reqs,
            max_q_len=max_q,
        )

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        slots = self.metadata.out_slots
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        meta = self.metadata
        num_reqs, max_kv = meta.kv_slots.shape
        flat_slots = meta.kv_slots.view(-1)
        # index_select beats advanced indexing here; [B, max_kv, H_kv, D] -> [B, H_kv, max_kv, D]
        k = k_cache.index_select(0, flat_slots).view(num_reqs, max_kv, *k_cache.shape[1:]).transpose(1, 2)
        v = v_cache.index_select(0, flat_slots).view(num_reqs, max_kv, *v_cache.shape[1:]).transpose(1, 2)
        q_padded = self._pad_queries(q)  # [B, H, max_q, D]
        out = F.scaled_dot_product_attention(
            q_padded, k, v, attn_mask=meta.mask, scale=scale, enable_gqa=self.num_heads != self.num_kv_heads
        )
        out = out.transpose(1, 2)  # [B, max_q, H, D]
        if meta.token_req is None:
            return out.reshape(q.shape)
        return out[meta.token_req, meta.token_offset]

    def _pad_queries(self, q: torch.Tensor) -> torch.Tensor:
        meta = self.metadata
        if meta.token_req is None:
            # One request (any q_len) or a pure decode batch: the flat batch already is the block.
            return q.view(meta.batch_size, meta.max_q_len, self.num_heads, self.head_dim).transpose(1, 2)
        padded = q.new_zeros(meta.batch_size, meta.max_q_len, self.num_heads, self.head_dim)
        padded[meta.token_req, meta.token_offset] = q
        return padded.transpose(1, 2)
