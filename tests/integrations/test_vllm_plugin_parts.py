"""The parts of rocm-k3's vLLM plugin that need no vLLM (default tier): the expanded MLA head size, where the
plugin takes the released architecture names, and rocm-k3's tokenizer as vLLM sees it (token strings that survive
byte-by-byte detokenization, the K3 chat template as token ids). The plugin inside vLLM: tests/integrations/test_vllm_plugin.py.
"""

from __future__ import annotations

import pytest

from rocm_k3 import settings
from rocm_k3.integrations.vllm.arch import expanded_head_size, takes_released_names
from rocm_k3.integrations.vllm.tokenizer import RocmK3Tokenizer
from rocm_k3.model.tiny import ensure_embedded_model
from rocm_k3.formats.k3_chat import K3ChatRenderer
from rocm_k3.tokenizers.loader import load_tokenizer


def test_expanded_head_size() -> None:
    assert expanded_head_size(128 + 64, 128) == 192  # K3 / Kimi Linear: q/k nope + rope, values padded
    assert expanded_head_size(32 + 16, 32) == 64  # a small geometry rounds up to a size every backend takes
    assert expanded_head_size(100, 130) == 160
    with pytest.raises(ValueError, match="exceed the largest attention head size"):
        expanded_head_size(600, 128)


def test_released_names_only_where_vllm_cannot_run_them() -> None:
    with settings.override(vllm_override=False):
        assert takes_released_names(is_cpu=True)[0]
        ok, why = takes_released_names(is_cpu=False)
        assert not ok and "ROCM_K3_VLLM_OVERRIDE=1" in why
    with settings.override(vllm_override=True):
        assert takes_released_names(is_cpu=False) == (True, "ROCM_K3_VLLM_OVERRIDE=1")


def test_settings_read_the_plugin_switches() -> None:
    s = settings.Settings.from_env({"ROCM_K3_VLLM_OVERRIDE": "1", "ROCM_K3_VLLM_DISABLE": "true"})
    assert s.vllm_override and s.vllm_disable
    assert not settings.Settings.from_env({}).vllm_override


@pytest.fixture(scope="module")
def embedded_tokenizer() -> RocmK3Tokenizer:
    return RocmK3Tokenizer.from_pretrained(ensure_embedded_model())


def test_tokenizer_ids_and_specials(embedded_tokenizer: RocmK3Tokenizer) -> None:
    tok = embedded_tokenizer
    assert (tok.vocab_size, tok.max_token_id, len(tok)) == (272, 271, 272)
    assert tok.eos_token_id == tok.tokenizer.special_tokens["<|end_of_msg|>"]
    assert tok.bos_token_id == 256 and tok.pad_token_id == 267
    assert tok.encode("héllo") == list("héllo".encode())
    assert tok.get_added_vocab()["<|open|>"] == 259 and "<|open|>" in tok.all_special_tokens
    assert tok("ab")["input_ids"] == [97, 98] and tok(["a", "bc"])["input_ids"] == [[97], [98, 99]]
    assert tok.encode("abcdef", truncation=True, max_length=2) == [101, 102]  # left truncation (vLLM's default)


def test_tokenizer_token_strings_survive_partial_utf8(embedded_tokenizer: RocmK3Tokenizer) -> None:
    tok = embedded_tokenizer
    ids = list("é€".encode()) + [258]
    tokens = tok.convert_ids_to_tokens(ids)
    assert tokens[-1] == "<|end_of_msg|>" and all(len(t) == 1 for t in tokens[:-1])
    assert tok.convert_tokens_to_string(tokens[:1]) == "\ufffd"  # half a character: replacement, no error
    assert tok.convert_tokens_to_string(tokens) == "é€<|end_of_msg|>"
    assert tok.convert_tokens_to_ids(tokens) == ids
    assert tok.decode(ids, skip_special_tokens=True) == "é€"
    assert tok.get_vocab()[tokens[0]] == ids[0]


def test_tokenizer_chat_template_is_k3_xtml(embedded_tokenizer: RocmK3Tokenizer) -> None:
    path = ensure_embedded_model()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = K3ChatRenderer(load_tokenizer(path)).render(messages, thinking=False)
    got = embedded_tokenizer.apply_chat_template([{**m, "tool": None} for m in messages], tokenize=True,
                                                 thinking=False, add_generation_prompt=True)
    assert got == list(want.token_ids)
    assert embedded_tokenizer.apply_chat_template(messages, thinking=False) == want.text
    with pytest.raises(ValueError):
        embedded_tokenizer.apply_chat_template([{"role": "wizard", "content": "x"}], tokenize=True)


def test_tokenizer_reads_k3_tiktoken_model(tmp_path) -> None:
    """A K3 ``tiktoken.model`` directory: multi-byte tokens keep their bytes through vLLM's token strings, and the
    chat template is rocm-k3's K3 XTML over that tokenizer."""
    from tokenizer_files import write_config, write_k3_tokenizer

    write_k3_tokenizer(tmp_path, ["Hello", " world"])
    write_config(tmp_path, "kimi_k3", [163586])
    tok = RocmK3Tokenizer.from_pretrained(tmp_path)
    ids = tok.encode("Hello world é")
    assert tok.decode(ids) == "Hello world é"
    assert tok.convert_ids_to_tokens(ids)[0] == "Hello"
    assert tok.convert_tokens_to_string(tok.convert_ids_to_tokens(ids)) == "Hello world é"
    messages = [{"role": "user", "content": "Hello"}]
    want = K3ChatRenderer(load_tokenizer(tmp_path)).render(messages)
    assert tok.apply_chat_template(messages, tokenize=True) == list(want.token_ids)
