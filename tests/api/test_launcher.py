"""text-generation-launcher flags, environment variables, defaults and argument errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tgi_compat.cli.config import ServerConfig
from tgi_compat.cli.launcher import (
    FLAGS,
    LauncherError,
    build_parser,
    config_from_args,
    parse_args,
    unimplemented_options,
)


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
    assert config.sharded is False and config.quantize == "gptq"
    assert unimplemented_options(config) == ["--quantize"]
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


def test_legacy_max_input_length_is_an_alias():
    assert _config(["--max-input-length", "100"]).max_input_tokens == 100


def test_bad_values_exit_with_usage_error():
    result = subprocess.run(
        [sys.executable, "-m", "tgi_compat.cli.launcher", "--quantize", "nope"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "possible values" in result.stderr


def test_engine_config_carries_engine_options():
    config = _config(["--max-batch-total-tokens", "4096", "--max-batch-size", "8", "--max-batch-prefill-tokens", "512"])
    engine = config.to_engine_config()
    assert (engine.max_batch_total_tokens, engine.max_running_requests, engine.max_batch_prefill_tokens) == (
        4096,
        8,
        512,
    )
    assert engine.model_id == config.model_id
