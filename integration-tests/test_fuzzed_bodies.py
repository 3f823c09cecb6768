"""Request bodies mutated at random (hypothesis) against the real launcher: whatever a client sends to a generation
route, the answer is one of TGI's (a 2xx, axum's text/plain rejection, or a `{"error", "error_type"}` JSON body with
a 4xx), never a 5xx or a dropped connection, and the server is left sound (harness.assert_sound).

Each body starts from a valid request of its route; one to three of its fields (known fields of the route, present or
not) are replaced by edge values or random JSON, or deleted; some bodies are random JSON or bytes outright. The
examples are derandomized: CI runs the same ones every time; FUZZ_EXAMPLES=2000 explores further, at random."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import httpx
import pytest
from harness import CHAT_PROMPT, assert_sound
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))
EXPLORING = "FUZZ_EXAMPLES" in os.environ  # then with random examples (pytest --hypothesis-seed=N repeats a run)
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GENERATE_PARAMETERS = [
    "adapter_id", "best_of", "decoder_input_details", "details", "do_sample", "frequency_penalty", "grammar",
    "max_new_tokens", "repetition_penalty", "return_full_text", "seed", "stop", "temperature", "top_k",
    "top_n_tokens", "top_p", "truncate", "typical_p", "watermark", "use_beam_search", "length_penalty",
    "early_stopping", "prompt_logprobs", "no_repeat_ngram_size",
]  # fmt: skip
CHAT_FIELDS = [
    "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "messages", "model", "n", "presence_penalty",
    "response_format", "seed", "stop", "stream", "stream_options", "temperature", "tool_choice", "tool_prompt",
    "tools", "top_logprobs", "top_p", "max_completion_tokens", "best_of", "user", "guideline",
]  # fmt: skip
COMPLETION_FIELDS = [
    "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "model", "n", "presence_penalty",
    "prompt", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
    "use_beam_search", "beam_width",
]  # fmt: skip

# route -> (a valid body, the paths mutations may touch)
ROUTES: dict[str, tuple[dict[str, Any], list[tuple[str, ...]]]] = {
    "/generate": (
        {"inputs": CHAT_PROMPT, "parameters": {"max_new_tokens": 4}},
        [("inputs",), ("parameters",), ("stream",)] + [("parameters", p) for p in GENERATE_PARAMETERS],
    ),
    "/generate_stream": (
        {"inputs": CHAT_PROMPT, "parameters": {"max_new_tokens": 4, "details": True}},
        [("inputs",), ("parameters",)] + [("parameters", p) for p in GENERATE_PARAMETERS],
    ),
    "/": (
        {"inputs": CHAT_PROMPT, "parameters": {"max_new_tokens": 4}, "stream": True},
        [("inputs",), ("parameters",), ("stream",)] + [("parameters", p) for p in GENERATE_PARAMETERS],
    ),
    "/tokenize": ({"inputs": CHAT_PROMPT}, [("inputs",), ("parameters",), ("parameters", "truncate")]),
    "/v1/chat/completions": (
        {"messages": MESSAGES, "max_tokens": 4},
        [(f,) for f in CHAT_FIELDS] + [("messages", 0, "role"), ("messages", 0, "content"), ("messages", 0)],
    ),
    "/chat_tokenize": ({"messages": MESSAGES}, [(f,) for f in CHAT_FIELDS] + [("messages", 0, "content")]),
    "/v1/completions": ({"prompt": "The capital of France is", "max_tokens": 4}, [(f,) for f in COMPLETION_FIELDS]),
}
ERROR_STATUSES = {400, 404, 413, 415, 422}  # what a well-formed HTTP request with a bad body may get
REJECTIONS = (
    "Failed to parse the request body as JSON: ",
    "Failed to deserialize the JSON body into the target type: ",
)

DELETE = object()
EDGES = st.sampled_from(
    [
        None, True, False, 0, 1, -1, 2, 0.5, -0.5, 1.5, 2**31, 2**63, 10**30, 1e308, -1e308, 1e-45,
        "", "x", "1", "\x00", "\ud7ff", "é" * 3, [], [1], ["x"], [[]], [None], {}, {"x": 1},
        {"type": "json", "value": {}}, {"type": "regex", "value": "a+"}, {"type": "json_object"},
        {"type": "function", "function": {"name": "x"}}, {"role": "user", "content": []},
        {"include_usage": True}, {"1": 2.0}, ["\n"] * 5,
    ]
)  # fmt: skip
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _mutated(body: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """`value` set at `path` in `body` (in place), or the field deleted; nothing where the path's parent is gone."""
    parent: Any = body
    for key in path[:-1]:
        try:
            parent = parent[key]
        except (KeyError, IndexError, TypeError):
            return
    last = path[-1]
    if value is not DELETE:
        value = copy.deepcopy(value)  # EDGES' lists and dicts are shared: two mutations must not set one object twice
    if isinstance(parent, dict) and isinstance(last, str):
        if value is DELETE:
            parent.pop(last, None)
        else:
            parent[last] = value
    elif isinstance(parent, list) and isinstance(last, int) and last < len(parent):
        if value is DELETE:
            del parent[last]
        else:
            parent[last] = value


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    route = draw(st.sampled_from(sorted(ROUTES)))
    template, paths = ROUTES[route]
    kind = draw(st.sampled_from(["mutated"] * 8 + ["json", "bytes"]))
    if kind == "bytes":
        return route, draw(st.binary(max_size=24))
    if kind == "json":
        return route, json.dumps(draw(JSON)).encode()
    body = copy.deepcopy(template)
    mutations = st.lists(st.tuples(st.sampled_from(paths), EDGES | JSON | st.just(DELETE)), min_size=1, max_size=3)
    for path, value in draw(mutations):
        _mutated(body, path, value)
    _bounded(body)
    return route, json.dumps(body).encode()


