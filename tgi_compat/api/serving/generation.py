"""One validated request through the engine: token events in, text tokens and a final result out.

`stream_step_batches` is the single loop every route uses (`one_step_at_a_time` hands out its steps
one at a time): it detokenizes each id, checks stop strings (aborting the engine request when one
matches), maps engine failures to TGI errors and always releases the engine request, also when
the HTTP client goes away mid-stream.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import cast

from tgi_compat.api.observability.durations import RequestDurations
from tgi_compat.api.protocol.errors import TgiError, generation_error, incomplete_generation_error, validation_error
from tgi_compat.api.protocol.tgi import FinishReason as TgiFinishReason
from tgi_compat.api.protocol.tgi import PrefillToken, Token
from tgi_compat.api.serving.detokenizer import IncrementalDetokenizer, StopStringMatcher
from tgi_compat.api.serving.state import AppState
from tgi_compat.api.serving.validation import ValidatedRequest, engine_refusal
from tgi_compat.router.client_api import EngineDeadError, RequestRejectedError
from tgi_compat.router.outputs import TokenEvent, TopToken
from tgi_compat.router.request import COMPLETED_FINISH_REASONS, FinishReason


@dataclass(slots=True)
class Timings:
    arrival: float  # perf_counter() when the request came in
    arrival_ns: int = field(default_factory=time.time_ns)  # the same instant on the wall clock (spans)
    validated: float = 0.0  # when it was handed to the engine
    first_event: float | None = None  # first token event: the engine had scheduled it
    finished: float | None = None

    def wall_ns(self, instant: float | None) -> int:
        """A perf_counter() instant as wall-clock ns (now when None)."""
        instant = time.perf_counter() if instant is None else instant
        return self.arrival_ns + int((instant - self.arrival) * 1e9)

    def queue_seconds(self) -> float:
        return max((self.first_event or self.validated) - self.validated, 0.0)

    def inference_seconds(self) -> float:
        end = self.finished or time.perf_counter()
        return max(end - (self.first_event or self.validated), 0.0)

    def durations(self, generated_tokens: int) -> RequestDurations:
        inference = self.inference_seconds()
        return RequestDurations(
            total_s=time.perf_counter() - self.arrival,
            validation_s=max(self.validated - self.arrival, 0.0),
            queue_s=self.queue_seconds(),
            inference_s=inference,
            time_per_token_s=inference / generated_tokens if generated_tokens else 0.0,
        )


@dataclass(slots=True)
class GenerationResult:
    generated_text: str  # without the prompt (return_full_text is applied by the response builder)
    finish_reason: TgiFinishReason
    seed: int | None
    input_length: int
    tokens: list[Token]
    top_tokens: list[list[Token]] = field(default_factory=list)
    prefill: list[PrefillToken] = field(default_factory=list)
    prefill_top_tokens: list[list[Token]] = field(default_factory=list)  # return_all_prompt_logprobs
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    skipped_tokens: int | None = None  # speculative decoding: accepted drafts (when the engine ended the request)

    @property
    def generated_tokens(self) -> int:
        return len(self.tokens)

    @property
    def mean_logprob(self) -> float:
        logprobs = [t.logprob for t in self.tokens if t.logprob is not None and math.isfinite(t.logprob)]
        return sum(logprobs) / len(logprobs) if logprobs else -math.inf


@dataclass(slots=True)
class PromptScores:
    """The prompt's logprobs (first None) and the top alternatives at each of its positions."""

    prefill: list[PrefillToken]
    top_tokens: list[list[Token]]


@dataclass(slots=True)
class TokenStep:
    """One generated token; `result` is set on the last one."""

    index: int  # 1-based, like StreamResponse.index
    token: Token
    top_tokens: list[Token]
    result: GenerationResult | None = None
    prompt: PromptScores | None = None  # on the first step of a request that scores its prompt


def _token(state: AppState, token_id: int, text: str, logprob: float | None) -> Token:
    return Token(id=token_id, text=text, logprob=logprob, special=state.tokenizer.is_special(token_id))


def _top_tokens(state: AppState, candidates: list[TopToken]) -> list[Token]:
    tokenizer = state.tokenizer
    return [_token(state, c.token_id, tokenizer.token_text(c.token_id), c.logprob) for c in candidates]


