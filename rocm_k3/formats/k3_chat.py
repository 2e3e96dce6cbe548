"""Kimi K3's chat format (XTML), rendered segment by segment.

A prompt is a list of segments. The four control markers (``<|open|>``, ``<|close|>``, ``<|sep|>``,
``<|end_of_msg|>``) are single special ids; every other segment (tag names, attribute keys and values, bodies) is
ordinary text, encoded with no specials allowed, so a user typing ``<|open|>`` gets its plain bytes. BPE never
merges across a segment boundary, so the segmentation is part of the format:

- ``open_tag(T, attrs)`` = ``<|open|>`` ``T`` then per attribute `` key`` ``="`` ``value`` ``"`` and ``<|sep|>``;
  attribute values are escaped (``&`` -> ``&amp;`` first, then ``"`` -> ``&quot;``), bodies never are.
- ``close_tag(T)`` = ``<|close|>`` ``T`` ``<|sep|>``; a message is open_tag("message", attrs), body,
  close_tag("message"), ``<|end_of_msg|>``.

Order: tool declarations, the thinking-effort note (thinking on), the conversation, the tool_choice and
response_format notes, then the generation prompt, which ends inside ``<|open|>think<|sep|>`` (thinking on) or
``<|open|>response<|sep|>``. With ``continue_final_message`` the final message comes after the notes and stays
open: an assistant's ends inside its think channel (thinking on, no content yet) or its response channel. No BOS, no default system prompt. An image part is an image segment: it adds no ids
(its index in the ids is reported in ``RenderedChat.image_positions``, where the image's media block is inserted)
and reads as the ``<|kimi_image_placeholder|>`` string in the text. Placeholder text typed in a message is a text
segment like any other, so it never gets an image slot.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from rocm_k3.tokenizers.base import Tokenizer
from rocm_k3.formats.chat_base import (
    IMAGE_PARTS,
    SCHEMA_FIELD,
    RenderedChat,
    check_bool,
    check_continuation,
    check_thinking_effort,
    compact_json,
    deep_sorted,
    response_format_kind,
    tool_call_function,
    validate_messages,
    validate_tools,
)
from rocm_k3.formats.json_limits import NotJSONError, load_json

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
CONTROL_TOKENS = (OPEN, CLOSE, SEP, END_OF_MSG)
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
DEFAULT_THINKING_EFFORT = "max"

# The fixed texts of K3's internal system messages (the model was trained on exactly these).
TOOL_DECLARE_HEAD = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
DYNAMIC_TOOL_DECLARE_HEAD = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n"
)
THINKING_EFFORT_NOTE = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
TOOL_CHOICE_NOTES = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_RAW_JSON = ("Your response must be raw JSON data without markdown code blocks (```json) or any additional "
             "formatting.")
JSON_OBJECT_NOTE = f"The system is invoked with `response_format=json_object`.\n{_RAW_JSON}"
JSON_SCHEMA_NOTE = (f"The system is invoked with `response_format=json_schema`.\n{_RAW_JSON}\n"
                    "The JSON data must match the following schema:\n```json\n{schema}\n```")


class Segment(NamedTuple):
    text: str
    control: bool  # one of CONTROL_TOKENS, encoded as its special id
    image: bool = False  # an image part: no ids, its position is reported (text: the placeholder)


class _Segments:
    """The segment list of one prompt, with the XTML primitives."""

    def __init__(self) -> None:
        self.items: list[Segment] = []

    def control(self, token: str) -> None:
        self.items.append(Segment(token, True))

    def text(self, text: str) -> None:
        if text:
            self.items.append(Segment(text, False))

    def open_tag(self, tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> None:
        self.control(OPEN)
        self.text(tag)
        for key, value in attrs:
            self.text(f" {key}")
            self.text('="')
            self.text(escape_attribute(str(value)))
            self.text('"')
        self.control(SEP)

    def close_tag(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def end_message(self) -> None:
        self.close_tag("message")
        self.control(END_OF_MSG)

    def content(self, content: Any) -> None:
        """A string body, or each part in turn (text parts as they are, images as the placeholder)."""
        if content is None:
            return
        if isinstance(content, str):
            self.text(content)
            return
        for part in content:
            if part.get("type") in IMAGE_PARTS:
                self.items.append(Segment(IMAGE_PLACEHOLDER, False, image=True))
            else:
                self.text(part["text"])

    def system_note(self, kind: str, body: str) -> None:
        self.open_tag("message", [("role", "system"), ("type", kind)])
        self.text(body.strip())
        self.end_message()


def escape_attribute(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def argument_type(value: Any) -> str:
    """The XTML ``type`` of a tool-call argument value."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    return "array"


