"""A one-shot all-reduce through peer GPU memory, for the small sums of decode steps.

A decode step of a sharded Llama makes two all-reduces per layer of a few rows each: at batch 1 the
whole step is ~64 sums of 8 KiB, where NCCL's per-call latency, not bandwidth, is the cost. Here every
rank's partial sum goes into a buffer that all ranks have mapped (PyTorch's symmetric memory, NVLink
peer access), and one kernel per rank adds every rank's copy. Sums past `default_max_bytes` (long prefill
chunks) stay on NCCL. Two kernels do it (`TGI_SYMMETRIC_ALL_REDUCE`):

    triton  tgi_compat/kernels/comm/one_shot_all_reduce.py: each rank stores its values into its peers' buffers, whose
            elements say themselves that they have arrived: one one-way trip a sum; bf16/fp16; the default
    torch   torch.ops.symm_mem.one_shot_all_reduce_copy_out: a handshake before reading the peers' copies
            across NVLink and one after; fp32 too
    0       neither: NCCL for every sum

Measured (BENCHMARKS.md): at 4 ranks (H200s, 2026-11-28, every peer's slots received at once) the triton kernel
takes 2.6 us for 8 KiB against torch's 7.3 (NCCL 21.5); at 2 ranks (H100s, 2026-11-28) 2.1 us (torch 9.1, NCCL
14.0). With the GEMVs pushing their sums, Llama-3-8B's batch-1 step at 2 shards is 0.578x of one H100's (0.60x on
H200s) and Llama-3-70B's at 4 shards 85% of its memory roofline on H100s, 80.3% on H200s; up to 8 MiB at 2 ranks,
256 streams at 2 H200s give 1.60x one GPU's throughput (1.34x with NCCL for their 2 MiB sums).

Only the peer-to-peer operations are used, never NVLink multicast (`multimem_*`). The kernels are
recorded into CUDA graphs like any other; every rank replays the same ones in the same order.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from tgi_compat.kernels.comm.one_shot_all_reduce import PushTarget

logger = logging.getLogger(__name__)


def default_max_bytes(world_size: int) -> int:
    """The largest sum (and gather) the one-trip kernel takes; larger ones go to NCCL.

    Each rank sends its whole part to every peer: at 2 ranks that is the data once, and the kernel beat NCCL at
    every size measured up to 8 MiB (the 64-row logits gather, 256-row sums, prefill chunks of 1,024 tokens). With
    more ranks each byte crosses NVLink once a peer, so NCCL's ring catches up sooner: 1 MiB, as measured at 4."""
    return 8 << 20 if world_size == 2 else 1 << 20


KERNEL_ENV = "TGI_SYMMETRIC_ALL_REDUCE"
KERNELS = ("triton", "torch")
DEFAULT_KERNEL = "triton"  # the faster at 2 and at 4 ranks, the counts measured


