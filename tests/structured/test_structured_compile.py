"""StructuredCompiler: vocabulary encoding, errors naming the problem, the cache, bitmask fill and apply."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from grammar_tokenizer import TinyTokenizer
from rocm_k3.structured import (
    GrammarRejectedError,
    StructuredCompiler,
    StructuredOutputs,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
)
from rocm_k3.structured.json_schema import normalize_json_schema


@pytest.fixture(scope="module")
def tok():
    return TinyTokenizer("kimi_k3", vocab_size=330)


@pytest.fixture(scope="module")
def compiler(tok):
    return StructuredCompiler(tok, "kimi_k3", vocab_size=352)  # model logits wider than the tokenizer


def allowed(state, vocab):
    bm = allocate_bitmask(1, vocab)
    assert state.fill_bitmask(bm, 0)
    return {j for j in range(vocab) if (int(bm[0, j // 32]) >> (j % 32)) & 1}


def test_vocab_encoding_keeps_specials_out_of_text(tok, compiler):
    st = compiler.new_state(StructuredOutputs(json={"type": "string"}), thinking=False)
    for t in tok.encode('"abc'):
        st.accept(t)
    ok = allowed(st, compiler.vocab_size)
    specials = set(tok.special_tokens.values())
    assert ok & specials == set(), "no special token (marker, media, reserved, eos) inside a JSON string"
    assert not ok & set(range(330, 352)), "padding ids beyond the tokenizer are never allowed"
    assert ord("x") in ok and tok.encode("Paris")[0] in ok


def test_eos_allowed_only_when_complete(tok, compiler):
    st = compiler.new_state(StructuredOutputs(regex="ab"), thinking=False)
    eos = set(tok.eos_token_ids)
    assert not allowed(st, compiler.vocab_size) & eos
    st.accept(ord("a"))
    st.accept(ord("b"))
    ok = allowed(st, compiler.vocab_size)
    assert eos <= ok and tok.special_tokens["<|close|>"] in ok  # the optional response/message close
    assert ok - eos - {tok.special_tokens["<|close|>"]} == set()
    st.accept(tok.special_tokens["<|end_of_msg|>"])
    assert st.is_terminated and not st.needs_bitmask
    assert not st.fill_bitmask(allocate_bitmask(1, compiler.vocab_size), 0)
    with pytest.raises(GrammarRejectedError, match="terminated"):
        st.accept(ord("a"))


def test_rejected_token_raises(compiler):
    st = compiler.new_state(StructuredOutputs(choice=["yes", "no"]), thinking=False)
    with pytest.raises(GrammarRejectedError, match="not allowed"):
        st.accept(ord("x"))


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputs(json={"type": "objx"}), r"json: .*objx"),
    (StructuredOutputs(json={"type": "string", "maxLength": -1}), "maxLength"),
    (StructuredOutputs(json=False), "json: .*cannot accept any value"),
    (StructuredOutputs(json={"type": "array", "minItems": 3, "maxItems": 1}), "json: minItems"),
    (StructuredOutputs(regex="a("), "regex: .*parenthesis"),
    (StructuredOutputs(grammar="root ::= undefined_rule"), "grammar: .*undefined_rule"),
    (StructuredOutputs(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}), "structural_tag: "),
])
def test_invalid_constraints_name_the_problem(compiler, spec, message):
    with pytest.raises(ValueError, match=message):
        compiler.validate(spec)


def test_cache(tok):
    c = StructuredCompiler(tok, "kimi_k3", cache_size=2)
    a = c.compile(StructuredOutputs(regex="a+"))
    assert c.compile(StructuredOutputs(regex="a+")) is a
    c.compile(StructuredOutputs(regex="b+"))
    c.compile(StructuredOutputs(regex="c+"))
    assert c.cache_len() == 2 and c.compile(StructuredOutputs(regex="a+")) is not a  # evicted (LRU)
    with pytest.raises(ValueError, match="cache_size"):
        StructuredCompiler(tok, "kimi_k3", cache_size=0)


def test_tokenizer_checks(tok):
    with pytest.raises(ValueError, match="needs special tokens"):
        StructuredCompiler(TinyTokenizer("kimi_k3", specials=("[BOS]", "[EOS]", "<|end_of_msg|>")), "kimi_k3")
    with pytest.raises(ValueError, match="family"):
        StructuredCompiler(tok, "llama")
    with pytest.raises(ValueError, match="smaller"):
        StructuredCompiler(tok, "kimi_k3", vocab_size=100)
    with pytest.raises(TypeError, match="token_bytes"):
        StructuredCompiler(object(), "kimi_k3")
    k2_no_think = TinyTokenizer("kimi_k2", specials=("[BOS]", "[EOS]", "<|im_end|>"))
    c = StructuredCompiler(k2_no_think, "kimi_k2")
    c.new_state(StructuredOutputs(regex="a"), thinking=False)  # works without think tokens when not thinking
    with pytest.raises(ValueError, match="think-end"):
        c.new_state(StructuredOutputs(regex="a"), thinking=True)
    with pytest.raises(ValueError, match="prompt_in_think"):
        c.new_state(StructuredOutputs(regex="a"), thinking=False, prompt_in_think=True)


def _reference_apply(logits, bitmask, rows):
    out = logits.clone()
    for r in rows:
        for j in range(logits.shape[1]):
            if not (int(bitmask[r, j // 32]) >> (j % 32)) & 1:
                out[r, j] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_fill_and_apply_leave_unconstrained_rows_alone(tok, compiler, dtype):
    gated = compiler.new_state(StructuredOutputs(regex="[0-9]+"), thinking=True)  # still inside think
    states = [compiler.new_state(StructuredOutputs(regex="[0-9]+"), thinking=False), None, gated,
              compiler.new_state(StructuredOutputs(choice=["yes", "no"]), thinking=False)]
    bitmask = allocate_bitmask(len(states), compiler.vocab_size)
    for batch in (None, xgr.BatchGrammarMatcher(max_threads=2)):
        bitmask.fill_(-1)
        rows = fill_bitmasks(states, bitmask, batch)
        assert rows == [0, 3]
        assert bool((bitmask[1:3] == -1).all()), "rows without a grammar are not written"
        logits = torch.randn(len(states), compiler.vocab_size, generator=torch.Generator().manual_seed(0)).to(dtype)
        want = _reference_apply(logits, bitmask, rows)
        apply_bitmask(logits, bitmask, rows)
        assert torch.equal(logits, want)
        assert torch.isfinite(logits[0, ord("7")]) and torch.isinf(logits[0, ord("a")])
        assert torch.isfinite(logits[3, ord("y")]) and torch.isinf(logits[3, ord("7")])


def test_apply_bitmask_shape_errors(compiler):
    with pytest.raises(ValueError, match="cover"):
        apply_bitmask(torch.zeros(1, 400), allocate_bitmask(1, 320), [0])
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask(torch.zeros(1, 320), torch.zeros(1, 10, dtype=torch.int64), [0])
    apply_bitmask(torch.zeros(1, 320), allocate_bitmask(1, 320), [])  # nothing to do


def test_xgrammar_length_bug_is_worked_around():
    # xgrammar 0.2.9 admits raw control characters in length-bounded strings; our rewrite must not
    vocab = xgr.TokenizerInfo([bytes([i]) for i in range(256)], xgr.VocabType.RAW, vocab_size=256, stop_token_ids=[0])
    comp = xgr.GrammarCompiler(vocab, max_threads=1)
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}}

    def control_ok(s):
        m = xgr.GrammarMatcher(comp.compile_json_schema(s))
        return m.accept_string('{"s": "a\x01')

    assert control_ok(schema), "xgrammar fixed the bug: drop normalize_json_schema's length rewrite"
    fixed = normalize_json_schema(schema)
    assert not control_ok(fixed)
    m = xgr.GrammarMatcher(comp.compile_json_schema(fixed))
    assert m.accept_string('{"s": "abcd"}') and m.is_completed()
    assert not xgr.GrammarMatcher(comp.compile_json_schema(fixed)).accept_string('{"s": "abcde"')
    assert normalize_json_schema({"enum": [{"type": "string", "maxLength": 1}]})["enum"][0]["maxLength"] == 1
