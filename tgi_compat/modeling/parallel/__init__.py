"""Tensor parallelism: the process group (group.py), how weights and heads split (sharding.py), and
the one broadcast per step that lets the other ranks run rank 0's forward (step_broadcast.py)."""

from tgi_compat.modeling.parallel.group import NO_TP, TensorParallel, init_tensor_parallel
from tgi_compat.modeling.parallel.sharding import HeadShard, Slice, shard_heads, split_evenly, vocab_shard

__all__ = [
    "NO_TP",
    "HeadShard",
    "Slice",
    "TensorParallel",
    "init_tensor_parallel",
    "shard_heads",
    "split_evenly",
    "vocab_shard",
]
