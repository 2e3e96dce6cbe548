"""The embedded model's byte tokenizer: K3's control specials above the bytes, its saved file, bad files."""

from __future__ import annotations

import json

import pytest

from rocm_k3.tokenizers import TOKENIZER_FILE, ByteTokenizer, embedded_byte_tokenizer, load_tokenizer
from rocm_k3.tokenizers.byte import EMBEDDED_SPECIALS, EMBEDDED_VOCAB_SIZE


@pytest.fixture
def tok() -> ByteTokenizer:
    return embedded_byte_tokenizer()


def test_layout(tok: ByteTokenizer) -> None:
    assert tok.vocab_size == EMBEDDED_VOCAB_SIZE == 272
    specials = tok.special_tokens
    assert [specials[n] for n in EMBEDDED_SPECIALS] == list(range(256, 268))
    assert specials["<|open|>"] == 259 and specials["<|close|>"] == 260 and specials["<|sep|>"] == 261
    assert specials["<|reserved_token_268|>"] == 268 and specials["<|reserved_token_271|>"] == 271
    assert len(specials) == 16
    assert tok.eos_token_ids == (258, 257)  # <|end_of_msg|>, [EOS]
    assert tok.bos_token_id == 256 and tok.pad_token_id == 267


def test_encode_decode(tok: ByteTokenizer) -> None:
    text = "héllo 中文 😀 <|open|>[EOS]"
    plain = tok.encode(text)
    assert plain == list(text.encode()) and tok.decode(plain) == text
    special = tok.encode(text, allow_special=True)
    assert special == list("héllo 中文 😀 ".encode()) + [259, 257]
    assert tok.decode(special) == text
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # an incomplete character decodes as U+FFFD
    assert tok.token_bytes(0xE4) == b"\xe4" and tok.token_bytes(258) == b"<|end_of_msg|>"
    assert tok.encode("\ud800") == list("\ufffd".encode())  # a lone surrogate
    for bad in (272, -1, 10_000):
        with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 272\)"):
            tok.decode([bad])
    with pytest.raises(TypeError, match="expected an int"):
        tok.token_bytes("a")


def test_save_load_round_trip(tmp_path, tok: ByteTokenizer) -> None:
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, ByteTokenizer) and loaded == tok
    assert dict(loaded.special_tokens) == dict(tok.special_tokens)
    saved = json.loads((tmp_path / TOKENIZER_FILE).read_text())
    assert "<|reserved_token_268|>" not in saved["special_tokens"]  # reserved names are implied, not stored


def test_first_file_format_still_loads(tmp_path) -> None:
    (tmp_path / TOKENIZER_FILE).write_text(json.dumps(
        {"type": "byte", "vocab_size": 264, "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}))
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == 264 and tok.eos_token_ids == (257,) and tok.bos_token_id == 256
    assert tok.pad_token_id == 258 and tok.special_tokens["<|reserved_token_263|>"] == 263


@pytest.mark.parametrize("content,message", [
    (b"{not json", "not valid JSON"),
    (b'{"type": "byte", "vocab_size": 272, "special_tokens": {"\xff": 256}}', "not valid UTF-8"),
    (b"[1, 2]", "expected a JSON object"),
    (b'{"type": "bpe"}', "expected a byte tokenizer"),
    (b'{"type": "byte", "vocab_size": "272", "special_tokens": {}}', "vocab_size: expected an int"),
    (b'{"type": "byte", "vocab_size": 272, "special_tokens": [1]}', "special_tokens: expected an object"),
    (b'{"type": "byte", "vocab_size": 272, "special_tokens": {"[X]": 300}}', r"has id 300, expected an int in"),
    (b'{"type": "byte", "vocab_size": 272, "special_tokens": {"[X]": 256, "[Y]": 256}}', "share id 256"),
    (b'{"type": "byte", "vocab_size": 272, "special_tokens": {}, "eos_tokens": "[EOS]"}', "eos_tokens"),
    (b'{"type": "byte", "vocab_size": 272, "special_tokens": {}, "eos_tokens": ["[EOS]"]}', "not one of its"),
    (b'{"type": "byte", "vocab_size": 272, "special_tokens": {}, "bos_token": 3}', "bos_token: expected"),
    (b'{"type": "byte", "vocab_size": 272, "special_tokens": {}, "extra": 1}', "unknown fields"),
    (b'{"type": "byte", "vocab_size": 264, "bos_token_id": 256, "eos_token_id": 256, "pad_token_id": 258}',
     "share id 256"),
    (b'{"type": "byte", "vocab_size": 264, "bos_token_id": 256}', "missing field 'eos_token_id'"),
])
def test_bad_files_are_named(tmp_path, content: bytes, message: str) -> None:
    (tmp_path / TOKENIZER_FILE).write_bytes(content)
    with pytest.raises(ValueError, match=message) as info:
        load_tokenizer(tmp_path)
    assert TOKENIZER_FILE in str(info.value)


def test_embedded_vocab_bounds() -> None:
    assert embedded_byte_tokenizer(300).special_tokens["<|reserved_token_299|>"] == 299
    with pytest.raises(ValueError, match="vocab_size"):
        embedded_byte_tokenizer(260)
