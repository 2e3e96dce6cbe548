"""Structured output end to end on the test tokenizer: seeded random logits, masked by the grammar, sampled
until the grammar terminates; the decoded text, read back by the family's parser, satisfies the constraint.
With thinking on, random think text comes first (gated), then the think-end marker opens the grammar."""

from __future__ import annotations

import json
import random
import re

import pytest

from grammar_drive import generate, validate_json
from grammar_tokenizer import TinyTokenizer
from rocm_k3.formats.parsers import parse_output
from rocm_k3.structured import StructuredCompiler, StructuredOutputs, tool_call_constraint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOL_SCHEMAS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
                       "unit": {"enum": ["c", "f"]}, "detail": {"type": "boolean"}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
                                         "where": {"$ref": "#/$defs/place"}},
        "required": ["ids"], "$defs": {"place": {"type": "object", "properties": {"lat": {"type": "number"}},
                                                 "required": ["lat"], "additionalProperties": False}},
        "additionalProperties": False}}},
]
THINK_END = {"kimi_k3": "<|close|>think<|sep|>", "kimi_k2": "</think>"}
FAMILIES = ("kimi_k3", "kimi_k2")
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def setups():
    out = {}
    for family in FAMILIES:
        tok = TinyTokenizer(family)
        out[family] = (tok, StructuredCompiler(tok, family))
    return out


def think_prefix(tok: TinyTokenizer, family: str, seed: int, split_tag: bool = False) -> list[int]:
    """Random think text (ordinary tokens), then the family's think-end marker as tokens."""
    rng = random.Random(seed)
    words = ["so", " the", " user", " wants", " JSON", ".", " Paris", " <", "|", " think", "\n"]
    ids = tok.encode("".join(rng.choice(words) for _ in range(rng.randint(5, 30))))
    end = tok.encode(THINK_END[family])
    if split_tag and family == "kimi_k3":  # the tag name as single bytes instead of one merged token
        end = [end[0], *b"think", end[-1]]
    return ids + end


def run(setups, family, spec, seed, thinking, **parse_kw):
    tok, compiler = setups[family]
    state = compiler.new_state(spec, thinking=thinking)
    prefix = think_prefix(tok, family, seed, split_tag=seed % 2 == 1) if thinking else []
    if thinking:
        assert state.is_gated
    ids = generate(state, compiler.vocab_size, seed=seed, prefix=prefix, greedy=seed % 2 == 0)
    assert state.is_terminated and ids[-1] in tok.eos_token_ids
    assert state.num_constrained_tokens == len(ids) - len(prefix)
    text = tok.decode(ids)
    return parse_output(family, text, thinking=thinking, **parse_kw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema(setups, family, thinking, seed):
    parsed = run(setups, family, StructuredOutputs(json=SCHEMA), seed, thinking)
    validate_json(json.loads(parsed.content), SCHEMA)
    assert (parsed.reasoning is not None) == thinking


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_regex_choice_grammar_object(setups, family, thinking, seed):
    regex = r"[a-z]{2,5}-[0-9]{3}( [A-Z])?"
    assert re.fullmatch(regex, run(setups, family, StructuredOutputs(regex=regex), seed, thinking).content)
    choices = ["yes", "no", "maybe so"]
    assert run(setups, family, StructuredOutputs(choice=choices), seed, thinking).content in choices
    ebnf = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'
    content = run(setups, family, StructuredOutputs(grammar=ebnf), seed, thinking).content
    assert re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", content)
    assert isinstance(json.loads(run(setups, family, StructuredOutputs(json_object=True), seed, thinking).content),
                      dict)


def check_calls(calls, tools, names=None):
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for c in calls:
        assert c.name in (names or by_name)
        validate_json(json.loads(c.arguments_json), by_name[c.name])
    assert [c.index for c in calls] == list(range(len(calls)))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_tool_choice_required(setups, family, thinking, seed):
    spec = StructuredOutputs(tools=tool_call_constraint(TOOL_SCHEMAS, "required"))
    parsed = run(setups, family, spec, seed, thinking, tools=TOOL_SCHEMAS, tool_choice="required")
    check_calls(parsed.tool_calls, TOOL_SCHEMAS)
    if family == "kimi_k2":
        assert all(re.fullmatch(rf"functions\.{c.name}:[0-9]+", c.id) for c in parsed.tool_calls)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", SEEDS)
def test_tool_choice_named_and_single(setups, family, seed):
    named = {"type": "function", "function": {"name": "lookup"}}
    spec = StructuredOutputs(tools=tool_call_constraint(TOOL_SCHEMAS, named))
    parsed = run(setups, family, spec, seed, True, tools=TOOL_SCHEMAS, tool_choice=named)
    assert len(parsed.tool_calls) == 1
    check_calls(parsed.tool_calls, TOOL_SCHEMAS, names=["lookup"])
    single = StructuredOutputs(tools=tool_call_constraint(TOOL_SCHEMAS, "required", parallel_tool_calls=False))
    parsed = run(setups, family, single, seed, False, tools=TOOL_SCHEMAS, tool_choice="required")
    assert len(parsed.tool_calls) == 1
    check_calls(parsed.tool_calls, TOOL_SCHEMAS)


@pytest.mark.parametrize("seed", SEEDS)
def test_tool_without_parameters_takes_any_arguments(setups, seed):
    tools = [{"type": "function", "function": {"name": "ping"}}]
    for family in FAMILIES:
        spec = StructuredOutputs(tools=tool_call_constraint(tools, "required", parallel_tool_calls=False))
        parsed = run(setups, family, spec, seed, False, tools=tools, tool_choice="required")
        (c,) = parsed.tool_calls
        assert c.name == "ping" and isinstance(json.loads(c.arguments_json), dict)


def test_user_structural_tag(setups):
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "ANSWER: "}, {"type": "regex", "pattern": "[0-9]{2}"}]}}
    parsed = run(setups, "kimi_k3", StructuredOutputs(structural_tag=tag), 0, True)
    assert re.fullmatch(r"ANSWER: [0-9]{2}", parsed.content)
