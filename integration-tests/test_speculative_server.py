"""`--speculate 4` on the real launcher (embedded SmolLM2) against the session's plain server: the same
generated text, token ids and finish reasons, greedy and seeded, one request and many at once, and the
stream carries one event per token, as TGI's does with speculation."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest
from harness import _free_port, _launcher_command, launched, metric

PROMPTS = [
    "Repeat: apple, banana, cherry, plum, apple, banana, cherry, plum, apple,",
    "def fibonacci(n):",
    "The capital of France is",
    "Once upon a time, there was a",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "In machine learning, a neural network",
]
PARAMETERS = {
    "greedy": {"max_new_tokens": 40, "details": True},
    "seeded": {"max_new_tokens": 40, "details": True, "do_sample": True, "temperature": 0.7, "seed": 3},
}


@pytest.fixture(scope="module")
def speculating_server():
    command = [*_launcher_command(_free_port()), "--speculate", "4"]
    with launched(command, dict(os.environ), "launcher-speculate-") as handle:
        yield handle


def _essentials(answer: dict) -> tuple:
    details = answer["details"]
    return answer["generated_text"], [t["id"] for t in details["tokens"]], details["finish_reason"]


async def _generate_all(base_url: str, parameters: dict) -> list[tuple]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        answers = await asyncio.gather(
            *(client.post("/generate", json={"inputs": p, "parameters": parameters}) for p in PROMPTS)
        )
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    return [_essentials(a.json()) for a in answers]


@pytest.mark.parametrize("name", list(PARAMETERS))
def test_speculation_answers_as_the_plain_server(server, speculating_server, name):
    parameters = PARAMETERS[name]
    plain = asyncio.run(_generate_all(server.base_url, parameters))
    assert asyncio.run(_generate_all(speculating_server.base_url, parameters)) == plain  # all at once
    alone = httpx.post(
        f"{speculating_server.base_url}/generate", json={"inputs": PROMPTS[0], "parameters": parameters}, timeout=300
    )
    assert _essentials(alone.json()) == plain[0]


def test_the_stream_has_one_event_per_token(speculating_server):
    body = {"inputs": PROMPTS[0], "parameters": PARAMETERS["greedy"]}
    with httpx.stream("POST", f"{speculating_server.base_url}/generate_stream", json=body, timeout=300) as stream:
        events = [json.loads(line[5:]) for line in stream.iter_lines() if line.startswith("data:")]
    whole = httpx.post(f"{speculating_server.base_url}/generate", json=body, timeout=300).json()
    assert [e["token"]["id"] for e in events] == _essentials(whole)[1]
    assert events[-1]["generated_text"] == whole["generated_text"]


def test_metrics_count_the_accepted_drafts(speculating_server):
    body = {"inputs": PROMPTS[0], "parameters": PARAMETERS["greedy"]}
    assert httpx.post(f"{speculating_server.base_url}/generate", json=body, timeout=300).status_code == 200
    url = speculating_server.base_url
    deadline = time.monotonic() + 10  # the engine's counts reach the API with its next stats report
    while not metric(url, "vllm:spec_decode_num_accepted_tokens_total") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    accepted = metric(url, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= metric(url, "vllm:spec_decode_num_draft_tokens_total")
    assert metric(url, "tgi_request_skipped_tokens_count") > 0 and metric(url, "tgi_request_skipped_tokens_sum") > 0
