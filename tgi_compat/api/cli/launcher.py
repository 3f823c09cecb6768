"""`text-generation-launcher`: TGI's command line (docs/contract.md §12), filling a ServerConfig.

Every flag can also come from the environment variable of the same name in UPPER_SNAKE_CASE
(`--max-total-tokens` <- MAX_TOTAL_TOKENS); an explicit flag wins over the environment.
Boolean options are value-less presence flags, except `--sharded true|false`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tgi_compat.api.cli.flags import Flag, bool_env, choice, cuda_graph_sizes, int_list, is_ip, true_false
from tgi_compat.api.config import ServerConfig, default_model_id

logger = logging.getLogger("tgi_compat.launcher")

_QUANTIZE = choice(
    "awq", "compressed-tensors", "eetq", "exl2", "gptq", "marlin",
    "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "fp8",
)  # fmt: skip
# TGI's --quantize values this server has no kernels for: refused at startup, never ignored.
UNBUILT_QUANTIZE = ("exl2", "marlin", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4")
# vLLM / AIAK --quantization values -> our scheme names (tgi_compat.modeling.layers.quantization.select)
_QUANTIZATION = choice("awq", "gptq", "fp8", "compressed-tensors", "weight_only_int8", "smooth_quant")

FLAGS: tuple[Flag, ...] = (
    Flag("model-id", "Model to serve: a local folder, a .gguf file or a Hub id. Default: the embedded SmolLM2-135M-Instruct GGUF.", str, None),
    Flag("revision", "Hub revision (branch, tag or commit) of the model.", str),
    Flag("validation-workers", "Threads that tokenize and validate requests.", int, 2),
    Flag("sharded", "Whether to shard the model across GPUs (true|false). true without --num-shard: every visible GPU.", true_false),
    Flag("num-shard", "Number of shards (GPUs) for tensor parallelism. Default: the devices in CUDA_VISIBLE_DEVICES (else NVIDIA_VISIBLE_DEVICES), 1 on CPU.", int),
    Flag("quantize", "Weight quantization. fp8 (FP8 weights and activations) and eetq (int8 weights) quantize the checkpoint while loading; awq, gptq, compressed-tensors and fp8 also name a pre-quantized checkpoint's scheme, which is detected from its config.json anyway. exl2, marlin and bitsandbytes* are refused.", _QUANTIZE),
    Flag("speculate", "Number of speculative tokens: n-gram drafts verified per step (0: off); with --model-id of an EAGLE-3 head, the head's drafts (it serves the base model the head names; no Medusa heads).", int),
    Flag("dtype", "Weights dtype: float16 or bfloat16 (float32 also accepted).", choice("float16", "bfloat16", "float32")),
    Flag("kv-cache-dtype", "KV cache dtype: fp8_e4m3fn or fp8_e5m2 store K and V in one byte (twice the tokens; unit scale); vLLM's fp8, fp8_e4m3 and auto are accepted too.", choice("fp8_e4m3fn", "fp8_e5m2", "fp8", "fp8_e4m3", "auto")),
    Flag("load-format", "vLLM's --load-format: auto reads the checkpoint; dummy serves random weights of the checkpoint's names and shapes, made on the GPU (the model folder needs only config.json and a tokenizer): for benchmarks.", choice("auto", "dummy"), "auto"),
    Flag("trust-remote-code", "Accepted as TGI takes it; no repository code runs: models and tokenizers load through transformers' own classes."),
    Flag("max-concurrent-requests", "Requests handled at once; more fail fast with 429 `Model is overloaded`.", int, 128),
    Flag("max-best-of", "Largest allowed `best_of`.", int, 2),
    Flag("max-stop-sequences", "Largest number of `stop` sequences per request.", int, 4),
    Flag("max-top-n-tokens", "Largest allowed `top_n_tokens`.", int, 5),
    Flag("max-input-tokens", "Longest prompt in tokens. Default: max_total_tokens - 1.", int),
    Flag("max-input-length", "Legacy alias of --max-input-tokens (setting both is an error).", int),
    Flag("max-total-tokens", "Prompt + generated tokens per request. Default: min(KV capacity, model max length).", int),
    Flag("waiting-served-ratio", "Waiting/running ratio that forces a prefill into a running batch.", float, 0.3),
    Flag("max-batch-prefill-tokens", "Prompt tokens per prefill step (longer prompts are chunked).", int),
    Flag("max-mixed-prefill-tokens", "Ours: prompt tokens in a step that also decodes for running requests (Sarathi-Serve's chunk budget): less keeps the running streams' inter-token latency down while prompts join, at more steps per prompt; those mixed steps replay CUDA graphs. Default: --max-batch-prefill-tokens.", int),
    Flag("max-batch-total-tokens", "KV cache capacity in tokens. Default: inferred from free memory.", int),
    Flag("max-waiting-tokens", "Decode steps after which waiting requests are considered.", int, 20),
    Flag("max-batch-size", "Largest number of running requests.", int),
    Flag("cuda-graphs", "Decode batch sizes to capture as CUDA graphs (comma list; 0 disables). Default: 1,2,4,8,16,32,48,64,96,128,160,192,224,256,320,384,448,512 up to --max-batch-size.", cuda_graph_sizes),
    Flag("hostname", "IP address to listen on (a non-IP value falls back to 0.0.0.0).", str, "0.0.0.0"),
    Flag("port", "HTTP port.", int, 3000, short="p"),
    Flag("prometheus-port", "Port of the Prometheus-only listener.", int, 9000),
    Flag("shard-uds-path", "Unix socket prefix for shard communication.", str, "/tmp/text-generation-server"),
    Flag("master-addr", "torch.distributed master address.", str, "localhost"),
    Flag("master-port", "torch.distributed master port.", int, 29500),
    Flag("huggingface-hub-cache", "Hub cache folder.", str),
    Flag("weights-cache-override", "Folder holding the weights, bypassing the Hub cache.", str),
    Flag("disable-custom-kernels", "Use reference PyTorch ops instead of Triton kernels."),
    Flag("cuda-memory-fraction", "Fraction of device memory the server may use.", float, 1.0),
    Flag("rope-scaling", "RoPE scaling type: linear or dynamic.", choice("linear", "dynamic")),
    Flag("rope-factor", "RoPE scaling factor.", float),
    Flag("json-output", "Log as JSON lines."),
    Flag("otlp-endpoint", "OpenTelemetry collector endpoint.", str),
    Flag("otlp-service-name", "OpenTelemetry service name.", str, "text-generation-inference.router"),
    Flag("cors-allow-origin", "Allowed CORS origin (repeatable). Default: any.", str, repeatable=True),
    Flag("api-key", "Require `Authorization: Bearer <key>` on generation routes.", str),
    Flag("watermark-gamma", "Watermark green-list fraction (default 0.5).", float),
    Flag("watermark-delta", "Watermark logit bias (default 2.0).", float),
    Flag("ngrok", "Expose the server through ngrok."),
    Flag("ngrok-authtoken", "ngrok auth token.", str),
    Flag("ngrok-edge", "ngrok edge.", str),
    Flag("tokenizer-config-path", "Path to a tokenizer_config.json overriding the model's.", str),
    Flag("disable-grammar-support", "Refuse grammar-constrained requests."),
    Flag("grammar-cache-bytes", "Bytes of compiled grammars the engine keeps for reuse (the least recently used go first); a grammar that compiles to more than an eighth of it is refused.", int, 512 * 2**20),
    Flag("grammar-compile-timeout", "Seconds one grammar may take to compile; a slower one is refused. A compile runs in a child process at a lower priority and stops as soon as no request waits for it.", float, 30.0),
    Flag("env", "Print the runtime environment at startup.", short="e"),
    Flag("max-client-batch-size", "Most prompts in one /v1/completions request.", int, 4),
    Flag(
        "lora-adapters",
        "LoRA adapters to load at startup: comma list of hub ids (id@revision) or name=/local/folder (PEFT format). "
        "Requests pick one by `parameters.adapter_id` or the OpenAI `model`.",
        str,
    ),
    Flag("enable-lora", "Serve LoRA adapters (vLLM); implied by --lora-adapters and --lora-modules."),
    Flag("lora-modules", "vLLM/AIAK: LoRA adapters to load, name=path or JSON {\"name\", \"path\"} (repeatable).", str, repeatable=True),
    Flag("max-loras", "Most LoRA adapters in one batch (device slots). Default: the startup adapters, at least 1.", int),
    Flag("max-cpu-loras", "Most LoRA adapters loaded at once (host memory; on a GPU page-locked for them at start, up to 8 GiB). Default: max(--max-loras, 8).", int),
    Flag("max-lora-rank", "Largest LoRA rank served. Default: 16 (64 with --lora-adapters).", int),
    Flag("usage-stats", "Usage statistics: on, off or no-stack (none are ever sent).", choice("on", "off", "no-stack"), "on"),
    Flag("payload-limit", "Largest request body in bytes.", int, 2_000_000),
    Flag("max-image-fetch-size", "Largest image fetched from a prompt's http(s) URL, in bytes.", int, 1024**3),
    Flag("allow-private-image-urls", "Fetch prompt images from private, loopback and link-local addresses too."),
    Flag("max-images", "Most images in one request; more is a 422 (validation). Default: no limit, as in TGI.", int),
    Flag("enable-prefill-logprobs", "Return prompt logprobs in `details.prefill` (decoder_input_details)."),
    Flag("prefix-caching", "Reuse the KV cache of prompt prefixes seen before (TGI's PREFIX_CACHING=0|1).", bool_env, True),
    Flag("graceful-termination-timeout", "Seconds to finish running requests on shutdown.", int, 90),
    Flag("header-read-timeout", "Seconds a client has to send a request's head (request line and headers), from the connection's start or the end of its previous response; a slower connection is closed without an answer (hyper's header_read_timeout, 30 s by default).", float, 30.0),
    # LightLLM's options (python -m tgi_compat.api.cli.api_server spells them the LightLLM way)
    Flag("long-truncation-mode", "LightLLM: default `long_truncation_mode` of requests: head or center cut over-long prompts instead of refusing them.", choice("head", "center")),
    Flag("token-healing", "LightLLM: default `token_healing` of requests (regenerate the prompt's last two tokens)."),
    Flag("return-all-prompt-logprobs", "LightLLM: default `return_all_prompt_logprobs` of requests (every prompt token's logprob in details.prefill)."),
    Flag("eos-token-ids", "LightLLM --eos_id: token ids that end generation besides the model's EOS (comma list).", int_list),
    Flag("router-token-ratio", "LightLLM: below this fraction of the KV cache in use, admit requests optimistically.", float, 0.0),
    Flag("router-max-new-token-len", "LightLLM: output length the optimistic admission estimate assumes.", int, 1024),
    Flag("health-monitor", "LightLLM --health_monitor: restart a dead or hung engine (in-flight requests fail with TGI's error) instead of stopping the server."),
    # vLLM-style options
    Flag("tensor-parallel-size", "vLLM/AIAK spelling of --num-shard.", int, short="tp"),
    Flag("quantization", "vLLM/AIAK spelling of --quantize: awq, gptq, fp8, compressed-tensors, weight_only_int8 (int8 weights, quantized while loading or from an int8 checkpoint) or smooth_quant (a W8A8 checkpoint from `python -m tgi_compat.quantize`).", _QUANTIZATION),
    Flag("enforce-eager", "Run every decode step eagerly (no CUDA graphs), whatever --cuda-graphs says."),
    Flag("speculative-config", 'vLLM: speculative decoding as JSON, model-free methods and EAGLE-3 heads: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}, {"method": "suffix", ...} or {"method": "eagle3", "model": PATH, "num_speculative_tokens": 3} (a speculators or EAGLE/SGLang head).', str),
    Flag("enable-prefix-caching", "vLLM: prefix caching on (the default; same as PREFIX_CACHING=1)."),
    Flag("no-enable-prefix-caching", "vLLM: prefix caching off (same as PREFIX_CACHING=0)."),
    Flag("enable-prompt-tokens-details", "vLLM: report `usage.prompt_tokens_details.cached_tokens` in OpenAI responses."),
    Flag("chat-template", "Chat template overriding the model's: a file (.jinja/text, or .json with `chat_template`) or the template text.", str),
    Flag("served-model-name", "Model name reported by /v1/models and the `model` field of OpenAI responses. Default: --model-id.", str),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="text-generation-launcher",
        description="Serve a model over TGI's HTTP API. Every flag also reads the environment "
        "variable of the same name in UPPER_SNAKE_CASE (e.g. MAX_TOTAL_TOKENS).",
    )
    for flag in FLAGS:
        names = [f"--{flag.name}"] + ([f"-{flag.short}"] if flag.short else [])
        help_text = f"{flag.help} [env: {flag.env}]"
        if flag.type is None:
            parser.add_argument(*names, dest=flag.dest, action="store_true", default=None, help=help_text)
        elif flag.repeatable:
            parser.add_argument(*names, dest=flag.dest, type=flag.type, action="append", default=None, help=help_text)
        else:
            shown = "" if flag.default is None else f" (default: {flag.default})"
            parser.add_argument(*names, dest=flag.dest, type=flag.type, default=None, help=help_text + shown)
    return parser


def flag_named(name: str) -> Flag:
    """The launcher's flag of that long name: other entry points parse the same option with its parser."""
    return next(flag for flag in FLAGS if flag.name == name)


