"""POST /v1/chat/completions and POST /chat_tokenize (docs/contract.md §9).

A chat request becomes a TGI generate request: the chat template renders the prompt (no special
tokens added: the template has them), the OpenAI sampling fields map onto GenerateParameters the
way TGI maps them, and the validated request runs through the same generation loop as /generate.

`response_format` constrains the answer with a grammar; `tools` constrain it to a tool call and
come back as `tool_calls` (tgi_compat/tools.py, TGI's tool grammar and prompt injection).
`n` is accepted and ignored like TGI (one choice); `logit_bias` must be an array (TGI's type) and
is ignored.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tgi_compat.protocol.errors import TgiError, validation_error
from tgi_compat.protocol.openai import ChatRequest
from tgi_compat.protocol.openai_common import (
    openai_finish_reason,
    parse_openai_body,
    reported_cached_tokens,
    served_model_name,
    stream_error_event,
    system_fingerprint,
    unix_now,
)
from tgi_compat.protocol.openai_responses import Usage
from tgi_compat.protocol.openapi import json_body, register_schemas
from tgi_compat.protocol.sse import data_event, done_event, event_stream
from tgi_compat.protocol.tgi import SimpleToken, Token, dump_json
from tgi_compat.server.auth import require_api_key
from tgi_compat.server.state import AppState, get_state
from tgi_compat.serving import accounting
from tgi_compat.serving.chat_request import ChatPrompt, chat_parameters, chat_template, render_prompt, without_tools
from tgi_compat.serving.chat_template import (
    ChatTemplate,
)
from tgi_compat.serving.frame import validate_request
from tgi_compat.serving.generation import GenerationResult, Timings, TokenStep, generate_to_end, stream_sequence
from tgi_compat.serving.responses import stream_headers, timing_headers
from tgi_compat.serving.tools import (
    StreamSignal,
    ToolDelta,
    ToolStream,
    next_tool_call_id,
    parse_tool_answer,
)

router = APIRouter()
register_schemas(ChatRequest)


def response_model(state: AppState, body: ChatRequest) -> str:
    return served_model_name(state) if body.model in (None, "tgi") else body.model


# --------------------------------------------------------------------------------------- shapes


def _logprob_entry(token: Token, top_tokens: list[Token], text: str | None = None) -> dict[str, Any]:
    return {
        "token": token.text if text is None else text,
        "logprob": token.logprob,
        "top_logprobs": [{"token": t.text, "logprob": t.logprob} for t in top_tokens],
    }


def completion_logprobs(result: GenerationResult) -> dict[str, Any]:
    tops = result.top_tokens
    return {
        "content": [_logprob_entry(token, tops[i] if i < len(tops) else []) for i, token in enumerate(result.tokens)]
    }


def chat_completion(
    model: str,
    result: GenerationResult,
    logprobs: bool,
    tool_calls: list[dict[str, Any]] | None = None,
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    """TGI's chat.completion; a tool call's message has `tool_calls` and no `content` key."""
    message = (
        {"role": "assistant", "tool_calls": tool_calls}
        if tool_calls is not None
        else {"role": "assistant", "content": result.generated_text}
    )
    return {
        "object": "chat.completion",
        "id": "",
        "created": unix_now(),
        "model": model,
        "system_fingerprint": system_fingerprint(),
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": completion_logprobs(result) if logprobs else None,
                "finish_reason": openai_finish_reason(result.finish_reason),
            }
        ],
        "usage": Usage.of(result.input_length, result.generated_tokens, cached_tokens).to_dict(),
    }


def _chunk(model: str, choices: list[dict[str, Any]], usage_: dict[str, Any] | None) -> str:
    return dump_json(
        {
            "object": "chat.completion.chunk",
            "id": "",
            "created": unix_now(),
            "model": model,
            "system_fingerprint": system_fingerprint(),
            "choices": choices,
            "usage": usage_,
        }
    )


def token_chunk(model: str, step: TokenStep, logprobs: bool) -> str:
    """One token: role on every chunk, "" for special tokens, finish_reason on the last."""
    result = step.result
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "content": "" if step.token.special else step.token.text},
        "logprobs": {"content": [_logprob_entry(step.token, step.top_tokens)]} if logprobs else None,
        "finish_reason": openai_finish_reason(result.finish_reason) if result is not None else None,
    }
    return _chunk(model, [choice], None)


def tool_chunk(model: str, step: TokenStep, logprobs: bool, delta: ToolDelta, call_id: str) -> str:
    """One piece of a streamed tool call (TGI's ToolCallDelta); its logprob entry shows the piece sent."""
    result = step.result
    call = {
        "index": 0,
        "id": call_id,
        "type": "function",
        "function": {"name": delta.name, "arguments": delta.arguments},
    }
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "tool_calls": [call]},
        "logprobs": {"content": [_logprob_entry(step.token, step.top_tokens, delta.arguments)]} if logprobs else None,
        "finish_reason": openai_finish_reason(result.finish_reason) if result is not None else None,
    }
    return _chunk(model, [choice], None)


def usage_chunk(model: str, result: GenerationResult, cached_tokens: int | None = None) -> str:
    return _chunk(model, [], Usage.of(result.input_length, result.generated_tokens, cached_tokens).to_dict())


# --------------------------------------------------------------------------------------- routes


