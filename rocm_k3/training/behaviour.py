"""What the trained model does when served: the measurements ``rocm-k3 train-tiny`` reports after training.

All of them go through the public path a user takes: ``rocm_k3.LLM(path).generate`` on text or on a chat
rendered by :class:`~rocm_k3.formats.k3_chat.K3ChatRenderer`, and ``parse_output("kimi_k3", ...)`` on the
completion decoded with its special tokens.

- :func:`prose_word_rate`: greedy continuations of prose prompts; the fraction of their words found in a word list;
- :func:`arithmetic_behaviour`: arithmetic chats (greedy): the completion closes its response channel, ends the
  message and stops on ``<|end_of_msg|>``; and whether the response holds the right number;
- :func:`tool_call_behaviour`: a weather question with ``get_weather`` declared, sampled with one seed per
  request: the parser finds a ``get_weather`` call with a ``city`` argument (and whether it is the asked city);
- :func:`repeat_behaviour`: "Repeat after me: <cities>" chats (greedy): the response is the text, word for word.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from rocm_k3.formats.parsers import parse_output
from rocm_k3.formats.parsers.kimi_k3 import END_OF_MSG, MESSAGE_CLOSE, RESPONSE_CLOSE
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.formats.k3_chat import K3ChatRenderer
from rocm_k3.training.chats import CITIES, WEATHER_TOOL, arithmetic_question, weather_question

PROSE_PROMPTS = ("Hello", "The file", "Return the", "This module provides", "If the value is", "An object")
MESSAGE_END = MESSAGE_CLOSE + END_OF_MSG


class WordRate(NamedTuple):
    rate: float  # dictionary words / words (the last, possibly cut-off word of each completion left out)
    words: int
    samples: tuple[str, ...]


class ArithmeticResult(NamedTuple):
    stop_rate: float  # response closed, message closed, stopped on <|end_of_msg|>
    accuracy: float  # the parsed response contains the right result
    samples: tuple[str, ...]


class RepeatResult(NamedTuple):
    rate: float  # the parsed response equals the text asked to be repeated
    samples: tuple[str, ...]


class ToolCallResult(NamedTuple):
    rate: float  # a parsable get_weather call with a city argument
    right_city_rate: float  # ... whose city is the one asked about
    samples: tuple[str, ...]


def prose_word_rate(llm: Any, words: Iterable[str], prompts: Sequence[str] = PROSE_PROMPTS,
                    max_tokens: int = 64) -> WordRate:
    vocabulary = {w.lower() for w in words}
    outs = llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens))
    found = total = 0
    for out in outs:
        generated = re.findall(r"[A-Za-z]+", out.text)
        if out.finish_reason == "length" and out.text[-1:].isalpha():
            generated = generated[:-1]
        total += len(generated)
        found += sum(w.lower() in vocabulary for w in generated)
    return WordRate(found / max(1, total), total, tuple(o.text for o in outs))


def _greedy_chats(llm: Any, questions: Sequence[str], max_tokens: int) -> tuple[list[Any], list[Any]]:
    """(rendered prompts, outputs) of one-question chats answered greedily, decoded with special tokens."""
    renderer = K3ChatRenderer(llm.tokenizer)
    prompts = [renderer.render([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, skip_special_tokens=False)
    return prompts, llm.generate([p.token_ids for p in prompts], params)


def arithmetic_behaviour(llm: Any, count: int = 12, seed: int = 1234, max_tokens: int = 300) -> ArithmeticResult:
    rng = random.Random(seed)
    drawn = [arithmetic_question(rng) for _ in range(count)]
    answers = [re.findall(r"-?\d+", answer)[-1] for _question, _think, answer in drawn]
    prompts, outs = _greedy_chats(llm, [question for question, _think, _answer in drawn], max_tokens)
    stopped = right = 0
    for prompt, out, answer in zip(prompts, outs, answers):
        closed = RESPONSE_CLOSE in out.text and out.text.endswith(MESSAGE_END)
        stopped += closed and out.finish_reason == "stop" and out.token_ids[-1] in llm.eos_token_ids
        parsed = parse_output("kimi_k3", out.text, prompt_in_think=prompt.prompt_in_think)
        right += answer in re.findall(r"-?\d+", parsed.content or "")
    return ArithmeticResult(stopped / count, right / count, tuple(o.text for o in outs))


def tool_call_behaviour(llm: Any, seeds: Sequence[int] = tuple(range(20)), temperature: float = 1.0,
                        max_tokens: int = 320) -> ToolCallResult:
    renderer = K3ChatRenderer(llm.tokenizer)
    rng = random.Random(4321)
    cities = [rng.choice(CITIES) for _ in seeds]
    prompts = [renderer.render([{"role": "user", "content": weather_question(city, rng)}], tools=[WEATHER_TOOL])
               for city in cities]
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=max_tokens, skip_special_tokens=False)
              for s in seeds]
    outs = llm.generate([p.token_ids for p in prompts], params)
    called = right = 0
    for prompt, out, city in zip(prompts, outs, cities):
        parsed = parse_output("kimi_k3", out.text, tools=[WEATHER_TOOL], prompt_in_think=prompt.prompt_in_think)
        calls = [c for c in parsed.tool_calls if c.name == "get_weather"]
        args = json.loads(calls[0].arguments_json) if calls else {}
        if isinstance(args, dict) and isinstance(args.get("city"), str) and args["city"]:
            called += 1
            right += args["city"] == city
    return ToolCallResult(called / len(seeds), right / len(seeds), tuple(o.text for o in outs))


def repeat_behaviour(llm: Any, count: int = 12, seed: int = 99, max_tokens: int = 200) -> RepeatResult:
    rng = random.Random(seed)
    texts = [", ".join(rng.sample(CITIES, rng.randint(1, 3))) for _ in range(count)]
    prompts, outs = _greedy_chats(llm, [f"Repeat after me: {text}" for text in texts], max_tokens)
    right = sum((parse_output("kimi_k3", out.text, prompt_in_think=prompt.prompt_in_think).content or "").strip()
                == text for prompt, out, text in zip(prompts, outs, texts))
    return RepeatResult(right / count, tuple(o.text for o in outs))
