"""TGI's request validation (docs/contract.md §4): the same checks, texts and order, then the mapping of a
validated HTTP request onto the engine's `GenerateRequest`.

Order (first failure wins): [stream-only checks] -> [non-stream best_of limits] -> concurrency
permit (done by the caller, see permits.py) -> `check_parameters` -> tokenize -> `check_lengths`
-> grammar.

TGI's texts live here: the API's own checks and the engine's refusals (`Refusal` codes, which the engine
sends instead of text) share `REFUSAL_TEXTS`.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import dataclass, field

from tgi_compat.api.config import ServingLimits
from tgi_compat.api.lightllm.features import RequestFeatures
from tgi_compat.api.protocol.errors import TgiError, validation_error
from tgi_compat.api.protocol.grammar import ResponseFormat, grammar_spec
from tgi_compat.api.protocol.tgi import MAX_NEW_TOKENS_CHUNK, GenerateParameters, GrammarType
from tgi_compat.router.client_api import Refusal, RequestRejectedError
from tgi_compat.router.images import PromptImage
from tgi_compat.router.request import GenerateRequest as EngineRequest
from tgi_compat.router.request import GrammarSpec, SamplingParams

REFUSAL_TEXTS = {
    Refusal.TEMPERATURE: "`temperature` must be strictly positive",
    Refusal.REPETITION_PENALTY: "`repetition_penalty` must be strictly positive",
    Refusal.FREQUENCY_PENALTY: "`frequency_penalty` must be >= -2.0 and <= 2.0",
    Refusal.TOP_P: "`top_p` must be > 0.0 and < 1.0",
    Refusal.TYPICAL_P: "`typical_p` must be > 0.0 and < 1.0",
    Refusal.TOP_K: "`top_k` must be strictly positive",
    Refusal.TOP_N_TOKENS: "`top_n_tokens` must be >= 0",
    Refusal.SEED: "`seed` must be an unsigned 64-bit integer",
    Refusal.MAX_NEW_TOKENS: "`max_new_tokens` must be strictly positive",
    Refusal.EMPTY_PROMPT: "`inputs` cannot be empty",
    Refusal.LOGIT_BIAS_TOKEN: "`logit_bias` token id {0} is outside the vocabulary (size {1})",
    Refusal.PROMPT_TOKEN: "`prompt` token id {0} is outside the vocabulary (size {1})",
    Refusal.TOTAL_TOKENS: (
        "`inputs` tokens + `max_new_tokens` must be <= {0}. Given: {1} `inputs` tokens and {2} `max_new_tokens`"
    ),
    Refusal.KV_CAPACITY: "the prompt's {0} tokens exceed the KV cache",
    Refusal.UNKNOWN_ADAPTER: "LoRA adapter {0!r} is not loaded",
    Refusal.LORA_OFF: "LoRA adapter {0!r} is not loaded; LoRA is off",
    Refusal.DUPLICATE_ID: "request id {0!r} is already in flight",
}


def refused(reason: Refusal, *values: int | str) -> TgiError:
    """TGI's 422 for a check that failed, on either side of the process boundary."""
    message = REFUSAL_TEXTS[reason].format(*values)
    if reason is Refusal.UNKNOWN_ADAPTER:  # values: the name, then every loaded adapter's
        loaded = values[1:]
        message += f"; loaded: {', '.join(map(str, loaded))}" if loaded else "; no adapter is loaded"
    return validation_error(message)


def engine_refusal(error: RequestRejectedError) -> TgiError:
    return refused(error.reason, *error.values)


def check_stream_only(params: GenerateParameters) -> None:
    if params.best_of is not None and params.best_of != 1:
        raise validation_error("`best_of` != 1 is not supported when streaming tokens")
    if params.decoder_input_details:
        raise validation_error("`decoder_input_details` == true is not supported when streaming tokens")


def num_sequences(params: GenerateParameters) -> int:
    """Independent generations this request runs (best_of=0 behaves like 1 on /generate)."""
    return max(params.best_of or 1, 1)


def check_best_of_limits(params: GenerateParameters, limits: ServingLimits) -> None:
    """Non-streaming best_of > 1 only; runs before the concurrency permit is taken."""
    best_of = params.best_of or 1
    if best_of <= 1:
        return
    if limits.max_best_of == 1:
        raise validation_error("`best_of` != 1 is not allowed for this endpoint")
    if best_of > limits.max_best_of:
        raise validation_error(f"`best_of` must be > 0 and <= {limits.max_best_of}. Given: {best_of}")


def is_sampling(params: GenerateParameters) -> bool:
    return params.do_sample or any(
        value is not None for value in (params.temperature, params.top_k, params.top_p, params.typical_p)
    )


