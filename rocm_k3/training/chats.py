"""Generated chats in Kimi K3's XTML format: the conversations the tiny model is trained to answer.

Four kinds, drawn from a seeded ``random.Random``:

- ``arithmetic``: "What is 17 + 25?" (sums and differences below 100, products up to 12 x 12), a short think
  channel and the answer in the response channel; 1 to 3 questions per chat;
- ``units``: "How many centimetres are in 3 metres?" (lengths, masses, volumes, times), answered the same way;
- ``tool``: a question for one of :data:`TOOLS` (declared in the prompt's tools list, alone or with others), an
  assistant turn that calls it (``<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>`` with
  typed ``argument`` blocks), the tool's result message and a final answer that uses the result, sometimes a
  second such question in the same chat; some tool chats ask an arithmetic question instead, answered without a
  call;
- ``repeat``: "Repeat after me: ..." with a sentence of the prose corpus or a list of cities, answered word for
  word. Every other kind needs the model to copy from the user's message (numbers, units, cities, currencies);
  these dense copies let that ability (attention that retrieves what followed a match earlier in the context)
  form within the short training.

Chats render through the project's own :class:`~rocm_k3.formats.k3_chat.K3ChatRenderer` (thinking on with
each effort, or off), so the model sees exactly what serving sends it. :func:`render_training_chat` marks every
assistant turn (from its think or response body to ``<|end_of_msg|>``) as the target.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

from rocm_k3.formats.k3_chat import K3ChatRenderer


def _tool(name: str, description: str, properties: dict[str, dict[str, str]]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(properties)}}}


WEATHER_TOOL = _tool("get_weather", "Get the current weather in a city", {"city": {"type": "string"}})
TIME_TOOL = _tool("get_time", "Get the local time in a city", {"city": {"type": "string"}})
CURRENCY_TOOL = _tool("convert_currency", "Convert money between currencies",
                      {"amount": {"type": "number"}, "from_currency": {"type": "string"},
                       "to_currency": {"type": "string"}})
TOOLS: dict[str, dict[str, Any]] = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL,
                                    "convert_currency": CURRENCY_TOOL}

CITIES = (
    "Paris", "London", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Warsaw", "Dublin", "Oslo",
    "Stockholm", "Helsinki", "Copenhagen", "Amsterdam", "Brussels", "Zurich", "Geneva", "Athens", "Istanbul",
    "Cairo", "Nairobi", "Lagos", "Accra", "Cape Town", "Johannesburg", "Casablanca", "Tunis", "Dubai", "Doha",
    "Riyadh", "Tehran", "Karachi", "Mumbai", "Delhi", "Chennai", "Kolkata", "Dhaka", "Kathmandu", "Colombo",
    "Bangkok", "Hanoi", "Singapore", "Jakarta", "Manila", "Kuala Lumpur", "Hong Kong", "Shanghai", "Beijing",
    "Seoul", "Tokyo", "Osaka", "Taipei", "Sydney", "Melbourne", "Perth", "Auckland", "Wellington", "Honolulu",
    "Vancouver", "Toronto", "Montreal", "Chicago", "New York", "Boston", "Miami", "Denver", "Seattle",
    "Los Angeles", "San Francisco", "Houston", "Mexico City", "Havana", "Bogota", "Lima", "Quito", "Santiago",
    "Buenos Aires", "Montevideo", "Rio de Janeiro", "Reykjavik", "Edinburgh", "Munich", "Hamburg", "Milan",
    "Naples", "Barcelona", "Seville", "Porto", "Krakow", "Budapest", "Bucharest", "Sofia", "Belgrade", "Kyiv",
)
CONDITIONS = ("clear", "sunny", "cloudy", "partly cloudy", "rainy", "foggy", "windy", "snowy", "stormy")
RATES = {("USD", "EUR"): 0.92, ("EUR", "USD"): 1.09, ("USD", "GBP"): 0.79, ("GBP", "USD"): 1.27,
         ("USD", "JPY"): 151.0, ("EUR", "GBP"): 0.86, ("GBP", "EUR"): 1.17, ("USD", "CAD"): 1.36,
         ("CAD", "USD"): 0.74, ("EUR", "CHF"): 0.97, ("AUD", "USD"): 0.66, ("USD", "INR"): 83.0}
# (unit, plural, smaller unit, its plural, how many smaller units in one unit)
UNITS = (("metre", "metres", "centimetre", "centimetres", 100), ("metre", "metres", "millimetre", "millimetres", 1000),
         ("kilometre", "kilometres", "metre", "metres", 1000), ("centimetre", "centimetres", "millimetre",
                                                                "millimetres", 10),
         ("kilogram", "kilograms", "gram", "grams", 1000), ("litre", "litres", "millilitre", "millilitres", 1000),
         ("hour", "hours", "minute", "minutes", 60), ("minute", "minutes", "second", "seconds", 60),
         ("day", "days", "hour", "hours", 24), ("week", "weeks", "day", "days", 7),
         ("year", "years", "month", "months", 12), ("foot", "feet", "inch", "inches", 12),
         ("yard", "yards", "foot", "feet", 3), ("dozen", "dozens", "egg", "eggs", 12))
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a concise assistant.", "Answer briefly.")
THINKING_EFFORTS = ("max", "high", "low")
KINDS = ("arithmetic", "units", "tool", "repeat")
KIND_WEIGHTS = {"arithmetic": 0.2, "units": 0.2, "tool": 0.35, "repeat": 0.25}


@dataclasses.dataclass(frozen=True)
class Chat:
    """One conversation: messages in OpenAI form, the declared tools (or None) and the thinking mode."""

    kind: str
    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] | None = None
    thinking: bool = True
    thinking_effort: str = "max"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")
        if self.thinking_effort not in THINKING_EFFORTS:
            raise ValueError(f"thinking_effort: expected one of {THINKING_EFFORTS}, got {self.thinking_effort!r}")

    def render_kwargs(self) -> dict[str, Any]:
        return {"tools": None if self.tools is None else list(self.tools), "thinking": self.thinking,
                "thinking_effort": self.thinking_effort if self.thinking else None}


@dataclasses.dataclass(frozen=True)
class RenderedTrainingChat:
    """token_ids of the whole chat; target[i]: token i is part of an assistant turn (the model's output)."""

    token_ids: list[int]
    target: list[bool]


# ---------------------------------------------------------------------------------------------------- questions
def arithmetic_question(rng: random.Random) -> tuple[str, str, str]:
    """(question, think, answer) for one sum, difference or product."""
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        c, words = a * b, ("times", "multiplied by")
    elif op == "+":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        c, words = a + b, ("plus",)
    else:
        a = rng.randint(1, 99)
        b = rng.randint(0, a)
        c, words = a - b, ("minus",)
    expr = f"{a} {op} {b}"
    spoken = f"{a} {rng.choice(words)} {b}"
    question = rng.choice((f"What is {expr}?", f"What is {spoken}?", f"What's {expr}?", f"Compute {expr}.",
                           f"Calculate {spoken}.", f"How much is {spoken}?", f"{expr} = ?"))
    think = rng.choice((f"{expr} = {c}.", f"The user asks for {expr}, which is {c}.",
                        f"Working it out: {expr} = {c}."))
    answer = rng.choice((f"{expr} = {c}.", f"The answer is {c}.", f"{spoken} is {c}."))
    return question, think, answer


def unit_question(rng: random.Random) -> tuple[str, str, str]:
    """(question, think, answer) for one unit conversion."""
    unit, units, small, smalls, factor = rng.choice(UNITS)
    n = rng.choice((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15, 20, 25, 50))
    big = unit if n == 1 else units
    total = n * factor
    question = rng.choice((f"How many {smalls} are in {n} {big}?", f"How many {smalls} are there in {n} {big}?",
                           f"Convert {n} {big} to {smalls}.", f"What is {n} {big} in {smalls}?"))
    think = (f"One {unit} is {factor} {smalls}, so {n} {big} is {n} * {factor} = {total} {smalls}."
             if n != 1 else f"One {unit} is {factor} {smalls}.")
    answer = rng.choice((f"There are {total} {smalls} in {n} {big}.", f"{n} {big} is {total} {smalls}.",
                         f"{n} {big} equals {total} {smalls}."))
    return question, think, answer


def _assistant(think: str, content: str, thinking: bool, calls: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["reasoning_content"] = think
    if calls:
        message["tool_calls"] = list(calls)
    return message


def _call(name: str, arguments: Mapping[str, Any], index: int) -> dict[str, Any]:
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


# ---------------------------------------------------------------------------------------------------- tools
def weather_question(city: str, rng: random.Random) -> str:
    return rng.choice((f"What's the weather in {city}?", f"What is the weather like in {city} today?",
                       f"How is the weather in {city}?", f"Is it raining in {city}?",
                       f"Tell me the weather in {city}.", f"What is the temperature in {city} right now?",
                       f"Weather in {city}, please."))


def _tool_exchange(rng: random.Random, thinking: bool) -> tuple[str, list[dict[str, Any]]]:
    """(tool name, [user, assistant call, tool result, assistant answer]) for one tool question."""
    name = rng.choice(tuple(TOOLS))
    if name == "get_weather":
        city = rng.choice(CITIES)
        question, args = weather_question(city, rng), {"city": city}
        temp, sky = rng.randint(-10, 35), rng.choice(CONDITIONS)
        result = json.dumps({"city": city, "temperature_c": temp, "condition": sky})
        think = f"The user wants the weather in {city}. I will call get_weather."
        think2 = f"The tool says it is {temp} degrees and {sky} in {city}."
        answer = rng.choice((f"It is {temp} degrees C and {sky} in {city} right now.",
                             f"In {city} it is {sky}, with a temperature of {temp} degrees C."))
    elif name == "get_time":
        city = rng.choice(CITIES)
        question = rng.choice((f"What time is it in {city}?", f"What is the local time in {city}?",
                               f"Tell me the time in {city}."))
        args = {"city": city}
        clock = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        result = json.dumps({"city": city, "time": clock})
        think = f"The user wants the local time in {city}. I will call get_time."
        think2 = f"The tool says it is {clock} in {city}."
        answer = rng.choice((f"It is {clock} in {city}.", f"The local time in {city} is {clock}."))
    else:
        (src, dst), rate = rng.choice(sorted(RATES.items()))
        amount = rng.choice((1, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000))
        question = rng.choice((f"Convert {amount} {src} to {dst}.", f"How much is {amount} {src} in {dst}?",
                               f"What is {amount} {src} in {dst}?"))
        args = {"amount": amount, "from_currency": src, "to_currency": dst}
        value = round(amount * rate, 2)
        result = json.dumps({"amount": value, "currency": dst})
        think = f"The user wants {amount} {src} in {dst}. I will call convert_currency."
        think2 = f"The tool says {amount} {src} is {value} {dst}."
        answer = rng.choice((f"{amount} {src} is about {value} {dst}.", f"That is {value} {dst}."))
    messages = [{"role": "user", "content": question},
                _assistant(think, "", thinking, [_call(name, args, 1)]),
                {"role": "tool", "tool_call_id": "call_1", "content": result},
                _assistant(think2, answer, thinking)]
    return name, messages


# ---------------------------------------------------------------------------------------------------- chats
def make_chat(rng: random.Random, kind: str | None = None, texts: Sequence[str] = ()) -> Chat:
    """One chat of ``kind`` (None: drawn by :data:`KIND_WEIGHTS`); ``texts``: sentences for ``repeat`` chats
    (cities are used when there are none)."""
    kind = kind or rng.choices(KINDS, weights=[KIND_WEIGHTS[k] for k in KINDS])[0]
    thinking = rng.random() < (0.6 if kind == "repeat" else 0.9)  # repeat drills: often the short prompt
    effort = rng.choice(THINKING_EFFORTS) if rng.random() < 0.4 else "max"
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    tools = None
    if kind == "tool":
        if rng.random() < 0.15:  # tools declared, but the question needs none
            tools = _declared(rng, [rng.choice(tuple(TOOLS))])
            messages += _plain_exchange(rng, arithmetic_question, thinking)
        else:  # one or two tool questions (the second in the same conversation, after the first answer)
            name, exchange = _tool_exchange(rng, thinking)
            messages += exchange
            names = [name]
            if rng.random() < 0.4:
                second, exchange = _tool_exchange(rng, thinking)
                messages += exchange
                names.append(second)
            tools = _declared(rng, names)
    else:
        ask = {"arithmetic": arithmetic_question, "units": unit_question,
               "repeat": lambda r: repeat_request(r, texts)}[kind]
        for _ in range(rng.choice((1, 1, 2, 3))):
            messages += _plain_exchange(rng, ask, thinking)
    return Chat(kind, tuple(messages), tools, thinking, effort)


def repeat_request(rng: random.Random, texts: Sequence[str]) -> tuple[str, str, str]:
    """(question, think, answer) asking to repeat a sentence of ``texts`` or a list of cities, word for word."""
    if texts and rng.random() < 0.7:
        text = rng.choice(texts)
    else:
        text = ", ".join(rng.sample(CITIES, rng.randint(1, 4)))
    question = rng.choice((f"Repeat after me: {text}", f"Please repeat this: {text}", f"Say this back to me: {text}",
                           f"Copy this text exactly: {text}"))
    think = rng.choice(("The user wants me to repeat the text.", "I repeat the text word for word."))
    return question, think, text


def _plain_exchange(rng: random.Random, ask: Any, thinking: bool) -> list[dict[str, Any]]:
    question, think, answer = ask(rng)
    return [{"role": "user", "content": question}, _assistant(think, answer, thinking)]


def _declared(rng: random.Random, needed: Sequence[str]) -> tuple[Mapping[str, Any], ...]:
    """The tools list of a chat: the ``needed`` ones (three times in four) or with some of the others, shuffled."""
    names = list(dict.fromkeys(needed))
    if rng.random() < 0.25:
        names += [n for n in TOOLS if n not in names and rng.random() < 0.6]
    rng.shuffle(names)
    return tuple(TOOLS[n] for n in names)


def render_training_chat(renderer: K3ChatRenderer, chat: Chat) -> RenderedTrainingChat:
    """The chat's token ids with its assistant turns marked as the target.

    Each assistant turn k is the rendering of messages[:k+1] minus the generation prompt of messages[:k] (which
    ends inside its first channel), so the target is exactly what the model generates after that prompt,
    through ``<|end_of_msg|>``.
    """
    kwargs = chat.render_kwargs()
    full = renderer.render(list(chat.messages), add_generation_prompt=False, **kwargs).token_ids
    target = [False] * len(full)
    for k, message in enumerate(chat.messages):
        if message["role"] != "assistant":
            continue
        prompt = renderer.render(list(chat.messages[:k]), add_generation_prompt=True, **kwargs).token_ids
        upto = renderer.render(list(chat.messages[:k + 1]), add_generation_prompt=False, **kwargs).token_ids
        if full[:len(upto)] != upto or upto[:len(prompt)] != prompt:
            raise ValueError(f"chat rendering is not incremental at message {k}; cannot mark the assistant turn")
        target[len(prompt):len(upto)] = [True] * (len(upto) - len(prompt))
    return RenderedTrainingChat(full, target)
