"""POST /, /generate, /generate_stream, /tokenize (docs/contract.md §2-§7)."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tgi_compat.protocol.errors import TgiError, parse_json_body, validation_error
from tgi_compat.protocol.openapi import json_body
from tgi_compat.protocol.sse import data_event, event_stream
from tgi_compat.protocol.tgi import CompatGenerateRequest, GenerateRequest, SimpleToken, dump_json
from tgi_compat.server.auth import require_api_key
from tgi_compat.server.state import AppState, get_state
from tgi_compat.serving.frame import RequestFrame
from tgi_compat.serving.responses import generate_response, stream_event_json, stream_headers, timing_headers
from tgi_compat.serving.validation import check_best_of_limits, check_stream_only, num_sequences

router = APIRouter(dependencies=[Depends(require_api_key)])


async def generate_json(state: AppState, body: GenerateRequest, span: Any, *, as_list: bool) -> Response:
    """Non-streaming generation; `as_list` wraps the body in a one-element array (POST /)."""
    frame = RequestFrame(state, span)
    params = body.parameters
    try:
        check_best_of_limits(params, state.limits)
        n = num_sequences(params)
        async with frame.admit(body.inputs, params, permits=n) as admitted:
            request = admitted.request
            results = await admitted.best_of(n) if n > 1 else [await admitted.to_end()]
    except TgiError as error:
        frame.failed(error)
        return error.response()
    frame.succeeded(request, results[0], n)
    payload = generate_response(request, results).to_dict()
    headers = timing_headers(
        frame.timings, request.input_length, results[0].generated_tokens, state.compute_type, body.inputs
    )
    return JSONResponse([payload] if as_list else payload, headers=headers)


def generate_stream(state: AppState, body: GenerateRequest, http_request: Request, route: str) -> Response:
    """SSE generation; every failure, validation included, is one error event on HTTP 200."""

    async def events():
        frame = RequestFrame(state)
        with state.request_span(route, http_request) as span:
            frame.span = span
            try:
                check_stream_only(body.parameters)
                async with frame.admit(body.inputs, body.parameters) as admitted:
                    request = admitted.request
                    async with aclosing(admitted.stream_batches()) as batches:
                        async for steps in batches:
                            # One SSE event per token; tokens that arrived together share one write.
                            yield b"".join([data_event(stream_event_json(request, step)) for step in steps])
                            if (result := steps[-1].result) is not None:
                                frame.succeeded(request, result)
            except TgiError as error:
                frame.failed(error)
                yield data_event(dump_json(error.body()))

    return event_stream(events(), stream_headers(state.compute_type, body.inputs))


@router.post(
    "/",
    openapi_extra=json_body("CompatGenerateRequest"),
    summary="Generate tokens if `stream == false` or a stream of token if `stream == true`",
)
async def compat_generate(request: Request) -> Response:
    state = get_state(request)
    body = await parse_json_body(request, CompatGenerateRequest, state.config.payload_limit)
    if body.parameters.return_full_text is None:
        body.parameters.return_full_text = state.compat_return_full_text
    if body.stream:
        return generate_stream(state, body, request, "compat_generate")
    with state.request_span("compat_generate", request) as span:
        return await generate_json(state, body, span, as_list=True)


@router.post("/generate", openapi_extra=json_body("GenerateRequest"), summary="Generate tokens")
async def generate(request: Request) -> Response:
    state = get_state(request)
    body = await parse_json_body(request, GenerateRequest, state.config.payload_limit)
    with state.request_span("generate", request) as span:
        return await generate_json(state, body, span, as_list=False)


@router.post(
    "/generate_stream",
    openapi_extra=json_body("GenerateRequest"),
    summary="Generate a stream of token using Server-Sent Events",
)
async def generate_stream_route(request: Request) -> Response:
    state = get_state(request)
    body = await parse_json_body(request, GenerateRequest, state.config.payload_limit)
    return generate_stream(state, body, request, "generate_stream")


@router.post("/tokenize", openapi_extra=json_body("GenerateRequest"), summary="Tokenize inputs")
async def tokenize(request: Request) -> Response:
    """Bare array of SimpleToken with byte offsets; `truncate` is ignored, not counted in metrics."""
    state = get_state(request)
    body = await parse_json_body(request, GenerateRequest, state.config.payload_limit)
    try:
        spans = await state.tokenizer.spans(body.inputs)
    except Exception as error:  # any tokenizer failure is the client's input
        return validation_error(f"tokenizer error {error}").response()
    raw = body.inputs.encode("utf-8")
    tokens = [
        SimpleToken(
            id=span.id,
            text=raw[span.start : span.stop].decode("utf-8", errors="replace"),
            start=span.start,
            stop=span.stop,
        ).to_dict()
        for span in spans
    ]
    return JSONResponse(tokens)
