"""Tokenizers: the byte-level one of the embedded tiny model, and a checkpoint's own ``tokenizer.json``.

Byte-level: token id = UTF-8 byte (0..255) plus a few specials, saved next to a checkpoint as
``rocm_k3_tokenizer.json``; decoding skips special and out-of-range ids and replaces invalid UTF-8 with U+FFFD,
so any generated id sequence decodes. A released checkpoint's ``tokenizer.json`` is read with the optional
``tokenizers`` package when it is installed. :func:`load_tokenizer` picks whichever the checkpoint has. Both
files are read through :mod:`rocm_k3.model.checkpoint_io` (inside the checkpoint, regular files only); an
unreadable one raises :class:`TokenizerError` naming it.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any, Protocol

from rocm_k3.model import checkpoint_io

TOKENIZER_FILE = "rocm_k3_tokenizer.json"
HF_TOKENIZER_FILE = "tokenizer.json"
NUM_BYTES = 256


class TokenizerError(ValueError):
    """A tokenizer file of the checkpoint that cannot be read; the message names the file."""


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """ids 0..255 = bytes; ``bos_token_id``, ``eos_token_id``, ``pad_token_id`` >= 256 and < vocab_size."""

    vocab_size: int = 264
    bos_token_id: int = 256
    eos_token_id: int = 257
    pad_token_id: int = 258

    def __post_init__(self) -> None:
        if self.vocab_size < NUM_BYTES + 3:
            raise ValueError(f"vocab_size: expected >= {NUM_BYTES + 3} (bytes + bos/eos/pad), got {self.vocab_size}")
        specials = (self.bos_token_id, self.eos_token_id, self.pad_token_id)
        for tok in specials:
            if not NUM_BYTES <= tok < self.vocab_size:
                raise ValueError(f"special token id {tok}: expected in [{NUM_BYTES}, {self.vocab_size})")
        if len(set(specials)) != 3:
            raise ValueError(f"bos/eos/pad token ids must differ, got {specials}")

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text: expected str, got {type(text).__name__}")
        return ([self.bos_token_id] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < NUM_BYTES).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> None:
        data = {"type": "byte", **dataclasses.asdict(self)}
        (Path(directory) / TOKENIZER_FILE).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def from_dir(cls, directory: str | Path) -> ByteTokenizer | None:
        """The tokenizer saved in ``directory``, or None when the checkpoint has none."""
        file = checkpoint_io.member(Path(directory), TOKENIZER_FILE)
        if not checkpoint_io.require_regular(file, TokenizerError):
            return None
        data = checkpoint_io.read_json(file, TokenizerError)
        if not isinstance(data, dict):
            raise TokenizerError(f"{file}: expected a JSON object, got {type(data).__name__}")
        if data.pop("type", None) != "byte":
            raise TokenizerError(f"{file}: expected a byte tokenizer ('type': 'byte')")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise TokenizerError(f"{file}: unknown keys {unknown}; expected some of {sorted(fields)}")
        for key, value in data.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TokenizerError(f"{file}: {key}: expected an integer, got {value!r}")
        try:
            return cls(**data)
        except ValueError as exc:
            raise TokenizerError(f"{file}: {exc}") from exc


class HFTokenizer:
    """A checkpoint's ``tokenizer.json`` through the ``tokenizers`` package (no special tokens added or decoded)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text: expected str, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(directory: str | Path) -> ByteTokenizer | HFTokenizer | None:
    """The checkpoint's tokenizer: rocm_k3's byte tokenizer, else ``tokenizer.json`` (needs the ``tokenizers``
    package), else None (the model then takes token ids only)."""
    byte = ByteTokenizer.from_dir(directory)
    if byte is not None:
        return byte
    file = checkpoint_io.member(Path(directory), HF_TOKENIZER_FILE)
    if not checkpoint_io.require_regular(file, TokenizerError):
        return None
    try:
        tokenizers = importlib.import_module("tokenizers")
    except ImportError:
        return None
    text = checkpoint_io.read_text(file, TokenizerError)
    try:
        return HFTokenizer(tokenizers.Tokenizer.from_str(text))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        raise TokenizerError(f"{file}: not a tokenizer.json the tokenizers package can read ({exc})") from exc