class SymmetricAllReduce:
    """Made once per process, by every rank at the same moment (the buffers' rendezvous is collective)."""

    def __init__(self, device: torch.device, kernel: str, max_bytes: int | None = None) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        # imported here, on CUDA only: importing Triton kernels from tgi_compat/modeling/ at import time would decorate
        # them before the CPU tests turn Triton's interpreter on
        from tgi_compat.kernels.comm.one_shot_all_reduce import (
            DTYPES,
            MAX_PROGRAMS,
            SENTINEL,
            PushTarget,
            fuses_rmsnorm,
            one_shot_all_gather,
            one_shot_all_reduce_,
            one_shot_all_reduce_rmsnorm,
        )

        assert kernel in KERNELS, kernel
        self._one_shot_all_reduce_ = one_shot_all_reduce_
        self._one_shot_all_gather = one_shot_all_gather
        self._fuses_rmsnorm = fuses_rmsnorm
        self._one_shot_all_reduce_rmsnorm = one_shot_all_reduce_rmsnorm
        self.kernel = kernel
        self.dtypes = DTYPES if kernel == "triton" else (*DTYPES, torch.float32)
        self.group_name = dist.group.WORLD.group_name  # type: ignore[union-attr]
        self.rank = dist.get_rank()
        world_size = dist.get_world_size()
        self.max_bytes = max_bytes or default_max_bytes(world_size)
        # the triton kernel's [2 halves, ranks, max_bytes] (torch's stages in the front), SENTINEL between sums
        self.buffer = symm_mem.empty(2 * world_size * self.max_bytes, dtype=torch.uint8, device=device)
        self.buffer.view(torch.int16).fill_(SENTINEL)
        buffer_handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self.buffer_ptrs = torch.tensor(buffer_handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.halves = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device)
        self._push_target = PushTarget(self.buffer_ptrs, self.halves, self.max_bytes // 2, self.rank)
        torch.cuda.synchronize(device)
        dist.barrier()  # every rank's buffer holds SENTINEL before any rank sends

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype in self.dtypes and x.numel() * x.element_size() <= self.max_bytes and x.is_contiguous()

    def push_target(self, numel: int, dtype: torch.dtype) -> PushTarget | None:
        """Where the kernel that computes this rank's part of a sum of `numel` elements may send it to the peers
        itself (then `finish_pushed_`); None: the sum takes `all_reduce_`."""
        if self.kernel != "triton" or dtype not in self.dtypes or numel * 2 > self.max_bytes:
            return None
        return self._push_target

    def finish_pushed_(self, x: torch.Tensor) -> None:
        """The sum over the ranks of x, whose kernel sent it to the peers (`push_target`), in place."""
        self._one_shot_all_reduce_(
            x.view(-1), self.buffer_ptrs, self.halves, self._push_target.capacity, self.rank, True
        )

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """[R, n] of every rank -> [R, ranks * n] (rank r's columns at r * n) in the all-reduce's one trip; None
        where it does not apply (the caller gathers through NCCL)."""
        if self.kernel != "triton" or not self.fits(x):  # (the triton kernel's dtypes are 16-bit only)
            return None
        capacity = self.max_bytes // x.element_size()
        return self._one_shot_all_gather(x, self.buffer_ptrs, self.halves, capacity, self.rank)

    def all_reduce_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rmsnorm(sum of x over the ranks + residual) * weight, that sum + residual) in the all-reduce's one
        trip; None where it does not apply (the caller all-reduces, then norms)."""
        if self.kernel != "triton" or not self.fits(x) or x.dim() != 2 or not self._fuses_rmsnorm(x.shape[1]):
            return None
        capacity = self.max_bytes // x.element_size()
        return self._one_shot_all_reduce_rmsnorm(
            x, residual.contiguous(), weight, eps, self.buffer_ptrs, self.halves, capacity, self.rank
        )

    def all_reduce_(self, x: torch.Tensor) -> None:
        flat = x.view(-1)
        if self.kernel == "triton":
            capacity = self.max_bytes // x.element_size()
            self._one_shot_all_reduce_(flat, self.buffer_ptrs, self.halves, capacity, self.rank)
        else:  # the kernel copies each thread's elements into the buffer before it reads them back: in place is safe
            staged = self.buffer.view(x.dtype)[: x.numel()]
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum", self.group_name, flat)


def make_symmetric_all_reduce(device: torch.device) -> SymmetricAllReduce | None:
    """The fast path when this host allows it (CUDA, peer access, not turned off), else None: NCCL."""
    kernel = os.environ.get(KERNEL_ENV, "1")
    if device.type != "cuda" or kernel == "0":
        return None
    if kernel not in KERNELS:  # "1" or unset
        kernel = DEFAULT_KERNEL
    try:
        return SymmetricAllReduce(device, kernel)
    except Exception as exc:  # no peer access, no symmetric-memory backend: NCCL serves every sum
        logger.warning("symmetric-memory all-reduce unavailable (%s); using NCCL for every all-reduce", exc)
        return None
