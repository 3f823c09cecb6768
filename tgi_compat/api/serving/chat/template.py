"""Chat templates, applied the way TGI's router applies them (docs/contract.md §9.1-§9.2).

* Source, first found wins: `--chat-template` (a file or the template text; ours), the model's
  `chat_template.json`, `chat_template` in tokenizer_config.json (`--tokenizer-config-path` replaces
  that file), processor_config.json, then the tokenizer's own template (GGUF metadata,
  chat_template.jinja). A list of named templates uses the one named `default`.
* Rendering: jinja2's ImmutableSandboxedEnvironment configured like transformers'
  `apply_chat_template` (trim_blocks, lstrip_blocks, loopcontrols, a `tojson` that does not escape
  HTML, `raise_exception`, `strftime_now`), after TGI's three source rewrites.
  (TGI's minijinja does not set trim/lstrip_blocks; we follow transformers so prompts equal what
  the model was trained and evaluated with.)
* Context: every message flattened to `{role, content: str}` (text chunks concatenated, images as
  markdown, tool calls as their JSON), `bos_token`/`eos_token` strings, `add_generation_prompt`
  always true, `tools`.
* Continue-final-message: when the last message is the assistant's, the prompt is cut right after
  the last occurrence of its content and right-trimmed.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tgi_compat.api.config import ServerConfig
from tgi_compat.api.protocol.errors import TgiError

logger = logging.getLogger(__name__)

# TGI's rewrites of template sources that minijinja cannot run as written (kept for parity: the
# same templates then render the same prompts here).
SOURCE_REWRITES: tuple[tuple[str, str], ...] = (
    ("messages[0]['content'][0]['text']", "messages[0]['content']"),
    ("[::-1]", "|reverse"),
    ("{% generation %}", ""),
    ("{% endgeneration %}", ""),
)


def template_error(message: str) -> TgiError:
    return TgiError(422, f"Template error: {message}", "template_error", "template")


def tool_error(message: str) -> TgiError:
    # tgi_request_failure has no tool label; tool errors are counted as validation failures.
    return TgiError(422, f"Tool error: {message}", "tool_error", "validation")


# ------------------------------------------------------------------------------------ messages


def _chunk_text(chunk: Any) -> str:
    if chunk.type == "text":
        return chunk.text
    return f"![]({chunk.image_url.url})"  # vision models swap these for image tokens; text models keep them


def _tool_calls_json(tool_calls: list[Any]) -> str:
    """TGI serialises a tool-call message's calls as JSON, `arguments` re-encoded as a JSON string."""
    calls = [
        {
            "id": call.id,
            "type": call.type,
            "function": {
                "description": call.function.description,
                "name": call.function.name,
                "arguments": compact_json(call.function.arguments),
            },
        }
        for call in tool_calls
    ]
    return compact_json(calls)


def flat_content(message: Any) -> str:
    """A Message (openai_schemas.Message) as TGI's TextMessage content."""
    if message.content is None:
        return _tool_calls_json(message.tool_calls or [])
    if isinstance(message.content, str):
        return message.content
    return "".join(_chunk_text(chunk) for chunk in message.content)


def template_messages(messages: list[Any]) -> list[dict[str, str]]:
    return [{"role": message.role, "content": flat_content(message)} for message in messages]


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# ------------------------------------------------------------------------------------ rendering


class _RaisedByTemplate(Exception):
    """`raise_exception(msg)` inside a template (TGI reports it as a minijinja syntax error)."""


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja2's own tojson escapes <, >, & for HTML; chat templates want the plain JSON text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _template_line(traceback: Any) -> int | None:
    """Line of the template being rendered when it failed (jinja2 maps frames to `<template>`)."""
    line = None
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == "<template>":
            line = traceback.tb_lineno
        traceback = traceback.tb_next
    return line


