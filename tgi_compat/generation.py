"""One validated request through the engine: token events in, text tokens and a final result out.

`stream_sequence` is the single loop both the JSON and the SSE routes use (and the OpenAI routes
can use): it detokenizes each id, checks stop strings (aborting the engine request when one
matches), maps engine failures to TGI errors and always releases the engine request, also when
the HTTP client goes away mid-stream.
"""

from __future__ import annotations

import asyncio
import math
import time
from contextlib import aclosing
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from router.client_api import EngineDeadError, RequestRejectedError
from router.outputs import TokenEvent, TopToken
from tgi_compat.detokenizer import IncrementalDetokenizer, StopStringMatcher
from tgi_compat.errors import generation_error, incomplete_generation_error, validation_error
from tgi_compat.schemas import PrefillToken, Token
from tgi_compat.state import AppState
from tgi_compat.validation import ValidatedRequest

FINISH_REASONS = ("length", "eos_token", "stop_sequence")


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


@dataclass(slots=True)
class GenerationResult:
    generated_text: str  # without the prompt (return_full_text is applied by the response builder)
    finish_reason: str
    seed: int | None
    input_length: int
    tokens: list[Token]
    top_tokens: list[list[Token]] = field(default_factory=list)
    prefill: list[PrefillToken] = field(default_factory=list)
    prefill_top_tokens: list[list[Token]] = field(default_factory=list)  # return_all_prompt_logprobs

    @property
    def generated_tokens(self) -> int:
        return len(self.tokens)

    @property
    def mean_logprob(self) -> float:
        logprobs = [t.logprob for t in self.tokens if t.logprob is not None and math.isfinite(t.logprob)]
        return sum(logprobs) / len(logprobs) if logprobs else -math.inf


@dataclass(slots=True)
class TokenStep:
    """One generated token; `result` is set on the last one."""

    index: int  # 1-based, like StreamResponse.index
    token: Token
    top_tokens: list[Token]
    result: GenerationResult | None = None


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


async def stream_sequence(
    state: AppState,
    request: ValidatedRequest,
    timings: Timings,
    *,
    streaming: bool = False,
    on_first_token: Callable[[], None] | None = None,
) -> AsyncIterator[TokenStep]:
    """Run one sequence; raises TgiError on engine failure or an unfinished stream."""
    engine_request = request.engine_request()
    sampling = engine_request.sampling
    seed = sampling.seed if sampling.is_sampling else None
    detokenizer = IncrementalDetokenizer(state.tokenizer, engine_request.prompt_ids)
    stops = StopStringMatcher(request.params.stop)
    tokens: list[Token] = []
    top_tokens: list[list[Token]] = []
    prefill: list[PrefillToken] = []
    prefill_top_tokens: list[list[Token]] = []
    healing = request.features.output_filter() if request.features is not None else None
    timings.validated = time.perf_counter()
    events = state.engine.generate(engine_request)
    finished = released = False
    try:
        async for event in _checked(events):
            if timings.first_event is None:
                timings.first_event = time.perf_counter()
                if on_first_token is not None:
                    on_first_token()
            if event.prompt_logprobs is not None and request.prompt_logprobs:
                prefill = _prefill(state, engine_request.prompt_ids, event.prompt_logprobs)
                prefill_top_tokens = [_top_tokens(state, top) for top in event.prompt_top_tokens or []]
            for position, token_id in enumerate(event.token_ids):
                text = detokenizer.push(token_id)
                is_last_id = position == len(event.token_ids) - 1
                if healing is not None:  # token healing: only text past the prompt is new
                    counts, text = healing.push(token_id, text)
                    if not counts and not (is_last_id and event.finish_reason):
                        continue
                logprob = event.logprobs[position] if position < len(event.logprobs) else None
                token = _token(state, token_id, text, _finite_or_none(logprob))
                alternatives = _top_tokens(state, event.top_tokens[position]) if event.top_tokens else []
                tokens.append(token)
                if request.params.top_n_tokens:
                    top_tokens.append(alternatives)
                finish = event.finish_reason if is_last_id else None
                if finish is None and len(tokens) >= request.max_new_tokens:
                    finish = "length"  # healing requests run with a larger engine budget
                if finish is None and stops.push(text):
                    finish = "stop_sequence"  # TGI checks stop strings after length and EOS
                step = TokenStep(index=len(tokens), token=token, top_tokens=alternatives)
                if finish is not None:
                    if finish not in FINISH_REASONS:
                        raise generation_error(event.error or f"request finished with `{finish}`")
                    finished = True
                    timings.finished = time.perf_counter()
                    generated_text = detokenizer.final_text()
                    input_length = event.num_prompt_tokens or len(engine_request.prompt_ids)
                    if healing is not None:  # the client's prompt, and no re-generated prompt text
                        generated_text, input_length = healing.final_text(generated_text), request.input_length
                    step.result = GenerationResult(
                        generated_text=generated_text,
                        finish_reason=finish,
                        seed=seed,
                        input_length=input_length,
                        tokens=tokens,
                        top_tokens=top_tokens,
                        prefill=prefill,
                        prefill_top_tokens=prefill_top_tokens,
                    )
                    # Free the engine request before the caller sees the last token (a stop string
                    # match must not keep generating while the response is written).
                    await _release(state, events, engine_request.request_id, finished)
                    released = True
                    yield step
                    return
                yield step
    finally:
        if not released:
            await _release(state, events, engine_request.request_id, finished)
    raise incomplete_generation_error(streaming)


async def _checked(events: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
    """Engine events with engine failures turned into TGI errors."""
    try:
        async for event in events:
            if event.error is not None:
                raise generation_error(event.error)
            yield event
    except EngineDeadError as error:
        raise generation_error(str(error) or "engine is not running") from error
    except RequestRejectedError as error:
        raise validation_error(str(error)) from error


async def _release(state: AppState, events: AsyncIterator[TokenEvent], request_id: str, finished: bool) -> None:
    # Closing the engine's iterator aborts the request there (its KV slots free within a step).
    aclose = getattr(events, "aclose", None)
    try:
        if aclose is not None:
            await asyncio.shield(aclose())
        if not finished:
            await asyncio.shield(state.engine.abort(request_id))
    except (EngineDeadError, RuntimeError):
        pass  # the engine is gone or the iterator was already closed: nothing left to free


async def generate_to_end(
    state: AppState, request: ValidatedRequest, timings: Timings, on_first_token: Callable[[], None] | None = None
) -> GenerationResult:
    async with aclosing(stream_sequence(state, request, timings, on_first_token=on_first_token)) as steps:
        async for step in steps:
            if step.result is not None:
                return step.result
    raise incomplete_generation_error(False)  # unreachable: stream_sequence raises first


async def generate_best_of(state: AppState, request: ValidatedRequest, timings: Timings, n: int) -> list[GenerationResult]:
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
