"""The few-row GEMV's inputs as the model feeds them, shared by the GEMV benchmarks (quant, tune_gemv).

A GemvCase holds one K's activations for every prologue the model fuses into a projection; weights come in
enough copies (> 4x L2) that each call reads HBM, as each layer's weights are read once in a real step.
"""

from __future__ import annotations

import torch

from tgi_compat.kernels.gemv.gemv import gemv, gemv_ref
from tgi_compat.kernels.gemv.types import (
    PROLOGUE_NONE,
    PROLOGUE_NORM_ADD_NORM,
    PROLOGUE_RMSNORM,
    PROLOGUE_SILU_MUL,
    GemvConfig,
    QuantizedWeight,
)
from tgi_compat.kernels.quant.int4_layout import pack_int4

GROUP = 128  # int4 weights' group size
MAX_ROWS = 8
COPY_BYTES = 200_000_000  # weight copies a timing cycles through: > 4x an H100's or H200's L2
# the prologue the model fuses into each projection at decode (Gemma's q|k|v and gate|up: norm-add-norm)
PROLOGUES = {"qkv": PROLOGUE_RMSNORM, "o": PROLOGUE_NONE, "gate_up": PROLOGUE_RMSNORM, "down": PROLOGUE_SILU_MUL}
PROLOGUE_NAMES = {
    PROLOGUE_NONE: "plain",
    PROLOGUE_RMSNORM: "rmsnorm+residual",
    PROLOGUE_SILU_MUL: "silu_mul",
    PROLOGUE_NORM_ADD_NORM: "norm_add_norm",
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error; inf where the output is not finite."""
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_weight(fmt: str, n: int, k: int, device: str = "cuda") -> torch.Tensor | QuantizedWeight:
    """Random [n, k] weights in one format: bf16, fp8 or int8 (a scale a row), int4 (groups of GROUP)."""
    if fmt == "bf16":
        return torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
    if fmt == "int4":
        scale = torch.rand(n, k // GROUP, device=device, dtype=torch.bfloat16) / 100
        zero = torch.randint(0, 16, scale.shape, device=device).to(torch.bfloat16)
        return QuantizedWeight(pack_int4(torch.randint(0, 16, (n, k), device=device), GROUP), scale, zero, GROUP)
    scale = torch.rand(n, device=device) / 100
    if fmt == "fp8":
        return QuantizedWeight(torch.randn(n, k, device=device).to(torch.float8_e4m3fn), scale)
    return QuantizedWeight(torch.randint(-128, 128, (n, k), device=device, dtype=torch.int8), scale)


def weight_bytes(w: torch.Tensor | QuantizedWeight) -> int:
    tensors = [w] if isinstance(w, torch.Tensor) else [t for t in (w.data, w.scale, w.zero) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def weight_copies(fmt: str, n: int, k: int) -> list[torch.Tensor | QuantizedWeight]:
    first = make_weight(fmt, n, k)
    return [first] + [make_weight(fmt, n, k) for _ in range(max(1, -(-COPY_BYTES // weight_bytes(first))) - 1)]


class GemvCase:
    """Inputs of one K for every prologue and row count (up to MAX_ROWS)."""

    def __init__(self, k: int, device: str = "cuda"):
        self.x = torch.randn(MAX_ROWS, 2 * k, device=device, dtype=torch.bfloat16)
        self.residual = torch.randn(MAX_ROWS, k, device=device, dtype=torch.bfloat16)
        self.summed = torch.empty_like(self.residual)
        self.norm_weight = 1 + 0.1 * torch.randn(k, device=device, dtype=torch.bfloat16)
        self.k = k

    def args(self, prologue: int, rows: int) -> tuple[torch.Tensor, dict]:
        if prologue == PROLOGUE_SILU_MUL:
            return self.x[:rows], {"silu_mul": True}
        x = self.x[:rows, : self.k]
        if prologue == PROLOGUE_NONE:
            return x, {}
        kwargs = dict(norm_weight=self.norm_weight, eps=1e-5, residual=self.residual[:rows])
        if prologue == PROLOGUE_NORM_ADD_NORM:
            kwargs |= dict(x_norm_weight=self.norm_weight.flip(0), x_eps=1e-6)
        return x, kwargs | {"residual_out": self.summed[:rows]}

    def run(self, w, prologue: int, rows: int = 1, config: GemvConfig | None = None) -> torch.Tensor:
        x, kwargs = self.args(prologue, rows)
        return gemv(x, w, config=config, **kwargs)

    def ref(self, w, prologue: int, rows: int = 1) -> torch.Tensor:
        x, kwargs = self.args(prologue, rows)
        kwargs.pop("residual_out", None)
        return gemv_ref(x, w, **kwargs)[0]
