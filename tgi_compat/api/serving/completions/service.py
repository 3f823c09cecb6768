"""TGI's /v1/completions behind the route, plus the OpenAI parameters vLLM-based servers accept.

Like TGI: every prompt is an independent generate request (special tokens added, details on);
`suffix` and more than --max-client-batch-size prompts are refused before anything runs; a stream
interleaves the prompts' tokens, ends each prompt with its usage and its *raw* finish reason, and
closes with `data: [DONE]`.

Beyond TGI (OpenAI legacy API / vLLM): `echo` (prompt prepended), `logprobs` (OpenAI's
{tokens, token_logprobs, top_logprobs, text_offset}), `n`/`best_of` (choice index = prompt * n + k;
best_of > n keeps the n highest cumulative logprobs), `stream_options.include_usage` (a final
`choices: []` chunk), `user` (ignored), and AIAK's `sentence_length` / `cum_log_probs` in choices.
`logit_bias` (token id -> bias in [-100, 100]) is added to the raw logits before every processor.
A prompt may be token ids (`[1, 2]`, `[[1, 2], [3]]`: what lm-eval sends); ids outside the vocabulary
are a 422, and `echo` shows their decoded text. With `echo` and `logprobs: k`, every echoed prompt
position but the first lists the prefill's k likeliest tokens (on streams in the echo's chunk, which then
comes with the first token). `response_format` constrains every
choice as on chat (tgi_compat/api/protocol/grammar.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from tgi_compat.api.protocol.answers import JsonAnswer, StreamAnswer
from tgi_compat.api.protocol.errors import TgiError
from tgi_compat.api.protocol.openai import CompletionRequest, Prompt
from tgi_compat.api.protocol.openai_common import (
    stream_error_event,
    summed_headers,
    system_fingerprint,
    unix_now,
)
from tgi_compat.api.protocol.openai_responses import (
    CompletionChoice,
    CompletionChunk,
    CompletionStreamChoice,
    TextCompletion,
    Usage,
)
from tgi_compat.api.protocol.sse import data_event
from tgi_compat.api.protocol.tgi import dump_json
from tgi_compat.api.serving.completions.beam import beam_completions
from tgi_compat.api.serving.completions.request import (
    Fanout,
    OpenAILogprobs,
    check_request,
    completion_choice,
    completion_parameters,
    cumulative_logprob,
    final_chunk,
    stream_end,
)
from tgi_compat.api.serving.frame import RequestFrame
from tgi_compat.api.serving.generation import GenerationResult, PromptScores
from tgi_compat.api.serving.responses import stream_headers, timing_headers
from tgi_compat.api.serving.state import AppState, Service


class CompletionService(Service):
    async def create(self, body: CompletionRequest) -> JsonAnswer | StreamAnswer:
        """The text_completion, or its chunks as SSE when `stream`; request-level checks fail before any prompt runs."""
        if body.use_beam_search:
            return await beam_completions(self.state, body)
        try:
            fanout = check_request(self.state, body)
        except TgiError as error:
            RequestFrame(self.state).failed(error)
            return JsonAnswer.error(error)
        if body.stream:
            return _completions_stream(self.state, body, fanout)
        return await _completions_json(self.state, body, fanout)


# ----------------------------------------------------------------------------------- non-stream


@dataclass(slots=True)
class PromptOutcome:
    prompt: str  # its text (token ids decoded)
    results: list[GenerationResult]  # the n kept sequences
    headers: dict[str, str]


async def _run_prompt(state: AppState, body: CompletionRequest, prompt: Prompt, fanout: Fanout) -> PromptOutcome:
    frame = RequestFrame(state)
    try:
        params = completion_parameters(body)
        async with frame.admit(prompt, params, permits=fanout.best_of, grammar=body.response_format) as admitted:
            request = admitted.request
            if body.echo and body.logprobs is not None:  # echoed positions list their top-k too (OpenAI, vLLM)
                request.score_prompt()
            results = [await admitted.to_end()] if fanout.best_of == 1 else await admitted.best_of(fanout.best_of)
    except TgiError as error:
        frame.failed(error)
        raise
    frame.succeeded(request, results[0], fanout.best_of)
    if fanout.best_of > fanout.n:
        results = sorted(results, key=lambda r: cumulative_logprob(r.tokens), reverse=True)[: fanout.n]
    headers = timing_headers(
        frame.timings, request.input_length, results[0].generated_tokens, state.compute_type, request.inputs
    )
    return PromptOutcome(request.inputs, results, headers)


async def _all_or_cancel(awaitables: list[Awaitable[PromptOutcome]]) -> list[PromptOutcome]:
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:  # one prompt failed (or the client left): stop the others too
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # let them release their engine requests
        raise


async def _completions_json(state: AppState, body: CompletionRequest, fanout: Fanout) -> JsonAnswer:
    try:
        outcomes = await _all_or_cancel([_run_prompt(state, body, prompt, fanout) for prompt in body.prompts])
    except TgiError as error:
        return JsonAnswer.error(error)
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
        model=state.served_model_name,
        system_fingerprint=system_fingerprint(),
        choices=choices,
        usage=Usage.of(prompt_tokens, completion_tokens, state.reported_cached_tokens(cached_tokens)),
    )
    return JsonAnswer(payload.to_dict(), summed_headers([o.headers for o in outcomes]))


# --------------------------------------------------------------------------------------- stream


def _stream_chunk(model: str, choice: CompletionStreamChoice) -> bytes:
    chunk = CompletionChunk(created=unix_now(), choices=[choice], model=model, system_fingerprint=system_fingerprint())
    return data_event(dump_json(chunk.to_dict()))


def _echoed(index: int, text: str, scores: PromptScores | None) -> CompletionStreamChoice:
    """The echoed prompt's chunk, with its logprobs when it was scored."""
    logprobs = None
    if scores is not None:
        builder = OpenAILogprobs()
        builder.add_prompt(scores.prefill, scores.top_tokens)
        logprobs = builder.value
    return CompletionStreamChoice(index=index, text=text, logprobs=logprobs, finish_reason="")


