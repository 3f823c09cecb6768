"""Chat tool calling the way TGI's router does it: tool choice, the JSON grammar the answer is
constrained to, the prompt injection, and reading the answer back as `tool_calls`.

    tools + tool_choice --select_tools--> tools in use (+ `no_tool` for "auto")
                        --tool_grammar--> {"$functions": {name: {..., "_name": const}}, "properties": {"function": anyOf}}
    prompt: "\\n---\\n" + tools JSON + "\\n" + tool_prompt appended to the last message (only the
            tool prompt when the chat template renders `tools` itself)
    answer: {"function": {"_name": "<tool>", <arguments>}} -> one tool call (streams: ToolStream);
            `no_tool` -> TGI generates again without tools and answers in plain text.

Two departures where TGI's output would not parse: the grammar requires its `function` key
(so `{}` is never a complete answer), and a stream never starts `arguments` with the comma that
followed the tool name (or leaves `{` unclosed for a tool without arguments). And one where clients
break on TGI's ids: every call gets a unique `call_<24 hex>` id, as OpenAI and vLLM give, where TGI
says "0" (or counts up on streams), which clients that merge calls by id (openai-agents) take for one.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tgi_compat.api.protocol.grammar import serde_syntax
from tgi_compat.api.protocol.openai import ChatRequest, FunctionDefinition, Tool
from tgi_compat.api.serving.chat.template import ChatTemplate, compact_json, tool_error

DEFAULT_TOOL_PROMPT = (
    "\nGiven the functions available, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt. Respond in the format {name: function name, parameters: dictionary of "
    "argument name and its value}.Do not use variables.\n"
)
NO_TOOL_NAME = "no_tool"
# tool_choice "auto" adds TGI's open-ended `no_tool` function to the tools.
NO_TOOL = Tool(
    type="function",
    function=FunctionDefinition(
        name=NO_TOOL_NAME,
        description="Open ended response with no specific tool selected",
        arguments={"type": "object"},
    ),
)


def select_tools(body: ChatRequest) -> list[Tool]:
    """TGI's ToolGrammar::apply selection: the tools generation is constrained to ([] = plain chat)."""
    if body.tools is None:
        return []
    choice = body.tool_choice
    if choice is None or choice == "auto":
        return [*body.tools, NO_TOOL]
    if choice == "none":
        return []
    if choice == "required":
        return list(body.tools)
    name = choice if isinstance(choice, str) else choice.function.name
    for tool in body.tools:
        if tool.function.name == name:
            return [tool]
    raise tool_error(f"Tool with name {name} not found")


def tool_grammar(tools: Sequence[Tool]) -> dict[str, Any]:
    """The JSON schema the answer must match (TGI's JsonSchemaTool)."""
    functions: dict[str, Any] = {}
    for tool in tools:
        function = tool.function
        entry: dict[str, Any] = {"description": function.description or ""}
        properties: dict[str, Any] = {"_name": {"type": "string", "const": function.name}}
        required: list[Any] = ["_name"]
        arguments = function.arguments
        if isinstance(arguments, dict):
            if isinstance(arguments.get("properties"), dict):
                properties.update(arguments["properties"])
            if isinstance(arguments.get("required"), list):
                required.extend(arguments["required"])
            entry["additionalProperties"] = arguments.get("additionalProperties") == "true"  # sic: only the string
        entry["properties"] = properties
        entry["required"] = required
        functions[function.name] = entry
    return {
        "$functions": functions,
        "properties": {"function": {"anyOf": [{"$ref": f"#/$functions/{tool.function.name}"} for tool in tools]}},
        "required": ["function"],
    }


def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """Tools as TGI serialises them for the template and the prompt (`arguments` as JSON text)."""
    return [
        {
            "type": tool.type,
            "function": {
                "description": tool.function.description,
                "name": tool.function.name,
                "arguments": compact_json(tool.function.arguments),
            },
        }
        for tool in tools
    ]


