"""--load-format dummy: random weights with a real checkpoint's names and shapes, from a folder that
holds only config.json. The names and shapes equal what save_pretrained writes for each family; a
rank's slice is made alone, reproducibly, and fills its whole shard; every family loads and runs from
config.json alone."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, Olmo2Config, Phi3Config

from tests.modeling.helpers import full_logits, tiny_hf_model
from tests.modeling.test_gemma_parity import CASES as GEMMA_CASES
from tests.modeling.test_moe_parity import CASES as MOE_CASES
from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.layers.ops import TORCH_OPS
from tgi_compat.modeling.parallel import TensorParallel
from tgi_compat.modeling.registry import NATIVE, modeling_path, resolve_model_class
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig
from tgi_compat.modeling.source import resolve_model_source
from tgi_compat.modeling.weights.dummy import INIT_STD, DummyTensor, checkpoint_shapes
from tgi_compat.modeling.weights.loader import iterate_weights

FAMILIES = {
    "llama": (LlamaConfig, {}),
    "llama-tied-biases": (LlamaConfig, dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "phi3": (Phi3Config, {"pad_token_id": 0}),  # q|k|v and gate|up fused in the checkpoint
    "olmo2": (Olmo2Config, {}),  # the transformers fallback
    **GEMMA_CASES,
    **MOE_CASES,  # transformers 5 stacks the experts in memory and saves them one by one
}


def _saved_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                shapes.update({key: tuple(f.get_slice(key).get_shape()) for key in f.keys()})
    return shapes


def _config_only(model, folder) -> str:
    """Only the config.json of `model` in folder, as a dummy-weights model folder has."""
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    assert os.listdir(folder) == ["config.json"]
    return str(folder)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_names_and_shapes_are_those_of_a_saved_checkpoint(family, tmp_path):
    config_cls, overrides = FAMILIES[family]
    model = tiny_hf_model(config_cls, **overrides)
    model.save_pretrained(tmp_path / "saved")
    expected = _saved_shapes(str(tmp_path / "saved"))
    assert checkpoint_shapes(_config_only(model, tmp_path / "config")) == expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_serves_from_config_json_alone(family, tmp_path):
    config_cls, overrides = FAMILIES[family]
    folder = _config_only(tiny_hf_model(config_cls, **overrides), tmp_path)
    cfg = RunnerConfig(model_id=folder, device="cpu", dtype="float32", num_kv_slots=64, max_rows=4, show_progress=False)
    cfg.load_format = "dummy"
    runner = ModelRunner(cfg)
    logits = full_logits(runner, [1, 5, 9, 200])
    assert logits.shape == (4, runner.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0  # random weights, not zeros


@pytest.mark.parametrize(("rank", "size"), [(1, 2), (2, 3)])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_tensor_parallel_rank_fills_every_value_of_its_shard(family, rank, size, tmp_path):
    """Each rank's parameters, NaN before loading, are all written from the slices it asked for."""
    config_cls, overrides = FAMILIES[family]
    source = resolve_model_source(_config_only(tiny_hf_model(config_cls, **overrides), tmp_path))
    with open(os.path.join(source.folder, "config.json")) as f:
        config = ModelConfig.from_hf_dict(json.load(f))
    if modeling_path(config.architecture) != NATIVE:
        pytest.skip("the transformers fallback does not shard")
    tp = TensorParallel(rank, size)
    model = resolve_model_class(config.architecture)(config, TORCH_OPS, tp=tp)
    for param in model.parameters():
        param.data.fill_(float("nan"))
    model.load_weights(iterate_weights(source, config, lazy=True, load_format="dummy"))
    assert all(torch.isfinite(param).all() for param in model.parameters())


def test_a_slice_is_made_alone_reproducibly_on_its_device_and_dtype():
    tensor = DummyTensor("model.layers.0.mlp.down_proj.weight", (64, 100), torch.device("cpu"), torch.bfloat16)
    part = tensor.narrow(1, 50, 50)
    assert part.shape == (64, 50) and part.dtype == torch.bfloat16 and part.device.type == "cpu"
    assert torch.equal(part, tensor.narrow(1, 50, 50))  # ranks holding the same slice hold the same values
    assert not torch.equal(part, tensor.narrow(1, 0, 50))
    assert abs(tensor.materialize().float().std().item() - INIT_STD) < 0.002
    norm = DummyTensor("model.norm.weight", (64,), torch.device("cpu"), torch.float32)
    bias = DummyTensor("model.layers.0.self_attn.q_proj.bias", (64,), torch.device("cpu"), torch.float32)
    assert torch.equal(norm.narrow(0, 32, 32), torch.ones(32)) and torch.equal(bias.materialize(), torch.zeros(64))


def test_a_quantized_config_is_refused(tmp_path):
    folder = _config_only(tiny_hf_model(LlamaConfig), tmp_path)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    cfg = RunnerConfig(model_id=folder, device="cpu", dtype="float32", num_kv_slots=64, max_rows=4, load_format="dummy")
    with pytest.raises(ValueError, match="unquantized weights"):
        ModelRunner(cfg)
