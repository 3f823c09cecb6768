"""`python -m tgi_compat.api.cli.api_server` flag parsing: LightLLM's names and seed-era defaults mapped
onto the launcher's ServerConfig, LightLLM's own startup checks, and refused TGI conflicts."""

from __future__ import annotations

import pytest

from tgi_compat.api.cli import launcher
from tgi_compat.api.cli.lightllm_args import FLAGS, LightLLMArgsError, build_parser, parse_config


def config_of(*argv: str, **environ: str):
    return parse_config(list(argv), environ)[0]


def unbuilt_of(*argv: str, **environ: str) -> list[str]:
    return parse_config(list(argv), environ)[1]


def test_seed_era_defaults():
    config = config_of()
    assert (config.hostname, config.port) == ("127.0.0.1", 8000)
    assert config.max_batch_total_tokens == 6000  # --max_total_token_num
    assert config.max_input_tokens == 2048 and config.max_total_tokens == 3072
    assert config.max_batch_prefill_tokens == 3072  # max(6000 / 6, max_req_total_len)
    assert config.max_batch_size == 1000  # --running_max_req_size
    assert config.max_waiting_tokens == 10  # --router_max_wait_tokens
    assert config.master_port == 28765 and config.num_shard == 1
    assert config.dtype is None and config.attention_backend is None
    assert unbuilt_of() == []


def test_flags_map_onto_the_launcher_fields():
    config = config_of(
        "--host", "0.0.0.0", "--port", "9001", "--model_dir", "/models/x", "--max_total_token_num", "120000",
        "--running_max_req_size", "64", "--max_req_input_len", "1000", "--max_req_total_len", "4000",
        "--nccl_port", "30000", "--data_type", "bf16", "--trust_remote_code", "--router_max_wait_tokens", "4",
    )  # fmt: skip
    assert (config.hostname, config.port, config.model_id) == ("0.0.0.0", 9001, "/models/x")
    assert config.max_batch_total_tokens == 120000 and config.max_batch_prefill_tokens == 20000
    assert (config.max_input_tokens, config.max_total_tokens, config.max_batch_size) == (1000, 4000, 64)
    assert (config.master_port, config.dtype, config.trust_remote_code, config.max_waiting_tokens) == (
        30000,
        "bfloat16",
        True,
        4,
    )


def test_batch_max_tokens_default_with_splitfuse_uses_the_block_size():
    assert config_of("--splitfuse_mode", "--max_total_token_num", "3072").max_batch_prefill_tokens == 512
    assert config_of("--splitfuse_mode", "--max_total_token_num", "1200", "--max_req_total_len", "1000",
                     "--max_req_input_len", "500").max_batch_prefill_tokens == 256  # fmt: skip


def test_explicit_batch_max_tokens_must_hold_a_whole_request():
    assert config_of("--batch_max_tokens", "3072").max_batch_prefill_tokens == 3072
    with pytest.raises(LightLLMArgsError, match=r"--batch_max_tokens \(3071\) must be >= --max_req_total_len \(3072\)"):
        config_of("--batch_max_tokens", "3071")
    assert config_of("--splitfuse_mode", "--batch_max_tokens", "256").max_batch_prefill_tokens == 256


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_req_input_len", "3072"], r"--max_req_input_len \(3072\) must be < --max_req_total_len \(3072\)"),
        (["--max_total_token_num", "3000"], r"--max_req_total_len \(3072\) must be <= --max_total_token_num \(3000\)"),
        (["--load_way", "DS"], r"--load_way DS is not supported"),
        (["--mode", "triton_gqa_flashdecoding", "turbo_attention"], r"--mode turbo_attention is unknown"),
    ],
)
def test_lightllm_startup_checks_refuse_clearly(argv, message):
    with pytest.raises(LightLLMArgsError, match=message):
        config_of(*argv)


@pytest.mark.parametrize("mode", ["triton_flashdecoding", "triton_gqa_flashdecoding", "triton_gqa_attention"])
def test_triton_attention_modes_select_the_triton_backend(mode):
    assert config_of("--mode", mode).attention_backend == "triton"


def test_known_but_unbuilt_modes_are_accepted_and_named():
    config, unbuilt, _ = parse_config(["--mode", "triton_gqa_flashdecoding", "triton_int8kv", "triton_w4a16g64"], {})
    assert config.attention_backend == "triton"
    assert unbuilt == ["--mode triton_int8kv", "--mode triton_w4a16g64"]


