"""The tokenizer as the grammar engine sees it, and the marker tokens of each output family.

The tokenizer interface it needs (``GrammarTokenizer``: the tokenizers' ``TokenTable``): ``vocab_size``,
``token_bytes(id) -> bytes``, ``special_tokens: Mapping[str, int]`` and ``eos_token_ids``. xgrammar matches grammar
text against each token's bytes, so special tokens are encoded for it on purpose (:func:`build_tokenizer_info`):

- the family's marker tokens (``<|open|>``, ``<|close|>``, ``<|sep|>`` for K3; the ``<think>``/tool markers for
  K2) become ``b"\\xff" + text``: 0xFF never occurs in UTF-8, so no JSON string, regex or EBNF text rule can
  ever produce them, while the grammars we build name them by id (xgrammar ``TokenFormat``) where they belong;
  free-text spans exclude their text, which also bars spelling them out byte by byte;
- every other special (media, reserved, ``[BOS]``...) is empty, which xgrammar treats as never allowed; the
  stop tokens (``eos_token_ids``) are allowed exactly when the grammar is complete;
- ids from the tokenizer's size up to the model's ``vocab_size`` (padding) are never allowed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import xgrammar as xgr

from rocm_k3.formats.parsers import kimi_k2, kimi_k3
from rocm_k3.tokenizers.base import TokenTable

# bytes no UTF-8 text contains: marker tokens carry it so that text rules never match them
MARKER_TAG = b"\xff"


GrammarTokenizer = TokenTable  # the tokenizer as the grammar engine sees it


# marker token texts per family (their ids come from the tokenizer's special_tokens)
FAMILY_MARKERS: dict[str, tuple[str, ...]] = {
    "kimi_k3": (kimi_k3.OPEN, kimi_k3.CLOSE, kimi_k3.SEP),
    "kimi_k2": (kimi_k2.THINK_OPEN, kimi_k2.THINK_CLOSE, kimi_k2.SECTION_BEGIN, kimi_k2.SECTION_END,
                kimi_k2.CALL_BEGIN, kimi_k2.ARGUMENT_BEGIN, kimi_k2.CALL_END),
}
# marker tokens a family cannot work without (K2 checkpoints without thinking lack <think>)
REQUIRED_MARKERS: dict[str, tuple[str, ...]] = {"kimi_k3": FAMILY_MARKERS["kimi_k3"], "kimi_k2": ()}


@dataclasses.dataclass(frozen=True)
class FamilyTokens:
    """The marker token ids of one family in one tokenizer (text -> id; absent markers are missing)."""

    family: str
    ids: Mapping[str, int]
    eos_token_ids: tuple[int, ...]

    def id(self, text: str) -> int:
        if text not in self.ids:
            raise ValueError(f"{self.family}: the tokenizer has no special token {text!r}")
        return self.ids[text]

    def pieces(self, text: str) -> list[int | str]:
        """A marker text as its special-token ids and the literal text between them, e.g.
        ``"<|close|>think<|sep|>"`` -> ``[close_id, "think", sep_id]``; ValueError if a special is missing."""
        specials = FAMILY_MARKERS[self.family]
        parts = re.split("(" + "|".join(re.escape(m) for m in specials) + ")", text)
        return [self.id(p) if p in specials else p for p in parts if p]


def family_tokens(tokenizer: GrammarTokenizer, family: str) -> FamilyTokens:
    """Look up ``family``'s marker tokens in ``tokenizer``; raises ValueError when a required one is missing
    or the tokenizer interface is incomplete."""
    if family not in FAMILY_MARKERS:
        raise ValueError(f"family: expected one of {sorted(FAMILY_MARKERS)}, got {family!r}")
    if not isinstance(tokenizer, GrammarTokenizer):
        raise TypeError("tokenizer: expected vocab_size, token_bytes(id), special_tokens and eos_token_ids")
    specials = tokenizer.special_tokens
    missing = [m for m in REQUIRED_MARKERS[family] if m not in specials]
    if missing:
        raise ValueError(f"tokenizer: {family} needs special tokens {missing}, which it does not have")
    eos = tuple(int(t) for t in tokenizer.eos_token_ids)
    if not eos:
        raise ValueError("tokenizer: eos_token_ids is empty; a grammar could never end")
    for t in (*eos, *(specials[m] for m in FAMILY_MARKERS[family] if m in specials)):
        if not 0 <= t < tokenizer.vocab_size:
            raise ValueError(f"tokenizer: token id {t} outside the vocabulary [0, {tokenizer.vocab_size})")
    return FamilyTokens(family, {m: int(specials[m]) for m in FAMILY_MARKERS[family] if m in specials}, eos)


def build_tokenizer_info(tokenizer: GrammarTokenizer, tokens: FamilyTokens,
                         vocab_size: int | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary (see the module docstring); ``vocab_size`` = the model's logits width
    (>= the tokenizer's, the rest is padding)."""
    n = int(tokenizer.vocab_size)
    width = n if vocab_size is None else int(vocab_size)
    if width < n:
        raise ValueError(f"vocab_size: {width} is smaller than the tokenizer's {n}")
    marker_ids = {tid: text for text, tid in tokens.ids.items()}
    special_ids = set(int(t) for t in tokenizer.special_tokens.values())
    encoded: list[bytes] = []
    for tid in range(n):
        if tid in marker_ids:
            encoded.append(MARKER_TAG + marker_ids[tid].encode())
        elif tid in special_ids:
            encoded.append(b"")
        else:
            piece = tokenizer.token_bytes(tid)
            if not isinstance(piece, bytes):
                raise TypeError(f"token_bytes({tid}): expected bytes, got {type(piece).__name__}")
            encoded.append(piece)
    return xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=width, stop_token_ids=list(tokens.eos_token_ids))
