"""Broken tool markup, generated: well-formed K3 and K2 calls with a marker dropped into them, a span deleted, or
the text cut off, parsed whole and in random splits.

Whatever the damage, a returned call names a declared function and its arguments are a JSON object with no
markup in any key or value; the split parse equals the whole; each returned call's streamed pieces concatenate
to its arguments and no other call's pieces join them; a broken call's text is never lost (each argument value
the turn holds comes back in a call or in the text).
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from parser_cases import IM_END, MSG_END, SEC_B, SEC_E, THINK_END, TOOLS, k2_call, k3_arg, k3_call, k3_tools
from rocm_k3.formats.parsers import StreamParser, merge_deltas, parse_output
from rocm_k3.formats.parsers.kimi_k2 import KIMI_K2
from rocm_k3.formats.parsers.kimi_k2 import CALL_MARKUP as K2_SPECIALS
from rocm_k3.formats.parsers.kimi_k3 import KIMI_K3
from rocm_k3.formats.parsers.kimi_k3 import SPECIALS as K3_SPECIALS

K3_BODY = k3_tools(k3_call("search", k3_arg("query", "string", "rocm kernels") + k3_arg("limit", "integer", "5")),
                   k3_call("get_weather", '<|open|>json<|sep|>{"city": "Oslo"}<|close|>json<|sep|>', 2))
K2_BODY = SEC_B + k2_call("functions.search:0", '{"query": "rocm kernels", "limit": 5}') \
    + k2_call("functions.get_weather:1", '{"city": "Oslo"}') + SEC_E
FAMILIES = {
    "kimi_k3": ("t" + THINK_END, K3_BODY, MSG_END, K3_SPECIALS + ("<|close|>argument<|sep|>", "<|open|>call")),
    "kimi_k2": ("t</think>", K2_BODY, IM_END, K2_SPECIALS),
}
DECLARED = {t["function"]["name"] for t in TOOLS}


def _markup(value) -> bool:
    if isinstance(value, str):
        return any(s in value for fam in FAMILIES.values() for s in fam[3])
    if isinstance(value, dict):
        return any(_markup(k) or _markup(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_markup(v) for v in value)
    return False


@st.composite
def damaged(draw):
    family = draw(st.sampled_from(sorted(FAMILIES)), label="family")
    head, body, end, markers = FAMILIES[family]
    kind = draw(st.sampled_from(["insert", "delete", "cut"]), label="kind")
    at = draw(st.integers(0, len(body)), label="at")
    if kind == "insert":
        body = body[:at] + draw(st.sampled_from(markers), label="marker") + body[at:]
    elif kind == "delete":
        body = body[:at] + body[at + draw(st.integers(1, 12), label="span"):]
    else:
        body, end = body[:at], ""
    return family, head + body + end, kind


@settings(max_examples=400, deadline=None)
@given(case=damaged(), data=st.data())
def test_damaged_calls_never_come_back_malformed(case, data):
    family, text, kind = case
    whole = parse_output(family, text, tools=TOOLS, tool_choice="auto")
    for call in whole.tool_calls:
        assert call.name in DECLARED, (text, whole)
        args = json.loads(call.arguments_json)
        assert isinstance(args, dict) and not _markup(args), (text, whole)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=30), label="cuts")))
    parser = StreamParser(family, tools=TOOLS, tool_choice="auto")
    bounds = [0, *cuts, len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
    assert merge_deltas(deltas) == whole, text
    pieces: dict[int, str] = {}
    for d in deltas:
        for p in d.call_deltas:
            assert (p.id is not None) == (p.index not in pieces), (text, d)  # the first piece of an index names it
            pieces[p.index] = pieces.get(p.index, "") + p.arguments
    for call in whole.tool_calls:
        assert pieces.get(call.index) == call.arguments_json, (text, pieces, whole)
    turn = text  # the message ends at its first end marker: what follows is not part of it
    for end in (KIMI_K3 if family == "kimi_k3" else KIMI_K2).markers.ends:
        turn = turn.split(end)[0]
    kept = [whole.content or "", whole.reasoning or "", *(c.arguments_json for c in whole.tool_calls)]
    for value in ("rocm kernels", "Oslo"):  # nothing lost: a value the turn holds comes back somewhere
        if value in turn:
            assert any(value in k for k in kept), (text, whole)
