"""OpenAI conformance details, live (uvicorn on 127.0.0.1 over the embedded tiny K3, the real ``openai`` client):
every key of the SDK's schemas in the raw JSON (null where empty, stream chunks too), ``GET /v1/models/{id}``,
the developer role, ``echo`` with prompt logprobs and vLLM's ``prompt_logprobs``, ``/tokenize`` of a chat giving
exactly the ids generation runs, vLLM's ``guided_*`` / ``continuous_usage_stats`` / ``add_generation_prompt`` /
``continue_final_message`` extras, and ``--chat-template``."""

from __future__ import annotations

import json
import typing
import urllib.error
import urllib.request

import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

from rocm_k3.args import EngineArgs, ServerArgs
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.server_fixtures import running_server, serve_module

ENGINE = EngineArgs(dtype="float32", max_model_len=2048)
USER = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
    "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server():
    yield from serve_module(ENGINE, enable_auto_tool_choice=True)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _model(server) -> str:
    return server.served.names[0]


def _post(server, route: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(server.url(route), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _get(server, route: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(server.url(route), timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _events(text: str) -> list[dict]:
    lines = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---- the SDK's key sets -------------------------------------------------------------------------------------
def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, Union, List, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def missing_keys(model: type[BaseModel], data: dict, where: str = "$") -> list[str]:
    """Keys of ``model`` (recursively, following the values present) that ``data`` lacks."""
    out = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in data:
            out.append(f"{where}.{key}")
            continue
        candidates = _models_in(field.annotation)
        values = data[key] if isinstance(data[key], list) else [data[key]]
        for i, value in enumerate(values):
            if candidates and isinstance(value, dict):  # a union: the member it matches best
                out += min((missing_keys(m, value, f"{where}.{key}[{i}]") for m in candidates), key=len)
    return out


def _check_keys(model: type[BaseModel], data: dict, *, validate: bool = True) -> None:
    assert missing_keys(model, data) == [], data
    if validate:  # the SDK builds stream events without validation (a completion chunk's finish_reason is null)
        model.model_validate(data)


def test_every_schema_key_is_present_null_where_empty(server) -> None:
    m = _model(server)
    status, body = _post(server, "/v1/chat/completions", {"model": m, "messages": USER, "max_tokens": 4,
                                                         "logprobs": True, "top_logprobs": 2})
    assert status == 200
    data = json.loads(body)
    _check_keys(ChatCompletion, data)
    message = data["choices"][0]["message"]
    assert message["refusal"] is None and message["function_call"] is None and "logprobs" in data["choices"][0]
    # a forced tool call: content null beside tool_calls
    status, body = _post(server, "/v1/chat/completions", {"model": m, "messages": USER, "tools": TOOLS,
                                                         "tool_choice": "required", "max_tokens": 200, "temperature": 0,
                                                         "chat_template_kwargs": {"thinking": False}})
    data = json.loads(body)
    _check_keys(ChatCompletion, data)
    assert data["choices"][0]["message"]["tool_calls"] and data["choices"][0]["message"]["content"] is None
    status, body = _post(server, "/v1/chat/completions", {"model": m, "messages": USER, "tools": TOOLS,
                                                         "tool_choice": "required", "max_tokens": 200, "temperature": 0,
                                                         "stream": True, "chat_template_kwargs": {"thinking": False},
                                                         "stream_options": {"include_usage": True}})
    events = _events(body)
    for event in events:
        _check_keys(ChatCompletionChunk, event)
    assert events[1]["choices"][0]["finish_reason"] is None and events[1]["choices"][0]["logprobs"] is None
    assert any(e["choices"] and e["choices"][0]["delta"]["tool_calls"] for e in events)
    status, body = _post(server, "/v1/completions", {"model": m, "prompt": "Hi", "max_tokens": 3, "logprobs": 1})
    _check_keys(Completion, json.loads(body))
    status, body = _post(server, "/v1/completions", {"model": m, "prompt": "Hi", "max_tokens": 3, "stream": True})
    events = _events(body)
    for event in events:
        _check_keys(Completion, event, validate=False)
    assert events[0]["choices"][0]["finish_reason"] is None and events[0]["choices"][0]["logprobs"] is None
    status, card = _get(server, f"/v1/models/{m}")
    assert status == 200
    _check_keys(Model, card)
    assert card["id"] == m and card["shutdown_date"] is None
    for entry in _get(server, "/v1/models")[1]["data"]:
        _check_keys(Model, entry)


def test_model_by_id(server, client) -> None:
    assert client.models.retrieve(_model(server)).id == _model(server)
    status, body = _get(server, "/v1/models/no-such-model")
    assert status == 404 and "no-such-model" in body["error"]["message"] and body["error"]["param"] == "model"


def test_developer_role_is_system(server, client) -> None:
    def prompt(role: str) -> list[int]:
        reply = client.chat.completions.create(
            model=_model(server), max_tokens=1, messages=[{"role": role, "content": "Be brief."}] + USER,
            extra_body={"return_token_ids": True})
        return reply.prompt_token_ids

    assert prompt("developer") == prompt("system")


def test_echo_and_prompt_logprobs(server, client) -> None:
    prompt = "The quick brown fox"
    plain = client.completions.create(model=_model(server), prompt=prompt, max_tokens=3, temperature=0,
                                      logprobs=2, extra_body={"return_token_ids": True})
    echoed = client.completions.create(model=_model(server), prompt=prompt, max_tokens=3, temperature=0,
                                       logprobs=2, echo=True, extra_body={"return_token_ids": True,
                                                                          "prompt_logprobs": 1})
    choice, base = echoed.choices[0], plain.choices[0]
    assert choice.text == prompt + base.text
    ids = choice.prompt_token_ids
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + len(base.token_ids) and lp.tokens[len(ids):] == base.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.token_logprobs[len(ids):] == pytest.approx(base.logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset[len(ids)] == len(prompt)
    # vLLM's prompt_logprobs: null first, then {id: {logprob, rank, decoded_token}} with the prompt token in it
    plp = choice.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for k in range(1, len(ids)):
        entry = plp[k][str(ids[k])]
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[k], abs=1e-6) and entry["rank"] >= 1
        assert entry["decoded_token"] == lp.tokens[k]
    # streamed: the prompt (and its logprobs) come in the choice's first chunk
    chunks = list(client.completions.create(model=_model(server), prompt=prompt, max_tokens=3, temperature=0,
                                            logprobs=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None and first.tokens[: len(ids)] == lp.tokens[: len(ids)]
    # max_tokens 0 with echo: the prompt alone, scored (how evaluation harnesses use it), streamed or not
    scored = client.completions.create(model=_model(server), prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    part = scored.choices[0]
    assert part.text == prompt and part.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert part.logprobs.token_logprobs == pytest.approx(lp.token_logprobs[: len(ids)], abs=1e-5)
    chunks = list(client.completions.create(model=_model(server), prompt=prompt, max_tokens=0, logprobs=1, echo=True,
                                            stream=True))
    assert [c.choices[0].text for c in chunks] == [prompt] and chunks[0].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="max_tokens: 0 is only allowed with echo"):
        client.completions.create(model=_model(server), prompt=prompt, max_tokens=0)
    # echo without logprobs: only the text
    bare = client.completions.create(model=_model(server), prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert bare.choices[0].text == choice.text and bare.choices[0].logprobs is None
    # chat: prompt_logprobs on the response (vLLM's), one per prompt token
    reply = client.chat.completions.create(model=_model(server), messages=USER, max_tokens=1,
                                           extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    assert len(reply.prompt_logprobs) == len(reply.prompt_token_ids) and reply.prompt_logprobs[0] is None
    # streamed chat: the same prompt_logprobs once, on the first chunk with output (after the role chunk)
    chunks = list(client.chat.completions.create(model=_model(server), messages=USER, max_tokens=3, stream=True,
                                                 extra_body={"prompt_logprobs": 0}))
    carried = [i for i, c in enumerate(chunks) if getattr(c, "prompt_logprobs", None) is not None]
    assert carried == [1], [c.model_dump() for c in chunks[:3]]
    assert chunks[1].prompt_logprobs == reply.prompt_logprobs
    # streamed completion with prompt_logprobs (no echo): on the choice's first chunk
    chunks = list(client.completions.create(model=_model(server), prompt=prompt, max_tokens=3, temperature=0,
                                            stream=True, extra_body={"prompt_logprobs": 1}))
    carried = [i for i, c in enumerate(chunks) if getattr(c.choices[0], "prompt_logprobs", None) is not None]
    assert carried == [0] and chunks[0].choices[0].prompt_logprobs == plp


def test_tokenize_chat_is_the_generation_prompt(server, client) -> None:
    """/tokenize and the chat API share one rendering function: the same ids for the same request."""
    cases = [
        {"messages": USER, "tools": TOOLS, "tool_choice": "required"},
        {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
            "name": "w", "schema": {"type": "object", "properties": {"t": {"type": "number"}}}}}},
        {"messages": USER, "chat_template_kwargs": {"thinking": False}, "reasoning_effort": "low"},
        {"messages": [{"role": "developer", "content": "Be brief."}] + USER, "tools": TOOLS},
        {"messages": USER + [{"role": "assistant", "content": "It is"}], "add_generation_prompt": False,
         "continue_final_message": True},
    ]
    for case in cases:
        status, body = _post(server, "/tokenize", {"model": _model(server), **case})
        assert status == 200, body
        tokens = json.loads(body)["tokens"]
        reply = client.chat.completions.create(model=_model(server), max_tokens=1, **{
            k: v for k, v in case.items() if k in ("messages", "tools", "tool_choice", "response_format",
                                                   "reasoning_effort")},
            extra_body={"return_token_ids": True, **{k: v for k, v in case.items() if k in (
                "chat_template_kwargs", "add_generation_prompt", "continue_final_message")}})
        assert reply.prompt_token_ids == tokens and reply.usage.prompt_tokens == len(tokens), case
    continued = json.loads(_post(server, "/tokenize", {"messages": cases[-1]["messages"], "return_token_strs": True,
                                                      "add_generation_prompt": False,
                                                      "continue_final_message": True})[1])
    assert "".join(continued["token_strs"]).endswith("It is")
    status, body = _post(server, "/tokenize", {"messages": USER, "continue_final_message": True})
    assert status == 400 and "continue_final_message" in body and "add_generation_prompt" in body


def test_guided_fields_and_continuous_usage(server, client) -> None:
    reply = client.chat.completions.create(
        model=_model(server), messages=USER, max_tokens=16, temperature=1.0, seed=3,
        extra_body={"guided_choice": ["sunny", "rainy"], "chat_template_kwargs": {"thinking": False}})
    assert reply.choices[0].message.content in ("sunny", "rainy")
    done = client.completions.create(model=_model(server), prompt="Number: ", max_tokens=8,
                                     extra_body={"guided_regex": "[0-9]{3}"})
    assert done.choices[0].text.isdigit() and len(done.choices[0].text) == 3
    status, body = _post(server, "/v1/chat/completions", {"messages": USER, "guided_json": {"type": "object"},
                                                         "structured_outputs": {"regex": "a"}})
    assert status == 400 and "guided_json" in json.loads(body)["error"]["message"]
    status, body = _post(server, "/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]})
    assert status == 400 and json.loads(body)["error"]["param"] == "guided_regex" and "guided_choice" in body
    status, body = _post(server, "/v1/completions", {"prompt": "x", "guided_choice": []})
    assert status == 400 and json.loads(body)["error"]["param"] == "guided_choice"
    chunks = list(client.completions.create(model=_model(server), prompt="Hi", max_tokens=4, stream=True,
                                            stream_options={"continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4 and all(c.usage.prompt_tokens == 2 for c in chunks)
    chat = list(client.chat.completions.create(model=_model(server), messages=USER, max_tokens=3, stream=True,
                                               stream_options={"include_usage": True,
                                                               "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chat) and chat[-1].usage.completion_tokens == 3


def test_chat_template_flag(tmp_path) -> None:
    """--chat-template FILE replaces the checkpoint's format (sandboxed Jinja); a bad one fails the start."""
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    with running_server(ENGINE, ServerArgs(port=0, chat_template=str(template),
                                           uvicorn_log_level="warning")) as srv:
        status, body = _post(srv, "/tokenize", {"messages": [{"role": "developer", "content": "Hi"}],
                                                "return_token_strs": True})
        assert status == 200 and "".join(json.loads(body)["token_strs"]) == "[system] Hi\n[assistant] "
        reply = srv.client().chat.completions.create(model=srv.served.names[0], max_tokens=2,
                                                     messages=[{"role": "user", "content": "Hi"}],
                                                     extra_body={"return_token_ids": True})
        assert srv.served.tokenizer.decode(reply.prompt_token_ids) == "[user] Hi\n[assistant] "
    with pytest.raises(ValueError, match="chat_template: cannot read"):
        ServerArgs(chat_template=str(tmp_path / "missing.jinja"))
    unsafe = tmp_path / "unsafe.jinja"
    unsafe.write_text("{{ ''.__class__.__mro__ }}")
    with running_server(ENGINE, ServerArgs(port=0, chat_template=str(unsafe), uvicorn_log_level="warning")) as srv:
        status, body = _post(srv, "/tokenize", {"messages": USER})
        assert status == 400 and "unsafe" in body
