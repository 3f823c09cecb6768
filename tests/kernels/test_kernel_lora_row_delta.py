"""The norm kernels add a folded projection's LoRA term to their input first (tgi_compat/kernels/lora/row_delta.py):
RMSNorm with the residual add, and RMSNorm + per-token FP8 quantization, over x = full[:, :N] of a folded output,
against the same kernels on RowDelta.reference() (x with each LoRA row's shrunk[slot] @ B[slot]^T added); base rows
unchanged; ranks that do not fill the tile; under the interpreter."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.kernels.elementwise.rmsnorm import rmsnorm
from tgi_compat.kernels.lora.row_delta import RowDelta
from tgi_compat.kernels.quant.per_token import rmsnorm_quant_per_token

N, SLOTS = 96, 3


def row_delta(rank: int, slots: list[int], seed: int = 0) -> RowDelta:
    torch.manual_seed(seed)
    full = torch.randn(len(slots), N + SLOTS * rank)
    return RowDelta(full, torch.tensor(slots), torch.randn(SLOTS, N, rank) / rank)


@pytest.mark.parametrize("rank", [4, 6, 16])  # 6: a partial pass of the rank loop
def test_rmsnorm_adds_the_row_delta_before_the_residual(rank):
    delta = row_delta(rank, [2, -1, 0, 2, 1])
    x = delta.full[:, :N]
    weight, residual = torch.rand(N) + 0.5, torch.randn(len(delta.token_slots), N)
    summed, expected_sum = torch.empty_like(residual), torch.empty_like(residual)
    out = rmsnorm(x, weight, 1e-6, residual=residual, residual_out=summed, row_delta=delta)
    expected = rmsnorm(delta.reference(), weight, 1e-6, residual=residual, residual_out=expected_sum)
    torch.testing.assert_close(summed, expected_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    plain = rmsnorm(x.contiguous(), weight, 1e-6, residual=residual, residual_out=torch.empty_like(residual))
    assert torch.equal(out[1], plain[1])  # the base row: as without LoRA
    assert not torch.allclose(out[0], plain[0])  # a LoRA row: its term added


def test_rmsnorm_quant_adds_the_row_delta_before_the_residual():
    delta = row_delta(16, [1, 1, -1, 0])
    x = delta.full[:, :N]
    weight, residual = torch.rand(N) + 0.5, torch.randn(4, N)
    summed, expected_sum = torch.empty_like(residual), torch.empty_like(residual)
    q, scale = rmsnorm_quant_per_token(
        x, weight, 1e-6, torch.float8_e4m3fn, residual=residual, residual_out=summed, row_delta=delta
    )
    q_ref, scale_ref = rmsnorm_quant_per_token(
        delta.reference(), weight, 1e-6, torch.float8_e4m3fn, residual=residual, residual_out=expected_sum
    )
    torch.testing.assert_close(summed, expected_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q.float() * scale, q_ref.float() * scale_ref, rtol=0.07, atol=1e-3)  # (an e4m3 step)
