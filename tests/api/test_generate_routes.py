"""POST /generate, /, /generate_stream over the real app with a scripted engine."""

from __future__ import annotations

import asyncio
import json

PROMPT = "What is the capital of France?"
GREEDY = {"max_new_tokens": 20}


async def test_generate_greedy_shape_and_headers(client, engine):
    response = await client.post("/generate", json={"inputs": PROMPT, "parameters": GREEDY})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"generated_text": " Paris is the capital."}  # no "details" key
    assert not engine.requests[0].sampling.is_sampling
    headers = response.headers
    for name in ("x-total-time", "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token"):
        assert headers[name].isdigit(), name
    float(headers["x-compute-time"])
    assert headers["x-compute-type"] == "gpu+optimized"
    assert headers["x-compute-characters"] == str(len(PROMPT))
    assert headers["x-prompt-tokens"] == str(len(engine.requests[0].prompt_ids))
    assert headers["x-generated-tokens"] == str(len(engine.continuation) + 1)


async def test_details_include_eos_and_omit_optional_keys(client, engine):
    body = {"inputs": PROMPT, "parameters": {**GREEDY, "details": True}}
    details = (await client.post("/generate", json=body)).json()["details"]
    assert list(details) == ["finish_reason", "generated_tokens", "seed", "prefill", "tokens"]
    assert details["finish_reason"] == "eos_token"
    assert details["seed"] is None
    assert details["prefill"] == []
    assert details["generated_tokens"] == len(engine.continuation) + 1
    last = details["tokens"][-1]
    assert last == {"id": 2, "text": "<|im_end|>", "logprob": last["logprob"], "special": True}
    assert "".join(t["text"] for t in details["tokens"][:-1]) == " Paris is the capital."


async def test_eos_as_last_permitted_token_reports_length(client, engine):
    limit = len(engine.continuation) + 1
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": limit, "details": True}}
    details = (await client.post("/generate", json=body)).json()["details"]
    assert (details["finish_reason"], details["generated_tokens"]) == ("length", limit)


async def test_compat_route_wraps_in_list_and_returns_full_text(client):
    response = await client.post("/", json={"inputs": PROMPT, "parameters": GREEDY})
    assert response.json() == [{"generated_text": PROMPT + " Paris is the capital."}]
    response = await client.post("/", json={"inputs": PROMPT, "parameters": {**GREEDY, "return_full_text": False}})
    assert response.json() == [{"generated_text": " Paris is the capital."}]
    generate = await client.post("/generate", json={"inputs": PROMPT, "parameters": GREEDY})
    assert generate.json() == {"generated_text": " Paris is the capital."}  # no compat default there


async def test_absent_parameters_samples_with_a_reported_seed(client, engine):
    await client.post("/generate", json={"inputs": PROMPT})
    assert engine.requests[0].sampling.do_sample and engine.requests[0].sampling.seed is not None
    body = {"inputs": PROMPT, "parameters": {"details": True, "do_sample": True, "seed": 42}}
    assert (await client.post("/generate", json=body)).json()["details"]["seed"] == 42


async def test_empty_parameters_is_greedy_and_defaults_to_remaining_budget(client, engine):
    await client.post("/generate", json={"inputs": PROMPT, "parameters": {}})
    request = engine.requests[0]
    assert not request.sampling.is_sampling
    assert request.max_new_tokens == engine.info.max_total_tokens - len(request.prompt_ids)


async def test_stop_sequence_is_kept_and_aborts_the_engine_request(client, engine):
    body = {"inputs": PROMPT, "parameters": {**GREEDY, "stop": [" capital"], "details": True}}
    result = (await client.post("/generate", json=body)).json()
    assert result["generated_text"] == " Paris is the capital"
    assert result["details"]["finish_reason"] == "stop_sequence"
    assert engine.requests[0].request_id in engine.closed


async def test_top_n_tokens_and_prefill_logprobs(make_client, engine):
    async with make_client(engine, enable_prefill_logprobs=True) as http:
        params = {**GREEDY, "top_n_tokens": 2, "decoder_input_details": True}
        details = (await http.post("/generate", json={"inputs": PROMPT, "parameters": params})).json()["details"]
    assert len(details["top_tokens"]) == details["generated_tokens"]
    assert all(len(alternatives) == 2 for alternatives in details["top_tokens"])
    prefill = details["prefill"]
    assert len(prefill) == len(engine.requests[0].prompt_ids)
    assert prefill[0]["logprob"] is None and prefill[1]["logprob"] == -1.0
    assert prefill[0]["text"] == "What"


async def test_decoder_input_details_without_flag_gives_empty_prefill(client):
    params = {**GREEDY, "decoder_input_details": True}
    details = (await client.post("/generate", json={"inputs": PROMPT, "parameters": params})).json()["details"]
    assert details["prefill"] == []


