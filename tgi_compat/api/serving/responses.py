"""Generation results -> TGI response bodies and headers (docs/contract.md §5, §7)."""

from __future__ import annotations

import time
from json.encoder import encode_basestring  # the C quoting json.dumps(ensure_ascii=False) uses
from typing import Any

from tgi_compat.api.lightllm.features import add_lightllm_details
from tgi_compat.api.protocol.tgi import (
    BestOfSequence,
    Details,
    GenerateResponse,
    StreamDetails,
    StreamResponse,
)
from tgi_compat.api.serving.generation import GenerationResult, Timings, TokenStep
from tgi_compat.api.serving.validation import ValidatedRequest


def _full_text(request: ValidatedRequest, text: str) -> str:
    # TGI prepends the original (untruncated) inputs verbatim, no separator.
    return request.inputs + text if request.return_full_text else text


def _sequence_fields(result: GenerationResult) -> dict[str, Any]:
    """What `details` and each best_of sequence say of one generation (`top_tokens` only when asked for)."""
    fields: dict[str, Any] = dict(
        finish_reason=result.finish_reason,
        generated_tokens=result.generated_tokens,
        seed=result.seed,
        prefill=result.prefill,
        tokens=result.tokens,
    )
    if result.top_tokens:
        fields["top_tokens"] = result.top_tokens
    return fields


def _best_of_sequence(request: ValidatedRequest, result: GenerationResult) -> BestOfSequence:
    return BestOfSequence(generated_text=_full_text(request, result.generated_text), **_sequence_fields(result))


def generate_response(request: ValidatedRequest, results: list[GenerationResult]) -> GenerateResponse:
    """`results[0]` is the answer; the rest (best_of > 1) go to best_of_sequences."""
    best = results[0]
    response = GenerateResponse(generated_text=_full_text(request, best.generated_text))
    if not request.wants_details:
        return response  # the `details` key is omitted, never null
    details = Details(**_sequence_fields(best))
    if len(results) > 1:
        details.best_of_sequences = [_best_of_sequence(request, r) for r in results[1:]]
    add_lightllm_details(details, request.features, best)
    response.details = details
    return response


def stream_event_json(request: ValidatedRequest, step: TokenStep) -> str:
    """The StreamResponse JSON of one step, byte for byte `stream_response(...).to_json()`.

    Most events are a bare token (no top tokens, not the last): their JSON is formatted directly
    with the json module's own pieces (its string quoting, float repr), skipping pydantic and the
    encoder's dict walk, which dominate the per-token cost of streaming.
    """
    if step.result is not None or step.top_tokens:
        return stream_response(request, step).to_json()
    token = step.token
    logprob = "null" if token.logprob is None else float.__repr__(token.logprob)  # always finite here
    special = "true" if token.special else "false"
    return (
        f'{{"index":{step.index},"token":{{"id":{token.id},"text":{encode_basestring(token.text)},'
        f'"logprob":{logprob},"special":{special}}},"generated_text":null,"details":null}}'
    )


def stream_response(request: ValidatedRequest, step: TokenStep) -> StreamResponse:
    event = StreamResponse(index=step.index, token=step.token, generated_text=None, details=None)
    if step.top_tokens:
        event.top_tokens = step.top_tokens
    result = step.result
    if result is not None:
        event.generated_text = _full_text(request, result.generated_text)
        if request.wants_details:  # details=true, or return_all_prompt_logprobs
            event.details = StreamDetails(
                finish_reason=result.finish_reason,
                generated_tokens=result.generated_tokens,
                seed=result.seed,
                input_length=result.input_length,
            )
            add_lightllm_details(event.details, request.features, result, streaming=True)
    return event


def _ms(seconds: float) -> str:
    return str(int(seconds * 1000))


def timing_headers(
    timings: Timings, prompt_tokens: int, generated_tokens: int, compute_type: str, inputs: str
) -> dict[str, str]:
    """x-* headers of non-streaming responses: milliseconds as integers, x-compute-time in seconds."""
    total = time.perf_counter() - timings.arrival
    validation = max(timings.validated - timings.arrival, 0.0)
    inference = timings.inference_seconds()
    per_token = inference / generated_tokens if generated_tokens else 0.0
    return {
        "x-compute-type": compute_type,
        "x-compute-time": f"{total}",
        "x-compute-characters": str(len(inputs)),
        "x-total-time": _ms(total),
        "x-validation-time": _ms(validation),
        "x-queue-time": _ms(timings.queue_seconds()),
        "x-inference-time": _ms(inference),
        "x-time-per-token": _ms(per_token),
        "x-prompt-tokens": str(prompt_tokens),
        "x-generated-tokens": str(generated_tokens),
    }


def stream_headers(compute_type: str, inputs: str) -> dict[str, str]:
    return {
        "cache-control": "no-cache",
        "x-compute-type": compute_type,
        "x-compute-characters": str(len(inputs)),
        "x-accel-buffering": "no",
    }
