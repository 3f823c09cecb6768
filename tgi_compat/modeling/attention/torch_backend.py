"""Reference attention in plain PyTorch: correct for EXTEND, DECODE and MIXED batches, GQA native.

A step's requests are split into groups that each run as one SDPA call over K/V gathered through
req_to_token: all single-token requests (decodes) together as one padded [B, 1, max_kv] block,
and each multi-token request (a prefill chunk over its cached prefix) on its own, so a long chunk
next to many decodes never builds a [B, max_q, max_kv] mask. A pure decode step is one group.
A multi-token request's mask opens each image span of ForwardBatch.images both ways. A sliding window
or an attention chunk narrows a group's mask per call (layers differ), a span's pairs staying open; soft-capped scores take an eager
softmax, since SDPA has no hook for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tgi_compat.modeling.attention.base import AttentionBackend, AttentionParams
from tgi_compat.modeling.forward_batch import ForwardBatch, ForwardMode


@dataclass
class AttentionGroup:
    tokens: slice | torch.Tensor  # rows of the flat batch holding this group's queries
    kv_slots: torch.Tensor  # [b, max_kv] slot of every key of every request (padding masked)
    mask: torch.Tensor | None  # [b, 1, q_len, max_kv] bool, True = may attend; None = every key
    q_len: int  # queries per request (1 for decodes)
    query_pos: torch.Tensor  # [b, q_len] position of every query
    # [b, 1, q_len, max_kv]: the pairs inside one bidirectional span, which a sliding window leaves open (the
    # prefix of a PaliGemma 2 prompt longer than its window, as transformers' masks OR the span in); None: no span
    spans: torch.Tensor | None = None


@dataclass
class TorchAttentionMetadata:
    out_slots: torch.Tensor  # [T] slots of the new tokens
    groups: list[AttentionGroup]


class TorchAttentionBackend(AttentionBackend):
    metadata: TorchAttentionMetadata  # this step's, set by init_forward_metadata

    def init_forward_metadata(self, batch: ForwardBatch, req_to_token: torch.Tensor) -> None:
        # a one-token step may still be a prompt's last token in a span (after a prefix-cache hit): not a decode
        if batch.mode == ForwardMode.DECODE and not (batch.images is not None and any(batch.images.spans)):
            groups = [_decode_group(req_to_token, batch.req_rows, batch.kv_lens, slice(None), batch.max_kv_len)]
        else:
            groups = _extend_groups(batch, req_to_token)
            if len(groups) == 1:  # every request is in some group, so this one is the whole batch
                groups[0].tokens = slice(None)
        self.metadata = TorchAttentionMetadata(batch.out_slots, groups)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        slots = self.metadata.out_slots
        _store(k_cache, slots, k)
        _store(v_cache, slots, v)

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, params: AttentionParams
    ) -> torch.Tensor:
        groups = self.metadata.groups
        if len(groups) == 1:
            return self._attend(q, groups[0], k_cache, v_cache, params)
        out = q.new_empty(q.shape)  # [T, H, D]
        for group in groups:
            out[group.tokens] = self._attend(q[group.tokens], group, k_cache, v_cache, params)
        return out

    def _attend(
        self,
        q: torch.Tensor,
        group: AttentionGroup,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        params: AttentionParams,
    ) -> torch.Tensor:
        scale, softcap = params.scale, params.softcap
        num_reqs, max_kv = group.kv_slots.shape
        flat_slots = group.kv_slots.view(-1)
        # index_select beats advanced indexing here; [b, max_kv, H_kv, D] -> [b, H_kv, max_kv, D]
        k = _gather(k_cache, flat_slots, q.dtype).view(num_reqs, max_kv, *k_cache.shape[1:]).transpose(1, 2)
        v = _gather(v_cache, flat_slots, q.dtype).view(num_reqs, max_kv, *v_cache.shape[1:]).transpose(1, 2)
        q_block = q.view(num_reqs, group.q_len, self.num_heads, self.head_dim).transpose(1, 2)  # [b, H, q, D]
        mask = group.mask
        first_key = _first_visible_key(group.query_pos, params)
        if first_key is not None:
            key_pos = torch.arange(max_kv, device=k.device)
            in_window = (key_pos >= first_key[:, :, None])[:, None]  # [b, 1, q, max_kv]
            mask = in_window if mask is None else mask & in_window
            if group.spans is not None:
                mask = mask | group.spans
        if softcap:
            out = _soft_capped_attention(q_block, k, v, mask, scale, softcap)
        else:
            out = F.scaled_dot_product_attention(
                q_block, k, v, attn_mask=mask, scale=scale, enable_gqa=self.num_heads != self.num_kv_heads
            )
        return out.transpose(1, 2).reshape(q.shape)


def _first_visible_key(query_pos: torch.Tensor, params: AttentionParams) -> torch.Tensor | None:
    """The first key position each query sees under the layer's window or chunk; None: from the first."""
    if params.sliding_window:
        return query_pos - params.sliding_window + 1
    if params.attention_chunk:
        return query_pos // params.attention_chunk * params.attention_chunk
    return None


