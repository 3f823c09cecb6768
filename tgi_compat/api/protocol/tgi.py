"""Pydantic models mirroring TGI's request and response schemas (names as in tgi-openapi.json).

Requests are SerdeModels (tgi_compat.api.protocol.serde) so the JSON types behave like serde's: no "1" -> 1
coercion, explicit `null` allowed only where TGI has an `Option`, unknown keys ignored, a field given twice
refused, and f32 parameters rounded to f32 as TGI deserializes them.
Responses are dumped with `exclude_unset=True`: keys TGI omits (`details`, `top_tokens`,
`best_of_sequences`) are simply never set, while `seed: null` is set explicitly and so kept.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tgi_compat.api.protocol.serde import F32, SerdeModel

ROUTER_NAME = "text-generation-router"
TGI_VERSION = "3.3.6-dev0"  # what /info reports for TGI v3.3.7 (contract header)
# v3.1+: the router validates and schedules max_new_tokens in chunks of at most this many tokens.
MAX_NEW_TOKENS_CHUNK = 1024

U32 = Annotated[int, Field(ge=0, le=2**32 - 1)]
U64 = Annotated[int, Field(ge=0, le=2**64 - 1)]
USIZE = U64
I32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]

# The Rust type serde names in "expected ..." messages, per field (see errors.deserialize_message).
RUST_TYPES: dict[str, str] = {
    "best_of": "usize",
    "truncate": "usize",
    "top_k": "i32",
    "seed": "u64",
    "max_new_tokens": "u32",
    "top_n_tokens": "u32",
    "temperature": "f32",
    "repetition_penalty": "f32",
    "frequency_penalty": "f32",
    "top_p": "f32",
    "typical_p": "f32",
    "parameters": "struct GenerateParameters",
    "grammar": "internally tagged enum GrammarType",
}


class GrammarType(SerdeModel):
    """`{"type": "json" | "json_object" | "regex" | "json_schema", "value": ...}`."""

    type: Literal["json", "json_object", "regex", "json_schema"]
    value: Any


class GenerateParameters(SerdeModel):
    adapter_id: str | None = None
    best_of: USIZE | None = None
    decoder_input_details: bool = False
    details: bool = False  # the OpenAPI file says true; TGI's code says false
    do_sample: bool = False
    frequency_penalty: F32 | None = None
    grammar: GrammarType | None = None
    max_new_tokens: U32 | None = None
    repetition_penalty: F32 | None = None
    return_full_text: bool | None = None
    seed: U64 | None = None
    stop: list[str] = Field(default_factory=list)
    temperature: F32 | None = None
    top_k: I32 | None = None
    top_n_tokens: U32 | None = None
    top_p: F32 | None = None
    truncate: USIZE | None = None
    typical_p: F32 | None = None
    watermark: bool = False
    # LightLLM extensions; null: the server's --long-truncation-mode / --token-healing / --return-all-prompt-logprobs
    long_truncation_mode: Literal["head", "center", "none"] | None = None
    token_healing: bool | None = None
    return_all_prompt_logprobs: bool | None = None
    # OpenAI/vLLM extension (ours, set by /v1/completions): token id (as a string) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    # beam search (ours; vLLM's names): `best_of` beams, scored as transformers' generate(num_beams) scores them;
    # null: LightLLM's --beam_mode decides (tgi_compat/api/serving/beam_generate.py)
    use_beam_search: bool | None = None
    length_penalty: F32 | None = None
    early_stopping: bool | Literal["never"] | None = None


def _sampling_preset() -> GenerateParameters:
    # A request without a `parameters` key samples (TGI's default_parameters()).
    return GenerateParameters(do_sample=True)


class GenerateRequest(SerdeModel):
    inputs: str
    parameters: GenerateParameters = Field(default_factory=_sampling_preset)


class CompatGenerateRequest(GenerateRequest):
    stream: bool = False


# ----------------------------------------------------------------------------------- responses


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)

    def to_json(self) -> str:
        return dump_json(self.to_dict())


# One shared encoder: json.dumps with non-default options builds a new JSONEncoder per call.
_COMPACT_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def dump_json(payload: Any) -> str:
    """Compact JSON, UTF-8 kept as is, like serde_json."""
    return _COMPACT_ENCODER.encode(payload)


class Token(_Response):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(_Response):
    id: int
    text: str
    logprob: float | None  # null for the first prompt token


class SimpleToken(_Response):
    id: int
    text: str
    start: int  # byte offset into the UTF-8 input
    stop: int


# The wire form of tgi_compat.router.request.COMPLETED_FINISH_REASONS (tests/api/test_finish_reason.py keeps them one set).
FinishReason = Literal["length", "eos_token", "stop_sequence"]


class BestOfSequence(_Response):
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None  # set only when non-empty


class Details(_Response):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None  # set only when non-empty
    best_of_sequences: list[BestOfSequence] | None = None  # set only when best_of > 1
    # LightLLM extensions, set only when the request used the feature
    prefill_top_tokens: list[list[Token]] | None = None  # return_all_prompt_logprobs + top_n_tokens
    truncated_prompt_tokens: int | None = None  # long_truncation_mode: prompt tokens dropped


class GenerateResponse(_Response):
    generated_text: str
    details: Details | None = None  # set only when details or decoder_input_details


class StreamDetails(_Response):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    input_length: int
    # LightLLM extensions, set only when the request used the feature
    prefill: list[PrefillToken] | None = None  # return_all_prompt_logprobs
    prefill_top_tokens: list[list[Token]] | None = None
    truncated_prompt_tokens: int | None = None


class StreamResponse(_Response):
    index: int
    token: Token
    top_tokens: list[Token] | None = None  # set only when non-empty
    generated_text: str | None
    details: StreamDetails | None


class ErrorResponse(_Response):
    error: str
    error_type: str


class Info(_Response):
    model_id: str
    model_sha: str | None
    model_pipeline_tag: str | None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    validation_workers: int
    max_client_batch_size: int
    router: str
    version: str
    sha: str | None
    docker_label: str | None
