"""Common types of the output parsers: results, request options, and the marker tables a family declares.

A family (``kimi_k3``, ``kimi_k2``) is a :class:`FamilySpec`: its :class:`FamilyMarkers` (which give, for each
parser :class:`State`, a table from marker text to :class:`Transition`), the texts of its special tokens, and a
function turning the text of one closed tool call into a :class:`ToolCall`. The scanner in ``stream.py`` runs those tables over decoded text
(special tokens arrive as their literal text).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

TOOL_CHOICE_MODES = ("auto", "none", "required")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed tool call. ``id`` is the OpenAI ``tool_calls[i].id``, ``arguments_json`` a JSON text (for
    K3 always valid JSON; for K2 the model's raw argument text), ``index`` the call's position in the output."""

    id: str
    name: str
    arguments_json: str
    index: int = 0


@dataclasses.dataclass
class ParsedOutput:
    """A whole completion split into channels. ``reasoning``/``content`` are None when empty (content also
    when it is whitespace only)."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a call as the model writes it (vLLM's streamed tool calls): the first piece of call ``index``
    carries its ``id`` and ``name``, every piece a text ``arguments`` to append; a call's pieces concatenate to
    its final ``arguments_json``."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclasses.dataclass
class ParsedDelta:
    """What one streamed piece of text adds: new reasoning text, new content text, calls closed in it, and the
    argument pieces of calls as they are written (``call_deltas``)."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
    call_deltas: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def is_empty(self) -> bool:
        return self.reasoning is None and self.content is None and not self.tool_calls and not self.call_deltas


