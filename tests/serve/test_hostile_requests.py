"""No request body produces a 500: a table of hostile requests against one real server (the embedded tiny K3 on
127.0.0.1), each answered with its documented 4xx and a message naming the problem, while a well-formed streaming
completion runs again and again beside them and always comes back with its full tokens.

Categories (issue 31): sampling extremes, JSON-schema keywords the grammar does not enforce, invalid tool
parameter schemas (every tool_choice), grammars whose language is empty, JSON nested too deep (in the body, in
schemas, in tool-call arguments), numbers too long, lone surrogates, malformed bodies, wrong types, oversize
fields, bad image parts (nothing remote is fetched: the model has no vision tower and remote images are off).
Raw HTTP (urllib) so that bodies the openai client would never send (NaN, bad UTF-8, 10000-deep arrays) are sent.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request
from typing import NamedTuple

import pytest

from rocm_k3.args import EngineArgs, ServerArgs
from rocm_k3.formats.json_limits import MAX_JSON_DEPTH, MAX_NUMBER_CHARS
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.server_fixtures import running_server

MAX_LEN = 1024
MAX_BODY = 1 << 20
CHAT, COMP, RESP = "/v1/chat/completions", "/v1/completions", "/v1/responses"
USER = [{"role": "user", "content": "hi"}]
WELL_FORMED = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
               "stream": True, "return_token_ids": True}


def chat(**kw) -> dict:
    return {"messages": USER, "max_tokens": 2, **kw}


def comp(**kw) -> dict:
    return {"prompt": "hi", "max_tokens": 2, **kw}


def resp(**kw) -> dict:
    return {"input": "hi", "max_output_tokens": 2, **kw}


def schema(s) -> dict:
    """A chat body asking for json_schema ``s``."""
    return chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": s}})


def tool(params, choice="required", name="get") -> dict:
    return chat(tools=[{"type": "function", "function": {"name": name, "parameters": params}}], tool_choice=choice)


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


def nested_schema(depth: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(depth):
        s = {"type": "array", "items": s}
    return s


SUR = "\ud800"  # json.dumps writes it as the escape "\ud800": a lone surrogate once parsed
OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
NAMED = {"type": "function", "function": {"name": "get"}}
DEEP = f"nested deeper than {MAX_JSON_DEPTH} levels"
LONG_NUMBER = f"(the limit is {MAX_NUMBER_CHARS})"
NO_IMAGES = "this model takes no images"

class DeclaredSize(NamedTuple):
    """A body sent as headers declaring ``size`` bytes (see :func:`post_declared`)."""

    size: int


# (field, value, route): a 400 naming the field
SAMPLING_EXTREMES = [
    ("top_p", 0, CHAT), ("top_p", 1.5, COMP), ("top_k", -5, CHAT), ("min_p", 2, CHAT), ("repetition_penalty", 0, CHAT),
    ("repetition_penalty", -1, COMP), ("presence_penalty", 5, CHAT), ("frequency_penalty", -5, CHAT),
    ("max_tokens", 0, COMP), ("max_tokens", -1, CHAT), ("n", 0, CHAT), ("n", 100000, COMP), ("seed", -1, CHAT),
    ("logprobs", 100, COMP), ("stop_token_ids", [-1], CHAT),
]
# (id, route, body (dict, or raw bytes), status, substring of the error message)
CASES = [
    # -- sampling extremes ------------------------------------------------------------------------------------
    ("temperature-negative", CHAT, chat(temperature=-1), 400, "temperature"),
    ("temperature-nan", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     "NaN is not a JSON number"),
    ("temperature-overflow", COMP, b'{"prompt": "hi", "temperature": 1e999}', 400, "inf is not a JSON number"),
    *((f"{field}={value}", route, (chat if route == CHAT else comp)(**{field: value}), 400, f"{field}:")
      for field, value, route in SAMPLING_EXTREMES),
    ("top-logprobs-too-many", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("logit-bias", CHAT, chat(logit_bias={"1": 5}), 400, "logit_bias"),
    # -- JSON-schema keywords the grammar does not enforce ------------------------------------------------------
    ("schema-allOf", CHAT, schema({"allOf": [{"type": "integer"}, {"minimum": 3}]}), 400,
     "response_format.json_schema.schema: JSON-schema keyword 'allOf' is not supported"),
    ("schema-not", CHAT, schema({"type": "integer", "not": {"const": 3}}), 400, "'not'"),
    ("schema-if-then-else", CHAT, schema({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}), 400,
     "'if'"),
    ("schema-dependentSchemas", CHAT, schema({**OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}), 400,
     "'dependentSchemas'"),
    ("schema-dependentRequired", CHAT, schema({**OBJ, "dependentRequired": {"a": ["b"]}}), 400,
     "'dependentRequired'"),
    ("schema-patternProperties", CHAT, schema({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}),
     400, "'patternProperties'"),
    ("schema-oneOf", CHAT, schema({"oneOf": [{"type": "integer"}, {"type": "number"}]}), 400, "'oneOf'"),
    ("schema-uniqueItems", CHAT, schema({"type": "array", "items": {}, "uniqueItems": True}), 400, "'uniqueItems'"),
    ("schema-contains", COMP, comp(structured_outputs={"json": {"type": "array", "contains": {"const": 1}}}), 400,
     "structured_outputs.json: JSON-schema keyword 'contains'"),
    ("schema-nullable", CHAT, schema({"type": "integer", "nullable": True}), 400, "'nullable'"),
    ("schema-format-not-enforced", CHAT, schema({"type": "string", "format": "regex"}), 400, "format 'regex'"),
    ("schema-multipleOf-number", COMP, comp(guided_json={"type": "number", "multipleOf": 0.5}), 400,
     "guided_json: JSON-schema keyword 'multipleOf'"),
    ("schema-remote-ref", CHAT, schema({"$ref": "http://127.0.0.1:9/s.json"}), 400, "only local references"),
    ("schema-untyped-minimum", COMP, comp(guided_json={"minimum": 3}), 400, "'minimum'"),
    ("schema-typo-keyword", CHAT, chat(guided_json={"type": "string", "minLenght": 3}), 400, "'minLenght'"),
    ("schema-pattern-with-length", CHAT, schema({"type": "string", "pattern": "^a+$", "maxLength": 3}), 400,
     "'maxLength'"),
    ("responses-text-format-allOf", RESP, resp(text={"format": {"type": "json_schema", "name": "x", "schema": {
        "allOf": [{"type": "integer"}, {"maximum": 3}]}}}), 400, "text.format.schema: JSON-schema keyword 'allOf'"),
    # -- tool parameter schemas ---------------------------------------------------------------------------------
    ("tool-bad-type-auto", CHAT, tool({"type": "strnig"}, "auto"), 400,
     "tools[0].function.parameters.type: not a valid JSON schema (tool 'get')"),
    ("tool-bad-type-required", CHAT, tool({"type": "strnig"}), 400, "not a valid JSON schema (tool 'get')"),
    ("tool-bad-type-named", CHAT, tool({"type": "strnig"}, NAMED), 400, "not a valid JSON schema (tool 'get')"),
    ("tool-properties-list", CHAT, tool({"type": "object", "properties": []}, "auto"), 400,
     "parameters.properties: not a valid JSON schema"),
    ("tool-required-string", CHAT, tool({"type": "object", "required": "a"}), 400,
     "parameters.required: not a valid JSON schema"),
    ("tool-parameters-string", CHAT, tool("an object", "auto"), 400, "expected a JSON-schema object (tool 'get')"),
    ("tool-allOf-required", CHAT, tool({"type": "object", "properties": {"a": {"allOf": [{"type": "integer"},
                                                                                        {"minimum": 1}]}}}),
     400, "'allOf'"),
    ("tool-string-format-required", CHAT, tool({"type": "object", "properties": {"a": {
        "type": "string", "format": "email"}}}), 400, "'format' is not supported in a Kimi K3 tool call"),
    ("tool-unknown-named", CHAT, tool(OBJ, {"type": "function", "function": {"name": "nope"}}), 400,
     "function 'nope' is not in tools"),
    ("tool-no-name", CHAT, chat(tools=[{"type": "function", "function": {"parameters": OBJ}}]), 400,
     "tools[0].function.name"),
    ("responses-tool-bad-schema", RESP, resp(tools=[{"type": "function", "name": "get", "parameters": {
        "type": "object", "properties": {"a": {"type": "strnig"}}}}]), 400, "not a valid JSON schema"),
    # -- grammars whose language is empty -------------------------------------------------------------------------
    ("empty-enum", CHAT, schema({"enum": []}), 400, "enum array must not be empty"),
    ("empty-length-range", CHAT, schema({"type": "string", "minLength": 5, "maxLength": 2}), 400,
     "maxLength 2 < minLength 5"),
    ("empty-guided-choice", COMP, comp(guided_choice=[]), 400, "choice: expected a non-empty list"),
    ("empty-structured-choice", CHAT, chat(structured_outputs={"choice": []}), 400,
     "choice: expected a non-empty list"),
    ("empty-regex", COMP, comp(guided_regex="[^\\s\\S]"), 400, "accepts no text"),
    ("empty-anyOf", CHAT, schema({"anyOf": []}), 400, "an empty list accepts no value"),
    ("empty-number-range", CHAT, schema({"type": "integer", "minimum": 5, "maximum": 2}), 400,
     "minimum greater than maximum"),
    ("empty-required-unknown", CHAT, schema({**OBJ, "required": ["c"]}), 400, "'c' is not in properties"),
    ("empty-false-schema", COMP, comp(structured_outputs={"json": False}), 400, "cannot accept any value"),
    ("empty-items-range", CHAT, schema({"type": "array", "items": {}, "minItems": 5, "maxItems": 2}), 400,
     "minItems is greater than maxItems"),
    # -- nesting --------------------------------------------------------------------------------------------------
    ("body-nested-10000", CHAT, f'{{"messages": {nested(10000)}}}'.encode(), 400, DEEP),
    ("body-nested-unknown-field", COMP, f'{{"prompt": "hi", "extra": {nested(MAX_JSON_DEPTH + 5)}}}'.encode(),
     400, DEEP),
    ("schema-nested-300", CHAT, schema(nested_schema(300)), 400, DEEP),
    ("tool-arguments-nested", CHAT, chat(messages=[*USER, {"role": "assistant", "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "get", "arguments": nested(5000)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"}]), 400, DEEP),
    ("schema-text-nested", COMP, comp(structured_outputs={"json": '{"a": ' + nested(3000) + "}"}), 400, DEEP),
    # -- number sizes ------------------------------------------------------------------------------------------------
    ("max-tokens-5000-digits", CHAT, b'{"messages": [], "max_tokens": 1' + b"0" * 5000 + b"}", 400, LONG_NUMBER),
    ("float-5000-digits", COMP, b'{"prompt": "hi", "temperature": 0.' + b"1" * 5000 + b"}", 400, LONG_NUMBER),
    ("seed-30-digits", CHAT, chat(seed=10**30), 400, "seed"),
    ("top-p-30-digits", CHAT, chat(top_p=10**30), 400, "top_p"),
    ("n-30-digits", COMP, comp(n=10**30), 400, "n: expected an int in [1, 128]"),
    ("logprobs-30-digits", COMP, comp(logprobs=10**30), 400, "logprobs"),
    ("prompt-id-30-digits", COMP, comp(prompt=[10**30]), 400, "outside the vocabulary"),
    ("schema-minimum-30-digits", CHAT, schema({"type": "integer", "minimum": 10**30}), 400,
     "Integer exceeds maximum limit"),
    ("schema-maxLength-30-digits", CHAT, schema({"type": "string", "maxLength": 10**30}), 400,
     "schema.maxLength: expected an int in [0, 1000000]"),
    ("schema-enum-5000-digits", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "response_format": '
     b'{"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [1' + b"0" * 5000 + b"]}}}}", 400,
     LONG_NUMBER),
    # -- lone surrogates -------------------------------------------------------------------------------------------
    ("surrogate-message", CHAT, chat(messages=[{"role": "user", "content": "a" + SUR}]), 400,
     "request body.messages[0].content: a string holds a lone UTF-16 surrogate"),
    ("surrogate-prompt", COMP, comp(prompt=SUR + "b"), 400, "request body.prompt: a string holds a lone UTF-16"),
    ("surrogate-stop", CHAT, chat(stop=["x" + SUR]), 400, "request body.stop[0]: a string holds a lone UTF-16"),
    ("surrogate-schema", CHAT, schema({"enum": [SUR]}), 400, "lone UTF-16 surrogate"),
    ("surrogate-tool-arguments", CHAT, chat(messages=[*USER, {"role": "assistant", "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"a": "' + SUR + '"}'}}]}]), 400,
     "lone UTF-16 surrogate"),
    ("surrogate-key", COMP, comp(structured_outputs={"json": {"type": "object", "properties": {SUR: {}}}}), 400,
     "a key holds a lone UTF-16 surrogate"),
    ("surrogate-responses-input", RESP, resp(input=SUR), 400, "lone UTF-16 surrogate"),
    # -- malformed bodies ------------------------------------------------------------------------------------------
    ("body-not-json", CHAT, b'{"messages": [', 400, "request body: not valid JSON"),
    ("body-empty", COMP, b"", 400, "request body: not valid JSON"),
    ("body-array", CHAT, b"[1, 2]", 400, "request body: expected a JSON object, got list"),
    ("body-null", RESP, b"null", 400, "expected a JSON object, got NoneType"),
    ("body-bad-utf8", CHAT, b'{"messages": "\xff\xfe"}', 400, "request body: not valid JSON"),
    ("body-trailing-garbage", COMP, b'{"prompt": "hi"} x', 400, "request body: not valid JSON"),
    ("body-too-large", COMP, DeclaredSize(2 * MAX_BODY), 413, f"exceeds the limit of {MAX_BODY} bytes"),
    # -- wrong types -------------------------------------------------------------------------------------------------
    ("messages-string", CHAT, {"messages": "hi"}, 400, "messages"),
    ("messages-empty", CHAT, chat(messages=[]), 400, "messages"),
    ("role-unknown", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    ("content-int", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "content"),
    ("stream-string", CHAT, chat(stream="yes"), 400, "stream"),
    ("max-tokens-string", COMP, comp(max_tokens="ten"), 400, "max_tokens"),
    ("tools-object", CHAT, chat(tools={"a": 1}), 400, "tools"),
    ("tool-choice-int", CHAT, chat(tools=[{"type": "function", "function": {"name": "get"}}], tool_choice=5), 400,
     "tool_choice"),
    ("response-format-xml", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type"),
    ("responses-text-format-string", RESP, resp(text={"format": "json"}), 400, "text.format: expected an object"),
    ("responses-json-schema-without-schema", RESP, resp(text={"format": {"type": "json_schema", "name": "x"}}), 400,
     "text.format.schema: a JSON-schema object is required"),
    ("responses-effort-int", RESP, resp(reasoning={"effort": 5}), 400, "reasoning.effort: Input should be a valid"),
    ("detokenize-30-digits", "/detokenize", {"tokens": [10**30]}, 400, "outside the vocabulary"),
    ("tokenize-surrogate", "/tokenize", {"prompt": SUR}, 400, "request body.prompt: a string holds a lone UTF-16"),
    ("stop-ints", CHAT, chat(stop=[1, 2]), 400, "stop"),
    ("guided-json-and-regex", COMP, comp(guided_json={"type": "integer"}, guided_regex="a+"), 400,
     "give only one of structured_outputs"),
    # -- oversize fields -----------------------------------------------------------------------------------------------
    ("prompt-too-long", COMP, comp(prompt=[1] * (MAX_LEN + 10)), 400, "prompt"),
    ("messages-too-long", CHAT, chat(messages=[{"role": "user", "content": "word " * 2000}]), 400,
     f"exceed max_model_len={MAX_LEN}"),
    # -- image parts (nothing remote is fetched) -------------------------------------------------------------------
    ("image-remote-url", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}]}]), 400, NO_IMAGES),
    ("image-bad-data-url", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}]}]), 400, NO_IMAGES),
    ("image-missing-url", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "image"),
    ("responses-image-no-url", RESP, resp(input=[{"role": "user", "content": [{"type": "input_image"}]}]), 400,
     "input"),
]


# Odd but valid: answered (200), as vLLM answers them (top_k past the vocabulary = no top-k; a stop id the model
# cannot write never matches; guided_choice is vLLM's older structured-output field).
ACCEPTED = [
    ("top-k-30-digits", CHAT, chat(top_k=10**30)),
    ("stop-token-30-digits", COMP, comp(stop_token_ids=[10**30])),
    ("valid-surrogate-pair", COMP, comp(prompt="\U0001F600", stop=["\U0001F600"])),
    ("guided-choice", COMP, comp(guided_choice=["yes", "no"], max_tokens=8)),
    ("oneOf-disjoint", CHAT, schema({"oneOf": [{"type": "integer"}, {"type": "string"}]})),
    ("schema-nested-30", COMP, comp(guided_json=nested_schema(30))),
]


@pytest.fixture(scope="module")
def server():
    args = ServerArgs(port=0, enable_auto_tool_choice=True, max_request_bytes=MAX_BODY, uvicorn_log_level="warning")
    with running_server(EngineArgs(dtype="float32", max_model_len=MAX_LEN), args) as srv:
        yield srv


def post(server, route: str, body) -> tuple[int, dict]:
    if isinstance(body, DeclaredSize):
        return post_declared(server, route, body.size)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.url(route), data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def post_declared(server, route: str, size: int) -> tuple[int, dict]:
    """Headers declaring a ``size``-byte body, and no body: the server must answer from the header alone (a
    client still writing a large body when the server answers and closes would see a broken pipe instead)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.putrequest("POST", route)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(size))
        conn.endheaders()
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read() or b"{}")
    finally:
        conn.close()


