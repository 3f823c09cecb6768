"""The frame every generation service runs a request in: permit -> validate -> generate -> account.

A service (generate_service.py, chat_service.py, ...) builds one `RequestFrame` per engine request
(counted as received), enters `admit()` to hold its permits and validate the prompt (TGI's
Validation::validate), generates inside that block, and reports the outcome with `succeeded()` or
`failed()`. The services keep only their wire shapes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from tgi_compat.api.lightllm.features import prepare_features
from tgi_compat.api.protocol.errors import TgiError, validation_error
from tgi_compat.api.protocol.grammar import ResponseFormat
from tgi_compat.api.protocol.images import DecodedImage
from tgi_compat.api.protocol.pooling import ROUTES_OF_TASK
from tgi_compat.api.protocol.tgi import GenerateParameters, GrammarType
from tgi_compat.api.serving import accounting
from tgi_compat.api.serving.generation import (
    GenerationResult,
    Timings,
    TokenStep,
    generate_best_of,
    generate_to_end,
    one_step_at_a_time,
    stream_step_batches,
)
from tgi_compat.api.serving.state import AppState
from tgi_compat.api.serving.validation import (
    ValidatedRequest,
    check_grammar,
    check_lengths,
    check_parameters,
    check_token_ids,
    truncate_prompt,
)


async def validate_request(
    state: AppState,
    inputs: str | list[int],
    params: GenerateParameters,
    *,
    add_special_tokens: bool = True,
    grammar: GrammarType | ResponseFormat | None = None,
) -> ValidatedRequest:
    """TGI's Validation::validate: parameters, tokenize, truncate, budget, grammar (in that order).
    `inputs`: the prompt's text, or its token ids (/v1/completions), which are checked against the
    vocabulary instead of tokenized. `grammar`: the chat `response_format`, in place of `params.grammar`."""
    if (task := state.engine.info.pooling_task) is not None:
        raise validation_error(f"this {task} model generates no text; it serves {', '.join(ROUTES_OF_TASK[task])}")
    limits = state.limits
    grammar = grammar or params.grammar
    check_parameters(params, inputs, limits)
    loaded: list[DecodedImage] = []
    if isinstance(inputs, str):
        text, loaded = (inputs, []) if state.vision is None else await state.vision.expand(inputs)
        prompt_ids = await _tokenize(state, text, state.special_tokens(add_special_tokens))
    else:
        prompt_ids = check_token_ids(inputs, state.engine.info.vocab_size)
        inputs = state.tokenizer.decode(prompt_ids)  # the text `echo` and `return_full_text` show
    prompt_ids = truncate_prompt(prompt_ids, params.truncate)
    images = [] if state.vision is None or not loaded else state.vision.place(prompt_ids, loaded)
    prompt_ids, features = await prepare_features(state, params, prompt_ids, constrained=grammar is not None)
    if images and features.truncated_prompt_tokens:  # its cut would move or split the images' placeholders
        raise validation_error("`long_truncation_mode` cannot shorten a prompt with images")
    max_new_tokens = check_lengths(params, len(prompt_ids), limits)
    grammar_spec = await check_grammar(grammar, not state.config.disable_grammar_support)
    request = ValidatedRequest(
        inputs=inputs,
        prompt_ids=prompt_ids,
        params=params,
        max_new_tokens=max_new_tokens,
        return_full_text=bool(params.return_full_text),
        prompt_logprobs=(state.config.enable_prefill_logprobs and params.decoder_input_details)
        or features.all_prompt_logprobs,
        features=features,
        grammar=grammar_spec,
        adapter_id=requested_adapter(state, params.adapter_id),
        images=images,
    )
    accounting.validated(state, request)
    return request


def requested_adapter(state: AppState, adapter_id: str | None) -> str | None:
    """The LoRA adapter a request names; None for the base model: no adapter named, the served model's own
    names, or LoRA off (TGI's behaviour, which ignores an unknown adapter; with LoRA on the engine refuses one)."""
    if adapter_id is None or not state.config.lora_enabled:
        return None
    base_names = {state.model.model_id, state.config.model_id, state.config.served_model_name}
    return None if adapter_id in base_names else adapter_id


async def _tokenize(state: AppState, inputs: str, add_special_tokens: bool) -> list[int]:
    try:
        return await state.tokenizer.encode(inputs, add_special_tokens)
    except Exception as error:  # any tokenizer failure is the client's input
        raise validation_error(f"tokenizer error {error}") from error


@dataclass(slots=True)
class Admitted:
    """A validated request holding its permits; generation runs through its methods."""

    state: AppState
    request: ValidatedRequest
    timings: Timings
    first_token: Callable[[], None]  # marks the request running in the in-flight gauges

    async def revalidate(
        self, inputs: str, params: GenerateParameters, *, add_special_tokens: bool = True
    ) -> ValidatedRequest:
        """Validate another prompt under the same permits (chat answers again in plain text after
        the model chose `no_tool`); generation then runs that request."""
        self.request = await validate_request(self.state, inputs, params, add_special_tokens=add_special_tokens)
        return self.request

    async def to_end(self) -> GenerationResult:
        return await generate_to_end(self.state, self.request, self.timings, self.first_token)

    async def best_of(self, n: int) -> list[GenerationResult]:
        return await generate_best_of(self.state, self.request, self.timings, n)

    def stream(self) -> AsyncGenerator[TokenStep, None]:
        return one_step_at_a_time(self.stream_batches())

    def stream_batches(self) -> AsyncGenerator[list[TokenStep], None]:
        return stream_step_batches(
            self.state, self.request, self.timings, streaming=True, on_first_token=self.first_token
        )


class RequestFrame:
    """One engine request's permits, validation and metrics; `span` is the route's trace span, if any."""

    def __init__(self, state: AppState, span: Any = None, *, count_received: bool = True) -> None:
        """`count_received=False`: the route counted the HTTP request once for all its frames (/vertex)."""
        self.state = state
        self.span = span
        self.timings = Timings(arrival=time.perf_counter())
        if count_received:
            accounting.received(state)

    @asynccontextmanager
    async def admit(
        self,
        inputs: str | list[int],
        params: GenerateParameters,
        *,
        permits: int = 1,
        add_special_tokens: bool = True,
        grammar: GrammarType | ResponseFormat | None = None,
    ) -> AsyncIterator[Admitted]:
        """Hold `permits` (TGI's 429 when short), count the request in flight, validate it.
        `grammar`: the chat `response_format` or tool grammar, in place of `params.grammar`."""
        with self.state.permits.hold(permits), self.state.metrics.track_inflight() as inflight:
            validating = self.span.child("validate") if self.span is not None else nullcontext()
            with validating:
                request = await validate_request(
                    self.state, inputs, params, add_special_tokens=add_special_tokens, grammar=grammar
                )
            yield Admitted(self.state, request, self.timings, inflight.first_token)

    def succeeded(self, request: ValidatedRequest, result: GenerationResult, n: int = 1) -> None:
        accounting.succeeded(self.state, request, result, self.timings, n)
        if self.span is not None:
            accounting.traced(self.span, result, self.timings)

    def failed(self, error: TgiError) -> None:
        accounting.failed(self.state, error, self.span)
