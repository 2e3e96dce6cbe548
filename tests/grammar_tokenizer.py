"""A small byte-level tokenizer with the project's tokenizer interface and the K3 / K2 special tokens.

``vocab_size``, ``token_bytes(id)``, ``special_tokens`` and ``eos_token_ids`` are the interface the structured
output code uses; ``encode``/``decode`` are test conveniences (decode writes special tokens as their text, as the
server's detokenizer does for the parsers). Ids: 0..255 bytes, then a few merged pieces (tag names as ordinary
tokens, as in K3's BPE), then the family's specials, then reserved specials up to ``vocab_size``.
"""

from __future__ import annotations

import dataclasses

MERGES = (b"think", b"response", b"tools", b"call", b"argument", b"message", b"json", b' tool="', b'" index="',
          b' key="', b'" type="', b"string", b"number", b'{"', b'": ', b'", "', b"true", b"false", b"null",
          b"functions.", b"Paris", b" the", "é".encode(), "ü".encode(), "漢字".encode(), "😀".encode())
LONE_HIGH_BYTES = frozenset(range(0x80, 0x100))  # single bytes that are no whole UTF-8 character
K3_SPECIALS = ("[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "<|media_pad|>")
K2_SPECIALS = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
               "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>")
EOS = {"kimi_k3": ("<|end_of_msg|>", "[EOS]"), "kimi_k2": ("<|im_end|>", "[EOS]")}


@dataclasses.dataclass
class TinyTokenizer:
    family: str = "kimi_k3"
    vocab_size: int = 320
    specials: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        names = self.specials if self.specials is not None else (
            K3_SPECIALS if self.family == "kimi_k3" else K2_SPECIALS)
        self._pieces: list[bytes] = [bytes([i]) for i in range(256)] + list(MERGES)
        first = len(self._pieces)
        if first + len(names) > self.vocab_size:
            raise ValueError("vocab_size too small for the specials")
        self.special_tokens = {name: first + i for i, name in enumerate(names)}
        for tid in range(first + len(names), self.vocab_size):
            self.special_tokens[f"<|reserved_token_{tid}|>"] = tid
        self._special_text = {tid: name for name, tid in self.special_tokens.items()}
        self.eos_token_ids = tuple(self.special_tokens[n] for n in EOS[self.family] if n in self.special_tokens)
        self._by_length = sorted(range(len(self._pieces)), key=lambda i: -len(self._pieces[i]))

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._special_text:
            return self._special_text[token_id].encode()
        return self._pieces[token_id]

    def encode(self, text: str) -> list[int]:
        """Greedy longest match: specials (as single tokens), then merges, then single bytes."""
        data, ids, pos = text.encode(), [], 0
        specials = sorted(((n.encode(), t) for n, t in self.special_tokens.items()), key=lambda x: -len(x[0]))
        while pos < len(data):
            hit = next((t for s, t in specials if data.startswith(s, pos)), None)
            if hit is None:
                hit = next(i for i in self._by_length if data.startswith(self._pieces[i], pos))
            ids.append(hit)
            pos += len(self.token_bytes(hit))
        return ids

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")
