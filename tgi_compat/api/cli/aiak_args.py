"""AIAK's OpenAI server arguments (Baidu's vLLM-based server: vLLM's names and defaults), mapped onto the
launcher's ServerConfig.

Each row of FLAGS either sets one launcher value (`sets`: a launcher flag's dest or a ServerConfig field),
which then goes through the launcher's own checks (`launcher.config_from_args`) like a TGI start; or
describes what this engine always does and sets nothing; or, where the feature does not exist here,
refuses the start with a one-line reason (`refused`). The model may also come positionally, as in
`vllm serve MODEL`.
"""

from __future__ import annotations

import argparse
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tgi_compat.api.cli import launcher
from tgi_compat.api.config import ServerConfig, default_model_id

# vLLM --dtype -> ours; auto: this engine's default (bfloat16 on a GPU, float32 on a CPU)
_DTYPES = {"auto": None, "half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32", "float32": "float32"}  # fmt: skip


class AiakArgsError(ValueError):
    pass


@dataclass(frozen=True)
class Refusal:
    """The start is refused, "--flag value: reason", when `applies(value, args)` (args: every parsed value)."""

    applies: Callable[[Any, dict[str, Any]], bool]
    reason: str


@dataclass(frozen=True)
class AiakFlag:
    name: str  # vLLM's spelling, without dashes
    help: str
    type: Callable[[str], Any] | None = None  # None: value-less presence flag
    default: Any = None
    short: str | None = None
    choices: tuple[str, ...] | None = None
    nargs: str | None = None
    negatable: bool = False  # a presence flag with a --no- form
    sets: str | None = None  # the launcher value it fills (a ServerConfig field once checked); None: none
    convert: Callable[[Any], Any] | None = None  # vLLM's value -> ours
    refused: Refusal | None = None

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


def _none_if_auto(value: str) -> str | None:
    return None if value == "auto" else value


def _is_given(value: Any, _: dict[str, Any]) -> bool:
    return value is not None


def _is_not_the_model(tokenizer: str | None, args: dict[str, Any]) -> bool:
    return tokenizer is not None and tokenizer != (args["model"] or default_model_id())


