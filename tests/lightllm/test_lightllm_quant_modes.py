"""LightLLM's weight-quantization --mode values choose the engine's quantization scheme."""

from __future__ import annotations

import pytest

from tgi_compat.api.cli.lightllm_args import LightLLMArgsError, parse_config


@pytest.mark.parametrize(
    "mode, scheme",
    [("triton_w8a16", "weight_only_int8"), ("triton_w8a8", "w8a8_int8"), ("triton_fp8w8a8", "fp8"),
     ("triton_w4a16", "w4a16_int4")],
)  # fmt: skip
def test_quant_modes_choose_the_scheme(mode: str, scheme: str):
    config, unbuilt, _ = parse_config(["--mode", "triton_gqa_flashdecoding", mode], {})
    assert config.quantize == scheme and config.to_engine_config().quantize == scheme
    assert unbuilt == [] and config.attention_backend == "triton"


def test_a_quant_mode_agreeing_with_quantize_is_fine_and_conflicts_are_refused():
    assert parse_config(["--mode", "triton_fp8w8a8", "--quantize", "fp8"], {})[0].quantize == "fp8"
    with pytest.raises(LightLLMArgsError, match="--mode triton_w8a16 conflicts with --quantize fp8"):
        parse_config(["--mode", "triton_w8a16", "--quantize", "fp8"], {})
    with pytest.raises(LightLLMArgsError, match="several weight quantizations"):
        parse_config(["--mode", "triton_w8a16", "triton_w4a16"], {})


def test_fp8kv_mode_chooses_the_fp8_kv_cache():
    config, unbuilt, _ = parse_config(["--mode", "triton_fp8kv"], {})
    assert config.to_engine_config().kv_cache_dtype == "fp8_e4m3fn" and unbuilt == []
