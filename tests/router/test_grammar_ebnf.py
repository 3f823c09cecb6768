"""Folding bounded repetitions (tgi_compat/router/sampling/grammar_ebnf.py) keeps the language of the grammar.

Property tests: strings near the bounds are accepted by the folded grammar exactly when xgrammar's own
grammar accepts them, and (for strings without escapes) exactly when jsonschema / re say they match.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

xgrammar = pytest.importorskip("xgrammar")

from tgi_compat.router.request import GrammarKind, GrammarSpec  # noqa: E402
from tgi_compat.router.sampling.grammar_compile import grammar_ebnf  # noqa: E402
from tgi_compat.router.sampling.grammar_ebnf import fold_bounded_repetitions  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 5},
        "tags": {"type": "array", "items": {"enum": ["x", "yz"]}, "minItems": 1, "maxItems": 3},
        "code": {"type": "string", "pattern": "[a-c]{1,3}-[0-9]{2}"},
        "note": {"type": "string", "maxLength": 3},
    },
    "required": ["name", "tags", "code", "note"],
}
REGEX = r"[a-c]{1,4}@[a-c]{0,2}\.(com|org){1,2}"


class Matcher:
    """Whole-string acceptance of one EBNF grammar, compiled once (no tokenizer: strings only)."""

    def __init__(self, ebnf: str) -> None:
        compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([]), cache_enabled=False)
        self.compiled = compiler.compile_grammar(ebnf)

    def accepts(self, text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(self.compiled, terminate_without_stop_token=True)
        return matcher.accept_string(text) and matcher.is_terminated()


def xgrammar_ebnf(spec: GrammarSpec) -> str:
    if spec.kind is GrammarKind.REGEX:
        return str(xgrammar.Grammar.from_regex(spec.value))
    return str(xgrammar.Grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=True))


SCHEMA_SPEC = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
REGEX_SPEC = GrammarSpec(GrammarKind.REGEX, REGEX)


@pytest.fixture(scope="module")
def schema_grammars() -> tuple[Matcher, Matcher]:
    return Matcher(xgrammar_ebnf(SCHEMA_SPEC)), Matcher(grammar_ebnf(SCHEMA_SPEC))


@pytest.fixture(scope="module")
def regex_grammars() -> tuple[Matcher, Matcher]:
    return Matcher(xgrammar_ebnf(REGEX_SPEC)), Matcher(grammar_ebnf(REGEX_SPEC))


def test_the_engine_compiles_folded_grammars():
    folded = grammar_ebnf(SCHEMA_SPEC)
    assert folded != xgrammar_ebnf(SCHEMA_SPEC) and "_fold0_" in folded
    assert "{2, 5}" not in folded and "{0, 3}" not in folded  # every bounded repetition + literal is folded


def test_a_string_chain_ends_in_its_closing_quote():
    ebnf = 'root ::= "\\"" c{1, 3} "\\"" "!"\nc ::= [a-z]\n'
    assert fold_bounded_repetitions(ebnf) == (
        'root ::= "\\"" c_fold0_0 "!"\nc ::= [a-z]\n'
        "c_fold0_0 ::= c c_fold0_1\n"
        'c_fold0_1 ::= "\\"" | c c_fold0_2\n'
        'c_fold0_2 ::= "\\"" | c c_fold0_3\n'
        'c_fold0_3 ::= "\\""\n'
    )


@pytest.mark.parametrize(
    "ebnf",
    [
        'root ::= c{0, 200} "x"\nc ::= [a-z]\n',  # above MAX_FOLDED_REPEAT: xgrammar's own form
        'root ::= c{1, -1} "x"\nc ::= [a-z]\n',  # unbounded
        'root ::= c{0, 3} "x"*\nc ::= [a-z]\n',  # the literal repeats itself
        'root ::= c{0, 3} d\nc ::= [a-z]\nd ::= "x"\n',  # no literal follows
        'root ::= "c{0, 3} \\"x\\""\n',  # inside a literal
    ],
)
def test_shapes_that_are_not_folded(ebnf):
    assert fold_bounded_repetitions(ebnf) == ebnf


def _quoted(text: str) -> str:
    return '"' + text + '"'


# Per field: values within its bounds, and values of its alphabet with any length (escapes, quotes).
NEAR = {
    "name": st.text(alphabet="ab", min_size=2, max_size=5),
    "tags": st.lists(st.sampled_from(["x", "yz"]), min_size=1, max_size=3),
    "code": st.from_regex(r"[a-c]{1,3}-[0-9]{2}", fullmatch=True),
    "note": st.text(alphabet="a b", max_size=3),
}
ANY = {
    "name": st.text(alphabet='ab"\\', max_size=7),
    "tags": st.lists(st.sampled_from(["x", "yz", "w"]), max_size=4),
    "code": st.text(alphabet="ac-19", max_size=7),
    "note": st.text(alphabet='a b"', max_size=5),
}


@settings(max_examples=400, deadline=None, derandomize=True)
@given(data=st.data(), broken=st.sets(st.sampled_from(sorted(NEAR)), max_size=2))
def test_folded_schema_grammar_accepts_exactly_what_xgrammar_and_jsonschema_accept(schema_grammars, data, broken):
    value = {field: data.draw(ANY[field] if field in broken else NEAR[field], label=field) for field in NEAR}
    text = (
        f'{{"name": {_quoted(value["name"])}, "tags": [{", ".join(map(_quoted, value["tags"]))}], '
        f'"code": {_quoted(value["code"])}, "note": {_quoted(value["note"])}}}'
    )
    original, folded = schema_grammars
    accepted = folded.accepts(text)
    assert accepted == original.accepts(text), text
    if "\\" not in text:  # (xgrammar's bounded strings take no escapes; jsonschema would)
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            valid = re.fullmatch(SCHEMA["properties"]["code"]["pattern"], value["code"]) is not None
        except (ValueError, jsonschema.ValidationError):
            valid = False
        assert accepted == valid, text
    if not broken:
        assert accepted, text


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=st.text(alphabet="abd@.comrg", max_size=14))
def test_folded_regex_grammar_accepts_exactly_what_re_and_xgrammar_accept(regex_grammars, text):
    original, folded = regex_grammars
    accepted = folded.accepts(text)
    assert accepted == (re.fullmatch(REGEX, text) is not None) == original.accepts(text), text


def test_boundary_lengths_of_a_bounded_string(schema_grammars):
    original, folded = schema_grammars
    for length in range(8):
        text = f'{{"name": "{"n" * length}", "tags": ["x"], "code": "a-12", "note": ""}}'
        assert folded.accepts(text) == original.accepts(text) == (2 <= length <= 5), length


def test_strict_closes_objects_and_loose_keeps_json_schemas_default():
    """OpenAI's `"strict": false` (GrammarSpec.strict) leaves objects open to unlisted properties."""
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    strict = Matcher(grammar_ebnf(GrammarSpec(GrammarKind.JSON_SCHEMA, schema)))
    loose = Matcher(grammar_ebnf(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=False)))
    extra = '{"a": 1, "b": "x"}'
    assert strict.accepts('{"a": 1}') and loose.accepts('{"a": 1}')
    assert not strict.accepts(extra) and loose.accepts(extra)
    assert not loose.accepts('{"a": "x"}')  # still the schema