def _bounded(body: dict[str, Any]) -> None:
    """A generation left without its token limit (deleted, or null) gets the template's back: the default limit is
    the context's rest, minutes of sampling on 2 busy cores (the default itself is other tests' work)."""
    parameters = body.get("parameters")
    for holder, key in [(body, "max_tokens"), (parameters, "max_new_tokens")]:
        if isinstance(holder, dict) and key in holder and holder[key] is None:
            holder[key] = 4
    if "max_tokens" not in body and ("messages" in body or "prompt" in body):
        body["max_tokens"] = 4
    if isinstance(parameters, dict) and "max_new_tokens" not in parameters:
        parameters["max_new_tokens"] = 4
    if "inputs" in body and "parameters" not in body:  # TGI's preset for a body without parameters samples
        body["parameters"] = {"do_sample": True, "max_new_tokens": 4}


def _check_answer(response: httpx.Response) -> None:
    kind = response.headers.get("content-type", "")
    if response.status_code in ERROR_STATUSES:
        if kind.startswith("text/plain"):
            assert response.text.startswith(REJECTIONS), response.text
        else:
            body = response.json()
            assert isinstance(body["error"], str) and isinstance(body["error_type"], str), body
        return
    assert response.status_code == 200, (response.status_code, response.text[:500])
    if kind.startswith("text/event-stream"):
        events = [e for e in response.text.split("\n\n") if e and e != ":"]
        assert events and all(e.startswith("data:") for e in events), response.text[:500]
        for event in events:
            payload = event.removeprefix("data:").strip()
            if payload != "[DONE]":
                json.loads(payload)  # an error mid-stream is a JSON event too
    else:
        json.loads(response.text)


@pytest.fixture(scope="module")
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=300) as client:
        yield client
    assert_sound(base_url)


@settings(
    max_examples=EXAMPLES,
    derandomize=not EXPLORING,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests())
def test_a_mutated_body_gets_one_of_tgis_answers(client, request):
    route, body = request
    response = client.post(route, content=body, headers={"content-type": "application/json"})
    _check_answer(response)
