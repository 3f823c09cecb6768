"""Warm the L2 cache with a tensor's first bytes ahead of the kernel that reads them (Hopper and newer).

Under tensor parallelism a decode step's all-reduces leave HBM idle for a few microseconds, and the GEMM after
each reads its weight from HBM. Launched on a side stream beside the all-reduce, this kernel has the TMA unit pull
the start of that weight into L2: one thread a 16 KiB chunk (`cp.async.bulk.prefetch.L2`), no registers or
shared memory held, nothing written, so it takes almost no SM time from the all-reduce. The lines are tagged
`evict_last`, so that the GEMM finds them even when other traffic passes through L2 meanwhile.

The instruction has no counterpart in Triton's interpreter: the CPU tests compile the kernel for sm_90 and check
its instructions, the GPU tests run it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CHUNK_BYTES = 16384  # one request; the instruction wants a multiple of 16
CHUNKS_PER_PROGRAM = 32  # one warp a program, one chunk a thread


@functools.cache  # asked at every sharded all-reduce of an eager step
def supports_l2_prefetch(device: torch.device) -> bool:
    """The bulk prefetch is sm_90's (TMA); on other devices `l2_prefetch` must not be called."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def _l2_prefetch_kernel(base_ptr, num_bytes, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    starts = (tl.program_id(0).to(tl.int64) * CHUNKS + tl.arange(0, CHUNKS)) * CHUNK
    # the last chunk stops at the tensor's end; chunks past it ask for 0 bytes, which the predicate skips
    sizes = tl.minimum(tl.maximum(num_bytes - starts, 0), CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        """{
        .reg .pred p; .reg .b64 policy;
        setp.ne.u32 p, $2, 0;
        createpolicy.fractional.L2::evict_last.b64 policy, 1.0;
        @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, policy;
        mov.u32 $0, 0;
        }""",
        "=r,l,r",
        [base_ptr + starts, sizes],
        dtype=tl.int32,
        is_pure=False,  # kept although its result is unused
        pack=1,
    )


def l2_prefetch(tensor: torch.Tensor, num_bytes: int) -> None:
    """Queue a prefetch of the first `num_bytes` of contiguous `tensor` (all of it if smaller) into L2 on the
    current stream; the kernel returns once the requests are issued, not when the bytes have arrived."""
    assert tensor.is_contiguous() and tensor.data_ptr() % 16 == 0
    num_bytes = min(num_bytes, tensor.numel() * tensor.element_size()) // 16 * 16  # whole 16-byte units only
    if num_bytes <= 0:
        return
    grid = (triton.cdiv(triton.cdiv(num_bytes, CHUNK_BYTES), CHUNKS_PER_PROGRAM),)
    _l2_prefetch_kernel[grid](
        tensor.view(-1).view(torch.int8), num_bytes, CHUNK=CHUNK_BYTES, CHUNKS=CHUNKS_PER_PROGRAM, num_warps=1
    )
