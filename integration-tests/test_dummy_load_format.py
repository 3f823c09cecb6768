"""--load-format dummy (vLLM's flag; here through its LOAD_FORMAT environment variable) on the real
launcher with --num-shard 2 (gloo): a folder holding only config.json and a tokenizer serves
/generate, each rank making its own slice of every random weight."""

from __future__ import annotations

import os

import httpx
import pytest
from harness import _free_port, _launcher_command, launched
from test_model_families import byte_level_tokenizer


@pytest.fixture(scope="module")
def dummy_server(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama-config-only")
    tokenizer = byte_level_tokenizer()
    tokenizer.save_pretrained(folder)
    LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, architectures=["LlamaForCausalLM"],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    ).save_pretrained(folder)  # fmt: skip
    assert not any(name.endswith((".safetensors", ".gguf", ".bin")) for name in os.listdir(folder))
    command = [*_launcher_command(_free_port()), "--model-id", str(folder), "--num-shard", "2"]
    env = {**os.environ, "LOAD_FORMAT": "dummy"}
    with launched(command + ["--master-port", str(_free_port())], env, "launcher-dummy-tp2-") as handle:
        yield handle


def test_a_config_only_folder_serves_generate_on_two_ranks(dummy_server):
    body = {"inputs": "Random weights, real shapes.", "parameters": {"max_new_tokens": 8, "details": True}}
    answers = [httpx.post(f"{dummy_server.base_url}/generate", json=body, timeout=120) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    first, second = (a.json() for a in answers)
    assert first["details"]["generated_tokens"] >= 1
    assert first["details"]["finish_reason"] in ("length", "eos_token")
    # greedy on fixed (seeded) weights: the same text and ids again
    assert second["generated_text"] == first["generated_text"]
    assert [t["id"] for t in second["details"]["tokens"]] == [t["id"] for t in first["details"]["tokens"]]
    assert "tp-rank-1" in "".join(open(f"/proc/{pid}/comm").read() for pid in _children(dummy_server.process.pid))


def _children(pid: int) -> list[str]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return f.read().split()