def test_unbuilt_flags_are_named_only_when_given():
    unbuilt = unbuilt_of("--splitfuse_block_size", "256", "--tokenizer_mode", "slow", "--metric_gateway", "h:9091")
    assert any("--splitfuse_block_size" in u for u in unbuilt)
    assert any("--tokenizer_mode slow" in u for u in unbuilt)
    assert not any("--metric_gateway" in u for u in unbuilt)  # built: tgi_compat.api.server.ops_services
    assert unbuilt_of("--tokenizer_mode", "fast", "--use_tgi_api", "--health_monitor", "--diverse_mode") == []
    assert unbuilt_of("--use_dynamic_prompt_cache") == []  # built: tgi_compat/router/prefix_cache.py
    assert (
        unbuilt_of("--beam_mode", "--use_reward_model", "--enable_multimodal") == []
    )  # built: serving/beam_generate.py, pooling models
    assert config_of("--beam_mode").beam_mode is True
    # --diverse_mode reaches the engine: siblings decode through the shared-prefix kernel
    assert config_of("--diverse_mode").to_engine_config().diverse_mode is True
    assert config_of().to_engine_config().diverse_mode is False


def test_dynamic_prompt_cache_flags_turn_prefix_caching_on_and_off():
    assert config_of().prefix_caching is True  # LightLLM v1's default
    assert config_of("--use_dynamic_prompt_cache").prefix_caching is True
    assert config_of("--disable_dynamic_prompt_cache").to_engine_config().prefix_caching is False
    assert config_of("--no-enable-prefix-caching").prefix_caching is False
    with pytest.raises(LightLLMArgsError):
        config_of("--use_dynamic_prompt_cache", "--disable_dynamic_prompt_cache")


def test_health_monitor_turns_on_engine_restarts():
    assert config_of("--health_monitor").health_monitor is True
    assert config_of().health_monitor is False


def test_tensor_parallel_is_passed_on_and_built():
    config = config_of("--tp", "2", "--nccl_port", "29123")
    assert config.num_shard == 2 and config.master_port == 29123
    assert not any("shard" in name for name in launcher.unimplemented_options(config))


@pytest.mark.parametrize(
    "argv, environ, message",
    [
        (["--max_total_token_num", "8000"], {"MAX_BATCH_TOTAL_TOKENS": "9000"}, "--max_total_token_num"),
        (["--max_total_token_num", "8000", "--max-batch-total-tokens", "9000"], {}, "--max-batch-total-tokens"),
        (["--port", "8001"], {"PORT": "80"}, "--port"),
        (["--data_type", "bf16", "--dtype", "float16"], {}, "--data_type"),
        (["--max_req_total_len", "4000"], {"MAX_TOTAL_TOKENS": "5000"}, "MAX_TOTAL_TOKENS"),
        (["--model_dir", "/a"], {"MODEL_ID": "/b"}, "--model_dir"),
        (["--max_req_input_len", "100"], {"MAX_INPUT_LENGTH": "100"}, "--max-input-length"),
    ],
)
def test_a_lightllm_flag_and_its_tgi_equivalent_conflict(argv, environ, message):
    with pytest.raises(LightLLMArgsError, match="conflicts with") as error:
        config_of(*argv, **environ)
    assert message in str(error.value)


def test_equal_values_given_both_ways_are_not_a_conflict():
    config = config_of(
        "--max_total_token_num", "8000", "--data_type", "fp16", MAX_BATCH_TOTAL_TOKENS="8000", DTYPE="float16"
    )
    assert config.max_batch_total_tokens == 8000 and config.dtype == "float16"


def test_a_tgi_value_given_alone_replaces_the_lightllm_default():
    config = config_of(PORT="80", MAX_TOTAL_TOKENS="1024", MAX_INPUT_TOKENS="1000", MAX_BATCH_TOTAL_TOKENS="50000")
    assert (config.port, config.max_total_tokens, config.max_input_tokens) == (80, 1024, 1000)
    assert config.max_batch_total_tokens == 50000
    assert config.max_batch_prefill_tokens == 8333  # the seed rule over the TGI capacity


def test_tgi_only_flags_pass_through():
    config = config_of("--max-best-of", "4", "--api-key", "k", MAX_STOP_SEQUENCES="6")
    assert (config.max_best_of, config.api_key, config.max_stop_sequences) == (4, "k", 6)


def test_checks_name_the_tgi_option_that_was_given():
    with pytest.raises(
        LightLLMArgsError, match="--max-input-tokens / MAX_INPUT_TOKENS \\(100\\) must be < --max-total-tokens"
    ):
        config_of("--max-input-tokens", "100", "--max-total-tokens", "50")