def merge_deltas(deltas: Iterable[ParsedDelta]) -> ParsedOutput:
    """The :class:`ParsedOutput` a sequence of deltas adds up to (texts concatenated, calls in order)."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ToolCall] = []
    for d in deltas:
        if d.reasoning:
            reasoning.append(d.reasoning)
        if d.content:
            content.append(d.content)
        calls.extend(d.tool_calls)
    return ParsedOutput("".join(reasoning) or None, "".join(content) or None, calls)


def tool_names(tools: Sequence[Mapping[str, Any]] | None) -> tuple[str, ...]:
    """The function names of an OpenAI ``tools`` list (``[{"type": "function", "function": {"name": ...}}]``);
    raises ValueError naming the first malformed entry."""
    if tools is None:
        return ()
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools: expected a list of tool objects, got {type(tools).__name__}")
    names = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ValueError(f"tools[{i}]: expected an object, got {type(tool).__name__}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}].type: expected 'function', got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name: expected a non-empty string")
        names.append(fn["name"])
    return tuple(names)


def named_tool_choice(tool_choice: Any) -> str | None:
    """The function name of a named ``tool_choice`` (``{"type": "function", "function": {"name": N}}``), None
    for the string modes; raises ValueError for anything else."""
    if tool_choice is None or tool_choice in TOOL_CHOICE_MODES:
        return None
    if isinstance(tool_choice, Mapping) and tool_choice.get("type", "function") == "function":
        fn = tool_choice.get("function")
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str) and fn["name"]:
            return fn["name"]
    raise ValueError(
        f"tool_choice: expected one of {TOOL_CHOICE_MODES}, None, or {{'type': 'function', 'function': "
        f"{{'name': ...}}}}, got {tool_choice!r}"
    )


@dataclasses.dataclass(frozen=True)
class ParseOptions:
    """Per-request parser options.

    tools:           the request's OpenAI ``tools`` list (None = no tools).
    tool_choice:     "auto" / None, "none", "required", or a named function. With "none" (or no tools) tool
                     markup is not parsed: it stays in the content as text, as vLLM does.
    thinking:        the request's thinking switch; off = no reasoning channel at all.
    prompt_in_think: the prompt ended inside the think channel (None = same as ``thinking``): output before
                     any marker is then reasoning, so a completion cut off inside think is reasoning.
    call_id_prefix:  K3 calls get ids ``f"{call_id_prefix}{index}"``; the same prefix streaming and not gives
                     the same ids (pass a request-scoped prefix to make them unique across turns).
    """

    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: Any = None
    thinking: bool = True
    prompt_in_think: bool | None = None
    call_id_prefix: str = "call_"

    def __post_init__(self) -> None:
        names = tool_names(self.tools)
        forced = named_tool_choice(self.tool_choice)
        if forced is not None and forced not in names:
            raise ValueError(f"tool_choice: function {forced!r} is not in tools {list(names)}")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs a non-empty tools list")
        if not isinstance(self.thinking, bool):
            raise ValueError(f"thinking: expected a bool, got {self.thinking!r}")
        if self.prompt_in_think is None:
            object.__setattr__(self, "prompt_in_think", self.thinking)
        if not isinstance(self.prompt_in_think, bool):
            raise ValueError(f"prompt_in_think: expected a bool or None, got {self.prompt_in_think!r}")
        if self.prompt_in_think and not self.thinking:
            raise ValueError("prompt_in_think: cannot be True when thinking is off")
        if not isinstance(self.call_id_prefix, str):
            raise ValueError(f"call_id_prefix: expected a str, got {self.call_id_prefix!r}")

    @property
    def parse_tools(self) -> bool:
        """Whether tool markup is parsed into calls (there are tools and tool_choice is not "none")."""
        return bool(tool_names(self.tools)) and self.tool_choice != "none"


class State(enum.Enum):
    """Where the scanner is: which channel plain text goes to."""

    REASONING = "reasoning"  # text is reasoning
    CONTENT = "content"      # text is content (response body, raw JSON after think-close, ...)
    TOOLS = "tools"          # inside a tool section: text between calls is dropped
    CALL = "call"            # inside one call: text is buffered until the call closes
    END = "end"              # the turn has ended (message close / end of turn): text is dropped


class Transition(NamedTuple):
    """What a marker does. ``next`` None = back to the state the current call was entered from.
    keep: the marker text itself goes on as text of the next state (e.g. tool markup left as content).
    closes_call: leaving CALL this way parses the buffered call (any other way drops an unclosed call)."""

    next: State | None
    keep: bool = False
    closes_call: bool = False


MarkerTable = Mapping[State, Mapping[str, Transition]]


@dataclasses.dataclass(frozen=True)
class FamilyMarkers:
    """The marker texts of a family's output format.

    wrappers: channel wrappers that carry no text (K3's response open/close): inside think they end it (the
    vLLM #53246 rule), in the content they are dropped. ends: end-of-turn markers (message close, end of
    message, the tokenizer eos): the text after them is not part of this message.
    """

    think_open: str
    think_close: str
    tools_open: str
    tools_close: str
    call_open: str
    call_close: str
    wrappers: tuple[str, ...]
    ends: tuple[str, ...]

    def tables(self, opts: ParseOptions) -> MarkerTable:
        """The scanner's table for every state. Tool markup is only recognised when ``opts.parse_tools``; a
        tools-open (or call-open) inside think ends the reasoning either way."""
        stay = Transition(State.CONTENT)  # a marker dropped from the content
        end = Transition(State.END)
        ends = {m: end for m in self.ends}
        reasoning = {self.think_close: Transition(State.CONTENT), self.think_open: Transition(State.REASONING),
                     **{m: Transition(State.CONTENT) for m in self.wrappers}, **ends}
        content = {self.think_open: Transition(State.REASONING) if opts.thinking else stay, self.think_close: stay,
                   **{m: stay for m in self.wrappers}, **ends}
        if opts.parse_tools:
            reasoning.update({self.tools_open: Transition(State.TOOLS), self.call_open: Transition(State.CALL)})
            content.update({self.tools_open: Transition(State.TOOLS), self.call_open: Transition(State.CALL),
                            self.tools_close: stay})
        else:
            reasoning[self.tools_open] = Transition(State.CONTENT, keep=True)
        tools = {self.call_open: Transition(State.CALL), self.tools_close: Transition(State.CONTENT), **ends}
        call = {self.call_close: Transition(None, closes_call=True), self.call_open: Transition(State.CALL),
                self.tools_close: Transition(State.CONTENT), **ends}
        return {State.REASONING: reasoning, State.CONTENT: content, State.TOOLS: tools, State.CALL: call,
                State.END: {}}


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """A model family's output format.

    name:          registry name ("kimi_k3", "kimi_k2").
    markers:       its marker texts (they define the scanner's tables).
    special_texts: literal texts of its special tokens that start markers; a held-back partial marker that
                   already contains one at the end of a completion is a truncated marker and is dropped (any
                   other partial, e.g. a lone ``<``, was ordinary text and is kept).
    parse_call:    ``parse_call(body, index, opts)`` -> the call, or None (dropped: no name, malformed header);
                   ``body`` is the text between the call-open marker and the call-close marker.
    """

    name: str
    markers: FamilyMarkers
    special_texts: tuple[str, ...]
    parse_call: Callable[[str, int, ParseOptions], ToolCall | None]
    # partial_call(body so far, index, opts) -> the call with the part of its arguments JSON text already fixed
    # (a prefix of the final ``arguments_json``), or None while its name is not known yet
    partial_call: Callable[[str, int, ParseOptions], ToolCall | None] | None = None


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def loads_strict(raw: str) -> object:
    """``json.loads`` that refuses NaN / Infinity (they are not JSON; a client's parser would fail on them)."""
    return json.loads(raw, parse_constant=_reject_constant)


def json_object_or_none(raw: str) -> object:
    """The strictly parsed value of ``raw``, or None when it is not JSON."""
    try:
        return loads_strict(raw)
    except ValueError:
        return None
