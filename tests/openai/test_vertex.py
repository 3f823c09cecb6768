"""POST /vertex over the in-memory app and the scripted engine (answers " Paris is the capital.")."""

from __future__ import annotations

ANSWER = " Paris is the capital."
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}


async def test_generate_and_chat_instances(client, engine):
    instances = [
        {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 3, "seed": 5, "top_k": 2}},
        CHAT,
    ]
    response = await client.post("/vertex", json={"instances": instances})
    assert response.status_code == 200
    assert response.json() == {"predictions": [" Paris is the", ANSWER]}
    generate, chat = sorted(engine.requests, key=lambda r: r.max_new_tokens)
    assert generate.sampling.do_sample and generate.sampling.seed == 5 and generate.sampling.top_k == 0  # only mnt/seed
    assert not chat.sampling.do_sample


async def test_errors(client, engine):
    response = await client.post("/vertex", json={"instances": []})
    assert (response.status_code, response.json()) == (
        422,
        {"error": "Input validation error", "error_type": "Input validation error"},
    )
    bad_tool = {**CHAT, "tools": [], "response_format": {"type": "json_object"}}
    response = await client.post("/vertex", json={"instances": [bad_tool]})
    assert response.json() == {
        "error": "Tool error: Grammar and tools are mutually exclusive",
        "error_type": "tool_error",
    }
    response = await client.post("/vertex", json={"instances": [{"inputs": ""}]})  # fails validation when generating
    assert (response.status_code, response.json()) == (
        500,
        {"error": "Incomplete generation", "error_type": "Incomplete generation"},
    )
    response = await client.post("/vertex", json={"instances": [{"nothing": 1}]})
    assert response.status_code == 422 and "untagged enum VertexInstance" in response.text
