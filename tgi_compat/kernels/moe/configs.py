"""Tilings of the fused-experts kernels (tgi_compat/kernels/moe/fused_moe.py), apart so that the generated table of
measured ones (tgi_compat/kernels/moe/tuned.py) can import them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchConfig:
    """One kernel launch's tiling. Grouped GEMM: BLOCK_N x BLOCK_K weight tiles, GROUP_M tiles of
    rows walked before the next column block (weight reuse in L2 vs activation reuse). GEMV: BLOCK_N
    output columns per program, BLOCK_K elements of the reduction per step."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 1


@dataclass(frozen=True)
class MoeConfig:
    """block_m: rows per tile of the sorted pairs (16, 32 or 64), or 0 for the GEMV path."""

    block_m: int
    up: LaunchConfig
    down: LaunchConfig