def default_values() -> dict[str, Any]:
    """Every launcher value at its TGI default, as `parse_args` fills it when nothing is given."""
    return {flag.dest: False if flag.type is None else flag.default for flag in FLAGS}


def _value_from_env(flag: Flag, parser: argparse.ArgumentParser) -> Any:
    raw = os.environ.get(flag.env)
    if raw is None:
        return None
    if flag.type is None:
        return bool_env(raw)
    try:
        if flag.repeatable:
            return [flag.type(part) for part in raw.split(",") if part]
        return flag.type(raw)
    except (ValueError, argparse.ArgumentTypeError) as error:
        parser.error(f"invalid value for {flag.env}: {error}")


def parse_args(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Flags, then environment, then TGI defaults."""
    parser = build_parser()
    namespace = vars(parser.parse_args(argv))
    values = default_values()
    for flag in FLAGS:
        value = namespace[flag.dest]
        if value is None:
            value = _value_from_env(flag, parser)
        if value is not None:
            values[flag.dest] = value
    if values["hostname"] and not is_ip(values["hostname"]):
        # Docker sets HOSTNAME to the container id; TGI warns and listens everywhere.
        logger.warning("Invalid hostname %r, defaulting to 0.0.0.0", values["hostname"])
        values["hostname"] = "0.0.0.0"
    return values


class LauncherError(ValueError):
    pass


def config_from_args(values: dict[str, Any]) -> ServerConfig:
    """Check the flags against each other the way TGI's launcher does, then build the config."""
    if values["max_input_length"] is not None and values["max_input_tokens"] is not None:
        raise LauncherError(
            "`max_input_tokens` and `max_input_length` are the same parameter: use only `max_input_tokens`"
        )
    max_input = values.pop("max_input_length")
    if values["max_input_tokens"] is None:
        values["max_input_tokens"] = max_input
    if values["validation_workers"] == 0:
        raise LauncherError("`validation_workers` must be > 0")
    max_input, max_total = values["max_input_tokens"], values["max_total_tokens"]
    if max_input is not None and max_total is not None and max_input >= max_total:
        raise LauncherError(f"`max_input_tokens`({max_input}) must be < `max_total_tokens`({max_total})")
    max_batch_total = values["max_batch_total_tokens"]
    if max_batch_total is not None and max_total is not None and max_total > max_batch_total:
        raise LauncherError(
            f"`max_total_tokens` must be <= `max_batch_total_tokens`. Given: {max_total} and {max_batch_total}"
        )
    values.pop("env")
    values["num_shard"] = resolve_num_shard(
        values.pop("sharded"),
        _one_of_num_shard(values["num_shard"], values.pop("tensor_parallel_size")),
        values.get("device"),
    )
    enable, disable = values.pop("enable_prefix_caching"), values.pop("no_enable_prefix_caching")
    if enable and disable:
        raise LauncherError("`--enable-prefix-caching` and `--no-enable-prefix-caching` contradict each other")
    if enable or disable:
        values["prefix_caching"] = enable
    values["quantize"] = _quantize_value(values.pop("quantization"), values["quantize"])
    values["model_id"] = values["model_id"] or default_model_id()
    _serve_base_of_head(values)
    values["cors_allow_origin"] = values["cors_allow_origin"] or []
    values["lora_modules"] = values["lora_modules"] or []
    values["eos_token_ids"] = values["eos_token_ids"] or []
    config = ServerConfig(**values)
    _check_lora(config)
    try:
        config.speculative  # noqa: B018 - parsed here so that a bad flag stops the launcher, not the engine
    except ValueError as exc:
        raise LauncherError(str(exc)) from None
    return config


def _serve_base_of_head(values: dict[str, Any]) -> None:
    """TGI's Medusa-style detection for EAGLE-3 heads: `--model-id HEAD` serves the base model it names, with it."""
    from tgi_compat.api.cli.speculative_head import detect_eagle3_head

    try:
        head = detect_eagle3_head(values["model_id"], values["revision"], values["speculate"])
    except ValueError as exc:
        raise LauncherError(str(exc)) from None
    if head is None:
        return
    if values["speculative_config"] is not None:
        raise LauncherError("--model-id names an EAGLE-3 head: give --speculate k, not --speculative-config")
    logger.info("EAGLE-3 head %s: serving its base model %s", head.head, head.base_model_id)
    values["model_id"], values["revision"] = head.base_model_id, None  # (the revision was the head's: TGI's too)
    values["speculate"], values["speculative_config"] = None, head.speculative_config()


def _check_lora(config: ServerConfig) -> None:
    from tgi_compat.api.lora_flags import LoraFlagError

    if not config.lora_enabled:
        return
    try:
        config.lora_sources  # noqa: B018 - parsed here so that a bad flag stops the launcher, not the engine
    except LoraFlagError as exc:
        raise LauncherError(str(exc)) from None


def _quantize_value(quantization: str | None, quantize: str | None) -> str | None:
    if quantize in UNBUILT_QUANTIZE:
        raise LauncherError(
            f"--quantize {quantize} is not supported by this server: use fp8 or eetq to quantize while loading, "
            "or an awq, gptq, fp8 or compressed-tensors checkpoint"
        )
    if quantization is not None and quantize is not None and quantization != quantize:
        raise LauncherError(f"--quantization {quantization} conflicts with --quantize {quantize}: give only one")
    return quantization or quantize


# Options accepted for compatibility whose feature does not exist (yet) in this server.
_NOT_IMPLEMENTED: dict[str, Callable[[ServerConfig], bool]] = {
    "--rope-scaling/--rope-factor": lambda c: c.rope_scaling is not None or c.rope_factor is not None,
    "--watermark-gamma/--watermark-delta": lambda c: c.watermark_gamma is not None or c.watermark_delta is not None,
    "--waiting-served-ratio": lambda c: c.waiting_served_ratio != 0.3,
    "--weights-cache-override": lambda c: c.weights_cache_override is not None,
    "--disable-custom-kernels": lambda c: c.disable_custom_kernels,
    "--ngrok": lambda c: c.ngrok or c.ngrok_authtoken is not None or c.ngrok_edge is not None,
    # ranks talk through torch.distributed (--master-addr/--master-port), not TGI's shard sockets
    "--shard-uds-path": lambda c: c.shard_uds_path != "/tmp/text-generation-server",
}
# Options accepted that have nothing to do here, whatever their value (no warning).
_WITHOUT_EFFECT = {
    "usage_stats": "TGI's telemetry switch: this server never sends telemetry",
    "trust_remote_code": "no repository code runs: models and tokenizers load through transformers' own classes",
}


def _one_of_num_shard(num_shard: int | None, tensor_parallel_size: int | None) -> int | None:
    if num_shard is not None and tensor_parallel_size is not None and num_shard != tensor_parallel_size:
        raise LauncherError(
            f"`num_shard` ({num_shard}) and `tensor_parallel_size` ({tensor_parallel_size}) differ: give only one of them"
        )
    return num_shard if num_shard is not None else tensor_parallel_size


def visible_cuda_devices() -> int | None:
    """TGI's count: the entries of CUDA_VISIBLE_DEVICES, else NVIDIA_VISIBLE_DEVICES; None if neither is set."""
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", os.environ.get("NVIDIA_VISIBLE_DEVICES"))
    return None if devices is None else len(devices.split(","))


def resolve_num_shard(sharded: bool | None, num_shard: int | None, device: str | None) -> int:
    """TGI's launcher rules for --sharded/--num-shard; with neither, every visible GPU (1 on CPU)."""
    if sharded is True and num_shard is None:
        devices = visible_cuda_devices()
        if devices is None:
            raise LauncherError("--num-shard and CUDA_VISIBLE_DEVICES/NVIDIA_VISIBLE_DEVICES are not set")
        if devices <= 1:
            raise LauncherError(f"`sharded` is true but only found {devices} CUDA devices")
        num_shard = devices
    elif sharded is True and num_shard is not None and num_shard <= 1:
        raise LauncherError("`sharded` is true but `num_shard` <= 1")
    elif sharded is False and num_shard is None:
        num_shard = 1
    elif num_shard is None:
        num_shard = visible_cuda_devices() or 1
        if num_shard > 1 and (device == "cpu" or not _has_cuda()):
            num_shard = 1  # CPU serving: the GPU list in the environment does not apply
    if num_shard < 1:
        raise LauncherError("`num_shard` cannot be < 1")
    return num_shard


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def unimplemented_options(config: ServerConfig) -> list[str]:
    return [name for name, is_set in _NOT_IMPLEMENTED.items() if is_set(config)]


def main(argv: Sequence[str] | None = None) -> int:
    values = parse_args(argv)
    print_env = values["env"]
    from tgi_compat.api.observability.logging_setup import configure_logging

    configure_logging(values["json_output"])
    try:
        config = config_from_args(values)
    except LauncherError as error:
        logger.error("%s", error)
        return 1
    if print_env:
        logger.info("Runtime environment: python %s, %s", sys.version.split()[0], sys.platform)
    missing = unimplemented_options(config)
    if missing:
        logger.warning("These options are accepted but not implemented yet and have no effect: %s", ", ".join(missing))
    if config.huggingface_hub_cache:
        os.environ.setdefault("HF_HUB_CACHE", config.huggingface_hub_cache)

    from tgi_compat.api.server.process import serve  # heavy imports only once the flags are valid

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
