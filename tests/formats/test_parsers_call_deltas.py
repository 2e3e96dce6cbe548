"""Streamed tool calls the vLLM way (``ParsedDelta.call_deltas``): for every parser case and random splits, each
call's first piece carries its id and name, and its pieces concatenate exactly to the final ``arguments_json``;
multi-field arguments arrive in more than one piece, for K3 (typed argument blocks and json blocks) and K2."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from parser_cases import ALL_CASES, K3_CASES, MSG_END, THINK_END, TOOLS, k2_call, k3_arg, k3_call, k3_tools
from rocm_k3.formats.parsers import StreamParser


def _feed(family: str, text: str, cuts: list[int], **options):
    parser = StreamParser(family, **options)
    bounds = [0, *sorted(set(cuts)), len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
    calls = [c for d in deltas for c in d.tool_calls]
    pieces = [p for d in deltas for p in d.call_deltas]
    return calls, pieces


def _check(calls, pieces, declared: set[str] | None) -> dict[int, list]:
    by_index: dict[int, list] = {}
    for p in pieces:
        by_index.setdefault(p.index, []).append(p)
    for call in calls:
        if declared is not None and call.name not in declared:
            assert call.index not in by_index  # an undeclared function is never streamed
            continue
        got = by_index[call.index]
        assert got[0].id == call.id and got[0].name == call.name
        assert all(p.id is None and p.name is None for p in got[1:])
        assert "".join(p.arguments for p in got) == call.arguments_json
    return by_index


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_call_pieces_concatenate_to_the_final_arguments(data):
    case = data.draw(st.sampled_from(ALL_CASES), label="case")
    cuts = data.draw(st.lists(st.integers(0, len(case.text)), max_size=min(len(case.text), 40)), label="cuts")
    calls, pieces = _feed(case.family, case.text, cuts, **case.options)
    tools = case.options.get("tools")
    _check(calls, pieces, {t["function"]["name"] for t in tools} if tools else None)


SEARCH_K3 = k3_call("search", k3_arg("query", "string", "rocm kernels") + k3_arg("limit", "integer", "5"), 0)
SEARCH_K3_JSON = k3_call("search", '<|open|>json<|sep|>{"query": "rocm", "limit": 5}<|close|>json<|sep|>', 0)
SEARCH_K2 = k2_call("functions.search:0", '{"query": "rocm kernels", "limit": 5}')


def _per_char(family: str, text: str):
    return _feed(family, text, list(range(len(text))), tools=TOOLS, tool_choice="auto")


def test_k3_multi_field_arguments_stream_in_several_pieces():
    for body in (SEARCH_K3, SEARCH_K3_JSON):
        calls, pieces = _per_char("kimi_k3", "ok" + THINK_END + k3_tools(body) + MSG_END)
        assert len(calls) == 1 and len(pieces) > 2, pieces
        _check(calls, pieces, {"search", "get_weather"})
    calls, pieces = _per_char("kimi_k3", "ok" + THINK_END + k3_tools(SEARCH_K3) + MSG_END)
    # the name goes out with the first argument (a call that breaks in its first argument streams nothing)
    assert [p.arguments for p in pieces] == ['{"query": "rocm kernels"', ', "limit": 5', "}"]
    assert pieces[0].name == "search" and pieces[0].id == "call_0"


def test_k2_multi_field_arguments_stream_in_several_pieces():
    calls, pieces = _per_char("kimi_k2", "ok</think><|tool_calls_section_begin|>" + SEARCH_K2
                              + "<|tool_calls_section_end|><|im_end|>")
    assert len(calls) == 1 and calls[0].id == "functions.search:0" and len(pieces) > 10, pieces
    _check(calls, pieces, {"search", "get_weather"})


def test_k3_cases_include_calls():  # the property test above really sees calls
    assert sum(len(c.expected.tool_calls) for c in K3_CASES) >= 3