def parse_arguments(arguments: Any, field: str) -> tuple[dict[str, Any], str | None]:
    """(arguments as an object, None) or ({}, raw text) for a string that is not JSON (rendered as a json block).

    None or a blank string is no arguments; JSON that is not an object is a ValueError naming ``field``."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, Mapping):
        return dict(arguments), None
    if not arguments.strip():
        return {}, None
    try:
        parsed = load_json(arguments, field)  # too deep, too long a number: ValueError naming the field
    except NotJSONError:
        return {}, arguments
    if not isinstance(parsed, dict):
        raise ValueError(f"{field}: expected a JSON object, got {type(parsed).__name__}")
    return parsed, None


def _call_positions(calls: Sequence[Any] | None, where: str) -> dict[str, tuple[int, str]]:
    """tool_call id -> (1-based position among the calls, function name); the first of duplicate ids wins."""
    out: dict[str, tuple[int, str]] = {}
    for position, call in enumerate(calls or (), start=1):
        name, _, _ = tool_call_function(call, f"{where}.tool_calls[{position - 1}]")
        call_id = call.get("id")
        if call_id is not None and call_id not in out:
            out[call_id] = (position, name)
    return out


def order_tool_results(messages: Sequence[Mapping[str, Any]]) -> list[tuple[int, str | None]]:
    """The render order as (index into ``messages``, tool name from the matched call or None).

    Each run of consecutive tool messages is sorted into the preceding assistant's tool_calls order by
    ``tool_call_id`` (stable; the matched call's name is authoritative); a run with any id that matches no call
    stays as sent.
    """
    order: list[tuple[int, str | None]] = []
    positions: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        role = messages[i]["role"]
        if role != "tool":
            if role == "assistant":
                positions = _call_positions(messages[i].get("tool_calls"), f"messages[{i}]")
            order.append((i, None))
            i += 1
            continue
        end = i
        while end < len(messages) and messages[end]["role"] == "tool":
            end += 1
        matches = [positions.get(messages[k].get("tool_call_id")) for k in range(i, end)]
        if all(m is not None for m in matches):
            ranked = sorted(zip(matches, range(i, end)), key=lambda item: (item[0][0], item[1]))
            order.extend((k, match[1]) for match, k in ranked)
        else:
            order.extend((k, None) for k in range(i, end))
        i = end
    return order


def k3_segments(messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
                tool_choice: str | Mapping[str, Any] | None = None, response_format: Mapping[str, Any] | None = None,
                thinking: bool | None = None, thinking_effort: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[Segment]:
    """The K3 prompt as segments (see the module docstring); invalid input is a ValueError naming the field."""
    messages = validate_messages(messages)
    thinking = True if thinking is None else check_bool(thinking, "thinking")
    effort = DEFAULT_THINKING_EFFORT if thinking_effort is None else check_thinking_effort(thinking_effort)
    continued = len(messages) - 1 if check_continuation(messages, add_generation_prompt, continue_final_message) else -1
    notes = _request_notes(tool_choice, response_format)
    if tools is not None:
        tools = validate_tools(tools)
    out = _Segments()
    if tools:
        _tool_declare(out, tools, TOOL_DECLARE_HEAD, "tools")
    if thinking:
        out.system_note("thinking-effort", THINKING_EFFORT_NOTE.format(effort=effort))
    calls: Sequence[Any] = ()
    tool_index = 0
    for k, matched_name in order_tool_results(messages):
        message, where = messages[k], f"messages[{k}]"
        role = message["role"]
        if k == continued:
            continue  # after the notes, left open
        if role == "system" and message.get("tools"):
            _tool_declare(out, message["tools"], DYNAMIC_TOOL_DECLARE_HEAD, f"{where}.tools")
        elif role in ("system", "user", "assistant"):
            if role == "assistant":
                calls = message.get("tool_calls") or ()
                tool_index = 0
            _message(out, message, thinking, where)
            out.end_message()
        else:  # tool
            tool_index += 1
            name = matched_name or message.get("tool") or message.get("name")
            if not name and tool_index <= len(calls):
                name = tool_call_function(calls[tool_index - 1], f"tool call {tool_index}")[0]
            if not name:
                raise ValueError(f"{where}.name: a tool message needs its tool's name (a 'name' field, a "
                                 f"tool_call_id of the preceding assistant's tool_calls, or a call at its position)")
            out.open_tag("message", [("role", "tool"), ("tool", name), ("index", tool_index)])
            out.content(message.get("content"))
            out.end_message()
    for kind, body in notes:
        out.system_note(kind, body)
    if continued >= 0:
        _message(out, messages[continued], thinking, f"messages[{continued}]", keep_open=True)
    if add_generation_prompt:
        out.open_tag("message", [("role", "assistant")])
        out.open_tag("think" if thinking else "response")
    return out.items


def _with_name(attrs: list[tuple[str, Any]], message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return attrs + [("name", message["name"])] if message.get("name") else attrs


def _tool_declare(out: _Segments, tools: Any, head: str, field: str) -> None:
    body = f"{head}```json\n{compact_json(deep_sorted(tools, field), field)}\n```"
    out.open_tag("message", [("role", "system"), ("type", "tool-declare")])
    out.text(body)
    out.end_message()


def _message(out: _Segments, message: Mapping[str, Any], thinking: bool, where: str, keep_open: bool = False) -> None:
    """A system, user or assistant message without its end (``keep_open``: a continued message, see
    :func:`_assistant_body`)."""
    role = message["role"]
    out.open_tag("message", _with_name([("role", role)], message))
    if role == "assistant":
        _assistant_body(out, message, thinking, where, keep_open)
    else:
        out.content(message.get("content"))


def _assistant_body(out: _Segments, message: Mapping[str, Any], thinking: bool, where: str,
                    keep_open: bool = False) -> None:
    """Think (thinking on), response and tool calls; ``keep_open`` leaves the last channel with text open (think
    when there is no content or call yet, else response; a message with calls is written whole)."""
    calls = message.get("tool_calls")
    answered = bool(message.get("content")) or bool(calls)
    if thinking:  # the think channel is always there in thinking mode, even empty
        reasoning = message.get("reasoning_content")
        if reasoning is None:
            reasoning = message.get("reasoning")
        out.open_tag("think")
        if reasoning and (reasoning.strip() or keep_open):
            out.text(reasoning)
        if keep_open and not answered:
            return
        out.close_tag("think")
    out.open_tag("response")
    out.content(message.get("content"))
    if keep_open and not calls:
        return
    out.close_tag("response")
    if not calls:
        return
    out.open_tag("tools")
    for index, call in enumerate(calls, start=1):
        name, arguments, field = tool_call_function(call, f"{where}.tool_calls[{index - 1}]")
        args, raw = parse_arguments(arguments, field)
        out.open_tag("call", [("tool", name), ("index", index)])
        if raw is not None:
            out.open_tag("json", [("type", "object")])
            out.text(raw)
            out.close_tag("json")
        for key, value in args.items():
            out.open_tag("argument", [("key", key), ("type", argument_type(value))])
            out.text(value if isinstance(value, str) else _argument_json(value, f"{field}.{key}"))
            out.close_tag("argument")
        out.close_tag("call")
    out.close_tag("tools")


def _argument_json(value: Any, field: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{field}: not JSON-serialisable ({exc})") from exc


def _request_notes(tool_choice: Any, response_format: Any) -> list[tuple[str, str]]:
    """The tool-choice and response-format system notes of a request (validated)."""
    notes: list[tuple[str, str]] = []
    if isinstance(tool_choice, str):
        if tool_choice in TOOL_CHOICE_NOTES:
            notes.append(("tool-choice", TOOL_CHOICE_NOTES[tool_choice]))
        elif tool_choice != "auto":
            raise ValueError(f"tool_choice: expected 'auto', 'required', 'none' or a named tool, got {tool_choice!r}")
    elif tool_choice is not None and not isinstance(tool_choice, Mapping):
        raise ValueError(f"tool_choice: expected a string or an object, got {type(tool_choice).__name__}")
    checked = response_format_kind(response_format)
    if checked is not None and checked[0] == "json_object":
        notes.append(("response-format", JSON_OBJECT_NOTE))
    elif checked is not None:
        schema = compact_json(deep_sorted(checked[1], SCHEMA_FIELD), SCHEMA_FIELD)
        notes.append(("response-format", JSON_SCHEMA_NOTE.format(schema=schema)))
    return notes


class K3ChatRenderer:
    """K3 XTML prompts as token ids for ``tokenizer`` (which must have the four control specials)."""

    family = "kimi_k3"

    def __init__(self, tokenizer: Tokenizer) -> None:
        specials = tokenizer.special_tokens
        missing = [t for t in CONTROL_TOKENS if t not in specials]
        if missing:
            raise ValueError(f"the K3 chat format needs the special tokens {missing}, which this tokenizer lacks")
        self.tokenizer = tokenizer
        self._control_ids = {t: specials[t] for t in CONTROL_TOKENS}

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               tool_choice: str | Mapping[str, Any] | None = None,
               response_format: Mapping[str, Any] | None = None, thinking: bool | None = None,
               thinking_effort: str | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> RenderedChat:
        segments = k3_segments(messages, tools=tools, tool_choice=tool_choice, response_format=response_format,
                               thinking=thinking, thinking_effort=thinking_effort,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message)
        ids: list[int] = []
        images: list[int] = []
        for seg in segments:
            if seg.image:
                images.append(len(ids))
            elif seg.control:
                ids.append(self._control_ids[seg.text])
            else:
                ids.extend(self.tokenizer.encode(seg.text))
        return RenderedChat(ids, "".join(seg.text for seg in segments), open_channel(segments) == "think",
                            tuple(images))


def open_channel(segments: Sequence[Segment]) -> str | None:
    """The innermost tag still open at the end of ``segments`` (``think``, ``response``, ``message``...)."""
    stack: list[str] = []
    after = None  # the control marker just seen: the next text segment names its tag
    for seg in segments:
        if seg.control:
            after = seg.text
            continue
        if after == OPEN:
            stack.append(seg.text)
        elif after == CLOSE and stack:
            stack.pop()
        after = None
    return stack[-1] if stack else None
