"""Fused-MoE block sizes measured by benchmarks/device/tune_fused_moe.py; generated, do not edit by hand."""

from tgi_compat.kernels.moe.configs import LaunchConfig, MoeConfig

# NVIDIA H100 80GB HBM3, bf16 (8, 14336, 4096). Key: (experts, intermediate size, hidden size, token bucket).
TUNED: dict[tuple[int, int, int, int], MoeConfig] = {
    (8, 14336, 4096, 1): MoeConfig(
        0,
        LaunchConfig(block_n=2, block_k=512, num_warps=4, num_stages=2, group_m=1),
        LaunchConfig(block_n=2, block_k=1024, num_warps=4, num_stages=1, group_m=1),
    ),
    (8, 14336, 4096, 64): MoeConfig(
        32,
        LaunchConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, group_m=1),
        LaunchConfig(block_n=128, block_k=128, num_warps=4, num_stages=3, group_m=1),
    ),
}
