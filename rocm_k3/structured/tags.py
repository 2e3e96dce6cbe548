"""xgrammar structural tags for the constraints of :mod:`rocm_k3.structured.spec`, per output family.

Each tag constrains the text from the point where the reasoning gate opens (``gate.py``) to the end of the
message; the stop token is allowed once the tag is complete. Marker tokens are matched by id
(``TokenFormat``), free text excludes every marker text. Every shape a tag admits is one the parsers in
``rocm_k3.formats.parsers`` read back.

Kimi K3 (after think-close, after a response-open when the model skipped think, or from the start when the
prompt ended in the response channel):

- content constraints (json / json_object / regex / choice / grammar): ``[<|open|>response<|sep|>] VALUE
  [<|close|>response<|sep|>] [<|close|>message<|sep|>]``: raw JSON right after think-close is legal, as is the
  model's usual wrapper (SERVING_SPEC §5, vllm-ascend #13204); a ``bare`` constraint is the value alone;
- tool calls (required / named): ``[[<|open|>response<|sep|>] text <|close|>response<|sep|>]
  [<|open|>tools<|sep|>] call+ <|close|>tools<|sep|> [<|close|>message<|sep|>]`` (no ``text`` when the
  constraint's ``allow_text`` is off: the response channel, if opened, closes at once) where a call is
  ``<|open|>call tool="NAME" index="N"<|sep|>`` + one argument tag per schema property (declared order;
  optional ones may be left out) + ``<|close|>call<|sep|>``; an argument is ``<|open|>argument key="K"
  type="T"<|sep|>VALUE<|close|>argument<|sep|>`` with T from the property's JSON-schema type (integer ->
  number); string values are free text without markers (``enum``/``const`` = those strings, ``pattern`` = that
  regex, ``minLength`` / ``maxLength`` bound the characters, the first ``minLength`` of them not ``<``), other
  values are JSON under the property's schema (the root ``$defs`` re-attached); union or untyped properties may
  take any of their types; a tool without properties takes any argument tags. What this XTML grammar cannot
  hold is refused (ValueError naming the keyword): a string argument's ``format``, constraints other than
  ``type`` / ``maxLength`` on a union or untyped argument, ``minProperties`` / ``maxProperties`` /
  ``propertyNames`` on the parameters, and
  ``additionalProperties`` on parameters without ``properties``.

Kimi K2 / Kimi Linear (after ``</think>``, or from the start when thinking is off): content constraints are the
bare value; tool calls are ``[text] [<|tool_calls_section_begin|>] (<|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{JSON under the parameters schema}<|tool_call_end|>)+ <|tool_calls_section_end|>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from xgrammar import structural_tag as st

from rocm_k3.formats.parsers import kimi_k2, kimi_k3
from rocm_k3.structured.json_schema import normalize_json_schema
from rocm_k3.structured.schema_keywords import ANNOTATIONS, DEFINITIONS, check_schema_keywords
from rocm_k3.structured.spec import StructuredOutputs, ToolCallConstraint, ToolSchema
from rocm_k3.structured.vocab import FamilyTokens

JSON_MAX_WHITESPACE = 2  # whitespace characters allowed between two JSON tokens ("{ \"a\": 1 }", ",\n ")

XTML_TYPES = ("string", "number", "boolean", "null", "object", "array")
_JSON_TO_XTML = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean",
                 "null": "null", "object": "object", "array": "array"}
_KEY_PATTERN = r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}"
_MAX_REF_DEPTH = 8


class _Builder:
    """Builds the formats of one family with its token ids."""

    def __init__(self, tokens: FamilyTokens) -> None:
        self.tokens = tokens
        self.family = tokens.family
        # texts the parser reads as markers: never produced inside free text
        self.excludes = list((kimi_k3.KIMI_K3 if self.family == "kimi_k3" else kimi_k2.KIMI_K2).special_texts)

    # -- pieces ---------------------------------------------------------------------------------------------

    def marker(self, text: str) -> st.Format:
        """``text`` with its special-token parts as tokens (by id) and the rest as literal text."""
        parts: list[st.Format] = [st.TokenFormat(token=p) if isinstance(p, int) else st.ConstStringFormat(value=p)
                                  for p in self.tokens.pieces(text)]
        return parts[0] if len(parts) == 1 else st.SequenceFormat(elements=parts)

    def free_text(self, max_chars: int | None = None) -> st.Format:
        return st.AnyTextFormat(excludes=self.excludes, max_chars=max_chars)

    @staticmethod
    def json_value(schema: Any) -> st.Format:
        # no ``excludes`` here: xgrammar then drops minLength/maxLength, and the schema must hold; marker
        # tokens cannot occur in JSON anyway (their encoding is not UTF-8), only a byte-by-byte spelling could.
        # Whitespace between JSON tokens is bounded (JSON_MAX_WHITESPACE): with unbounded whitespace a model
        # that likes newlines fills max_tokens with them inside an unfinished value (vLLM's
        # disable_any_whitespace answers the same failure).
        return st.JSONSchemaFormat(json_schema=normalize_json_schema(schema), max_whitespace_cnt=JSON_MAX_WHITESPACE)

    @staticmethod
    def optional(fmt: st.Format) -> st.Format:
        return st.OptionalFormat(content=fmt)

    @staticmethod
    def seq(*parts: st.Format) -> st.Format:
        return st.SequenceFormat(elements=list(parts))

    # -- content constraints --------------------------------------------------------------------------------

    def content(self, spec: StructuredOutputs) -> st.Format:
        kind = spec.kind
        if kind == "json":
            value: st.Format = self.json_value(spec.json)
        elif kind == "json_object":
            value = self.json_value({"type": "object"})
        elif kind == "regex":
            value = st.RegexFormat(pattern=spec.regex)
        elif kind == "choice":
            options = [st.ConstStringFormat(value=c) for c in spec.choice]
            value = options[0] if len(options) == 1 else st.OrFormat(elements=options)
        elif kind == "grammar":
            value = st.GrammarFormat(grammar=spec.grammar)
        else:
            raise ValueError(f"content constraint: unexpected kind {kind!r}")
        if self.family != "kimi_k3" or spec.bare:
            return value
        return self.seq(self.optional(self.marker(kimi_k3.RESPONSE_OPEN)), value,
                        self.optional(self.marker(kimi_k3.RESPONSE_CLOSE)),
                        self.optional(self.marker(kimi_k3.MESSAGE_CLOSE)))

    # -- tool calls -----------------------------------------------------------------------------------------

    def tool_calls(self, constraint: ToolCallConstraint) -> st.Format:
        if self.family == "kimi_k3":
            calls = [self._k3_call(t) for t in constraint.tools]
        else:
            calls = [self._k2_call(t) for t in constraint.tools]
        one = calls[0] if len(calls) == 1 else st.OrFormat(elements=calls)
        several = one if constraint.mode == "named" or not constraint.parallel else st.PlusFormat(content=one)
        if self.family == "kimi_k3":
            body = [self.free_text()] if constraint.allow_text else []
            response = self.seq(self.optional(self.marker(kimi_k3.RESPONSE_OPEN)), *body,
                                self.marker(kimi_k3.RESPONSE_CLOSE))
            return self.seq(self.optional(response), self.optional(self.marker(kimi_k3.TOOLS_OPEN)), several,
                            self.marker(kimi_k3.TOOLS_CLOSE), self.optional(self.marker(kimi_k3.MESSAGE_CLOSE)))
        text = [self.optional(self.free_text())] if constraint.allow_text else []
        return self.seq(*text, self.optional(self.marker(kimi_k2.SECTION_BEGIN)), several,
                        self.marker(kimi_k2.SECTION_END))

    def _k2_call(self, tool: ToolSchema) -> st.Format:
        params: Any = tool.parameters if tool.parameters is not None else {"type": "object"}
        return self.seq(self.marker(kimi_k2.CALL_BEGIN + f"functions.{tool.name}:"), st.RegexFormat(pattern=r"[0-9]{1,3}"),
                        self.marker(kimi_k2.ARGUMENT_BEGIN), self.json_value(params),
                        self.marker(kimi_k2.CALL_END))

    def _k3_call(self, tool: ToolSchema) -> st.Format:
        _check_k3_parameters(tool)
        head = self.seq(self.marker(f'{kimi_k3.CALL_OPEN} tool="{_escape_attr(tool.name)}" index="'),
                        st.RegexFormat(pattern=r"[1-9][0-9]{0,2}"), self.marker('"' + kimi_k3.SEP))
        params = tool.parameters or {}
        props = params.get("properties") if isinstance(params, Mapping) else None
        if isinstance(props, Mapping) and props:
            required = set(params.get("required") or ())
            args = [self._k3_argument(key, _resolve(prop, params), params) for key, prop in props.items()]
            args = [a if key in required else self.optional(a) for a, key in zip(args, props)]
        else:
            args = [st.StarFormat(content=self._k3_any_argument())]
        return self.seq(head, *args, self.marker(kimi_k3.CALL_CLOSE))

    def _k3_argument(self, key: str, prop: Any, root: Mapping[str, Any]) -> st.Format:
        types = _xtml_types(prop)
        _check_k3_argument(key, prop, types)
        if types is not None and len(types) == 1:
            (t,) = types
            value = self._k3_string_value(prop) if t == "string" else self.json_value(_with_defs(prop, root))
            return self._k3_arg_tag(self.marker(f'{kimi_k3.OPEN}argument key="{_escape_attr(key)}" type="{t}"'
                                                + kimi_k3.SEP), value)
        typed = [self._k3_typed_tail(t, prop if isinstance(prop, Mapping) else {}) for t in (types or XTML_TYPES)]
        return self._k3_arg_tag(self.seq(self.marker(f'{kimi_k3.OPEN}argument key="{_escape_attr(key)}"'),
                                         st.OrFormat(elements=typed)), None)

    def _k3_any_argument(self) -> st.Format:
        tails = [self._k3_typed_tail(t, {}) for t in XTML_TYPES]
        return self._k3_arg_tag(self.seq(self.marker(f'{kimi_k3.OPEN}argument key="'),
                                         st.RegexFormat(pattern=_KEY_PATTERN), st.ConstStringFormat(value='"'),
                                         st.OrFormat(elements=tails)), None)

    def _k3_typed_tail(self, t: str, prop: Mapping[str, Any]) -> st.Format:
        """`` type="T"<|sep|>VALUE`` for a permissive (union / untyped) argument."""
        if t == "string":
            value = self._k3_string_value({k: v for k, v in prop.items() if k in ("maxLength",)})
        else:
            value = self.json_value({"type": t})
        return self.seq(self.marker(f' type="{t}"' + kimi_k3.SEP), value)

    def _k3_arg_tag(self, head: st.Format, value: st.Format | None) -> st.Format:
        parts = [head] if value is None else [head, value]
        return self.seq(*parts, self.marker(kimi_k3.close_tag("argument")))

    def _k3_string_value(self, prop: Any) -> st.Format:
        prop = prop if isinstance(prop, Mapping) else {}
        if "const" in prop or "enum" in prop:
            values = [prop["const"]] if "const" in prop else list(prop["enum"])
            options = [st.ConstStringFormat(value=v) for v in dict.fromkeys(values) if isinstance(v, str) and v]
            if not options:
                raise ValueError(f"string property: enum/const {values!r} has no non-empty string")
            return options[0] if len(options) == 1 else st.OrFormat(elements=options)
        if isinstance(prop.get("pattern"), str):
            return st.RegexFormat(pattern=prop["pattern"])
        max_len = prop.get("maxLength")
        max_len = max_len if isinstance(max_len, int) and max_len >= 0 else None
        min_len = prop.get("minLength")
        if not isinstance(min_len, int) or min_len <= 0:
            return self.free_text(max_chars=max_len)
        # the first minLength characters without "<" (no marker can start there), then free text for the rest
        head = st.RegexFormat(pattern=f"[^<]{{{min_len}}}")
        if max_len is not None and max_len <= min_len:
            return head
        return self.seq(head, self.free_text(max_chars=None if max_len is None else max_len - min_len))


_K3_STRING_KEYS = frozenset({"type", "enum", "const", "pattern", "minLength", "maxLength"})
_K3_UNION_KEYS = frozenset({"type", "maxLength"})


def _k3_refused(where: str, key: str, why: str) -> ValueError:
    return ValueError(f"{where}: JSON-schema keyword {key!r} is not supported in a Kimi K3 tool call: {why}")


def _check_k3_parameters(tool: ToolSchema) -> None:
    params = tool.parameters or {}
    where = f"tools[{tool.name!r}].function.parameters"
    for key in ("minProperties", "maxProperties", "propertyNames"):
        if key in params:
            raise _k3_refused(where, key, "each argument is a tag of its own; the count and names are not bounded")
    if not params.get("properties") and params.get("additionalProperties", True) is not True:
        raise _k3_refused(where, "additionalProperties", "a tool without properties takes any arguments")


def _check_k3_argument(key: str, prop: Any, types: list[str] | None) -> None:
    """Refuse what the XTML argument grammar would drop: string arguments are free text (enum/const, pattern,
    minLength and maxLength held), union or untyped ones take any value of their types (only maxLength held)."""
    if not isinstance(prop, Mapping):
        return
    where = f"parameters.properties.{key}"
    if types is not None and len(types) == 1 and types != ["string"]:
        return  # JSON under the property's own schema: every keyword holds
    allowed = _K3_STRING_KEYS if types == ["string"] else _K3_UNION_KEYS
    if "anyOf" in prop and all(isinstance(b, Mapping) and set(b) - ANNOTATIONS <= {"type"} for b in prop["anyOf"]):
        allowed = allowed | {"anyOf"}
    for k in prop:
        if k not in allowed and k not in ANNOTATIONS and k not in DEFINITIONS and not k.startswith("x-"):
            raise _k3_refused(where, k, "string arguments hold enum/const, pattern, minLength and maxLength only; "
                                        "arguments of several types hold their types (and maxLength) only")


def _escape_attr(value: str) -> str:
    """The renderer's attribute escaping: ``&`` first, then ``"``."""
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _resolve(prop: Any, root: Mapping[str, Any], depth: int = 0) -> Any:
    """Follow a local ``$ref`` (``#/$defs/X`` or ``#/definitions/X``) of a property schema."""
    if not isinstance(prop, Mapping) or "$ref" not in prop or depth >= _MAX_REF_DEPTH:
        return prop
    ref = prop["$ref"]
    for section in ("$defs", "definitions"):
        prefix = f"#/{section}/"
        if isinstance(ref, str) and ref.startswith(prefix) and isinstance(root.get(section), Mapping):
            target = root[section].get(ref[len(prefix):].replace("~1", "/").replace("~0", "~"))
            if target is not None:
                return _resolve(target, root, depth + 1)
    raise ValueError(f"tool parameters: cannot resolve $ref {ref!r}")


