"""A call that breaks after its first pieces were streamed: its pieces stay (they cannot be taken back), its
index is not reused by the next call, its text follows as content; the Responses stream ends its item
``incomplete``; without parallel calls the first call that comes back is the one streamed."""

from __future__ import annotations

import json

from parser_cases import MSG_END, THINK_END, TOOLS, k3_arg, k3_call, k3_tools
from rocm_k3.engine.chat import PreparedChat
from rocm_k3.entrypoints.openai.serving_responses import _EventWriter, _item_id, _OutputBuilder

BROKEN_THEN_GOOD = "t" + THINK_END + k3_tools(
    k3_call("search", k3_arg("query", "string", "q") + "junk"),
    k3_call("get_weather", k3_arg("city", "string", "Oslo"), 2)) + MSG_END


def _prepared(parallel: bool) -> PreparedChat:
    return PreparedChat(prompt_token_ids=[], prompt_text="", family="kimi_k3", thinking=True, prompt_in_think=True,
                        constraint=None, tools=TOOLS, tool_choice="auto", parallel_tool_calls=parallel,
                        thinking_token_budget=None)


def _deltas(prepared: PreparedChat):
    parser = prepared.parser()
    return [parser.feed(ch) for ch in BROKEN_THEN_GOOD] + [parser.finish()]


def test_chat_pieces_without_parallel_calls_follow_the_call_that_came_back() -> None:
    for parallel in (True, False):
        prepared = _prepared(parallel)
        returned, pieces = [], {}
        for d in _deltas(prepared):
            returned += prepared.allowed_calls(d.tool_calls, len(returned))
            for p in prepared.allowed_call_deltas(d.call_deltas, returned):
                pieces[p.index] = pieces.get(p.index, "") + p.arguments
        assert [(c.index, c.name) for c in returned] == [(1, "get_weather")]
        assert pieces[1] == '{"city": "Oslo"}' and pieces[0] == '{"query": "q"', pieces  # 0: the broken call


def test_responses_stream_ends_a_broken_call_incomplete() -> None:
    prepared, events = _prepared(True), _EventWriter()
    out = _OutputBuilder(events)
    sent = [e for d in _deltas(prepared) for e in out.add(d, prepared, _item_id)]
    sent += out.close() + out.end_broken_calls()
    calls = [item for item in out.items if item["type"] == "function_call"]
    assert [(c["name"], c["status"]) for c in calls] == [("search", "incomplete"), ("get_weather", "completed")]
    assert json.loads(calls[1]["arguments"]) == {"city": "Oslo"}
    message = [item for item in out.items if item["type"] == "message"]
    assert message and "junk" in message[0]["content"][0]["text"]  # the broken call's text
    done = [json.loads(e.split("data: ", 1)[1]) for e in sent if e.startswith("event: response.output_item.done")]
    assert {d["item"]["id"] for d in done} >= {c["id"] for c in calls}
