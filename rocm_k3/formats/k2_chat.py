"""The K2-style chat format of Kimi Linear (and K2-family) checkpoints, from the checkpoint's own Jinja template.

The template comes from ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template`` and runs in
jinja2's immutable sandbox (``trim_blocks``/``lstrip_blocks`` and loop controls, as chat templates expect) with
``messages``, ``tools``, ``add_generation_prompt``, ``tool_choice``, ``response_format`` and, when given,
``thinking`` / ``thinking_effort``; a ``tojson`` filter and ``raise_exception``. A template that reaches for
unsafe attributes (``''.__class__``...) or raises gets a ValueError naming it. The rendered text holds the
family's special-token strings, so it is encoded with specials allowed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from jinja2 import TemplateError
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rocm_k3.tokenizers.base import Tokenizer, read_json_if_present
from rocm_k3.formats.chat_base import (
    RenderedChat,
    check_bool,
    check_continuation,
    content_text,
    validate_messages,
    validate_tools,
)

CHAT_TEMPLATE_FILE = "chat_template.jinja"
THINK_OPEN = "<think>"


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, failing at once (not with an empty string) on an unsafe attribute."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is not allowed")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(str(message))


def read_chat_template(directory: str | Path) -> tuple[str, str] | None:
    """(template text, where it came from) of a checkpoint, or None when it has no template.

    ``chat_template`` in tokenizer_config.json may also be a list of ``{"name", "template"}``; "default" is used.
    """
    root = Path(directory)
    file = root / CHAT_TEMPLATE_FILE
    if file.is_file():
        try:
            return file.read_bytes().decode("utf-8"), str(file)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{file}: not valid UTF-8 ({exc})") from exc
    config_file = root / "tokenizer_config.json"
    config = read_json_if_present(config_file)
    if config is None or config.get("chat_template") is None:
        return None
    template = config["chat_template"]
    source = f"{config_file} chat_template"
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
        if template is None:
            raise ValueError(f"{source}: a list of templates needs one named 'default', got {sorted(map(str, named))}")
    if not isinstance(template, str):
        raise ValueError(f"{source}: expected a string, got {type(template).__name__}")
    return template, source


class K2ChatRenderer:
    """A checkpoint's Jinja chat template, sandboxed, producing token ids for ``tokenizer``."""

    family = "kimi_k2"

    def __init__(self, tokenizer: Tokenizer, template: str, *, source: str = "chat template") -> None:
        self.tokenizer = tokenizer
        self.source = source
        env = _ChatTemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(template)
        except TemplateError as exc:
            raise ValueError(f"{source}: not a valid Jinja template ({exc})") from exc

    @classmethod
    def from_dir(cls, directory: str | Path, tokenizer: Tokenizer) -> K2ChatRenderer | None:
        found = read_chat_template(directory)
        return None if found is None else cls(tokenizer, found[0], source=found[1])

    def render_text(self, messages: Sequence[Mapping[str, Any]], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    tool_choice: str | Mapping[str, Any] | None = None,
                    response_format: Mapping[str, Any] | None = None, thinking: bool | None = None,
                    thinking_effort: str | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        """The template's text; ``continue_final_message`` cuts it after the final message's content (vLLM's
        way: the template writes that content verbatim, and everything after it closes the message)."""
        messages = validate_messages(messages)
        continued = check_continuation(messages, add_generation_prompt, continue_final_message)
        variables: dict[str, Any] = {
            "messages": [dict(m) for m in messages],
            "tools": None if tools is None else [dict(t) for t in validate_tools(tools)],
            "add_generation_prompt": check_bool(add_generation_prompt, "add_generation_prompt"),
            "tool_choice": tool_choice,
            "response_format": response_format,
        }
        if thinking is not None:
            variables["thinking"] = check_bool(thinking, "thinking")
        if thinking_effort is not None:
            variables["thinking_effort"] = thinking_effort
        try:
            text = self._template.render(**variables)
        except SecurityError as exc:
            raise ValueError(f"{self.source}: the chat template attempted an unsafe operation: {exc}") from exc
        except Exception as exc:  # the template is the checkpoint's code: any failure is reported as its error
            raise ValueError(f"{self.source}: rendering the chat template failed: {exc}") from exc
        if not continued:
            return text
        final = content_text(messages[-1].get("content"))
        cut = text.rfind(final) if final else -1
        if cut < 0:
            raise ValueError(f"continue_final_message: the final message (messages[{len(messages) - 1}]) needs "
                             f"text content that {self.source} writes verbatim")
        return text[: cut + len(final)]

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               tool_choice: str | Mapping[str, Any] | None = None,
               response_format: Mapping[str, Any] | None = None, thinking: bool | None = None,
               thinking_effort: str | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> RenderedChat:
        text = self.render_text(messages, tools=tools, tool_choice=tool_choice, response_format=response_format,
                                thinking=thinking, thinking_effort=thinking_effort,
                                add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message)
        ids = self.tokenizer.encode(text, allow_special=True)
        return RenderedChat(ids, text, add_generation_prompt and text.endswith(THINK_OPEN))