def _with_defs(prop: Any, root: Mapping[str, Any]) -> Any:
    if not isinstance(prop, Mapping):
        return prop
    extra = {k: root[k] for k in ("$defs", "definitions") if k in root and k not in prop}
    return {**prop, **extra} if extra else prop


def _xtml_types(prop: Any) -> list[str] | None:
    """The XTML type names a property may take, or None when any type is allowed."""
    if not isinstance(prop, Mapping):
        return None
    t = prop.get("type")
    if isinstance(t, str):
        return [_JSON_TO_XTML[t]] if t in _JSON_TO_XTML else None
    if isinstance(t, list) and t and all(x in _JSON_TO_XTML for x in t):
        return list(dict.fromkeys(_JSON_TO_XTML[x] for x in t))
    values = [prop["const"]] if "const" in prop else prop.get("enum")
    if isinstance(values, list) and values:
        names = {str: "string", bool: "boolean", int: "number", float: "number", type(None): "null",
                 dict: "object", list: "array"}
        return list(dict.fromkeys(names[type(v)] for v in values if type(v) in names)) or None
    branches = prop.get("anyOf") or prop.get("oneOf")
    if isinstance(branches, list) and branches:
        out: list[str] = []
        for b in branches:
            bt = _xtml_types(b)
            if bt is None:
                return None
            out.extend(bt)
        return list(dict.fromkeys(out))
    return None


def structural_tag_for(spec: StructuredOutputs, tokens: FamilyTokens) -> st.StructuralTag:
    """The structural tag of ``spec`` for ``tokens.family``."""
    if spec.kind == "structural_tag":
        return st.StructuralTag.model_validate(spec.structural_tag)
    if spec.kind == "json":
        check_schema_keywords(spec.json, "schema")
    elif spec.kind == "tools":
        for tool in spec.tools.tools:
            if tool.parameters is not None:
                check_schema_keywords(tool.parameters, f"tools[{tool.name!r}].function.parameters")
    builder = _Builder(tokens)
    fmt = builder.tool_calls(spec.tools) if spec.kind == "tools" else builder.content(spec)
    return st.StructuralTag(format=fmt)
