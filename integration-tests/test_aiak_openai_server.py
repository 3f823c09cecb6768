"""A server started the AIAK way (`python -m tgi_compat.openai_server` with AIAK's vLLM-style arguments, the
embedded model) answers the AIAK client parameters of /v1/completions through the `openai` client, with
AIAK's output fields `sentence_length` (generated tokens) and `cum_log_probs` (their summed logprobs) in
each choice; a refused argument stops the start with its reason."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import httpx
import openai
import pytest
from harness import REPO_ROOT, _free_port, launched

MAX_MODEL_LEN = 512
PROMPT = "The capital of France is"
GREEDY_TEXT = " Paris.\n"  # 3 tokens
PARIS_ID = 7042  # SmolLM2's " Paris"


@pytest.fixture(scope="module")
def aiak_server():
    command = [
        sys.executable, "-m", "tgi_compat.openai_server", "--host", "127.0.0.1", "--port", str(_free_port()),
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--tensor-parallel-size", "1", "--dtype", "auto",
        "--enable-prefix-caching", "--enable-chunked-prefill", "--distributed-executor-backend", "mp",
    ]  # fmt: skip
    with launched(command, {**os.environ, "LOG_LEVEL": "info"}, "aiak-server-") as handle:
        yield handle


@pytest.fixture(scope="module")
def oai(aiak_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{aiak_server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def complete(oai: openai.OpenAI, **params):
    return oai.completions.create(model="tgi", prompt=PROMPT, **{"max_tokens": 3, **params})


def aiak_fields(choice) -> tuple[int, float]:
    return choice.model_extra["sentence_length"], choice.model_extra["cum_log_probs"]


def test_limits_come_from_the_aiak_arguments(aiak_server):
    info = httpx.get(f"{aiak_server.base_url}/info", timeout=30).json()
    assert (info["max_total_tokens"], info["max_input_tokens"]) == (MAX_MODEL_LEN, MAX_MODEL_LEN - 1)


def test_logprobs_and_the_output_fields_agree(oai):
    response = complete(oai, temperature=0, logprobs=2)
    (choice,) = response.choices
    assert choice.text == GREEDY_TEXT
    sentence_length, cum_log_probs = aiak_fields(choice)
    assert sentence_length == response.usage.completion_tokens == len(choice.logprobs.tokens) == 3
    assert math.isclose(cum_log_probs, sum(choice.logprobs.token_logprobs), abs_tol=1e-4) and cum_log_probs < 0
    assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)


def test_echo_prepends_the_prompt_and_counts_only_generated_tokens(oai):
    (choice,) = complete(oai, temperature=0, echo=True, logprobs=1).choices
    assert choice.text == PROMPT + GREEDY_TEXT
    sentence_length, cum_log_probs = aiak_fields(choice)
    assert sentence_length == 3 and len(choice.logprobs.tokens) > 3
    assert math.isclose(cum_log_probs, sum(choice.logprobs.token_logprobs[-3:]), abs_tol=1e-4)


def test_n_and_best_of(oai):
    response = complete(oai, temperature=1.0, n=2, best_of=2, logprobs=1)
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:  # a sampled sibling may end early, on its EOS
        sentence_length, cum_log_probs = aiak_fields(choice)
        assert sentence_length == len(choice.logprobs.tokens)
        assert math.isclose(cum_log_probs, sum(choice.logprobs.token_logprobs), abs_tol=1e-4)
    assert len(complete(oai, temperature=1.0, n=1, best_of=2).choices) == 1


def test_seed_reproduces_a_sampled_completion(oai):
    first, second = (complete(oai, temperature=1.0, seed=7, max_tokens=5).choices[0] for _ in range(2))
    assert first.text == second.text and aiak_fields(first) == aiak_fields(second)


def test_stop_ends_at_the_stop_string(oai):
    (choice,) = complete(oai, temperature=0, stop=["."]).choices
    assert choice.text == " Paris." and aiak_fields(choice)[0] == 2


def test_logit_bias_forces_and_forbids_a_token(oai):
    forced = complete(oai, temperature=0, logit_bias={str(PARIS_ID): 100}).choices[0]
    assert forced.text == " Paris Paris Paris" and aiak_fields(forced) == (3, 0.0)
    forbidden = complete(oai, temperature=0, logit_bias={str(PARIS_ID): -100}).choices[0]
    assert not forbidden.text.startswith(" Paris")


def test_presence_penalty_and_user_are_accepted(oai):
    # /v1/completions takes both; `user` is ignored as OpenAI's identifier, and presence_penalty has no
    # effect yet (TGI ignores it on this route too): the greedy answer is unchanged.
    (choice,) = complete(oai, temperature=0, presence_penalty=1.5, user="aiak-client").choices
    assert choice.text == GREEDY_TEXT and aiak_fields(choice)[0] == 3


def test_stream_options_include_usage_and_the_last_choice_has_the_output_fields(oai):
    chunks = list(complete(oai, temperature=0, stream=True, stream_options={"include_usage": True}))
    *token_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in token_chunks) == GREEDY_TEXT
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 3
    last = token_chunks[-1].choices[0]
    assert last.finish_reason == "length" and aiak_fields(last)[0] == 3
    assert all("sentence_length" not in (c.choices[0].model_extra or {}) for c in token_chunks[:-1])


def test_suffix_is_refused_with_tgi_s_message(oai):
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        complete(oai, suffix=" and Berlin")
    assert refused.value.body == "Suffix is not supported and can be achieved by preprocessing the prompt."


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["-pp", "2"], "--pipeline-parallel-size 2: pipeline parallelism is not built"),
        (
            ["--tokenizer-extension-path", "/ext"],
            "--tokenizer-extension-path /ext: tokenizer extensions are not supported",
        ),
    ],
)
def test_a_refused_argument_stops_the_start_with_its_reason(argv, reason):
    done = subprocess.run(
        [sys.executable, "-m", "tgi_compat.api.cli.openai_server", *argv],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert done.returncode == 1 and reason in done.stderr
