"""Session-scoped SmolLM2 fixtures: our runner, transformers' reference model, the tokenizer.

transformers' GGUF conversion is slow (~30-70 s on 2 cores), so its converted model is saved once
under pytest's cache folder and later sessions load that snapshot of transformers' own output.
"""

from __future__ import annotations

import os

import pytest
import torch

from modeling.runner import ModelRunner, RunnerConfig
from tests.modeling.helpers import smollm2_gguf_path


@pytest.fixture(scope="session")
def smollm2_runner() -> ModelRunner:
    return ModelRunner(
        RunnerConfig(device="cpu", dtype="float32", num_kv_slots=8192, max_rows=8, show_progress=False)
    )


@pytest.fixture(scope="session")
def smollm2_hf_model(request):
    from transformers import AutoModelForCausalLM

    gguf_path = smollm2_gguf_path()
    stat = os.stat(gguf_path)
    cached = request.config.cache.mkdir(f"smollm2-hf-reference-{stat.st_size}-{stat.st_mtime_ns}")
    if (cached / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()
    _save_reference(model, cached)
    return model


def _save_reference(model, folder) -> None:
    """save_pretrained refuses GGUF-loaded models, so write config + safetensors by hand."""
    import json

    from safetensors.torch import save_model

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    save_model(model, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from modeling.tokenizer import load_tokenizer

    return load_tokenizer()
