"""AIAK's server argument table (`python -m tgi_compat.openai_server`, `tgi-compat-serve MODEL`), row by row:
each argument parses and changes the ServerConfig field it says, sets nothing where it describes what this
engine always does, or refuses the start with its reason."""

from __future__ import annotations

import pytest

from tgi_compat.api.cli.aiak_args import FLAGS, AiakArgsError, build_parser, parse_config

# (argv, ServerConfig field, value): each differs from the value without the argument
MAPPED = [
    (["--host", "127.0.0.1"], "hostname", "127.0.0.1"),
    (["--port", "9001"], "port", 9001),
    (["--model", "/models/llama"], "model_id", "/models/llama"),
    (["/models/llama"], "model_id", "/models/llama"),  # positional, as `vllm serve MODEL`
    (["/models/llama", "--model", "/models/llama", "--tokenizer", "/models/llama"], "model_id", "/models/llama"),
    (["--trust-remote-code"], "trust_remote_code", True),
    (["--dtype", "half"], "dtype", "float16"),
    (["--dtype", "float16"], "dtype", "float16"),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
    (["--dtype", "float"], "dtype", "float32"),
    (["--dtype", "float32"], "dtype", "float32"),
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype", "fp8"),
    (["--kv-cache-dtype", "fp8_e5m2"], "kv_cache_dtype", "fp8_e5m2"),
    (["--max-model-len", "4096"], "max_total_tokens", 4096),
    (["--tensor-parallel-size", "2"], "num_shard", 2),
    (["-tp", "4"], "num_shard", 4),
    (["--no-enable-prefix-caching"], "prefix_caching", False),
    (["--gpu-memory-utilization", "0.5"], "cuda_memory_fraction", 0.5),
    (["--max-num-batched-tokens", "2048"], "max_batch_prefill_tokens", 2048),
    (["--max-num-seqs", "64"], "max_batch_size", 64),
    (["--quantization", "weight_only_int8"], "quantize", "weight_only_int8"),
    (["-q", "fp8"], "quantize", "fp8"),
    (["--enforce-eager"], "enforce_eager", True),
    (["--disable-async-output-proc"], "overlap_scheduling", False),
    (["--chat-template", "{{ messages[0].content }}"], "chat_template", "{{ messages[0].content }}"),
    (["--lora-modules", "sql=/lora/sql", '{"name": "chat", "path": "/lora/chat"}'], "lora_modules", ["sql=/lora/sql", '{"name": "chat", "path": "/lora/chat"}']),
]  # fmt: skip

# Accepted values of arguments that set nothing: what they ask for is what this engine does anyway.
WITHOUT_EFFECT = [
    ["--enable-prefix-caching"],  # on by default here
    ["--dtype", "auto"],
    ["--kv-cache-dtype", "auto"],
    ["--tokenizer", "HuggingFaceTB/SmolLM2-135M-Instruct"],  # the default model's own
    ["--distributed-executor-backend", "mp"],
    ["--max-seq-len-to-capture", "1024"],
    ["--num-scheduler-steps", "1"],
    ["--pipeline-parallel-size", "1"],
    ["-pp", "1"],
    ["--scheduler-delay-factor", "0"],
    ["--enable-chunked-prefill"],
]

# (argv, the one-line reason the start is refused with)
REFUSED = [
    (["--model", "/models/llama", "--tokenizer", "/models/other"], "--tokenizer /models/other: a tokenizer other than the model's is not supported"),
    (["--tokenizer-extension-path", "/ext"], "--tokenizer-extension-path /ext: tokenizer extensions are not supported"),
    (["--distributed-executor-backend", "ray"], "--distributed-executor-backend ray: Ray is not supported"),
    (["--num-scheduler-steps", "8"], "--num-scheduler-steps 8: multi-step scheduling is not built"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2: pipeline parallelism is not built"),
    (["-pp", "4"], "--pipeline-parallel-size 4: pipeline parallelism is not built"),
    (["--scheduler-delay-factor", "0.5"], "--scheduler-delay-factor 0.5: delayed prompt scheduling is not built"),
    (["/models/llama", "--model", "/models/other"], "the positional MODEL (/models/llama) and --model (/models/other) differ"),
    (["--tensor-parallel-size", "0"], "`num_shard` cannot be < 1"),  # the launcher's own check
]  # fmt: skip


@pytest.mark.parametrize("argv, field, value", MAPPED)
def test_each_argument_sets_its_field(argv, field, value):
    assert getattr(parse_config(argv), field) == value
    assert getattr(parse_config([]), field) != value


@pytest.mark.parametrize("argv", WITHOUT_EFFECT)
def test_arguments_describing_what_the_engine_does_change_nothing(argv):
    assert parse_config(argv) == parse_config([])


@pytest.mark.parametrize("argv, reason", REFUSED)
def test_missing_features_refuse_the_start_with_their_reason(argv, reason):
    with pytest.raises(AiakArgsError) as refused:
        parse_config(argv)
    assert str(refused.value).startswith(reason)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["--dtype", "int8"],
        ["--quantization", "exl2"],
        ["--kv-cache-dtype", "int8"],
        ["--distributed-executor-backend", "uni"],
    ],
)
def test_values_outside_the_choices_are_argument_errors(argv):
    with pytest.raises(SystemExit):
        parse_config(argv)


def test_defaults_are_vllm_s():
    config = parse_config([])
    assert (config.hostname, config.port, config.num_shard) == ("0.0.0.0", 8000, 1)
    assert config.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded model
    assert (config.cuda_memory_fraction, config.max_batch_size) == (0.9, 256)
    assert config.dtype is None and config.kv_cache_dtype is None and config.max_total_tokens is None
    assert config.prefix_caching and config.overlap_scheduling is None and not config.enforce_eager


def test_engine_switches_reach_the_engine_config():
    assert parse_config(["--disable-async-output-proc"]).to_engine_config().overlap_scheduling is False
    assert parse_config(["--enforce-eager"]).to_engine_config().cuda_graphs == []
    engine = parse_config(["--max-num-batched-tokens", "512", "--max-num-seqs", "8"]).to_engine_config()
    assert (engine.max_batch_prefill_tokens, engine.max_running_requests) == (512, 8)


def test_every_row_is_tested_and_documented():
    tested = {arg for case in MAPPED + REFUSED for arg in case[0]} | {arg for argv in WITHOUT_EFFECT for arg in argv}
    help_text = build_parser().format_help()
    unwrapped = "".join(help_text.split())  # argparse wraps lines, at spaces and after hyphens
    for flag in FLAGS:
        assert f"--{flag.name}" in tested, f"--{flag.name} has no row in this test"
        assert f"--{flag.name}" in help_text and "".join(flag.help.split()) in unwrapped
        if flag.short:
            assert f"-{flag.short} " in help_text
    assert "MODEL" in help_text and "--no-enable-prefix-caching" in help_text


def test_the_lora_row_turns_lora_on():
    config = parse_config(["--lora-modules", "sql=/lora/sql"])
    assert config.lora_enabled and [source.name for source in config.lora_sources] == ["sql"]