def check_parameters(params: GenerateParameters, inputs: str | list[int], limits: ServingLimits) -> None:
    """Everything TGI checks before tokenizing, in TGI's order."""
    best_of = params.best_of or 1
    if best_of > 1 and not is_sampling(params):
        raise validation_error("you must use sampling when `best_of` is > 1")
    if params.temperature is not None and not params.temperature > 0:
        raise refused(Refusal.TEMPERATURE)
    if params.repetition_penalty is not None and not params.repetition_penalty > 0:
        raise refused(Refusal.REPETITION_PENALTY)
    if params.frequency_penalty is not None and not -2.0 <= params.frequency_penalty <= 2.0:
        raise refused(Refusal.FREQUENCY_PENALTY)
    if params.top_p is not None and not 0.0 < params.top_p < 1.0:
        raise refused(Refusal.TOP_P)
    if params.typical_p is not None and not 0.0 < params.typical_p < 1.0:
        raise refused(Refusal.TYPICAL_P)
    if params.top_k is not None and params.top_k <= 0:
        raise refused(Refusal.TOP_K)
    if params.max_new_tokens == 0:
        raise refused(Refusal.MAX_NEW_TOKENS)
    if len(params.stop) > limits.max_stop_sequences:
        raise validation_error(
            f"`stop` supports up to {limits.max_stop_sequences} stop sequences. Given: {len(params.stop)}"
        )
    if best_of > 1 and params.seed is not None:
        raise validation_error("`seed` must not be set when `best_of` > 1")
    top_n = params.top_n_tokens or 0
    if top_n > limits.max_top_n_tokens:
        raise validation_error(f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. Given: {top_n}")
    check_logit_bias(params.logit_bias)
    if not inputs:
        raise refused(Refusal.EMPTY_PROMPT)
    if params.truncate is not None and not 0 < params.truncate <= limits.max_input_tokens:
        raise validation_error(
            f"`truncate` must be strictly positive and less than {limits.max_input_tokens}. Given: {params.truncate}"
        )


def check_logit_bias(logit_bias: dict[str, float] | None) -> None:
    """OpenAI's rule: keys are token ids, biases lie in [-100, 100] (the engine checks the vocabulary)."""
    for token, bias in (logit_bias or {}).items():
        if not token.isdigit():
            raise validation_error(f"`logit_bias` keys must be token ids. Given: {token!r}")
        if not -100.0 <= bias <= 100.0:
            raise validation_error(f"`logit_bias` values must be >= -100 and <= 100. Given: {bias}")


def check_token_ids(prompt_ids: list[int], vocab_size: int) -> list[int]:
    """A prompt given as token ids (/v1/completions): every id must be one of the model's."""
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        bad = next(t for t in prompt_ids if not 0 <= t < vocab_size)
        raise refused(Refusal.PROMPT_TOKEN, bad, vocab_size)
    return prompt_ids


def truncate_prompt(prompt_ids: list[int], truncate: int | None) -> list[int]:
    """Left truncation: keep the last `truncate` ids."""
    if truncate is None or len(prompt_ids) <= truncate:
        return prompt_ids
    return prompt_ids[-truncate:]


def check_lengths(params: GenerateParameters, input_length: int, limits: ServingLimits) -> int:
    """The token budget and input length; returns the max_new_tokens the engine should use."""
    requested = params.max_new_tokens
    if requested is None:
        requested = max(limits.max_total_tokens - input_length, 0)
    chunk = min(requested, MAX_NEW_TOKENS_CHUNK)
    if input_length + chunk > limits.max_total_tokens:
        raise refused(Refusal.TOTAL_TOKENS, limits.max_total_tokens, input_length, chunk)
    if input_length > limits.max_input_tokens:
        raise validation_error(f"`inputs` must have less than {limits.max_input_tokens} tokens. Given: {input_length}")
    # One engine request covers every chunk TGI would schedule, up to the per-request cap.
    return min(requested, limits.max_total_tokens - input_length)


async def check_grammar(grammar: GrammarType | ResponseFormat | None, grammar_supported: bool) -> GrammarSpec | None:
    """TGI's grammar checks (tgi_compat/grammar.py), off the event loop: a schema can be large."""
    if grammar is None:
        return None
    return await asyncio.to_thread(grammar_spec, grammar, grammar_supported)


@dataclass(slots=True)
class ValidatedRequest:
    """A request that passed validation: everything the generation loop needs."""

    inputs: str
    prompt_ids: list[int]  # after truncation
    params: GenerateParameters
    max_new_tokens: int
    return_full_text: bool
    prompt_logprobs: bool  # fill `details.prefill`
    features: RequestFeatures | None = None  # LightLLM's truncation / healing / prompt logprobs
    grammar: GrammarSpec | None = None  # what the generated text must match
    adapter_id: str | None = None  # the LoRA adapter to run under (None: the base model)
    images: list[PromptImage] = field(default_factory=list)  # a vision model's prompt images

    @property
    def input_length(self) -> int:
        return len(self.prompt_ids)

    def score_prompt(self) -> None:
        """Report every prompt token's logprob (and its `top_n_tokens` likeliest ids at each position)."""
        self.prompt_logprobs = True

    @property
    def wants_details(self) -> bool:
        all_prompt_logprobs = self.features is not None and self.features.all_prompt_logprobs
        return self.params.details or self.params.decoder_input_details or all_prompt_logprobs

    def sampling_params(self) -> SamplingParams:
        p = self.params
        sampling = SamplingParams(
            do_sample=p.do_sample,
            temperature=1.0 if p.temperature is None else p.temperature,
            top_k=p.top_k or 0,
            top_p=1.0 if p.top_p is None else p.top_p,
            typical_p=1.0 if p.typical_p is None else p.typical_p,
            repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
            frequency_penalty=p.frequency_penalty or 0.0,
            watermark=p.watermark,
            seed=p.seed,
            top_n_tokens=p.top_n_tokens or 0,
            logit_bias=tuple((int(token), bias) for token, bias in (p.logit_bias or {}).items()),
        )
        if sampling.is_sampling and sampling.seed is None:
            # TGI's router draws the seed, so details.seed is always known for sampled requests.
            sampling.seed = random.getrandbits(64)
        return sampling

    def engine_request(self) -> EngineRequest:
        request = EngineRequest(
            request_id=uuid.uuid4().hex,
            prompt_ids=list(self.prompt_ids),
            sampling=self.sampling_params(),
            max_new_tokens=self.max_new_tokens,
            prompt_logprobs=self.prompt_logprobs,
            grammar=self.grammar,
            adapter_id=self.adapter_id,
            images=self.images,
        )
        if self.features is not None:
            self.features.apply_to(request)
        return request