FLAGS: tuple[AiakFlag, ...] = (
    AiakFlag("host", "IP address to listen on.", str, "0.0.0.0", sets="hostname"),
    AiakFlag("port", "HTTP port.", int, 8000, sets="port"),
    AiakFlag("model", "Model to serve: a local folder, a .gguf file or a Hub id (or the positional MODEL). Default: the embedded SmolLM2-135M-Instruct GGUF.", str, sets="model_id"),
    AiakFlag("tokenizer", "Tokenizer: the model's own. A different one is refused: the tokenizer always loads from the model.", str,
             refused=Refusal(_is_not_the_model, "a tokenizer other than the model's is not supported: the tokenizer loads from --model")),
    AiakFlag("tokenizer-extension-path", "AIAK's tokenizer extension files. Refused: the tokenizer is the model's own (tokenizer.json, or the GGUF's).", str,
             refused=Refusal(_is_given, "tokenizer extensions are not supported: the tokenizer is the model's own")),
    AiakFlag("trust-remote-code", "Allow custom modeling code from the model repository.", sets="trust_remote_code"),
    AiakFlag("dtype", "Weights and activations dtype: auto (bfloat16 on a GPU, float32 on a CPU), half/float16, bfloat16, float/float32.", str, "auto",
             choices=tuple(_DTYPES), sets="dtype", convert=_DTYPES.__getitem__),
    AiakFlag("kv-cache-dtype", "KV cache dtype: auto (the model's dtype), or fp8 / fp8_e4m3 / fp8_e5m2: K and V in one byte, unit scale (twice the tokens).", launcher.flag_named("kv-cache-dtype").type,
             sets="kv_cache_dtype", convert=_none_if_auto),
    AiakFlag("max-model-len", "Prompt + generated tokens per request (TGI's --max-total-tokens). Default: from the KV capacity and the model.", int, sets="max_total_tokens"),
    AiakFlag("distributed-executor-backend", "How tensor-parallel ranks run: mp (one local process per rank, what this server does). ray is refused.", str, choices=("mp", "ray"),
             refused=Refusal(lambda value, _: value == "ray", "Ray is not supported: tensor-parallel ranks run as local processes (mp)")),
    AiakFlag("max-seq-len-to-capture", "vLLM: longest sequence its CUDA graphs cover. Here decode graphs cover every length up to --max-model-len, so any value is accepted (--enforce-eager turns graphs off).", int, 8192),
    AiakFlag("num-scheduler-steps", "vLLM multi-step scheduling. Only 1: each step is scheduled while the GPU runs the previous one (overlap scheduling) instead.", int, 1,
             refused=Refusal(lambda value, _: value != 1, "multi-step scheduling is not built: each step is scheduled while the previous one runs (overlap scheduling)")),
    AiakFlag("pipeline-parallel-size", "Pipeline-parallel stages. Only 1: pipeline parallelism is not built (docs/pipeline-parallelism.md).", int, 1, short="pp",
             refused=Refusal(lambda value, _: value != 1, "pipeline parallelism is not built (docs/pipeline-parallelism.md): use --tensor-parallel-size or replicas")),
    AiakFlag("tensor-parallel-size", "Tensor-parallel ranks, one GPU each (TGI's --num-shard).", int, 1, short="tp", sets="tensor_parallel_size"),
    AiakFlag("enable-prefix-caching", "Reuse the KV of cached prompt prefixes (radix tree). On by default here; --no-enable-prefix-caching turns it off.", negatable=True, sets="prefix_caching"),
    AiakFlag("gpu-memory-utilization", "Share of the GPU memory left after the weights that the KV cache may take (TGI's --cuda-memory-fraction).", float, 0.9, sets="cuda_memory_fraction"),
    AiakFlag("max-num-batched-tokens", "Prompt tokens per step; longer prompts are prefilled in chunks (TGI's --max-batch-prefill-tokens). Default: 4096.", int, sets="max_batch_prefill_tokens"),
    AiakFlag("max-num-seqs", "Largest number of running requests (TGI's --max-batch-size).", int, 256, sets="max_batch_size"),
    AiakFlag("quantization", "Weight quantization: awq, gptq, fp8, compressed-tensors (pre-quantized checkpoints; fp8 also quantizes while loading), weight_only_int8 (int8 weights) or smooth_quant (a W8A8 checkpoint from `python -m tgi_compat.quantize`).", launcher.flag_named("quantization").type, short="q", sets="quantization"),
    AiakFlag("enforce-eager", "Run every decode step eagerly (no CUDA graphs).", sets="enforce_eager"),
    AiakFlag("scheduler-delay-factor", "vLLM: delay new prompts by this factor of the last prompt's latency. Only 0: waiting prompts join the next step.", float, 0.0,
             refused=Refusal(lambda value, _: value != 0.0, "delayed prompt scheduling is not built: waiting prompts join the next step")),
    AiakFlag("enable-chunked-prefill", "Split long prompts into chunks that share steps with decodes. Always on here (chunk size: --max-num-batched-tokens)."),
    AiakFlag("disable-async-output-proc", "Finish each step (sampled tokens on the host) before scheduling the next: turns overlap scheduling off.", sets="overlap_scheduling", convert=operator.not_),
    AiakFlag("lora-modules", "LoRA adapters, each name=path or vLLM's JSON form ('{\"name\": ..., \"path\": ...}').", str, nargs="+", sets="lora_modules", convert=list),
    AiakFlag("chat-template", "Chat template overriding the model's: a file (.jinja/text, or .json with `chat_template`) or the template text.", str, sets="chat_template"),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tgi-compat-serve",
        description="Serve a model over TGI's HTTP API (the OpenAI routes included), configured with the "
        "server arguments of AIAK's vLLM-based OpenAI server. Also `python -m tgi_compat.openai_server`.",
    )
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="The model, as `vllm serve MODEL` takes it (same as --model).")  # fmt: skip
    for flag in FLAGS:
        names = [f"--{flag.name}"] + ([f"-{flag.short}"] if flag.short else [])
        if flag.type is None:
            action = argparse.BooleanOptionalAction if flag.negatable else "store_true"
            parser.add_argument(*names, dest=flag.dest, action=action, default=None, help=flag.help)
            continue
        shown = "" if flag.default is None else f" (default: {flag.default})"
        parser.add_argument(
            *names,
            dest=flag.dest,
            type=flag.type,
            default=flag.default,
            choices=flag.choices,
            nargs=flag.nargs,
            help=flag.help + shown,
        )
    return parser


def _one_model(model_tag: str | None, model: str | None) -> str | None:
    if model_tag is not None and model is not None and model_tag != model:
        raise AiakArgsError(f"the positional MODEL ({model_tag}) and --model ({model}) differ: give only one")
    return model_tag or model


def _shown(value: Any) -> str:
    return " ".join(value) if isinstance(value, list) else str(value)


def parse_config(argv: Sequence[str] | None = None) -> ServerConfig:
    """The ServerConfig of an AIAK command line; AiakArgsError names the argument that refuses the start."""
    args = vars(build_parser().parse_args(argv))
    args["model"] = _one_model(args.pop("model_tag"), args["model"])
    values = launcher.default_values()
    for flag in FLAGS:
        value = args[flag.dest]
        if flag.refused is not None and flag.refused.applies(value, args):
            raise AiakArgsError(f"--{flag.name} {_shown(value)}: {flag.refused.reason}")
        if flag.sets is not None and value is not None:
            values[flag.sets] = value if flag.convert is None else flag.convert(value)
    try:
        return launcher.config_from_args(values)
    except launcher.LauncherError as error:
        raise AiakArgsError(str(error)) from error
