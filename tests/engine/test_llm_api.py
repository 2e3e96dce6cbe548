"""The Python API: rocm_k3.LLM(path).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import rel_err
from model_fixtures import one_thread  # noqa: F401 (autouse)

import rocm_k3
from rocm_k3.engine.llm import LLM, PromptTooLongError
from simple_cache import SimpleCache
from rocm_k3.model.tiny import EMBEDDED_DIR, embedded_name, write_tiny_checkpoint
from rocm_k3.settings import override
from rocm_k3.tokenizers import TOKENIZER_FILE

GREEDY = rocm_k3.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=1)


@pytest.fixture(scope="module")
def llm(tiny_dir) -> LLM:
    return rocm_k3.LLM(tiny_dir, dtype="float32")


def test_greedy_tokens_are_argmax_of_a_full_forward(llm: LLM) -> None:
    out = llm.generate("Hello", GREEDY)[0]
    assert out.prompt_token_ids == list(b"Hello") and len(out.token_ids) == 6
    assert out.finish_reason == "length" and out.text == llm.tokenizer.decode(out.token_ids)
    seq = out.prompt_token_ids + out.token_ids[:-1]
    cache = SimpleCache(llm.config, max_model_len=len(seq), dtype=llm.dtype)
    batch = cache.prepare([(0, seq)])
    batch.logits_indices = torch.arange(len(out.prompt_token_ids) - 1, len(seq))
    assert llm.model.forward(batch, cache).argmax(-1).tolist() == out.token_ids


def test_prompt_forms(llm: LLM) -> None:
    text = llm.generate("Hello", GREEDY)
    ids = llm.generate(list(b"Hello"), GREEDY)
    many = llm.generate(["Hello", list(b"Hi there")], GREEDY)
    many_ids = llm.generate([list(b"Hello"), list(b"Hi there")], GREEDY)
    assert text[0].token_ids == ids[0].token_ids == many[0].token_ids == many_ids[0].token_ids
    assert many[1].token_ids == many_ids[1].token_ids and len(many) == 2


def test_seeded_sampling(llm: LLM) -> None:
    params = [rocm_k3.SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True) for s in (1, 1, 2)]
    a, b, c = llm.generate(["abc", "abc", "abc"], params)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_token_and_stop_string(llm: LLM) -> None:
    base = llm.generate("stop here", GREEDY)[0]
    cut = 2
    token = base.token_ids[cut]
    first = base.token_ids.index(token)
    out = llm.generate("stop here", rocm_k3.SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[token]))[0]
    assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop"
    stop = base.text[2:4]
    out = llm.generate("stop here", rocm_k3.SamplingParams(temperature=0, max_tokens=6, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == base.text[:base.text.find(stop)]


def test_logprobs(llm: LLM) -> None:
    out = llm.generate("lp", rocm_k3.SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == 3
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert next(iter(entry)) == tok and 2 <= len(entry) <= 3
        assert max(entry.values()) == entry[tok]  # greedy: the chosen token is the most likely one
    assert llm.generate("lp", GREEDY)[0].logprobs is None


def test_max_model_len(tiny_dir) -> None:
    small = LLM(tiny_dir, dtype="float32", max_model_len=8)
    with pytest.raises(PromptTooLongError, match="9 tokens exceed max_model_len=8"):
        small.generate(list(range(9)))
    out = small.generate(list(range(6)), rocm_k3.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"  # 6 prompt + 2 fed back fill 8 slots
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_dir, dtype="float32", max_model_len=10**7)


def test_checkpoint_without_tokenizer(tiny_dir, tmp_path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(tiny_dir, bare)
    (bare / TOKENIZER_FILE).unlink()
    llm = LLM(bare, dtype="float32")
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("Hello")
    out = llm.generate([72, 105], GREEDY)[0]
    assert len(out.token_ids) == 6 and out.text == ""


def test_checkpoint_tokenizer_json(tiny_dir, tmp_path) -> None:
    """A released checkpoint's tokenizer.json (read with the tokenizers package) encodes prompts and decodes output."""
    tokenizers = pytest.importorskip("tokenizers")
    ckpt = tmp_path / "hf_tok"
    shutil.copytree(tiny_dir, ckpt)
    (ckpt / TOKENIZER_FILE).unlink()
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(["hello", "world"] + [f"w{i}" for i in range(260)])}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(ckpt / "tokenizer.json"))
    out = LLM(ckpt, dtype="float32").generate("hello world", GREEDY)[0]
    assert out.prompt_token_ids == [1, 2]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True) and out.text


def test_invalid_arguments(tiny_dir, llm: LLM) -> None:
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_dir, dtype="int8")
    with pytest.raises(ValueError, match="backend"):
        LLM(tiny_dir, backend="cuda-magic")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([1, 10_000])
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([""])
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY])


def test_dtype_and_backend_choice(tiny_dir) -> None:
    llm = LLM(tiny_dir, dtype="bfloat16", backend="reference")
    assert llm.model.dtype == torch.bfloat16 and llm.model.backend.backend == "reference"
    out = llm.generate("bf16", GREEDY)[0]
    assert len(out.token_ids) == 6


def test_a8w4_experts(tmp_path) -> None:
    """moe_act_quant="mxfp8" reaches the routed experts: A8W4 logits move off A16W4 by FP8 rounding only.

    Every expert is routed (top-k = E), so no router near-tie can flip between the two runs. E4M3 keeps 3
    mantissa bits (about 2% rms rounding per element); five random MoE layers amplify that to ~10% on the
    logits (measured 8-11% over seeds). 0.25 stays far below unrelated logits (~1.4), and a difference of
    exactly 0 would mean the option was dropped on the way to fused_moe.
    """
    root = write_tiny_checkpoint(tmp_path, seed=1, text_overrides={"num_experts_per_token": 8})
    a16w4 = LLM(root, dtype="float32")
    a8w4 = LLM(root, dtype="float32", moe_act_quant="mxfp8")
    assert all(layer.ffn.act_quant.mode == "mxfp8" for layer in a8w4.model.layers[1:])
    ids = list(b"A8W4 vs A16W4")
    logits = []
    for model in (a16w4.model, a8w4.model):
        cache = SimpleCache(model.cfg, max_model_len=len(ids), dtype=model.dtype)
        logits.append(model.forward(cache.prepare([(0, ids)]), cache))
    err = rel_err(logits[1], logits[0])
    assert 0 < err <= 0.25, err
    with pytest.raises(ValueError, match="moe_act_quant"):
        LLM(root, moe_act_quant="int8")


def test_embedded_model_is_installed_on_first_use(tmp_path) -> None:
    """``LLM()`` copies the committed trained checkpoint into the cache dir once, under a name with its digest."""
    with override(cache_dir=tmp_path):
        llm = rocm_k3.LLM(dtype="float32")
        again = rocm_k3.LLM(dtype="float32")
    assert llm.path == again.path == tmp_path / embedded_name() and (llm.path / "config.json").is_file()
    for name in ("config.json", "model.safetensors", "rocm_k3_tokenizer.json"):
        assert (llm.path / name).read_bytes() == (EMBEDDED_DIR / name).read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == [llm.path.name]  # no temporary directory left behind
    assert llm.config.is_k3 and llm.config.expert_format == "mxfp4"
    out = llm.generate("Hello", GREEDY)[0]
    assert len(out.token_ids) == 6 and isinstance(out.text, str)