def _minijinja_style(kind: str, detail: str, line: int | None) -> str:
    # minijinja's Display: "<kind>: <detail> (in <name>:<line>)"; TGI names the template <string>.
    location = f" (in <string>:{line})" if line is not None else ""
    return f"{kind}: {detail}{location}"


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    source: str  # after TGI's rewrites
    bos_token: str | None
    eos_token: str | None

    @classmethod
    def create(cls, source: str, bos_token: str | None, eos_token: str | None) -> ChatTemplate:
        for old, new in SOURCE_REWRITES:
            source = source.replace(old, new)
        return cls(source, bos_token, eos_token)

    def render(self, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt for already-flattened messages; raises TGI's template_error."""
        try:
            template = _compile(self.source)
            rendered = template.render(
                messages=messages,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=True,
                tools=tools,
            )
        except _RaisedByTemplate as error:
            raise template_error(
                _minijinja_style("syntax error", str(error), _template_line(sys.exc_info()[2]))
            ) from error
        except jinja2.TemplateSyntaxError as error:
            raise template_error(_minijinja_style("syntax error", error.message or str(error), error.lineno)) from error
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as error:
            detail = getattr(error, "message", None) or str(error)
            raise template_error(
                _minijinja_style("invalid operation", detail, _template_line(sys.exc_info()[2]))
            ) from error
        return continue_final_message(rendered, messages)


def continue_final_message(rendered: str, messages: list[dict[str, str]]) -> str:
    """A trailing assistant message is continued, not answered (TGI / transformers pipeline)."""
    if not messages or messages[-1]["role"] != "assistant":
        return rendered
    content = messages[-1]["content"]
    index = rendered.rfind(content)
    if index < 0:
        return rendered
    return rendered[: index + len(content)].rstrip()


_COMPILED: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    template = _COMPILED.get(source)
    if template is None:
        template = _environment().from_string(source)
        _COMPILED[source] = template
    return template


# -------------------------------------------------------------------------------------- loading


def _token_string(value: Any) -> str | None:
    """tokenizer_config tokens come as a plain string or as `{"content": ...}`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_template(value: Any) -> str | None:
    """A template string, or the one named `default` in a list of `{name, template}`."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return entry.get("template")
    return None


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None


def read_template_override(value: str) -> str:
    """`--chat-template`: a file (a .json with a `chat_template` key, or the template text) or the text itself."""
    path = os.path.expanduser(value)
    if not os.path.isfile(path):
        return value
    if path.endswith(".json"):
        document = _read_json(path) or {}
        template = _pick_template(document.get("chat_template"))
        if template is None:
            raise ValueError(f"{path} has no `chat_template`")
        return template
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def _model_folder(config: ServerConfig) -> str | None:
    try:
        from tgi_compat.modeling.source import resolve_model_source

        return resolve_model_source(config.model_id, config.revision).folder
    except Exception:  # no local files (e.g. offline hub id): use the tokenizer's template
        return None


def _from_files(folder: str | None, tokenizer_config_path: str | None) -> tuple[str | None, dict[str, Any]]:
    """TGI's file priority; also returns tokenizer_config (for bos/eos strings)."""
    tokenizer_config_file = tokenizer_config_path or (folder and os.path.join(folder, "tokenizer_config.json"))
    tokenizer_config = (_read_json(tokenizer_config_file) if tokenizer_config_file else None) or {}
    candidates = []
    if folder:
        candidates.append((_read_json(os.path.join(folder, "chat_template.json")) or {}).get("chat_template"))
    candidates.append(tokenizer_config.get("chat_template"))
    if folder:
        candidates.append((_read_json(os.path.join(folder, "processor_config.json")) or {}).get("chat_template"))
    for candidate in candidates:
        template = _pick_template(candidate)
        if template:
            return template, tokenizer_config
    return None, tokenizer_config


def load_chat_template(config: ServerConfig, hf_tokenizer: Any) -> ChatTemplate | None:
    """The server's chat template, or None (chat then answers `Template error: template not found`).

    `config.chat_template` (ours, `--chat-template`, env CHAT_TEMPLATE) wins over the model's files.
    """
    override = config.chat_template
    folder = _model_folder(config)
    source, tokenizer_config = _from_files(folder, config.tokenizer_config_path)
    if override:
        source = read_template_override(override)
    if source is None:
        source = _pick_template(getattr(hf_tokenizer, "chat_template", None))
    if not source:
        return None
    bos = _token_string(tokenizer_config.get("bos_token")) or _token_string(getattr(hf_tokenizer, "bos_token", None))
    eos = _token_string(tokenizer_config.get("eos_token")) or _token_string(getattr(hf_tokenizer, "eos_token", None))
    logger.info("Chat template loaded (%d characters)", len(source))
    return ChatTemplate.create(source, bos, eos)
