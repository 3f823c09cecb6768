"""A projection widened by LoRA's folded A keeps its base shape's tuned config (tgi_compat/kernels/widening.py)."""

from __future__ import annotations

from tgi_compat.kernels.gemv.config import gemv_config, rule_of_thumb_config
from tgi_compat.kernels.gemv.tuned import TUNED, TUNED_ROW_SCALED
from tgi_compat.kernels.gemv.types import PROLOGUE_RMSNORM, WEIGHT_ROW_SCALED
from tgi_compat.kernels.quant.fp8_gemm import TUNED as FP8_TUNED
from tgi_compat.kernels.quant.fp8_gemm import fp8_gemm_config
from tgi_compat.kernels.widening import tuned_for


def test_a_widened_shape_takes_the_widest_tuned_n_it_widens():
    table = {(16, 4096): "a", (16, 4352): "b", (32, 4096): "c", (16, 8192): "d"}
    assert tuned_for(table, (16, 4096), n_index=1) == (True, "a")  # its own
    assert tuned_for(table, (16, 4224), n_index=1) == (True, "a")
    assert tuned_for(table, (16, 4480), n_index=1) == (True, "b")  # the widest it widens, not the first
    assert tuned_for(table, (16, 5000), n_index=1) == (False, None)  # wider than 12.5% of any
    assert tuned_for(table, (16, 4000), n_index=1) == (False, None)  # narrower: never
    assert tuned_for(table, (64, 4224), n_index=1) == (False, None)  # other fields differ


def test_llama3_8b_fp8_projections_folded_for_8_slots_of_rank_16_keep_their_gemv_and_gemm_configs():
    extra = {6144: 8 * 3 * 16, 4096: 8 * 16, 28672: 8 * 2 * 16}  # q|k|v, o and down, gate|up
    for n, k, prologue in TUNED_ROW_SCALED:
        assert gemv_config(n + extra[n], k, prologue, WEIGHT_ROW_SCALED) == TUNED_ROW_SCALED[(n, k, prologue)]
    for rows, n, k in FP8_TUNED:
        assert fp8_gemm_config(rows, n + extra[n], k) == FP8_TUNED[(rows, n, k)]
        assert fp8_gemm_config(rows - 1, n + extra[n], k) == FP8_TUNED[(rows, n, k)]  # (rows round up to a bucket)
    # a dense shape does not (measured slower): the rule of thumb
    widened = gemv_config(6144 + 384, 4096, PROLOGUE_RMSNORM)
    assert widened == rule_of_thumb_config(4096, PROLOGUE_RMSNORM) != TUNED[(6144, 4096, PROLOGUE_RMSNORM)]
