"""POST /v1/completions over the real app, scripted engine (docs/contract.md §10 + OpenAI/vLLM extensions)."""

from __future__ import annotations

import json

ANSWER = " Paris is the capital."
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def sse_payloads(text: str) -> list[str]:
    events = text[:-2].split("\n\n")
    assert text.endswith("\n\n") and all(e.startswith("data:") for e in events)
    return [e[len("data:") :] for e in events]


async def test_single_and_list_prompts(client, engine):
    response = await client.post(
        "/v1/completions", json={"prompt": "The capital of France is", "temperature": 0, "model": "whatever"}
    )
    assert response.status_code == 200
    body = response.json()
    body.pop("created")
    prompt_tokens = len(engine.requests[0].prompt_ids)
    assert body == {
        "object": "text_completion",
        "id": "",
        "model": MODEL,
        "system_fingerprint": "3.3.6-dev0-native",
        "choices": [
            {
                "index": 0,
                "text": ANSWER,
                "logprobs": None,
                "finish_reason": "stop",
                "sentence_length": 6,
                "cum_log_probs": body["choices"][0]["cum_log_probs"],
            }
        ],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 6, "total_tokens": prompt_tokens + 6},
    }
    assert abs(body["choices"][0]["cum_log_probs"] - sum(-0.5 - 0.01 * s for s in range(1, 7))) < 1e-6
    assert not engine.requests[0].sampling.is_sampling
    response = await client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" and c["text"] == " Paris is" for c in choices)
    assert all(r.sampling.do_sample for r in engine.requests[1:])  # no temperature: TGI samples
    assert response.json()["usage"]["completion_tokens"] == 6
    headers = response.headers
    assert headers["x-generated-tokens"] == "6" and headers["x-compute-characters"] == "3"
    assert "x-compute-time" not in headers  # TGI's integer sum drops it


async def test_tgi_refusals(client, engine):
    response = await client.post("/v1/completions", json={"prompt": []})
    assert (response.status_code, response.headers["content-type"]) == (422, "text/plain; charset=utf-8")
    assert response.text == (
        "Failed to deserialize the JSON body into the target type: prompt: Empty array detected. Do not use an empty array for the prompt."
    )
    response = await client.post("/v1/completions", json={"prompt": "x", "suffix": "y"})
    assert (response.status_code, response.json()) == (
        422,
        {
            "error": "Suffix is not supported and can be achieved by preprocessing the prompt.",
            "error_type": "suffix not supported",
        },
    )
    response = await client.post("/v1/completions", json={"prompt": ["a"] * 5, "stream": True})
    assert (response.status_code, response.json()) == (
        422,
        {"error": "Number of prompts exceeds the maximum allowed batch size of 4", "error_type": "batch size exceeded"},
    )
    response = await client.post("/v1/completions", json={"prompt": "", "temperature": 0})
    assert response.json() == {"error": "Input validation error: `inputs` cannot be empty", "error_type": "validation"}
    assert engine.requests == []


async def test_echo_and_openai_logprobs(client, engine, tokenizer):
    body = {"prompt": "Hello world", "temperature": 0, "echo": True, "logprobs": 1, "max_tokens": 2}
    choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    assert choice["text"] == "Hello world Paris is"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["Hello", " world", " Paris", " is"]
    assert logprobs["token_logprobs"] == [None, -1.0, -0.51, -0.52]
    # an echoed position lists the prefill's top-k (the scripted engine's likeliest is the next id), then
    # the prompt token itself, as OpenAI's legacy API and vLLM do
    (request,) = engine.requests
    assert (request.prompt_logprobs, request.sampling.top_n_tokens) == (True, 1)
    likeliest = tokenizer.token_text(request.prompt_ids[1] + 1)
    assert logprobs["top_logprobs"] == [None, {likeliest: -0.25, " world": -1.0}, {" Paris": -0.5}, {" is": -0.5}]
    assert logprobs["text_offset"] == [0, 5, 11, 17]