async def test_best_of_returns_other_sequences(client, engine):
    params = {**GREEDY, "best_of": 2, "do_sample": True, "details": True}
    details = (await client.post("/generate", json={"inputs": PROMPT, "parameters": params})).json()["details"]
    assert len(engine.requests) == 2
    assert details["seed"] is not None
    (other,) = details["best_of_sequences"]
    assert set(other) == {"generated_text", "finish_reason", "generated_tokens", "seed", "prefill", "tokens"}


async def test_truncate_keeps_the_last_tokens(client, engine, tokenizer):
    params = {**GREEDY, "truncate": 3}
    await client.post("/generate", json={"inputs": PROMPT, "parameters": params})
    assert engine.requests[0].prompt_ids == tokenizer.encode_sync(PROMPT)[-3:]


def _events(raw: bytes) -> list[dict]:
    assert raw.endswith(b"\n\n")
    chunks = raw.split(b"\n\n")[:-1]
    assert all(chunk.startswith(b"data:{") for chunk in chunks), chunks
    return [json.loads(chunk[len(b"data:") :]) for chunk in chunks]


async def test_stream_framing_and_final_event(client, engine):
    body = {"inputs": PROMPT, "parameters": {**GREEDY, "details": True}}
    response = await client.post("/generate_stream", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert b"[DONE]" not in response.content
    events = _events(response.content)
    assert [e["index"] for e in events] == list(range(1, len(engine.continuation) + 2))
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    assert all("top_tokens" not in e for e in events)
    assert events[-1]["generated_text"] == " Paris is the capital."
    assert events[-1]["details"] == {
        "finish_reason": "eos_token",
        "generated_tokens": len(events),
        "seed": None,
        "input_length": len(engine.requests[0].prompt_ids),
    }
    assert events[-1]["token"]["special"] is True


async def test_compat_stream_and_details_null_without_details(client):
    response = await client.post("/", json={"inputs": PROMPT, "parameters": GREEDY, "stream": True})
    events = _events(response.content)
    assert events[-1]["details"] is None
    assert events[-1]["generated_text"] == PROMPT + " Paris is the capital."


async def test_stream_errors_are_one_event_on_200(client):
    for params in ({"temperature": 0}, {"best_of": 2, "do_sample": True}, {"decoder_input_details": True}):
        response = await client.post("/generate_stream", json={"inputs": PROMPT, "parameters": params})
        assert response.status_code == 200
        (event,) = _events(response.content)
        assert event["error_type"] == "validation"
        assert event["error"].startswith("Input validation error: `")


async def test_engine_failure_is_424(client, engine):
    engine.fail_with = "CUDA out of memory"
    response = await client.post("/generate", json={"inputs": PROMPT, "parameters": GREEDY})
    assert response.status_code == 424
    assert response.json() == {
        "error": "Request failed during generation: CUDA out of memory",
        "error_type": "generation",
    }
    stream = await client.post("/generate_stream", json={"inputs": PROMPT, "parameters": GREEDY})
    assert _events(stream.content) == [response.json()]


async def test_overload_fails_fast_with_429(make_client, continuation):
    from scripted_engine import ScriptedEngine

    slow = ScriptedEngine(continuation, delay=0.05)
    async with make_client(slow, max_concurrent_requests=1) as http:
        body = {"inputs": PROMPT, "parameters": GREEDY}
        first, second = await asyncio.gather(http.post("/generate", json=body), http.post("/generate", json=body))
        assert sorted([first.status_code, second.status_code]) == [200, 429]
        rejected = first if first.status_code == 429 else second
        assert rejected.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        # best_of=2 needs two permits out of one
        params = {**GREEDY, "best_of": 2, "do_sample": True}
        assert (await http.post("/generate", json={"inputs": PROMPT, "parameters": params})).status_code == 429
        assert (await http.post("/generate", json=body)).status_code == 200


async def test_metrics_count_requests_and_failures(client):
    await client.post("/generate", json={"inputs": PROMPT, "parameters": GREEDY})
    await client.post("/generate", json={"inputs": PROMPT, "parameters": {"top_k": 0}})
    text = (await client.get("/metrics")).text
    assert "tgi_request_count 2" in text
    assert "tgi_request_success 1" in text
    assert 'tgi_request_failure{err="validation"} 1' in text


async def test_leaving_a_stream_early_releases_the_engine_request(engine, tokenizer):
    import time

    from scripted_engine import make_state

    from tgi_compat.api.protocol.tgi import GenerateParameters
    from tgi_compat.api.serving.frame import validate_request
    from tgi_compat.api.serving.generation import Timings, one_step_at_a_time, stream_step_batches

    state = make_state(engine, tokenizer)
    request = await validate_request(state, PROMPT, GenerateParameters(max_new_tokens=20))
    steps = one_step_at_a_time(
        stream_step_batches(state, request, Timings(arrival=time.perf_counter()), streaming=True)
    )
    first = await steps.__anext__()
    assert first.index == 1 and first.result is None
    await steps.aclose()  # what a client disconnect does to the SSE generator
    request_id = engine.requests[0].request_id
    assert request_id in engine.closed and request_id in engine.aborted
