"""`python -m tgi_compat.api.cli.api_server`: a real start with LightLLM flags (their server defaults
reach requests, requests can override them), refused conflicts, and --help."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from harness import CHAT_PROMPT, REPO_ROOT, _free_port, launched

MAX_INPUT, MAX_TOTAL = 64, 128
LONG_PROMPT = "one two three four five six seven eight nine ten " * 10  # ~100 tokens
THE_ID = 504  # SmolLM2's "The": the chat prompt's answer ("The capital of France is Paris.") starts with it


def api_server_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "tgi_compat.api.cli.api_server", *flags]


def _clean_env() -> dict[str, str]:
    # No TGI variable may leak in from the caller: it would conflict with (or replace) a LightLLM flag.
    from tgi_compat.api.cli.launcher import FLAGS

    return {k: v for k, v in os.environ.items() if k not in {flag.env for flag in FLAGS}} | {"LOG_LEVEL": "info"}


@pytest.fixture(scope="module")
def lightllm_server():
    port = _free_port()
    command = api_server_command(
        "--host", "127.0.0.1", "--port", str(port), "--max_total_token_num", "1024",
        "--max_req_input_len", str(MAX_INPUT), "--max_req_total_len", str(MAX_TOTAL), "--running_max_req_size", "8",
        "--long_truncation_mode", "center", "--return_all_prompt_logprobs", "--eos_id", "2", str(THE_ID), "--splitfuse_block_size", "256",
    )  # fmt: skip
    with launched(list(command), _clean_env(), "api-server-") as handle:
        yield handle


def test_limits_come_from_the_lightllm_flags(lightllm_server):
    info = httpx.get(f"{lightllm_server.base_url}/info", timeout=30).json()
    assert (info["max_input_tokens"], info["max_total_tokens"]) == (MAX_INPUT, MAX_TOTAL)


def test_one_startup_warning_names_the_unbuilt_flags(lightllm_server):
    warnings = [line for line in lightllm_server.log_tail(200_000).splitlines() if "not implemented yet" in line]
    assert len(warnings) == 1 and "--splitfuse_block_size" in warnings[0]


def test_every_eos_id_ends_generation(lightllm_server):
    params = {"max_new_tokens": 10, "details": True}
    body = httpx.post(
        f"{lightllm_server.base_url}/generate", json={"inputs": CHAT_PROMPT, "parameters": params}, timeout=120
    ).json()
    details = body["details"]
    assert [t["id"] for t in details["tokens"]] == [THE_ID]
    assert details["finish_reason"] == "eos_token"


def test_server_defaults_apply_to_requests(lightllm_server):
    tokens = httpx.post(f"{lightllm_server.base_url}/tokenize", json={"inputs": LONG_PROMPT}, timeout=30).json()
    body = httpx.post(
        f"{lightllm_server.base_url}/generate",
        json={"inputs": LONG_PROMPT, "parameters": {"max_new_tokens": 2}},
        timeout=120,
    ).json()
    details = body["details"]  # --return_all_prompt_logprobs: details come back without details=true
    assert details["truncated_prompt_tokens"] == len(tokens) - MAX_INPUT  # --long_truncation_mode center
    ids = [t["id"] for t in tokens]
    assert [t["id"] for t in details["prefill"]] == ids[: MAX_INPUT // 2] + ids[-(MAX_INPUT // 2) :]
    assert details["prefill"][0]["logprob"] is None


def test_requests_can_turn_the_defaults_off(lightllm_server):
    params = {"max_new_tokens": 2, "long_truncation_mode": "none", "return_all_prompt_logprobs": False}
    response = httpx.post(
        f"{lightllm_server.base_url}/generate", json={"inputs": LONG_PROMPT, "parameters": params}, timeout=120
    )
    assert response.status_code == 422
    body = httpx.post(
        f"{lightllm_server.base_url}/generate", json={"inputs": "Hello", "parameters": params}, timeout=120
    ).json()
    assert "details" not in body


@pytest.mark.parametrize(
    "flags, environ, message",
    [
        (["--max_total_token_num", "8000"], {"MAX_BATCH_TOTAL_TOKENS": "9000"}, "conflicts with"),
        (["--load_way", "DS"], {}, "--load_way DS is not supported"),
        (["--mode", "turbo_attention"], {}, "--mode turbo_attention is unknown"),
    ],
)
def test_refused_starts_exit_non_zero_with_a_clear_message(flags, environ, message):
    done = subprocess.run(
        api_server_command(*flags),
        capture_output=True,
        text=True,
        env=_clean_env() | environ,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert done.returncode == 1
    assert message in done.stderr


def test_help_lists_both_flag_families():
    done = subprocess.run(api_server_command("--help"), capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0
    for flag in ("--max_total_token_num", "--long_truncation_mode", "--token_healing_mode", "--max-batch-total-tokens"):
        assert flag in done.stdout