async def test_streamed_echo_carries_the_prompts_logprobs(client, engine, tokenizer):
    body = {"prompt": "Hello world", "temperature": 0, "echo": True, "logprobs": 1, "max_tokens": 2, "stream": True}
    events = [json.loads(p) for p in sse_payloads((await client.post("/v1/completions", json=body)).text)[:-1]]
    echoed, first, last = (event["choices"][0] for event in events)
    likeliest = tokenizer.token_text(engine.requests[0].prompt_ids[1] + 1)
    assert echoed["text"] == "Hello world"
    assert echoed["logprobs"] == {
        "tokens": ["Hello", " world"],
        "token_logprobs": [None, -1.0],
        "top_logprobs": [None, {likeliest: -0.25, " world": -1.0}],
        "text_offset": [0, 5],
    }
    assert (first["text"], first["logprobs"]["text_offset"], last["logprobs"]["text_offset"]) == (" Paris", [11], [17])


async def test_prompt_top_k_costs_nothing_unless_echoed(client, engine):
    for body in ({"logprobs": 2}, {"echo": True}, {"echo": True, "stream": True}, {}):
        await client.post("/v1/completions", json={"prompt": "Hello world", "temperature": 0, "max_tokens": 1, **body})
    assert [r.prompt_logprobs for r in engine.requests] == [False] * 4


