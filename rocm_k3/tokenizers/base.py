"""The tokenizer interface every rocm-k3 tokenizer implements, and the helpers the implementations share.

The engine, the detokenizer, the structured-output helper and the server depend on exactly these names:

- ``vocab_size``: ids are ``0 <= id < vocab_size``; no tokenizer ever produces or accepts an id outside.
- ``encode(text, *, allow_special=False)``: with ``allow_special`` False every character is ordinary text (a
  user typing ``<|open|>`` gets its plain bytes); True also matches the special-token strings.
- ``decode(ids)``: specials come out as their text, with no spaces added around them.
- ``token_bytes(id)``: the raw bytes of a normal token, the UTF-8 of a special's string (xgrammar's vocabulary
  and the incremental detokenizer read this).
- ``special_tokens`` (string -> id), ``eos_token_ids`` (the generation stop ids), ``bos_token_id``,
  ``pad_token_id``.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rocm_k3 import checkpoint_io


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used (not a regular file, bad UTF-8 / JSON, wrong fields); names the file."""


@runtime_checkable
class TokenTable(Protocol):
    """The id-level facts of a tokenizer: its size, special tokens, stop ids and each id's bytes (all the grammar
    engine reads: :mod:`rocm_k3.structured.vocab`)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def special_tokens(self) -> Mapping[str, int]: ...

    @property
    def eos_token_ids(self) -> Sequence[int]: ...

    def token_bytes(self, token_id: int) -> bytes: ...


@runtime_checkable
class Tokenizer(TokenTable, Protocol):
    """What the engine and the server need from a tokenizer (see the module docstring): a :class:`TokenTable`
    that also encodes and decodes text."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def pad_token_id(self) -> int | None: ...

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class SpecialIds:
    """The id facts of a tokenizer (``vocab_size``, ``special_tokens``, eos/bos/pad), validated once; the
    tiktoken and tokenizer.json tokenizers build on it."""

    def __init__(self, vocab_size: int, special_tokens: Mapping[str, int], *, eos_token_ids: Sequence[int],
                 bos_token_id: int | None, pad_token_id: int | None, source: str) -> None:
        self._vocab_size = vocab_size
        self._specials: Mapping[str, int] = types.MappingProxyType(dict(special_tokens))
        self._eos = check_stop_ids(eos_token_ids, vocab_size, source=source)
        self._bos = None if bos_token_id is None else check_token_id(bos_token_id, vocab_size)
        self._pad = None if pad_token_id is None else check_token_id(pad_token_id, vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def special_tokens(self) -> Mapping[str, int]:
        return self._specials

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def pad_token_id(self) -> int | None:
        return self._pad


def reserved_token_name(token_id: int) -> str:
    """The name of an unnamed special slot, as the Kimi tokenizers call it."""
    return f"<|reserved_token_{token_id}|>"


def fill_special_slots(named: Mapping[str, int], start: int, stop: int, *, source: str) -> dict[str, int]:
    """Every id in [start, stop) named: ``named`` (validated: ids in range, names and ids unique) plus
    ``<|reserved_token_{id}|>`` for the gaps. Returns the map ordered by id."""
    by_id: dict[int, str] = {}
    for name, token_id in named.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{source}: special token names must be non-empty strings, got {name!r}")
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not start <= token_id < stop:
            raise ValueError(f"{source}: special token {name!r} has id {token_id!r}, expected an int in "
                             f"[{start}, {stop})")
        if token_id in by_id:
            raise ValueError(f"{source}: special tokens {by_id[token_id]!r} and {name!r} share id {token_id}")
        by_id[token_id] = name
    out = {by_id.get(i, reserved_token_name(i)): i for i in range(start, stop)}
    if len(out) != stop - start:
        raise ValueError(f"{source}: a special token is named like a reserved slot of another id")
    return out


def special_split_pattern(specials: Mapping[str, int]) -> re.Pattern[str] | None:
    """A regex matching any special-token string (longest first, so no special shadows a longer one)."""
    if not specials:
        return None
    names = sorted(specials, key=len, reverse=True)
    return re.compile("|".join(re.escape(n) for n in names))


def split_specials(text: str, pattern: re.Pattern[str] | None) -> Iterator[tuple[str, bool]]:
    """(piece, is_special) in order: the special-token strings of ``text`` and the ordinary text between them."""
    if pattern is None:
        if text:
            yield text, False
        return
    pos = 0
    for match in pattern.finditer(text):
        if match.start() > pos:
            yield text[pos:match.start()], False
        yield match.group(), True
        pos = match.end()
    if pos < len(text):
        yield text[pos:], False


def check_text(text: Any) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text: expected str, got {type(text).__name__}")
    return text


def utf8(text: str) -> bytes:
    """UTF-8 of ``text``, a lone surrogate (not encodable) becoming U+FFFD as tiktoken does."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")


def check_token_id(token_id: Any, vocab_size: int) -> int:
    """``token_id`` as an int in [0, vocab_size), else a ValueError/TypeError naming it."""
    if isinstance(token_id, bool) or not hasattr(token_id, "__index__"):
        raise TypeError(f"token id {token_id!r}: expected an int")
    value = token_id.__index__()
    if not 0 <= value < vocab_size:
        raise ValueError(f"token id {value} is outside the vocabulary [0, {vocab_size})")
    return value


def check_token_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    return [check_token_id(t, vocab_size) for t in ids]


def check_stop_ids(ids: Sequence[int], vocab_size: int, *, source: str) -> tuple[int, ...]:
    """Validated, de-duplicated (first occurrence kept) stop ids."""
    out: list[int] = []
    for t in ids:
        try:
            value = check_token_id(t, vocab_size)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: eos token id: {exc}") from exc
        if value not in out:
            out.append(value)
    return tuple(out)


def read_json_object(file: Path) -> dict[str, Any]:
    """A JSON object from ``file`` (read by :func:`rocm_k3.checkpoint_io.read_json`); bad UTF-8, bad JSON or another
    top-level type raise a ValueError naming it."""
    data = checkpoint_io.read_json(file, TokenizerError)
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def read_json_if_present(file: Path) -> dict[str, Any] | None:
    return read_json_object(file) if file.is_file() else None


def token_content(value: Any, *, field: str, source: str) -> str | None:
    """A tokenizer_config token field (``"[EOS]"``, ``{"content": "[EOS]", ...}`` or null) as its string."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        value = value.get("content")
    if not isinstance(value, str) or not value:
        raise ValueError(f"{source}: {field}: expected a token string or an object with 'content', got {value!r}")
    return value


def config_eos_ids(directory: Path) -> list[int]:
    """The stop ids a checkpoint declares: ``generation_config.json`` first, then ``config.json`` (top level and
    ``text_config``). Values may be an int or a list of ints; anything else is a ValueError naming the file."""
    out: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        data = read_json_if_present(file)
        if data is None:
            continue
        scopes = [data]
        if isinstance(data.get("text_config"), Mapping):
            scopes.append(data["text_config"])
        for scope in scopes:
            value = scope.get("eos_token_id")
            values = value if isinstance(value, list) else [value]
            for v in values:
                if v is None:
                    continue
                if isinstance(v, bool) or not isinstance(v, int):
                    raise ValueError(f"{file}: eos_token_id: expected an int or a list of ints, got {value!r}")
                if v not in out:
                    out.append(v)
    return out
