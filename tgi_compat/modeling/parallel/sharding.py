"""Which part of each checkpoint tensor a rank holds.

Splits are as even as the sizes allow, so a model whose head count does not divide by the number
of ranks still shards (SmolLM2-135M: 9 query heads, 3 KV heads, over 2 ranks -> 6 + 3 query heads).
Attention splits by KV head, each rank taking the query heads of its KV heads; with fewer KV heads
than ranks every rank holds one KV head (replicated) and a share of its query heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from tgi_compat.modeling.parallel.group import TensorParallel


@dataclass(frozen=True, slots=True)
class Slice:
    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    def scaled(self, factor: int) -> Slice:
        return Slice(self.start * factor, self.size * factor)


def split_evenly(total: int, parts: int, index: int) -> Slice:
    """Part `index` of range(total) cut into `parts` contiguous pieces whose sizes differ by <= 1."""
    start, end = index * total // parts, (index + 1) * total // parts
    return Slice(start, end - start)


@dataclass(frozen=True, slots=True)
class HeadShard:
    """This rank's attention heads (as head indices of the checkpoint)."""

    q_heads: Slice
    kv_heads: Slice

    @property
    def num_heads(self) -> int:
        return self.q_heads.size

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads.size


def shard_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadShard:
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= tp.size:
        kv = split_evenly(num_kv_heads, tp.size, tp.rank)
        return HeadShard(q_heads=kv.scaled(group), kv_heads=kv)
    kv_head = tp.rank * num_kv_heads // tp.size
    sharing = [r for r in range(tp.size) if r * num_kv_heads // tp.size == kv_head]
    if len(sharing) > group:
        raise ValueError(f"{tp.size} ranks cannot split {num_heads} query heads over {num_kv_heads} KV heads")
    q = split_evenly(group, len(sharing), sharing.index(tp.rank))
    return HeadShard(q_heads=Slice(kv_head * group + q.start, q.size), kv_heads=Slice(kv_head, 1))


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[Slice, int]:
    """(this rank's rows of the checkpoint, rows of its padded shard). Every shard has the same
    padded size, so the logits gather in one all-gather; rows past the vocabulary are zeros."""
    padded = -(-vocab_size // tp.size)
    start = min(tp.rank * padded, vocab_size)
    return Slice(start, min(padded, vocab_size - start)), padded