async def test_logprobs_without_echo_lists_alternatives(client):
    body = {"prompt": "Hi", "temperature": 0, "logprobs": 2, "max_tokens": 1}
    logprobs = (await client.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [" Paris"] and logprobs["text_offset"] == [0]
    assert len(logprobs["top_logprobs"][0]) == 2


async def test_n_and_best_of(client, engine):
    response = await client.post(
        "/v1/completions", json={"prompt": ["a", "b"], "n": 2, "temperature": 0.7, "max_tokens": 2}
    )
    assert [c["index"] for c in response.json()["choices"]] == [0, 1, 2, 3]
    seeds = {r.sampling.seed for r in engine.requests}
    assert len(engine.requests) == 4 and len(seeds) == 4  # independent samples
    response = await client.post("/v1/completions", json={"prompt": "a", "n": 1, "best_of": 2, "temperature": 0.7})
    assert len(response.json()["choices"]) == 1 and len(engine.requests) == 6
    errors = [
        ({"n": 2, "temperature": 0}, "you must use sampling when `n` or `best_of` is > 1"),
        ({"n": 3}, "`n` must be > 0 and <= 2. Given: 3"),
        ({"n": 2, "best_of": 1}, "`best_of` must be >= `n` and <= 2. Given: 1"),
        ({"n": 2, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
        ({"best_of": 2, "stream": True}, "`best_of` != `n` is not supported when streaming tokens"),
        ({"logit_bias": {"x": 5.0}}, "`logit_bias` keys must be token ids. Given: 'x'"),
        ({"logit_bias": {"42": 101.0}}, "`logit_bias` values must be >= -100 and <= 100. Given: 101.0"),
    ]
    for extra, message in errors:
        response = await client.post("/v1/completions", json={"prompt": "a", **extra})
        assert (response.status_code, response.json()) == (
            422,
            {"error": f"Input validation error: {message}", "error_type": "validation"},
        )


async def test_stream_events_exactly(client):
    body = {"prompt": ["a", "b"], "temperature": 0, "stream": True, "max_tokens": 3}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    payloads = sse_payloads(response.text)
    assert payloads[-1] == " [DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    for index in (0, 1):
        mine = [e for e in events if e["choices"][0]["index"] == index]
        assert "".join(e["choices"][0]["text"] for e in mine) == " Paris is the"
        *chunks, final = mine
        for chunk in chunks:
            assert list(chunk) == ["object", "id", "created", "choices", "model", "system_fingerprint"]  # no usage key
            assert chunk["choices"][0] == {
                "index": index,
                "text": chunk["choices"][0]["text"],
                "logprobs": None,
                "finish_reason": "",
            }
        assert list(final) == ["object", "id", "created", "model", "system_fingerprint", "choices", "usage"]
        assert final["choices"][0]["finish_reason"] == "length" and final["choices"][0]["sentence_length"] == 3
        assert final["usage"]["completion_tokens"] == 3


async def test_stream_raw_eos_finish_reason_and_include_usage(client):
    body = {"prompt": "a", "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "echo": True}
    events = [json.loads(p) for p in sse_payloads((await client.post("/v1/completions", json=body)).text)[:-1]]
    assert events[0]["choices"][0]["text"] == "a"  # echo: the prompt first
    assert events[-2]["choices"][0]["finish_reason"] == "eos_token"  # raw on streams, unlike non-stream "stop"
    assert events[-2]["choices"][0]["text"] == "<|im_end|>"  # special token text is not filtered
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6


async def test_stream_validation_error_event(client):
    response = await client.post("/v1/completions", json={"prompt": "a", "stream": True, "top_p": 1.5})
    assert response.text == (
        'data:{"error":{"message":"Input validation error: `top_p` must be > 0.0 and < 1.0","http_status_code":422}}\n\n'
        "data: [DONE]\n\n"
    )


async def test_api_key_and_response_model_is_the_served_id(engine, make_client):
    async with make_client(engine, api_key="k") as http:
        assert (await http.post("/v1/completions", json={"prompt": "a"})).status_code == 401
        ok = await http.post(
            "/v1/completions", json={"prompt": "a", "temperature": 0}, headers={"authorization": "Bearer k"}
        )
        assert ok.json()["model"] == MODEL


async def test_one_failing_prompt_fails_the_request_and_frees_the_others(tokenizer, continuation, make_client):
    from scripted_engine import ScriptedEngine

    engine = ScriptedEngine(continuation, max_total_tokens=256, delay=0.01)
    async with make_client(engine) as http:
        # The second prompt is too long for max_new_tokens=250 within 256 total tokens.
        body = {"prompt": ["short", "word " * 20], "temperature": 0, "max_tokens": 250}
        response = await http.post("/v1/completions", json=body)
    assert response.status_code == 422
    assert response.json()["error"].startswith(
        "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 256."
    )
    assert set(engine.closed) == {r.request_id for r in engine.requests}  # nothing left running


async def test_lightllm_long_truncation_mode_reaches_completions(client, engine):
    body = {"prompt": "word " * 400, "max_tokens": 2, "temperature": 0}
    refused = await client.post("/v1/completions", json=body)
    assert refused.status_code == 422 and refused.json()["error_type"] == "validation"
    response = await client.post("/v1/completions", json={**body, "long_truncation_mode": "head"})
    assert response.status_code == 200
    kept = len(engine.requests[-1].prompt_ids)
    assert kept == engine.info.max_total_tokens - 2  # the largest prompt that fits beside max_tokens
    assert response.json()["usage"]["prompt_tokens"] == kept


async def test_logit_bias_reaches_the_engine_as_id_bias_pairs(client, engine):
    body = {"prompt": "a", "temperature": 0, "max_tokens": 2, "logit_bias": {"42": 5.0, "7": -100}}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert engine.requests[-1].sampling.logit_bias == ((42, 5.0), (7, -100.0))


async def test_token_id_prompts(client, engine, tokenizer):
    """What lm-eval's local-completions sends: ids run as given, one prompt per inner list."""
    ids = tokenizer.encode_sync("The capital of France is")
    body = {"temperature": 0, "max_tokens": 2, "echo": True}
    text = (await client.post("/v1/completions", json={"prompt": "The capital of France is", **body})).json()
    by_ids = (await client.post("/v1/completions", json={"prompt": ids, **body})).json()
    assert engine.requests[0].prompt_ids == engine.requests[1].prompt_ids == ids
    assert by_ids["choices"] == text["choices"] and by_ids["usage"] == text["usage"]
    assert by_ids["choices"][0]["text"] == "The capital of France is Paris is"  # echo decodes the ids
    two = (await client.post("/v1/completions", json={"prompt": [ids, ids[:2]], **body})).json()
    assert [r.prompt_ids for r in engine.requests[2:]] == [ids, ids[:2]]
    assert [c["index"] for c in two["choices"]] == [0, 1]
    stream = await client.post("/v1/completions", json={"prompt": [ids[:2]], "stream": True, **body})
    assert json.loads(sse_payloads(stream.text)[0])["choices"][0]["text"] == tokenizer.decode(ids[:2])


async def test_token_ids_outside_the_vocabulary_are_refused(client):
    for prompt, bad in (([1, 49152], 49152), ([[5], [-1]], -1)):
        response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert (response.status_code, response.json()) == (
            422,
            {
                "error": f"Input validation error: `prompt` token id {bad} is outside the vocabulary (size 49152)",
                "error_type": "validation",
            },
        )
    response = await client.post("/v1/completions", json={"prompt": [[]], "max_tokens": 2})
    assert response.json() == {"error": "Input validation error: `inputs` cannot be empty", "error_type": "validation"}
    response = await client.post("/v1/completions", json={"prompt": [1, "a"]})
    assert response.status_code == 422 and response.text.startswith("Failed to deserialize the JSON body")
