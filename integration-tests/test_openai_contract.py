"""Raw-HTTP contract of the OpenAI routes on the real server: exact SSE framing and chunk shapes,
and TGI's error bodies (docs/contract.md §6, §7, §9, §10)."""

from __future__ import annotations

import json

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_KEYS = ["object", "id", "created", "model", "system_fingerprint", "choices", "usage"]


def events(text: str) -> list[str]:
    """SSE events, keep-alive comments (`:`, every 15 s without tokens) left out."""
    assert text.endswith("\n\n")
    return [event for event in text[:-2].split("\n\n") if event != ":"]


async def test_chat_stream_framing(http):
    body = {
        "messages": QUESTION,
        "temperature": 0,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    raw = events(response.text)
    assert raw[-1] == "data: [DONE]"
    assert all(e.startswith("data:{") for e in raw[:-1])  # axum's json_data: no space
    chunks = [json.loads(e[len("data:") :]) for e in raw[:-1]]
    assert len(chunks) == 4
    for chunk in chunks:
        assert list(chunk) == CHAT_KEYS
    for chunk in chunks[:3]:
        assert chunk["usage"] is None
        assert list(chunk["choices"][0]) == ["index", "delta", "logprobs", "finish_reason"]
        assert list(chunk["choices"][0]["delta"]) == ["role", "content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "length"]
    assert chunks[3]["choices"] == [] and chunks[3]["usage"] == {
        "prompt_tokens": 37,
        "completion_tokens": 3,
        "total_tokens": 40,
    }


async def test_chat_logprobs(http):
    body = {"messages": QUESTION, "temperature": 0, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    choice = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["The", " capital"]
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy picks the top token


async def test_completions_stream_raw_eos_and_usage(http):
    # The chat-formatted prompt makes the model answer and stop with <|im_end|> (eos).
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    response = await http.post(
        "/v1/completions", json={"prompt": prompt, "temperature": 0, "max_tokens": 20, "stream": True}
    )
    raw = events(response.text)
    assert raw[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data:") :]) for e in raw[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [""] * (len(chunks) - 1) + ["eos_token"]
    assert "usage" not in chunks[0] and chunks[-1]["usage"]["completion_tokens"] == len(chunks)
    assert chunks[-1]["choices"][0]["text"] == "<|im_end|>"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "The capital of France is Paris."


async def test_error_bodies(http):
    response = await http.post("/v1/chat/completions", json={"messages": QUESTION, "logit_bias": {"1": 2.0}})
    assert (response.status_code, response.headers["content-type"]) == (422, "text/plain; charset=utf-8")
    assert response.text.startswith("Failed to deserialize the JSON body into the target type: logit_bias:")
    # a bounded string: an unbounded one can be sampled past the token budget and stop unterminated
    grammar = {"type": "json", "value": {"properties": {"a": {"type": "string", "maxLength": 8}}}}
    response = await http.post(
        "/v1/chat/completions", json={"messages": QUESTION, "response_format": grammar, "tools": []}
    )
    assert (response.status_code, response.json()) == (
        422,
        {"error": "Tool error: Grammar and tools are mutually exclusive", "error_type": "tool_error"},
    )
    # response_format is built (structured output): the answer is JSON of the schema, not an error
    response = await http.post(
        "/v1/chat/completions", json={"messages": QUESTION, "response_format": grammar, "max_tokens": 32}
    )
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "stop"
    answer = json.loads(response.json()["choices"][0]["message"]["content"])
    assert isinstance(answer, dict) and set(answer) <= {"a"} and all(isinstance(v, str) for v in answer.values())
    response = await http.post("/v1/completions", json={"prompt": ["a"] * 5})
    assert response.json() == {
        "error": "Number of prompts exceeds the maximum allowed batch size of 4",
        "error_type": "batch size exceeded",
    }
    response = await http.post("/v1/completions", json={"prompt": []})
    assert response.status_code == 422 and response.text.endswith(
        "Empty array detected. Do not use an empty array for the prompt."
    )


async def test_chat_stream_error_event_then_done(http):
    response = await http.post("/v1/chat/completions", json={"messages": QUESTION, "stream": True, "temperature": -1})
    assert response.status_code == 200
    assert events(response.text) == [
        'data:{"error":{"message":"Input validation error: `temperature` must be strictly positive","http_status_code":422}}',
        "data: [DONE]",
    ]


async def test_chat_tokenize(http):
    response = await http.post("/chat_tokenize", json={"messages": QUESTION})
    body = response.json()
    assert body["templated_text"].endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert len(body["tokenize_response"]) == 37
