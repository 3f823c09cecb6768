"""The one input of a model step: a flat, unpadded token batch (router -> modeling).

    Scheduler (router)  --StepPlan-->  Engine builds ForwardBatch  -->  ModelRunner.forward
                                                                          |-> AttentionBackend.init_forward_metadata
                                                                          |-> model(...) -> logits[logits_indices]

Request i owns tokens input_ids[q_start[i] : q_start[i] + q_lens[i]]; its first new token sits at
position kv_lens[i] - q_lens[i], so a cached prefix (earlier chunk, prefix hit, or a decode's past)
is simply kv_lens - q_lens. The runner writes out_slots into req_to_token[req_rows, positions]
before attention, so K/V of every token, old and new, is reached through req_to_token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class ForwardMode(enum.Enum):
    EXTEND = enum.auto()  # every request brings >= 1 new token over a (maybe empty) cached prefix
    DECODE = enum.auto()  # every request brings exactly one token
    MIXED = enum.auto()  # both kinds in one step (chunked prefill beside decodes)


@dataclass(slots=True)
class LoraBatch:
    """The adapters of a step with at least one LoRA row (tgi_compat/modeling/lora/)."""

    slots: torch.Tensor  # [B] int64: each request's adapter slot, -1 for the base model
    # (slot, adapter id): adapters the scheduler placed in a slot for this step, copied there before it runs
    loads: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class ImageEmbeds:
    """A step's image features (a vision model's prompts): each replaces its placeholder token's embedding.

    Under chunked prefill a chunk brings the rows of the placeholders it holds; an image's placeholders are
    never split across chunks (their attention is bidirectional, `spans`)."""

    token_index: torch.Tensor  # [N] int64: rows of the flat batch holding image placeholders
    embeds: torch.Tensor  # [N, hidden]: their features, from the vision encoder
    # per request of the batch: the [start, end) positions of each image whose placeholders attend to each
    # other both ways (Gemma 3; PaliGemma's whole prompt), up to this step's last new token (from the span's
    # start, which an earlier step or the prefix cache may have computed); empty for a causal-only model
    spans: list[list[tuple[int, int]]] = field(default_factory=list)
    # some rows come from an encoder call queued as this step was built (not all from the encoder cache)
    encoded: bool = False


@dataclass(frozen=True, slots=True)
class CrossRun:
    """Consecutive rows of CrossAttention.rows, of one request, that attend to the same keys of its images."""

    first: int
    end: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # the request's keys and values [N, kv_heads, D], per cross layer
    keys: tuple[int, int]  # the [lo, hi) of them these rows attend to
    entry: int = 0  # the id of `kv` in rank 0's store, by which the other ranks find their own (tensor parallelism)


@dataclass(slots=True)
class CrossAttention:
    """A cross-attending model's (Mllama) step: the tokens of its requests with images, which attend to their images'
    keys and values (tgi_compat/router/cross_attention.py); every other row skips the cross-attention layers."""

    rows: torch.Tensor  # [M] int64: rows of the flat batch, by request, in order
    # [M, 1]: 0 for a row before its request's first image, whose cross-attention MLP output is dropped
    follows_image: torch.Tensor
    runs: list[CrossRun]
    # under tensor parallelism, what the other ranks make and keep their own keys by (parallel/cross_broadcast.py):
    # the keys this step made, (id, their vision states [N, hidden] on the host), and the ids the store holds after it
    made: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    held: list[int] = field(default_factory=list)


# --diverse_mode: rows of one shared-prefix group at most (n = 8 siblings fill one; a larger n makes several groups)
PREFIX_GROUP_MAX = 8


@dataclass(slots=True)
class PrefixGroups:
    """Decode rows that share a KV prefix (n / best_of siblings of one prompt), as the shared-prefix attention
    kernel reads them (tgi_compat/kernels/attention/shared_prefix.py). Shapes depend on the batch size only.

    `table` [B, 1 + group_max] int64 (or int32): column 0 of row b is the length P of the prefix b shares with its
    group (0: in no group); columns 1.. of row g list the batch positions of group g (the first leads), -1 padding,
    so the groups fill the first rows and the kernel's programs find them without a search.
    """

    table: torch.Tensor

    @property
    def prefix_lens(self) -> torch.Tensor:  # [B]
        return self.table[:, 0]

    @property
    def members(self) -> torch.Tensor:  # [B, group_max]: row g, group g's positions
        return self.table[:, 1:]

    @staticmethod
    def rows(groups: list[tuple[int, list[int]]], batch_size: int, group_max: int) -> list[list[int]]:
        """The host table of `groups` ((shared length, batch positions; the first leads)): [B][1 + group_max]."""
        rows = [[0] + [-1] * group_max for _ in range(batch_size)]
        for slot, (prefix_len, positions) in enumerate(groups):
            assert 0 < len(positions) <= group_max and prefix_len > 0
            rows[slot][1 : 1 + len(positions)] = positions
            for position in positions:
                rows[position][0] = prefix_len
        return rows


def leading_one_token_requests(q_lens: list[int]) -> int:
    """How many requests at the head of a step bring one token each (a MIXED step's decodes come first)."""
    return next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64, KV slot of every new token
    req_rows: torch.Tensor  # [B] int64, row of each request in req_to_token
    q_start: torch.Tensor  # [B] int64, offset of each request's first new token in input_ids
    q_lens: torch.Tensor  # [B] int64, new tokens per request
    kv_lens: torch.Tensor  # [B] int64, cached prefix + new tokens
    logits_indices: torch.Tensor  # [R] int64, rows of the flat batch whose logits are returned
    max_q_len: int
    max_kv_len: int  # max(kv_lens), exact: the torch backend reads this many keys for a lone decode
    # host copies, so backends can plan without a device sync
    q_lens_cpu: list[int] | None = None
    kv_lens_cpu: list[int] | None = None
    # [3, H] int64 rows (req row, position, slot): prefix-cache hits of requests new to their row,
    # whose K/V is already in the cache; the runner writes them into req_to_token before the step.
    cached_prefix_slots: torch.Tensor | None = None
    # the caller takes only each logits row's greedy choice (no sampling, processors, top-n or prompt scores): a
    # vocab-parallel runner may then answer with the choice (GreedyChoice) and never gather the logits
    greedy_only: bool = False
    lora: LoraBatch | None = None  # None: every request runs on the base model (no LoRA work at all)
    images: ImageEmbeds | None = None  # None: no image placeholder among the new tokens
    # a DECODE step under --diverse_mode: its rows' shared prefixes (every step of the mode has one, maybe empty)
    prefix_groups: PrefixGroups | None = None
    # [3, T] int64 (t, h, w) rotary positions of an M-RoPE model's step (Qwen2.5-VL, tgi_compat.router.mrope) where
    # some token's differ from `positions`; None: every token rotates by `positions`
    rope_positions: torch.Tensor | None = None
    cross: CrossAttention | None = None  # None: no row of the step cross-attends to an image
    # a MIXED step whose first n requests bring one token each, fixed by its layout (a mixed-step CUDA graph's,
    # tgi_compat/modeling/mixed_graphs.py, whose lengths are on the device only); None: read from q_lens_cpu
    decode_prefix: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def batch_size(self) -> int:
        return self.req_rows.shape[0]


def build_forward_batch(
    input_ids: list[int],
    req_rows: list[int],
    q_lens: list[int],
    kv_lens: list[int],
    out_slots: list[int],
    logits_indices: list[int],
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """Build a ForwardBatch from host lists (one H2D copy per field). Positions follow from kv/q lens."""
    num_prefix = [kv - q for q, kv in zip(q_lens, kv_lens)]
    positions = [p for start, q in zip(num_prefix, q_lens) for p in range(start, start + q)]
    q_start, offset = [], 0
    for q in q_lens:
        q_start.append(offset)
        offset += q
    if all(q == 1 for q in q_lens):
        mode = ForwardMode.DECODE
    elif any(q == 1 and p > 0 for q, p in zip(q_lens, num_prefix)):
        mode = ForwardMode.MIXED
    else:
        mode = ForwardMode.EXTEND

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

    return ForwardBatch(
        mode=mode,
        input_ids=as_tensor(input_ids),
        positions=as_tensor(positions),
        out_slots=as_tensor(out_slots),
        req_rows=as_tensor(req_rows),
        q_start=as_tensor(q_start),
        q_lens=as_tensor(q_lens),
        kv_lens=as_tensor(kv_lens),
        logits_indices=as_tensor(logits_indices),
        max_q_len=max(q_lens),
        max_kv_len=max(kv_lens),
        q_lens_cpu=list(q_lens),
        kv_lens_cpu=list(kv_lens),
    )