_DONE = object()


@dataclass(slots=True)
class _UsageTotals:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


async def _stream_sequence(
    state: AppState, body: CompletionRequest, prompt: Prompt, index: int, out: asyncio.Queue, totals: _UsageTotals
) -> None:
    """One sequence's events into `out`; errors become an OpenAI-route error event."""
    model = state.served_model_name
    frame = RequestFrame(state)
    want_logprobs = body.logprobs is not None
    try:
        async with frame.admit(prompt, completion_parameters(body), grammar=body.response_format) as admitted:
            text = admitted.request.inputs
            offset = len(text) if body.echo else 0
            if body.echo and body.logprobs is not None:  # the echo waits for the prompt's scores (first event)
                admitted.request.score_prompt()
            elif body.echo:
                await out.put(_stream_chunk(model, _echoed(index, text, None)))
            async for step in admitted.stream():
                if body.echo and step.prompt is not None:
                    await out.put(_stream_chunk(model, _echoed(index, text, step.prompt)))
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
                    final_chunk(
                        model,
                        [last],
                        Usage.of(
                            result.input_length,
                            result.generated_tokens,
                            state.reported_cached_tokens(result.cached_tokens),
                        ),
                    )
                )
    except TgiError as error:
        frame.failed(error)
        await out.put(stream_error_event(error))
    finally:
        out.put_nowait(_DONE)


def _completions_stream(state: AppState, body: CompletionRequest, fanout: Fanout) -> StreamAnswer:
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
            cached = state.reported_cached_tokens(totals.cached_tokens)
            usage = Usage.of(totals.prompt_tokens, totals.completion_tokens, cached)
            yield stream_end(body, state.served_model_name, usage)
        finally:
            for task in tasks:  # the client went away: stop generating for it
                task.cancel()

    # x-compute-characters sums the prompts' characters (TGI); token-id prompts, decoded later, count none
    characters = "".join(prompt for prompt in prompts if isinstance(prompt, str))
    return StreamAnswer(events(), stream_headers(state.compute_type, characters))
