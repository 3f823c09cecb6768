"""A /v1/completions request checked and mapped onto TGI's generate requests, and the OpenAI
legacy pieces of its answer: `logprobs` ({tokens, token_logprobs, top_logprobs, text_offset}),
the choices with AIAK's `sentence_length` / `cum_log_probs`, and a stream's last events."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tgi_compat.api.protocol.errors import TgiError, validation_error
from tgi_compat.api.protocol.openai import CompletionRequest
from tgi_compat.api.protocol.openai_common import (
    openai_finish_reason,
    openai_parameters,
    system_fingerprint,
    unix_now,
)
from tgi_compat.api.protocol.openai_responses import CompletionChoice, TextCompletion, Usage
from tgi_compat.api.protocol.sse import data_event, done_event
from tgi_compat.api.protocol.tgi import GenerateParameters, PrefillToken, Token, dump_json
from tgi_compat.api.serving.generation import GenerationResult
from tgi_compat.api.serving.state import AppState

# ---------------------------------------------------------------------------------- parameters


def _suffix_error() -> TgiError:
    return TgiError(
        422,
        "Suffix is not supported and can be achieved by preprocessing the prompt.",
        "suffix not supported",
        "validation",
    )


def _batch_error(max_client_batch_size: int) -> TgiError:
    message = f"Number of prompts exceeds the maximum allowed batch size of {max_client_batch_size}"
    return TgiError(422, message, "batch size exceeded", "validation")


def is_greedy(body: CompletionRequest) -> bool:
    return body.temperature == 0.0


@dataclass(frozen=True, slots=True)
class Fanout:
    n: int  # choices returned per prompt
    best_of: int  # sequences generated per prompt


def check_request(state: AppState, body: CompletionRequest) -> Fanout:
    """TGI's checks (suffix, prompt count), then ours for the OpenAI extensions."""
    if body.suffix is not None:
        raise _suffix_error()
    if len(body.prompts) > state.limits.max_client_batch_size:
        raise _batch_error(state.limits.max_client_batch_size)
    if body.response_format is not None:
        body.response_format.check_shape()
    limit = state.limits.max_best_of
    n = 1 if body.n is None else body.n
    best_of = n if body.best_of is None else body.best_of
    if not 0 < n <= limit:
        raise validation_error(f"`n` must be > 0 and <= {limit}. Given: {n}")
    if not n <= best_of <= limit:
        raise validation_error(f"`best_of` must be >= `n` and <= {limit}. Given: {best_of}")
    if best_of > 1 and is_greedy(body):
        raise validation_error("you must use sampling when `n` or `best_of` is > 1")
    if best_of > 1 and body.seed is not None:
        raise validation_error("`seed` must not be set when `best_of` > 1")
    if body.stream and best_of != n:
        raise validation_error("`best_of` != `n` is not supported when streaming tokens")
    return Fanout(n=n, best_of=best_of)


def completion_parameters(body: CompletionRequest) -> GenerateParameters:
    return openai_parameters(
        body,
        repetition_penalty=body.repetition_penalty,
        top_n_tokens=body.logprobs,
        decoder_input_details=not body.stream,
        long_truncation_mode=body.long_truncation_mode,
        token_healing=body.token_healing,
        return_all_prompt_logprobs=body.return_all_prompt_logprobs,
        logit_bias=body.logit_bias,
    )


# ------------------------------------------------------------------------------------ logprobs


def _top_dict(text: str, logprob: float | None, alternatives: list[Token]) -> dict[str, float | None]:
    top = {alt.text: alt.logprob for alt in alternatives}
    top.setdefault(text, logprob)  # OpenAI lists the chosen token too
    return top


class OpenAILogprobs:
    """OpenAI legacy `logprobs`: parallel lists; `text_offset` counts characters of the choice text."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset
        self.value: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, text: str, logprob: float | None, top: dict[str, float | None] | None) -> None:
        self.value["tokens"].append(text)
        self.value["token_logprobs"].append(logprob)
        self.value["top_logprobs"].append(top)
        self.value["text_offset"].append(self.offset)
        self.offset += len(text)

    def add_prompt(self, prefill: list[PrefillToken], top_tokens: list[list[Token]]) -> None:
        """The echoed prompt: the first token has no score, the others their prefill top-k."""
        for position, token in enumerate(prefill):
            alternatives = top_tokens[position] if position < len(top_tokens) else []
            top = _top_dict(token.text, token.logprob, alternatives) if position else None
            self.add(token.text, token.logprob, top)

    def add_generated(self, tokens: list[Token], top_tokens: list[list[Token]]) -> None:
        for position, token in enumerate(tokens):
            alternatives = top_tokens[position] if position < len(top_tokens) else []
            self.add(token.text, token.logprob, _top_dict(token.text, token.logprob, alternatives))


def cumulative_logprob(tokens: list[Token]) -> float:
    return sum(t.logprob for t in tokens if t.logprob is not None and math.isfinite(t.logprob))


def completion_choice(body: CompletionRequest, index: int, prompt: str, result: GenerationResult) -> CompletionChoice:
    echo = bool(body.echo)
    logprobs = None
    if body.logprobs is not None:
        builder = OpenAILogprobs()
        if echo:
            builder.add_prompt(result.prefill, result.prefill_top_tokens)
            builder.offset = len(prompt)
        builder.add_generated(result.tokens, result.top_tokens)
        logprobs = builder.value
    return CompletionChoice(
        index=index,
        text=prompt + result.generated_text if echo else result.generated_text,
        logprobs=logprobs,
        finish_reason=openai_finish_reason(result.finish_reason),
        sentence_length=result.generated_tokens,
        cum_log_probs=cumulative_logprob(result.tokens),
    )


def final_chunk(model: str, choices: list[CompletionChoice], usage: Usage) -> bytes:
    """A stream's event that ends a sequence (TGI: the whole text_completion shape, with its usage)."""
    final = TextCompletion(
        created=unix_now(), model=model, system_fingerprint=system_fingerprint(), choices=choices, usage=usage
    )
    return data_event(dump_json(final.to_dict()))


def stream_end(body: CompletionRequest, model: str, usage: Usage) -> bytes:
    """What closes a stream: the `choices: []` usage chunk when `stream_options.include_usage` asks, then [DONE]."""
    wants_usage = body.stream_options is not None and body.stream_options.include_usage
    return (final_chunk(model, [], usage) if wants_usage else b"") + done_event()
