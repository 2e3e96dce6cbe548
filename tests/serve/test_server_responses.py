"""``POST /v1/responses`` on the embedded model, driven with the real ``openai`` client's ``responses.create``:
plain and streamed answers (typed events in order, numbered, their deltas adding up to the final items), the
token budget ending a response as ``incomplete``, a function tool through a call / ``function_call_output`` round
trip (by ``previous_response_id`` and by sending the items back), ``text.format`` json_schema output that
validates, the store (GET, DELETE, LRU bound) and background requests with cancel.

The module's long generations are sent at once before its first test (the ``ahead`` fixture): the engine batches
them, so the module costs about its longest request instead of their sum (greedy outputs do not depend on the
batch: tests/model/test_embedded_model.py); each test reads its own results and checks them."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from rocm_k3.args import EngineArgs, ServerArgs
from rocm_k3.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from tests.server_fixtures import running_server

ENGINE = EngineArgs(dtype="float32", max_model_len=2048)
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
NO_THINK = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def server():
    with running_server(ENGINE, ServerArgs(port=0, enable_auto_tool_choice=True, uvicorn_log_level="warning",
                                           responses_store_size=64)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def ahead(server):
    """name -> Future of each request in ``LONG``, all submitted at once (a batch for the engine)."""
    client = server.client(timeout=600)
    with ThreadPoolExecutor(len(LONG)) as pool:
        yield {name: pool.submit(request, client) for name, request in LONG.items()}


def test_plain_response_has_reasoning_and_message_items(ahead) -> None:
    got = ahead["plain"].result()
    assert got.object == "response" and got.id.startswith("resp_")
    kinds = [item.type for item in got.output]
    assert got.status in ("completed", "incomplete"), got
    assert "reasoning" in kinds, got  # thinking is on by default: the think channel is its own item
    reasoning = next(i for i in got.output if i.type == "reasoning")
    assert reasoning.content[0].text.strip()
    if got.status == "completed":
        assert got.output_text.strip() and got.incomplete_details is None
    assert got.usage.input_tokens > 0 and got.usage.output_tokens > 0
    assert got.usage.total_tokens == got.usage.input_tokens + got.usage.output_tokens


def test_token_budget_ends_incomplete_with_details(client) -> None:
    got = client.responses.create(input="Tell me about Paris.", max_output_tokens=5, temperature=0.0)
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens", got
    assert got.usage.output_tokens == 5


def test_stream_sends_typed_numbered_events_that_add_up(client, ahead) -> None:
    events = ahead["stream"].result()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    texts: dict[str, str] = {}
    for e in events:
        if e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            texts[e.item_id] = texts.get(e.item_id, "") + e.delta
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    done = [e.item.id for e in events if e.type == "response.output_item.done"]
    assert added == done == [i.id for i in final.output]
    for item in final.output:
        assert item.content[0].text == texts[item.id]
    assert "response.reasoning_text.done" in types
    # the streamed response is stored: GET returns the same body
    assert client.responses.retrieve(final.id).output == final.output


def test_stream_incomplete_event(client) -> None:
    events = list(client.responses.create(input="Hello", max_output_tokens=3, stream=True,
                                          extra_body={"ignore_eos": True}))  # sampled: no early EOS
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def _weather_call(client, **kw):
    got = client.responses.create(input="What is the weather in Paris?", tools=[WEATHER], temperature=0.0,
                                  tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=300,
                                  extra_body=NO_THINK, **kw)
    calls = [i for i in got.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather", got
    assert isinstance(json.loads(calls[0].arguments).get("city"), str)
    assert calls[0].call_id and calls[0].id.startswith("fc_")
    return got, calls[0]


def test_function_tool_round_trip_by_previous_response_id(client, ahead) -> None:
    first, call = ahead["weather_stored"].result()
    second = client.responses.create(
        previous_response_id=first.id, tools=[WEATHER], max_output_tokens=40, temperature=0.0, extra_body=NO_THINK,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}])
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    # the second prompt holds the first turn, its call and the tool's output
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_function_tool_round_trip_by_items(client, server, ahead) -> None:
    first, call = ahead["weather_unstored"].result()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)  # store=False: not kept
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "21 C and sunny"}]
    second = client.responses.create(input=items, tools=[WEATHER], max_output_tokens=40, temperature=0.0,
                                     extra_body=NO_THINK)
    assert second.status in ("completed", "incomplete")
    # the same conversation through the chat API renders the same prompt
    chat = client.chat.completions.create(
        model=server.served.names[0], max_tokens=1, tools=[{"type": "function", "function": {
            k: WEATHER[k] for k in ("name", "description", "parameters")}}], extra_body=NO_THINK,
        messages=[items[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "21 C and sunny"}])
    assert chat.usage.prompt_tokens == second.usage.input_tokens


def test_undeclared_function_call_item_is_refused(client) -> None:
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.responses.create(input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="input"):
        client.responses.create(input=[{"type": "bogus"}])


def test_json_schema_text_format_validates(ahead) -> None:
    got = ahead["json_schema"].result()
    assert got.status == "completed", got
    value = json.loads(got.output_text)
    assert set(value) == {"city", "days"} and isinstance(value["city"], str) and isinstance(value["days"], int)
    assert got.text.format.type == "json_schema"


def test_instructions_developer_role_and_metadata(client) -> None:
    got = client.responses.create(instructions="Answer briefly.", metadata={"k": "v"}, max_output_tokens=8,
                                  input=[{"role": "developer", "content": "Be kind."},
                                         {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])
    assert got.metadata == {"k": "v"} and got.instructions == "Answer briefly."
    plain = client.responses.create(input="Hi", max_output_tokens=8)
    assert got.usage.input_tokens > plain.usage.input_tokens


def test_store_get_delete_and_unknown_previous(client) -> None:
    got = client.responses.create(input="Hi", max_output_tokens=4)
    assert client.responses.retrieve(got.id).id == got.id
    client.responses.delete(got.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(got.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(input="Hi", previous_response_id=got.id)


def test_background_response_polls_and_cancels(client) -> None:
    started = client.responses.create(input="Hi", max_output_tokens=6, background=True,
                                       extra_body={"ignore_eos": True})
    assert started.status == "in_progress"
    deadline = time.monotonic() + 60
    while client.responses.retrieve(started.id).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.responses.retrieve(started.id).status == "incomplete"
    long = client.responses.create(input="Hi", max_output_tokens=900, background=True,
                                   extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(input="Hi", background=True, store=False)


def test_store_is_a_bounded_lru() -> None:
    store = ResponseStore(2)
    for k in "abc":
        store.put(k, StoredResponse({"id": k}, []))
        if k == "b":
            store.get("a")  # a is now the most recently used
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    with pytest.raises(ValueError, match="responses_store_size"):
        ResponseStore(-1)


def test_raw_events_name_their_type(server) -> None:
    body = json.dumps({"input": "Hi", "max_output_tokens": 3, "stream": True}).encode()
    request = urllib.request.Request(server.url("/v1/responses"), data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        lines = [line for line in r.read().decode().splitlines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in datas] and names[-1] == "response.incomplete"


# ---- reasoning budgets (reasoning_effort / reasoning.effort) ------------------------------------------------
TRIP = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 30}},
        "required": ["city", "days"], "additionalProperties": False}


SEEDS = range(4)


@pytest.mark.parametrize("seed", SEEDS)
def test_low_effort_budget_closes_think_so_json_follows(ahead, seed) -> None:
    """Thinking on, reasoning_effort "low", a json_schema response_format, sampled: the low budget (256 think
    tokens) closes the think channel, so valid JSON content comes back within 1,000 tokens for every seed."""
    got = ahead[f"low_effort_json_{seed}"].result()
    choice = got.choices[0]
    assert choice.finish_reason == "stop", choice
    assert choice.message.reasoning_content, choice  # it did think
    value = json.loads(choice.message.content)
    assert set(value) == {"city", "days"}


def test_responses_reasoning_effort_low_json(ahead) -> None:
    got = ahead["responses_low_effort_json"].result()
    assert got.status == "completed" and got.reasoning.effort == "low", got
    assert any(i.type == "reasoning" for i in got.output)
    assert set(json.loads(got.output_text)) == {"city", "days"}


@pytest.mark.parametrize("effort", ["none", "minimal", "low", "medium", "high"])
def test_every_openai_effort_is_accepted(client, effort) -> None:
    got = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                         reasoning_effort=effort)
    assert got.choices[0].finish_reason in ("stop", "length")


# ---- streamed tool-call arguments (chat and responses) -------------------------------------------------------
CURRENCY = {"name": "convert_currency", "description": "Convert money between currencies", "parameters": {
    "type": "object", "properties": {"amount": {"type": "number"}, "from_currency": {"type": "string"},
                                     "to_currency": {"type": "string"}},
    "required": ["amount", "from_currency", "to_currency"]}}
ASK = "Convert 20 dollars to euros."


def test_chat_stream_tool_arguments_arrive_in_pieces(ahead) -> None:
    chunks = ahead["currency_chat_stream"].result()
    pieces = [t for ch in chunks for c in ch.choices for t in c.delta.tool_calls or []]
    assert pieces and pieces[0].id and pieces[0].type == "function" and pieces[0].function.name == CURRENCY["name"]
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    assert len(pieces) > 2, pieces  # multi-field arguments: more than one argument delta
    streamed = "".join(p.function.arguments or "" for p in pieces)
    whole = ahead["currency_chat"].result()
    assert streamed == whole.choices[0].message.tool_calls[0].function.arguments
    assert set(json.loads(streamed)) == {"amount", "from_currency", "to_currency"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_stream_function_call_arguments_arrive_in_pieces(ahead) -> None:
    events = ahead["currency_responses_stream"].result()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) > 1 and "".join(deltas) == done.arguments
    final = events[-1].response.output
    call = next(i for i in final if i.type == "function_call")
    assert call.arguments == done.arguments and call.name == "convert_currency" and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"amount", "from_currency", "to_currency"}


def test_tool_call_cut_off_by_max_tokens_keeps_its_text(ahead) -> None:
    """A forced call cut off by max_tokens: no tool call, its text as content (markers removed), finish_reason
    "length"; streamed content adds up to the same text."""
    whole = ahead["currency_cut_off"].result().choices[0]
    assert whole.finish_reason == "length" and not whole.message.tool_calls, whole
    assert "convert_currency" in whole.message.content and "<|" not in whole.message.content
    chunks = ahead["currency_cut_off_stream"].result()
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


# ---- the long requests, sent ahead at once (see the module docstring) ---------------------------------------
TRIP_FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP}}
CURRENCY_CHAT = dict(model=None, messages=[{"role": "user", "content": ASK}], temperature=0.0,
                     tools=[{"type": "function", "function": CURRENCY}], extra_body=NO_THINK,
                     tool_choice={"type": "function", "function": {"name": "convert_currency"}})


def _low_effort_json(seed: int):
    return lambda client: client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "Plan a trip to Rome."}], reasoning_effort="low",
        response_format=TRIP_FORMAT, max_tokens=1000, temperature=1.0, seed=seed)


LONG = {
    "plain": lambda client: client.responses.create(model=None, input="What is 2 + 3?", max_output_tokens=200,
                                                    temperature=0.0),
    "stream": lambda client: list(client.responses.create(input="What is 4 + 4?", max_output_tokens=200,
                                                          temperature=0.0, stream=True)),
    "weather_stored": _weather_call,
    "weather_unstored": lambda client: _weather_call(client, store=False),
    "json_schema": lambda client: client.responses.create(
        input="Plan a trip to Rome.", temperature=0.0, max_output_tokens=400, extra_body=NO_THINK,
        text={"format": {"type": "json_schema", "name": "trip", "schema": TRIP, "strict": True}}),
    **{f"low_effort_json_{seed}": _low_effort_json(seed) for seed in SEEDS},
    "responses_low_effort_json": lambda client: client.responses.create(
        input="Plan a trip to Rome.", reasoning={"effort": "low"}, temperature=1.0, max_output_tokens=1000,
        extra_body={"seed": 7}, text={"format": {"type": "json_schema", "name": "trip", "schema": TRIP}}),
    "currency_chat_stream": lambda client: list(client.chat.completions.create(
        stream=True, max_tokens=300, **CURRENCY_CHAT)),
    "currency_chat": lambda client: client.chat.completions.create(max_tokens=300, **CURRENCY_CHAT),
    "currency_responses_stream": lambda client: list(client.responses.create(
        input=ASK, tools=[{"type": "function", **CURRENCY}], stream=True, temperature=0.0, max_output_tokens=300,
        tool_choice={"type": "function", "name": "convert_currency"}, extra_body=NO_THINK)),
    "currency_cut_off": lambda client: client.chat.completions.create(max_tokens=70, **CURRENCY_CHAT),
    "currency_cut_off_stream": lambda client: list(client.chat.completions.create(
        stream=True, max_tokens=70, **CURRENCY_CHAT)),
}
