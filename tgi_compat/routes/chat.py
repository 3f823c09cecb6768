"""POST /v1/chat/completions and POST /chat_tokenize (docs/contract.md §9).

A chat request becomes a TGI generate request: the chat template renders the prompt (no special
tokens added: the template has them), the OpenAI sampling fields map onto GenerateParameters the
way TGI maps them, and the validated request runs through the same generation loop as /generate.

Not supported yet (refused, never faked): tool calling (`Tool error`, 422) and `response_format`
(TGI's `grammar is not supported` validation error, as under --disable-grammar-support).
`n` is accepted and ignored like TGI (one choice); `logit_bias` must be an array (TGI's type) and
is ignored.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tgi_compat.protocol.errors import TgiError, validation_error
from tgi_compat.protocol.openai import ChatRequest, FunctionDefinition, Tool
from tgi_compat.protocol.openai_common import (
    openai_finish_reason,
    parse_openai_body,
    served_model_name,
    stream_error_event,
    system_fingerprint,
    unix_now,
)
from tgi_compat.protocol.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprob,
    ChatLogprobs,
    ChatMessage,
    ChatTopLogprob,
    Usage,
)
from tgi_compat.protocol.openapi import json_body, register_schemas
from tgi_compat.protocol.sse import data_event, done_event, event_stream
from tgi_compat.protocol.tgi import GenerateParameters, SimpleToken, Token, dump_json
from tgi_compat.server.auth import require_api_key
from tgi_compat.server.state import AppState, get_state
from tgi_compat.serving.chat_template import (
    ChatTemplate,
    load_chat_template,
    template_error,
    template_messages,
    tool_error,
)
from tgi_compat.serving.frame import RequestFrame
from tgi_compat.serving.generation import GenerationResult, TokenStep
from tgi_compat.serving.responses import stream_headers, timing_headers

router = APIRouter()
register_schemas(ChatRequest)
_NO_TEMPLATE = object()
# tool_choice "auto" adds TGI's open-ended `no_tool` function to the tools.
_NO_TOOL = Tool(
    type="function",
    function=FunctionDefinition(
        name="no_tool", description="Open ended response with no specific tool selected", parameters={"type": "object"}
    ),
)


# ------------------------------------------------------------------------------ chat -> generate


def chat_template(request: Request) -> ChatTemplate | None:
    """The app's template, loaded on first use and kept on `app.state` (tests may preset it)."""
    template = getattr(request.app.state, "chat_template", None)
    if template is None:
        state = get_state(request)
        template = load_chat_template(state.config, state.tokenizer.tokenizer) or _NO_TEMPLATE
        request.app.state.chat_template = template
    return None if template is _NO_TEMPLATE else template


def _tools_in_use(body: ChatRequest) -> list[Tool]:
    """TGI's ToolGrammar::apply selection: which tools the request would constrain generation to."""
    if body.tools is None:
        return []
    choice = body.tool_choice
    if choice is None or choice == "auto":
        return [*body.tools, _NO_TOOL]
    if choice == "none":
        return []
    if choice == "required":
        return list(body.tools)
    name = choice if isinstance(choice, str) else choice.function.name
    chosen = [tool for tool in body.tools if tool.function.name == name]
    if not chosen:
        raise tool_error(f"Tool with name {name} not found")
    return chosen[:1]


def render_prompt(template: ChatTemplate | None, body: ChatRequest) -> str:
    """Tool checks, then the chat template (errors are HTTP 422 even on streams, like TGI)."""
    if body.response_format is not None and body.tools is not None:
        raise tool_error("Grammar and tools are mutually exclusive")
    if _tools_in_use(body):
        # TGI would constrain generation with a JSON grammar built from the tools; this server
        # has no grammar support yet, so it refuses instead of answering as if tools worked.
        raise tool_error("tool calling is not supported by this server yet")
    if template is None:
        raise template_error("template not found")
    return template.render(template_messages(body.messages))


def chat_parameters(body: ChatRequest) -> GenerateParameters:
    greedy = body.temperature == 0.0  # exactly 0 means greedy; anything else samples
    model = body.model if body.model != "tgi" else None
    return GenerateParameters(
        adapter_id=model,
        do_sample=not greedy,
        temperature=None if greedy else body.temperature,
        repetition_penalty=None if body.presence_penalty is None else body.presence_penalty + 2.0,
        frequency_penalty=body.frequency_penalty,
        top_p=body.top_p,
        max_new_tokens=body.max_tokens,
        stop=list(body.stop or []),
        seed=body.seed,
        top_n_tokens=body.top_logprobs,
        grammar=body.response_format,  # refused by validation (no grammar support yet)
        details=True,
    )


def response_model(state: AppState, body: ChatRequest) -> str:
    return served_model_name(state) if body.model in (None, "tgi") else body.model


