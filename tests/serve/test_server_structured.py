"""Tool calls, reasoning and structured output through the live server with the real ``openai`` client, on the
embedded tiny K3 model (random weights: the grammar alone makes the outputs valid). json_schema answers validate
with and without thinking, streaming or not; regex and choice match; tool_choice "required" / named returns
parsable calls whose arguments validate; unconstrained requests batched with constrained ones get the tokens they
get alone; assistant history with tool calls and reasoning renders as the renderer renders it."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

import rocm_k3
from rocm_k3.args import EngineArgs, ServerArgs
from rocm_k3.engine.chat import ChatRequest
from rocm_k3.sampling_params import SamplingParams
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.server_fixtures import running_server

MAX_LEN = 2048
ENGINE = EngineArgs(dtype="float32", max_model_len=MAX_LEN)
USER = [{"role": "user", "content": "Give me the data."}]
NO_THINK = {"chat_template_kwargs": {"thinking": False}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": {
             "type": "object", "properties": {"host": {"enum": ["a", "b"]}}, "required": ["host"]}}}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server():
    with running_server(ENGINE, ServerArgs(port=0, enable_auto_tool_choice=True, uvicorn_log_level="warning")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _chat(server, client, **kw):
    return client.chat.completions.create(model=server.served.names[0], messages=kw.pop("messages", USER), **kw)


@pytest.mark.parametrize("thinking", [False, True], ids=["no-thinking", "thinking"])
def test_json_schema_answers_validate(server, client, thinking) -> None:
    extra = {"thinking_token_budget": 4} if thinking else dict(NO_THINK)
    got = _chat(server, client, response_format=RESPONSE_FORMAT, max_tokens=400, temperature=1.0, seed=2,
                extra_body=extra)
    choice = got.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    reasoning = getattr(choice.message, "reasoning_content", None)
    assert (reasoning is not None) == thinking
    chunks = list(_chat(server, client, response_format=RESPONSE_FORMAT, max_tokens=400, temperature=1.0, seed=2,
                        stream=True, extra_body=extra))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content  # the same seed, streamed


def test_regex_and_choice(server, client) -> None:
    got = _chat(server, client, max_tokens=60, temperature=1.0, seed=1,
                extra_body={**NO_THINK, "structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", got.choices[0].message.content)
    got = _chat(server, client, max_tokens=60, temperature=0,
                extra_body={"thinking_token_budget": 2, "structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert got.choices[0].message.content in ("red", "green", "blue")
    done = client.completions.create(model=server.served.names[0], prompt="Date:", max_tokens=40, temperature=0,
                                     extra_body={"structured_outputs": {"regex": "20[0-9]{2}-[01][0-9]"}})
    assert re.fullmatch("20[0-9]{2}-[01][0-9]", done.choices[0].text)  # a completion's text is the bare value


def _check_calls(message, names: set[str]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id and call.function.name in names
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tool_choice_required_and_named(server, client) -> None:
    got = _chat(server, client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=300,
                temperature=1.0, seed=4, extra_body=NO_THINK)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_calls(choice.message, {"get_weather", "ping"})
    named = {"type": "function", "function": {"name": "ping"}}
    got = _chat(server, client, tools=TOOLS, tool_choice=named, max_tokens=300, temperature=1.0, seed=5,
                extra_body={"thinking_token_budget": 3})
    _check_calls(got.choices[0].message, {"ping"})
    assert got.choices[0].finish_reason == "tool_calls"
    chunks = list(_chat(server, client, tools=TOOLS, tool_choice=named, max_tokens=300, temperature=1.0, seed=5,
                        stream=True, extra_body={"thinking_token_budget": 3}))
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    # streamed the vLLM way: the name first, then argument pieces that concatenate to the whole arguments
    assert [(t.index, t.function.name) for t in calls[:1]] == [(0, "ping")]
    assert all(t.index == 0 and t.function.name is None for t in calls[1:])
    assert "".join(t.function.arguments or "" for t in calls) == \
        got.choices[0].message.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_history_with_tool_calls_and_reasoning_renders_like_the_renderer(server, client) -> None:
    messages = USER + [
        {"role": "assistant", "content": "", "reasoning_content": "I should look it up.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
    ]
    got = _chat(server, client, messages=messages, tools=TOOLS, max_tokens=4, temperature=0,
                extra_body={"return_token_ids": True})
    want = server.served.frontend.prepare_chat(ChatRequest(messages, tools=TOOLS))
    assert got.prompt_token_ids == want.prompt_token_ids
    text = server.served.tokenizer.decode(got.prompt_token_ids)
    assert '<|open|>call tool="get_weather" index="1"<|sep|>' in text and "I should look it up." in text
    assert '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>{"temp_c": 18}' in text


def test_unconstrained_requests_batched_with_constrained_ones_get_their_tokens(server) -> None:
    llm = rocm_k3.LLM(dtype="float32", max_model_len=MAX_LEN)
    free = [("plain one", 0.0, None), ("seeded two", 0.9, 7)]
    want = [llm.generate(p, SamplingParams(temperature=t, seed=s, max_tokens=16, ignore_eos=True))[0].token_ids
            for p, t, s in free]
    model = server.served.names[0]

    async def main():
        client = server.async_client()
        try:
            constrained = [
                client.chat.completions.create(model=model, messages=USER, response_format=RESPONSE_FORMAT,
                                               max_tokens=200, temperature=1.0, seed=i, extra_body=NO_THINK)
                for i in range(2)]
            constrained.append(client.chat.completions.create(model=model, messages=USER, tools=TOOLS,
                                                              tool_choice="required", max_tokens=200, seed=9,
                                                              extra_body=NO_THINK))
            plain = [client.completions.create(model=model, prompt=p, max_tokens=16, temperature=t, seed=s,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
                     for p, t, s in free]
            return await asyncio.wait_for(asyncio.gather(*constrained, *plain), 300)
        finally:
            await client.close()

    results = asyncio.run(main())
    assert [r.choices[0].token_ids for r in results[3:]] == want
    for r in results[:2]:
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
