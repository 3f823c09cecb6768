"""OpenAI response bodies as TGI writes them: chat completions and their chunks, text completions
and their chunks, usage. Field order is the wire order; `to_dict()` keeps every field (nulls too)
and leaves floats as they are, so the JSON is the bytes the routes wrote before these were typed."""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


class PromptTokensDetails(_Body):
    cached_tokens: int


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # vLLM's --enable-prompt-tokens-details only; absent (not null) otherwise, so TGI's shape stays exact
    prompt_tokens_details: PromptTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        body = handler(self)
        if body.get("prompt_tokens_details") is None:
            body.pop("prompt_tokens_details", None)
        return body

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens)
            if cached_tokens is not None
            else None,
        )


ChoiceT = TypeVar("ChoiceT", bound=_Body)


class _Response(_Body, Generic[ChoiceT]):
    """The fields every OpenAI body and chunk starts with, in TGI's order. A subclass pins `object`
    to its literal and adds `usage`; redeclared fields keep their place."""

    object: str
    id: str = ""
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChoiceT]


# ------------------------------------------------------------------------------------------ chat


class ChatTopLogprob(_Body):
    token: str
    logprob: float | None


class ChatLogprob(_Body):
    token: str
    logprob: float | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(_Body):
    content: list[ChatLogprob]


class ChatMessage(_Body):
    role: Literal["assistant"] = "assistant"
    content: str


class FunctionCall(_Body):
    """TGI's FunctionDefinition as a generated call: `description` is always null."""

    description: str | None = None
    name: str
    arguments: str  # compact JSON


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatToolCallMessage(_Body):
    """A tool call's message: `tool_calls` and no `content` key (TGI)."""

    role: Literal["assistant"] = "assistant"
    tool_calls: list[ToolCall]


class ChatChoice(_Body):
    index: int
    message: ChatMessage | ChatToolCallMessage
    logprobs: ChatLogprobs | None
    finish_reason: str


class ChatCompletion(_Response[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    usage: Usage


class ChatDelta(_Body):
    role: Literal["assistant"] = "assistant"
    content: str


class FunctionCallChunk(_Body):
    name: str | None  # on the first piece only
    arguments: str


class ToolCallDelta(_Body):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallChunk


class ChatToolCallDelta(_Body):
    """TGI's ToolCallDelta: one piece of a streamed tool call."""

    role: Literal["assistant"] = "assistant"
    tool_calls: list[ToolCallDelta]


class ChatChunkChoice(_Body):
    index: int
    delta: ChatDelta | ChatToolCallDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(_Response[ChatChunkChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: Usage | None


# ----------------------------------------------------------------------------------- completions

# OpenAI's legacy logprobs: parallel lists {tokens, token_logprobs, top_logprobs, text_offset}.
CompletionLogprobs = dict[str, list[Any]]


class _TextChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str


class CompletionStreamChoice(_TextChoice):
    """A stream's token choice: no AIAK fields; finish_reason "" until the last."""


class CompletionChoice(_TextChoice):
    """A choice with AIAK's `sentence_length` and `cum_log_probs` (non-stream, and a stream's last)."""

    sentence_length: int
    cum_log_probs: int | float  # the sum keeps its type: 0 when nothing was generated


class TextCompletion(_Response[CompletionChoice]):
    """Non-stream /v1/completions, and TGI's `CompletionFinal` (a stream's last chunk per prompt)."""

    object: Literal["text_completion"] = "text_completion"
    usage: Usage


class CompletionChunk(_Body):
    """TGI's streamed `Chunk`: no usage key, and model after choices (so not a _Response)."""

    object: Literal["text_completion"] = "text_completion"
    id: str = ""
    created: int
    choices: list[CompletionStreamChoice]
    model: str
    system_fingerprint: str
