"""PEFT adapters beyond one rank and alpha on separate projections, against peft's merged model on tiny random
checkpoints (one prefill of a base row and an adapter row: row by row the base model's logits and the merged
model's): a fused checkpoint's (Phi-3: qkv_proj and gate_up_proj, one pair over several projections), and a
Llama adapter with per-module ranks and alphas (rank_pattern, alpha_pattern). A fused pair beside a part's own,
or of another model's sizes, is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, Phi3Config

from tests.modeling.helpers import hf_logits, max_rel_error, tiny_hf_model
from tgi_compat.modeling.forward_batch import LoraBatch, build_forward_batch
from tgi_compat.modeling.lora.adapter import LoraAdapterError, load_peft_adapter
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # what Phi-3 fine-tunes target
PROMPT = [5, 17, 42, 9, 100, 3, 77]


def _write_adapter(model, folder, rank: int, seed: int, targets=TARGETS, **patterns) -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **patterns)
    get_peft_model(copy.deepcopy(model), config).save_pretrained(str(folder))


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    model = tiny_hf_model(Phi3Config, pad_token_id=0)
    folder = tmp_path_factory.mktemp("phi3-base")
    model.save_pretrained(folder)
    adapter = tmp_path_factory.mktemp("phi3-lora")
    _write_adapter(model, adapter, rank=8, seed=3)
    return model, str(folder), str(adapter)


def _runner(folder: str, max_rank: int = 8) -> ModelRunner:
    config = RunnerConfig(
        model_id=folder, device="cpu", dtype="float32", num_kv_slots=256, max_rows=4, show_progress=False,
        max_loras=2, max_lora_rank=max_rank,
    )  # fmt: skip
    return ModelRunner(config)


def _equals_peft_merged(model, folder: str, adapter_folder: str, max_rank: int = 8) -> None:
    from peft import PeftModel

    runner = _runner(folder, max_rank)
    assert runner.lora is not None
    runner.lora.add(1, load_peft_adapter("adapter", adapter_folder))
    n = len(PROMPT)
    batch = build_forward_batch(PROMPT * 2, [0, 1], [n, n], [n, n], list(range(2 * n)), list(range(2 * n)))
    batch.lora = LoraBatch(torch.tensor([-1, 0]), [(0, 1)])  # the base row, then the adapter's in slot 0
    logits = runner.forward(batch)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(model), adapter_folder).merge_and_unload()
    merged, base = hf_logits(peft_model, PROMPT), hf_logits(model, PROMPT)
    assert max_rel_error(logits[:n], base) <= 1e-4
    assert max_rel_error(logits[n:], merged) <= 2e-4
    assert max_rel_error(merged, base) > 1e-2  # the adapter matters


def test_a_fused_adapter_equals_the_peft_merged_model(phi3):
    model, folder, adapter_folder = phi3
    adapter = load_peft_adapter("phi", adapter_folder)
    assert {projection for _, projection in adapter.modules} == set(TARGETS)  # fused pairs, as peft saved them
    _equals_peft_merged(model, folder, adapter_folder)


def test_per_module_ranks_and_alphas_equal_the_peft_merged_model(tmp_path):
    """rank_pattern and alpha_pattern as peft matches them: a bare name, and a name under one layer."""
    model = tiny_hf_model(LlamaConfig, pad_token_id=0)
    model.save_pretrained(tmp_path / "base")
    seven = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    patterns = dict(rank_pattern={"v_proj": 4, "layers.1.mlp.down_proj": 16}, alpha_pattern={"q_proj": 64, "o_proj": 1})
    _write_adapter(model, tmp_path / "adapter", 8, seed=4, targets=seven, **patterns)
    adapter = load_peft_adapter("patterns", str(tmp_path / "adapter"))
    assert {m.rank for (_, p), m in adapter.modules.items() if p == "v_proj"} == {4}
    assert adapter.modules[(1, "down_proj")].rank == 16 and adapter.modules[(0, "down_proj")].rank == 8
    _equals_peft_merged(model, str(tmp_path / "base"), str(tmp_path / "adapter"), max_rank=16)


def test_a_fused_pair_beside_its_parts_or_of_other_sizes_is_refused(phi3, tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder, adapter_folder = phi3
    runner = _runner(folder)
    assert runner.lora is not None
    tensors = load_file(f"{adapter_folder}/adapter_model.safetensors")
    key = next(k for k in tensors if "layers.0.self_attn.qkv_proj.lora_A" in k)
    twice = dict(tensors)
    for suffix in ("lora_A", "lora_B"):
        fused = tensors[key.replace("lora_A", suffix)]
        twice[key.replace("qkv_proj", "q_proj").replace("lora_A", suffix)] = (
            fused if suffix == "lora_A" else fused[:64]
        ).clone()
    short = dict(tensors)
    short[key.replace("lora_A", "lora_B")] = tensors[key.replace("lora_A", "lora_B")][:-16].clone()
    for name, changed, reason in (
        ("twice", twice, "layers.0.qkv_proj and q_proj both adapt the same weights"),
        ("short", short, "layers.0.qkv_proj has 112 outputs, the model's q_proj | k_proj | v_proj 128"),
    ):
        (tmp_path / name).mkdir()
        save_file(changed, str(tmp_path / name / "adapter_model.safetensors"))
        (tmp_path / name / "adapter_config.json").write_text(open(f"{adapter_folder}/adapter_config.json").read())
        with pytest.raises(LoraAdapterError, match=reason.replace("|", r"\|")):
            runner.lora.prepare(load_peft_adapter(name, str(tmp_path / name)))
