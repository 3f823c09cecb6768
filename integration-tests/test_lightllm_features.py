"""LightLLM's per-request features over raw HTTP against the session server (TGI launcher):
long_truncation_mode, token_healing and return_all_prompt_logprobs, streamed and not."""

from __future__ import annotations

import json

import pytest
from harness import MAX_TOTAL_TOKENS

LONG_PROMPT = "one two three four five six seven eight nine ten " * 60  # ~600 tokens > max_input_tokens


async def tokenize(http, text: str) -> list[int]:
    response = await http.post("/tokenize", json={"inputs": text})
    return [token["id"] for token in response.json()]


async def stream_events(http, inputs: str, parameters: dict) -> list[dict]:
    events = []
    async with http.stream("POST", "/generate_stream", json={"inputs": inputs, "parameters": parameters}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:") :]))
    return events


# ------------------------------------------------------------------------- long_truncation_mode


async def test_an_over_long_prompt_is_refused_without_a_mode(http):
    response = await http.post("/generate", json={"inputs": LONG_PROMPT, "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 422
    assert "must be <= 512" in response.json()["error"]


@pytest.mark.parametrize("mode", ["head", "center"])
async def test_truncation_keeps_the_largest_fitting_prompt(http, mode):
    ids = await tokenize(http, LONG_PROMPT)
    budget = MAX_TOTAL_TOKENS - 2  # max_new_tokens=2 binds before max_input_tokens (= max_total - 1)
    params = {
        "max_new_tokens": 2,
        "long_truncation_mode": mode,
        "decoder_input_details": True,
        "return_full_text": True,
    }
    response = await http.post("/generate", json={"inputs": LONG_PROMPT, "parameters": params})
    assert response.status_code == 200, response.text
    body = response.json()
    details = body["details"]
    assert details["truncated_prompt_tokens"] == len(ids) - budget
    assert response.headers["x-prompt-tokens"] == str(budget)
    kept = [token["id"] for token in details["prefill"]]  # the server runs --enable-prefill-logprobs
    expected = ids[-budget:] if mode == "head" else ids[: budget // 2] + ids[len(ids) - (budget - budget // 2) :]
    assert kept == expected
    assert body["generated_text"].startswith(LONG_PROMPT)  # return_full_text: the original prompt


async def test_truncation_is_reported_on_the_stream(http):
    ids = await tokenize(http, LONG_PROMPT)
    events = await stream_events(
        http, LONG_PROMPT, {"max_new_tokens": 2, "long_truncation_mode": "head", "details": True}
    )
    details = events[-1]["details"]
    assert details["input_length"] == MAX_TOTAL_TOKENS - 2
    assert details["truncated_prompt_tokens"] == len(ids) - (MAX_TOTAL_TOKENS - 2)
    assert all(event["details"] is None for event in events[:-1])


async def test_a_prompt_that_fits_reports_zero_dropped_tokens(http):
    params = {"max_new_tokens": 2, "long_truncation_mode": "center", "details": True}
    body = (await http.post("/generate", json={"inputs": "Hello there", "parameters": params})).json()
    assert body["details"]["truncated_prompt_tokens"] == 0


async def test_without_a_mode_no_extension_keys_appear(http):
    body = (
        await http.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2, "details": True}})
    ).json()
    assert "truncated_prompt_tokens" not in body["details"] and "prefill_top_tokens" not in body["details"]


async def test_a_bad_mode_is_a_422(http):
    response = await http.post("/generate", json={"inputs": "Hi", "parameters": {"long_truncation_mode": "tail"}})
    assert response.status_code == 422


# ------------------------------------------------------------------------------- token_healing

HEALING_CASES = [
    ("The capital of Fra", "nce"),  # a word cut in two
    ("Visit https:", "//"),  # a URL scheme
]


@pytest.mark.parametrize("prompt, start", HEALING_CASES)
async def test_healed_generation_continues_the_cut_word(http, prompt, start):
    params = {"max_new_tokens": 6, "token_healing": True, "details": True}
    body = (await http.post("/generate", json={"inputs": prompt, "parameters": params})).json()
    text, details = body["generated_text"], body["details"]
    assert text.startswith(start), text
    assert "".join(token["text"] for token in details["tokens"]) == text  # no prompt text re-emitted
    assert details["generated_tokens"] == len(details["tokens"]) == 6  # re-covering tokens are not counted


@pytest.mark.parametrize("prompt, start", HEALING_CASES)
async def test_healed_stream_equals_the_healed_response(http, prompt, start):
    params = {"max_new_tokens": 6, "token_healing": True, "details": True}
    body = (await http.post("/generate", json={"inputs": prompt, "parameters": params})).json()
    events = await stream_events(http, prompt, params)
    assert "".join(event["token"]["text"] for event in events) == body["generated_text"]
    assert [event["index"] for event in events] == list(range(1, 7))
    assert events[-1]["generated_text"] == body["generated_text"]
    assert events[-1]["details"]["input_length"] == len(await tokenize(http, prompt))


@pytest.mark.parametrize("prompt", ["The answer is (", "Hello "])
async def test_healing_with_sampling_and_best_of(http, prompt):
    params = {
        "max_new_tokens": 5,
        "token_healing": True,
        "best_of": 2,
        "do_sample": True,
        "details": True,
        "return_full_text": True,
    }
    body = (await http.post("/generate", json={"inputs": prompt, "parameters": params})).json()
    sequences = [body, *body["details"]["best_of_sequences"]]
    assert len(sequences) == 2
    for sequence in sequences:
        assert sequence["generated_text"].startswith(prompt)
        tokens = sequence["tokens"] if "tokens" in sequence else sequence["details"]["tokens"]
        generated = sequence["generated_text"][len(prompt) :]
        if generated == "" and tokens[-1]["text"] == "":
            continue  # sampled to an end inside a UTF-8 character: TGI's final decode then gives no text at all
        assert "".join(token["text"] for token in tokens if not token["special"]) == generated


async def test_healing_a_one_token_prompt_is_plain_generation(http):
    plain = (await http.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}})).json()
    healed = (
        await http.post(
            "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4, "token_healing": True}}
        )
    ).json()
    assert healed == plain


