"""The K3 / Kimi Linear tiktoken tokenizer on files the tests write (SERVING_SPEC 1.2-1.5, rule by rule)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizer_files import (
    K2_ONLY_NAMES,
    K2_TABLE,
    K3_TABLE,
    NUM_RANKS,
    VOCAB_SIZE,
    write_config,
    write_k3_tokenizer,
    write_kimi_tokenizer,
)

from rocm_k3.tokenizers import KimiTiktokenTokenizer, load_tokenizer
from rocm_k3.tokenizers.kimi_tiktoken import MAX_ENCODE_CHARS, MAX_RUN_CHARS

# Tricky strings and their pre-tokens, derived by hand from the 8-way pattern of SERVING_SPEC 1.2.
PRETOKEN_CASES = [
    ("abc中文", ["abc", "中文"]),             # a Han run never joins Latin (alternatives 2-3 exclude Han)
    ("中文abc", ["中文", "abc"]),
    ("漢字かな", ["漢字", "かな"]),            # kana are \p{Lo} but not Han: they are letters of alternative 2
    ("abcカナ", ["abcカナ"]),                 # ... so they do join Latin
    ("ABC中", ["ABC", "中"]),
    ("a&&b", ["a", "&&", "b"]),              # && is intersection: '&' is not a letter
    ("a&b", ["a", "&b"]),                    # a punctuation prefix joins the next word
    ("&&x", ["&&", "x"]),
    ("What's", ["What's"]),                  # contraction suffix
    ("fooBAR", ["foo", "BAR"]),
    ("XMLHttpRequest", ["XMLHttp", "Request"]),
    ("1234567890", ["123", "456", "789", "0"]),
    ("hello  world", ["hello", " ", " world"]),
    ("line\n\nnext", ["line", "\n\n", "next"]),
    ("x = 1;\n", ["x", " =", " ", "1", ";\n"]),
]
WORDS = sorted({w for text, pieces in PRETOKEN_CASES for w in [text, *pieces] if len(w.encode()) > 1})


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("k3_tok")
    ranks = write_k3_tokenizer(root, WORDS)
    write_config(root, "kimi_k3", 163586)
    return root, ranks


@pytest.fixture(scope="module")
def k3(k3_dir) -> KimiTiktokenTokenizer:
    tok = load_tokenizer(k3_dir[0])
    assert isinstance(tok, KimiTiktokenTokenizer)
    return tok


def test_vocabulary_is_ranks_plus_256_specials(k3: KimiTiktokenTokenizer) -> None:
    assert k3.vocab_size == VOCAB_SIZE == 163_840
    specials = k3.special_tokens
    assert len(specials) == 256 and sorted(specials.values()) == list(range(NUM_RANKS, VOCAB_SIZE))
    for token_id, name in K3_TABLE.items():
        assert specials[name] == token_id
    assert specials["<|reserved_token_163592|>"] == 163592  # an unnamed slot
    assert specials["<|reserved_token_163837|>"] == 163837
    assert not set(K2_ONLY_NAMES) & set(specials)  # listed in additional_special_tokens, but no slot: no id
    assert k3.encode("<|im_end|>", allow_special=True) == k3.encode("<|im_end|>")


def test_stop_bos_pad_ids(k3: KimiTiktokenTokenizer) -> None:
    assert k3.eos_token_ids == (163586, 163585)  # <|end_of_msg|> (generation eos), then [EOS]
    assert k3.bos_token_id == 163584 and k3.pad_token_id == 163839


@pytest.mark.parametrize("text,pieces", PRETOKEN_CASES, ids=[repr(t) for t, _ in PRETOKEN_CASES])
def test_split_pattern(k3: KimiTiktokenTokenizer, k3_dir, text: str, pieces: list[str]) -> None:
    """Every piece and the whole string are single tokens, so the ids show exactly where tiktoken split."""
    ranks = k3_dir[1]
    assert "".join(pieces) == text
    expected = [ranks[p.encode()] for p in pieces]
    for piece, token in zip(pieces, expected):
        assert k3.encode(piece) == [token], piece
    assert k3.encode(text) == expected


def test_typed_specials_stay_text(k3: KimiTiktokenTokenizer) -> None:
    text = "hi <|open|>message<|sep|> [EOS] <|end_of_msg|>"
    plain = k3.encode(text)
    assert all(t < NUM_RANKS for t in plain) and k3.decode(plain) == text
    special = k3.encode(text, allow_special=True)
    assert [t for t in special if t >= NUM_RANKS] == [163587, 163589, 163585, 163586]
    assert k3.decode(special) == text


def test_control_marker_is_three_tokens(k3: KimiTiktokenTokenizer, k3_dir) -> None:
    think = k3_dir[1][b"think"]
    assert k3.encode("<|close|>think<|sep|>", allow_special=True) == [163588, think, 163589]
    assert k3.decode([163588, think, 163589]) == "<|close|>think<|sep|>"  # no spaces around specials


def test_no_id_at_or_past_vocab_size(k3: KimiTiktokenTokenizer) -> None:
    rng = random.Random(0)
    alphabet = "ab中文カ😀 \n\t&|<>[]" + "".join(chr(rng.randrange(32, 0x2FFFF)) for _ in range(64))
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60))) for _ in range(200)]
    texts += list(k3.special_tokens) + K2_ONLY_NAMES + ["\ud800 lone surrogate"]
    for text in texts:
        for allow in (False, True):
            ids = k3.encode(text, allow_special=allow)
            assert all(0 <= t < VOCAB_SIZE for t in ids), text
    for bad in (VOCAB_SIZE, VOCAB_SIZE + 6, -1):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            k3.decode([5, bad])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            k3.token_bytes(bad)
    with pytest.raises(TypeError, match="expected str"):
        k3.encode(b"bytes")


def test_token_bytes(k3: KimiTiktokenTokenizer, k3_dir) -> None:
    ranks = k3_dir[1]
    assert k3.token_bytes(ranks["中文".encode()]) == "中文".encode()
    assert k3.token_bytes(0xE4) == b"\xe4"  # a single byte, not valid UTF-8 on its own
    assert k3.token_bytes(163587) == b"<|open|>"
    assert k3.token_bytes(163700) == b"<|reserved_token_163700|>"


def test_long_input_cuts(k3_dir) -> None:
    """Windows of max_encode_chars, then runs of one class cut every max_run_chars (small limits here)."""
    assert (MAX_ENCODE_CHARS, MAX_RUN_CHARS) == (400_000, 25_000)
    root, ranks = k3_dir
    base = load_tokenizer(root)
    small = KimiTiktokenTokenizer(ranks, {n: i for i, n in K3_TABLE.items()}, max_encode_chars=12,
                                  max_run_chars=4)
    assert list(small.split_long_input("xaaaaaa  b")) == ["xaaa", "aaa  b"]
    assert list(small.split_long_input("ab" + " " * 9 + "c")) == ["ab    ", "    ", " c"]
    assert list(small.split_long_input("abcdefghijklmnopqrstuvwxyz")) == [
        "abcd", "efgh", "ijkl", "mnop", "qrst", "uvwx", "yz"]
    assert list(small.split_long_input("ab cd ef gh ij kl")) == ["ab cd ef gh ", "ij kl"]  # a window cut
    text = "abc中文" * 3
    assert small.encode(text) == [t for piece in small.split_long_input(text) for t in base.encode(piece)]
    long_word = "abc" * 10  # one pre-token of 30 chars: cut at 4, so "abc" no longer merges whole
    assert small.encode(long_word) != base.encode(long_word)
    assert small.decode(small.encode(long_word)) == long_word


def test_kimi_linear_table(tmp_path) -> None:
    write_kimi_tokenizer(tmp_path, K2_TABLE)
    write_config(tmp_path, "kimi_linear", [163586])
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == VOCAB_SIZE and tok.special_tokens["<|im_user|>"] == 163587
    assert tok.eos_token_ids == (163586, 163585)  # <|im_end|>, [EOS]
    assert tok.encode("<think>", allow_special=True) == [163606]
    assert tok.encode("<think>") != [163606]


def test_bad_files_are_named(tmp_path) -> None:
    root = tmp_path / "k3"
    write_kimi_tokenizer(root, K3_TABLE)
    model = root / "tiktoken.model"
    good = model.read_text()
    model.write_text(good.replace("\n", "\nnot-a-rank-line\n", 1))
    with pytest.raises(ValueError, match=r"tiktoken.model:2: expected 'base64-token rank'"):
        load_tokenizer(root)
    lines = good.splitlines()
    model.write_text("\n".join(lines[:-1]) + "\n")  # one rank short: specials would move
    with pytest.raises(ValueError, match="outside the special slots"):
        load_tokenizer(root)
    model.write_text("\n".join(lines[:5] + [lines[5].split()[0] + " 999999999"] + lines[6:]) + "\n")
    with pytest.raises(ValueError, match="ranks must be exactly"):
        load_tokenizer(root)
    model.write_text(good)
    config = root / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["added_tokens_decoder"]["163700"] = {"content": "[BOS]"}
    config.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"tokenizer_config.json: .*'\[BOS\]' has ids"):
        load_tokenizer(root)
    config.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        load_tokenizer(root)
    config.unlink()
    with pytest.raises(ValueError, match="needs tokenizer_config.json"):
        load_tokenizer(root)
