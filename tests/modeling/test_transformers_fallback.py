"""The transformers fallback: architectures with no native file (OLMo-2, GPT-NeoX) run transformers'
modeling on our attention and KV cache, and match transformers' own logits, for a whole prompt
and for a step that mixes a chunk over a cached prefix with another request's decode."""

from __future__ import annotations

import pytest
import torch
from transformers import GPTNeoXConfig, Olmo2Config

from tests.modeling.helpers import full_logits, hf_logits, max_rel_error, run_step, runner_for_folder, tiny_hf_model
from tgi_compat.modeling.registry import NATIVE, TRANSFORMERS, UnsupportedArchitectureError, modeling_path

CASES = {
    "olmo2": (Olmo2Config, {}),
    "gpt-neox": (GPTNeoXConfig, {"num_key_value_heads": 4, "rotary_pct": 0.5}),  # partial rotary, inside transformers
}


@pytest.fixture(scope="module", params=sorted(CASES))
def fallback_pair(request, tmp_path_factory):
    config_cls, overrides = CASES[request.param]
    model = tiny_hf_model(config_cls, **overrides)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    runner = runner_for_folder(str(folder))
    assert runner.modeling_path == TRANSFORMERS
    return model, runner


def prompt(length: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_match_transformers(fallback_pair):
    model, runner = fallback_pair
    ids = prompt(40)
    assert max_rel_error(full_logits(runner, ids), hf_logits(model, ids)) <= 1e-4


def test_mixed_step_matches_transformers(fallback_pair):
    model, runner = fallback_pair
    first, second = prompt(20, seed=2), prompt(9, seed=3)
    run_step(runner, [(2, first[:12], 0, list(range(300, 312))), (3, second[:8], 0, list(range(400, 408)))])
    chunk, decode = run_step(runner, [(2, first[12:], 12, list(range(312, 320))), (3, second[8:], 8, [408])])
    assert max_rel_error(chunk, hf_logits(model, first)[12:]) <= 1e-4
    assert max_rel_error(decode, hf_logits(model, second)[8:]) <= 1e-4


def test_modeling_paths():
    assert modeling_path("LlamaForCausalLM") == NATIVE
    assert modeling_path("Olmo2ForCausalLM") == TRANSFORMERS
    with pytest.raises(UnsupportedArchitectureError, match="no model class 'NoSuchForCausalLM'"):
        modeling_path("NoSuchForCausalLM")


def test_a_folder_is_loaded_without_hub_kernels(fallback_pair):
    # transformers >= 5.2x swaps layers for kernels fetched from the hub when `kernels` is installed (an offline GPU
    # machine then fails to load, and an online one runs code it did not ship): the fallback turns that off
    _, runner = fallback_pair
    assert runner.model.loaded_by_transformers
    assert not runner.model.hf.use_kernels
