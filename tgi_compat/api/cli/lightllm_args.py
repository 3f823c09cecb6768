"""LightLLM's `api_server` command line (seed era, 2024-08), mapped onto the TGI launcher's ServerConfig.

`python -m tgi_compat.api.cli.api_server` accepts LightLLM's flags with LightLLM's names and defaults, and
also every `text-generation-launcher` flag and environment variable. Each LightLLM flag has at most
one TGI equivalent (`--max_total_token_num` <-> `--max-batch-total-tokens` / MAX_BATCH_TOTAL_TOKENS);
when both are given with different values the start is refused, naming both. A TGI value given
alone wins over a LightLLM *default*. The merged values then go through the launcher's own checks
(`launcher.config_from_args`), so both entry points fill the same ServerConfig the same way.

Two defaults differ from the seed era on purpose (both follow LightLLM from 2024-10 on):
`--data_type` defaults to the model's dtype (seed: float16, which CPUs serve badly) and `--eos_id`
to the model's EOS ids (seed: [2], the id of `</s>` in Llama 1/2 only).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tgi_compat.api.cli import launcher
from tgi_compat.api.cli.flags import Flag, bool_env, is_ip
from tgi_compat.api.config import ServerConfig

# --mode values: LightLLM's kernel choices. The Triton attention ones are what our triton backend does.
ATTENTION_MODES = {"triton_flashdecoding", "triton_gqa_flashdecoding", "triton_gqa_attention"}
# --mode values that quantize the weights while loading -> the scheme (tgi_compat.modeling.layers.quantization.select)
QUANT_MODES = {
    "triton_w8a16": "weight_only_int8", "triton_w8a8": "w8a8_int8", "triton_fp8w8a8": "fp8", "triton_w4a16": "w4a16_int4",
}  # fmt: skip
KV_MODES = {"triton_fp8kv": "fp8_e4m3fn"}  # --mode values that choose the KV cache dtype
UNBUILT_MODES = {
    "triton_int8kv", "ppl_int8kv", "ppl_int8kv_flashdecoding", "ppl_int4kv_flashdecoding",
    "ppl_fp16", "lmdeploy_w4a16", "ppl_w4a16", "ppl_w8a8", "ppl_w8a8_mixdown", "quik_activation_weight",
}  # fmt: skip
_GROUPED_W4A16 = re.compile(r"^(triton|lmdeploy|ppl)_w4a16(g\d+)?$")  # e.g. triton_w4a16g64: group size 64
_DATA_TYPES = {
    "fp16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
}


_KNOWN_MODES = ATTENTION_MODES | UNBUILT_MODES | set(QUANT_MODES) | set(KV_MODES)


class LightLLMArgsError(ValueError):
    pass


@dataclass(frozen=True)
class LightFlag:
    name: str  # LightLLM's spelling, without dashes
    help: str
    type: Callable[[str], Any] | None = None  # None: store_true
    default: Any = None
    tgi: str | None = None  # the ServerConfig field / launcher dest it fills
    config: str | None = None  # a ServerConfig field with no launcher flag (set after the launcher's checks)
    nargs: str | None = None
    repeatable: bool = False
    choices: Sequence[str] | None = None


def _truncation_mode(value: str) -> str | None:
    if value not in ("None", "head", "center"):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from None, head, center)")
    return None if value == "None" else value


FLAGS: tuple[LightFlag, ...] = (
    LightFlag("host", "IP address to listen on.", str, "127.0.0.1", tgi="hostname"),
    LightFlag("port", "HTTP port.", int, 8000, tgi="port"),
    LightFlag("model_dir", "Model to serve: a folder, a .gguf file or a Hub id. Default: the embedded SmolLM2-135M-Instruct.", str, tgi="model_id"),
    LightFlag("tokenizer_mode", "slow, fast or auto. transformers 5 has one (fast) backend per model, so all three load the same tokenizer.", str, "slow", choices=("slow", "fast", "auto")),
    LightFlag("load_way", "Weight format: HF (safetensors or GGUF). LightLLM's DS format is refused.", str, "HF"),
    LightFlag("max_total_token_num", "KV cache capacity in tokens (slots).", int, 6000, tgi="max_batch_total_tokens"),
    LightFlag("batch_max_tokens", "Prompt tokens per prefill step. Default: max(max_total_token_num / 6, max_req_total_len); with --splitfuse_mode max(max_total_token_num / 6, splitfuse_block_size).", int, tgi="max_batch_prefill_tokens"),
    LightFlag("eos_id", "Token ids that end generation (all of them), besides the model's EOS ids. Default: the model's EOS ids.", int, tgi="eos_token_ids", nargs="+"),
    LightFlag("running_max_req_size", "Largest number of running (and paused) requests.", int, 1000, tgi="max_batch_size"),
    LightFlag("tp", "Tensor-parallel degree (GPUs).", int, 1, tgi="num_shard"),
    LightFlag("max_req_input_len", "Longest prompt in tokens.", int, 2048, tgi="max_input_tokens"),
    LightFlag("max_req_total_len", "Prompt + generated tokens per request.", int, 2048 + 1024, tgi="max_total_tokens"),
    LightFlag("nccl_port", "torch.distributed port between tensor-parallel ranks.", int, 28765, tgi="master_port"),
    LightFlag("mode", "Kernel modes. triton_flashdecoding, triton_gqa_flashdecoding and triton_gqa_attention select the Triton attention backend; triton_w8a16 (int8 weights), triton_w8a8 (int8 weights and activations), triton_fp8w8a8 (FP8) and triton_w4a16 (int4 weights, groups of 128) quantize the weights while loading; triton_fp8kv stores the KV cache in FP8; the int8-KV / ppl / lmdeploy / grouped-w4a16 modes are accepted but not built; anything else is refused.", str, [], nargs="+"),
    LightFlag("trust_remote_code", "Allow custom modeling code from the model repository.", tgi="trust_remote_code"),
    LightFlag("disable_log_stats", "Do not log the periodic throughput line.", config="disable_log_stats"),
    LightFlag("log_stats_interval", "Seconds between throughput log lines.", int, 10, config="log_stats_interval"),
    LightFlag("router_token_ratio", "Below this fraction of KV in use, admit requests optimistically (0.0: always conservative).", float, 0.0, tgi="router_token_ratio"),
    LightFlag("router_max_new_token_len", "Output length the optimistic admission estimate assumes.", int, 1024, tgi="router_max_new_token_len"),
    LightFlag("router_max_wait_tokens", "Decode steps between two admissions of waiting requests.", int, 10, tgi="max_waiting_tokens"),
    LightFlag("use_dynamic_prompt_cache", "Reuse the KV of shared prompt prefixes (radix cache). On by default, as in LightLLM v1.", tgi="enable_prefix_caching"),
    LightFlag("disable_dynamic_prompt_cache", "LightLLM v1: turn the prompt cache off.", tgi="no_enable_prefix_caching"),
    LightFlag("splitfuse_block_size", "Prompt tokens of one request per fused step (with --splitfuse_mode).", int, 256),
    LightFlag("splitfuse_mode", "Fuse prompt chunks and decodes in one step. Our scheduler always does (chunked prefill)."),
    LightFlag("beam_mode", "Beam search over best_of sequences: a request with best_of > 1 and no sampling searches that many beams.", config="beam_mode"),
    LightFlag("diverse_mode", "n / best_of sequences decode with shared-prefix attention: the prompt's KV, shared through the prompt cache, is read once per step for up to 8 siblings instead of once per sequence. Outputs are unchanged.", config="diverse_mode"),
    LightFlag("token_healing_mode", "Default of the request parameter `token_healing`: back the prompt up by its last two tokens and regenerate them.", tgi="token_healing"),
    LightFlag("enable_multimodal", "Serve images (a vision checkpoint's images are served either way, as in TGI)."),
    LightFlag("cache_capacity", "Images whose encoder output is kept.", int, 200, config="image_cache_capacity"),
    LightFlag("cache_reserved_ratio", "Share of --cache_capacity kept when it overflows.", float, 0.5, config="image_cache_reserved_ratio"),
    LightFlag("data_type", "Weights/activations/KV dtype. Default: the model's dtype (float32 on CPU).", str, choices=tuple(_DATA_TYPES), tgi="dtype"),
    LightFlag("return_all_prompt_logprobs", "Default of the request parameter `return_all_prompt_logprobs` (every prompt token's logprob in details.prefill).", tgi="return_all_prompt_logprobs"),
    LightFlag("use_reward_model", "Serve a reward model (/get_score, /pooling). The checkpoint's architecture decides: a reward or classification checkpoint is a pooling model with or without this flag."),
    LightFlag("long_truncation_mode", "Default of the request parameter `long_truncation_mode`: None (refuse long prompts, 422), head (keep the end) or center (keep both ends).", _truncation_mode, tgi="long_truncation_mode"),
    LightFlag("use_tgi_api", "Speak TGI's API on /generate, /generate_stream and /. This server always does."),
    LightFlag("health_monitor", "Restart a dead engine or one that makes no progress; in-flight requests fail with TGI's error shape.", tgi="health_monitor"),
    LightFlag("metric_gateway", "Prometheus Pushgateway host:port to push the metrics to.", str, config="metric_gateway"),
    LightFlag("job_name", "Pushgateway job name.", str, "lightllm", config="metric_job_name"),
    LightFlag("grouping_key", "Pushgateway grouping key key=value (repeatable).", str, [], repeatable=True, config="metric_grouping_key"),
    LightFlag("push_interval", "Seconds between two pushes.", int, 10, config="metric_push_interval"),
    LightFlag("enable_monitor_auth", "Basic auth to the Pushgateway from env USERNAME / PASSWORD.", config="enable_monitor_auth"),
)  # fmt: skip

_BY_NAME = {flag.name: flag for flag in FLAGS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tgi_compat.api_server",
        description="Serve a model over TGI's HTTP API, configured with LightLLM's api_server flags. "
        "Every text-generation-launcher flag and environment variable is accepted too; a LightLLM flag "
        "and its TGI equivalent given with different values is an error.",
    )
    group = parser.add_argument_group("LightLLM options")
    for flag in FLAGS:
        equivalent = _tgi_option(flag)
        help_text = flag.help + (f" [TGI: {equivalent}]" if equivalent else "")
        if flag.type is None:
            group.add_argument(f"--{flag.name}", action="store_true", default=None, help=help_text)
            continue
        shown = f" (default: {flag.default})" if flag.default not in (None, []) else ""
        kwargs: dict[str, Any] = {"type": flag.type, "default": None, "help": help_text + shown}
        if flag.choices:
            kwargs["choices"] = flag.choices
        if flag.type is _truncation_mode:
            kwargs["metavar"] = "{None,head,center}"
        if flag.nargs:
            kwargs["nargs"] = flag.nargs
        if flag.repeatable:
            kwargs["action"] = "append"
        group.add_argument(f"--{flag.name}", **kwargs)
    tgi = parser.add_argument_group("text-generation-launcher options")
    light_names = {f"--{flag.name}" for flag in FLAGS}
    for tgi_flag in launcher.FLAGS:
        spellings = [f"--{tgi_flag.name}"] + ([f"-{tgi_flag.short}"] if tgi_flag.short else [])
        names = [n for n in spellings if n not in light_names]
        if f"--{tgi_flag.name}" in light_names:
            continue  # same spelling in both (--port): LightLLM's flag, TGI's env var
        help_text = f"{tgi_flag.help} [env: {tgi_flag.env}]"
        if tgi_flag.type is None:
            tgi.add_argument(*names, dest=f"tgi_{tgi_flag.dest}", action="store_true", default=None, help=help_text)
        else:
            action = "append" if tgi_flag.repeatable else "store"
            tgi.add_argument(
                *names,
                dest=f"tgi_{tgi_flag.dest}",
                metavar=tgi_flag.env,
                type=tgi_flag.type,
                action=action,
                default=None,
                help=help_text,
            )
    return parser


def _tgi_option(flag: LightFlag) -> str | None:
    for tgi in launcher.FLAGS:
        if tgi.dest == flag.tgi:
            return f"--{tgi.name} / {tgi.env}"
    return None


@dataclass(slots=True)
class ParsedArgs:
    light: dict[str, Any]  # LightLLM flags with their LightLLM defaults filled in
    light_given: set[str]  # LightLLM flags given on the command line
    tgi_given: dict[str, Any]  # launcher dests given by flag or environment


def parse(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ParsedArgs:
    environ = os.environ if environ is None else environ
    parser = build_parser()
    namespace = vars(parser.parse_args(argv))
    light = {flag.name: namespace[flag.name] for flag in FLAGS}
    given = {name for name, value in light.items() if value is not None}
    for flag in FLAGS:
        if light[flag.name] is None:
            light[flag.name] = False if flag.type is None else flag.default
    tgi_given: dict[str, Any] = {}
    for tgi_flag in launcher.FLAGS:
        value = namespace.get(f"tgi_{tgi_flag.dest}")
        if value is None and (raw := environ.get(tgi_flag.env)) is not None:
            value = _env_value(tgi_flag, raw, parser)
            if tgi_flag.dest == "hostname" and not is_ip(value):
                value = None  # Docker sets HOSTNAME to the container id: not a listen address
        if value is not None:
            tgi_given[tgi_flag.dest] = value
    return ParsedArgs(light, given, tgi_given)


def _env_value(flag: Flag, raw: str, parser: argparse.ArgumentParser) -> Any:
    if flag.type is None:
        return bool_env(raw)
    try:
        return [flag.type(p) for p in raw.split(",") if p] if flag.repeatable else flag.type(raw)
    except (ValueError, argparse.ArgumentTypeError) as error:
        parser.error(f"invalid value for {flag.env}: {error}")


def _check_flag_values(light: dict[str, Any], given: set[str], tgi_given: dict[str, Any]) -> None:
    """LightLLM's own startup assertions, with messages that name the flag (or env var) to change."""

    def name(flag_name: str) -> str:
        tgi = _BY_NAME[flag_name].tgi
        option = _tgi_option(_BY_NAME[flag_name]) if flag_name not in given and tgi in tgi_given else None
        return option or f"--{flag_name}"

    if light["load_way"] != "HF":
        raise LightLLMArgsError(
            f"--load_way {light['load_way']} is not supported: only HF weights (safetensors or GGUF) load"
        )
    for mode in light["mode"]:
        if mode not in _KNOWN_MODES and not _GROUPED_W4A16.match(mode):
            known = ", ".join(sorted(_KNOWN_MODES))
            raise LightLLMArgsError(f"--mode {mode} is unknown (known modes: {known})")
    total, total_kv = light["max_req_total_len"], light["max_total_token_num"]
    input_len = light["max_req_input_len"]
    if not input_len < total:
        raise LightLLMArgsError(
            f"{name('max_req_input_len')} ({input_len}) must be < {name('max_req_total_len')} ({total})"
        )
    if total > total_kv:
        raise LightLLMArgsError(
            f"{name('max_req_total_len')} ({total}) must be <= {name('max_total_token_num')} ({total_kv})"
        )
    batch = light["batch_max_tokens"]
    if "batch_max_tokens" in given and not light["splitfuse_mode"] and batch < total:
        raise LightLLMArgsError(f"--batch_max_tokens ({batch}) must be >= {name('max_req_total_len')} ({total})")


