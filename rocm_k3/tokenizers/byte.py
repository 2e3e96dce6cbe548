"""The byte-level tokenizer of the embedded tiny model: ids 0..255 are UTF-8 bytes, specials sit above them.

The embedded model carries K3's control specials (``[BOS]``, ``[EOS]``, ``<|end_of_msg|>``, ``<|open|>``,
``<|close|>``, ``<|sep|>``, the media tokens, ``[UNK]``, ``[PAD]``; gaps are ``<|reserved_token_{id}|>``), so a
K3 XTML chat renders and runs on it end to end. It is saved next to a checkpoint as ``rocm_k3_tokenizer.json``::

    {"type": "byte", "vocab_size": 272, "special_tokens": {"[BOS]": 256, ...},
     "bos_token": "[BOS]", "eos_tokens": ["<|end_of_msg|>", "[EOS]"], "pad_token": "[PAD]"}

The first format (``bos_token_id``/``eos_token_id``/``pad_token_id`` and no names) still loads, with the names
``[BOS]``/``[EOS]``/``[PAD]``. Decoding replaces invalid UTF-8 with U+FFFD.
"""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rocm_k3.tokenizers.base import (
    check_text,
    check_token_id,
    fill_special_slots,
    read_json_object,
    special_split_pattern,
    split_specials,
    utf8,
)

TOKENIZER_FILE = "rocm_k3_tokenizer.json"
NUM_BYTES = 256

# The embedded model's specials, in K3's order (ids from 256); the rest of the slots up to vocab_size are reserved.
EMBEDDED_SPECIALS = (
    "[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>",
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>", "[UNK]", "[PAD]",
)
EMBEDDED_VOCAB_SIZE = 272  # 256 bytes + 12 specials + 4 reserved slots (a multiple of 16)


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """Bytes 0..255 plus named specials filling [256, vocab_size).

    special_tokens: name -> id for the named specials (ids in [256, vocab_size)); unnamed slots get reserved names.
    bos_token / eos_tokens / pad_token: names from ``special_tokens`` (eos_tokens in stop-priority order).
    """

    vocab_size: int
    special_tokens: Mapping[str, int]
    bos_token: str | None = None
    eos_tokens: tuple[str, ...] = ()
    pad_token: str | None = None

    def __post_init__(self) -> None:
        source = "byte tokenizer"
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < NUM_BYTES:
            raise ValueError(f"{source}: vocab_size: expected an int >= {NUM_BYTES}, got {self.vocab_size!r}")
        if not isinstance(self.special_tokens, Mapping):
            raise ValueError(f"{source}: special_tokens: expected a mapping name -> id")
        full = fill_special_slots(self.special_tokens, NUM_BYTES, self.vocab_size, source=source)
        object.__setattr__(self, "special_tokens", types.MappingProxyType(full))
        object.__setattr__(self, "eos_tokens", tuple(self.eos_tokens))
        for field, name in (("bos_token", self.bos_token), ("pad_token", self.pad_token),
                            *(("eos_tokens", n) for n in self.eos_tokens)):
            if name is not None and name not in full:
                raise ValueError(f"{source}: {field}: {name!r} is not one of its special tokens")
        object.__setattr__(self, "_names", {i: n for n, i in full.items()})
        object.__setattr__(self, "_pattern", special_split_pattern(full))

    # ---- the Tokenizer interface ------------------------------------------------------------------------
    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.special_tokens[self.bos_token]

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self.special_tokens[self.pad_token]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.special_tokens[n] for n in self.eos_tokens)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        check_text(text)
        if not allow_special:
            return list(utf8(text))
        out: list[int] = []
        for piece, special in split_specials(text, self._pattern):
            if special:
                out.append(self.special_tokens[piece])
            else:
                out.extend(utf8(piece))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        value = check_token_id(token_id, self.vocab_size)
        if value < NUM_BYTES:
            return bytes((value,))
        return self._names[value].encode("utf-8")

    # ---- the file next to a checkpoint --------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        named = {n: i for n, i in self.special_tokens.items() if not n.startswith("<|reserved_token_")}
        data = {"type": "byte", "vocab_size": self.vocab_size, "special_tokens": named,
                "bos_token": self.bos_token, "eos_tokens": list(self.eos_tokens), "pad_token": self.pad_token}
        (Path(directory) / TOKENIZER_FILE).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")

    @classmethod
    def from_dir(cls, directory: str | Path) -> ByteTokenizer | None:
        """The tokenizer saved in ``directory``, or None when there is no ``rocm_k3_tokenizer.json``."""
        file = Path(directory) / TOKENIZER_FILE
        if not file.is_file():
            return None
        data = read_json_object(file)
        if data.get("type") != "byte":
            raise ValueError(f"{file}: expected a byte tokenizer ('type': 'byte'), got type {data.get('type')!r}")
        try:
            if "special_tokens" in data:
                return _from_current_format(data)
            return _from_first_format(data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{file}: {exc}") from exc


def embedded_byte_tokenizer(vocab_size: int = EMBEDDED_VOCAB_SIZE) -> ByteTokenizer:
    """The embedded model's tokenizer: bytes, then :data:`EMBEDDED_SPECIALS` from id 256, reserved slots after."""
    specials = {name: NUM_BYTES + i for i, name in enumerate(EMBEDDED_SPECIALS)}
    if vocab_size < NUM_BYTES + len(specials):
        raise ValueError(f"vocab_size: expected >= {NUM_BYTES + len(specials)} for the embedded specials, "
                         f"got {vocab_size}")
    return ByteTokenizer(vocab_size=vocab_size, special_tokens=specials, bos_token="[BOS]",
                         eos_tokens=("<|end_of_msg|>", "[EOS]"), pad_token="[PAD]")


_CURRENT_KEYS = {"type", "vocab_size", "special_tokens", "bos_token", "eos_tokens", "pad_token"}
_FIRST_KEYS = {"type", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"}


def _check_keys(data: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"unknown fields {unknown}; expected {sorted(allowed)}")


def _optional_name(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{key}: expected a string or null, got {type(value).__name__}")
    return value


def _from_current_format(data: dict[str, Any]) -> ByteTokenizer:
    _check_keys(data, _CURRENT_KEYS)
    specials = data["special_tokens"]
    if not isinstance(specials, dict):
        raise TypeError(f"special_tokens: expected an object name -> id, got {type(specials).__name__}")
    eos = data.get("eos_tokens", [])
    if not isinstance(eos, list) or not all(isinstance(e, str) for e in eos):
        raise TypeError(f"eos_tokens: expected a list of token names, got {eos!r}")
    return ByteTokenizer(vocab_size=data.get("vocab_size"), special_tokens=specials,
                         bos_token=_optional_name(data, "bos_token"), eos_tokens=tuple(eos),
                         pad_token=_optional_name(data, "pad_token"))


def _from_first_format(data: dict[str, Any]) -> ByteTokenizer:
    """The first saved form: bos/eos/pad ids and no names."""
    _check_keys(data, _FIRST_KEYS)
    specials: dict[str, int] = {}
    for key, name in (("bos_token_id", "[BOS]"), ("eos_token_id", "[EOS]"), ("pad_token_id", "[PAD]")):
        if key not in data:
            raise ValueError(f"missing field {key!r}")
        specials[name] = data[key]
    return ByteTokenizer(vocab_size=data.get("vocab_size"), special_tokens=specials, bos_token="[BOS]",
                         eos_tokens=("[EOS]",), pad_token="[PAD]")
