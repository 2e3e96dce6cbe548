"""StructuredOutputs / tool-call constraint validation (request-boundary errors)."""

from __future__ import annotations

import pytest

from parser_cases import TOOLS
from rocm_k3.structured import StructuredOutputs, ToolCallConstraint, ToolSchema, tool_call_constraint


def test_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(json={"type": "object"}, json_object=True)
    assert StructuredOutputs(json_object=True).kind == "json_object"
    assert StructuredOutputs(grammar='root ::= "a"').kind == "grammar"


def test_field_validation():
    assert StructuredOutputs(json='{"type": "string"}').json == {"type": "string"}
    with pytest.raises(ValueError, match="json: not valid JSON"):
        StructuredOutputs(json="{nope")
    with pytest.raises(ValueError, match="json: expected a JSON-schema object"):
        StructuredOutputs(json=[1, 2])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputs(choice="yes")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputs(choice=["a", ""])
    with pytest.raises(ValueError, match="regex"):
        StructuredOutputs(regex="")
    with pytest.raises(ValueError, match="grammar"):
        StructuredOutputs(grammar="  ")
    with pytest.raises(ValueError, match="json_object"):
        StructuredOutputs(json_object="yes")
    with pytest.raises(ValueError, match="structural_tag"):
        StructuredOutputs(structural_tag="[1]")
    with pytest.raises(ValueError, match="ToolCallConstraint"):
        StructuredOutputs(tools={"mode": "required"})
    assert StructuredOutputs(choice=["a", "b", "a"]).choice == ("a", "b")


def test_constraints_are_copies_of_the_request():
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    spec = StructuredOutputs(json=schema)
    key = spec.cache_key()
    schema["properties"]["y"] = {"type": "integer"}  # the caller mutates its dict afterwards
    assert spec.cache_key() == key and "y" not in spec.json["properties"]
    with pytest.raises(ValueError, match="json: not valid JSON"):
        StructuredOutputs(json={"type": object()})
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    constraint = tool_call_constraint(tools, "required")
    tools[0]["function"]["parameters"]["type"] = "array"
    assert constraint.tools[0].parameters == {"type": "object"}
    with pytest.raises(ValueError, match="tool name"):
        ToolSchema("", None)
    with pytest.raises(ValueError, match="parallel"):
        ToolCallConstraint((ToolSchema("a", None),), "required", parallel="yes")


def test_cache_key_is_canonical():
    a = StructuredOutputs(json={"type": "object", "properties": {"x": {"type": "string"}}})
    b = StructuredOutputs(json='{"properties": {"x": {"type": "string"}}, "type": "object"}')
    assert a.cache_key() == b.cache_key()
    assert a.cache_key() != StructuredOutputs(json_object=True).cache_key()
    assert StructuredOutputs(regex="a").cache_key() != StructuredOutputs(grammar="a").cache_key()


def test_tool_call_constraint():
    assert tool_call_constraint(TOOLS, "auto") is None
    assert tool_call_constraint(TOOLS, None) is None
    assert tool_call_constraint(TOOLS, "none") is None
    req = tool_call_constraint(TOOLS, "required")
    assert req.mode == "required" and [t.name for t in req.tools] == ["get_weather", "search"] and req.parallel
    named = tool_call_constraint(TOOLS, {"type": "function", "function": {"name": "search"}}, False)
    assert named.mode == "named" and named.tools[0].name == "search" and not named.parallel
    assert named.tools[0].parameters == TOOLS[1]["function"]["parameters"]
    with pytest.raises(ValueError, match="not in tools"):
        tool_call_constraint(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="non-empty tools"):
        tool_call_constraint([], "required")
    with pytest.raises(ValueError, match="parameters"):
        tool_call_constraint([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "required")
    with pytest.raises(ValueError, match="tool_choice"):
        tool_call_constraint(TOOLS, "sometimes")
    with pytest.raises(ValueError, match="exactly one tool"):
        ToolCallConstraint((ToolSchema("a", None), ToolSchema("b", None)), "named")
    with pytest.raises(ValueError, match="mode"):
        ToolCallConstraint((ToolSchema("a", None),), "auto")
