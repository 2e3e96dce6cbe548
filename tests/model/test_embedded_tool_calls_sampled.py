"""Nothing lost under sampling: the embedded model at temperature 1 with ``get_weather`` declared
(``tool_choice="auto"``), many seeds in one batch, its completions parsed whole and streamed.

The sampled model writes well-formed calls, calls to the undeclared ``get_time``, and broken markup (a block
never closed, markup inside a value, a call cut off by ``max_tokens``). For every seed:

- a returned call is to the declared function, its arguments a JSON object whose values hold no markup, and
  they are exactly the values the model wrote between the argument markers;
- a call the model started that is not returned keeps its text in the content (the markers removed);
- streamed (split at every character), the deltas add up to the whole parse, and each returned call's pieces
  concatenate to its arguments; ``finish_reason`` is "tool_calls" exactly when calls came back.

The seeds include the shape once returned as a call with ``{}`` arguments (seed 6: an argument block never
closed) and a call cut off by ``max_tokens`` (seed 4).
"""

from __future__ import annotations

import json
import random
import re

import pytest
from model_fixtures import one_thread  # noqa: F401 (autouse)

import rocm_k3
from rocm_k3.engine.chat import ChatRequest, chat_finish_reason
from rocm_k3.formats.parsers import StreamParser, merge_deltas
from rocm_k3.formats.parsers.kimi_k3 import SPECIALS
from rocm_k3.model.tiny import EMBEDDED_DIR
from rocm_k3.training.chats import CITIES, WEATHER_TOOL, weather_question

SEEDS = range(8)  # measured: 3 calls, 2 undeclared get_time, 1 unclosed block, 1 cut off, 1 no call
CALL_OPEN = "<|open|>call"


@pytest.fixture(scope="module")
def sampled():
    llm = rocm_k3.LLM(EMBEDDED_DIR, dtype="float32", backend="reference")
    rng = random.Random(17)
    prepared, params = [], []
    for seed in SEEDS:
        question = weather_question(rng.choice(CITIES), rng)
        chat = llm.frontend.prepare_chat(ChatRequest([{"role": "user", "content": question}], tools=[WEATHER_TOOL],
                                                     tool_choice="auto"))
        prepared.append(chat)
        params.append(chat.sampling(rocm_k3.SamplingParams(temperature=1.0, seed=seed, max_tokens=240)))
    outs = llm.generate([p.prompt_token_ids for p in prepared], params)
    return list(zip(prepared, outs))


def _specials(value) -> bool:
    if isinstance(value, str):
        return any(s in value for s in SPECIALS)
    if isinstance(value, dict):
        return any(_specials(k) or _specials(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_specials(v) for v in value)
    return False


def test_sampled_calls_are_well_formed_or_kept_as_content(sampled) -> None:
    seen = {"calls": 0, "kept": 0}
    for seed, (prepared, out) in zip(SEEDS, sampled):
        whole = prepared.parse(out.text)
        where = (seed, out.text, whole)
        for call in whole.tool_calls:
            assert call.name == "get_weather", where  # never a call to a function the request did not declare
            args = json.loads(call.arguments_json)
            assert isinstance(args, dict) and not _specials(args), where
            # exactly what the model wrote: the call's text is its header, these argument blocks, its close
            blocks = "".join(f'<|open|>argument key="{k}" type="string"<|sep|>{v}<|close|>argument<|sep|>'
                             for k, v in args.items())
            assert re.search(r'<\|open\|>call tool="get_weather" index="\d+"<\|sep\|>' + re.escape(blocks)
                             + re.escape("<|close|>call<|sep|>"), out.text), where
            seen["calls"] += 1
        n_started = out.text.count(CALL_OPEN)
        if n_started > len(whole.tool_calls):  # a started call that did not come back keeps its text
            assert whole.content and 'tool="' in whole.content, where
            assert not any(s in whole.content for s in ("<|open|>call", "<|close|>call", "<|close|>argument")), where
            seen["kept"] += 1
        reason = chat_finish_reason(out.finish_reason, bool(whole.tool_calls))
        assert (reason == "tool_calls") == bool(whole.tool_calls) or out.finish_reason == "length", where
        # streamed, one character at a time: the same result, each call's pieces its arguments
        parser = prepared.parser()
        deltas = [parser.feed(ch) for ch in out.text] + [parser.finish()]
        assert merge_deltas(deltas) == whole, where
        pieces: dict[int, str] = {}
        for d in deltas:
            for p in d.call_deltas:
                pieces[p.index] = pieces.get(p.index, "") + p.arguments
        for call in whole.tool_calls:
            assert pieces[call.index] == call.arguments_json, where
    assert seen["calls"] >= 2 and seen["kept"] >= 3, seen  # the sample holds both shapes


def test_streamed_parser_matches_for_the_malformed_seed_shapes() -> None:
    """The two shapes the sampled model wrote that once came back as calls: an argument block that never closes
    (``{}`` arguments) and markup inside a value; both are content now, whole and streamed."""
    tools = [WEATHER_TOOL]
    for body in ('<|open|>argument key="city" type="string"<|sep|>Nepenenamgument<|sep|>',
                 '<|open|>argument key="city" type="string"<|sep|>vario<|close|>alue<|close|>argument<|sep|>'):
        text = ("t<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
                + body + "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>")
        parser = StreamParser("kimi_k3", tools=tools, tool_choice="auto")
        deltas = [parser.feed(ch) for ch in text] + [parser.finish()]
        got = merge_deltas(deltas)
        assert got.tool_calls == [] and not any(d.call_deltas for d in deltas), got
        assert got.content.startswith('tool="get_weather"') and "<|" not in got.content, got
