"""The committed embedded model (``rocm_k3/model/embedded/``, trained by ``rocm-k3 train-tiny``) says something.

Each test measures the committed checkpoint through the public path: ``rocm_k3.LLM`` (fp32, reference ops) on
text or on a chat rendered by ``K3ChatRenderer``, and ``parse_output("kimi_k3", ...)`` on the completion decoded
with its special tokens. The numbers recorded when it was trained are in its ``training.json`` (see
``TRAINED`` below); the tests measure smaller samples against thresholds with room for sampling noise.
"""

from __future__ import annotations

import json
import math
import random
import re

import pytest
from model_fixtures import one_thread  # noqa: F401 (autouse)

import rocm_k3
from rocm_k3.entrypoints.openai.parsers import parse_output
from rocm_k3.model.tiny import EMBEDDED_DIR
from rocm_k3.tokenizers.byte import embedded_byte_tokenizer
from rocm_k3.tokenizers.k3_chat import K3ChatRenderer
from rocm_k3.training.chats import CITIES, WEATHER_TOOL, arithmetic_question, weather_question
from rocm_k3.training.corpus import CorpusConfig, build_corpus
from rocm_k3.training.loop import heldout_loss
from rocm_k3.training.params import load_params
from rocm_k3.training.prose import prose_documents, stdlib_docstrings, word_list

TRAINED = json.loads((EMBEDDED_DIR / "training.json").read_text())
UNIFORM = math.log(embedded_byte_tokenizer().vocab_size)  # 5.606 nats per token
END = "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"


@pytest.fixture(scope="module")
def llm():
    return rocm_k3.LLM(EMBEDDED_DIR, dtype="float32", backend="reference")


@pytest.fixture(scope="module")
def docstrings():
    return stdlib_docstrings()


def test_heldout_loss_is_far_below_a_uniform_byte_model(docstrings) -> None:
    """Held-out prose (documents the training never saw) and held-out chats, through the training forward on the
    checkpoint's weights (bf16 storage, MXFP4 experts)."""
    tokenizer = embedded_byte_tokenizer()
    corpus = build_corpus(CorpusConfig(chats=1, heldout_chats=12), tokenizer, docstrings)
    prose = [r for r in corpus.heldout if r.kind == "prose"][:12]
    chats = [r for r in corpus.heldout if r.kind != "prose"]
    cfg, params = load_params(EMBEDDED_DIR)
    loss = heldout_loss(cfg, params, prose + chats, 8192, tokenizer.pad_token_id)
    assert loss["prose"] < 0.5 * UNIFORM, loss  # bits per byte < 4.04 (uniform: 8.09)
    assert loss["chat"] < 0.1 * UNIFORM, loss


def test_prose_is_mostly_dictionary_words(llm, docstrings) -> None:
    words = word_list([d.text for d in prose_documents(docstrings)])
    outs = llm.generate(["Hello", "The file", "Return the", "If the value is"],
                        rocm_k3.SamplingParams(temperature=0, max_tokens=48))
    generated = [w.lower() for o in outs for w in re.findall(r"[A-Za-z]+", o.text)[:-1]]  # last: maybe cut off
    assert len(generated) >= 20, [o.text for o in outs]
    rate = sum(w in words for w in generated) / len(generated)
    assert rate >= 0.8, (rate, [o.text for o in outs])


def test_arithmetic_chat_closes_the_response_and_stops(llm) -> None:
    renderer = K3ChatRenderer(llm.tokenizer)
    rng = random.Random(99)
    prompts = [renderer.render([{"role": "user", "content": arithmetic_question(rng)[0]}]) for _ in range(6)]
    params = rocm_k3.SamplingParams(temperature=0, max_tokens=160, skip_special_tokens=False)
    end_of_msg = llm.tokenizer.special_tokens["<|end_of_msg|>"]
    for prompt, out in zip(prompts, llm.generate([p.token_ids for p in prompts], params)):
        assert out.finish_reason == "stop" and out.token_ids[-1] == end_of_msg, out.text
        assert out.text.endswith(END), out.text
        parsed = parse_output("kimi_k3", out.text, prompt_in_think=prompt.prompt_in_think)
        assert parsed.reasoning and parsed.content and re.search(r"\d", parsed.content), out.text
        assert not parsed.tool_calls


@pytest.mark.parametrize("temperature", [1.0])
def test_weather_question_gets_a_parsable_tool_call(llm, temperature: float) -> None:
    renderer = K3ChatRenderer(llm.tokenizer)
    rng = random.Random(5)
    cities = [rng.choice(CITIES) for _ in range(8)]
    prompts = [renderer.render([{"role": "user", "content": weather_question(c, rng)}], tools=[WEATHER_TOOL])
               for c in cities]
    params = [rocm_k3.SamplingParams(temperature=temperature, seed=seed, max_tokens=200, skip_special_tokens=False)
              for seed in range(len(prompts))]
    outs = llm.generate([p.token_ids for p in prompts], params)
    called = 0
    for prompt, out in zip(prompts, outs):
        parsed = parse_output("kimi_k3", out.text, tools=[WEATHER_TOOL], prompt_in_think=prompt.prompt_in_think)
        calls = [json.loads(c.arguments_json) for c in parsed.tool_calls if c.name == "get_weather"]
        called += bool(calls) and isinstance(calls[0].get("city"), str) and bool(calls[0]["city"])
    assert called >= 6, [o.text for o in outs]  # >= 75% of the seeds


def test_training_report_is_consistent_with_the_checkpoint() -> None:
    """The recorded losses are the ones the done-criteria quote (documentation, cross-checked here)."""
    heldout = TRAINED["heldout_nats_per_token"]
    assert heldout["checkpoint"]["prose"] < 0.5 * UNIFORM and heldout["checkpoint"]["chat"] < 0.1 * UNIFORM
    assert abs(heldout["checkpoint"]["prose"] - heldout["fp32"]["prose"]) < 0.05  # MXFP4 experts cost little
    total = sum(t.numel() for t in load_params(EMBEDDED_DIR)[1].values())
    assert total == TRAINED["parameters"]
