"""Mixtral, Qwen2-MoE (shared expert, a dense layer) and Qwen3-MoE (q/k norm, renormalised top-k)
against transformers on tiny random configs, through the safetensors path (per-expert tensors, as
on the hub) and through transformers 5's in-memory stacked-expert state dict."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from tests.modeling.helpers import full_logits, hf_logits, max_rel_error, runner_for_folder, tiny_hf_model
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

EXPERTS = {"num_experts_per_tok": 2}
CASES = {
    "mixtral": (MixtralConfig, {**EXPERTS, "num_local_experts": 4}),
    "qwen2-moe": (
        Qwen2MoeConfig,
        {
            **EXPERTS,
            "num_experts": 6,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 96,
            "num_hidden_layers": 3,
            "mlp_only_layers": [1],
        },
    ),
    "qwen3-moe": (
        Qwen3MoeConfig,
        {**EXPERTS, "num_experts": 8, "moe_intermediate_size": 48, "norm_topk_prob": True, "head_dim": 32},
    ),
}


def prompt(vocab_size: int) -> list[int]:
    return torch.randint(0, vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    config_cls, overrides = CASES[case]
    model = tiny_hf_model(config_cls, **overrides)
    model.save_pretrained(tmp_path)
    ids = prompt(model.config.vocab_size)
    assert max_rel_error(full_logits(runner_for_folder(str(tmp_path)), ids), hf_logits(model, ids)) <= 1e-4


def test_stacked_expert_state_dict_loads():
    config_cls, overrides = CASES["qwen3-moe"]
    model = tiny_hf_model(config_cls, **overrides)
    assert any(name.endswith("experts.gate_up_proj") for name in model.state_dict())
    cfg = RunnerConfig(device="cpu", dtype="float32", num_kv_slots=256, max_rows=2, max_seq_len=64)
    hf_config = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    runner = ModelRunner.from_hf_state_dict(hf_config, model.state_dict(), cfg)
    ids = prompt(model.config.vocab_size)
    assert max_rel_error(full_logits(runner, ids), hf_logits(model, ids)) <= 1e-4