def test_the_launchers_own_checks_still_apply():
    with pytest.raises(LightLLMArgsError, match=r"`validation_workers` must be > 0"):
        config_of("--validation-workers", "0")


def test_bad_choices_exit_like_argparse():
    with pytest.raises(SystemExit):
        config_of("--tokenizer_mode", "fastest")
    with pytest.raises(SystemExit):
        config_of("--long_truncation_mode", "tail")


def test_help_documents_every_lightllm_and_launcher_flag():
    text = build_parser().format_help()
    for flag in FLAGS:
        assert f"--{flag.name}" in text
    for flag in launcher.FLAGS:
        assert f"--{flag.name}" in text
    assert "MAX_BATCH_TOTAL_TOKENS]" in text  # each LightLLM flag names its TGI equivalent


def test_lightllm_only_options_reach_the_config_and_the_engine():
    config = config_of(
        "--eos_id", "2", "7", "--long_truncation_mode", "center", "--token_healing_mode",
        "--return_all_prompt_logprobs", "--router_token_ratio", "0.5", "--router_max_new_token_len", "256",
    )  # fmt: skip
    assert config.eos_token_ids == [2, 7]
    assert (config.long_truncation_mode, config.token_healing, config.return_all_prompt_logprobs) == (
        "center",
        True,
        True,
    )
    engine = config.to_engine_config()
    assert (engine.eos_token_ids, engine.router_token_ratio, engine.router_max_new_token_len) == ([2, 7], 0.5, 256)
    assert config_of("--long_truncation_mode", "None").long_truncation_mode is None


def test_lightllm_only_options_conflict_with_their_launcher_spelling():
    with pytest.raises(LightLLMArgsError, match="--long_truncation_mode"):
        config_of("--long_truncation_mode", "head", LONG_TRUNCATION_MODE="center")
    with pytest.raises(LightLLMArgsError, match="--eos_id"):
        config_of("--eos_id", "2", "--eos-token-ids", "3")
    assert config_of("--eos_id", "2", "3", EOS_TOKEN_IDS="2,3").eos_token_ids == [2, 3]


def test_the_tgi_launcher_accepts_the_lightllm_options(monkeypatch):
    for flag in launcher.FLAGS:
        monkeypatch.delenv(flag.env, raising=False)
    argv = ["--long-truncation-mode", "head", "--token-healing", "--return-all-prompt-logprobs",
            "--eos-token-ids", "2,9", "--router-token-ratio", "0.3", "--router-max-new-token-len", "128"]  # fmt: skip
    config = launcher.config_from_args(launcher.parse_args(argv))
    assert (config.long_truncation_mode, config.token_healing, config.return_all_prompt_logprobs) == (
        "head",
        True,
        True,
    )
    assert (config.eos_token_ids, config.router_token_ratio, config.router_max_new_token_len) == ([2, 9], 0.3, 128)
    defaults = launcher.config_from_args(launcher.parse_args([]))
    assert (defaults.long_truncation_mode, defaults.token_healing, defaults.eos_token_ids) == (None, False, [])
    help_text = launcher.build_parser().format_help()
    for name in ("--long-truncation-mode", "--token-healing", "--return-all-prompt-logprobs", "--eos-token-ids"):
        assert name in help_text


def test_dockers_hostname_variable_is_not_a_listen_address():
    assert config_of("--host", "0.0.0.0", HOSTNAME="3f2a9c1b7d4e").hostname == "0.0.0.0"
    assert config_of(HOSTNAME="3f2a9c1b7d4e").hostname == "127.0.0.1"
    with pytest.raises(LightLLMArgsError, match="--host"):
        config_of("--host", "0.0.0.0", HOSTNAME="10.0.0.5")


def test_push_gateway_and_stats_flags_fill_the_ops_fields():
    config = config_of(
        "--metric_gateway", "gw:9091", "--job_name", "svc", "--grouping_key", "a=b", "--grouping_key", "c=d",
        "--push_interval", "5", "--enable_monitor_auth", "--log_stats_interval", "3",
    )  # fmt: skip
    assert (config.metric_gateway, config.metric_job_name, config.metric_grouping_key) == (
        "gw:9091",
        "svc",
        ["a=b", "c=d"],
    )
    assert (config.metric_push_interval, config.enable_monitor_auth, config.log_stats_interval) == (5, True, 3)
    defaults = config_of()
    assert (defaults.metric_gateway, defaults.log_stats_interval, defaults.disable_log_stats) == (None, 10, False)
    assert config_of("--disable_log_stats").disable_log_stats
