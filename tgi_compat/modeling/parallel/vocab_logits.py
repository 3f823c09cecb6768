"""What a vocab-parallel rank does with its block of the LM head's logits after the forward.

The LM head of a sharded model leaves each rank its block of the logits columns (its vocabulary rows). For
sampling, the blocks are gathered into [R, vocab] on every rank (the one-trip gather of
tgi_compat.kernels.comm.one_shot_all_reduce, NCCL for float32 logits). A step that only takes each row's greedy choice needs far
less: each rank reduces its block to (max, first id of the max, sum of exp(x - max)) a row, and only those cross
NVLink (12 bytes a row and rank, where the gather moves the whole block: 8 MiB at 64 rows of Llama-3's
vocabulary over 2 ranks, ~27 us on H200s). tgi_compat.kernels.sampling.greedy_pick merges them into what its whole-vocabulary choice
returns: the same id, the same logprob.

The partials travel through the 16-bit gather as their bytes, one bf16 integer (0..255, exact) each, which never
takes the gather's -0.0 sentinel (float32 partials would need NCCL, ~20 us a call): four kernels a step, the
block's reduction in two, the gather, the merge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgi_compat.modeling.parallel.group import TensorParallel
from tgi_compat.modeling.parallel.sharding import vocab_shard


@dataclass(slots=True)
class GreedyChoice:
    """Each logits row's greedy choice, as tgi_compat.router.sampling.sampler's greedy path computes it from the whole logits."""

    token_ids: torch.Tensor  # [R] int64
    packed: torch.Tensor  # [2, R] float64: the ids, then their logprobs


class VocabParallelLogits:
    def __init__(self, tp: TensorParallel, vocab_size: int) -> None:
        self.tp, self.vocab_size = tp, vocab_size
        rows, _ = vocab_shard(vocab_size, tp)
        self.block_start, self.block_size = rows.start, rows.size

    def gather(self, block: torch.Tensor) -> torch.Tensor:
        """[R, padded vocab / ranks] of every rank -> the logits [R, vocab], on every rank."""
        return self.tp.all_gather_columns(block)[:, : self.vocab_size]

    def greedy(self, block: torch.Tensor) -> GreedyChoice:
        """Every rank's block -> each row's greedy choice, on every rank (a collective: every rank calls it)."""
        from tgi_compat.kernels.sampling import (
            greedy_pick,  # imported on first use: see tgi_compat.modeling.runner._build_model
        )

        real = block[:, : self.block_size]  # columns past the vocabulary are padding (zero weights)
        on_gpu = block.is_cuda
        partial = greedy_pick.greedy_block_partials if on_gpu else greedy_pick.greedy_block_partials_ref
        mine = partial(real, self.block_start, self.vocab_size)  # [R, 12] bf16: the bytes of 3 float32 values
        everyone = self.tp.all_gather_columns(mine)  # [R, 12 * ranks], rank order = id order
        merge = greedy_pick.greedy_merge_blocks if on_gpu else greedy_pick.greedy_merge_blocks_ref
        return GreedyChoice(*merge(everyone, self.vocab_size))
