"""Request bodies of the OpenAI-compatible routes: TGI's ChatRequest and CompletionRequest
(docs/contract.md §9.1 and §10), plus the OpenAI completions parameters vLLM-based servers accept.

Parsed like serde would (SerdeModels: strict types, unknown keys ignored, `null` only where TGI has an
`Option`, a field given twice refused, f32 parameters in f32) through `tgi_compat.api.protocol.errors.parse_json_body`, so shape errors are axum's text/plain 422.
Responses are the typed models in openai_responses.py, in TGI's key order.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from tgi_compat.api.protocol.grammar import ResponseFormat
from tgi_compat.api.protocol.serde import F32, SerdeModel
from tgi_compat.api.protocol.tgi import U32, U64

# ------------------------------------------------------------------------------------- messages


class ImageUrl(SerdeModel):
    url: str


class TextChunk(SerdeModel):
    type: Literal["text"]
    text: str


class ImageChunk(SerdeModel):
    type: Literal["image_url"]
    image_url: ImageUrl


MessageChunk = Annotated[TextChunk | ImageChunk, Field(discriminator="type")]


class FunctionDefinition(SerdeModel):
    description: str | None = None
    name: str
    arguments: Any = Field(validation_alias=AliasChoices("arguments", "parameters"))  # TGI reads either key


class ToolCall(SerdeModel):
    id: str
    type: str
    function: FunctionDefinition


class Message(SerdeModel):
    """`{role, content: str | [chunks]}` or `{role, tool_calls: [...]}`; `name` is ignored."""

    role: str
    content: str | list[MessageChunk] | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_or_tool_calls(self) -> Message:
        if self.content is None and self.tool_calls is None:
            raise ValueError("data did not match any variant of untagged enum MessageBody")
        return self


class Tool(SerdeModel):
    type: str
    function: FunctionDefinition


class FunctionName(SerdeModel):
    name: str


class TypedToolChoice(SerdeModel):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(SerdeModel):
    include_usage: bool = False


# ----------------------------------------------------------------------------------------- chat


class ChatRequest(SerdeModel):
    messages: list[Message]
    model: str | None = None
    frequency_penalty: F32 | None = None
    logit_bias: list[F32] | None = None  # TGI types it as an array: an OpenAI map is a 422
    logprobs: bool | None = None
    top_logprobs: U32 | None = None
    max_tokens: U32 | None = Field(default=None, validation_alias=AliasChoices("max_tokens", "max_completion_tokens"))
    n: U32 | None = None  # accepted and ignored, like TGI: one choice is returned
    presence_penalty: F32 | None = None
    stop: list[str] | None = None
    stream: bool = False
    seed: U64 | None = None
    temperature: F32 | None = None
    top_p: F32 | None = None
    tools: list[Tool] | None = None
    tool_prompt: str | None = None
    tool_choice: str | TypedToolChoice | None = None
    response_format: ResponseFormat | None = None  # TGI's GrammarType; `value` optional for json_object
    stream_options: StreamOptions = Field(default_factory=StreamOptions)


# ---------------------------------------------------------------------------------- completions

EMPTY_PROMPT_MESSAGE = "Empty array detected. Do not use an empty array for the prompt."


Prompt = str | list[int]  # text, or token ids (OpenAI's legacy API and vLLM take both; TGI only text)


class CompletionRequest(SerdeModel):
    prompt: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    max_tokens: U32 | None = None
    temperature: F32 | None = None
    top_p: F32 | None = None
    seed: U64 | None = None
    suffix: str | None = None
    repetition_penalty: F32 | None = None
    frequency_penalty: F32 | None = None
    stop: list[str] | None = None
    stream: bool = False
    # OpenAI / vLLM parameters TGI ignores:
    echo: bool | None = None
    logprobs: U32 | None = None  # top alternatives per token (OpenAI legacy shape)
    n: U32 | None = None
    best_of: U32 | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    user: str | None = None
    response_format: ResponseFormat | None = None  # as on chat (vLLM takes it here too)
    # LightLLM's per-request features (ours), as on /generate
    long_truncation_mode: Literal["head", "center", "none"] | None = None
    token_healing: bool | None = None
    return_all_prompt_logprobs: bool | None = None
    # vLLM's beam search (tgi_compat/api/serving/beam_search.py): `beam_width` beams (default `n`), the `n` best
    # returned, scored as transformers' generate(num_beams) scores them
    use_beam_search: bool = False
    beam_width: U32 | None = None
    length_penalty: F32 = 1.0
    early_stopping: bool | Literal["never"] = False

    @field_validator("prompt", mode="after")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError(EMPTY_PROMPT_MESSAGE)
        return prompt

    @property
    def prompts(self) -> list[Prompt]:
        """One entry per prompt: `"text"` and `[1, 2]` are one prompt, `["a", "b"]` and `[[1], [2]]` two."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)
