"""The OpenAI-compatible server, live: uvicorn on 127.0.0.1 (a free port) over the embedded tiny K3 model (CPU,
fp32), driven with the real ``openai`` client. Completions and chats, streaming or not, return the tokens
``LLM.generate`` returns; n=2 with a seed is reproducible; usage, logprobs and stops are right; every bad request
gets its status and an error naming the problem without disturbing a concurrent request; an engine failure turns
into 503s instead of a hang."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest

import rocm_k3
from rocm_k3.args import EngineArgs, ServerArgs
from rocm_k3.formats.parsers import parse_output
from rocm_k3.sampling_params import SamplingParams
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.server_fixtures import running_server

KEY = "test-key"
MAX_LEN = 1024
ENGINE = EngineArgs(dtype="float32", max_model_len=MAX_LEN)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


@pytest.fixture(scope="module")
def server():
    with running_server(ENGINE, ServerArgs(port=0, api_key=KEY, enable_auto_tool_choice=True,
                                           uvicorn_log_level="warning")) as srv:
        yield srv


@pytest.fixture(scope="module")
def llm():
    return rocm_k3.LLM(dtype="float32", max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key=KEY)


def _model(server) -> str:
    return server.served.names[0]


def _post(server, route: str, body: bytes | dict, key: str | None = KEY) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(server.url(route), data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _get(server, route: str, key: str | None = KEY) -> tuple[int, str]:
    req = urllib.request.Request(server.url(route), headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_models_health_and_metrics(server, client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == server.served.names and models[0].max_model_len == MAX_LEN
    assert _get(server, "/health", key=None)[0] == 200
    status, text = _get(server, "/metrics", key=None)
    assert status == 200
    for name in ("rocm_k3_requests_running", "rocm_k3_kv_blocks_free", "rocm_k3_kda_slots_free",
                 "rocm_k3_time_to_first_token_seconds_bucket", "rocm_k3_inter_token_latency_seconds_bucket",
                 "rocm_k3_prefix_cache_hit_rate", "rocm_k3_prompt_tokens_total", "rocm_k3_engine_healthy 1.0"):
        assert name in text, name


def test_completions_match_llm_generate(server, client, llm) -> None:
    prompt = "The quick brown fox"
    want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0]
    got = client.completions.create(model=_model(server), prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"return_token_ids": True})
    choice = got.choices[0]
    assert choice.token_ids == want.token_ids and choice.text == want.text
    assert choice.finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.completions.create(model=_model(server), prompt=prompt, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    assert [t for c in chunks if c.choices for t in getattr(c.choices[0], "token_ids", None) or []] == want.token_ids
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-2].choices[0].finish_reason == want.finish_reason


def test_completion_prompt_forms_and_batches(server, client, llm) -> None:
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = llm.tokenizer.encode("token ids")
    want = [o.token_ids for o in llm.generate(["first", "second", ids], p)]
    got = client.completions.create(model=_model(server), prompt=["first", "second"], max_tokens=4, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.token_ids for c in got.choices] == want[:2] and [c.index for c in got.choices] == [0, 1]
    got = client.completions.create(model=_model(server), prompt=ids, max_tokens=4, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    assert got.choices[0].token_ids == want[2] and got.choices[0].prompt_token_ids == ids


def _chat_reference(llm, max_tokens: int):
    prepared = llm.frontend.prepare_chat(rocm_k3.engine.chat.ChatRequest(MESSAGES))
    params = prepared.sampling(SamplingParams(temperature=0, max_tokens=max_tokens))
    out = llm.generate(prepared.prompt_token_ids, params)[0]
    return prepared, out, parse_output("kimi_k3", out.text, thinking=True, prompt_in_think=prepared.prompt_in_think)


def test_chat_matches_llm_generate(server, client, llm) -> None:
    prepared, want, parsed = _chat_reference(llm, 12)
    got = client.chat.completions.create(model=_model(server), messages=MESSAGES, max_tokens=12, temperature=0,
                                         extra_body={"return_token_ids": True})
    choice = got.choices[0]
    assert got.prompt_token_ids == prepared.prompt_token_ids and choice.token_ids == want.token_ids
    assert choice.message.content == parsed.content and choice.message.reasoning_content == parsed.reasoning
    assert got.usage.prompt_tokens == len(prepared.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids) and got.usage.total_tokens == got.usage.prompt_tokens + 12
    stream = client.chat.completions.create(model=_model(server), messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True})
    chunks = list(stream)
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].delta.role == "assistant"
    assert [t for d in deltas for t in (getattr(d, "token_ids", None) or [])] == want.token_ids
    reasoning = "".join(getattr(d.delta, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.delta.content or "" for d in deltas)
    assert (reasoning or None, content or None) == (parsed.reasoning, parsed.content)
    assert deltas[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12


def test_chat_without_thinking(server, client, llm) -> None:
    got = client.chat.completions.create(model=_model(server), messages=MESSAGES, max_tokens=6, temperature=0,
                                         extra_body={"chat_template_kwargs": {"thinking": False},
                                                     "return_token_ids": True})
    want = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=6), chat_template_kwargs={"thinking": False})[0]
    assert got.choices[0].token_ids == want.output.token_ids
    assert got.choices[0].message.content == want.content and want.reasoning_content is None
    assert getattr(got.choices[0].message, "reasoning_content", None) is None


def test_n2_with_a_seed_is_reproducible(server, client, llm) -> None:
    kw = dict(model=_model(server), prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=11, n=2,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    first = [c.token_ids for c in client.completions.create(**kw).choices]
    second = [c.token_ids for c in client.completions.create(**kw).choices]
    assert first == second and first[0] != first[1]
    alone = [llm.generate("Once upon a time", SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True))[0]
             .token_ids for s in (11, 12)]
    assert first == alone
    chat = client.chat.completions.create(model=_model(server), messages=MESSAGES, max_tokens=5, temperature=1.0,
                                          seed=3, n=2, extra_body={"return_token_ids": True})
    again = client.chat.completions.create(model=_model(server), messages=MESSAGES, max_tokens=5, temperature=1.0,
                                           seed=3, n=2, extra_body={"return_token_ids": True})
    assert [c.token_ids for c in chat.choices] == [c.token_ids for c in again.choices]
    assert chat.usage.completion_tokens == 10 and chat.usage.prompt_tokens == len(chat.prompt_token_ids)


def test_logprobs_match_the_engine(server, client, llm) -> None:
    want = llm.generate("log", SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True))[0]
    got = client.completions.create(model=_model(server), prompt="log", max_tokens=3, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True}).choices[0].logprobs
    assert got.token_logprobs == pytest.approx([e[t] for t, e in zip(want.token_ids, want.logprobs)], abs=1e-6)
    assert all(len(top) <= 2 for top in got.top_logprobs) and got.text_offset[0] == 0
    chat = client.chat.completions.create(model=_model(server), messages=MESSAGES, max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert len(chat) == 3 and all(len(t.top_logprobs) == 2 for t in chat)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in chat)


def test_stops_and_sampling_fields(server, client, llm) -> None:
    free = llm.generate("stop here", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_id = free.token_ids[3]
    got = client.completions.create(model=_model(server), prompt="stop here", max_tokens=12, temperature=0,
                                    extra_body={"stop_token_ids": [stop_id], "ignore_eos": True,
                                                "return_token_ids": True}).choices[0]
    assert got.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1] and got.finish_reason == "stop"
    stop_text = free.text[5:7]
    got = client.completions.create(model=_model(server), prompt="stop here", max_tokens=12, temperature=0,
                                    stop=[stop_text], extra_body={"ignore_eos": True}).choices[0]
    assert got.text == free.text[: free.text.index(stop_text)] and got.finish_reason == "stop"
    fields = dict(top_k=5, min_p=0.05, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=6, ignore_eos=True, **fields)
    want = llm.generate("fields", params)[0].token_ids
    got = client.completions.create(model=_model(server), prompt="fields", max_tokens=6, temperature=0.7, seed=1,
                                    presence_penalty=0.5, frequency_penalty=0.3, top_p=0.9,
                                    extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2,
                                                "ignore_eos": True, "return_token_ids": True}).choices[0]
    assert got.token_ids == want


def test_tokenize_and_detokenize(server, llm) -> None:
    status, body = _post(server, "/tokenize", {"prompt": "héllo <|open|>"})
    # the typed <|open|> stays bytes: 15 byte tokens
    assert status == 200 and body["tokens"] == llm.tokenizer.encode("héllo <|open|>") and body["count"] == 15
    status, body = _post(server, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and body["prompt"] == "héllo <|open|>"
    status, body = _post(server, "/tokenize", {"messages": MESSAGES})
    assert status == 200 and body["tokens"] == llm.frontend.prepare_chat(
        rocm_k3.engine.chat.ChatRequest(MESSAGES)).prompt_token_ids
    assert _post(server, "/detokenize", {"tokens": [10**6]})[0] == 400


BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "m", "prompt": "x", ', 400, None, "not valid JSON"),
    ("/v1/completions", b'[1, 2]', 400, None, "expected a JSON object"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "valid number"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    ("/v1/completions", {"prompt": "x", "top_p": 5}, 400, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "n: expected"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": [10**7]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": "x" * (MAX_LEN + 1)}, 400, "prompt", "maximum context length"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", "not supported"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404, "model", "does not exist"),
    ("/v1/completions", {}, 400, "prompt", "Field required"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "valid string"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": "x"}}, 400,
     "stream_options.include_usage", "boolean"),
    ("/v1/chat/completions", {"messages": [1]}, 400, "messages[0]", "dictionary"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "valid list"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "role"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs", "logprobs=true"),
    ("/v1/chat/completions", {"messages": MESSAGES, "reasoning_effort": "extreme"}, 400, "reasoning_effort", "extreme"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, 400, None, "strin"),
    ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"regex": "a("}}, 400, None, "regex"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, 400, "tool_choice", "tools"),
]


def _stream_in_background(server, llm, results: dict) -> threading.Thread:
    def run() -> None:
        client = server.client(api_key=KEY)
        stream = client.completions.create(model=_model(server), prompt="concurrent", max_tokens=40, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        results["ids"] = [t for c in stream if c.choices for t in getattr(c.choices[0], "token_ids", None) or []]

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_bad_requests_get_named_errors_and_leave_a_concurrent_request_alone(server, llm) -> None:
    results: dict = {}
    thread = _stream_in_background(server, llm, results)
    for route, body, status, param, words in BAD_REQUESTS:
        got, err = _post(server, route, body)
        assert got == status, (body, err)
        assert words in err["error"]["message"], (body, err)
        assert err["error"]["code"] == status and err["error"]["type"]
        if param is not None:
            assert err["error"]["param"] == param, (body, err)
    # unknown fields are accepted (and ignored)
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "not_a_field": [1]})[0] == 200
    # wrong or missing API key: 401 on every API route, /health and /metrics stay open
    for key in ("wrong-key", None):
        got, err = _post(server, "/v1/completions", {"prompt": "x"}, key=key)
        assert got == 401 and "API key" in err["error"]["message"]
        assert _get(server, "/v1/models", key=key)[0] == 401
    assert _get(server, "/health", key=None)[0] == 200
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong-key").models.list()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client(api_key=KEY).chat.completions.create(model="gpt-4", messages=MESSAGES)
    thread.join(120)
    want = llm.generate("concurrent", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].token_ids
    assert results["ids"] == want
    assert _get(server, "/health", key=None)[0] == 200


def test_an_engine_failure_gives_503_not_a_hang() -> None:
    def fail_on_fifth_step(core) -> None:
        real, calls = core.executor.execute, {"n": 0}

        def flaky(step):
            calls["n"] += 1
            if calls["n"] >= 5:
                raise RuntimeError("device lost (injected)")
            return real(step)

        core.executor.execute = flaky

    with running_server(ENGINE, core_hook=fail_on_fifth_step) as srv:
        client = srv.client()
        stream = client.completions.create(model=_model(srv), prompt="x", max_tokens=50, stream=True,
                                           extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="device lost"):
            for _ in stream:
                pass
        assert _get(srv, "/health", key=None)[0] == 503
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=_model(srv), prompt="x", max_tokens=2)
        assert err.value.status_code == 503 and "device lost" in str(err.value)
        assert "rocm_k3_engine_healthy 0.0" in _get(srv, "/metrics", key=None)[1]


def test_a_client_that_leaves_a_non_streaming_request_aborts_it(server) -> None:
    steps = server.engine.stats()["steps"]
    body = json.dumps({"prompt": "abandoned", "max_tokens": 900, "extra": 1, "ignore_eos": True}).encode()
    req = urllib.request.Request(server.url("/v1/completions"), data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with pytest.raises(OSError):  # the client gives up after half a second and closes the connection
        urllib.request.urlopen(req, timeout=0.5)
    for _ in range(600):
        stats = server.engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and server.engine.num_streams == 0:
            break
        threading.Event().wait(0.05)
    assert stats["running"] == 0 and stats["free_blocks"] == stats["num_blocks"], stats
    assert stats["steps"] - steps < 600  # aborted long before its 900 tokens
