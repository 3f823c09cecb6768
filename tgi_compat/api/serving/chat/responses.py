"""Generation results -> TGI's chat.completion bodies and chat.completion.chunk events.

Every chunk carries `role`; a special token's content is ""; `finish_reason` is on the last
token's chunk only; usage comes in a final chunk with no choices (`stream_options.include_usage`).
"""

from __future__ import annotations

from typing import Any

from tgi_compat.api.protocol.openai_common import openai_finish_reason, system_fingerprint, unix_now
from tgi_compat.api.protocol.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprob,
    ChatLogprobs,
    ChatMessage,
    ChatToolCallDelta,
    ChatToolCallMessage,
    ChatTopLogprob,
    FunctionCallChunk,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from tgi_compat.api.protocol.tgi import Token, dump_json
from tgi_compat.api.serving.chat.tools import ToolDelta
from tgi_compat.api.serving.generation import GenerationResult, TokenStep


def _logprob_entry(token: Token, top_tokens: list[Token], text: str | None = None) -> ChatLogprob:
    return ChatLogprob(
        token=token.text if text is None else text,
        logprob=token.logprob,
        top_logprobs=[ChatTopLogprob(token=t.text, logprob=t.logprob) for t in top_tokens],
    )


def completion_logprobs(result: GenerationResult) -> ChatLogprobs:
    tops = result.top_tokens
    return ChatLogprobs(
        content=[_logprob_entry(token, tops[i] if i < len(tops) else []) for i, token in enumerate(result.tokens)]
    )


def chat_completion(
    model: str,
    result: GenerationResult,
    logprobs: bool,
    tool_calls: list[dict[str, Any]] | None = None,
    cached_tokens: int | None = None,
) -> ChatCompletion:
    """TGI's chat.completion; a tool call's message has `tool_calls` and no `content` key."""
    message = (
        ChatToolCallMessage(tool_calls=[ToolCall.model_validate(call) for call in tool_calls])
        if tool_calls is not None
        else ChatMessage(content=result.generated_text)
    )
    choice = ChatChoice(
        index=0,
        message=message,
        logprobs=completion_logprobs(result) if logprobs else None,
        finish_reason=openai_finish_reason(result.finish_reason),
    )
    return ChatCompletion(
        created=unix_now(),
        model=model,
        system_fingerprint=system_fingerprint(),
        choices=[choice],
        usage=Usage.of(result.input_length, result.generated_tokens, cached_tokens),
    )


def _chunk(model: str, choices: list[ChatChunkChoice], usage: Usage | None) -> str:
    chunk = ChatCompletionChunk(
        created=unix_now(), model=model, system_fingerprint=system_fingerprint(), choices=choices, usage=usage
    )
    return dump_json(chunk.to_dict())


def _finish_reason(step: TokenStep) -> str | None:
    return openai_finish_reason(step.result.finish_reason) if step.result is not None else None


def token_chunk(model: str, step: TokenStep, logprobs: bool) -> str:
    """One token: role on every chunk, "" for special tokens, finish_reason on the last."""
    choice = ChatChunkChoice(
        index=0,
        delta=ChatDelta(content="" if step.token.special else step.token.text),
        logprobs=ChatLogprobs(content=[_logprob_entry(step.token, step.top_tokens)]) if logprobs else None,
        finish_reason=_finish_reason(step),
    )
    return _chunk(model, [choice], None)


def tool_chunk(model: str, step: TokenStep, logprobs: bool, delta: ToolDelta, call_id: str) -> str:
    """One piece of a streamed tool call (TGI's ToolCallDelta); its logprob entry shows the piece sent."""
    call = ToolCallDelta(index=0, id=call_id, function=FunctionCallChunk(name=delta.name, arguments=delta.arguments))
    entry = _logprob_entry(step.token, step.top_tokens, delta.arguments)
    choice = ChatChunkChoice(
        index=0,
        delta=ChatToolCallDelta(tool_calls=[call]),
        logprobs=ChatLogprobs(content=[entry]) if logprobs else None,
        finish_reason=_finish_reason(step),
    )
    return _chunk(model, [choice], None)


def usage_chunk(model: str, result: GenerationResult, cached_tokens: int | None = None) -> str:
    return _chunk(model, [], Usage.of(result.input_length, result.generated_tokens, cached_tokens))
