"""The LoRA flags, TGI's and vLLM's spellings, into the engine's adapters and limits."""

from __future__ import annotations

import pytest

from tgi_compat.api.cli.launcher import LauncherError, config_from_args, parse_args
from tgi_compat.router.config import LoraSource


def _config(*flags: str):
    return config_from_args(parse_args(["--model-id", "m", *flags]))


def test_off_without_any_lora_flag():
    engine = _config().to_engine_config()
    assert engine.max_loras == 0 and engine.lora_adapters == []


def test_tgi_spelling_with_revisions_and_local_names():
    engine = _config("--lora-adapters", "org/a@v2,local=/data/b, org/c").to_engine_config()
    assert engine.lora_adapters == [
        LoraSource("org/a", "org/a", "v2"),
        LoraSource("local", "/data/b"),
        LoraSource("org/c", "org/c"),
    ]
    assert (engine.max_loras, engine.max_cpu_loras, engine.max_lora_rank) == (3, 8, 64)


def test_vllm_spelling_plain_and_json_with_limits():
    engine = _config(
        "--enable-lora",
        "--lora-modules", "sql=/a/sql",
        "--lora-modules", '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}',
        "--max-loras", "1", "--max-cpu-loras", "4", "--max-lora-rank", "32",
    ).to_engine_config()  # fmt: skip
    assert engine.lora_adapters == [LoraSource("sql", "/a/sql"), LoraSource("chat", "/a/chat")]
    assert (engine.max_loras, engine.max_cpu_loras, engine.max_lora_rank) == (1, 4, 32)
    assert _config("--enable-lora").to_engine_config().max_loras == 1  # adapters come later, at runtime


def test_served_with_num_shard():
    engine = _config("--lora-adapters", "a=/x", "--num-shard", "2").to_engine_config()
    assert (engine.num_shard, engine.lora_adapters) == (2, [LoraSource("a", "/x")])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-modules", "no-path"], "expected name=path or JSON"),
        (["--lora-modules", '{"name": "x"}'], "needs string 'name' and 'path'"),
    ],
)
def test_bad_flags_stop_the_launcher(flags, message):
    with pytest.raises(LauncherError, match=message):
        _config(*flags)
