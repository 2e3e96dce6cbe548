"""What a request asks the grammar for: :class:`StructuredOutputs` (exactly one kind), validated on creation.

Kinds: ``json`` (a JSON schema, dict or JSON text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one
of a list of strings), ``grammar`` (EBNF with a ``root`` rule), ``structural_tag`` (an xgrammar structural tag,
dict or JSON text, applied as given), and ``tools`` (tool_choice ``required`` / a named function, built with
:func:`tool_call_constraint` from the OpenAI ``tools`` list). Whether a schema/regex/EBNF actually compiles is
checked by the compiler (``StructuredCompiler.validate``), which raises ValueError naming the problem.
"""

from __future__ import annotations

import dataclasses
import json as _json
from collections.abc import Mapping, Sequence
from typing import Any

from rocm_k3.formats.json_limits import MAX_JSON_DEPTH, JSONLimitError, load_json
from rocm_k3.formats.parsers.types import named_tool_choice, tool_names

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag", "tools")


@dataclasses.dataclass(frozen=True)
class ToolSchema:
    """One tool the grammar may call: its name and its JSON-schema ``parameters`` (None = any arguments)."""

    name: str
    parameters: Mapping[str, Any] | None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tool name: expected a non-empty string, got {self.name!r}")
        if self.parameters is not None:
            params = _as_json_value(f"tools[{self.name!r}].function.parameters", self.parameters)
            if not isinstance(params, dict):
                raise ValueError(f"tools[{self.name!r}].function.parameters: expected a JSON-schema object")
            object.__setattr__(self, "parameters", params)


@dataclasses.dataclass(frozen=True)
class ToolCallConstraint:
    """Calls the output must consist of: ``required`` = one or more of ``tools`` (just one when
    ``parallel`` is False); ``named`` = exactly one call of ``tools[0]``. ``allow_text``: free text may come
    before the calls (K3: the response channel's body; K2: content before the tool section); False = the calls
    come at once (an empty response channel at most), as OpenAI's forced tool choices return no content."""

    tools: tuple[ToolSchema, ...]
    mode: str
    parallel: bool = True
    allow_text: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools", tuple(self.tools))
        if not all(isinstance(t, ToolSchema) for t in self.tools):
            raise ValueError("tools: expected ToolSchema entries")
        if not isinstance(self.parallel, bool):
            raise ValueError(f"parallel: expected a bool, got {self.parallel!r}")
        if not isinstance(self.allow_text, bool):
            raise ValueError(f"allow_text: expected a bool, got {self.allow_text!r}")
        if self.mode not in ("required", "named"):
            raise ValueError(f"mode: expected 'required' or 'named', got {self.mode!r}")
        if not self.tools:
            raise ValueError("tools: a tool-call constraint needs at least one tool")
        if self.mode == "named" and len(self.tools) != 1:
            raise ValueError(f"tools: a named tool choice constrains exactly one tool, got {len(self.tools)}")


def tool_call_constraint(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any,
                         parallel_tool_calls: bool = True, allow_text: bool = True) -> ToolCallConstraint | None:
    """The constraint for an OpenAI ``tools`` + ``tool_choice`` pair: None for "auto"/None/"none" (no
    grammar), else required/named (``allow_text``: see ToolCallConstraint). Raises ValueError for a malformed
    list or an unknown named function."""
    names = tool_names(tools)
    forced = named_tool_choice(tool_choice)
    if tool_choice in (None, "auto", "none"):
        return None
    if not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"parallel_tool_calls: expected a bool, got {parallel_tool_calls!r}")
    schemas = []
    for name, tool in zip(names, tools or ()):
        if forced is None or name == forced:
            schemas.append(ToolSchema(name, tool["function"].get("parameters")))
    if forced is not None and not schemas:
        raise ValueError(f"tool_choice: function {forced!r} is not in tools {list(names)}")
    if not schemas:
        raise ValueError("tool_choice: 'required' needs a non-empty tools list")
    return ToolCallConstraint(tuple(schemas), "named" if forced is not None else "required", parallel_tool_calls,
                              allow_text)


def _as_json_value(name: str, value: Any) -> Any:
    """``value`` parsed when it is JSON text, else a plain-JSON deep copy of it (dicts, lists, scalars)."""
    if isinstance(value, (str, bytes)):
        return load_json(value, name)
    try:
        return load_json(_json.dumps(value, default=_plain), name)
    except RecursionError:
        raise JSONLimitError(f"{name}: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except JSONLimitError:
        raise
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: not valid JSON ({e})") from None


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (list, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """One request's output constraint; exactly one field set (``json_object`` counts when True).

    bare: the value alone, without the family's channel wrappers (K3's optional ``<|open|>response<|sep|>`` ...
    around content constraints): for prompts that are not chats (the completions API), whose output is the value.
    """

    json: Mapping[str, Any] | str | bool | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    structural_tag: Mapping[str, Any] | str | None = None
    tools: ToolCallConstraint | None = None
    bare: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object: expected a bool, got {self.json_object!r}")
        if not isinstance(self.bare, bool):
            raise ValueError(f"bare: expected a bool, got {self.bare!r}")
        chosen = [k for k in KINDS if (getattr(self, k) is True if k == "json_object" else getattr(self, k) is not None)]
        if len(chosen) != 1:
            raise ValueError(f"structured outputs: expected exactly one of {list(KINDS)}, got {chosen or 'none'}")
        if self.json is not None:
            schema = _as_json_value("json", self.json)
            if not isinstance(schema, (Mapping, bool)):
                raise ValueError(f"json: expected a JSON-schema object, got {type(schema).__name__}")
            object.__setattr__(self, "json", schema)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"regex: expected a non-empty string, got {self.regex!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence) or not self.choice:
                raise ValueError(f"choice: expected a non-empty list of strings, got {self.choice!r}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"choice: every entry must be a non-empty string, got {list(self.choice)!r}")
            object.__setattr__(self, "choice", tuple(dict.fromkeys(self.choice)))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"grammar: expected EBNF text, got {self.grammar!r}")
        if self.structural_tag is not None:
            tag = _as_json_value("structural_tag", self.structural_tag)
            if not isinstance(tag, Mapping):
                raise ValueError("structural_tag: expected a structural-tag object")
            object.__setattr__(self, "structural_tag", tag)
        if self.tools is not None and not isinstance(self.tools, ToolCallConstraint):
            raise ValueError("tools: expected a ToolCallConstraint (see tool_call_constraint)")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if (self.json_object if k == "json_object" else getattr(self, k) is not None))

    def cache_key(self) -> str:
        """A canonical text of the constraint (equal constraints, equal keys)."""
        value: Any = getattr(self, self.kind)
        if isinstance(value, ToolCallConstraint):
            value = {"mode": value.mode, "parallel": value.parallel, "allow_text": value.allow_text,
                     "tools": [[t.name, t.parameters] for t in value.tools]}
        return self.kind + (":bare:" if self.bare else ":") + _json.dumps(value, sort_keys=True, ensure_ascii=False)
