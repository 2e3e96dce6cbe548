"""Kimi K3 XTML parser: every rule, whole and streamed in chunks of 1, 3, 7 and whole (cases in parser_cases)."""

from __future__ import annotations

import json

import pytest

from parser_cases import K3_CASES, MSG_END, PARIS, THINK_END, TOOLS, check_case, k3_tools, stream
from rocm_k3.formats.parsers import StreamParser, parse_output


@pytest.mark.parametrize("case", K3_CASES, ids=lambda c: c.name)
def test_k3_case(case):
    check_case(case)


def test_k3_arguments_are_json():
    text = "t" + THINK_END + k3_tools(PARIS) + MSG_END
    (tc,) = parse_output("kimi_k3", text, tools=TOOLS).tool_calls
    assert json.loads(tc.arguments_json) == {"city": "Paris"}


def test_k3_53246_would_be_empty_with_a_close_only_parser():
    # the regression the fix guards: without implied closes everything is reasoning and there is no call
    text = "Calling it now.<|close|>response<|sep|>" + k3_tools(PARIS) + MSG_END
    parsed = parse_output("kimi_k3", text, tools=TOOLS)
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]
    assert "<|" not in (parsed.reasoning or "")


def test_k3_end_markers_never_streamed_into_content():
    # vLLM #51412: no chunking lets any piece of the message close / end-of-msg reach a content delta
    text = "r" + THINK_END + "<|open|>response<|sep|>All done.<|close|>response<|sep|>" + MSG_END
    for size in (1, 2, 3, 5, 7, 11, None):
        _, deltas = stream("kimi_k3", text, size, tools=TOOLS)
        for d in deltas:
            assert "<" not in (d.content or "") and "|" not in (d.content or ""), (size, d)


def test_k3_partial_marker_held_back_then_resolved():
    p = StreamParser("kimi_k3", tools=TOOLS)
    d = p.feed("thinking<|clo")
    assert d.reasoning == "thinking" and d.content is None
    d = p.feed("se|>think")
    assert d.is_empty()
    d = p.feed("<|sep|><|open|>response<|sep|>Hel")
    assert (d.reasoning, d.content) == (None, "Hel")
    d = p.feed("lo<|close|>resp")
    assert d.content == "lo"
    assert p.feed("onse<|sep|><|close|>message<|sep|>").is_empty()
    assert p.finish().is_empty()


def test_k3_not_a_marker_after_all_is_released():
    p = StreamParser("kimi_k3")
    assert p.feed("x<|close|>thi").reasoning == "x"
    assert p.feed("ng").reasoning == "<|close|>thing"  # not a marker: the held text was ordinary reasoning


def test_k3_call_emitted_whole_when_its_close_arrives():
    text = "t" + THINK_END + k3_tools(PARIS, PARIS.replace('index="1"', 'index="2"')) + MSG_END
    p = StreamParser("kimi_k3", tools=TOOLS)
    first_close = text.index("<|close|>call<|sep|>") + len("<|close|>call<|sep|>")
    seen = []
    for i, ch in enumerate(text):
        for tc in p.feed(ch).tool_calls:
            seen.append((i + 1, tc.index, tc.id, tc.name, tc.arguments_json))
    assert p.finish().is_empty()
    assert seen[0] == (first_close, 0, "call_0", "get_weather", '{"city": "Paris"}')
    assert [s[1] for s in seen] == [0, 1]


def test_k3_finished_parser_refuses_more():
    p = StreamParser("kimi_k3")
    p.finish()
    with pytest.raises(ValueError, match="finished"):
        p.feed("x")
    with pytest.raises(ValueError, match="finished"):
        p.finish()
    with pytest.raises(TypeError, match="str"):
        StreamParser("kimi_k3").feed(b"x")
