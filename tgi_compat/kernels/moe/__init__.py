"""The fused mixture-of-experts MLP: routing, the expert sort, the grouped GEMM and the few-token GEMV path."""
