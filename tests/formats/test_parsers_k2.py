"""Kimi K2 / Kimi Linear marker parser: every rule, whole and streamed in chunks of 1, 3, 7 and whole."""

from __future__ import annotations

import pytest

from parser_cases import BEIJING, IM_END, K2_CASES, SEC_B, SEC_E, TOOLS, check_case, stream
from rocm_k3.formats.parsers import StreamParser


@pytest.mark.parametrize("case", K2_CASES, ids=lambda c: c.name)
def test_k2_case(case):
    check_case(case)


def test_k2_im_end_never_streamed():
    text = "r</think>Fine." + IM_END
    for size in (1, 2, 3, 7, None):
        _, deltas = stream("kimi_k2", text, size)
        assert "".join(d.content or "" for d in deltas) == "Fine."
        assert all("<" not in (d.content or "") for d in deltas)


def test_k2_call_arrives_once_closed_with_id():
    p = StreamParser("kimi_k2", tools=TOOLS)
    text = "r</think>" + SEC_B + BEIJING + SEC_E
    close_at = text.index("<|tool_call_end|>") + len("<|tool_call_end|>")
    calls = [(i + 1, tc) for i, ch in enumerate(text) for tc in p.feed(ch).tool_calls]
    assert p.finish().is_empty()
    assert [(i, tc.id, tc.index) for i, tc in calls] == [(close_at, "functions.get_weather:0", 0)]
