"""POST /v1/chat/completions and /chat_tokenize over the real app, scripted engine (docs/contract.md §9)."""

from __future__ import annotations

import json

from tgi_compat.api.serving.chat.template import ChatTemplate

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = " Paris is the capital."


def sse_payloads(text: str) -> list[str]:
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data:") for e in events), events
    return [e[len("data:") :] for e in events]


async def test_non_stream_shape_greedy_and_headers(client, engine, smollm2_tokenizer):
    response = await client.post("/v1/chat/completions", json={"model": "tgi", "messages": MESSAGES, "temperature": 0})
    assert response.status_code == 200
    body = response.json()
    created = body.pop("created")
    assert isinstance(created, int)
    prompt = smollm2_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt_ids = smollm2_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert body == {
        "object": "chat.completion",
        "id": "",
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "system_fingerprint": "3.3.6-dev0-native",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": ANSWER}, "logprobs": None, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": 6, "total_tokens": len(prompt_ids) + 6},
    }
    sent = engine.requests[0]
    assert sent.prompt_ids == prompt_ids  # template rendered, no extra special tokens
    assert not sent.sampling.is_sampling
    assert response.headers["x-prompt-tokens"] == str(len(prompt_ids))
    assert response.headers["x-compute-characters"] == str(len(prompt))


async def test_sampling_unless_temperature_zero_and_parameter_mapping(client, engine):
    body = {
        "model": "my-model",
        "messages": MESSAGES,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "top_p": 0.9,
        "seed": 7,
        "max_completion_tokens": 3,
        "stop": ["zzz"],
        "n": 3,
        "logit_bias": [0.5],
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.json()["model"] == "my-model"  # echoed like TGI
    assert len(response.json()["choices"]) == 1  # `n` is ignored, like TGI
    sampling = engine.requests[0].sampling
    assert sampling.do_sample and sampling.temperature == 1.0 and sampling.seed == 7
    assert sampling.repetition_penalty == 2.5  # TGI: presence_penalty + 2.0
    assert (sampling.frequency_penalty, sampling.top_p) == (0.25, 0.8999999761581421)  # 0.9 in f32, TGI's type
    assert engine.requests[0].max_new_tokens == 3
    assert response.json()["choices"][0]["finish_reason"] == "length"


async def test_stop_sequence_finish_reason_passes_through(client):
    body = {"messages": MESSAGES, "temperature": 0, "stop": [" the"]}
    choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (" Paris is the", "stop_sequence")


async def test_logprobs_shape(client):
    body = {"messages": MESSAGES, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    logprobs = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["logprobs"]
    content = logprobs["content"]
    assert [c["token"] for c in content] == [" Paris", " is", " the", " capital", ".", "<|im_end|>"]
    assert content[0]["logprob"] == -0.51
    assert [list(t) for t in content[0]["top_logprobs"]] == [["token", "logprob"]] * 2


async def test_stream_chunks_exactly(client):
    body = {"messages": MESSAGES, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")  # a space before [DONE] only
    payloads = sse_payloads(response.text)
    assert payloads[-1] == " [DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    token_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c["choices"][0]["delta"]["content"] for c in token_chunks) == ANSWER  # EOS gives ""
    for chunk in token_chunks:
        assert list(chunk) == ["object", "id", "created", "model", "system_fingerprint", "choices", "usage"]
        assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == "" and chunk["usage"] is None
        assert chunk["choices"][0]["delta"]["role"] == "assistant"
        assert chunk["choices"][0]["logprobs"] is None
    assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None] * 5 + ["stop"]
    assert token_chunks[-1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6


async def test_stream_without_usage_and_with_logprobs(client):
    body = {"messages": MESSAGES, "temperature": 0, "stream": True, "logprobs": True}
    chunks = [json.loads(p) for p in sse_payloads((await client.post("/v1/chat/completions", json=body)).text)[:-1]]
    assert len(chunks) == 6 and all(c["usage"] is None for c in chunks)
    assert chunks[0]["choices"][0]["logprobs"] == {
        "content": [{"token": " Paris", "logprob": -0.51, "top_logprobs": []}]
    }


async def test_stream_validation_error_is_an_event_then_done(client):
    body = {"messages": MESSAGES, "stream": True, "top_p": 1.0}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.text == (
        'data:{"error":{"message":"Input validation error: `top_p` must be > 0.0 and < 1.0","http_status_code":422}}\n\n'
        "data: [DONE]\n\n"
    )


async def test_non_stream_validation_error(client):
    response = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "top_logprobs": 6})
    assert response.status_code == 422
    assert response.json() == {
        "error": "Input validation error: `top_n_tokens` must be >= 0 and <= 5. Given: 6",
        "error_type": "validation",
    }


async def test_body_errors_are_axum_text(client):
    response = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "logit_bias": {"42": 1.0}})
    assert (response.status_code, response.headers["content-type"]) == (422, "text/plain; charset=utf-8")
    assert (
        response.text
        == "Failed to deserialize the JSON body into the target type: logit_bias: invalid type: map, expected a sequence"
    )
    response = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream_options": None})
    assert response.status_code == 422 and response.text.startswith("Failed to deserialize the JSON body")
    response = await client.post("/v1/chat/completions", json={"model": "tgi"})
    assert response.text == "Failed to deserialize the JSON body into the target type: missing field `messages`"
    response = await client.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    assert response.status_code == 400


