"""Attention on the GPU through the Triton kernels in tgi_compat/kernels/.

DECODE steps run flash-decoding (tgi_compat.kernels.attention.decode); EXTEND steps run the variable-length
extend kernel, which a step with images whose placeholders attend both ways (Gemma 3) gives each token's span.
A MIXED step (chunked prefill beside decodes) sends its leading run of one-token
requests (the scheduler puts running decodes first) through flash-decoding and the rest through
the extend kernel: the extend kernel would give every decode row a whole query tile, a grid sized by
the longest chunk, and one K/V read per query head instead of per KV head. Both read K/V through
req_to_token.

Small DECODE batches (MERGED_SPLIT_BATCHES) merge the flash-decoding splits inside the split kernel
(no stage-2 launch), and in FUSED_ROTARY_BATCHES the rotary + KV-store kernel is folded into it as well
(`rotate_store_and_attend`): the attention side of a layer is then one launch instead of three.

--diverse_mode: a DECODE step carries its rows' shared-prefix groups (ForwardBatch.prefix_groups, n / best_of
siblings on one cached prompt) and runs the shared-prefix kernel (tgi_compat/kernels/attention/shared_prefix.py):
each group's prefix is read once, each row's own tokens once, with the rotary and KV store unfused before it.

CUDA graphs: the decode path does no host work that depends on the step's contents. The number
of KV splits depends only on the batch size, the split length is derived per request on the
device, and the split scratch buffers and the merge's ticket counters are carved from buffers
allocated here at startup (the counters are left at zero by every launch). So a decode step
captured once per batch size replays correctly for any context lengths.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tgi_compat.kernels.attention.decode import choose_block_n, choose_num_splits, decode_attention
from tgi_compat.kernels.attention.decode_rotary import NewTokenKV
from tgi_compat.kernels.attention.kv_store import kv_store
from tgi_compat.kernels.attention.prefill import prefill_attention, token_spans
from tgi_compat.kernels.attention.rotary import rotary_and_kv_store
from tgi_compat.kernels.attention.shared_prefix import (
    choose_prefix_splits,
    choose_suffix_programs,
    shared_prefix_decode_attention,
)
from tgi_compat.modeling.attention.base import AttentionBackend, AttentionParams, AttentionShape, LayerQKV
from tgi_compat.modeling.forward_batch import ForwardBatch, ForwardMode, leading_one_token_requests
from tgi_compat.modeling.layers.ops import RopeLayout

MAX_DECODE_SPLITS = 64
# The shared-prefix kernel's keys per iteration, over prefixes and suffixes alike: its two kinds of program share one
# launch, so a 128-key suffix tile would set the shared memory (and so the SMs' occupancy) of the prefix's too.
SHARED_PREFIX_BLOCK_N = 64
# three stages of key blocks in flight: 7% faster than two at 32 groups of 8 (H100, 2026-12-06) and at 16 (2026-12-05)
SHARED_PREFIX_STAGES = 3
# The group programs read their members' own keys too (shared_prefix.py's `group_suffix`): CPU-proven, not yet timed
# on a GPU (`queue.sh diverse-kernel-ab` times both kernels, `diverse.py --both-forms` both engines), so off unless
# TGI_COMPAT_GROUP_SUFFIX=1.
SHARED_PREFIX_GROUP_SUFFIX = os.environ.get("TGI_COMPAT_GROUP_SUFFIX", "0") == "1"
# Decode batch sizes that take each fusion: H200, Llama-3-8B decode steps with CUDA graphs, context
# 512 (`bench_gpu.py --attn-variants`, docs/benchmarks/2026-11-22-serving.md, run J). The fused rotary saves 45 us per step at batch 1
# and 15-70 us at 2-64 but costs 24-130 us at 128-256 (every program rotates its queries). Merged
# splits save 18-30 us at batch 2-16 (batch >= 32 has one split); at batch 1 (dependent-launched chain,
# tgi_compat/kernels/pdl.py) they measured the same as the two kernels (4.052 vs 4.046 ms with the fused rotary).
MERGED_SPLIT_BATCHES = range(2, 17)
FUSED_ROTARY_BATCHES = range(1, 65)


@dataclass
class TritonAttentionMetadata:
    is_decode: bool
    req_to_token: torch.Tensor  # [R, L] int32
    req_rows: torch.Tensor  # [B]
    q_start: torch.Tensor  # [B]
    q_lens: torch.Tensor  # [B]
    kv_lens: torch.Tensor  # [B]
    out_slots: torch.Tensor  # [T]
    max_q_len: int
    num_splits: int  # flash-decoding rows only
    block_n: int  # flash-decoding rows only: keys per iteration
    num_decode_prefix: int = 0  # MIXED: the first requests (one token each) that go to flash-decoding
    prefix_table: torch.Tensor | None = None  # DECODE under --diverse_mode: PrefixGroups.table [B, 1 + group_max]
    prefix_splits: int = 0  # splits of each group's prefix (with prefix_table)
    spans: torch.Tensor | None = None  # [T, 2]: each of the step's tokens' bidirectional image span (token_spans)


class TritonAttentionBackend(AttentionBackend):
    supports_cuda_graphs = True
    metadata: TritonAttentionMetadata  # this step's, set by init_forward_metadata

    def __init__(self, shape: AttentionShape) -> None:
        super().__init__(shape)
        self.num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 4
        )
        # Split scratch for the largest decode batch a step may carry (one request per row).
        max_rows, num_heads = self.max_rows, self.num_heads
        self.prefix_group_max = shape.prefix_group_max
        self.max_seq_len = shape.max_seq_len  # bounds a prefix's splits by its key blocks
        capacity = max(b * (self._num_splits(b) + self._prefix_splits(b)) for b in range(1, max_rows + 1))
        self._mid_out = torch.empty(capacity * num_heads * self.head_dim, dtype=torch.float32, device=self.device)
        self._mid_lse = torch.empty(capacity * num_heads, dtype=torch.float32, device=self.device)
        # Ticket counters of the merged path, one per (position in the batch, KV head): indexed by
        # position, not request row, since CUDA-graph padding puts every padding entry on one spare row.
        self._split_counter = torch.zeros(max_rows, self.num_kv_heads, dtype=torch.int32, device=self.device)
        self.merged_split_batches = MERGED_SPLIT_BATCHES
        self.fused_rotary_batches = FUSED_ROTARY_BATCHES

    def compile_kernels(
        self,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        req_to_token: torch.Tensor,
        layer_params: list[AttentionParams],
        image_spans: bool = False,
    ) -> None:
        """Flash-decoding at every batch size, as a MIXED step's decode rows run it (no fused rotary).
        The batch size picks the kernel's variant (one split or several, merged or not, the key block,
        PDL at batch 1); the graph capture compiles only the fused-rotary ones, and the warm-up's mixed
        steps carry a few rows, so a mixed step of 17+ decode rows compiled its variant mid-serving
        (0.6-1.6 s each on an H200). Each size reads one key of row 0 and writes only scratch.
        With `image_spans`, the extend kernel's SPANS variant of each layer kind too (the first image's prefill
        compiled them)."""
        k_cache, v_cache = kv_cache
        rows = torch.zeros(self.max_rows, dtype=torch.int64, device=self.device)
        kv_lens = torch.ones(self.max_rows, dtype=torch.int64, device=self.device)
        for batch in range(1, self.max_rows + 1):
            self.metadata = TritonAttentionMetadata(
                is_decode=True,
                req_to_token=req_to_token,
                req_rows=rows[:batch],
                q_start=rows[:batch],
                q_lens=kv_lens[:batch],
                kv_lens=kv_lens[:batch],
                out_slots=rows[:0],
                max_q_len=1,
                num_splits=self._num_splits(batch),
                block_n=choose_block_n(batch, self.num_kv_heads, self.num_sms),
            )
            q = torch.zeros(batch, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)
            for params in layer_params:
                self._decode(q, k_cache, v_cache, params)
        if image_spans:
            self._compile_span_prefill(k_cache, v_cache, req_to_token, layer_params)

    def _compile_span_prefill(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        layer_params: list[AttentionParams],
    ) -> None:
        """One new token of row 0 in a one-token span, per layer kind: reads key 0, writes only scratch. Its q is a
        view of a q|k|v row as the layers' is (the kernel is specialized on its strides)."""
        heads = self.num_heads + 2 * self.num_kv_heads
        qkv = torch.zeros(1, heads, self.head_dim, dtype=self.dtype, device=self.device)
        one = torch.ones(1, dtype=torch.int64, device=self.device)
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        spans = token_spans([[(0, 1)]], [1], [1]).to(self.device)
        for params in layer_params:
            prefill_attention(
                qkv[:, : self.num_heads],
                k_cache,
                v_cache,
                req_to_token,
                zero,
                zero,
                one,
                one,
                1,
                params.scale,
                sliding_window=params.sliding_window,
                softcap=params.softcap,
                attention_chunk=params.attention_chunk,
                spans=spans,
            )

    def _num_splits(self, batch_size: int) -> int:
        return choose_num_splits(batch_size, self.num_kv_heads, self.num_sms, MAX_DECODE_SPLITS)

    def _prefix_splits(self, batch_size: int) -> int:
        """Under --diverse_mode, the splits of a group's prefix: enough programs over a batch of full groups
        (n = 8 siblings) to fill the SMs (choose_prefix_splits); 0 when the mode is off."""
        if not self.prefix_group_max:
            return 0
        if batch_size < 2:  # no group: its prefix programs only exit
            return 1
        # the merge holds every split of a head in registers: at most MAX_DECODE_SPLITS in all, as flash-decoding
        room = MAX_DECODE_SPLITS - self._num_splits(batch_size)
        return choose_prefix_splits(
            batch_size,
            self.prefix_group_max,
            self.num_kv_heads,
            self.num_sms,
            self.max_seq_len,
            SHARED_PREFIX_BLOCK_N,
            room,
        )

    def init_forward_metadata(self, batch: ForwardBatch, req_to_token: torch.Tensor) -> None:
        is_decode = batch.mode == ForwardMode.DECODE
        num_flash = batch.batch_size if is_decode else _num_decode_prefix(batch)
        spans = None
        if not is_decode and batch.images is not None and any(batch.images.spans):
            # image placeholders that attend to each other both ways (Gemma 3's prefill) go to the extend kernel,
            # a one-token chunk in a span too (its span may reach past its window)
            image_spans = batch.images.spans
            num_flash = next((i for i in range(num_flash) if i < len(image_spans) and image_spans[i]), num_flash)
            assert batch.q_lens_cpu is not None and batch.kv_lens_cpu is not None, "a step with images has host lengths"
            # one row per token of the whole step: the kernel indexes spans by q_start, which counts the decode
            # prefix's tokens too (theirs stay (0, 0))
            spans = token_spans(image_spans, batch.q_lens_cpu, batch.kv_lens_cpu)
            spans = spans.to(batch.req_rows.device, non_blocking=True)
        max_q_len = batch.max_q_len
        if num_flash and not is_decode and batch.q_lens_cpu is not None:  # a decode prefix needs host lengths
            max_q_len = max(batch.q_lens_cpu[num_flash:])
        self.metadata = TritonAttentionMetadata(
            is_decode=is_decode,
            req_to_token=req_to_token,
            req_rows=batch.req_rows,
            q_start=batch.q_start,
            q_lens=batch.q_lens,
            kv_lens=batch.kv_lens,
            out_slots=batch.out_slots,
            max_q_len=max_q_len,
            num_splits=self._num_splits(num_flash) if num_flash else 0,
            block_n=choose_block_n(max(num_flash, 1), self.num_kv_heads, self.num_sms),
            num_decode_prefix=0 if is_decode else num_flash,
            spans=spans,
        )
        if is_decode and batch.prefix_groups is not None and self.prefix_group_max:
            self.metadata.prefix_table = batch.prefix_groups.table
            self.metadata.prefix_splits = self._prefix_splits(batch.batch_size)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        kv_store(k, v, k_cache, v_cache, self.metadata.out_slots)

    def rotate_and_store_kv(self, new: LayerQKV) -> torch.Tensor:
        if new.ops.rope_layout is not RopeLayout.HALF:  # tables in the torch ops' layout
            return super().rotate_and_store_kv(new)
        cos, sin = new.rope
        rotary_and_kv_store(new.qk, new.v, cos, sin, new.k_cache, new.v_cache, self.metadata.out_slots, new.num_q_heads)
        return new.qk

    def rotate_store_and_attend(self, new: LayerQKV, params: AttentionParams) -> torch.Tensor:
        meta = self.metadata
        fusable = meta.is_decode and meta.prefix_table is None and new.ops.rope_layout is RopeLayout.HALF
        if not (fusable and new.qk.shape[0] in self.fused_rotary_batches):
            return super().rotate_store_and_attend(new, params)
        num_q_heads = new.num_q_heads
        cos, sin = new.rope  # [B, D/2] each, this step's rows (triton_rope_tables)
        new_token = NewTokenKV(k=new.qk[:, num_q_heads:], v=new.v, cos=cos, sin=sin, slots=meta.out_slots)
        return self._decode(new.qk[:, :num_q_heads], new.k_cache, new.v_cache, params, new_token=new_token)

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, params: AttentionParams
    ) -> torch.Tensor:
        meta = self.metadata
        if meta.is_decode:
            return self._decode(q, k_cache, v_cache, params)
        out = torch.empty_like(q)
        first = meta.num_decode_prefix  # requests [0, first) own tokens [0, first), one each
        if first:
            self._decode(q[:first], k_cache, v_cache, params, out=out[:first])
        prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.req_to_token,
            meta.req_rows[first:],
            meta.q_start[first:],
            meta.q_lens[first:],
            meta.kv_lens[first:],
            meta.max_q_len,
            params.scale,
            out=out,
            sliding_window=params.sliding_window,
            softcap=params.softcap,
            attention_chunk=params.attention_chunk,
            spans=meta.spans,
        )
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        params: AttentionParams,
        out: torch.Tensor | None = None,
        new_token: NewTokenKV | None = None,
    ) -> torch.Tensor:
        """Flash-decoding of requests [0, len(q)) (each one token: q row i is request i); with
        `new_token`, q is unrotated and the kernel does the rotary and the KV store too."""
        meta = self.metadata
        batch, splits = q.shape[0], meta.num_splits
        if batch > self.max_rows:
            raise ValueError(f"decode batch of {batch} requests exceeds the backend's max_rows={self.max_rows}")
        mid_out = self._mid_out[: batch * self.num_heads * splits * self.head_dim].view(
            batch, self.num_heads, splits, self.head_dim
        )
        mid_lse = self._mid_lse[: batch * self.num_heads * splits].view(batch, self.num_heads, splits)
        # (a windowed or chunked layer: flash-decoding)
        if meta.prefix_table is not None and params.sliding_window is None and params.attention_chunk is None:
            assert new_token is None  # the rotary and the KV store ran before (rotate_store_and_attend)
            return self._shared_prefix_decode(q, k_cache, v_cache, params, out)
        counter = self._split_counter if batch in self.merged_split_batches else None
        return decode_attention(
            q,
            k_cache,
            v_cache,
            meta.req_to_token,
            meta.req_rows,
            meta.kv_lens,
            params.scale,
            splits,
            out=out,
            mid_out=mid_out,
            mid_lse=mid_lse,
            block_n=meta.block_n,
            split_counter=counter,
            new_token=new_token,
            sliding_window=params.sliding_window,
            softcap=params.softcap,
            attention_chunk=params.attention_chunk,
        )

    def _shared_prefix_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        params: AttentionParams,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """A --diverse_mode DECODE step: each group's shared prefix once, then each row's own tokens."""
        meta = self.metadata
        assert meta.prefix_table is not None
        batch, heads, head_dim = q.shape[0], self.num_heads, self.head_dim
        splits = meta.num_splits + meta.prefix_splits
        mid_out = self._mid_out[: batch * heads * splits * head_dim].view(batch, heads, splits, head_dim)
        mid_lse = self._mid_lse[: batch * heads * splits].view(batch, heads, splits)
        return shared_prefix_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.req_to_token,
            meta.req_rows,
            meta.kv_lens,
            meta.prefix_table,
            params.scale,
            meta.num_splits,
            meta.prefix_splits,
            out=out,
            mid_out=mid_out,
            mid_lse=mid_lse,
            block_n=SHARED_PREFIX_BLOCK_N,
            prefix_block_n=SHARED_PREFIX_BLOCK_N,
            num_stages=SHARED_PREFIX_STAGES,
            softcap=params.softcap,
            group_suffix=SHARED_PREFIX_GROUP_SUFFIX,
            suffix_programs=choose_suffix_programs(
                batch, meta.num_splits, self.num_kv_heads, self.num_sms, SHARED_PREFIX_GROUP_SUFFIX
            ),
        )


def _num_decode_prefix(batch: ForwardBatch) -> int:
    """How many leading requests bring one token each (0 without host lengths, or if all do: the
    caller labelled such a step DECODE or EXTEND and it takes that path)."""
    if batch.decode_prefix is not None:
        return batch.decode_prefix
    q_lens = batch.q_lens_cpu
    if q_lens is None:
        return 0
    count = leading_one_token_requests(q_lens)
    return 0 if count == len(q_lens) else count
