"""InternLM2 against a plain torch InternLM2 written from its hub modeling file (tests/modeling/internlm2_reference.py;
remote code, not in transformers), fp32 within 1e-4: the causal LM's logits (wqkv unpacked from its grouped layout,
with and without its biases, grouped and plain multi-head attention) and the reward model's score, LightLLM's
`v_head` on each prompt's last token, for prompts of different lengths in one step."""

from __future__ import annotations

import pytest
import torch

from tests.modeling.helpers import full_logits, runner_for_folder
from tests.modeling.internlm2_reference import REWARD_TOKEN_ID, InternLM2Reference
from tests.modeling.test_pooling_parity import assert_close, pool_step, prompts
from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.registry import is_pooling_model

PROMPT = [1, 17, 200, 33, 91, 4, 150, 12, 9]


@pytest.mark.parametrize(
    ("bias", "num_kv_heads"), [(True, 2), (False, 2), (False, 4), (True, 1)], ids=["gqa-bias", "gqa", "mha", "mqa-bias"]
)
def test_causal_lm_logits_match_the_reference(bias, num_kv_heads, tmp_path):
    reference = InternLM2Reference(bias=bias, num_key_value_heads=num_kv_heads)
    reference.save(str(tmp_path))
    ours = full_logits(runner_for_folder(str(tmp_path)), PROMPT)
    expected = reference.logits(PROMPT)
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() <= 1e-4


def test_reward_model_scores_the_last_token_as_lightllm_does(tmp_path):
    reference = InternLM2Reference(reward=True)
    reference.save(str(tmp_path))
    batch = [p + [REWARD_TOKEN_ID] for p in prompts(256)]  # a reward prompt ends with the reward token
    runner = runner_for_folder(str(tmp_path))
    assert runner.pooling_task == "reward"
    assert_close(pool_step(runner, batch), [reference.reward(p) for p in batch])


def test_config_reads_the_one_bias_switch():
    base = {"architectures": ["InternLM2ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8}
    base |= {"num_hidden_layers": 1, "num_attention_heads": 2}
    assert ModelConfig.from_hf_dict(base).qkv_bias and ModelConfig.from_hf_dict(base).o_proj_bias  # its default
    unbiased = ModelConfig.from_hf_dict({**base, "bias": False})
    assert not unbiased.qkv_bias and not unbiased.o_proj_bias and not unbiased.mlp_bias
    assert is_pooling_model("InternLM2ForRewardModel") and not is_pooling_model("InternLM2ForCausalLM")


def test_unpacked_wqkv_holds_each_kv_heads_group():
    from tgi_compat.modeling.models.internlm2 import unpack_wqkv

    config = ModelConfig("InternLM2ForCausalLM", 8, 4, 8, 1, num_heads=4, num_kv_heads=2, head_dim=1)
    # rows: kv 0: q0 q1 k0 v0, kv 1: q2 q3 k1 v1
    parts = dict(unpack_wqkv("model.layers.0.attention.wqkv.bias", torch.arange(8.0), config))
    assert parts["model.layers.0.self_attn.q_proj.bias"].tolist() == [0, 1, 4, 5]
    assert parts["model.layers.0.self_attn.k_proj.bias"].tolist() == [2, 6]
    assert parts["model.layers.0.self_attn.v_proj.bias"].tolist() == [3, 7]