async def test_tool_and_grammar_errors(client, engine):
    grammar = {"type": "json", "value": {"properties": {"a": {"type": "string"}}}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    cases = [
        ({"response_format": grammar, "tools": []}, {"error": "Tool error: Grammar and tools are mutually exclusive", "error_type": "tool_error"}),
        ({"tools": [tool], "tool_choice": "other"}, {"error": "Tool error: Tool with name other not found", "error_type": "tool_error"}),
        ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "x"}}}, {"error": "Tool error: Tool with name x not found", "error_type": "tool_error"}),
        ({"response_format": {"type": "json", "value": {"type": "object"}}}, {"error": "Input validation error: grammar is not valid: Grammar must have a 'properties' field", "error_type": "validation"}),
        # serde reads an explicit null as Value::Null: not "missing", refused by validation instead
        ({"response_format": {"type": "json", "value": None}}, {"error": "Input validation error: grammar is not supported", "error_type": "validation"}),
    ]  # fmt: skip
    for extra, expected in cases:
        response = await client.post("/v1/chat/completions", json={"messages": MESSAGES, **extra})
        assert (response.status_code, response.json()) == (422, expected), extra
    assert engine.requests == []
    response = await client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "response_format": {"type": "regex"}}
    )
    assert (response.status_code, response.text) == (
        422,
        "Failed to deserialize the JSON body into the target type: response_format: missing field `value`",
    )
    response = await client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "tools": [tool], "tool_choice": "none", "temperature": 0}
    )
    assert response.json()["choices"][0]["message"]["content"] == ANSWER  # TGI: tools ignored entirely
    assert engine.requests[-1].grammar is None


async def test_template_errors(engine, make_client):
    raising = ChatTemplate.create("{{ raise_exception('Only user roles') }}", None, None)
    async with make_client(engine, chat_template=raising) as http:
        response = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True})
        assert response.status_code == 422  # before the stream starts: plain HTTP error
        assert response.json() == {
            "error": "Template error: syntax error: Only user roles (in <string>:1)",
            "error_type": "template_error",
        }


async def test_no_template_is_template_not_found(engine, tokenizer, monkeypatch):
    import httpx
    from scripted_engine import make_state

    from tgi_compat.api.server.app import create_app

    monkeypatch.setattr(tokenizer.tokenizer, "chat_template", None)
    monkeypatch.setattr("tgi_compat.api.serving.chat.template._model_folder", lambda config: None)
    app = create_app(make_state(engine, tokenizer))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        response = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert (response.status_code, response.json()) == (
        422,
        {"error": "Template error: template not found", "error_type": "template_error"},
    )


async def test_continue_final_assistant_message(client, engine, smollm2_tokenizer):
    messages = [*MESSAGES, {"role": "assistant", "content": "The capital is"}]
    await client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0})
    prompt = smollm2_tokenizer.decode(engine.requests[0].prompt_ids)
    assert prompt.endswith("<|im_start|>assistant\nThe capital is")


async def test_chat_tokenize(client, smollm2_tokenizer):
    null_grammar = {"messages": MESSAGES, "response_format": {"type": "json", "value": None}}
    assert (await client.post("/chat_tokenize", json=null_grammar)).status_code == 200  # found by the soak
    response = await client.post("/chat_tokenize", json={"messages": MESSAGES})
    assert response.status_code == 200
    body = response.json()
    assert body["templated_text"] == smollm2_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    ids = smollm2_tokenizer(body["templated_text"], add_special_tokens=False)["input_ids"]
    assert [t["id"] for t in body["tokenize_response"]] == ids
    assert body["tokenize_response"][0] == {"id": 1, "text": "<|im_start|>", "start": 0, "stop": 12}


async def test_api_key_protects_chat_but_not_chat_tokenize(engine, make_client):
    async with make_client(engine, api_key="secret") as http:
        denied = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert (denied.status_code, denied.content) == (401, b"")
        allowed = await http.post(
            "/v1/chat/completions", json={"messages": MESSAGES}, headers={"Authorization": "Bearer secret"}
        )
        assert allowed.status_code == 200
        assert (await http.post("/chat_tokenize", json={"messages": MESSAGES})).status_code == 200


async def test_max_tokens_and_openapi_document(client, engine):
    await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert engine.requests[0].max_new_tokens == 2
    document = (await client.get("/api-doc/openapi.json")).json()
    for path in ("/v1/chat/completions", "/v1/completions", "/chat_tokenize"):
        assert path in document["paths"]
    schemas = document["components"]["schemas"]
    assert "messages" in schemas["ChatRequest"]["properties"] and "prompt" in schemas["CompletionRequest"]["properties"]


def test_served_model_name_and_chat_template_from_config(smollm2_tokenizer, engine, tokenizer):
    """--served-model-name and --chat-template, read from ServerConfig."""
    from scripted_engine import make_state

    from tgi_compat.api.config import ServerConfig
    from tgi_compat.api.serving.chat.template import load_chat_template

    assert make_state(engine, tokenizer, model_id="org/model").served_model_name == "org/model"
    named = make_state(engine, tokenizer, model_id="org/model", served_model_name="public-name")
    assert named.served_model_name == "public-name"
    config = ServerConfig(
        model_id="HuggingFaceTB/SmolLM2-135M-Instruct", revision=None, chat_template="X{{ eos_token }}"
    )
    assert load_chat_template(config, smollm2_tokenizer).render([]) == "X<|im_end|>"


async def test_cached_tokens_are_reported_only_with_enable_prompt_tokens_details(engine, make_client):
    engine.num_cached_tokens = 7
    body = {"messages": MESSAGES, "temperature": 0}
    async with make_client(engine) as http:
        assert "prompt_tokens_details" not in (await http.post("/v1/chat/completions", json=body)).json()["usage"]
    async with make_client(engine, enable_prompt_tokens_details=True) as http:
        usage = (await http.post("/v1/chat/completions", json=body)).json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 7}
        stream = await http.post(
            "/v1/chat/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}}
        )
        usage_chunk = json.loads(sse_payloads(stream.text)[-2])
        assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 7}
        completion = await http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 3})
        assert completion.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 14}
