"""Incremental detokenization: feed the new ids of a request each step, get the text they complete.

Bytes of a UTF-8 character split across tokens are held until the character is whole, so a stream never shows
U+FFFD for an incomplete character; bytes that can never form a character come out as U+FFFD, as ``decode`` gives
them. Specials come out as their text with nothing added around them (``skip_special_tokens=False``,
``spaces_between_special_tokens=False``). For the byte, tiktoken and byte-level ``tokenizer.json`` tokenizers the
pieces joined equal ``tokenizer.decode`` of all ids.

A tokenizer whose token bytes do not simply concatenate (``concatenates_bytes`` False: a ``tokenizer.json`` whose
decoder inserts spaces between words, say) is decoded through a short window instead: the text of the newest
tokens in the context of the few before them, as vLLM's incremental detokenizer does.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from rocm_k3.tokenizers.base import Tokenizer


class IncrementalDetokenizer:
    """One request's output text, built piece by piece from its token ids (``tokenizer.token_bytes``)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_tokens = 0
        self._text: list[str] = []
        self._by_bytes = getattr(tokenizer, "concatenates_bytes", True)
        self._ids: list[int] = []  # window mode: ids since the window's start
        self._read = 0  # window mode: ids of the window whose text was emitted

    @property
    def num_tokens(self) -> int:
        """How many ids were fed so far."""
        return self._num_tokens

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text)

    def feed(self, ids: Sequence[int]) -> str:
        """The text completed by ``ids`` (possibly ""); an id outside the vocabulary is a ValueError."""
        self._num_tokens += len(ids)
        if not self._by_bytes:
            piece = self._window(list(ids), final=False)
            if piece:
                self._text.append(piece)
            return piece
        data = self._tokenizer.token_bytes(ids[0]) if len(ids) == 1 else \
            b"".join(self._tokenizer.token_bytes(t) for t in ids)
        piece = self._decoder.decode(data)
        if piece:
            self._text.append(piece)
        return piece

    def finish(self) -> str:
        """The end of the stream: bytes still waiting for the rest of their character come out as U+FFFD."""
        piece = self._window([], final=True) if not self._by_bytes else self._decoder.decode(b"", final=True)
        if piece:
            self._text.append(piece)
        return piece

    def _window(self, ids: list[int], final: bool) -> str:
        """Window mode: decode the emitted part and the whole window; the difference is the new text (held back
        while it ends in an incomplete character, at most 8 tokens)."""
        self._ids += ids
        if self._read == len(self._ids):
            return ""
        done = self._tokenizer.decode(self._ids[: self._read])
        full = self._tokenizer.decode(self._ids)
        if not final and (len(full) <= len(done) or full.endswith("\ufffd")) and len(self._ids) - self._read < 8:
            return ""
        piece = full[len(done) :]
        self._ids = self._ids[self._read :]  # the last emitted token(s) stay as context for the next piece
        self._read = len(self._ids)
        return piece
