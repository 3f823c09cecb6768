"""/v1/completions with vLLM's `use_beam_search`: per prompt, `beam_width` beams (default `n`) searched over the
engine (tgi_compat/api/serving/beam_search.py) and the `n` best hypotheses returned as its choices, best first,
with `cum_log_probs` their summed logprobs. No sampling, logprobs, echo, suffix or response_format with it.

`stream: true` is not refused: vLLM does not refuse it either, it answers a beam search whole, as if not streamed
(its serving_completion: "we do not stream the results when use beam search"), since no token is final before the
search ends. We keep the client's SSE framing instead: once the search ends, each choice comes as one event with its
whole text (the event that ends a sequence on our streams, with its usage), then the usage chunk that
`stream_options.include_usage` asks for and `[DONE]`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tgi_compat.api.protocol.answers import JsonAnswer, StreamAnswer
from tgi_compat.api.protocol.errors import TgiError, validation_error
from tgi_compat.api.protocol.openai import CompletionRequest, Prompt
from tgi_compat.api.protocol.openai_common import openai_finish_reason, system_fingerprint, unix_now
from tgi_compat.api.protocol.openai_responses import CompletionChoice, TextCompletion, Usage
from tgi_compat.api.serving.beam_search import Beam, BeamSearchParams, beam_search
from tgi_compat.api.serving.completions.request import completion_parameters, final_chunk, stream_end
from tgi_compat.api.serving.frame import RequestFrame
from tgi_compat.api.serving.responses import stream_headers
from tgi_compat.api.serving.state import AppState


async def beam_completions(state: AppState, body: CompletionRequest) -> JsonAnswer | StreamAnswer:
    try:
        n, width = _check(state, body)
        prompts = await asyncio.gather(*(_search(state, body, prompt, width) for prompt in body.prompts))
    except TgiError as error:
        return JsonAnswer.error(error)
    # per prompt: its prompt tokens and its n choices
    outcomes = [
        (num_prompt_tokens, [_choice(state, p * n + k, beam, body.stream) for k, beam in enumerate(beams[:n])])
        for p, (num_prompt_tokens, beams) in enumerate(prompts)
    ]
    choices = [choice for _, prompt_choices in outcomes for choice in prompt_choices]
    prompt_tokens = sum(num_prompt_tokens for num_prompt_tokens, _ in outcomes)
    usage = Usage.of(prompt_tokens, sum(choice.sentence_length or 0 for choice in choices))
    if body.stream:
        return _streamed(state, body, outcomes, usage)
    payload = TextCompletion(
        created=unix_now(),
        model=state.served_model_name,
        system_fingerprint=system_fingerprint(),
        choices=choices,
        usage=usage,
    )
    return JsonAnswer(payload.to_dict())


def _check(state: AppState, body: CompletionRequest) -> tuple[int, int]:
    """(n, beam width), or the reason beam search cannot serve the body."""
    refused = {
        "echo": body.echo,
        "logprobs": body.logprobs,
        "suffix": body.suffix,
        "response_format": body.response_format,
        "seed": body.seed,
    }
    if given := [name for name, value in refused.items() if value not in (None, False)]:
        raise validation_error(f"`use_beam_search` does not combine with `{given[0]}`")
    if body.temperature not in (None, 0.0) or body.top_p is not None:
        raise validation_error("`use_beam_search` scores the model's own distribution: no `temperature` or `top_p`")
    if len(body.prompts) > state.limits.max_client_batch_size:
        raise validation_error(f"at most {state.limits.max_client_batch_size} prompts per request")
    n = body.n or 1
    width = body.beam_width or n
    if not 0 < n <= width <= state.limits.max_best_of:
        raise validation_error(f"`beam_width` must be >= `n` and <= {state.limits.max_best_of}. Given: {width}")
    return n, width


async def _search(state: AppState, body: CompletionRequest, prompt: Prompt, width: int) -> tuple[int, list[Beam]]:
    """(prompt tokens, hypotheses best first) of one prompt, validated as any completion (its permits: the beams)."""
    frame = RequestFrame(state)
    try:
        async with frame.admit(prompt, completion_parameters(body), permits=width) as admitted:
            request = admitted.request
            eos = frozenset(state.engine.info.eos_token_ids)
            params = BeamSearchParams(width, request.max_new_tokens, body.length_penalty, body.early_stopping, eos)
            return request.input_length, await beam_search(state.engine, request.prompt_ids, params)
    except TgiError as error:
        frame.failed(error)
        raise


def _choice(state: AppState, index: int, beam: Beam, streamed: bool) -> CompletionChoice:
    eos = state.engine.info.eos_token_ids
    ended = bool(beam.token_ids) and beam.token_ids[-1] in eos
    text_ids = beam.token_ids[:-1] if ended else beam.token_ids
    finish_reason = "eos_token" if ended else "length"
    return CompletionChoice(
        index=index,
        text=state.tokenizer.decode(text_ids, skip_special_tokens=True),
        logprobs=None,
        finish_reason=finish_reason if streamed else openai_finish_reason(finish_reason),  # raw on streams (TGI)
        sentence_length=len(beam.token_ids),
        cum_log_probs=beam.cum_logprob,
    )


def _streamed(
    state: AppState, body: CompletionRequest, outcomes: list[tuple[int, list[CompletionChoice]]], usage: Usage
) -> StreamAnswer:
    """The searched choices as a stream's events: each one's final event (its usage: the prompt and its tokens), then
    the stream's end with the request's usage."""
    model = state.served_model_name
    events = [
        final_chunk(model, [choice], Usage.of(num_prompt_tokens, choice.sentence_length or 0))
        for num_prompt_tokens, choices in outcomes
        for choice in choices
    ]
    events.append(stream_end(body, model, usage))

    async def sent() -> AsyncIterator[bytes]:
        for event in events:
            yield event

    characters = "".join(prompt for prompt in body.prompts if isinstance(prompt, str))
    return StreamAnswer(sent(), stream_headers(state.compute_type, characters))
