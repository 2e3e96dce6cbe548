"""The chat-renderer interface, the request conventions for thinking, and message validation shared by renderers.

A renderer turns OpenAI-format messages into prompt token ids::

    renderer.render(messages, *, tools=None, tool_choice=None, response_format=None, thinking=None,
                    thinking_effort=None, add_generation_prompt=True, continue_final_message=False)
        -> RenderedChat(token_ids, text, prompt_in_think, image_positions)

``continue_final_message`` (vLLM's): the final message is left open (no end markers), so generation continues
it; it excludes ``add_generation_prompt`` and a final tool message.

``renderer.family`` is "kimi_k3" (XTML) or "kimi_k2" (the checkpoint's Jinja template). Messages are dicts:
``role`` (system | developer | user | assistant | tool; OpenAI's ``developer`` is rendered as ``system``), ``content`` (a string or a list of ``text`` / ``image_url`` parts),
optional ``name``; assistant messages may carry ``reasoning_content`` and ``tool_calls`` (``function.arguments``
as a JSON string or a dict); tool messages ``tool_call_id``. A bad message is a ValueError naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

ROLES = ("system", "developer", "user", "assistant", "tool")
RENDERED_AS = {"developer": "system"}  # OpenAI's newer name for system instructions
TEXT_PART = "text"
IMAGE_PARTS = ("image_url", "image")
THINKING_EFFORTS = ("low", "high", "max")  # K3 accepts these; "medium" is rejected although its note names it
# OpenAI's reasoning_effort values (and K3's "max") -> the K3 effort written in the prompt
REASONING_EFFORTS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "max": "max"}
# think-token budget of each reasoning_effort when the request names no thinking_token_budget ("max": none)
DEFAULT_EFFORT_BUDGETS = {"minimal": 64, "low": 256, "medium": 1024, "high": 4096}


class RenderedChat(NamedTuple):
    """token_ids: the prompt; text: the same prompt as text; prompt_in_think: generation starts in the think channel.

    image_positions: one entry per image part, in order: the index into ``token_ids`` where that image's block goes
    (``MultiModalProcessor.process_images(token_ids, image_positions, images)`` inserts it there). A renderer that
    reports positions (K3) puts no ids of its own for an image in ``token_ids``; ``text`` shows each image as the
    ``<|kimi_image_placeholder|>`` string, for reading only. Placeholder text a user typed in a message is ordinary
    text in both and has no entry here. Empty when the renderer does not track images (K2's Jinja templates).
    """

    token_ids: list[int]
    text: str
    prompt_in_think: bool
    image_positions: tuple[int, ...] = ()


class ChatRenderer(Protocol):
    family: str

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               tool_choice: str | Mapping[str, Any] | None = None,
               response_format: Mapping[str, Any] | None = None, thinking: bool | None = None,
               thinking_effort: str | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> RenderedChat: ...


def check_continuation(messages: Sequence[Mapping[str, Any]], add_generation_prompt: Any,
                       continue_final_message: Any) -> bool:
    """Whether the final message is continued (validated: bools, not both, not a tool message)."""
    check_bool(add_generation_prompt, "add_generation_prompt")
    if not check_bool(continue_final_message, "continue_final_message"):
        return False
    if add_generation_prompt:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=true "
                         "(send add_generation_prompt=false)")
    if messages[-1]["role"] == "tool":
        raise ValueError(f"continue_final_message: the final message (messages[{len(messages) - 1}]) is a tool "
                         "result, which cannot be continued")
    return True


def content_text(content: Any) -> str:
    """The text of a message's content (a string, or its text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == TEXT_PART)


class ThinkingOptions(NamedTuple):
    thinking: bool | None
    effort: str | None


def thinking_options(chat_template_kwargs: Mapping[str, Any] | None,
                     reasoning_effort: str | None) -> ThinkingOptions:
    """vLLM's request conventions -> (thinking, effort) for ``render``; None leaves the renderer's default.

    ``chat_template_kwargs`` ``thinking`` (or ``enable_thinking``) and ``thinking_effort`` are explicit and win;
    otherwise ``reasoning_effort`` "none" turns thinking off and "minimal" / "low" / "medium" / "high" / "max"
    set the effort (K3's nearest: :data:`REASONING_EFFORTS`).
    """
    kwargs = {} if chat_template_kwargs is None else chat_template_kwargs
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"chat_template_kwargs: expected an object, got {type(kwargs).__name__}")
    thinking = kwargs.get("thinking")
    if thinking is None:
        thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise ValueError(f"chat_template_kwargs.thinking: expected true or false, got {thinking!r}")
    effort = kwargs.get("thinking_effort")
    if effort is not None:
        check_thinking_effort(effort, field="chat_template_kwargs.thinking_effort")
    if reasoning_effort is not None:
        if reasoning_effort == "none":
            if thinking is None:
                thinking = False
        else:
            if reasoning_effort not in REASONING_EFFORTS:
                choices = ", ".join(repr(e) for e in ("none", *REASONING_EFFORTS))
                raise ValueError(f"reasoning_effort: expected one of {choices}, got {reasoning_effort!r}")
            if effort is None:
                effort = REASONING_EFFORTS[reasoning_effort]
    return ThinkingOptions(thinking, effort)


def check_thinking_effort(effort: Any, *, field: str = "thinking_effort", allow_none: bool = False) -> str:
    if effort not in THINKING_EFFORTS:
        choices = ", ".join(repr(e) for e in (("none",) if allow_none else ()) + THINKING_EFFORTS)
        raise ValueError(f"{field}: expected one of {choices}, got {effort!r}")
    return effort


