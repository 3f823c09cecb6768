"""POST /v1/completions (docs/contract.md §10) plus the OpenAI parameters vLLM-based servers accept.

Like TGI: every prompt is an independent generate request (special tokens added, details on);
`suffix` and more than --max-client-batch-size prompts are refused before anything runs; a stream
interleaves the prompts' tokens, ends each prompt with its usage and its *raw* finish reason, and
closes with `data: [DONE]`.

Beyond TGI (OpenAI legacy API / vLLM): `echo` (prompt prepended), `logprobs` (OpenAI's
{tokens, token_logprobs, top_logprobs, text_offset}), `n`/`best_of` (choice index = prompt * n + k;
best_of > n keeps the n highest cumulative logprobs), `stream_options.include_usage` (a final
`choices: []` chunk), `user` (ignored), and AIAK's `sentence_length` / `cum_log_probs` in choices.
`logit_bias` (token id -> bias in [-100, 100]) is added to the raw logits before every processor.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tgi_compat.protocol.errors import TgiError, validation_error
from tgi_compat.protocol.openai import CompletionRequest
from tgi_compat.protocol.openai_common import (
    openai_finish_reason,
    parse_openai_body,
    reported_cached_tokens,
    served_model_name,
    stream_error_event,
    summed_headers,
    system_fingerprint,
    unix_now,
)
from tgi_compat.protocol.openai_responses import (
    CompletionChoice,
    CompletionChunk,
    CompletionStreamChoice,
    TextCompletion,
    Usage,
)
from tgi_compat.protocol.openapi import json_body, register_schemas
from tgi_compat.protocol.sse import data_event, done_event, event_stream
from tgi_compat.protocol.tgi import GenerateParameters, PrefillToken, Token, dump_json
from tgi_compat.server.auth import require_api_key
from tgi_compat.server.state import AppState, get_state
from tgi_compat.serving.frame import RequestFrame
from tgi_compat.serving.generation import GenerationResult
from tgi_compat.serving.responses import stream_headers, timing_headers

router = APIRouter()
register_schemas(CompletionRequest)


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
    greedy = is_greedy(body)
    return GenerateParameters(
        adapter_id=body.model if body.model != "tgi" else None,
        do_sample=not greedy,
        temperature=None if greedy else body.temperature,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        top_p=body.top_p,
        max_new_tokens=body.max_tokens,
        stop=list(body.stop or []),
        seed=body.seed,
        top_n_tokens=body.logprobs,
        details=True,
        decoder_input_details=not body.stream,
        long_truncation_mode=body.long_truncation_mode,
        token_healing=body.token_healing,
        return_all_prompt_logprobs=body.return_all_prompt_logprobs,
        logit_bias=body.logit_bias,
    )


# ------------------------------------------------------------------------------------ logprobs


def _top_dict(token: Token, alternatives: list[Token]) -> dict[str, float | None]:
    top = {alt.text: alt.logprob for alt in alternatives}
    top.setdefault(token.text, token.logprob)  # OpenAI lists the sampled token too
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

    def add_prompt(self, prefill: list[PrefillToken]) -> None:
        for position, token in enumerate(prefill):
            self.add(token.text, token.logprob, None if position == 0 else {token.text: token.logprob})

    def add_generated(self, tokens: list[Token], top_tokens: list[list[Token]]) -> None:
        for position, token in enumerate(tokens):
            alternatives = top_tokens[position] if position < len(top_tokens) else []
            self.add(token.text, token.logprob, _top_dict(token, alternatives))


def cumulative_logprob(tokens: list[Token]) -> float:
    return sum(t.logprob for t in tokens if t.logprob is not None and math.isfinite(t.logprob))


# ----------------------------------------------------------------------------------- non-stream


@dataclass(slots=True)
class PromptOutcome:
    prompt: str
    results: list[GenerationResult]  # the n kept sequences
    headers: dict[str, str]


async def _run_prompt(state: AppState, body: CompletionRequest, prompt: str, fanout: Fanout) -> PromptOutcome:
    frame = RequestFrame(state)
    try:
        async with frame.admit(prompt, completion_parameters(body), permits=fanout.best_of) as admitted:
            request = admitted.request
            request.prompt_logprobs = request.prompt_logprobs or (bool(body.echo) and body.logprobs is not None)
            results = [await admitted.to_end()] if fanout.best_of == 1 else await admitted.best_of(fanout.best_of)
    except TgiError as error:
        frame.failed(error)
        raise
    frame.succeeded(request, results[0], fanout.best_of)
    if fanout.best_of > fanout.n:
        results = sorted(results, key=lambda r: cumulative_logprob(r.tokens), reverse=True)[: fanout.n]
    headers = timing_headers(
        frame.timings, request.input_length, results[0].generated_tokens, state.compute_type, prompt
    )
    return PromptOutcome(prompt, results, headers)


async def _all_or_cancel(awaitables: list[Awaitable[PromptOutcome]]) -> list[PromptOutcome]:
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:  # one prompt failed (or the client left): stop the others too
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # let them release their engine requests
        raise


def completion_choice(body: CompletionRequest, index: int, prompt: str, result: GenerationResult) -> CompletionChoice:
    echo = bool(body.echo)
    logprobs = None
    if body.logprobs is not None:
        builder = OpenAILogprobs()
        if echo:
            builder.add_prompt(result.prefill)
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


async def _completions_json(state: AppState, body: CompletionRequest, fanout: Fanout) -> Response:
    try:
        outcomes = await _all_or_cancel([_run_prompt(state, body, prompt, fanout) for prompt in body.prompts])
    except TgiError as error:
        return error.response()
    choices: list[CompletionChoice] = []
    prompt_tokens, completion_tokens, cached_tokens = 0, 0, 0
    for prompt_index, outcome in enumerate(outcomes):
        for k, result in enumerate(outcome.results):
            choices.append(completion_choice(body, prompt_index * fanout.n + k, outcome.prompt, result))
            prompt_tokens += result.input_length
            completion_tokens += result.generated_tokens
            cached_tokens += result.cached_tokens
    payload = TextCompletion(
        created=unix_now(),
        model=served_model_name(state),
        system_fingerprint=system_fingerprint(),
        choices=choices,
        usage=Usage.of(prompt_tokens, completion_tokens, reported_cached_tokens(state, cached_tokens)),
    )
    return JSONResponse(payload.to_dict(), headers=summed_headers([o.headers for o in outcomes]))


# --------------------------------------------------------------------------------------- stream


def _stream_chunk(model: str, choice: CompletionStreamChoice) -> bytes:
    chunk = CompletionChunk(created=unix_now(), choices=[choice], model=model, system_fingerprint=system_fingerprint())
    return data_event(dump_json(chunk.to_dict()))


def _final_chunk(model: str, choices: list[CompletionChoice], usage: Usage) -> bytes:
    final = TextCompletion(
        created=unix_now(), model=model, system_fingerprint=system_fingerprint(), choices=choices, usage=usage
    )
    return data_event(dump_json(final.to_dict()))


_DONE = object()


@dataclass(slots=True)
class _UsageTotals:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


async def _stream_sequence(
    state: AppState, body: CompletionRequest, prompt: str, index: int, out: asyncio.Queue, totals: _UsageTotals
) -> None:
    """One sequence's events into `out`; errors become an OpenAI-route error event."""
    model = served_model_name(state)
    frame = RequestFrame(state)
    want_logprobs = body.logprobs is not None
    try:
        async with frame.admit(prompt, completion_parameters(body)) as admitted:
            offset = 0
            if body.echo:
                echoed = CompletionStreamChoice(index=index, text=prompt, logprobs=None, finish_reason="")
                await out.put(_stream_chunk(model, echoed))
                offset = len(prompt)
            async for step in admitted.stream():
                logprobs = None
                if want_logprobs:
                    builder = OpenAILogprobs(offset)
                    builder.add_generated([step.token], [step.top_tokens])
                    logprobs, offset = builder.value, builder.offset
                result = step.result
                if result is None:
                    choice = CompletionStreamChoice(
                        index=index, text=step.token.text, logprobs=logprobs, finish_reason=""
                    )
                    await out.put(_stream_chunk(model, choice))
                    continue
                frame.succeeded(admitted.request, result)
                totals.prompt_tokens += result.input_length
                totals.completion_tokens += result.generated_tokens
                totals.cached_tokens += result.cached_tokens
                last = CompletionChoice(
                    index=index,
                    text=step.token.text,
                    logprobs=logprobs,
                    finish_reason=result.finish_reason,  # raw on streams (TGI)
                    sentence_length=result.generated_tokens,
                    cum_log_probs=cumulative_logprob(result.tokens),
                )
                await out.put(
                    _final_chunk(
                        model,
                        [last],
                        Usage.of(
                            result.input_length,
                            result.generated_tokens,
                            reported_cached_tokens(state, result.cached_tokens),
                        ),
                    )
                )
    except TgiError as error:
        frame.failed(error)
        await out.put(stream_error_event(error))
    finally:
        out.put_nowait(_DONE)


