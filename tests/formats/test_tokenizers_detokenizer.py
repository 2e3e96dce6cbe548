"""Incremental detokenization: characters split across tokens come out whole, never as U+FFFD meanwhile."""

from __future__ import annotations

import random

import pytest
from tokenizer_files import K3_TABLE, NUM_RANKS, rank_table

from rocm_k3.tokenizers import IncrementalDetokenizer, KimiTiktokenTokenizer, embedded_byte_tokenizer

# Tokens that cut characters: 中 = e4 b8 ad, 文 = e6 96 87, 😀 = f0 9f 98 80.
SPLIT_TOKENS = [b"\xe4\xb8", b"\xad\xe6", b"\x96\x87\xf0", b"\x9f\x98", b"\x80!"]


@pytest.fixture(scope="module")
def k3() -> KimiTiktokenTokenizer:
    ranks = rank_table([])
    for token in SPLIT_TOKENS:  # replace filler ranks with the splitting tokens (ranks stay 0..n-1)
        filler = next(t for t, r in ranks.items() if r == NUM_RANKS - 1 - SPLIT_TOKENS.index(token))
        ranks[token] = ranks.pop(filler)
    return KimiTiktokenTokenizer(ranks, {name: i for i, name in K3_TABLE.items()}, eos_token_ids=[163586])


def _stream(tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.feed([t]) for t in ids]
    pieces.append(detok.finish())
    assert detok.num_tokens == len(ids) and detok.text == "".join(pieces)
    return pieces


def test_chinese_and_emoji_across_tiktoken_tokens(k3: KimiTiktokenTokenizer) -> None:
    ids = [k3.encode("<|open|>", allow_special=True)[0]] + [k3.encode("x")[0]]
    ids += [163584 - 1 - SPLIT_TOKENS.index(t) for t in SPLIT_TOKENS]
    assert b"".join(k3.token_bytes(t) for t in ids[2:]) == "中文😀!".encode()
    pieces = _stream(k3, ids)
    assert pieces == ["<|open|>", "x", "", "中", "文", "", "😀!", ""]
    assert "".join(pieces) == k3.decode(ids)


def test_every_byte_its_own_token() -> None:
    tok = embedded_byte_tokenizer()
    text = "a中😀é"
    ids = tok.encode(text)
    pieces = _stream(tok, ids)
    assert pieces == ["a", "", "", "中", "", "", "", "😀", "", "é", ""]
    several = IncrementalDetokenizer(tok)
    assert several.feed(ids[:2]) == "a" and several.feed(ids[2:6]) == "中" and several.feed(ids[6:]) == "😀é"


def test_specials_as_text_without_spaces() -> None:
    tok = embedded_byte_tokenizer()
    ids = tok.encode("<|close|>think<|sep|><|open|>response<|sep|>", allow_special=True)
    assert "".join(_stream(tok, ids)) == "<|close|>think<|sep|><|open|>response<|sep|>"


def test_invalid_and_unfinished_bytes() -> None:
    tok = embedded_byte_tokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.feed([0xFF]) == "\ufffd"  # can never start a character: replaced at once
    assert detok.feed([0xE4, 0xB8]) == ""  # the start of a character: held
    assert detok.feed([ord("a")]) == "\ufffda"  # ... that did not continue
    assert detok.feed([0xF0, 0x9F]) == ""
    assert detok.finish() == "\ufffd"  # the stream ended inside a character
    with pytest.raises(ValueError, match="outside the vocabulary"):
        IncrementalDetokenizer(tok).feed([tok.vocab_size])


def test_random_streams_match_decode(k3: KimiTiktokenTokenizer) -> None:
    rng = random.Random(1)
    pool = list(range(0, 300)) + [163584 - 1 - i for i in range(len(SPLIT_TOKENS))] + [163587, 163589]
    for _ in range(100):
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 30))]
        detok = IncrementalDetokenizer(k3)
        pieces, i = [], 0
        while i < len(ids):
            step = rng.randrange(1, 4)
            pieces.append(detok.feed(ids[i:i + step]))
            i += step
        assert "".join(pieces) + detok.finish() == k3.decode(ids)
