"""A checkpoint's own ``tokenizer.json``, read with the optional ``tokenizers`` package.

``encode(text)`` treats special tokens typed in the text as ordinary text (``encode_special_tokens``), and
``allow_special=True`` matches them; decoding keeps specials as their text. ``token_bytes`` undoes the byte-level
alphabet (GPT-2 style ``ByteLevel``), ``<0xNN>`` byte-fallback tokens and the ``▁`` word marker, so that joining the
bytes of a byte-level or byte-fallback tokenizer's tokens gives its decoded text.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from rocm_k3.tokenizers.base import (
    SpecialIds,
    check_text,
    check_token_id,
    check_token_ids,
    read_json_if_present,
    token_content,
)

HF_TOKENIZER_FILE = "tokenizer.json"
_METASPACE = "\u2581"


def byte_level_alphabet() -> dict[str, int]:
    """The printable stand-in character of each byte in byte-level BPE vocabularies -> that byte.

    Printable Latin-1 bytes stand for themselves; the other 68 map, in byte order, to U+0100, U+0101, ...
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            out[chr(0x100 + extra)] = b
            extra += 1
    return out


def _decoder_types(decoder: Any) -> set[str]:
    if not isinstance(decoder, dict):
        return set()
    found = {str(decoder.get("type"))}
    for child in decoder.get("decoders") or ():
        found |= _decoder_types(child)
    return found


class HFTokenizer(SpecialIds):
    """``tokenizers.Tokenizer`` behind the rocm-k3 interface (see :mod:`rocm_k3.tokenizers.base`)."""

    def __init__(self, tokenizer: Any, *, decoder_types: Collection[str] = (), eos_token_ids: Sequence[int] = (),
                 bos_token_id: int | None = None, pad_token_id: int | None = None,
                 source: str = HF_TOKENIZER_FILE) -> None:
        self._tok = tokenizer
        self._plain = type(tokenizer).from_str(tokenizer.to_str())  # specials typed in text stay text
        self._plain.encode_special_tokens = True
        added = tokenizer.get_added_tokens_decoder()  # id -> AddedToken
        super().__init__(int(tokenizer.get_vocab_size(with_added_tokens=True)),
                         {tok.content: int(i) for i, tok in sorted(added.items())}, eos_token_ids=eos_token_ids,
                         bos_token_id=bos_token_id, pad_token_id=pad_token_id, source=source)
        self._added_ids = frozenset(self.special_tokens.values())
        self._byte_level = "ByteLevel" in decoder_types
        self._byte_fallback = "ByteFallback" in decoder_types
        self._metaspace = bool({"Metaspace", "Replace"} & decoder_types)
        self._alphabet = byte_level_alphabet() if self._byte_level else {}
        # whether joining token_bytes gives the decoded text (the incremental detokenizer's fast path)
        self.concatenates_bytes = self._byte_level or self._byte_fallback

    @classmethod
    def from_dir(cls, directory: str | Path, *, extra_eos_ids: Sequence[int] = ()) -> HFTokenizer | None:
        """``tokenizer.json`` of ``directory`` (with bos/eos/pad names from ``tokenizer_config.json`` when present),
        or None when the file or the ``tokenizers`` package is missing."""
        root = Path(directory)
        file = root / HF_TOKENIZER_FILE
        if not file.is_file():
            return None
        try:
            tokenizers = importlib.import_module("tokenizers")
        except ImportError:
            return None
        try:
            text = file.read_bytes().decode("utf-8")
            decoder = json.loads(text).get("decoder")
            tok = tokenizers.Tokenizer.from_str(text)
        except Exception as exc:  # the Rust loader raises a bare Exception for a malformed file
            raise ValueError(f"{file}: not a valid tokenizer.json ({exc})") from exc
        config_file = root / "tokenizer_config.json"
        config = read_json_if_present(config_file) or {}

        def named(field: str) -> int | None:
            name = token_content(config.get(field), field=field, source=str(config_file))
            if name is None:
                return None
            token_id = tok.token_to_id(name)
            if token_id is None:
                raise ValueError(f"{config_file}: {field} {name!r} is not in {file}")
            return int(token_id)

        eos = list(extra_eos_ids)
        eos_token = named("eos_token")
        if eos_token is not None:
            eos.append(eos_token)
        return cls(tok, decoder_types=_decoder_types(decoder), eos_token_ids=eos, bos_token_id=named("bos_token"),
                   pad_token_id=named("pad_token"), source=str(file))

    # ---- the Tokenizer interface (ids and specials: SpecialIds) -----------------------------------------
    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        check_text(text)
        tok = self._tok if allow_special else self._plain
        return [int(i) for i in tok.encode(text, add_special_tokens=False).ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(check_token_ids(ids, self._vocab_size), skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        value = check_token_id(token_id, self._vocab_size)
        token = self._tok.id_to_token(value)
        if token is None:
            raise ValueError(f"token id {value} has no token in this tokenizer.json")
        if value in self._added_ids:
            return token.encode("utf-8")
        if self._byte_level:
            try:
                return bytes(self._alphabet[c] for c in token)
            except KeyError:
                return token.encode("utf-8")
        if self._byte_fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes((int(token[3:5], 16),))
            except ValueError:
                pass
        if self._metaspace:
            token = token.replace(_METASPACE, " ")
        return token.encode("utf-8")
