"""TGI's native generation API behind POST /, /generate, /generate_stream and /tokenize.

`GenerateService` takes a parsed GenerateRequest and answers it: a JSON body (one response, or a
one-element array for POST /) with TGI's x-* timing headers, or an SSE stream where every failure,
validation included, is one error event on HTTP 200.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

from fastapi import Request

from tgi_compat.api.protocol.answers import JsonAnswer, StreamAnswer
from tgi_compat.api.protocol.errors import TgiError, validation_error
from tgi_compat.api.protocol.sse import data_event
from tgi_compat.api.protocol.tgi import CompatGenerateRequest, GenerateRequest, dump_json
from tgi_compat.api.serving.beam_generate import check_not_streamed, generate_beams, wants_beam_search
from tgi_compat.api.serving.frame import RequestFrame
from tgi_compat.api.serving.responses import generate_response, stream_event_json, stream_headers, timing_headers
from tgi_compat.api.serving.state import Service
from tgi_compat.api.serving.tokenization import simple_tokens
from tgi_compat.api.serving.validation import check_best_of_limits, check_stream_only, num_sequences


class GenerateService(Service):
    async def compat(self, body: CompatGenerateRequest, http_request: Request) -> JsonAnswer | StreamAnswer:
        """POST /: `stream` picks the shape; `return_full_text` defaults by the model's pipeline tag."""
        if body.parameters.return_full_text is None:
            body.parameters.return_full_text = self.state.compat_return_full_text
        if body.stream:
            return self.stream(body, http_request, "compat_generate")
        return await self.generate(body, http_request, "compat_generate", as_list=True)

    async def generate(
        self, body: GenerateRequest, http_request: Request, route: str, *, as_list: bool = False
    ) -> JsonAnswer:
        """Non-streaming generation; `as_list` wraps the body in a one-element array (POST /)."""
        with self.state.request_span(route, http_request) as span:
            return await self._generate(body, span, as_list)

    async def _generate(self, body: GenerateRequest, span: Any, as_list: bool) -> JsonAnswer:
        state = self.state
        frame = RequestFrame(state, span)
        params = body.parameters
        try:
            if wants_beam_search(params, state.config.beam_mode):
                request, results = await generate_beams(state, frame, body.inputs, params)
                n = len(results)
            else:
                check_best_of_limits(params, state.limits)
                n = num_sequences(params)
                async with frame.admit(body.inputs, params, permits=n) as admitted:
                    request = admitted.request
                    results = await admitted.best_of(n) if n > 1 else [await admitted.to_end()]
        except TgiError as error:
            frame.failed(error)
            return JsonAnswer.error(error)
        frame.succeeded(request, results[0], n)
        payload = generate_response(request, results).to_dict()
        headers = timing_headers(
            frame.timings, request.input_length, results[0].generated_tokens, state.compute_type, body.inputs
        )
        return JsonAnswer([payload] if as_list else payload, headers)

    def stream(self, body: GenerateRequest, http_request: Request, route: str) -> StreamAnswer:
        """SSE generation; every failure, validation included, is one error event on HTTP 200."""
        state = self.state

        async def events():
            frame = RequestFrame(state)
            with state.request_span(route, http_request) as span:
                frame.span = span
                try:
                    check_stream_only(body.parameters)
                    check_not_streamed(body.parameters)
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

        return StreamAnswer(events(), stream_headers(state.compute_type, body.inputs))

    async def tokenize(self, body: GenerateRequest) -> JsonAnswer:
        """Bare array of SimpleToken with byte offsets; `truncate` is ignored, not counted in metrics. A vision model
        tokenizes the prompt with its images' tokens, whose offsets TGI then reads in the prompt as sent."""
        try:
            text = await self.state.expand_images(body.inputs)
            spans = await self.state.tokenizer.spans(text, self.state.special_tokens())
        except TgiError as error:
            return JsonAnswer.error(error)
        except Exception as error:  # any tokenizer failure is the client's input
            return JsonAnswer.error(validation_error(f"tokenizer error {error}"))
        return JsonAnswer(simple_tokens(body.inputs, spans))
