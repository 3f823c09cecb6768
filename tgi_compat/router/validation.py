"""The engine's side of validation: a request it could not serve is refused before it waits for admission.

Each check returns a `Refusal` code and the values its message shows; the API maps them to TGI's texts
(tgi_compat/api/serving/validation.py), and has checked the same limits before the request crossed over.
"""

from __future__ import annotations

from tgi_compat.router.client_api import EngineInfo, Refusal, RequestRejectedError
from tgi_compat.router.request import GenerateRequest


def validate_request(request: GenerateRequest, info: EngineInfo) -> None:
    """Raise RequestRejectedError; return None when the engine can serve the request."""
    if refusal := _sampling_refusal(request) or _logit_bias_refusal(request, info) or _prompt_refusal(request, info):
        raise refusal


def _sampling_refusal(request: GenerateRequest) -> RequestRejectedError | None:
    s = request.sampling
    reason = None
    if not s.temperature > 0:
        reason = Refusal.TEMPERATURE
    elif not s.repetition_penalty > 0:
        reason = Refusal.REPETITION_PENALTY
    elif not -2.0 <= s.frequency_penalty <= 2.0:
        reason = Refusal.FREQUENCY_PENALTY
    elif not 0.0 < s.top_p <= 1.0:  # 1.0 is our "disabled" value; the API rejects an explicit 1.0
        reason = Refusal.TOP_P
    elif not 0.0 < s.typical_p <= 1.0:
        reason = Refusal.TYPICAL_P
    elif s.top_k < 0:
        reason = Refusal.TOP_K
    elif s.top_n_tokens < 0:
        reason = Refusal.TOP_N_TOKENS
    elif s.seed is not None and not 0 <= s.seed < 1 << 64:
        reason = Refusal.SEED
    return None if reason is None else RequestRejectedError(reason)


def _logit_bias_refusal(request: GenerateRequest, info: EngineInfo) -> RequestRejectedError | None:
    if bad := [t for t, _ in request.sampling.logit_bias if not 0 <= t < info.vocab_size]:
        return RequestRejectedError(Refusal.LOGIT_BIAS_TOKEN, bad[0], info.vocab_size)
    return None


def _prompt_refusal(request: GenerateRequest, info: EngineInfo) -> RequestRejectedError | None:
    ids, max_new = request.prompt_ids, request.max_new_tokens
    num_prompt = len(ids)
    if max_new <= 0:
        return RequestRejectedError(Refusal.MAX_NEW_TOKENS)
    if num_prompt == 0:
        return RequestRejectedError(Refusal.EMPTY_PROMPT)
    if min(ids) < 0 or max(ids) >= info.vocab_size:  # two C passes: a chat turn's prompt is its whole history
        bad = next(t for t in ids if not 0 <= t < info.vocab_size)
        return RequestRejectedError(Refusal.PROMPT_TOKEN, bad, info.vocab_size)
    # info.max_total_tokens is below the KV capacity, so a request that passes can always be admitted.
    if num_prompt + max_new > info.max_total_tokens:
        return RequestRejectedError(Refusal.TOTAL_TOKENS, info.max_total_tokens, num_prompt, max_new)
    return None
