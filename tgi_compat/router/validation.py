"""Checks a request must pass before it may wait for admission (the API layer maps them to TGI 422).

Messages are TGI's validation texts without the "Input validation error: " prefix the API adds.
"""

from __future__ import annotations

from tgi_compat.router.client_api import EngineInfo, RequestRejectedError
from tgi_compat.router.request import GenerateRequest


def validate_request(request: GenerateRequest, info: EngineInfo) -> None:
    """Raise RequestRejectedError with a clear message; return None when the engine can serve it."""
    if message := _sampling_error(request) or _logit_bias_error(request, info) or _length_error(request, info):
        raise RequestRejectedError(message)


def _sampling_error(request: GenerateRequest) -> str | None:
    s = request.sampling
    if not s.temperature > 0:
        return "`temperature` must be strictly positive"
    if not s.repetition_penalty > 0:
        return "`repetition_penalty` must be strictly positive"
    if not -2.0 <= s.frequency_penalty <= 2.0:
        return "`frequency_penalty` must be >= -2.0 and <= 2.0"
    if not 0.0 < s.top_p <= 1.0:  # 1.0 is our "disabled" value; the API rejects an explicit 1.0
        return "`top_p` must be > 0.0 and < 1.0"
    if not 0.0 < s.typical_p <= 1.0:
        return "`typical_p` must be > 0.0 and < 1.0"
    if s.top_k < 0:
        return "`top_k` must be strictly positive"
    if s.top_n_tokens < 0:
        return "`top_n_tokens` must be >= 0"
    if s.seed is not None and not 0 <= s.seed < 1 << 64:
        return "`seed` must be an unsigned 64-bit integer"
    return None


def _logit_bias_error(request: GenerateRequest, info: EngineInfo) -> str | None:
    if bad := [t for t, _ in request.sampling.logit_bias if not 0 <= t < info.vocab_size]:
        return f"`logit_bias` token id {bad[0]} is outside the vocabulary (size {info.vocab_size})"
    return None


def _length_error(request: GenerateRequest, info: EngineInfo) -> str | None:
    num_prompt = len(request.prompt_ids)
    if request.max_new_tokens <= 0:
        return "`max_new_tokens` must be strictly positive"
    if num_prompt == 0:
        return "`inputs` cannot be empty"
    ids = request.prompt_ids
    if min(ids) < 0 or max(ids) >= info.vocab_size:  # two C passes: a chat turn's prompt is its whole history
        bad = next(t for t in ids if not 0 <= t < info.vocab_size)
        return f"token id {bad} is outside the vocabulary (size {info.vocab_size})"
    if num_prompt + request.max_new_tokens > info.max_total_tokens:
        return (
            f"`inputs` tokens + `max_new_tokens` must be <= {info.max_total_tokens}. "
            f"Given: {num_prompt} `inputs` tokens and {request.max_new_tokens} `max_new_tokens`"
        )
    if num_prompt + request.max_new_tokens >= info.num_kv_slots:  # could never be admitted
        return (
            f"`inputs` tokens + `max_new_tokens` must be < {info.num_kv_slots} (the KV cache size). "
            f"Given: {num_prompt} `inputs` tokens and {request.max_new_tokens} `max_new_tokens`"
        )
    return None