def _completions_stream(state: AppState, body: CompletionRequest, fanout: Fanout) -> Response:
    prompts = body.prompts

    async def events() -> AsyncIterator[bytes]:
        out: asyncio.Queue = asyncio.Queue()
        totals = _UsageTotals()
        tasks = [
            asyncio.create_task(_stream_sequence(state, body, prompt, p * fanout.n + k, out, totals))
            for p, prompt in enumerate(prompts)
            for k in range(fanout.n)
        ]
        try:
            remaining = len(tasks)
            while remaining:
                event = await out.get()
                if event is _DONE:
                    remaining -= 1
                    continue
                yield event
            if body.stream_options is not None and body.stream_options.include_usage:
                cached = reported_cached_tokens(state, totals.cached_tokens)
                usage = Usage.of(totals.prompt_tokens, totals.completion_tokens, cached)
                yield _final_chunk(served_model_name(state), [], usage)
            yield done_event()
        finally:
            for task in tasks:  # the client went away: stop generating for it
                task.cancel()

    characters = "".join(prompts)  # x-compute-characters sums the prompts' characters (TGI)
    return event_stream(events(), stream_headers(state.compute_type, characters))


@router.post(
    "/v1/completions",
    openapi_extra=json_body("CompletionRequest"),
    dependencies=[Depends(require_api_key)],
    summary="Generate tokens",
)
async def completions(request: Request) -> Response:
    state = get_state(request)
    body = await parse_openai_body(request, CompletionRequest, state.config.payload_limit)
    try:
        fanout = check_request(state, body)
    except TgiError as error:
        RequestFrame(state).failed(error)
        return error.response()
    if body.stream:
        return _completions_stream(state, body, fanout)
    return await _completions_json(state, body, fanout)
