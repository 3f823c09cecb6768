"""A one-shot all-reduce through peer GPU memory, for the small sums of decode steps.

A decode step of a sharded Llama makes two all-reduces per layer of a few rows each: at batch 1 the
whole step is ~64 sums of 8 KiB, where NCCL's per-call latency, not bandwidth, is the cost. Here every
rank copies its partial sum into a buffer that all ranks have mapped (PyTorch's symmetric memory,
NVLink peer access), and one kernel per rank reads every peer's copy and adds them: one launch and
one barrier instead of NCCL's protocol. Large sums (prefill) stay on NCCL, which is faster there.

Only the peer-to-peer operations are used, never NVLink multicast (`multimem_*`). The kernels are
recorded into CUDA graphs like any other; every rank replays the same ones in the same order.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# One-shot reads every peer's whole buffer: fastest for small sums, NCCL wins past ~1 MiB.
DEFAULT_MAX_BYTES = 1 << 20
DISABLE_ENV = "TGI_SYMMETRIC_ALL_REDUCE"  # "0" turns it off (NCCL for every sum)


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class SymmetricAllReduce:
    """Made once per process, by every rank at the same moment (the buffer's rendezvous is collective)."""

    def __init__(self, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name  # type: ignore[union-attr]
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)  # viewed as each sum's dtype
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype in _DTYPES and x.numel() * x.element_size() <= self.max_bytes and x.is_contiguous()

    def all_reduce_(self, x: torch.Tensor) -> None:
        staged = self.buffer.view(x.dtype)[: x.numel()]
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, x.view(-1))


def make_symmetric_all_reduce(device: torch.device) -> SymmetricAllReduce | None:
    """The fast path when this host allows it (CUDA, peer access, not turned off), else None: NCCL."""
    if device.type != "cuda" or os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    try:
        return SymmetricAllReduce(device)
    except Exception as exc:  # no peer access, no symmetric-memory backend: NCCL serves every sum
        logger.warning("symmetric-memory all-reduce unavailable (%s); using NCCL for every all-reduce", exc)
        return None
