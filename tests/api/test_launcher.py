"""text-generation-launcher flags, environment variables, defaults and argument errors."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from tgi_compat.api.cli.launcher import (
    FLAGS,
    LauncherError,
    build_parser,
    config_from_args,
    parse_args,
    resolve_num_shard,
    unimplemented_options,
)
from tgi_compat.api.config import ServerConfig
from tgi_compat.api.server.http_protocol import HEAD_READ_TIMEOUT_S


def _config(argv: list[str]) -> ServerConfig:
    return config_from_args(parse_args(argv))


def test_defaults_follow_tgi(monkeypatch):
    for flag in FLAGS:
        monkeypatch.delenv(flag.env, raising=False)
    config = _config([])
    assert config.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (config.port, config.hostname, config.prometheus_port) == (3000, "0.0.0.0", 9000)
    assert (config.max_concurrent_requests, config.max_best_of, config.max_stop_sequences) == (128, 2, 4)
    assert (config.max_top_n_tokens, config.payload_limit, config.max_client_batch_size) == (5, 2_000_000, 4)
    assert config.header_read_timeout == HEAD_READ_TIMEOUT_S == 30.0  # hyper's header_read_timeout
    assert config.max_total_tokens is None and config.max_input_tokens is None
    assert not config.enable_prefill_logprobs and not config.trust_remote_code
    assert unimplemented_options(config) == []


def test_environment_fills_flags_and_flags_win(monkeypatch):
    monkeypatch.setenv("PORT", "80")
    monkeypatch.setenv("MAX_TOTAL_TOKENS", "1024")
    monkeypatch.setenv("TRUST_REMOTE_CODE", "true")
    monkeypatch.setenv("ENABLE_PREFILL_LOGPROBS", "false")
    monkeypatch.setenv("CORS_ALLOW_ORIGIN", "http://a,http://b")
    config = _config(["--max-total-tokens", "2048"])
    assert config.port == 80 and config.max_total_tokens == 2048
    assert config.trust_remote_code and not config.enable_prefill_logprobs
    assert config.cors_allow_origin == ["http://a", "http://b"]


def test_docker_hostname_falls_back_to_any_address(monkeypatch):
    monkeypatch.setenv("HOSTNAME", "3f2a9c1b7d4e")
    assert _config([]).hostname == "0.0.0.0"
    assert _config(["--hostname", "127.0.0.1"]).hostname == "127.0.0.1"


def test_every_flag_is_accepted_and_documented():
    parser = build_parser()
    help_text = parser.format_help()
    for flag in FLAGS:
        assert f"--{flag.name}" in help_text and flag.env in help_text
    argv = ["--sharded", "false", "--num-shard", "1", "--quantize", "gptq", "--cuda-graphs", "1,2,4", "-p", "8080",
            "--cors-allow-origin", "x", "--cors-allow-origin", "y", "--usage-stats", "off", "-e", "--json-output"]  # fmt: skip
    config = _config(argv)
    assert config.cuda_graphs == [1, 2, 4] and config.port == 8080 and config.cors_allow_origin == ["x", "y"]
    assert config.num_shard == 1 and config.quantize == "gptq"
    assert unimplemented_options(config) == []  # quantization is built: the engine applies it
    assert _config(["--cuda-graphs", "0"]).cuda_graphs == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--max-input-tokens", "10", "--max-total-tokens", "10"],
            "`max_input_tokens`(10) must be < `max_total_tokens`(10)",
        ),
        (["--max-input-length", "5", "--max-input-tokens", "5"], "`max_input_tokens` and `max_input_length`"),
        (
            ["--max-total-tokens", "100", "--max-batch-total-tokens", "50"],
            "`max_total_tokens` must be <= `max_batch_total_tokens`. Given: 100 and 50",
        ),
        (["--validation-workers", "0"], "`validation_workers` must be > 0"),
    ],
)
def test_argument_errors(argv, message):
    with pytest.raises(LauncherError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        _config(argv)


@pytest.mark.parametrize("value", ["bitsandbytes", "bitsandbytes-nf4", "exl2", "marlin"])
def test_unbuilt_quantize_values_are_refused(value: str):
    with pytest.raises(LauncherError, match=f"--quantize {value} is not supported by this server"):
        _config(["--quantize", value])


def test_vllm_quantization_flag_fills_quantize():
    assert _config(["--quantization", "weight_only_int8"]).to_engine_config().quantize == "weight_only_int8"
    assert _config(["--quantization", "fp8", "--quantize", "fp8"]).quantize == "fp8"
    with pytest.raises(LauncherError, match="conflicts with --quantize"):
        _config(["--quantization", "awq", "--quantize", "gptq"])


@pytest.mark.parametrize("value", ["fp8_e4m3fn", "fp8_e5m2", "fp8", "fp8_e4m3"])
def test_kv_cache_dtype_reaches_the_engine(value: str):
    config = _config(["--kv-cache-dtype", value])
    assert config.to_engine_config().kv_cache_dtype == value and unimplemented_options(config) == []


def test_load_format_reaches_the_engine_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv("LOAD_FORMAT", raising=False)
    assert _config([]).to_engine_config().load_format == "auto"
    assert _config(["--load-format", "dummy"]).to_engine_config().load_format == "dummy"
    monkeypatch.setenv("LOAD_FORMAT", "dummy")
    assert _config([]).to_engine_config().load_format == "dummy"
    with pytest.raises(SystemExit):
        _config(["--load-format", "safetensors-of-another-kind"])


def test_legacy_max_input_length_is_an_alias():
    assert _config(["--max-input-length", "100"]).max_input_tokens == 100


def test_bad_values_exit_with_usage_error():
    result = subprocess.run(
        [sys.executable, "-m", "tgi_compat.api.cli.launcher", "--quantize", "nope"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "possible values" in result.stderr


def test_engine_config_carries_engine_options():
    argv = ["--max-batch-total-tokens", "4096", "--max-batch-size", "8", "--max-batch-prefill-tokens", "512"]
    config = _config([*argv, "--max-mixed-prefill-tokens", "128"])
    engine = config.to_engine_config()
    assert (engine.max_batch_total_tokens, engine.max_running_requests, engine.max_batch_prefill_tokens) == (
        4096,
        8,
        512,
    )
    assert engine.max_mixed_prefill_tokens == 128
    assert _config(argv).to_engine_config().max_mixed_prefill_tokens is None  # the default: any step's budget
    assert engine.model_id == config.model_id


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, 1),
        (["--num-shard", "3"], {}, 3),
        (["--tensor-parallel-size", "2"], {}, 2),
        (["-tp", "2"], {}, 2),
        (["--sharded", "false"], {"CUDA_VISIBLE_DEVICES": "0,1"}, 1),
        (["--num-shard", "2", "--sharded", "true"], {}, 2),
        ([], {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4 if torch.cuda.is_available() else 1),
        ([], {"NUM_SHARD": "2"}, 2),
    ],
)
def test_num_shard_resolves_as_tgi_does(argv, env, expected, monkeypatch):
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NUM_SHARD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _config(argv).num_shard == expected


def test_num_shard_defaults_to_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert resolve_num_shard(None, None, "cuda") == (4 if torch.cuda.is_available() else 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert resolve_num_shard(True, None, "cuda") == 2


@pytest.mark.parametrize(
    ("sharded", "num_shard", "env", "message"),
    [
        (True, 1, None, "`sharded` is true but `num_shard` <= 1"),
        (True, None, "0", "`sharded` is true but only found 1 CUDA devices"),
        (True, None, None, "--num-shard and CUDA_VISIBLE_DEVICES/NVIDIA_VISIBLE_DEVICES are not set"),
        (None, 0, None, "`num_shard` cannot be < 1"),
    ],
)
def test_num_shard_errors_are_tgis(sharded, num_shard, env, message, monkeypatch):
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    if env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    with pytest.raises(LauncherError, match=re.escape(message)):
        resolve_num_shard(sharded, num_shard, None)


def test_num_shard_and_tensor_parallel_size_must_agree():
    with pytest.raises(LauncherError, match="give only one"):
        _config(["--num-shard", "2", "-tp", "4"])


def test_prefix_caching_in_every_spelling(monkeypatch):
    for flag in FLAGS:
        monkeypatch.delenv(flag.env, raising=False)
    assert _config([]).to_engine_config().prefix_caching is True  # on by default, as in TGI 3
    assert _config(["--no-enable-prefix-caching"]).to_engine_config().prefix_caching is False
    monkeypatch.setenv("PREFIX_CACHING", "0")
    assert _config([]).prefix_caching is False
    assert _config(["--enable-prefix-caching"]).prefix_caching is True  # the flag wins over the environment
    monkeypatch.setenv("PREFIX_CACHING", "1")
    assert _config([]).prefix_caching is True
    with pytest.raises(LauncherError, match="contradict"):
        _config(["--enable-prefix-caching", "--no-enable-prefix-caching"])
    assert _config([]).enable_prompt_tokens_details is False
    assert _config(["--enable-prompt-tokens-details"]).enable_prompt_tokens_details is True


def test_speculation_flags_reach_the_engine():
    assert _config([]).to_engine_config().speculative is None
    assert _config(["--speculate", "0"]).to_engine_config().speculative is None
    tgi = _config(["--speculate", "4"])
    assert unimplemented_options(tgi) == []
    speculative = tgi.to_engine_config().speculative
    assert speculative is not None and (speculative.method, speculative.num_speculative_tokens) == ("ngram", 4)
    vllm = _config(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}'])
    speculative = vllm.to_engine_config().speculative
    assert speculative is not None and speculative.num_speculative_tokens == 3 and speculative.ngram.min_n == 2
    suffix = _config(["--speculative-config", '{"method": "suffix", "num_speculative_tokens": 8}'])
    assert suffix.to_engine_config().speculative.method == "suffix"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}'], "not supported"),
        (["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}'], "EAGLE-3 head is given as"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "model": "x"}'], "only for eagle3"),
        (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens"),
        (["--speculate", "2", "--speculative-config", '{"num_speculative_tokens": 2}'], "not both"),
    ],
)
def test_speculation_flag_errors(argv, message):
    with pytest.raises(LauncherError, match=message):
        _config(argv)
