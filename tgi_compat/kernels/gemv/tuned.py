"""Measured GEMV configs, keyed by shape (the sweeps that found them print these literals)."""

from __future__ import annotations

from tgi_compat.kernels.gemv.types import PROLOGUE_NONE, PROLOGUE_RMSNORM, PROLOGUE_SILU_MUL, GemvConfig

# Best configs from scripts/device/tune_gemv.py on an H200, bf16, for the projections of Llama-3-8B
# and Qwen2-7B (key: N, K, prologue). None: the unfused pair (cuBLAS) was faster for that shape.
TUNED: dict[tuple[int, int, int], GemvConfig | None] = {
    (6144, 4096, PROLOGUE_RMSNORM): GemvConfig(16, 512, 4, 2),
    (4096, 4096, PROLOGUE_NONE): GemvConfig(4, 1024, 4, 1),
    (28672, 4096, PROLOGUE_RMSNORM): GemvConfig(8, 1024, 4, 1),
    (4096, 14336, PROLOGUE_SILU_MUL): GemvConfig(4, 1024, 4, 1),
    (128256, 4096, PROLOGUE_NONE): GemvConfig(2, 1024, 4, 1),
    (4608, 3584, PROLOGUE_RMSNORM): GemvConfig(4, 512, 4, 2),
    (3584, 3584, PROLOGUE_NONE): GemvConfig(4, 128, 8, 2),
    (37888, 3584, PROLOGUE_RMSNORM): GemvConfig(8, 512, 4, 4),
    (3584, 18944, PROLOGUE_SILU_MUL): None,
}

# Best 1-byte (FP8 / int8) configs at one row from scripts/device/bench_quant.py's sweep (key: N, K, prologue):
# Llama-3-8B's shapes, H100, 2026-11-24 (BENCHMARKS.md, "Quantization, third pass"); the sweep prints this literal.
TUNED_ROW_SCALED: dict[tuple[int, int, int], GemvConfig] = {
    (6144, 4096, PROLOGUE_RMSNORM): GemvConfig(block_n=16, num_stages=1),
    (4096, 4096, PROLOGUE_NONE): GemvConfig(block_k=1024, num_stages=1),
    (28672, 4096, PROLOGUE_RMSNORM): GemvConfig(block_k=1024, num_stages=1),
    (4096, 14336, PROLOGUE_SILU_MUL): GemvConfig(block_k=1024, num_stages=1),
}

# Best int4 configs (groups of 128) from scripts/device/bench_quant.py's sweeps, keyed (N, K, prologue, rows of x
# padded to a power of two): Llama-3-8B's shapes. The one-row entries run tgi_compat/kernels/gemv/int4_one_row.py's
# dp4a kernel (`--parts int4_one_row`, H100, 2026-11-28, thirteenth session: q|k|v 8.7 us and gate|up 26.0 with their
# RMSNorms as their own kernels, o 5.8, down 16.7 split 14 ways; the fastest in the decode step too, against 8 other
# mixes); the 8-row entry is the tile kernel's (`--parts int4`, H100, 2026-11-24). The sweeps print these.
TUNED_INT4: dict[tuple[int, int, int, int], GemvConfig] = {
    (6144, 4096, PROLOGUE_RMSNORM, 1): GemvConfig(
        block_n=32, block_k=4096, num_stages=1, separate_prologue=True, one_row=True
    ),
    (4096, 4096, PROLOGUE_NONE, 1): GemvConfig(block_n=8, block_k=4096, num_stages=1, one_row=True),
    (28672, 4096, PROLOGUE_RMSNORM, 1): GemvConfig(
        block_n=8, block_k=4096, num_stages=1, separate_prologue=True, one_row=True
    ),
    (4096, 14336, PROLOGUE_SILU_MUL, 1): GemvConfig(
        block_n=32, block_k=1024, num_warps=1, num_stages=1, split_k=14, one_row=True
    ),
    (6144, 4096, PROLOGUE_RMSNORM, 8): GemvConfig(num_stages=1),
}
