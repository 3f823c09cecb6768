"""LoRA adapters on the real launcher (embedded SmolLM2): TGI's --lora-adapters and vLLM's --lora-modules, a
request's adapter picked by `adapter_id` (HTTP, huggingface_hub) or `model` (openai), and an unknown
adapter refused with the loaded ones named while the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from harness import _free_port, _launcher_command, launched

from tests.lora_adapters import write_smollm2_adapter  # (the repository root is on the path, as for tests/)

PROMPT = "The capital of France is"
PARAMS = {"max_new_tokens": 8, "details": True}


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    import os

    root = tmp_path_factory.mktemp("lora-server")
    a1, a2 = write_smollm2_adapter(root / "a1", 8, seed=1), write_smollm2_adapter(root / "a2", 16, seed=2)
    command = [*_launcher_command(_free_port()), "--lora-adapters", f"a1={a1}", "--lora-modules", f"a2={a2}"]
    with launched(command, dict(os.environ), "launcher-lora-") as handle:
        yield handle


def _generate(server, adapter_id: str | None) -> dict:
    body = {"inputs": PROMPT, "parameters": {**PARAMS, "adapter_id": adapter_id}}
    answer = httpx.post(f"{server.base_url}/generate", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _logprobs(answer: dict) -> list[float]:
    return [token["logprob"] for token in answer["details"]["tokens"]]


def test_adapter_id_through_http_and_huggingface_hub(lora_server):
    from huggingface_hub import InferenceClient

    base, a1, a2 = (_generate(lora_server, name) for name in (None, "a1", "a2"))
    assert _logprobs(a1) != _logprobs(base) and _logprobs(a2) != _logprobs(a1)
    # (text-generation 0.7.0, the newest on PyPI, has no adapter_id argument: its raw body is the HTTP one above)
    hub = InferenceClient(lora_server.base_url, timeout=120)
    assert (
        hub.text_generation(PROMPT, adapter_id="a2", max_new_tokens=8, return_full_text=False) == a2["generated_text"]
    )


def test_model_through_openai(lora_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{lora_server.base_url}/v1", api_key="-")
    completion = client.completions.create(model="a1", prompt=PROMPT, max_tokens=8, temperature=0)
    assert completion.choices[0].text == _generate(lora_server, "a1")["generated_text"]
    chat = [{"role": "user", "content": "Say hi."}]
    under_a2 = client.chat.completions.create(model="a2", messages=chat, max_tokens=8, temperature=0)
    under_base = client.chat.completions.create(model="tgi", messages=chat, max_tokens=8, temperature=0)
    assert under_a2.choices[0].message.content and under_base.choices[0].message.content


def test_unknown_adapter_is_refused_and_the_server_keeps_serving(lora_server):
    body = {"inputs": PROMPT, "parameters": {**PARAMS, "adapter_id": "nope"}}
    answer = httpx.post(f"{lora_server.base_url}/generate", json=body, timeout=120)
    assert answer.status_code == 422, answer.text
    assert "'nope' is not loaded; loaded: a1, a2" in answer.json()["error"]
    assert _generate(lora_server, None)["details"]["generated_tokens"] >= 1
