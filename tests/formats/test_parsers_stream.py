"""Streaming equals whole-text parsing on random splits of every case; options and registry validation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parser_cases import ALL_CASES, TOOLS, stream_split
from rocm_k3.formats.parsers import (
    ParsedDelta,
    ParseOptions,
    StreamParser,
    family_for_model_type,
    get_family,
    merge_deltas,
    parse_output,
    resolve_family,
)
from rocm_k3.formats.parsers.stream import _CompiledTable
from rocm_k3.formats.parsers.types import State, Transition


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_splits_equal_whole(data):
    case = data.draw(st.sampled_from(ALL_CASES), label="case")
    n = len(case.text)
    cuts = data.draw(st.lists(st.integers(0, n), max_size=min(n, 40)), label="cuts")
    assert stream_split(case.family, case.text, cuts, **case.options) == case.expected


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.sampled_from([
    "a", " ", "\n", "<", "|", "<|", "<|open|>", "<|close|>", "<|sep|>", "think", "response", "tools", "call",
    ' tool="get_weather" index="1"', "argument", ' key="city" type="string"', "json", "message",
    "<|end_of_msg|>", "<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
    "functions.search:0", "<|tool_call_argument_begin|>", "{}", "<|tool_call_end|>", "<|tool_calls_section_end|>",
    "<|im_end|>", "[EOS]", "[EO"]), max_size=40), family=st.sampled_from(["kimi_k3", "kimi_k2"]),
    thinking=st.booleans(), none=st.booleans(), data=st.data())
def test_random_marker_soup_split_invariant(pieces, family, thinking, none, data):
    # arbitrary (mostly malformed) marker sequences: any split still gives the whole-text result
    text = "".join(pieces)
    opts = {"tools": TOOLS, "tool_choice": "none" if none else "auto", "thinking": thinking}
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=30))
    assert stream_split(family, text, cuts, **opts) == parse_output(family, text, **opts)


def test_merge_deltas_none_when_empty():
    assert merge_deltas([ParsedDelta(), ParsedDelta(reasoning=None, content="")]).content is None


def test_options_validation():
    with pytest.raises(ValueError, match="not in tools"):
        ParseOptions(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="required"):
        ParseOptions(tools=None, tool_choice="required")
    with pytest.raises(ValueError, match="tool_choice"):
        ParseOptions(tools=TOOLS, tool_choice="sometimes")
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        ParseOptions(tools=[{"type": "function", "function": {}}])
    with pytest.raises(ValueError, match="tools"):
        ParseOptions(tools="get_weather")
    with pytest.raises(ValueError, match="prompt_in_think"):
        ParseOptions(thinking=False, prompt_in_think=True)
    assert ParseOptions(thinking=False).prompt_in_think is False
    assert ParseOptions().prompt_in_think is True
    assert not ParseOptions(tools=TOOLS, tool_choice="none").parse_tools
    assert ParseOptions(tools=TOOLS, tool_choice="required").parse_tools


def test_registry():
    assert family_for_model_type("kimi_k3") == "kimi_k3"
    assert family_for_model_type("kimi_linear") == "kimi_k2"
    assert resolve_family("kimi_k3") == "kimi_k3"
    assert resolve_family("kimi_k3", tool_call_parser="kimi_k2") == "kimi_k2"
    assert resolve_family(None, reasoning_parser="kimi_linear") == "kimi_k2"
    assert get_family("kimi_linear").name == "kimi_k2"
    with pytest.raises(ValueError, match="different"):
        resolve_family("kimi_k3", tool_call_parser="kimi_k3", reasoning_parser="kimi_k2")
    with pytest.raises(ValueError, match="model_type"):
        resolve_family("llama")
    with pytest.raises(ValueError, match="parser family"):
        StreamParser("hermes")


def test_marker_inside_marker_rejected():
    with pytest.raises(ValueError, match="occurs inside"):
        _CompiledTable({"<a>": Transition(State.CONTENT), "x<a>y": Transition(State.END)})
