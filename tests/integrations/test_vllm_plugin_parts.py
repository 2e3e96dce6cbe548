"""The parts of rocm-k3's vLLM plugin that need no vLLM (default tier): the expanded MLA head size, where the
plugin takes the released architecture names, and rocm-k3's tokenizer as vLLM sees it (token strings that survive
byte-by-byte detokenization, the K3 chat template as token ids). The plugin inside vLLM: tests/integrations/test_vllm_plugin.py.
"""

from __future__ import annotations

import pytest

from rocm_k3 import settings
from types import SimpleNamespace as NS

from rocm_k3.integrations.vllm.arch import choose_mla_path, expanded_head_size, layers_block_type, \
    takes_released_names
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
    s = settings.Settings.from_env({"ROCM_K3_VLLM_OVERRIDE": "1", "ROCM_K3_VLLM_DISABLE": "true",
                                    "ROCM_K3_VLLM_MLA": "Latent"})
    assert s.vllm_override and s.vllm_disable and s.vllm_mla == "latent"
    default = settings.Settings.from_env({})
    assert not default.vllm_override and default.vllm_mla == "auto"
    with pytest.raises(ValueError, match="ROCM_K3_VLLM_MLA='fast'"):
        settings.Settings.from_env({"ROCM_K3_VLLM_MLA": "fast"})


def _kimi_text_config(full: list[int], layers: int = 4, kv_lora_rank: int = 512, rope: int = 64) -> NS:
    return NS(num_hidden_layers=layers, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope,
              linear_attn_config={"full_attn_layers": full, "kda_layers": [i for i in range(1, layers + 1)
                                                                           if i not in full]})


def test_layers_block_type_from_either_config_spelling() -> None:
    assert layers_block_type(_kimi_text_config([2, 4])) == ["mamba", "attention", "mamba", "attention"]
    hf = NS(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "full_attention"])
    assert layers_block_type(hf) == ["mamba", "attention", "attention"]


@pytest.mark.parametrize("case", [
    # (full-attention layers, kv_lora_rank, is_cpu, mode, VLLM_MLA_DISABLE) -> latent?, a word of the reason
    ([2, 4], 512, True, "auto", False, False, "KDA layers force a hybrid page"),
    ([1, 2, 3, 4], 512, True, "auto", False, True, "no KDA layers, latent 576"),
    ([1, 2, 3, 4], 256, True, "auto", False, False, "takes only 576"),
    ([2, 4], 512, False, "auto", False, True, "split the hybrid page into kernel blocks"),
    ([2, 4], 512, False, "expanded", False, False, "ROCM_K3_VLLM_MLA=expanded"),
    ([1, 2, 3, 4], 512, True, "expanded", False, False, "ROCM_K3_VLLM_MLA=expanded"),
    ([2, 4], 512, False, "latent", False, True, "ROCM_K3_VLLM_MLA=latent"),
    ([2, 4], 512, False, "auto", True, False, "VLLM_MLA_DISABLE=1"),
], ids=["cpu-hybrid", "cpu-mla-only", "cpu-narrow-latent", "gpu", "gpu-forced-expanded", "cpu-forced-expanded",
        "gpu-forced-latent", "vllm-mla-disabled"])
def test_choose_mla_path(case) -> None:
    """Latent MLA (vLLM's MLA layer) wherever the platform's MLA backend takes the model's page; expanded heads
    elsewhere; the reason is logged with the choice."""
    full, rank, is_cpu, mode, disabled, latent, why = case
    path = choose_mla_path(_kimi_text_config(full, kv_lora_rank=rank), is_cpu=is_cpu, where="cuda:0", mode=mode,
                           mla_disabled=disabled)
    assert path.latent == latent and path.name == ("latent" if latent else "expanded")
    assert why in path.reason


def test_forced_latent_mla_that_cannot_run_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="ROCM_K3_VLLM_MLA=latent.*KDA layers.*takes only 576"):
        choose_mla_path(_kimi_text_config([2, 4], kv_lora_rank=128), is_cpu=True, where="cpu", mode="latent")
    with pytest.raises(ValueError, match="contradicts VLLM_MLA_DISABLE"):
        choose_mla_path(_kimi_text_config([2, 4]), is_cpu=False, where="cuda:0", mode="latent", mla_disabled=True)


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
