"""TGI's chat API behind POST /v1/chat/completions and POST /chat_tokenize.

A chat request becomes a TGI generate request: the chat template renders the prompt (no special
tokens added: the template has them), the OpenAI sampling fields map onto GenerateParameters the
way TGI maps them (chat_request.py), and the validated request runs through the same frame and
generation loop as /generate.

`response_format` constrains the answer with a grammar; `tools` constrain it to a tool call and
come back as `tool_calls` (tools.py: TGI's tool grammar and prompt injection). When the model
picks `no_tool`, TGI answers again in plain text, without tools or grammar, under the same permit.
`n` is accepted and ignored like TGI (one choice); `logit_bias` must be an array (TGI's type) and
is ignored.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

from tgi_compat.api.protocol.answers import JsonAnswer, StreamAnswer
from tgi_compat.api.protocol.errors import TgiError, validation_error
from tgi_compat.api.protocol.openai import ChatRequest
from tgi_compat.api.protocol.openai_common import stream_error_event
from tgi_compat.api.protocol.sse import data_event, done_event
from tgi_compat.api.serving.chat.request import (
    ChatPrompt,
    TemplatedService,
    chat_parameters,
    render_prompt,
    without_tools,
)
from tgi_compat.api.serving.chat.responses import chat_completion, token_chunk, tool_chunk, usage_chunk
from tgi_compat.api.serving.chat.tools import StreamSignal, ToolStream, new_tool_call_id, parse_tool_answer
from tgi_compat.api.serving.frame import Admitted, RequestFrame
from tgi_compat.api.serving.responses import stream_headers, timing_headers
from tgi_compat.api.serving.tokenization import simple_tokens


class ChatService(TemplatedService):
    def response_model(self, body: ChatRequest) -> str:
        return self.state.served_model_name if body.model in (None, "tgi") else body.model

    async def render(self, body: ChatRequest) -> ChatPrompt:
        return await asyncio.to_thread(render_prompt, self.template, body)  # Jinja: off the loop

    async def create(self, body: ChatRequest) -> JsonAnswer | StreamAnswer:
        """A chat.completion, or its chunks as SSE when `stream`; template errors are 422 either way."""
        frame = RequestFrame(self.state)
        try:
            prompt = await self.render(body)
        except TgiError as error:
            frame.failed(error)
            return JsonAnswer.error(error)
        if body.stream:
            return StreamAnswer(self._events(frame, body, prompt), stream_headers(self.state.compute_type, prompt.text))
        return await self._complete(frame, body, prompt)

    async def _complete(self, frame: RequestFrame, body: ChatRequest, prompt: ChatPrompt) -> JsonAnswer:
        state = self.state
        params = chat_parameters(body)
        tool_calls = None
        try:
            async with frame.admit(prompt.text, params, add_special_tokens=False, grammar=prompt.grammar) as admitted:
                result = await admitted.to_end()
                if prompt.uses_tools and (tool_calls := parse_tool_answer(result.generated_text)) is None:
                    prompt = await self.render(without_tools(body))
                    await admitted.revalidate(prompt.text, params, add_special_tokens=False)
                    result = await admitted.to_end()
                request = admitted.request
        except TgiError as error:
            frame.failed(error)
            return JsonAnswer.error(error)
        frame.succeeded(request, result)
        cached = state.reported_cached_tokens(result.cached_tokens)
        payload = chat_completion(self.response_model(body), result, bool(body.logprobs), tool_calls, cached)
        headers = timing_headers(
            frame.timings, request.input_length, result.generated_tokens, state.compute_type, prompt.text
        )
        return JsonAnswer(payload.to_dict(), headers)

    async def _events(self, frame: RequestFrame, body: ChatRequest, prompt: ChatPrompt) -> AsyncIterator[bytes]:
        """The stream: a `no_tool` answer restarts it as a plain answer; errors are one event; [DONE]."""
        params = chat_parameters(body)
        try:
            async with frame.admit(prompt.text, params, add_special_tokens=False, grammar=prompt.grammar) as admitted:
                while True:
                    async with aclosing(self._answer(frame, admitted, body, prompt)) as chunks:
                        async for chunk in chunks:
                            if chunk is None:
                                break
                            yield chunk
                        else:
                            break
                    prompt = await self.render(without_tools(body))  # the model chose `no_tool`
                    await admitted.revalidate(prompt.text, params, add_special_tokens=False)
        except TgiError as error:
            frame.failed(error)
            yield stream_error_event(error)
        yield done_event()

    async def _answer(
        self, frame: RequestFrame, admitted: Admitted, body: ChatRequest, prompt: ChatPrompt
    ) -> AsyncGenerator[bytes | None, None]:
        """The events of one generation; a final None means the model chose `no_tool` (answer again)."""
        model, logprobs = self.response_model(body), bool(body.logprobs)
        tools = ToolStream() if prompt.uses_tools else None
        call_id = new_tool_call_id()
        async with aclosing(admitted.stream()) as steps:
            async for step in steps:
                piece = tools.push(step.token.text, step.token.special) if tools is not None else None
                if piece is StreamSignal.NO_TOOL:
                    yield None
                    return
                if tools is None or piece is StreamSignal.EMPTY_CONTENT:
                    yield data_event(token_chunk(model, step, logprobs))
                elif piece is not None:
                    yield data_event(tool_chunk(model, step, logprobs, piece, call_id))
                if step.result is not None:
                    frame.succeeded(admitted.request, step.result)
                    if body.stream_options.include_usage:
                        cached = self.state.reported_cached_tokens(step.result.cached_tokens)
                        yield data_event(usage_chunk(model, step.result, cached))

    async def tokenize(self, body: ChatRequest) -> JsonAnswer:
        """`{"tokenize_response": [SimpleToken...], "templated_text": prompt}`; not counted in metrics."""
        try:
            prompt = (await self.render(body)).text
            spans = await self.state.tokenizer.spans(await self.state.expand_images(prompt), add_special_tokens=False)
        except TgiError as error:
            return JsonAnswer.error(error)
        except Exception as error:  # tokenizer failures are the client's input
            return JsonAnswer.error(validation_error(f"tokenizer error {error}"))
        return JsonAnswer({"tokenize_response": simple_tokens(prompt, spans), "templated_text": prompt})
