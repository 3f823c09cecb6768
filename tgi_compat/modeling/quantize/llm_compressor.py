"""`-quant_type awq | gptq`: llm-compressor's calibrated AWQ and GPTQ, in an environment of its own.

llm-compressor (the field's tool for AWQ/GPTQ, vLLM's) pins transformers and compressed-tensors to other
versions than this server's lock, so it cannot share our environment. The tool keeps one for it: the Python named
by TGI_COMPAT_LLM_COMPRESSOR_PYTHON, else a virtual environment under ~/.cache/tgi-compat/llm-compressor, made on
first use with `pip install torch==<ours> llmcompressor==<pinned>` (about a minute; later runs reuse it). There
`llm_compressor_worker.py` quantizes a plain transformers checkpoint that this side writes (a GGUF input is
dequantized first) over the calibration token ids (-token, or ShareGPT), and saves a compressed-tensors
`pack-quantized` checkpoint: symmetric int4 groups, which this server (and vLLM) load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tgi_compat.modeling.config import ModelConfig

LLM_COMPRESSOR = "llmcompressor==0.14.0.1"
PYTHON_VAR = "TGI_COMPAT_LLM_COMPRESSOR_PYTHON"
DEFAULT_ENV = Path.home() / ".cache" / "tgi-compat" / "llm-compressor"
WORKER = Path(__file__).with_name("llm_compressor_worker.py")
GROUP_SIZES = (128, 64, 32)  # AWQ/GPTQ's usual 128 where it divides every projection's inputs


class LlmCompressorError(RuntimeError):
    pass


def group_size_for(config: ModelConfig) -> int:
    """One group size for every projection (one config group in the checkpoint)."""
    inputs = {config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim}
    for size in GROUP_SIZES:
        if all(n % size == 0 for n in inputs):
            return size
    raise LlmCompressorError(f"no int4 group size of {GROUP_SIZES} divides the projections' inputs {sorted(inputs)}")


def environment_python(announce=print) -> str:
    """The llm-compressor environment's Python, made on first use."""
    if named := os.environ.get(PYTHON_VAR):
        return named
    python = DEFAULT_ENV / "bin" / "python"
    if python.exists() and _has_llm_compressor(str(python)):
        return str(python)
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    announce(f"making llm-compressor's environment in {DEFAULT_ENV} ({torch_pin}, {LLM_COMPRESSOR}; once)")
    steps = [
        [sys.executable, "-m", "venv", str(DEFAULT_ENV)],
        [str(python), "-m", "pip", "install", "-q", torch_pin],
        [str(python), "-m", "pip", "install", "-q", LLM_COMPRESSOR],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode:
            raise LlmCompressorError(f"{' '.join(step)} failed: {_tail(done.stderr)}")
    return str(python)


def _has_llm_compressor(python: str) -> bool:
    return subprocess.run([python, "-c", "import llmcompressor"], capture_output=True).returncode == 0


def quantize(
    model_folder: str, output: str, method: str, group_size: int, samples: list[list[int]], dtype: str, announce=print
) -> None:
    """Runs the worker over a transformers checkpoint folder; the output folder receives the checkpoint."""
    python = environment_python(announce)
    with tempfile.TemporaryDirectory() as scratch:
        samples_path, job_path = Path(scratch, "samples.json"), Path(scratch, "job.json")
        samples_path.write_text(json.dumps(samples))
        job = dict(model=model_folder, output=output, method=method, group_size=group_size, samples=str(samples_path))
        job_path.write_text(json.dumps({**job, "dtype": {"bf16": "bfloat16", "fp16": "float16"}[dtype]}))
        announce(f"{method.upper()} through llm-compressor: int4 groups of {group_size}, {len(samples)} samples")
        done = subprocess.run([python, str(WORKER), str(job_path)], capture_output=True, text=True)
    if done.returncode:
        raise LlmCompressorError(f"llm-compressor's {method.upper()} failed: {_tail(done.stderr)}")


def _tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
