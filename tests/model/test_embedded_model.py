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
from rocm_k3.formats.parsers import parse_output
from rocm_k3.model.tiny import EMBEDDED_DIR
from rocm_k3.tokenizers.byte import embedded_byte_tokenizer
from rocm_k3.formats.k3_chat import K3ChatRenderer
from rocm_k3.training.chats import CITIES, WEATHER_TOOL, arithmetic_question, weather_question
from rocm_k3.training.corpus import CorpusConfig, build_corpus
from rocm_k3.training.loop import heldout_loss
from rocm_k3.training.params import load_params
from rocm_k3.training.prose import prose_documents, stdlib_docstrings, word_list

TRAINED = json.loads((EMBEDDED_DIR / "training.json").read_text())
UNIFORM = math.log(embedded_byte_tokenizer().vocab_size)  # 5.606 nats per token
END = "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
TOOLS_OPEN = "<|open|>tools<|sep|>"


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


def _arithmetic_outputs(llm, count: int = 6):
    renderer = K3ChatRenderer(llm.tokenizer)
    rng = random.Random(99)
    questions = [arithmetic_question(rng) for _ in range(count)]
    prompts = [renderer.render([{"role": "user", "content": q[0]}]) for q in questions]
    params = rocm_k3.SamplingParams(temperature=0, max_tokens=300, skip_special_tokens=False)
    return questions, prompts, llm.generate([p.token_ids for p in prompts], params)


def test_arithmetic_chats_close_the_response_and_stop(llm) -> None:
    """Greedy arithmetic chats: at least half answer in a response channel that closes, end the message and stop
    on ``<|end_of_msg|>`` (measured 6 of these 6; the model trained without copy drills called a tool in two)."""
    end_of_msg = llm.tokenizer.special_tokens["<|end_of_msg|>"]
    answered = 0
    for (question, _, _), prompt, out in zip(*_arithmetic_outputs(llm)):
        parsed = parse_output("kimi_k3", out.text, prompt_in_think=prompt.prompt_in_think)
        if parsed.tool_calls or TOOLS_OPEN in out.text:  # a (possibly cut-off) tool call, counted as not answered
            continue
        assert out.finish_reason == "stop" and out.token_ids[-1] == end_of_msg, (question, out.text)
        assert out.text.endswith(END), (question, out.text)
        assert parsed.reasoning and parsed.content and re.search(r"\d", parsed.content), (question, out.text)
        answered += 1
    assert answered >= 3


@pytest.mark.xfail(strict=True, reason="measured: the answers copy an operand or a nearby number but the "
                   "arithmetic is wrong (0 of these 6 right, 1 of 12 in training.json): 2.2 M parameters and "
                   "1100 CPU steps do not learn to add")
def test_arithmetic_chats_answer_the_question_asked(llm) -> None:
    for (question, _, answer), prompt, out in zip(*_arithmetic_outputs(llm)):
        parsed = parse_output("kimi_k3", out.text, prompt_in_think=prompt.prompt_in_think)
        assert not parsed.tool_calls and re.findall(r"-?\d+", answer)[-1] in (parsed.content or ""), (question,
                                                                                                      out.text)


def _weather_calls(llm, temperature: float = 1.0, count: int = 8) -> tuple[list[str], list[dict], list[str]]:
    renderer = K3ChatRenderer(llm.tokenizer)
    rng = random.Random(5)
    cities = [rng.choice(CITIES) for _ in range(count)]
    prompts = [renderer.render([{"role": "user", "content": weather_question(c, rng)}], tools=[WEATHER_TOOL])
               for c in cities]
    params = [rocm_k3.SamplingParams(temperature=temperature, seed=seed, max_tokens=320, skip_special_tokens=False)
              for seed in range(count)]
    calls = []
    outs = llm.generate([p.token_ids for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        parsed = parse_output("kimi_k3", out.text, tools=[WEATHER_TOOL], prompt_in_think=prompt.prompt_in_think)
        calls.append({c.name: json.loads(c.arguments_json) for c in parsed.tool_calls})
    return cities, calls, [o.text for o in outs]


def test_weather_questions_get_parsable_tool_calls(llm) -> None:
    """Sampled weather chats: the model writes tool calls the parser turns into JSON arguments with a string
    ``city`` (measured 7 of these 8)."""
    _, calls, texts = _weather_calls(llm)
    with_city = [c for call in calls for c in call.values() if isinstance(c.get("city"), str) and c["city"]]
    assert len(with_city) >= 4, texts


def test_weather_calls_name_the_city_asked(llm) -> None:
    """The model reads the question: its calls carry the city the user asked about, copied from the message
    (measured 4 of these 8; the model trained without copy drills named the asked city in none)."""
    cities, calls, texts = _weather_calls(llm)
    right = sum(any(args.get("city") == city for args in call.values()) for city, call in zip(cities, calls))
    assert right >= 2, texts


@pytest.mark.xfail(strict=True, reason="measured: 5 of these 8 seeds call get_weather, 2 call get_time (not "
                   "declared) with the asked city; 8 of 20 in training.json's tool_call_rate")
def test_weather_questions_mostly_call_get_weather(llm) -> None:
    _, calls, texts = _weather_calls(llm)
    called = sum(isinstance(c.get("get_weather", {}).get("city"), str) for c in calls)
    assert called >= 6, texts  # >= 75 % of the seeds


def test_training_report_is_consistent_with_the_checkpoint() -> None:
    """The recorded losses are the ones the done-criteria quote (documentation, cross-checked here)."""
    heldout = TRAINED["heldout_nats_per_token"]
    assert heldout["checkpoint"]["prose"] < 0.5 * UNIFORM and heldout["checkpoint"]["chat"] < 0.1 * UNIFORM
    assert abs(heldout["checkpoint"]["prose"] - heldout["fp32"]["prose"]) < 0.05  # MXFP4 experts cost little
    total = sum(t.numel() for t in load_params(EMBEDDED_DIR)[1].values())
    assert total == TRAINED["parameters"]


def test_greedy_chats_identical_with_prefix_caching_and_batching() -> None:
    """The trained model's greedy chat answers (real text, peaked logits, natural stops) are the same with prefix
    caching on and off, batched or one at a time; the second batch reuses the shared system prompt."""
    renderer = K3ChatRenderer(embedded_byte_tokenizer())
    rng = random.Random(21)
    system = {"role": "system", "content": "You are a helpful assistant."}
    prompts = [renderer.render([system, {"role": "user", "content": arithmetic_question(rng)[0]}]).token_ids
               for _ in range(3)]
    params = rocm_k3.SamplingParams(temperature=0, max_tokens=200)
    knobs = dict(dtype="float32", backend="reference", max_model_len=1024)
    cached = rocm_k3.LLM(EMBEDDED_DIR, enable_prefix_caching=True, **knobs)
    first = [o.token_ids for o in cached.generate(prompts[:1], params)]
    batched = first + [o.token_ids for o in cached.generate(prompts[1:], params)]
    assert cached.stats()["hit_tokens"] >= 64, cached.stats()
    plain = rocm_k3.LLM(EMBEDDED_DIR, enable_prefix_caching=False, **knobs)
    alone = [plain.generate([p], params)[0].token_ids for p in prompts]
    assert batched == alone
    end_of_msg = embedded_byte_tokenizer().special_tokens["<|end_of_msg|>"]
    assert any(len(t) < 200 and t[-1] == end_of_msg for t in alone), alone  # natural stops are compared too
