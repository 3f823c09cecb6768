"""Whole greedy responses against stored snapshots (logprobs within rtol 0.2, like TGI's suite)."""

from __future__ import annotations

import json

from harness import CHAT_PROMPT


async def test_generate_details_snapshot(http, response_snapshot):
    params = {"max_new_tokens": 10, "details": True, "decoder_input_details": True, "top_n_tokens": 2}
    response = await http.post("/generate", json={"inputs": CHAT_PROMPT, "parameters": params})
    assert response.json() == response_snapshot


async def test_generate_stream_snapshot(http, response_snapshot):
    params = {"max_new_tokens": 10, "details": True}
    response = await http.post("/generate_stream", json={"inputs": "The capital of France is", "parameters": params})
    events = [json.loads(chunk[5:]) for chunk in response.content.split(b"\n\n") if chunk.startswith(b"data:")]
    assert events == response_snapshot


async def test_compat_stop_sequence_snapshot(http, response_snapshot):
    params = {"max_new_tokens": 10, "details": True, "stop": ["France"]}
    response = await http.post("/", json={"inputs": CHAT_PROMPT, "parameters": params})
    assert response.json() == response_snapshot
