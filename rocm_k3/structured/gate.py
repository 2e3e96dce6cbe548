"""The reasoning gate: watch a request's generated tokens until its reasoning ends, token by token.

While a request is inside think, no grammar applies. The gate opens right after one of the family's openers
(a marker as a token sequence: special ids plus the bytes of the text between them, so it works whether a tag
name is one BPE token or many):

- K3: ``<|close|>think<|sep|>``; ``<|open|>response<|sep|>`` (the model skipped think: vLLM #57714, where the
  grammar otherwise never engages); ``<|close|>response<|sep|>`` (an orphan close, vLLM #53246's shape); and,
  for tool-call grammars only, ``<|open|>tools<|sep|>``;
- K2: ``</think>``; for tool-call grammars also ``<|tool_calls_section_begin|>``.

Each step costs O(marker length) only on special tokens (every opener ends with one), never a context scan.
The grammar that follows (``tags.py``) accepts the text from any of these points on.
"""

from __future__ import annotations

import collections

from rocm_k3.formats.parsers import kimi_k2, kimi_k3
from rocm_k3.structured.vocab import FamilyTokens, GrammarTokenizer

_OTHER = -1  # a symbol standing for any special (or padding) token that is no marker part


def opener_texts(family: str, tool_calls: bool) -> tuple[str, ...]:
    if family == "kimi_k3":
        base = (kimi_k3.THINK_CLOSE, kimi_k3.RESPONSE_OPEN, kimi_k3.RESPONSE_CLOSE)
        return base + ((kimi_k3.TOOLS_OPEN,) if tool_calls else ())
    return (kimi_k2.THINK_CLOSE,) + ((kimi_k2.SECTION_BEGIN,) if tool_calls else ())


class ReasoningGate:
    """``step(token_id) -> bool``: True once the latest token completed an opener (then stays open)."""

    def __init__(self, tokenizer: GrammarTokenizer, tokens: FamilyTokens, *, tool_calls: bool) -> None:
        self._tokenizer = tokenizer
        self._marker_ids = {tid: text for text, tid in tokens.ids.items()}
        self._special_ids = frozenset(int(t) for t in tokenizer.special_tokens.values())
        self._vocab_size = int(tokenizer.vocab_size)
        self._patterns: list[tuple[object, ...]] = []
        for text in opener_texts(tokens.family, tool_calls):
            pattern = self._symbols(text, tokens)
            if pattern is not None:
                self._patterns.append(pattern)
        if not self._patterns:
            raise ValueError(f"{tokens.family}: the tokenizer has none of the think-end markers; the grammar could "
                             "never start inside think (send thinking off, or use a tokenizer with them)")
        self._tail: collections.deque[object] = collections.deque(maxlen=max(len(p) for p in self._patterns))
        self.is_open = False

    @staticmethod
    def _symbols(text: str, tokens: FamilyTokens) -> tuple[object, ...] | None:
        """``text`` as symbols: ``("id", n)`` per special part, one int per byte of the literal parts; None
        when the tokenizer lacks one of its specials."""
        try:
            pieces = tokens.pieces(text)
        except ValueError:
            return None
        out: list[object] = []
        for piece in pieces:
            if isinstance(piece, int):
                out.append(("id", piece))
            else:
                out.extend(piece.encode())
        return tuple(out)

    def step(self, token_id: int) -> bool:
        if self.is_open:
            return True
        if token_id in self._marker_ids:
            self._tail.append(("id", token_id))
            tail = tuple(self._tail)
            if any(tail[len(tail) - len(p):] == p for p in self._patterns if len(p) <= len(tail)):
                self.is_open = True
        elif token_id in self._special_ids or not 0 <= token_id < self._vocab_size:  # padding ids too
            self._tail.append(_OTHER)
        else:
            self._tail.extend(self._tokenizer.token_bytes(token_id))
        return self.is_open
