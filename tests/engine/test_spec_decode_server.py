"""Speculative decoding behind the real server (embedded tiny K3, CPU): streamed and whole completions with
n-gram or drafter speculation equal the non-speculative engine's greedy text, a stop string cuts the text exactly where the
non-speculative run cuts it, and /metrics reports vLLM's spec_decode counters. A chat constrained by a json_schema
response_format speculates and answers exactly what the non-speculative engine answers."""

from __future__ import annotations

import re
import urllib.request

import pytest

from rocm_k3.args import EngineArgs
from rocm_k3.engine.llm import LLM
from rocm_k3.sampling_params import SamplingParams
from tests.server_fixtures import running_server

PROMPT = "hello hello hello hello hello hello"
SPECS = {"ngram": '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}',
         "draft_model": '{"method": "draft_model", "model": "embedded-drafter", "num_speculative_tokens": 4}'}


@pytest.fixture(scope="module")
def reference():
    llm = LLM(dtype="float32", device="cpu", max_model_len=256)
    try:
        yield llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].text
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", sorted(SPECS))
def test_server_with_speculation_streams_the_greedy_text(reference, method):
    args = EngineArgs(dtype="float32", device="cpu", max_model_len=256, speculative_config=SPECS[method])
    with running_server(args) as server:
        client = server.client()
        model = server.served.names[0]
        kw = dict(model=model, prompt=PROMPT, max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**kw).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
        assert whole == reference and streamed == reference
        stop = reference[len(reference) // 2 : len(reference) // 2 + 3]
        cut = client.completions.create(stop=[stop], **kw).choices[0]
        assert cut.text == reference[: reference.index(stop)] and cut.finish_reason == "stop"
        with urllib.request.urlopen(server.url("/metrics"), timeout=60) as resp:
            text = resp.read().decode()
        drafted = float(re.search(r"^rocm_k3_spec_decode_num_draft_tokens_total (\S+)$", text, re.M).group(1))
        accepted = float(re.search(r"^rocm_k3_spec_decode_num_accepted_tokens_total (\S+)$", text, re.M).group(1))
        assert drafted > 0 and 0 < accepted <= drafted
        assert 'rocm_k3_spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text


SCHEMA = {"type": "object", "properties": {"word": {"enum": ["hello", "world"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["word", "count"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": PROMPT}]
NO_THINK = {"thinking": False}
CHAT_LEN = 1024  # the rendered chat takes ~550 tokens


@pytest.fixture(scope="module")
def chat_reference():
    llm = LLM(dtype="float32", device="cpu", max_model_len=CHAT_LEN)
    try:
        yield llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24), response_format=RESPONSE_FORMAT,
                       chat_template_kwargs=NO_THINK)[0].content
    finally:
        llm.shutdown()


def test_server_with_speculation_answers_a_json_schema_chat_exactly(chat_reference):
    """tool_choice and the other constraints: the engine-level identity tests (test_spec_decode_constrained)."""
    args = EngineArgs(dtype="float32", device="cpu", max_model_len=CHAT_LEN, speculative_config=SPECS["ngram"])
    with running_server(args) as server:
        client = server.client()
        got = client.chat.completions.create(model=server.served.names[0], messages=MESSAGES, max_tokens=24,
                                             temperature=0, response_format=RESPONSE_FORMAT,
                                             extra_body={"chat_template_kwargs": NO_THINK}).choices[0].message
        assert got.content == chat_reference
        assert got.content.startswith("{")
        with urllib.request.urlopen(server.url("/metrics"), timeout=60) as resp:
            text = resp.read().decode()
        drafted = float(re.search(r"^rocm_k3_spec_decode_num_draft_tokens_total (\S+)$", text, re.M).group(1))
        assert drafted > 0  # the constrained request was verified in chunks