def _prefill(state: AppState, prompt_ids: list[int], logprobs: list[float | None]) -> list[PrefillToken]:
    tokenizer = state.tokenizer
    return [
        PrefillToken(id=token_id, text=tokenizer.token_text(token_id), logprob=_finite_or_none(logprob))
        for token_id, logprob in zip(prompt_ids, logprobs)
    ]


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class _Sequence:
    """One sequence's running state: engine events in, TokenSteps out (detokenized, stop strings)."""

    def __init__(
        self, state: AppState, request: ValidatedRequest, timings: Timings, on_first_token: Callable[[], None] | None
    ) -> None:
        self.state, self.request, self.timings, self.on_first_token = state, request, timings, on_first_token
        self.engine_request = request.engine_request()
        sampling = self.engine_request.sampling
        self.seed = sampling.seed if sampling.is_sampling else None
        self.detokenizer = IncrementalDetokenizer(state.tokenizer, self.engine_request.prompt_ids)
        self.stops = StopStringMatcher(request.params.stop)
        self.keep_top_tokens = bool(request.params.top_n_tokens)
        self.tokens: list[Token] = []
        self.top_tokens: list[list[Token]] = []
        self.prefill: list[PrefillToken] = []
        self.prefill_top_tokens: list[list[Token]] = []
        self.healing = request.features.output_filter() if request.features is not None else None
        self.finished = False
        self.cached_tokens = 0

    def add_event(self, event: TokenEvent, steps: list[TokenStep]) -> None:
        """Append the event's steps; the last one carries `result` once the sequence finishes.

        Raises TgiError for an engine failure (steps appended before it are still valid).
        """
        if event.error is not None:
            if event.finish_reason == FinishReason.REJECTED:  # refused after queueing: the grammar
                raise validation_error(event.error)
            raise generation_error(event.error)
        timings = self.timings
        if timings.first_event is None:
            timings.first_event = time.perf_counter()
            self.cached_tokens = event.num_cached_tokens
            if self.on_first_token is not None:
                self.on_first_token()
        state, request = self.state, self.request
        if event.prompt_logprobs is not None and request.prompt_logprobs:
            self.prefill = _prefill(state, self.engine_request.prompt_ids, event.prompt_logprobs)
            self.prefill_top_tokens = [_top_tokens(state, top) for top in event.prompt_top_tokens or []]
        token_ids, logprobs, tokens = event.token_ids, event.logprobs, self.tokens
        last_position = len(token_ids) - 1
        for position, token_id in enumerate(token_ids):
            text = self.detokenizer.push(token_id)
            if self.healing is not None:  # token healing: only text past the prompt is new
                counts, text = self.healing.push(token_id, text)
                if not counts and not (position == last_position and event.finish_reason):
                    continue
            logprob = logprobs[position] if position < len(logprobs) else None
            token = _token(state, token_id, text, _finite_or_none(logprob))
            alternatives = _top_tokens(state, event.top_tokens[position]) if event.top_tokens else []
            tokens.append(token)
            if self.keep_top_tokens:
                self.top_tokens.append(alternatives)
            finish = event.finish_reason if position == last_position else None
            if finish is None and self.stops and self.stops.push(text):
                finish = FinishReason.STOP_TOKEN.value  # TGI checks stop strings after length and EOS
            step = TokenStep(index=len(tokens), token=token, top_tokens=alternatives)
            if len(tokens) == 1 and self.prefill:
                step.prompt = PromptScores(self.prefill, self.prefill_top_tokens)
            steps.append(step)
            if finish is not None:
                step.result = self._finish(event, finish)
                return

    def _finish(self, event: TokenEvent, finish: str) -> GenerationResult:
        if finish not in COMPLETED_FINISH_REASONS:
            raise generation_error(event.error or f"request finished with `{finish}`")
        self.finished = True
        self.timings.finished = time.perf_counter()
        generated_text = self.detokenizer.final_text()
        input_length = event.num_prompt_tokens or len(self.engine_request.prompt_ids)
        if self.healing is not None:  # the client's prompt, and no re-generated prompt text
            generated_text, input_length = self.healing.final_text(generated_text), self.request.input_length
        return GenerationResult(
            generated_text=generated_text,
            finish_reason=cast(TgiFinishReason, finish),  # one of COMPLETED_FINISH_REASONS (checked above)
            seed=self.seed,
            input_length=input_length,
            tokens=self.tokens,
            top_tokens=self.top_tokens,
            prefill=self.prefill,
            prefill_top_tokens=self.prefill_top_tokens,
            cached_tokens=self.cached_tokens,
            skipped_tokens=event.num_skipped_tokens,
        )


