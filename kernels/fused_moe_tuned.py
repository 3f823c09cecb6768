"""Fused-MoE block sizes measured by scripts/device/tune_fused_moe.py; generated, do not edit by hand."""

from kernels.fused_moe_configs import LaunchConfig, MoeConfig  # noqa: F401 (the entries use both)

# Key: (experts, intermediate size, hidden size, token bucket). Empty until the tuner's first GPU run:
# every shape takes kernels.fused_moe.default_moe_config.
TUNED: dict[tuple[int, int, int, int], MoeConfig] = {}
