"""Phi-3 / Phi-4 against transformers on tiny random configs (fused qkv and gate_up in the
checkpoint), with plain rope and with LongRoPE (short factors inside the original context)."""

from __future__ import annotations

import pytest
import torch
from transformers import Phi3Config

from tests.modeling.helpers import full_logits, hf_logits, max_rel_error, runner_for_folder, tiny_hf_model
from tgi_compat.modeling.config import ModelConfig, RopeScaling
from tgi_compat.modeling.layers.rotary import build_cos_sin

HALF_DIM = 8  # head_dim 16
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(HALF_DIM)],
    "long_factor": [2.0 + 0.5 * i for i in range(HALF_DIM)],
    "rope_theta": 10000.0,
}
CASES = {
    "phi3": {},
    "phi3-longrope": {"rope_parameters": LONGROPE, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    model = tiny_hf_model(Phi3Config, pad_token_id=0, **CASES[case])
    model.save_pretrained(tmp_path)
    assert any("qkv_proj" in name for name in model.state_dict())  # the checkpoint holds fused tensors
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    assert max_rel_error(full_logits(runner_for_folder(str(tmp_path)), ids), hf_logits(model, ids)) <= 1e-4


def test_longrope_tables_switch_to_long_factors_past_the_original_context():
    config = ModelConfig.from_hf_dict(
        tiny_hf_model(Phi3Config, pad_token_id=0, **CASES["phi3-longrope"]).config.to_dict()
        | {"architectures": ["Phi3ForCausalLM"]}
    )
    scaling = config.rope_scaling
    assert scaling.rope_type == "longrope" and scaling.original_max_position_embeddings == 64
    assert scaling.factor == 512 / 64
    cos, sin = build_cos_sin(16, 10000.0, scaling, 512)
    attention_factor = (1 + torch.log(torch.tensor(8.0)) / torch.log(torch.tensor(64.0))).sqrt()
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    for position, factors in ((10, LONGROPE["short_factor"]), (100, LONGROPE["long_factor"])):
        angles = position * inv_freq / torch.tensor(factors)
        torch.testing.assert_close(cos[position], angles.cos() * attention_factor)
        torch.testing.assert_close(sin[position], angles.sin() * attention_factor)
    assert RopeScaling.from_dict({"type": "su", "short_factor": [1.0], "long_factor": [1.0]}).rope_type == "longrope"