def default_batch_max_tokens(light: dict[str, Any]) -> int:
    """Seed-era rule: a sixth of the KV capacity, but at least one whole request (or splitfuse block)."""
    floor = light["splitfuse_block_size"] if light["splitfuse_mode"] else light["max_req_total_len"]
    return max(int(light["max_total_token_num"] / 6), floor)


def _mapped_values(light: dict[str, Any]) -> dict[str, Any]:
    """LightLLM values -> launcher dests (some need translating)."""
    values = {flag.tgi: light[flag.name] for flag in FLAGS if flag.tgi is not None}
    values["model_id"] = light["model_dir"]
    values["dtype"] = _DATA_TYPES.get(light["data_type"]) if light["data_type"] else None
    values["eos_token_ids"] = list(light["eos_id"] or [])
    values["max_batch_prefill_tokens"] = light["batch_max_tokens"]
    return values


def merge(parsed: ParsedArgs) -> dict[str, Any]:
    """Launcher values: TGI defaults < LightLLM defaults < given values; conflicting givens refused."""
    light, given, tgi_given = dict(parsed.light), parsed.light_given, parsed.tgi_given
    if light["batch_max_tokens"] is None:
        light["batch_max_tokens"] = default_batch_max_tokens(_with_tgi_values(light, given, tgi_given))
    _check_flag_values(_with_tgi_values(light, given, tgi_given), given, tgi_given)
    mapped = _mapped_values(light)
    values = launcher.default_values()
    values.update({dest: value for dest, value in mapped.items() if dest in values})
    for flag in FLAGS:
        if flag.tgi is None or flag.tgi not in tgi_given:
            continue
        tgi_value = tgi_given[flag.tgi]
        if flag.name in given and _normalise(mapped[flag.tgi]) != _normalise(tgi_value):
            raise LightLLMArgsError(
                f"--{flag.name} ({mapped[flag.tgi]}) conflicts with {_tgi_option(flag)} ({tgi_value}): give only one of them"
            )
    values.update({dest: value for dest, value in tgi_given.items() if dest in values})
    values["max_input_length"] = tgi_given.get("max_input_length")
    if values["max_input_length"] is not None and "max_req_input_len" in given:
        raise LightLLMArgsError(
            "--max_req_input_len conflicts with --max-input-length / MAX_INPUT_LENGTH: give only one of them"
        )
    if values["max_input_length"] is not None and "max_input_tokens" not in tgi_given:
        values["max_input_tokens"] = None  # the legacy TGI alias alone decides
    values["env"] = bool(values.get("env"))
    return values