async def stream_step_batches(
    state: AppState,
    request: ValidatedRequest,
    timings: Timings,
    *,
    streaming: bool = False,
    on_first_token: Callable[[], None] | None = None,
) -> AsyncGenerator[list[TokenStep], None]:
    """Run one sequence, yielding the steps of every engine event that had arrived at once.

    A stream that keeps up gets one step per batch; one that falls behind catches up with fewer
    wake-ups. Raises TgiError on engine failure or an unfinished stream (after yielding the
    steps that came before the failure).
    """
    sequence = _Sequence(state, request, timings, on_first_token)
    request_id = sequence.engine_request.request_id
    timings.validated = time.perf_counter()
    events = state.engine.generate_batches(sequence.engine_request)
    released = False
    try:
        async for batch in events:
            steps: list[TokenStep] = []
            try:
                for event in batch:
                    sequence.add_event(event, steps)
                    if sequence.finished:
                        break
            except TgiError:
                if steps:
                    yield steps
                raise
            if sequence.finished:
                # Free the engine request before the caller sees the last token (a stop string
                # match must not keep generating while the response is written).
                await _release(state, events, request_id, finished=True)
                released = True
                yield steps
                return
            if steps:
                yield steps
    except EngineDeadError as error:
        raise generation_error(str(error) or "engine is not running") from error
    except RequestRejectedError as error:
        raise engine_refusal(error) from error
    finally:
        if not released:
            await _release(state, events, request_id, sequence.finished)
    raise incomplete_generation_error(streaming)


async def one_step_at_a_time(batches: AsyncGenerator[list[TokenStep], None]) -> AsyncGenerator[TokenStep, None]:
    """`stream_step_batches`' steps one at a time; closing this closes it (which releases the engine request)."""
    async with aclosing(batches):
        async for steps in batches:
            for step in steps:
                yield step


async def _release(
    state: AppState, events: AsyncGenerator[list[TokenEvent], None], request_id: str, finished: bool
) -> None:
    # Closing the engine's iterator aborts the request there (its KV slots free within a step).
    try:
        await asyncio.shield(events.aclose())
        if not finished:
            await asyncio.shield(state.engine.abort(request_id))
    except (EngineDeadError, RuntimeError):
        pass  # the engine is gone or the iterator was already closed: nothing left to free


async def generate_to_end(
    state: AppState, request: ValidatedRequest, timings: Timings, on_first_token: Callable[[], None] | None = None
) -> GenerationResult:
    batches = stream_step_batches(state, request, timings, on_first_token=on_first_token)
    async with aclosing(one_step_at_a_time(batches)) as steps:
        async for step in steps:
            if step.result is not None:
                return step.result
    raise incomplete_generation_error(False)  # unreachable: stream_step_batches raises first


async def generate_best_of(
    state: AppState, request: ValidatedRequest, timings: Timings, n: int
) -> list[GenerationResult]:
    """n independent sampled sequences, best (highest mean token logprob) first."""
    per_sequence = [Timings(arrival=timings.arrival) for _ in range(n)]
    tasks = [asyncio.create_task(generate_to_end(state, request, t)) for t in per_sequence]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # one failed or the client left: stop the siblings too
            task.cancel()
        raise
    timings.validated = min(t.validated for t in per_sequence)
    timings.first_event = min((t.first_event for t in per_sequence if t.first_event), default=None)
    timings.finished = max((t.finished for t in per_sequence if t.finished), default=None)
    best = max(range(n), key=lambda i: results[i].mean_logprob)
    return [results[best]] + [r for i, r in enumerate(results) if i != best]
