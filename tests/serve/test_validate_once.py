"""A request is checked once at its boundary: SamplingParams is built once per server request, and the prompt
length has one check (the engine core's) with one message, on the LLM and the server paths alike."""

from __future__ import annotations

import pytest

import rocm_k3
from rocm_k3.args import EngineArgs
from rocm_k3.cache.errors import PromptTooLongError, check_prompt_length
from rocm_k3.sampling_params import SamplingParams
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.server_fixtures import running_server

MAX_LEN = 512


@pytest.fixture(scope="module")
def server():
    with running_server(EngineArgs(dtype="float32", max_model_len=MAX_LEN)) as s:
        yield s


def _count_builds(monkeypatch) -> list[int]:
    calls = [0]
    original = SamplingParams.__post_init__

    def counting(self):
        calls[0] += 1
        original(self)

    monkeypatch.setattr(SamplingParams, "__post_init__", counting)
    return calls


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_server_builds_sampling_params_once(server, monkeypatch, route):
    calls = _count_builds(monkeypatch)
    client = server.client()
    if route == "completions":
        out = client.completions.create(model=server.served.names[0], prompt="hi", max_tokens=2, seed=3)
    else:
        out = client.chat.completions.create(model=server.served.names[0], max_tokens=2, seed=3,
                                             messages=[{"role": "user", "content": "hi"}])
    assert out.choices and calls[0] == 1


def test_prompt_length_one_message_everywhere(server):
    with pytest.raises(PromptTooLongError) as direct:
        check_prompt_length(MAX_LEN + 1, MAX_LEN, "prompt")
    assert str(direct.value) == (f"prompt: {MAX_LEN + 1} tokens exceed max_model_len={MAX_LEN}, this model's "
                                 "maximum context length; reduce the length of the input")
    client = server.client()
    with pytest.raises(Exception) as http:  # openai.BadRequestError
        client.completions.create(model=server.served.names[0], prompt=[1] * (MAX_LEN + 1), max_tokens=1)
    assert getattr(http.value, "status_code", None) == 400
    assert f"{MAX_LEN + 1} tokens exceed max_model_len={MAX_LEN}" in str(http.value)
    assert server.engine.core.stats()["running"] == 0 and server.engine.core.stats()["waiting"] == 0
    llm = rocm_k3.LLM(dtype="float32", max_model_len=MAX_LEN)
    with pytest.raises(PromptTooLongError, match=f"{MAX_LEN + 1} tokens exceed max_model_len={MAX_LEN}"):
        llm.generate([[1, 2], [1] * (MAX_LEN + 1)], SamplingParams(max_tokens=1))
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=1))[0].token_ids  # the engine is clean afterwards
