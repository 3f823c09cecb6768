"""TGI's `grammar` parameter and the chat `response_format`: validated with TGI's texts and turned
into the GrammarSpec the engine compiles (tgi_compat/router/sampling/grammar.py). No tokenizer is involved here.

    {"type": "json" | "json_object", "value": <schema object or JSON text>}
    {"type": "json_schema", "value": {"name"?: str, "schema": {...}}}
    {"type": "regex", "value": "<regex>"}

TGI's checks, in order: grammar support (`--disable-grammar-support`), the value's JSON type, the
JSON text, JSON-Schema draft 2020-12 meta-validation, a top-level `properties` key. A schema that
passes but does not compile is refused by the engine with `cannot compile regex from schema: ...`.

Beyond TGI (its users hit these): `response_format` (chat and completions) also takes
`{"type": "json_object"}` with no value (any JSON), `{"type": "json_object", "schema": {...}}` (what
LangChain sends) and OpenAI's structured outputs, `{"type": "json_schema", "json_schema": {"name": ...,
"schema": {...}, "strict": ...}}` (the openai SDK's `.parse()`, LiteLLM, instructor, pydantic-ai,
openai-agents). OpenAI's schema passes TGI's checks and texts like TGI's own form; `"strict": false`
compiles it with JSON Schema's own defaults (objects open to unlisted properties) instead of the closed
objects every other JSON grammar gets, and a `json_schema` without `schema` is any JSON.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import ConfigDict, Field

from tgi_compat.api.protocol.errors import BodyRejection, validation_error
from tgi_compat.api.protocol.serde import SerdeModel, SerdeSyntaxError, loads
from tgi_compat.api.protocol.tgi import GrammarType
from tgi_compat.router.request import GrammarKind, GrammarSpec

NOT_SUPPORTED = "grammar is not supported"
NO_PROPERTIES = "Grammar must have a 'properties' field"


class JsonSchemaFormat(SerdeModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str
    description: str | None = None
    schema_: Any = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(SerdeModel):
    """`response_format`: TGI's GrammarType (`value` optional for `json_object`) or OpenAI's `json_schema`."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    type: Literal["json", "json_object", "regex", "json_schema"]
    value: Any = None
    schema_: Any = Field(default=None, alias="schema")  # {"type": "json_object", "schema": {...}}
    json_schema: JsonSchemaFormat | None = None  # OpenAI's form of {"type": "json_schema"}

    @property
    def openai_json_schema(self) -> JsonSchemaFormat | None:
        """OpenAI's `json_schema` object when that is the form used (TGI's `value` wins where both are sent)."""
        return self.json_schema if self.type == "json_schema" and "value" not in self.model_fields_set else None

    @property
    def strict(self) -> bool:
        """Closed objects, unless OpenAI's form says `"strict": false`."""
        openai = self.openai_json_schema
        return openai is None or openai.strict is not False

    def check_shape(self) -> None:
        """What serde would refuse: only `json_object` (and OpenAI's `json_schema`) may come without a
        `value` (axum's 422 text). An explicit `"value": null` deserializes (serde_json's Value::Null);
        validation refuses it later."""
        if "value" not in self.model_fields_set and self.type != "json_object" and self.openai_json_schema is None:
            raise BodyRejection(
                422, "Failed to deserialize the JSON body into the target type: response_format: missing field `value`"
            )

    def as_grammar(self) -> GrammarType | None:
        """The TGI grammar it stands for; None for any JSON (no schema given)."""
        if (openai := self.openai_json_schema) is not None:
            schema = openai.schema_
            return None if schema is None else GrammarType(type="json_schema", value={"schema": schema})
        if self.value is not None or (self.type != "json_object" and "value" in self.model_fields_set):
            return GrammarType(type=self.type, value=self.value)
        if self.schema_ is not None:
            return GrammarType(type="json", value=self.schema_)
        return None


def grammar_spec(grammar: GrammarType | ResponseFormat | None, supported: bool) -> GrammarSpec | None:
    """TGI's grammar validation (raises its 422 validation errors); None when there is no grammar.

    Runs JSON-Schema meta-validation: call it off the event loop (a schema can be large)."""
    if grammar is None:
        return None
    if not supported:
        raise validation_error(NOT_SUPPORTED)
    if isinstance(grammar, ResponseFormat):
        tgi_grammar = grammar.as_grammar()
        if tgi_grammar is None:
            return GrammarSpec(GrammarKind.ANY_JSON)
        spec = _tgi_grammar_spec(tgi_grammar)
        return spec if grammar.strict else dataclasses.replace(spec, strict=False)
    return _tgi_grammar_spec(grammar)