def _with_tgi_values(light: dict[str, Any], given: set[str], tgi_given: dict[str, Any]) -> dict[str, Any]:
    """The LightLLM view of the final values: a TGI value given alone replaces a LightLLM default."""
    merged = dict(light)
    for flag in FLAGS:
        if flag.tgi in tgi_given and flag.name not in given and flag.type is not None and flag.tgi != "dtype":
            merged[flag.name] = tgi_given[flag.tgi]
    return merged


def _normalise(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def unbuilt_features(light: dict[str, Any], given: set[str]) -> list[str]:
    """LightLLM flags that were given but whose feature this server does not have (yet)."""
    unbuilt = [f"--mode {m}" for m in light["mode"] if m not in ATTENTION_MODES | set(QUANT_MODES) | set(KV_MODES)]
    checks = {
        "--tokenizer_mode slow (only the fast tokenizer exists under transformers 5)": "tokenizer_mode" in given
        and light["tokenizer_mode"] == "slow",
        "--splitfuse_block_size (steps are capped by --batch_max_tokens, not per request)": "splitfuse_block_size"
        in given,
    }
    return unbuilt + [name for name, is_set in checks.items() if is_set]


def attention_backend(light: dict[str, Any]) -> str | None:
    return "triton" if ATTENTION_MODES & set(light["mode"]) else None


def quantize_mode(light: dict[str, Any], quantize: str | None) -> str | None:
    """The weight scheme the --mode list names (at most one, agreeing with --quantize), else quantize."""
    modes = [mode for mode in light["mode"] if mode in QUANT_MODES]
    if len(modes) > 1:
        raise LightLLMArgsError(f"--mode {' '.join(modes)} names several weight quantizations: pick one")
    if not modes:
        return quantize
    scheme = QUANT_MODES[modes[0]]
    if quantize is not None and quantize != scheme:
        raise LightLLMArgsError(f"--mode {modes[0]} conflicts with --quantize {quantize}: give only one")
    return scheme


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[ServerConfig, list[str], bool]:
    """(config, unbuilt LightLLM features, print env) from LightLLM + TGI flags and the environment."""
    parsed = parse(argv, environ)
    values = merge(parsed)
    print_env = values["env"]
    if values["hostname"] and not is_ip(values["hostname"]):
        values["hostname"] = "0.0.0.0"
    try:
        config = launcher.config_from_args(values)
    except launcher.LauncherError as error:
        raise LightLLMArgsError(str(error)) from error
    if (backend := attention_backend(parsed.light)) is not None:
        config.attention_backend = backend
    config.quantize = quantize_mode(parsed.light, config.quantize)
    if "triton_fp8kv" in parsed.light["mode"] and config.kv_cache_dtype is None:
        config.kv_cache_dtype = KV_MODES["triton_fp8kv"]
    for flag in FLAGS:
        if flag.config is not None:  # ServerConfig fields with no launcher flag
            setattr(config, flag.config, _normalise(parsed.light[flag.name]))
    return config, unbuilt_features(parsed.light, parsed.light_given), print_env
