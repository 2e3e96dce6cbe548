"""The JSON-schema allow list (rocm_k3/structured/schema_keywords.py) against xgrammar itself: every keyword it
lets through is enforced (the grammar accepts a value that keeps it and rejects one that breaks it), every keyword
it refuses is named in the error, and the refused ones are really ignored by xgrammar (so the refusal is needed: if
an xgrammar upgrade starts enforcing one, ``test_refused_keywords_are_ignored_by_xgrammar`` says so). Also the
empty-language check (structured/emptiness.py) and the JSON input limits (formats/json_limits.py)."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr
from xgrammar import structural_tag as st
from xgrammar.testing import _is_grammar_accept_string

from rocm_k3.formats.json_limits import MAX_JSON_DEPTH, MAX_NUMBER_CHARS, JSONLimitError, NotJSONError, load_json
from rocm_k3.structured.emptiness import accepts_some_text
from rocm_k3.structured.json_schema import normalize_json_schema
from rocm_k3.structured.schema_keywords import ENFORCED, ENFORCED_FORMATS, check_schema_keywords

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
# a tagged union as pydantic writes it (Union[Cat, Dog] with Field(discriminator="kind"))
TAGGED = {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "discriminator": {"propertyName": "kind"},
          "$defs": {"Cat": {"type": "object", "title": "Cat", "required": ["kind", "lives"], "properties": {
              "kind": {"const": "cat", "type": "string"}, "lives": {"type": "integer"}}},
              "Dog": {"type": "object", "title": "Dog", "required": ["kind", "bark"], "properties": {
                  "kind": {"enum": ["dog", "wolf"], "type": "string"}, "bark": {"type": "boolean"}}}}}


def grammar(schema) -> xgr.Grammar:
    """The grammar the server builds for a JSON schema (rewrites, bounded whitespace, structural tag)."""
    return xgr.Grammar.from_structural_tag(st.StructuralTag(format=st.JSONSchemaFormat(
        json_schema=normalize_json_schema(schema), max_whitespace_cnt=2)))


# keyword -> (schema using it, a value keeping it, a value breaking it)
ENFORCED_CASES = {
    "type": ({"type": ["integer", "null"]}, "null", '"s"'),
    "enum": ({"type": "integer", "enum": [1, 2]}, "1", "3"),
    "const": ({"const": "x"}, '"x"', '"y"'),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", '"s"'),
    "oneOf": (TAGGED, '{"kind": "cat", "lives": 9}', '{"kind": "cat", "bark": true}'),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 3}]}, "3", "2"),
    "$ref": ({"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A"}, "1", '"s"'),
    "$defs": ({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"type": "integer"}}},
              '{"a": 1}', '{"a": "s"}'),
    "definitions": ({"definitions": {"A": {"type": "integer"}}, "$ref": "#/definitions/A"}, "1", '"s"'),
    "properties": (OBJ, '{"a": 1}', '{"a": "s"}'),
    "required": ({**OBJ, "required": ["a"]}, '{"a": 1}', "{}"),
    "additionalProperties": ({**OBJ, "additionalProperties": False}, '{"a": 1}', '{"a": 1, "c": 2}'),
    "unevaluatedProperties": ({**OBJ, "unevaluatedProperties": False}, '{"a": 1}', '{"a": 1, "c": 2}'),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-c]+$"}}, '{"ab": 1}', '{"zz": 1}'),
    "minProperties": ({**OBJ, "minProperties": 1}, '{"a": 1}', "{}"),
    "maxProperties": ({**OBJ, "maxProperties": 1}, '{"a": 1}', '{"a": 1, "b": "x"}'),
    "items": ({"type": "array", "items": {"type": "integer"}}, "[1]", '["s"]'),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}, '[1, "a"]',
                    '["a", 1]'),
    "unevaluatedItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False}, "[1]",
                         "[1, 2]"),
    "minItems": ({"type": "array", "items": {}, "minItems": 2}, "[1, 2]", "[1]"),
    "maxItems": ({"type": "array", "items": {}, "maxItems": 1}, "[1]", "[1, 2]"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}, "[1, 1]", '["s"]'),
    "minLength": ({"type": "string", "minLength": 2}, '"ab"', '"a"'),
    "maxLength": ({"type": "string", "maxLength": 2}, '"ab"', '"abc"'),
    "pattern": ({"type": "string", "pattern": "^a+$"}, '"aa"', '"b"'),
    "format": ({"type": "string", "format": "date"}, '"2020-01-02"', '"ab"'),
    "minimum": ({"type": "number", "minimum": 1.5}, "2.5", "1.0"),
    "maximum": ({"type": "integer", "maximum": 3}, "3", "4"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, "4", "3"),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 1.5}, "1", "1.5"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "6", "4"),
}
FORMAT_EXAMPLES = {"email": ('"a@b.co"', '"ab"'), "date": ('"2020-01-02"', '"ab"'),
                   "date-time": ('"2020-01-02T10:00:00Z"', '"ab"'), "time": ('"10:00:00Z"', '"ab"'),
                   "duration": ('"P1D"', '"ab"'), "uuid": ('"123e4567-e89b-12d3-a456-426614174000"', '"ab"'),
                   "uri": ('"http://a.b/c"', '"a b"'), "uri-reference": ('"/a"', '"a b\\\\"'),
                   "uri-template": ('"/a/{b}"', '"{"'), "ipv4": ('"1.2.3.4"', '"ab"'), "ipv6": ('"::1"', '"ab"'),
                   "hostname": ('"a.b"', '"a b"'), "json-pointer": ('"/a"', '"a"'),
                   "relative-json-pointer": ('"0/a"', '"a"')}
# keyword -> (a schema using it that xgrammar compiles, a value breaking the keyword that xgrammar accepts anyway)
REFUSED_CASES = {
    "allOf": ({"allOf": [{"type": "integer"}, {"maximum": 3}]}, "4"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    "not": ({"type": "integer", "not": {"const": 1}}, "1"),
    "if": ({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}, "7"),
    "dependentRequired": ({**OBJ, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependentSchemas": ({**OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
    "dependencies": ({**OBJ, "dependencies": {"a": ["b"]}}, '{"a": 1}'),
    "uniqueItems": ({"type": "array", "items": {}, "uniqueItems": True}, "[1, 1]"),
    "contains": ({"type": "array", "items": {}, "contains": {"const": 3}}, "[1]"),
    "maxContains": ({"type": "array", "items": {}, "maxContains": 1}, None),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, "1.3"),
    "format": ({"type": "string", "format": "byte"}, '"!!"'),
    "contentEncoding": ({"type": "string", "contentEncoding": "base64"}, '"!!"'),
    "minimum": ({"minimum": 3}, "2"),
    "pattern": ({"pattern": "^a$"}, '"b"'),
    "required": ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, None),
    "maxLength": ({"type": "string", "pattern": "^a*$", "maxLength": 2}, '"aaa"'),
    "type": ({"type": "string", "enum": ["a", 1]}, "1"),
    "$ref": ({"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "type": "integer", "minimum": 3}, "2"),
    "$anchor": ({"$defs": {"A": {"$anchor": "foo", "type": "integer"}}, "$ref": "#/$defs/A"}, None),
    "#foo": ({"$defs": {"A": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}, '"s"'),
}


@pytest.mark.parametrize("keyword", sorted(ENFORCED_CASES))
def test_allowed_keywords_are_enforced_by_xgrammar(keyword: str) -> None:
    schema, good, bad = ENFORCED_CASES[keyword]
    check_schema_keywords(schema)
    g = grammar(schema)
    assert _is_grammar_accept_string(g, good) and not _is_grammar_accept_string(g, bad)


def test_every_allowed_keyword_has_a_case() -> None:
    assert set(ENFORCED_CASES) == set(ENFORCED)
    assert set(FORMAT_EXAMPLES) == set(ENFORCED_FORMATS)


@pytest.mark.parametrize("fmt", sorted(FORMAT_EXAMPLES))
def test_allowed_formats_are_enforced(fmt: str) -> None:
    good, bad = FORMAT_EXAMPLES[fmt]
    g = grammar({"type": "string", "format": fmt})
    assert _is_grammar_accept_string(g, good) and not _is_grammar_accept_string(g, bad)


@pytest.mark.parametrize("keyword", sorted(REFUSED_CASES))
def test_refused_keywords_are_named(keyword: str) -> None:
    schema, _ = REFUSED_CASES[keyword]
    with pytest.raises(ValueError, match=re.escape(keyword)):
        check_schema_keywords({"type": "object", "properties": {"x": schema}}, "schema")


@pytest.mark.parametrize("keyword", sorted(k for k, (_, bad) in REFUSED_CASES.items() if bad is not None))
def test_refused_keywords_are_ignored_by_xgrammar(keyword: str) -> None:
    schema, bad = REFUSED_CASES[keyword]
    assert _is_grammar_accept_string(grammar(schema), bad)  # the grammar lets the breaking value through


@pytest.mark.parametrize("branches, ok", [
    ([{"type": "string"}, {"type": ["integer", "null"]}], True),
    ([{"const": 1}, {"enum": [2, True]}], True),
    ([{"type": "integer"}, {"type": "number"}], False),
    ([{"const": 1}, {"type": "number"}], False),
    ([{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
      {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]}], False),
    ([{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
      {"type": "object", "properties": {"k": {"const": "b"}}}], False),  # k is optional in the second: overlap
])
def test_one_of_is_accepted_only_for_disjoint_branches(branches, ok: bool) -> None:
    if ok:
        check_schema_keywords({"oneOf": branches})
    else:
        with pytest.raises(ValueError, match="'oneOf' is not supported: branches 0 and 1 may both match"):
            check_schema_keywords({"oneOf": branches})


def test_the_error_names_the_path() -> None:
    with pytest.raises(ValueError, match=r"^schema\.properties\.a\.items: JSON-schema keyword 'not' is not supported"):
        check_schema_keywords({"type": "object", "properties": {"a": {"type": "array", "items": {"not": {}}}}})


@pytest.mark.parametrize("text, empty", [
    (r"[^\s\S]", True), (r"a[^\s\S]", True), (r"(x[^\s\S])+b", True), (r"[^\x00-\U0010ffff]", True),
    (r"[^\s\S]*", False), (r"a|[^\s\S]", False), (r"[^a]", False), ("abc", False),
])
def test_empty_regexes_are_found(text: str, empty: bool) -> None:
    g = xgr.Grammar.from_structural_tag(st.StructuralTag(format=st.RegexFormat(pattern=text)))
    assert accepts_some_text(str(g)) is not empty


@pytest.mark.parametrize("schema, empty", [
    ({**OBJ, "properties": {"a": {"type": "string", "pattern": r"[^\s\S]"}}, "required": ["a"]}, True),
    ({"type": "array", "items": {"type": "string", "pattern": r"[^\s\S]"}, "minItems": 1}, True),
    ({**OBJ, "properties": {"a": {"type": "string", "pattern": r"[^\s\S]"}}}, False),
    (OBJ, False),
])
def test_empty_schemas_are_found(schema, empty: bool) -> None:
    assert accepts_some_text(str(grammar(schema))) is not empty


def test_unknown_syntax_counts_as_accepting() -> None:
    assert accepts_some_text("root ::= ((SomethingNew<1, 2>))")


@pytest.mark.parametrize("text, match", [
    ("[" * 5000 + "]" * 5000, f"nested deeper than {MAX_JSON_DEPTH} levels"),
    ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), f"nested deeper than {MAX_JSON_DEPTH} levels"),
    ("1" * (MAX_NUMBER_CHARS + 1), f"a number of {MAX_NUMBER_CHARS + 1} characters"),
    ("[NaN]", "NaN is not a JSON number"), ("-Infinity", "-Infinity is not a JSON number"),
    ("1e999", "inf is not a JSON number"),
    ('{"a": ["\\udc00"]}', r"x\.a\[0\]: a string holds a lone UTF-16 surrogate"),
    ('{"\\ud800": 1}', "a key holds a lone UTF-16 surrogate"),
])
def test_json_limits(text: str, match: str) -> None:
    with pytest.raises(JSONLimitError, match=match):
        load_json(text, "x")


def test_json_within_limits_loads() -> None:
    deep = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert load_json(deep, "x") is not None
    assert load_json('{"a": "\\ud83d\\ude00", "n": ' + "9" * MAX_NUMBER_CHARS + "}", "x")["a"] == "\U0001F600"
    with pytest.raises(NotJSONError):
        load_json("{", "x")


def test_k3_string_arguments_hold_min_and_max_length() -> None:
    from grammar_drive import generate
    from grammar_tokenizer import TinyTokenizer
    from rocm_k3.formats.parsers import parse_output
    from rocm_k3.structured import GrammarRejectedError, StructuredCompiler, StructuredOutputs, tool_call_constraint

    tok = TinyTokenizer("kimi_k3")
    compiler = StructuredCompiler(tok, "kimi_k3")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string", "minLength": 3, "maxLength": 5}}, "required": ["s"]}}}]
    spec = StructuredOutputs(tools=tool_call_constraint(tools, "required"))

    def accepts(value: str) -> bool:
        state = compiler.new_state(spec, thinking=False)
        text = (f'<|open|>call tool="f" index="1"<|sep|><|open|>argument key="s" type="string"<|sep|>{value}'
                "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>")
        try:
            for t in tok.encode(text):
                state.accept(t)
        except GrammarRejectedError:
            return False
        return state.is_completed

    assert [accepts(v) for v in ("ab", "abc", "a b\nc", "abcde", "abcdef", "<ab")] == [False, True, True, True,
                                                                                       False, False]
    for seed in range(4):
        ids = generate(compiler.new_state(spec, thinking=False), compiler.vocab_size, seed=seed)
        calls = parse_output("kimi_k3", tok.decode(ids), thinking=False, tools=tools, tool_choice="required").tool_calls
        assert calls and all(3 <= len(json.loads(c.arguments_json)["s"]) <= 5 for c in calls)
