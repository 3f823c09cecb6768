"""A chat request made into a generate request (TGI's try_into_generate): the app's chat template,
tool selection and prompt injection, the response-format or tool grammar, and the sampling fields
mapped onto GenerateParameters the way TGI maps them. Shared by /v1/chat/completions,
/chat_tokenize and /vertex."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Self, cast

from fastapi import Request

from tgi_compat.api.protocol.grammar import ResponseFormat
from tgi_compat.api.protocol.openai import ChatRequest, Tool
from tgi_compat.api.protocol.openai_common import openai_parameters
from tgi_compat.api.protocol.tgi import GenerateParameters, GrammarType
from tgi_compat.api.serving.chat.template import (
    ChatTemplate,
    load_chat_template,
    template_error,
    template_messages,
    tool_error,
)
from tgi_compat.api.serving.chat.tools import select_tools, template_tools, tool_grammar, tool_prompt_text
from tgi_compat.api.serving.state import AppState, Service, get_state

_NO_TEMPLATE = object()


# ------------------------------------------------------------------------------ chat -> generate


def chat_template(request: Request) -> ChatTemplate | None:
    """The app's template, loaded on first use and kept on `app.state` (tests may preset it)."""
    template = getattr(request.app.state, "chat_template", None)
    if template is None:
        state = get_state(request)
        template = load_chat_template(state.config, state.tokenizer.tokenizer) or _NO_TEMPLATE
        request.app.state.chat_template = template
    return None if template is _NO_TEMPLATE else cast(ChatTemplate, template)  # app.state is untyped


class TemplatedService(Service):
    """A service that renders chats: the app's chat template (None: the model has none) beside the state."""

    def __init__(self, state: AppState, template: ChatTemplate | None) -> None:
        super().__init__(state)
        self.template = template

    @classmethod
    def of(cls, request: Request) -> Self:
        return cls(get_state(request), chat_template(request))


@dataclass(slots=True)
class ChatPrompt:
    """A chat request made into a generate request's inputs and grammar (TGI's try_into_generate)."""

    text: str
    grammar: GrammarType | ResponseFormat | None = None
    tools: list[Tool] = field(default_factory=list)  # the tools in use; [] = a plain answer

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools)


def render_prompt(template: ChatTemplate | None, body: ChatRequest) -> ChatPrompt:
    """Tool checks, then the chat template (errors are HTTP 422 even on streams, like TGI)."""
    if body.response_format is not None and body.tools is not None:
        raise tool_error("Grammar and tools are mutually exclusive")
    if body.response_format is not None:
        body.response_format.check_shape()
    tools = select_tools(body) if body.response_format is None else []
    if template is None:
        raise template_error("template not found")
    messages = template_messages(body.messages)
    if not tools:
        return ChatPrompt(template.render(messages), body.response_format)
    if body.messages and body.messages[-1].content is not None:  # TGI appends to a content message only
        messages[-1]["content"] += tool_prompt_text(tools, body.tool_prompt, template)
    text = template.render(messages, template_tools(tools))
    return ChatPrompt(text, GrammarType(type="json", value=tool_grammar(tools)), tools)


def without_tools(body: ChatRequest) -> ChatRequest:
    """The request TGI runs again when the model picked `no_tool`: no tools, no grammar."""
    return body.model_copy(update={"tools": None, "response_format": None})


def chat_parameters(body: ChatRequest) -> GenerateParameters:
    return openai_parameters(
        body,
        repetition_penalty=None if body.presence_penalty is None else body.presence_penalty + 2.0,
        top_n_tokens=body.top_logprobs,
    )