def _tgi_grammar_spec(grammar: GrammarType) -> GrammarSpec:
    if grammar.type == "regex":
        if not isinstance(grammar.value, str):
            raise validation_error(NOT_SUPPORTED)
        return GrammarSpec(GrammarKind.REGEX, grammar.value)
    if grammar.type == "json_schema":
        if not isinstance(grammar.value, dict) or "schema" not in grammar.value:
            raise validation_error(NOT_SUPPORTED)
        schema = grammar.value["schema"]
    else:
        schema = _json_value(grammar.value)
    check_schema(schema)
    schema = named_empty_function_refs(schema)
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False, separators=(",", ":")))


_EMPTY_NAME_REF = "#/$functions/"  # the tool grammar's pointer to a tool named ""


def named_empty_function_refs(schema: Any) -> Any:
    """The tool grammar's `{"$ref": "#/$functions/"}` (a tool named "") pointed at a copy of that function under a
    name of its own.

    TGI's resolver reads the pointer as the key "" (RFC 6901) and constrains the call; xgrammar reads
    it as `$functions` itself and then accepts any JSON there. Other names resolve alike in both. The function is
    named once, not copied into every reference: a schema of many references to a large function grew ~1,000x
    (181 KB -> 244 MB) when each was replaced by the function itself."""
    functions = schema.get("$functions") if isinstance(schema, dict) else None
    if not isinstance(functions, dict) or "" not in functions:
        return schema
    name = "_empty_name"
    while name in functions:
        name += "_"
    named = {"$ref": f"#/$functions/{name}"}  # (underscores and letters: nothing to escape in the pointer)

    def resolve(node: Any) -> Any:
        if isinstance(node, list):
            return [resolve(item) for item in node]
        if not isinstance(node, dict):
            return node
        if node == {"$ref": _EMPTY_NAME_REF}:
            return named
        return {key: value if key == "$functions" else resolve(value) for key, value in node.items()}

    resolved = resolve(schema)
    resolved["$functions"] = {**functions, name: functions[""]}
    return resolved


def _json_value(value: Any) -> Any:
    """`json` takes the schema as an object or as JSON text (which must parse)."""
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise validation_error(NOT_SUPPORTED)
    try:
        return loads(value.encode())  # serde_json's reading (no NaN, no number past f64)
    except SerdeSyntaxError as error:
        raise validation_error(f"grammar is not valid: {error}") from None
    except json.JSONDecodeError as error:
        raise validation_error(f"grammar is not valid: {serde_syntax(error)}") from None
    except RecursionError:
        raise validation_error("grammar is not valid: recursion limit exceeded") from None


def check_schema(schema: Any) -> None:
    """Draft 2020-12 meta-validation, then TGI's `properties` requirement."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as error:
        raise validation_error(f"grammar is not valid: {_rust_schema_message(error)}") from None
    except RecursionError:
        raise validation_error("grammar is not valid: recursion limit exceeded") from None
    if not isinstance(schema, dict) or "properties" not in schema:
        raise validation_error(f"grammar is not valid: {NO_PROPERTIES}")


def _rust_schema_message(error: Any) -> str:
    """The Rust `jsonschema` crate's wording of the usual meta-validation failures (Python's otherwise)."""
    instance = json.dumps(error.instance, ensure_ascii=False, separators=(",", ":"))
    if error.validator == "anyOf":
        return f"{instance} is not valid under any of the schemas listed in the 'anyOf' keyword"
    if error.validator == "type":
        types = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
        if len(types) == 1:
            return f'{instance} is not of type "{types[0]}"'
        return f"{instance} is not of types " + ", ".join(f'"{t}"' for t in types)
    if error.validator == "enum":
        return f"{instance} is not one of {json.dumps(error.validator_value, separators=(',', ':'))}"
    return error.message


def serde_syntax(error: json.JSONDecodeError) -> str:
    """serde_json's wording for the common JSON text errors."""
    if error.pos >= len(error.doc) or error.msg.startswith("Unterminated"):
        text = "EOF while parsing a value"
    elif error.msg == "Expecting value":
        text = "expected value"
    elif error.msg == "Extra data":
        text = "trailing characters"
    elif error.msg.startswith("Expecting property name"):
        text = "key must be a string"
    else:
        text = error.msg[0].lower() + error.msg[1:]
    return f"{text} at line {error.lineno} column {error.colno}"
