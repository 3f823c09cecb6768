"""Fixtures every test tree shares.

transformers' reference model of the embedded SmolLM2 loads once per session for all of them: its
GGUF conversion is slow (~30-70 s on 2 cores), so the converted model is saved once under the
tgi_compat cache folder (tgi_compat.modeling.tokenizer.cache_root) and later sessions load that snapshot of
transformers' own output.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.modeling.helpers import smollm2_gguf_path
from tgi_compat.modeling.tokenizer import cache_root


def _import_triton_interpreted() -> None:
    """Without a GPU, Triton's own @jit helpers (tl.cdiv, the reductions, gluon's copies) must be
    the interpreter's: Triton decorates them once, when it is first imported, so that import happens
    here, before any test module pulls in a kernel. The variable is restored at once so that server
    subprocesses started by tests do not inherit it (tests/kernels/conftest.py re-imports tgi_compat/kernels/)."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.experimental.gluon  # noqa: F401  (imports triton.language as well)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


if not torch.cuda.is_available():
    _import_triton_interpreted()


@pytest.fixture(scope="session")
def smollm2_hf_model():
    from transformers import AutoModelForCausalLM

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


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The embedded model's tokenizer (converted from the GGUF once, then cached)."""
    from tgi_compat.modeling.tokenizer import load_tokenizer

    return load_tokenizer()