def _soft_capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float
) -> torch.Tensor:
    """Eager attention with scores -> softcap * tanh(scores / softcap); q [b, H, q, D], k/v [b, H_kv, L, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _store(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    if cache.element_size() == 1:  # FP8 KV: CPU has no index_copy_ for float8, so copy the bytes
        cache.view(torch.uint8).index_copy_(0, slots, values.to(cache.dtype).view(torch.uint8))
    else:
        cache.index_copy_(0, slots, values)


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if cache.element_size() == 1:  # FP8 KV (unit scale): read the bytes, widen to the model's dtype
        return cache.view(torch.uint8).index_select(0, slots).view(cache.dtype).to(dtype)
    return cache.index_select(0, slots)


def _decode_group(
    req_to_token: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor, tokens, max_kv: int
) -> AttentionGroup:
    kv_slots = req_to_token[rows, :max_kv].long()  # [b, max_kv]
    mask = None
    if rows.shape[0] > 1:  # shorter requests mask their padding
        key_pos = torch.arange(max_kv, device=kv_lens.device)
        mask = (key_pos[None, :] < kv_lens[:, None]).view(rows.shape[0], 1, 1, max_kv)
    return AttentionGroup(tokens, kv_slots, mask, q_len=1, query_pos=(kv_lens - 1)[:, None])


def _extend_groups(batch: ForwardBatch, req_to_token: torch.Tensor) -> list[AttentionGroup]:
    q_lens = batch.q_lens_cpu if batch.q_lens_cpu is not None else batch.q_lens.tolist()
    kv_lens = batch.kv_lens_cpu if batch.kv_lens_cpu is not None else batch.kv_lens.tolist()
    starts = [0]
    for q_len in q_lens[:-1]:
        starts.append(starts[-1] + q_len)
    groups = []
    spans = batch.images.spans if batch.images is not None else []
    # one new token in a span (a prompt's last after a prefix-cache hit) keeps its span's mask: not a decode
    decodes = [i for i, q_len in enumerate(q_lens) if q_len == 1 and not (i < len(spans) and spans[i])]
    if decodes:
        index = torch.tensor(decodes, device=batch.req_rows.device)
        groups.append(
            _decode_group(
                req_to_token,
                batch.req_rows[index],
                batch.kv_lens[index],
                torch.tensor([starts[i] for i in decodes], device=index.device),
                max(kv_lens[i] for i in decodes),
            )
        )
    for i, (start, q_len, kv_len) in enumerate(zip(starts, q_lens, kv_lens)):
        if i in decodes:
            continue
        kv_slots = req_to_token[batch.req_rows[i : i + 1], :kv_len].long()  # [1, kv_len]
        # causal relative to each token's position: query j sits at position (kv_len - q_len + j)
        query_pos = torch.arange(kv_len - q_len, kv_len, device=kv_slots.device)
        key_pos = torch.arange(kv_len, device=kv_slots.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        opened = None
        for span_start, span_end in spans[i] if i < len(spans) else ():
            # an image's placeholders see each other both ways (Gemma 3's prefill; PaliGemma's whole prompt)
            in_span = (key_pos >= span_start) & (key_pos < span_end)
            pairs = in_span[kv_len - q_len :, None] & in_span[None, :]
            opened = pairs if opened is None else opened | pairs
        if opened is not None:
            mask |= opened
            opened = opened.view(1, 1, q_len, kv_len)
        groups.append(
            AttentionGroup(
                slice(start, start + q_len), kv_slots, mask.view(1, 1, q_len, kv_len), q_len, query_pos[None], opened
            )
        )
    return groups