# -------------------------------------------------------------------- return_all_prompt_logprobs

PROMPT = "The quick brown fox jumps over the lazy dog"


async def test_all_prompt_logprobs_without_the_server_flag_or_details(http):
    ids = await tokenize(http, PROMPT)
    params = {"max_new_tokens": 2, "return_all_prompt_logprobs": True}
    body = (await http.post("/generate", json={"inputs": PROMPT, "parameters": params})).json()
    prefill = body["details"]["prefill"]
    assert [token["id"] for token in prefill] == ids
    assert prefill[0]["logprob"] is None
    assert all(token["logprob"] is not None and token["logprob"] <= 0 for token in prefill[1:])
    # the same numbers TGI's own decoder_input_details path reports (--enable-prefill-logprobs)
    reference = (
        await http.post(
            "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "decoder_input_details": True}}
        )
    ).json()
    reference_prefill = reference["details"]["prefill"]
    assert reference_prefill[0]["logprob"] is None
    assert [t["logprob"] for t in reference_prefill[1:]] == pytest.approx([t["logprob"] for t in prefill[1:]], rel=1e-5)


async def test_prompt_top_alternatives_with_top_n_tokens(http):
    params = {"max_new_tokens": 2, "return_all_prompt_logprobs": True, "top_n_tokens": 3}
    details = (await http.post("/generate", json={"inputs": PROMPT, "parameters": params})).json()["details"]
    prefill, alternatives = details["prefill"], details["prefill_top_tokens"]
    assert len(alternatives) == len(prefill) and alternatives[0] == []
    for token, top in zip(prefill[1:], alternatives[1:]):
        logprobs = [t["logprob"] for t in top]
        assert len(top) >= 3 and logprobs == sorted(logprobs, reverse=True)
        assert token["logprob"] <= logprobs[0] + 1e-6
        if token["id"] in [t["id"] for t in top]:
            assert token["logprob"] == pytest.approx(
                next(t["logprob"] for t in top if t["id"] == token["id"]), rel=1e-5
            )


async def test_all_prompt_logprobs_arrive_with_the_last_stream_event(http):
    ids = await tokenize(http, PROMPT)
    events = await stream_events(http, PROMPT, {"max_new_tokens": 3, "return_all_prompt_logprobs": True})
    details = events[-1]["details"]
    assert [token["id"] for token in details["prefill"]] == ids and details["prefill"][0]["logprob"] is None
    assert all(event["details"] is None for event in events[:-1])