def template_uses_tools(template: ChatTemplate) -> bool:
    """Whether the template renders `tools` itself (minijinja's undeclared variables)."""
    from jinja2 import Environment, meta

    return "tools" in meta.find_undeclared_variables(Environment().parse(template.source))


def tool_prompt_text(tools: Sequence[Tool], tool_prompt: str | None, template: ChatTemplate) -> str:
    """What TGI appends to the last message's content."""
    prompt = tool_prompt or DEFAULT_TOOL_PROMPT
    if template_uses_tools(template):
        return f"\n---\n{prompt}"
    return f"\n---\n{compact_json(template_tools(tools))}\n{prompt}"


# ------------------------------------------------------------------------------------ answers


def _call(text: str) -> dict[str, Any] | None:
    """`{"function": {"_name": str, ...}}` parsed, else None (what serde's `Call` accepts)."""
    try:
        document = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    function = document.get("function") if isinstance(document, dict) else None
    if isinstance(function, dict) and isinstance(function.get("_name"), str):
        return function
    return None


def parse_tool_answer(generated_text: str) -> list[dict[str, Any]] | None:
    """The non-streamed answer as `tool_calls`; None for `no_tool` (answer again without tools)."""
    function = _call(generated_text)
    if function is None:
        raise tool_error(
            f"Failed to parse generated text: {_parse_failure(generated_text)} {json.dumps(generated_text)}"
        )
    name = function.pop("_name")
    if name == NO_TOOL_NAME:
        return None
    return [
        {
            "id": new_tool_call_id(),
            "type": "function",
            "function": {"description": None, "name": name, "arguments": compact_json(function)},
        }
    ]


def _parse_failure(text: str) -> str:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        return serde_syntax(error)
    if not isinstance(document, dict) or "function" not in document:
        return "missing field `function` at line 1 column 1"
    return "missing field `_name` at line 1 column 1"


def new_tool_call_id() -> str:
    """A call id unique across calls and requests (OpenAI's shape); a stream repeats it on every chunk."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(slots=True)
class ToolDelta:
    """One streamed chunk of a tool call: `name` on the first, then pieces of `arguments`."""

    arguments: str
    name: str | None = None


class StreamSignal(enum.Enum):
    NO_TOOL = enum.auto()  # the model chose `no_tool`: answer again, in plain text
    EMPTY_CONTENT = enum.auto()  # a special token inside the arguments: TGI sends `content: ""`


_TRAILING = re.compile(r"[\s,}]+$")


@dataclass(slots=True)
class ToolStream:
    """TGI's ChatState for tools: buffer tokens until the tool name parses, then stream arguments.

    push() returns a ToolDelta to send, a StreamSignal, or None to send nothing. Once the call is
    complete, later tokens (EOS) send nothing, as in TGI.
    """

    text: str = ""
    state: str = "buffering"  # buffering -> arguments -> done
    _started: bool = field(default=False)

    def push(self, token_text: str, special: bool) -> ToolDelta | StreamSignal | None:
        self.text += token_text
        if self.state == "buffering":
            call = _call(_TRAILING.sub("", self.text) + "}}")
            if call is None:
                return None
            if call["_name"] == NO_TOOL_NAME:
                return StreamSignal.NO_TOOL
            complete = _call(self.text) is not None  # a tool without arguments: nothing more will come
            self.state = "done" if complete else "arguments"
            return ToolDelta("{}" if complete else "{", name=call["_name"])
        if self.state == "done":
            return None
        if special:
            return StreamSignal.EMPTY_CONTENT
        text = token_text
        if not self._started:  # the comma after the name belongs to the wrapper, not to the arguments
            self._started = True
            if text.lstrip().startswith(","):
                text = text.lstrip()[1:]
        if _call(self.text) is not None:  # the call is complete: drop the wrapper's closing brace
            self.state = "done"
            text = text.rstrip()
            if text.endswith("}"):
                text = text[:-1]
        return ToolDelta(text)
