"""Beam search end to end: a tiny random Llama (byte-level tokenizer) behind the real launcher answers
/v1/completions with vLLM's `use_beam_search` exactly as transformers' `generate(num_beams=...)` ranks the
hypotheses: the same best texts and lengths, and scores (cum_log_probs / length ** length_penalty) within 1e-4."""

from __future__ import annotations

import json
import os
import sys

import httpx
import pytest
from harness import _free_port, _launcher_command, launched
from test_model_families import byte_level_tokenizer
from transformers import LlamaConfig

from tests.modeling.beam_reference import transformers_beams
from tests.modeling.helpers import tiny_hf_model

PROMPT = "Beams share their prefix."
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def beam_server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("beam-llama"))
    tokenizer = byte_level_tokenizer()
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = tiny_hf_model(LlamaConfig, vocab_size=320, **ids)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    command = [*_launcher_command(_free_port()), "--model-id", folder, "--max-best-of", "4"]  # the beam width cap
    with launched(command, dict(os.environ), "beam-") as server:
        yield server, model, tokenizer


@pytest.mark.parametrize(("width", "length_penalty", "early_stopping"), [(3, 1.0, False), (4, 0.5, True)])
def test_completions_beam_search_equals_transformers(beam_server, width, length_penalty, early_stopping):
    server, model, tokenizer = beam_server
    body = {
        "model": "tgi",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "use_beam_search": True,
        "beam_width": width,
        "n": 2,
        "length_penalty": length_penalty,
        "early_stopping": early_stopping,
    }
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    ids = tokenizer(PROMPT).input_ids
    expected = transformers_beams(
        model,
        ids,
        width,
        MAX_TOKENS,
        tokenizer.eos_token_id,
        num_return=2,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    assert [c["index"] for c in choices] == [0, 1]
    for choice, (generated, score) in zip(choices, expected):
        assert choice["text"] == tokenizer.decode(generated, skip_special_tokens=True)
        assert choice["sentence_length"] == len(generated)
        assert abs(choice["cum_log_probs"] / choice["sentence_length"] ** length_penalty - score) <= 1e-4


def test_beam_search_refuses_sampling_and_tgi_streams(beam_server):
    server, _, _ = beam_server
    body = {"prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, "temperature": 0.7}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 422 and "no `temperature`" in response.json()["error"]
    # TGI refuses `best_of` on streams for the same reason: nothing is final before the end
    parameters = {"use_beam_search": True, "max_new_tokens": 4}
    stream = httpx.post(f"{server.base_url}/generate_stream", json={"inputs": PROMPT, "parameters": parameters})
    assert "`use_beam_search` is not supported when streaming tokens" in stream.text


def test_streamed_beam_search_sends_the_searched_choices_at_the_end(beam_server):
    """vLLM answers `stream: true` with a beam search's final result (it never refuses it); we send it as SSE: one
    event a choice with its whole text, the same choices as unstreamed, then the usage chunk and [DONE]."""
    server, _, _ = beam_server
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "use_beam_search": True, "beam_width": 3, "n": 2}
    whole = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    response = httpx.post(f"{server.base_url}/v1/completions", json=streamed, timeout=120)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [e.removeprefix("data:").strip() for e in response.text.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    *choice_events, usage_event = [json.loads(e) for e in events[:-1]]
    choices = [event["choices"][0] for event in choice_events]
    assert [len(event["choices"]) for event in choice_events] == [1, 1]
    raw = {"stop": "eos_token", "length": "length"}  # a stream's finish reasons are TGI's raw ones
    for ours, expected in zip(choices, whole["choices"], strict=True):
        # the second search reads the first one's KV from the prefix cache: its sums may differ in the last bits
        assert abs(ours.pop("cum_log_probs") - expected.pop("cum_log_probs")) <= 1e-4
        assert ours == {**expected, "finish_reason": raw[expected["finish_reason"]]}
    assert usage_event["choices"] == [] and usage_event["usage"] == whole["usage"]


def test_generate_beam_search_extension_returns_the_other_beams_as_best_of_sequences(beam_server):
    server, model, tokenizer = beam_server
    parameters = {"best_of": 3, "use_beam_search": True, "max_new_tokens": MAX_TOKENS, "details": True}
    body = httpx.post(f"{server.base_url}/generate", json={"inputs": PROMPT, "parameters": parameters}, timeout=120)
    assert body.status_code == 200, body.text
    answer = body.json()
    expected = transformers_beams(
        model, tokenizer(PROMPT).input_ids, 3, MAX_TOKENS, tokenizer.eos_token_id, num_return=3
    )
    texts = [answer["generated_text"], *(s["generated_text"] for s in answer["details"]["best_of_sequences"])]
    assert texts == [tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in expected]
    assert [t["id"] for t in answer["details"]["tokens"]] == expected[0][0]


def test_lightllm_beam_mode_searches_best_of_beams(tmp_path):
    tokenizer = byte_level_tokenizer()
    model = tiny_hf_model(LlamaConfig, vocab_size=320, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    command = [
        sys.executable,
        "-m",
        "tgi_compat.api.cli.api_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(_free_port()),
    ]
    command += ["--model_dir", str(tmp_path), "--max_req_total_len", "512", "--max_req_input_len", "500", "--beam_mode"]
    parameters = {"best_of": 2, "max_new_tokens": MAX_TOKENS}  # greedy best_of: a beam search with --beam_mode
    with launched(command, dict(os.environ), "beam-mode-") as server:
        body = httpx.post(f"{server.base_url}/generate", json={"inputs": PROMPT, "parameters": parameters}, timeout=120)
    assert body.status_code == 200, body.text
    ((best, _),) = transformers_beams(model, tokenizer(PROMPT).input_ids, 2, MAX_TOKENS, tokenizer.eos_token_id)
    assert body.json()["generated_text"] == tokenizer.decode(best, skip_special_tokens=True)