def stream_tokens(server) -> list[int]:
    """The token ids of one streamed well-formed completion."""
    data = json.dumps(WELL_FORMED).encode()
    request = urllib.request.Request(server.url(COMP), data=data, headers={"Content-Type": "application/json"})
    tokens: list[int] = []
    with urllib.request.urlopen(request, timeout=120) as answer:
        for line in answer:
            line = line.strip()
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event["choices"]:
                    tokens += choice.get("token_ids") or []
    return tokens


def test_the_table_covers_every_category() -> None:
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


def test_hostile_requests_get_named_4xx_and_a_concurrent_stream_is_unharmed(server) -> None:
    want = stream_tokens(server)
    assert len(want) == WELL_FORMED["max_tokens"]
    done, runs, problems = threading.Event(), [], []

    def well_formed_loop() -> None:
        while not done.is_set():
            try:
                runs.append(stream_tokens(server))
            except Exception as exc:  # noqa: BLE001 (reported below)
                problems.append(repr(exc))
                return

    runner = threading.Thread(target=well_formed_loop, name="well-formed-stream", daemon=True)
    runner.start()
    failures = []
    for case_id, route, body, status, substring in CASES:
        got_status, answer = post(server, route, body)
        message = (answer.get("error") or {}).get("message", "")
        if got_status != status or substring not in message:
            failures.append(f"{case_id}: expected {status} with {substring!r}, got {got_status}: {message[:300]!r}")
    for case_id, route, body in ACCEPTED:
        got_status, answer = post(server, route, body)
        if got_status != 200:
            failures.append(f"{case_id}: expected 200, got {got_status}: {answer}")
        elif case_id == "guided-choice" and answer["choices"][0]["text"] not in ("yes", "no"):
            failures.append(f"{case_id}: {answer['choices'][0]['text']!r} is not a choice")
    done.set()
    runner.join(120)
    assert not failures, "\n".join(failures)
    assert not problems and runs, (problems, len(runs))
    assert all(r == want for r in runs), [len(r) for r in runs]
    assert server.engine is not None and not server.engine.is_dead
