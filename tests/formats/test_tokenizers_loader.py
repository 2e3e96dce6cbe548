"""Which tokenizer and chat renderer a checkpoint directory gets; the tokenizer.json path."""

from __future__ import annotations

import json

import pytest
from tokenizer_files import K2_TABLE, write_config, write_k3_tokenizer, write_kimi_tokenizer

from rocm_k3.formats import K2ChatRenderer, K3ChatRenderer, load_chat_renderer
from rocm_k3.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    KimiTiktokenTokenizer,
    Tokenizer,
    embedded_byte_tokenizer,
    load_tokenizer,
)


def test_byte_tokenizer_gets_the_k3_renderer(tmp_path) -> None:
    embedded_byte_tokenizer().save(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    renderer = load_chat_renderer(tmp_path, tok)  # no config.json: the byte tokenizer alone decides
    assert isinstance(renderer, K3ChatRenderer) and renderer.family == "kimi_k3"
    write_kimi_tokenizer(tmp_path, K2_TABLE)  # the byte tokenizer file wins over tiktoken.model
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)


def test_k3_checkpoint(tmp_path) -> None:
    write_k3_tokenizer(tmp_path)
    write_config(tmp_path, "kimi_k3", 163586)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_length": 1048576, "eos_token_id": 163586}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, KimiTiktokenTokenizer) and isinstance(tok, Tokenizer)
    assert tok.eos_token_ids == (163586, 163585)
    assert isinstance(load_chat_renderer(tmp_path, tok), K3ChatRenderer)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [163586, 200000]}))
    with pytest.raises(ValueError, match=r"eos token id: token id 200000 is outside the vocabulary"):
        load_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "163586"}))
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id: expected an int"):
        load_tokenizer(tmp_path)


def test_kimi_linear_without_a_template_has_no_renderer(tmp_path) -> None:
    write_kimi_tokenizer(tmp_path, K2_TABLE)
    write_config(tmp_path, "kimi_linear", 163586)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, KimiTiktokenTokenizer) and load_chat_renderer(tmp_path, tok) is None
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert isinstance(load_chat_renderer(tmp_path, tok), K2ChatRenderer)


def test_no_tokenizer(tmp_path) -> None:
    write_config(tmp_path, "kimi_k3", 163586)
    assert load_tokenizer(tmp_path) is None and load_chat_renderer(tmp_path, None) is None


def _byte_level_tokenizer_json(path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("h", "e"), ("he", "l"), ("hel", "l"), ("Ġ", "w"), ("ä", "¸")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    tok.save(str(path))


def test_tokenizer_json(tmp_path) -> None:
    _byte_level_tokenizer_json(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    write_config(tmp_path, "kimi_linear", 3)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    end = tok.special_tokens["<|end|>"]
    assert tok.vocab_size == end + 1 and tok.eos_token_ids == (3, end)
    text = "hello world 中文😀<|end|>"
    plain = tok.encode(text)
    assert end not in plain and tok.decode(plain) == text
    special = tok.encode(text, allow_special=True)
    assert special[-1] == end and tok.decode(special) == text
    for ids in (plain, special):
        assert b"".join(tok.token_bytes(t) for t in ids) == text.encode()
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.feed([t]) for t in ids]
        assert "".join(pieces) + detok.finish() == text and "\ufffd" not in "".join(pieces)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    assert load_chat_renderer(tmp_path, tok) is None
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)


def test_embedded_model_runs_a_k3_chat(tmp_path) -> None:
    """The tiny checkpoint: byte tokenizer + K3 renderer; a rendered chat generates, and streams as decode says."""
    import rocm_k3
    from rocm_k3.model.tiny import write_tiny_checkpoint

    root = write_tiny_checkpoint(tmp_path)
    tok = load_tokenizer(root)
    renderer = load_chat_renderer(root, tok)
    assert isinstance(tok, ByteTokenizer) and isinstance(renderer, K3ChatRenderer)
    config = json.loads((root / "config.json").read_text())
    assert config["text_config"]["vocab_size"] == tok.vocab_size
    assert tuple(config["text_config"]["eos_token_id"]) == tok.eos_token_ids == (258, 257)
    chat = renderer.render([{"role": "user", "content": "Hi <|open|>"}], tools=[
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert chat.token_ids.count(tok.special_tokens["<|open|>"]) == chat.text.count("<|open|>") - 1  # not the user's
    llm = rocm_k3.LLM(root, dtype="float32")
    out = llm.generate([chat.token_ids], rocm_k3.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.prompt_token_ids == chat.token_ids
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.feed([t]) for t in out.token_ids) + detok.finish() == out.text == tok.decode(out.token_ids)
