"""This process's tensor-parallel group and the collectives a sharded model calls.

One group per process, made once at startup by `init_tensor_parallel` and passed to the layers that
split (never read from a global). With one rank every collective is the identity, so the plain path
costs one attribute test. On CUDA the group is NCCL, whose all-reduce and all-gather are recorded
into CUDA graphs like any kernel: every rank captures the same graphs in the same order, so the
replays meet in the same collectives. On CPU (tests, CI) it is gloo.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tgi_compat.modeling.parallel.symmetric_all_reduce import SymmetricAllReduce, make_symmetric_all_reduce

if TYPE_CHECKING:
    from tgi_compat.kernels.comm.one_shot_all_reduce import PushTarget
    from tgi_compat.modeling.layers.norm import RMSNorm

logger = logging.getLogger(__name__)

# torch >= 2.12 renamed all_gather_into_tensor (output: the inputs of every rank stacked along dim 0)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")  # where this rank's tensors (and collective buffers) live
    symmetric: SymmetricAllReduce | None = None  # the small sums' fast path on CUDA (None: NCCL/gloo)
    host_group: dist.ProcessGroup | None = None  # gloo over the same ranks, for host tensors (None: the default group)

    @property
    def is_sharded(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (row-parallel partial sums -> the full output)."""
        if self.size > 1:
            if self.symmetric is not None and self.symmetric.fits(x):
                self.symmetric.all_reduce_(x)
            else:
                dist.all_reduce(x)
        return x

    def all_reduce_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(norm(sum of x over the ranks + residual), that sum + residual) in one kernel; None where the one-trip
        all-reduce does not take it (the caller sums, then norms)."""
        if self.size == 1 or self.symmetric is None:
            return None
        return self.symmetric.all_reduce_rms_norm(x, residual, norm.weight, norm.eps)

    def push_target(self, numel: int, dtype: torch.dtype) -> PushTarget | None:
        """Where a row-parallel projection's kernel may send its partial sum (`numel` elements) to the other
        ranks itself, then `finish_pushed_all_reduce`; None: the projection is followed by `all_reduce`."""
        if self.size == 1 or self.symmetric is None:
            return None
        return self.symmetric.push_target(numel, dtype)

    def finish_pushed_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """`all_reduce` of x, whose kernel sent it to the other ranks (`push_target`)."""
        assert self.symmetric is not None
        self.symmetric.finish_pushed_(x)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[R, n] on every rank -> [R, size * n]: rank r's columns at r * n (vocab-parallel logits)."""
        if self.size == 1:
            return x
        if self.symmetric is not None and (gathered := self.symmetric.all_gather_columns(x)) is not None:
            return gathered
        rows, cols = x.shape
        stacked = torch.empty(self.size * rows, cols, dtype=x.dtype, device=x.device)
        _all_gather_single(stacked, x.contiguous())
        return stacked.view(self.size, rows, cols).transpose(0, 1).reshape(rows, self.size * cols)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (KV pool size: the rank with least free memory decides)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's tensor into every rank's tensor of the same shape (on this rank's device)."""
        if self.size > 1:
            dist.broadcast(tensor, src=0)

    def broadcast_host(self, tensor: torch.Tensor) -> None:
        """The same for a tensor in host memory: it reaches the host without waiting for any GPU work."""
        if self.size > 1:
            dist.broadcast(tensor, src=0, group=self.host_group)


NO_TP = TensorParallel()


def init_tensor_parallel(
    rank: int, size: int, master_addr: str, master_port: int, device: torch.device, timeout_s: float = 600.0
) -> TensorParallel:
    """Join the group of `size` ranks at master_addr:master_port (rank 0 hosts the store).

    NCCL on CUDA (each rank on its own device), gloo elsewhere. The timeout bounds a collective that
    a hung peer never joins; rank death is noticed sooner, by whoever watches the processes.
    """
    if size == 1:
        return TensorParallel(device=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,  # None: the default, no eager NCCL init
    )
    logger.info("tensor-parallel rank %d of %d joined (%s, %s)", rank, size, backend, device)
    host_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    return TensorParallel(rank, size, device, make_symmetric_all_reduce(device), host_group)


def destroy_tensor_parallel(tp: TensorParallel) -> None:
    if tp.is_sharded and dist.is_initialized():
        dist.destroy_process_group()
