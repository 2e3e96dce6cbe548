"""Limits on JSON that comes from outside (request bodies, tool-call arguments in a chat history): every JSON text
the server parses goes through :func:`load_json`, so no body can make it recurse without bound, spend seconds on
one number, or carry a string that cannot be written back as UTF-8.

vLLM and SGLang set none of these limits (a body nested 100k deep or an integer of 5000 digits gets a 500 there);
these are ours, documented in README.md ("Request limits"):

- ``MAX_JSON_DEPTH``: arrays/objects nested at most this deep (a chat body is about 6 deep, a tool schema
  seldom over 20);
- ``MAX_NUMBER_CHARS``: a number literal (integer or float) of at most this many characters (an int64 has 20;
  Python refuses integers of over 4300 digits anyway, with a ValueError that is no JSON error);
- no ``NaN`` / ``Infinity`` / ``-Infinity`` (not JSON; Python's ``json`` reads them by default);
- no lone UTF-16 surrogates (``"\\ud800"``): they are not Unicode scalar values, so no tokenizer can encode them
  and no response could carry them.

Every violation is a :class:`JSONLimitError` (a ValueError) naming where it is and the limit.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_JSON_DEPTH = 128
MAX_NUMBER_CHARS = 100


class JSONLimitError(ValueError):
    """JSON text that is not valid JSON or breaks one of the limits above; the message names where and which."""


class NotJSONError(JSONLimitError):
    """Text that is not JSON at all (a syntax or encoding error)."""


def _number(kind: type):
    def parse(text: str) -> Any:
        if len(text) > MAX_NUMBER_CHARS:
            raise JSONLimitError(f"a number of {len(text)} characters (the limit is {MAX_NUMBER_CHARS})")
        return kind(text)

    return parse


def _constant(name: str) -> Any:
    raise JSONLimitError(f"{name} is not a JSON number")


_PARSE_INT = _number(int)
_PARSE_FLOAT = _number(float)


def load_json(text: str | bytes, where: str) -> Any:
    """``text`` parsed as JSON within the limits (JSONLimitError naming ``where`` otherwise)."""
    try:
        value = json.loads(text, parse_int=_PARSE_INT, parse_float=_PARSE_FLOAT, parse_constant=_constant)
    except JSONLimitError as exc:
        raise JSONLimitError(f"{where}: {exc}") from None
    except RecursionError:
        raise JSONLimitError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise NotJSONError(f"{where}: not valid JSON ({exc})") from None
    check_json_value(value, where)
    return value


def _path(where: str, keys: tuple, shown: int = 8) -> str:
    text = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys[:shown])
    return where + text + ("..." if len(keys) > shown else "")


def _check_text(text: str, where: str, keys: tuple, what: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise JSONLimitError(f"{_path(where, keys)}: {what} holds a lone UTF-16 surrogate "
                             f"{text[exc.start]!r} at position {exc.start} (not valid Unicode)") from None


def check_json_value(value: Any, where: str) -> None:
    """The depth and string limits above for an already-parsed value (iterative: no recursion on hostile input)."""
    stack: list[tuple[Any, tuple, int]] = [(value, (), 0)]
    while stack:
        item, keys, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, where, keys, "a string")
        elif isinstance(item, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise JSONLimitError(f"{_path(where, keys)}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(item, dict):
                for k, v in item.items():
                    if isinstance(k, str):
                        _check_text(k, where, keys, "a key")
                    stack.append((v, keys + (k,), depth + 1))
            else:
                stack.extend((v, keys + (i,), depth + 1) for i, v in enumerate(item))
        elif isinstance(item, float) and not math.isfinite(item):
            raise JSONLimitError(f"{_path(where, keys)}: {item} is not a JSON number")