# --------------------------------------------------------------------------------------- shapes


def _logprob_entry(token: Token, top_tokens: list[Token]) -> ChatLogprob:
    return ChatLogprob(
        token=token.text,
        logprob=token.logprob,
        top_logprobs=[ChatTopLogprob(token=t.text, logprob=t.logprob) for t in top_tokens],
    )


def completion_logprobs(result: GenerationResult) -> ChatLogprobs:
    tops = result.top_tokens
    return ChatLogprobs(
        content=[_logprob_entry(token, tops[i] if i < len(tops) else []) for i, token in enumerate(result.tokens)]
    )


def chat_completion(model: str, result: GenerationResult, logprobs: bool) -> ChatCompletion:
    return ChatCompletion(
        created=unix_now(),
        model=model,
        system_fingerprint=system_fingerprint(),
        choices=[
            ChatChoice(
                index=0,
                message=ChatMessage(content=result.generated_text),
                logprobs=completion_logprobs(result) if logprobs else None,
                finish_reason=openai_finish_reason(result.finish_reason),
            )
        ],
        usage=Usage.of(result.input_length, result.generated_tokens),
    )


def _chunk(model: str, choices: list[ChatChunkChoice], usage_: Usage | None) -> str:
    chunk = ChatCompletionChunk(
        created=unix_now(), model=model, system_fingerprint=system_fingerprint(), choices=choices, usage=usage_
    )
    return dump_json(chunk.to_dict())


def token_chunk(model: str, step: TokenStep, logprobs: bool) -> str:
    """One token: role on every chunk, "" for special tokens, finish_reason on the last."""
    result = step.result
    choice = ChatChunkChoice(
        index=0,
        delta=ChatDelta(content="" if step.token.special else step.token.text),
        logprobs=ChatLogprobs(content=[_logprob_entry(step.token, step.top_tokens)]) if logprobs else None,
        finish_reason=openai_finish_reason(result.finish_reason) if result is not None else None,
    )
    return _chunk(model, [choice], None)


def usage_chunk(model: str, result: GenerationResult) -> str:
    return _chunk(model, [], Usage.of(result.input_length, result.generated_tokens))


# --------------------------------------------------------------------------------------- routes


async def _chat_json(frame: RequestFrame, body: ChatRequest, prompt: str) -> Response:
    state = frame.state
    try:
        async with frame.admit(prompt, chat_parameters(body), add_special_tokens=False) as admitted:
            request = admitted.request
            result = await admitted.to_end()
    except TgiError as error:
        frame.failed(error)
        return error.response()
    frame.succeeded(request, result)
    payload = chat_completion(response_model(state, body), result, bool(body.logprobs)).to_dict()
    headers = timing_headers(frame.timings, request.input_length, result.generated_tokens, state.compute_type, prompt)
    return JSONResponse(payload, headers=headers)


def _chat_stream(frame: RequestFrame, body: ChatRequest, prompt: str) -> Response:
    state = frame.state
    model = response_model(state, body)
    logprobs = bool(body.logprobs)

    async def events():
        try:
            async with frame.admit(prompt, chat_parameters(body), add_special_tokens=False) as admitted:
                async for step in admitted.stream():
                    yield data_event(token_chunk(model, step, logprobs))
                    if step.result is not None:
                        frame.succeeded(admitted.request, step.result)
                        if body.stream_options.include_usage:
                            yield data_event(usage_chunk(model, step.result))
        except TgiError as error:
            frame.failed(error)
            yield stream_error_event(error)
        yield done_event()

    return event_stream(events(), stream_headers(state.compute_type, prompt))


@router.post(
    "/v1/chat/completions",
    openapi_extra=json_body("ChatRequest"),
    dependencies=[Depends(require_api_key)],
    summary="Generate tokens",
)
async def chat_completions(request: Request) -> Response:
    state = get_state(request)
    body = await parse_openai_body(request, ChatRequest, state.config.payload_limit)
    frame = RequestFrame(state)
    try:
        prompt = await asyncio.to_thread(render_prompt, chat_template(request), body)  # Jinja: off the loop
    except TgiError as error:
        frame.failed(error)
        return error.response()
    if body.stream:
        return _chat_stream(frame, body, prompt)
    return await _chat_json(frame, body, prompt)


@router.post("/chat_tokenize", openapi_extra=json_body("ChatRequest"), summary="Template and tokenize ChatRequest")
async def chat_tokenize(request: Request) -> Response:
    """`{"tokenize_response": [SimpleToken...], "templated_text": prompt}`; no API key (TGI)."""
    state = get_state(request)
    body = await parse_openai_body(request, ChatRequest, state.config.payload_limit)
    try:
        prompt = await asyncio.to_thread(render_prompt, chat_template(request), body)  # Jinja: off the loop
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
