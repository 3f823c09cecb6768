"""Token embedding and the LM head (which may share the embedding's weight).

Vocab-parallel under tensor parallelism: each rank holds an equal, zero-padded block of vocabulary
rows. The embedding looks up the ids in its block and all-reduces (exactly one rank contributes
each row); the LM head computes its block of logits, which the runner gathers for sampling after the forward
(outside its CUDA graphs) or reduces to the greedy choice (tgi_compat.modeling.parallel.vocab_logits).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tgi_compat.kernels.comm.vocab_embedding import vocab_shard_embedding, vocab_shard_embedding_ref
from tgi_compat.modeling.layers.linear import LoadableParameter, default_weight_loader, dense, new_param
from tgi_compat.modeling.parallel import NO_TP, TensorParallel, vocab_shard
from tgi_compat.modeling.weights.lazy import LazyTensor, take


def _vocab_parallel_weight(vocab_size: int, hidden_size: int, tp: TensorParallel) -> LoadableParameter:
    rows, padded = vocab_shard(vocab_size, tp)

    def load_rows(param: nn.Parameter, loaded: torch.Tensor | LazyTensor, shard: object = None) -> None:
        if not tp.is_sharded:
            return default_weight_loader(param, loaded)
        param.data[rows.size :].zero_()
        default_weight_loader(param.data[: rows.size], take(loaded, 0, rows.start, rows.size))

    return new_param(padded, hidden_size, loader=load_rows)


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = NO_TP):
        super().__init__()
        self.tp = tp
        self.rows, _ = vocab_shard(vocab_size, tp)
        self.weight = _vocab_parallel_weight(vocab_size, hidden_size, tp)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_sharded:
            return F.embedding(input_ids, self.weight)
        if not input_ids.is_cuda:
            return self.tp.all_reduce(
                vocab_shard_embedding_ref(input_ids, self.weight, self.rows.start, self.rows.size)
            )
        # one lookup kernel, whose rows go to the other ranks as it stores them where the one-trip all-reduce takes
        # the sum (then the sum only gathers)
        push = self.tp.push_target(input_ids.numel() * self.weight.shape[1], self.weight.dtype)
        hidden = vocab_shard_embedding(input_ids.view(-1), self.weight, self.rows.start, self.rows.size, push)
        if push is None:
            return self.tp.all_reduce(hidden)
        return self.tp.finish_pushed_all_reduce(hidden)


class LMHead(nn.Module):
    """Projects the R rows whose logits are wanted (not all T tokens) to logits in the weights' dtype: the
    greedy choice reads them as they are, and the sampler widens them to float32 where it processes them."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None, tp: TensorParallel = NO_TP
    ):
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight  # same Parameter: loaded once, stored once
        else:
            self.weight = _vocab_parallel_weight(vocab_size, hidden_size, tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # [R, hidden] -> [R, vocab]; under tensor parallelism this rank's block, [R, padded vocab / N], which the
        # runner gathers, or reduces to the greedy choice (tgi_compat.modeling.parallel.vocab_logits)
        return dense(hidden, self.weight)