def check_bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{field}: expected true or false, got {value!r}")
    return value


# ---- messages -------------------------------------------------------------------------------------------------
def validate_messages(messages: Any) -> list[Mapping[str, Any]]:
    """Check the shape of every message (roles, content, names, tool calls); returns them as a list, with each
    role as the formats render it (``developer`` -> ``system``)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages: expected a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages: expected at least one message")
    for i, message in enumerate(messages):
        _validate_message(message, f"messages[{i}]")
    return [{**m, "role": RENDERED_AS[m["role"]]} if m["role"] in RENDERED_AS else m for m in messages]


def _validate_message(message: Any, where: str) -> None:
    if not isinstance(message, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}")
    role = RENDERED_AS.get(role, role)
    for key in ("name",) + (("tool", "tool_call_id") if role == "tool" else ()):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{where}.{key}: expected a string, got {type(value).__name__}")
    if role == "system" and message.get("tools") is not None:
        validate_tools(message["tools"], f"{where}.tools")
    if role in ("system", "user", "tool") and message.get("content") is None and not (
            role == "system" and message.get("tools")):
        raise ValueError(f"{where}.content: required for a {role} message")
    if message.get("content") is not None:
        validate_content(message["content"], f"{where}.content")
    if role != "assistant":
        for key in ("tool_calls", "reasoning_content"):
            if message.get(key) is not None:
                raise ValueError(f"{where}.{key}: only assistant messages carry it")
        return
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{where}.{key}: expected a string, got {type(value).__name__}")
    calls = message.get("tool_calls")
    if calls is not None:
        if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
            raise ValueError(f"{where}.tool_calls: expected a list of tool calls, got {type(calls).__name__}")
        for j, call in enumerate(calls):
            tool_call_function(call, f"{where}.tool_calls[{j}]")


def validate_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, Sequence) or isinstance(content, bytes):
        raise ValueError(f"{where}: expected a string or a list of content parts, got {type(content).__name__}")
    for k, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ValueError(f"{where}[{k}]: expected a content part object, got {type(part).__name__}")
        kind = part.get("type")
        if kind == TEXT_PART:
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}[{k}].text: expected a string")
        elif kind not in IMAGE_PARTS:
            raise ValueError(f"{where}[{k}].type: expected one of {', '.join((TEXT_PART,) + IMAGE_PARTS)}, "
                             f"got {kind!r}")


def tool_call_function(call: Any, where: str) -> tuple[str, Any, str]:
    """(name, arguments, field of the arguments) of one tool call: ``{"function": {"name", "arguments"}}`` or the
    flat ``{"name", "arguments"}``; arguments must be a JSON string, an object or null."""
    if not isinstance(call, Mapping):
        raise ValueError(f"{where}: expected a tool call object, got {type(call).__name__}")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise ValueError(f"{where}.id: expected a string, got {type(call_id).__name__}")
    fn, prefix = (call["function"], f"{where}.function") if "function" in call else (call, where)
    if not isinstance(fn, Mapping):
        raise ValueError(f"{prefix}: expected an object, got {type(fn).__name__}")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{prefix}.name: expected a non-empty string, got {name!r}")
    arguments = fn.get("arguments")
    if arguments is not None and not isinstance(arguments, (str, Mapping)):
        raise ValueError(f"{prefix}.arguments: expected a JSON string or an object, got {type(arguments).__name__}")
    return name, arguments, f"{prefix}.arguments"


def validate_tools(tools: Any, where: str = "tools") -> list[Mapping[str, Any]]:
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ValueError(f"{where}: expected a list of tool objects, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ValueError(f"{where}[{i}]: expected a tool object, got {type(tool).__name__}")
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn.get("name"):
            raise ValueError(f"{where}[{i}].function.name: expected a non-empty string")
    return list(tools)


SCHEMA_FIELD = "response_format.json_schema.schema"  # where a json_schema format's schema sits in a request


def response_format_kind(response_format: Any) -> tuple[str, Any] | None:
    """A request's ``response_format`` checked: None (absent or ``text``), ``("json_object", None)`` or
    ``("json_schema", schema)``; a ValueError naming the bad field otherwise."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ValueError(f"response_format: expected an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return kind, None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise ValueError(f"{SCHEMA_FIELD}: required for type 'json_schema'")
        return kind, spec["schema"]
    raise ValueError(f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}")


# ---- JSON as the chat formats write it --------------------------------------------------------------------------
def deep_sorted(value: Any, field: str) -> Any:
    """``value`` with the keys of every nested object sorted (lists keep their order); keys must be strings."""
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise ValueError(f"{field}: object keys must be strings")
        return {k: deep_sorted(value[k], field) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [deep_sorted(v, field) for v in value]
    return value


def compact_json(value: Any, field: str) -> str:
    """``,``/``:`` separators, non-ASCII kept; a value JSON cannot hold is a ValueError naming ``field``."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{field}: not JSON-serialisable ({exc})") from exc


def parse_effort_budgets(text: str) -> dict[str, int]:
    """``"low=256,medium=1024"`` -> the default budgets with those replaced (ValueError naming a bad entry)."""
    budgets = dict(DEFAULT_EFFORT_BUDGETS)
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, sep, value = entry.partition("=")
        if not sep or name.strip() not in REASONING_EFFORTS or not value.strip().isdigit():
            raise ValueError(f"reasoning_effort_budgets: expected EFFORT=TOKENS entries with EFFORT one of "
                             f"{', '.join(REASONING_EFFORTS)}, got {entry!r}")
        budgets[name.strip()] = int(value)
    return budgets
