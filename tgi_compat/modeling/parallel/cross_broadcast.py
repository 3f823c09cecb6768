"""Rank 0 -> the other ranks under tensor parallelism: a cross-attending model's (Mllama's) step's CrossAttention.

Rank 0's store (tgi_compat/router/cross_attention.py) makes a request's image keys once, from its images' vision
states, which only rank 0 encodes; each rank's keys hold its own KV heads (models/mllama.py), so the other ranks
make theirs from the same states, sent once, with the step that first reads them, and keep them by the store's ids
until a step's list of the ids rank 0 holds leaves them out (their request gave back its row). Sent after the
step's batch (parallel/step_broadcast.py), whose header carries the length of the host part:

    host   = [M, runs, made, held, dtype] runs * (first, end, keys lo, keys hi, entry) made * (id, N, width) held ids
    device = rows[M] (int64), follows_image[M, 1] (dtype), then each made entry's states [N, width] (dtype)
"""

from __future__ import annotations

import torch

from tgi_compat.modeling.forward_batch import CrossAttention, CrossRun
from tgi_compat.modeling.parallel.group import TensorParallel
from tgi_compat.modeling.vision.cross_keys import CrossProjector

WIRE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # a tensor's dtype as it travels, by index
_RUN, _MADE = 5, 3  # host ints per run and per made entry


def cross_host(cross: CrossAttention) -> list[int]:
    """The host part of `cross` (rank 0); send_cross_tensors sends the rest after it."""
    dtype = WIRE_DTYPES.index(cross.follows_image.dtype)
    host = [len(cross.rows), len(cross.runs), len(cross.made), len(cross.held), dtype]
    for run in cross.runs:
        host += [run.first, run.end, *run.keys, run.entry]
    for entry_id, states in cross.made:
        host += [entry_id, *states.shape]
    return host + cross.held


def send_cross_tensors(tp: TensorParallel, cross: CrossAttention) -> None:
    tp.broadcast(cross.rows)
    tp.broadcast(cross.follows_image.contiguous())
    for _, states in cross.made:
        tp.broadcast(states.to(tp.device, cross.follows_image.dtype).contiguous())


class CrossKeysFollower:
    """Ranks > 0: this rank's keys of the requests rank 0's store holds, by its ids."""

    def __init__(self, projector: CrossProjector) -> None:
        self.projector = projector
        self.entries: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def receive(self, tp: TensorParallel, length: int) -> CrossAttention:
        host = torch.empty(length, dtype=torch.int64)
        tp.broadcast_host(host)
        meta = host.tolist()
        num_rows, num_runs, num_made, num_held, dtype_index = meta[:5]
        at = 5 + _RUN * num_runs
        runs = [meta[k : k + _RUN] for k in range(5, at, _RUN)]
        made = [meta[k : k + _MADE] for k in range(at, at + _MADE * num_made, _MADE)]
        held = set(meta[at + _MADE * num_made : at + _MADE * num_made + num_held])
        for entry_id in [key for key in self.entries if key not in held]:  # their requests gave back their rows
            del self.entries[entry_id]
        dtype = WIRE_DTYPES[dtype_index]
        rows = torch.empty(num_rows, dtype=torch.int64, device=tp.device)
        tp.broadcast(rows)
        follows = torch.empty(num_rows, 1, dtype=dtype, device=tp.device)
        tp.broadcast(follows)
        for entry_id, n, width in made:
            states = torch.empty(n, width, dtype=dtype, device=tp.device)
            tp.broadcast(states)
            self.entries[entry_id] = self.projector.cross_kv(states)
        cross_runs = [CrossRun(first, end, self.entries[e], (lo, hi), e) for first, end, lo, hi, e in runs]
        return CrossAttention(rows, follows, cross_runs)
