"""Kimi K3 XTML output: markers, reasoning rules and tool-call decoding (SERVING_SPEC §3.1-3.4, §4.1).

An assistant turn is ``[think-body <|close|>think<|sep|>] [<|open|>response<|sep|>] body <|close|>response<|sep|>
[<|open|>tools<|sep|> call+ <|close|>tools<|sep|>] <|close|>message<|sep|> <|end_of_msg|>``; the prompt holds the
opener of the first channel. Rules beyond the happy path:

- reasoning ends only when the newest think marker is a close; a response-open, response-close or tools-open
  (or a call-open) seen inside think ends it too (vLLM #53246: the model sometimes never closes think);
- after think-close the text may be raw JSON with no response wrapper, or have a response-close without an
  open (vllm-ascend #13204): it is all content, never an error;
- the message close, ``<|end_of_msg|>`` and the tokenizer eos ``[EOS]`` end the turn and never reach the
  content (vLLM #51412); text after them is not part of this message and is dropped;
- a call is ``<|open|>call tool="NAME" index="k"<|sep|>`` + argument blocks (or one ``json`` block) +
  ``<|close|>call<|sep|>``; typed argument values become JSON (``string`` raw, other types parsed with
  ``json``, unparsable values kept as strings); attribute values are unescaped (``&quot;`` then ``&amp;``); a
  call without a tool name is dropped; a call cut off before its close is dropped;
- a call's arguments are the first ``json`` block when the call starts with one, else its argument blocks (a
  key seen twice keeps its first value), so that streamed argument pieces are a prefix of the final JSON;
- markers are matched exactly as the detokenizer writes them (no spaces between special tokens). A string
  argument that literally contains ``<|close|>argument<|sep|>`` cannot be told from the real close.
"""

from __future__ import annotations

import json
import re

from rocm_k3.formats.parsers.types import FamilyMarkers, FamilySpec, ParseOptions, ToolCall

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
EOS = "[EOS]"  # the tokenizer eos, also a stop token


def open_tag(name: str) -> str:
    return f"{OPEN}{name}{SEP}"


def close_tag(name: str) -> str:
    return f"{CLOSE}{name}{SEP}"


THINK_OPEN, THINK_CLOSE = open_tag("think"), close_tag("think")
RESPONSE_OPEN, RESPONSE_CLOSE = open_tag("response"), close_tag("response")
TOOLS_OPEN, TOOLS_CLOSE = open_tag("tools"), close_tag("tools")
MESSAGE_CLOSE = close_tag("message")
CALL_OPEN = f"{OPEN}call"  # the header (attributes, then <|sep|>) is part of the call body
CALL_CLOSE = close_tag("call")

_ATTR = re.compile(r'\s*([A-Za-z_][\w.\-]*)="([^"]*)"')
_BLOCK = re.compile(
    re.escape(OPEN) + r"(argument|json)((?:\s+[A-Za-z_][\w.\-]*=\"[^\"]*\")*)\s*" + re.escape(SEP)
    + r"(.*?)" + re.escape(CLOSE) + r"\1" + re.escape(SEP),
    re.DOTALL,
)


def unescape_attr(value: str) -> str:
    """Undo the renderer's attribute escaping (``&`` -> ``&amp;`` first, then ``"`` -> ``&quot;``)."""
    return value.replace("&quot;", '"').replace("&amp;", "&")


def parse_attrs(header: str) -> dict[str, str] | None:
    """``' key="v" k2="w"'`` -> ``{"key": "v", "k2": "w"}`` (unescaped); None when the header is malformed."""
    attrs: dict[str, str] = {}
    pos = 0
    while pos < len(header):
        m = _ATTR.match(header, pos)
        if m is None:
            return None if header[pos:].strip() else attrs
        attrs[m.group(1)] = unescape_attr(m.group(2))
        pos = m.end()
    return attrs


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def typed_value(type_name: str | None, raw: str) -> object:
    """An XTML argument's value: ``string`` keeps the raw text; any other type is parsed as JSON (strict: no
    NaN/Infinity), and a value that does not parse is kept as the raw string."""
    if type_name == "string":
        return raw
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        return raw


def parse_call(body: str, index: int, opts: ParseOptions) -> ToolCall | None:
    """One call: ``body`` = ``' tool="N" index="k"<|sep|>' + blocks`` (the text after ``<|open|>call``)."""
    header, sep, rest = body.partition(SEP)
    if not sep or (header and not header[0].isspace()):
        return None  # "<|open|>callx..." or no header end: not a call
    attrs = parse_attrs(header)
    if attrs is None or not attrs.get("tool"):
        return None
    raw_json, arguments = _arguments(rest)
    args_json = raw_json if raw_json is not None else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"{opts.call_id_prefix}{index}", name=attrs["tool"], arguments_json=args_json, index=index)


def _arguments(rest: str) -> tuple[str | None, dict[str, object]]:
    """(the raw text of a leading json block, or None; the typed argument blocks, first value of a key wins)."""
    arguments: dict[str, object] = {}
    for m in _BLOCK.finditer(rest):
        kind, block_attrs, value = m.group(1), parse_attrs(m.group(2)) or {}, m.group(3)
        if kind == "json":
            if not arguments:
                return value, {}
        elif block_attrs.get("key") and block_attrs["key"] not in arguments:
            arguments[block_attrs["key"]] = typed_value(block_attrs.get("type"), value)
    return None, arguments


_JSON_OPEN = open_tag("json")
_JSON_CLOSE = close_tag("json")


def partial_call(body: str, index: int, opts: ParseOptions) -> ToolCall | None:
    """The call being written, with the fixed prefix of its arguments JSON: a leading json block's text as it
    arrives, or ``{"k": v`` + ``, "k2": v2`` ... for each argument block once closed (json.dumps' separators)."""
    header, sep, rest = body.partition(SEP)
    if not sep or (header and not header[0].isspace()):
        return None
    attrs = parse_attrs(header)
    if attrs is None or not attrs.get("tool"):
        return None
    start = rest.lstrip()
    if start.startswith(_JSON_OPEN):
        raw = start[len(_JSON_OPEN):]
        end = raw.find(_JSON_CLOSE)
        if end >= 0:
            raw = raw[:end]
        else:  # hold back a tail that may be the start of the block's close
            raw = raw[:len(raw) - next((k for k in range(min(len(raw), len(_JSON_CLOSE)), 0, -1)
                                        if _JSON_CLOSE.startswith(raw[-k:])), 0)]
        prefix = raw
    else:
        _, arguments = _arguments(rest)
        prefix = json.dumps(arguments, ensure_ascii=False)[:-1] if arguments else ""
    return ToolCall(id=f"{opts.call_id_prefix}{index}", name=attrs["tool"], arguments_json=prefix, index=index)


KIMI_K3 = FamilySpec(
    name="kimi_k3",
    markers=FamilyMarkers(think_open=THINK_OPEN, think_close=THINK_CLOSE, tools_open=TOOLS_OPEN,
                          tools_close=TOOLS_CLOSE, call_open=CALL_OPEN, call_close=CALL_CLOSE,
                          wrappers=(RESPONSE_OPEN, RESPONSE_CLOSE), ends=(MESSAGE_CLOSE, END_OF_MSG, EOS)),
    special_texts=(OPEN, CLOSE, SEP, END_OF_MSG, EOS),
    parse_call=parse_call,
    partial_call=partial_call,
)
