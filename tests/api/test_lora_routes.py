"""vLLM's runtime LoRA routes at the HTTP edge (absent without VLLM_ALLOW_RUNTIME_LORA_UPDATING, the API key,
vLLM's error shapes) and the adapters' /v1/models cards. Loads that reach a real engine: integration-tests/
test_lora_server.py and tests/router/test_lora_engine.py."""

from __future__ import annotations

import dataclasses

import pytest

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


async def test_routes_are_absent_unless_enabled(client, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    for path in (LOAD, UNLOAD):
        answer = await client.post(path, json={"lora_name": "a", "lora_path": "/x"})
        assert (answer.status_code, answer.content) == (404, b"")


@pytest.fixture
def enabled(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")


async def test_api_key_and_body_errors(enabled, make_client, engine):
    async with make_client(engine, api_key="secret") as http:
        assert (await http.post(LOAD, json={"lora_name": "a", "lora_path": "/x"})).status_code == 401
        auth = {"Authorization": "Bearer secret"}
        missing = await http.post(LOAD, json={"lora_name": "a", "lora_path": ""}, headers=auth)
        assert missing.status_code == 400
        assert missing.json() == {
            "error": {
                "message": "Both 'lora_name' and 'lora_path' must be provided.",
                "type": "InvalidUserInput",
                "param": None,
                "code": 400,
            }
        }
        no_name = await http.post(UNLOAD, json={}, headers=auth)
        assert no_name.status_code == 400 and "lora_name" in no_name.json()["error"]["message"]
        text = await http.post(UNLOAD, content=b"lora_name=a", headers=auth)
        assert text.status_code == 415


async def test_engine_refusal_is_a_400_naming_the_reason(enabled, client):
    # the scripted engine serves no LoRA: its refusal is what the engine's reason would be
    answer = await client.post(LOAD, json={"lora_name": "a", "lora_path": "/x"})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "ScriptedEngine cannot load LoRA adapters"


async def test_models_lists_adapters_as_vllm(make_client, engine):
    engine.info = dataclasses.replace(engine.info, max_loras=1, lora_adapters={"a1": "/adapters/a1"})
    async with make_client(engine) as http:
        data = (await http.get("/v1/models")).json()["data"]
    base = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert [card["id"] for card in data] == [base, "a1"]
    assert data[1] == {
        "id": "a1",
        "object": "model",
        "created": 0,
        "owned_by": base,
        "root": "/adapters/a1",
        "parent": base,
    }
