"""Tokenizers: the byte-level one of the embedded tiny model, and a checkpoint's own ``tokenizer.json``.

Byte-level: token id = UTF-8 byte (0..255) plus a few specials, saved next to a checkpoint as
``rocm_k3_tokenizer.json``; decoding skips special and out-of-range ids and replaces invalid UTF-8 with U+FFFD,
so any generated id sequence decodes. A released checkpoint's ``tokenizer.json`` is read with the optional
``tokenizers`` package when it is installed. :func:`load_tokenizer` picks whichever the checkpoint has.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any, Protocol

TOKENIZER_FILE = "rocm_k3_tokenizer.json"
HF_TOKENIZER_FILE = "tokenizer.json"
NUM_BYTES = 256


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
        file = Path(directory) / TOKENIZER_FILE
        if not file.is_file():
            return None
        data = json.loads(file.read_text())
        if data.pop("type", None) != "byte":
            raise ValueError(f"{file}: expected a byte tokenizer ('type': 'byte')")
        return cls(**data)


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
    file = Path(directory) / HF_TOKENIZER_FILE
    if not file.is_file():
        return None
    try:
        tokenizers = importlib.import_module("tokenizers")
    except ImportError:
        return None
    return HFTokenizer(tokenizers.Tokenizer.from_file(str(file)))