async def _chat_json(
    state: AppState, template: ChatTemplate | None, body: ChatRequest, prompt: ChatPrompt, timings: Timings
) -> Response:
    params = chat_parameters(body)
    tool_calls = None
    try:
        with state.permits.hold(1), accounting.inflight(state) as inflight:
            request = await validate_request(
                state, prompt.text, params, add_special_tokens=False, grammar=prompt.grammar
            )
            first_token = inflight.first_token if inflight is not None else None
            result = await generate_to_end(state, request, timings, first_token)
            if prompt.uses_tools and (tool_calls := parse_tool_answer(result.generated_text)) is None:
                # `no_tool`: TGI answers again, in plain text, without tools or grammar
                prompt = render_prompt(template, without_tools(body))
                request = await validate_request(state, prompt.text, params, add_special_tokens=False)
                result = await generate_to_end(state, request, timings)
    except TgiError as error:
        accounting.failed(state, error)
        return error.response()
    accounting.succeeded(state, request, result, timings)
    cached = reported_cached_tokens(state, result.cached_tokens)
    payload = chat_completion(response_model(state, body), result, bool(body.logprobs), tool_calls, cached)
    headers = timing_headers(timings, request.input_length, result.generated_tokens, state.compute_type, prompt.text)
    return JSONResponse(payload, headers=headers)


def _chat_stream(
    state: AppState, template: ChatTemplate | None, body: ChatRequest, prompt: ChatPrompt, timings: Timings
) -> Response:
    model = response_model(state, body)
    logprobs = bool(body.logprobs)

    async def answer(chat_prompt: ChatPrompt, on_first_token):
        """The events of one generation; a StreamSignal.NO_TOOL item ends it (answer again)."""
        request = await validate_request(
            state, chat_prompt.text, chat_parameters(body), add_special_tokens=False, grammar=chat_prompt.grammar
        )
        tools = ToolStream() if chat_prompt.uses_tools else None
        call_id = next_tool_call_id(body)
        steps = stream_sequence(state, request, timings, streaming=True, on_first_token=on_first_token)
        async with aclosing(steps):
            async for step in steps:
                piece = tools.push(step.token.text, step.token.special) if tools is not None else None
                if piece is StreamSignal.NO_TOOL:
                    yield piece
                    return
                if tools is None or piece is StreamSignal.EMPTY_CONTENT:
                    yield data_event(token_chunk(model, step, logprobs))
                elif piece is not None:
                    yield data_event(tool_chunk(model, step, logprobs, piece, call_id))
                if step.result is not None:
                    accounting.succeeded(state, request, step.result, timings)
                    if body.stream_options.include_usage:
                        cached = reported_cached_tokens(state, step.result.cached_tokens)
                        yield data_event(usage_chunk(model, step.result, cached))

    async def events():
        try:
            with state.permits.hold(1), accounting.inflight(state) as inflight:
                first_token = inflight.first_token if inflight is not None else None
                chat_prompt, restart = prompt, True
                while restart:
                    restart = False
                    async with aclosing(answer(chat_prompt, first_token)) as chunks:
                        async for chunk in chunks:
                            if chunk is StreamSignal.NO_TOOL:  # TGI restarts the stream as a plain answer
                                chat_prompt = await asyncio.to_thread(render_prompt, template, without_tools(body))
                                restart = True
                                break
                            yield chunk
        except TgiError as error:
            accounting.failed(state, error)
            yield stream_error_event(error)
        yield done_event()

    return event_stream(events(), stream_headers(state.compute_type, prompt.text))


@router.post(
    "/v1/chat/completions",
    openapi_extra=json_body("ChatRequest"),
    dependencies=[Depends(require_api_key)],
    summary="Generate tokens",
)
async def chat_completions(request: Request) -> Response:
    state = get_state(request)
    body = await parse_openai_body(request, ChatRequest, state.config.payload_limit)
    timings = Timings(arrival=time.perf_counter())
    accounting.received(state)
    template = chat_template(request)
    try:
        prompt = await asyncio.to_thread(render_prompt, template, body)  # Jinja: off the loop
    except TgiError as error:
        accounting.failed(state, error)
        return error.response()
    if body.stream:
        return _chat_stream(state, template, body, prompt, timings)
    return await _chat_json(state, template, body, prompt, timings)


@router.post("/chat_tokenize", openapi_extra=json_body("ChatRequest"), summary="Template and tokenize ChatRequest")
async def chat_tokenize(request: Request) -> Response:
    """`{"tokenize_response": [SimpleToken...], "templated_text": prompt}`; no API key (TGI)."""
    state = get_state(request)
    body = await parse_openai_body(request, ChatRequest, state.config.payload_limit)
    try:
        prompt = (await asyncio.to_thread(render_prompt, chat_template(request), body)).text  # Jinja: off the loop
        spans = await state.tokenizer.spans(prompt, add_special_tokens=False)
    except TgiError as error:
        return error.response()
    except Exception as error:  # tokenizer failures are the client's input
        return validation_error(f"tokenizer error {error}").response()
    raw = prompt.encode("utf-8")
    tokens = [
        SimpleToken(
            id=span.id,
            text=raw[span.start : span.stop].decode("utf-8", errors="replace"),
            start=span.start,
            stop=span.stop,
        ).to_dict()
        for span in spans
    ]
    return JSONResponse({"tokenize_response": tokens, "templated_text": prompt})
