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
- a call is ``<|open|>call tool="NAME" index="k"<|sep|>`` + argument blocks (or one ``json`` block holding a
  JSON object) + ``<|close|>call<|sep|>``; typed argument values become JSON (``string`` raw, other types parsed
  with ``json``, unparsable values kept as strings); attribute values are unescaped (``&quot;`` then ``&amp;``);
  a key seen twice keeps its first value, so that streamed argument pieces are a prefix of the final JSON;
- a call is returned only when it is well formed: a header naming a tool, then only closed blocks separated by
  whitespace, each argument block with a ``key``, no markup (``<|open|>``, ``<|close|>``, ``<|sep|>``, end
  markers) inside a name, attribute or value, a json block alone and valid. Anything else (and a call cut off
  before its close) is not a call: the scanner keeps its text as content (markers removed);
- markers are matched exactly as the detokenizer writes them (no spaces between special tokens). A string
  argument that literally contains ``<|close|>argument<|sep|>`` cannot be told from the real close.
"""

from __future__ import annotations

import json
import re

from rocm_k3.formats.parsers.types import (FamilyMarkers, FamilySpec, ParseOptions, ToolCall, json_object_or_none,
                                           loads_strict)

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
_BLOCK_OPEN = re.compile(
    r"\s*" + re.escape(OPEN) + r"(argument|json)((?:\s+[A-Za-z_][\w.\-]*=\"[^\"]*\")*)\s*" + re.escape(SEP))
SPECIALS = (OPEN, CLOSE, SEP, END_OF_MSG, EOS)


def has_special(text: str) -> bool:
    """Whether ``text`` holds a special-token text (markup never belongs inside a name or a value)."""
    return any(s in text for s in SPECIALS)


def unescape_attr(value: str) -> str:
    """Undo the renderer's attribute escaping (``&`` -> ``&amp;`` first, then ``"`` -> ``&quot;``)."""
    return value.replace("&quot;", '"').replace("&amp;", "&")


def parse_attrs(header: str) -> dict[str, str] | None:
    """``' key="v" k2="w"'`` -> ``{"key": "v", "k2": "w"}`` (unescaped); None when the header is malformed."""
    if has_special(header):
        return None
    attrs: dict[str, str] = {}
    pos = 0
    while pos < len(header):
        m = _ATTR.match(header, pos)
        if m is None:
            return None if header[pos:].strip() else attrs
        attrs[m.group(1)] = unescape_attr(m.group(2))
        pos = m.end()
    return attrs


def typed_value(type_name: str | None, raw: str) -> object:
    """An XTML argument's value: ``string`` keeps the raw text; any other type is parsed as JSON (strict: no
    NaN/Infinity), and a value that does not parse is kept as the raw string."""
    if type_name == "string":
        return raw
    try:
        return loads_strict(raw)
    except ValueError:
        return raw


def _header(body: str) -> tuple[dict[str, str], str] | None:
    """(the call's attributes, the text after its header) when the header is well formed and names a tool."""
    header, sep, rest = body.partition(SEP)
    if not sep or (header and not header[0].isspace()):
        return None  # "<|open|>callx..." or no header end: not a call
    attrs = parse_attrs(header)
    if attrs is None or not attrs.get("tool"):
        return None
    return attrs, rest


def parse_call(body: str, index: int, opts: ParseOptions) -> ToolCall | None:
    """One call: ``body`` = ``' tool="N" index="k"<|sep|>' + blocks`` (the text after ``<|open|>call``); None
    when it is malformed (see the module docstring)."""
    head = _header(body)
    if head is None:
        return None
    attrs, rest = head
    blocks, end = _blocks(rest)
    if rest[end:].strip():
        return None  # text that is not a block, a block not closed, or markup inside a value
    if any(kind == "json" for kind, _, _ in blocks):
        if len(blocks) != 1 or not isinstance(json_object_or_none(blocks[0][2]), dict):
            return None  # a json block is the call's only block and holds a JSON object
        args_json = blocks[0][2]
    else:
        args_json = json.dumps(_arguments(blocks), ensure_ascii=False)
    return ToolCall(id=f"{opts.call_id_prefix}{index}", name=attrs["tool"], arguments_json=args_json, index=index)


def _blocks(rest: str) -> tuple[list[tuple[str, dict[str, str], str]], int]:
    """The well-formed closed blocks at the start of ``rest`` (kind, attributes, value) and where they end: a
    block is ``<|open|>KIND attrs<|sep|>value<|close|>KIND<|sep|>`` with no markup inside ``value``, an argument
    block has a ``key``; blocks are separated by whitespace only. Scanning stops at anything else."""
    blocks: list[tuple[str, dict[str, str], str]] = []
    pos = 0
    while True:
        m = _BLOCK_OPEN.match(rest, pos)
        if m is None:
            return blocks, pos
        kind, attrs = m.group(1), parse_attrs(m.group(2))
        close = close_tag(kind)
        at = rest.find(close, m.end())
        if attrs is None or (kind == "argument" and not attrs.get("key")) or at < 0 \
                or has_special(rest[m.end():at]):
            return blocks, pos
        blocks.append((kind, attrs, rest[m.end():at]))
        pos = at + len(close)


def _arguments(blocks: list[tuple[str, dict[str, str], str]]) -> dict[str, object]:
    """The typed argument blocks as a dict (the first value of a key wins)."""
    arguments: dict[str, object] = {}
    for _, attrs, value in blocks:
        if attrs["key"] not in arguments:
            arguments[attrs["key"]] = typed_value(attrs.get("type"), value)
    return arguments


def partial_call(body: str, index: int, opts: ParseOptions) -> ToolCall | None:
    """The call being written, with the fixed prefix of its arguments JSON: a leading json block's text as it
    arrives (up to any markup in it), or ``{"k": v`` + ``, "k2": v2`` ... for each well-formed argument block
    once closed (json.dumps' separators). The prefix only grows as text arrives."""
    head = _header(body)
    if head is None:
        return None
    attrs, rest = head
    opened = _BLOCK_OPEN.match(rest)
    if opened is not None and opened.group(1) == "json" and parse_attrs(opened.group(2)) is not None:
        raw = rest[opened.end():]
        ends = [at for at in (raw.find(s) for s in SPECIALS) if at >= 0]
        if ends:
            raw = raw[:min(ends)]
        else:  # hold back a tail that may be the start of markup
            raw = raw[:len(raw) - max(_held(raw, s) for s in SPECIALS)]
        prefix = raw
    else:
        blocks, _ = _blocks(rest)
        blocks = [b for b in blocks if b[0] == "argument"]
        prefix = json.dumps(_arguments(blocks), ensure_ascii=False)[:-1] if blocks else ""
    return ToolCall(id=f"{opts.call_id_prefix}{index}", name=attrs["tool"], arguments_json=prefix, index=index)


def _held(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    return next((k for k in range(min(len(text), len(marker) - 1), 0, -1) if marker.startswith(text[-k:])), 0)


KIMI_K3 = FamilySpec(
    name="kimi_k3",
    markers=FamilyMarkers(think_open=THINK_OPEN, think_close=THINK_CLOSE, tools_open=TOOLS_OPEN,
                          tools_close=TOOLS_CLOSE, call_open=CALL_OPEN, call_close=CALL_CLOSE,
                          wrappers=(RESPONSE_OPEN, RESPONSE_CLOSE), ends=(MESSAGE_CLOSE, END_OF_MSG, EOS)),
    special_texts=(OPEN, CLOSE, SEP, END_OF_MSG, EOS),
    parse_call=parse_call,
    partial_call=partial_call,
)
