"""Quantized matmuls outside the GEMV: the row-scaled FP8 GEMM, the int8/int4 dequantizing matmul (and the int4
layout), and per-token activation quantization."""
