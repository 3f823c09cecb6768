"""Weights pulled into L2 while a kernel waits for the one before it (Hopper, under PDL).

A sharded decode step alternates bandwidth-bound GEMVs with latency-bound kernels: a cross-GPU all-reduce
(~6 us) after o and down, decode attention over a short context before o. HBM idles through those. A GEMV
launched as a programmatic dependent (kernels/pdl.py) is resident before its input exists, so while it
waits its first programs ask L2 for their weight rows: the first `L2_PREFETCH_BYTES` of the weight are
read during the idle time, and the GEMV's own loads then hit L2. The cap stays well under the L2 (50 MB
on H100 and H200), so the lines are still there when the GEMV reads them; the programs that own those rows
are the first to be scheduled.

TGI_L2_PREFETCH_MB sets the cap (0: off).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

L2_PREFETCH_BYTES = int(float(os.environ.get("TGI_L2_PREFETCH_MB", "16")) * 2**20)


def prefetching_programs(row_bytes: int, rows_per_program: int) -> int:
    """How many programs (the first ones) prefetch their rows: those owning the first L2_PREFETCH_BYTES."""
    return L2_PREFETCH_BYTES // (row_bytes * rows_per_program)


def lines_per_step(rows_per_program: int, num_warps: int) -> int:
    """Lines a row each step of `prefetch_rows_to_l2`, so that every thread asks for one line a step."""
    return max(1, 32 * num_warps // rows_per_program)


@triton.jit
def prefetch_rows_to_l2(w_ptr, rows, stride_wn, K, LINES: tl.constexpr):
    """Asks L2 for the K elements of each of w's `rows` ([R] row indices), one 128-byte line a thread a step.
    A hint with no result: nothing waits for it. Compiled only for the GPU (inline PTX)."""
    ELEMS_PER_LINE: tl.constexpr = 8 * 128 // w_ptr.dtype.element_ty.primitive_bitwidth
    offs = tl.arange(0, LINES) * ELEMS_PER_LINE
    for k0 in range(0, K, LINES * ELEMS_PER_LINE):
        cols = k0 + offs
        ptrs = w_ptr + rows[:, None] * stride_wn + tl.where(cols < K, cols, 0)[None, :]
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.b32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )
