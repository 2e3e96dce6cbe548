"""The reasoning gate: the grammar stays off inside think and engages exactly at the family's openers,
including the shapes of vLLM #57714 (think skipped: the grammar must still engage) and #53246."""

from __future__ import annotations

import json

import pytest

from grammar_drive import generate, validate_json
from grammar_tokenizer import TinyTokenizer
from rocm_k3.formats.parsers import parse_output
from rocm_k3.structured import StructuredCompiler, StructuredOutputs, allocate_bitmask, tool_call_constraint

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def k3():
    tok = TinyTokenizer("kimi_k3")
    return tok, StructuredCompiler(tok, "kimi_k3")


@pytest.fixture(scope="module")
def k2():
    tok = TinyTokenizer("kimi_k2")
    return tok, StructuredCompiler(tok, "kimi_k2")


def feed(state, ids):
    for t in ids:
        state.accept(t)


def json_state(compiler):
    return compiler.new_state(StructuredOutputs(json=SCHEMA), thinking=True)


def tools_state(compiler):
    return compiler.new_state(StructuredOutputs(tools=tool_call_constraint(TOOLS, "required")), thinking=True)


def test_gated_state_writes_no_mask(k3):
    tok, c = k3
    state = json_state(c)
    bitmask = allocate_bitmask(1, c.vocab_size)
    bitmask.fill_(7)
    feed(state, tok.encode("thinking about <|open|>response in prose"))  # typed text, no special tokens
    assert state.is_gated and not state.needs_bitmask
    assert not state.fill_bitmask(bitmask, 0) and bool((bitmask == 7).all())
    assert state.num_constrained_tokens == 0


@pytest.mark.parametrize("tag", ["merged", "bytes"])
def test_k3_opens_after_think_close(k3, tag):
    tok, c = k3
    close, sep = tok.special_tokens["<|close|>"], tok.special_tokens["<|sep|>"]
    name = tok.encode("think") if tag == "merged" else list(b"think")
    assert len(name) == (1 if tag == "merged" else 5)
    state = json_state(c)
    feed(state, tok.encode("hmm") + [close] + name)
    assert state.is_gated
    state.accept(sep)
    assert not state.is_gated and state.needs_bitmask


@pytest.mark.parametrize("text", [
    "<|close|>thinking<|sep|>", "<|close|>xthink<|sep|>", "<|open|>think<|sep|>", "<|close|>message<|sep|>",
    "<|close|><|media_pad|>think<|sep|>", "<|close|>tools<|sep|>", "<|open|>tools<|sep|>",
])
def test_k3_lookalikes_keep_the_gate_closed(k3, text):
    tok, c = k3
    state = json_state(c)
    feed(state, tok.encode(text))
    assert state.is_gated, text


def test_padding_ids_while_gated(k3):
    tok, _ = k3
    c = StructuredCompiler(tok, "kimi_k3", vocab_size=tok.vocab_size + 32)  # logits wider than the tokenizer
    state = json_state(c)
    close, sep = tok.special_tokens["<|close|>"], tok.special_tokens["<|sep|>"]
    feed(state, [close, *tok.encode("think"), tok.vocab_size + 5, sep])  # a padding id breaks the marker
    assert state.is_gated
    feed(state, [close, *tok.encode("think"), sep])
    assert not state.is_gated


def test_k3_spelled_out_marker_keeps_the_gate_closed(k3):
    tok, c = k3
    state = json_state(c)
    feed(state, list(b"<|close|>think<|sep|>"))  # the text typed byte by byte, not the special tokens
    assert state.is_gated


def generate_and_parse(tok, c, state, prefix, fed=(), **parse_kw):
    """Generate after ``prefix`` (``fed`` = ids the state already accepted before) and parse it all."""
    ids = list(fed) + generate(state, c.vocab_size, seed=3, prefix=prefix)
    return parse_output(c.family, tok.decode(ids), thinking=True, **parse_kw)


def test_57714_skipped_think_engages_at_response_open(k3):
    # the model answers straight away: no think-close ever comes; the grammar must engage anyway
    tok, c = k3
    state = json_state(c)
    prefix = tok.encode("<|open|>response<|sep|>")
    feed(state, prefix[:-1])
    assert state.is_gated
    parsed = generate_and_parse(tok, c, state, prefix[-1:], fed=prefix[:-1])
    assert parsed.reasoning is None
    validate_json(json.loads(parsed.content), SCHEMA)


def test_53246_orphan_response_close_engages(k3):
    tok, c = k3
    state = json_state(c)
    parsed = generate_and_parse(tok, c, state, tok.encode("I will answer in JSON.<|close|>response<|sep|>"))
    assert parsed.reasoning == "I will answer in JSON."
    validate_json(json.loads(parsed.content), SCHEMA)


def test_k3_tools_open_engages_only_tool_grammars(k3):
    tok, c = k3
    opener = tok.encode("need f<|open|>tools<|sep|>")
    content = json_state(c)
    feed(content, opener)
    assert content.is_gated  # a JSON answer cannot start inside a tool section
    state = tools_state(c)
    parsed = generate_and_parse(tok, c, state, opener, tools=TOOLS, tool_choice="required")
    assert parsed.reasoning == "need f" and parsed.tool_calls
    assert all(c.name == "f" and isinstance(json.loads(c.arguments_json)["n"], int) for c in parsed.tool_calls)


def test_k2_gate(k2):
    tok, c = k2
    state = json_state(c)
    feed(state, tok.encode("hmm <think> still<|tool_calls_section_begin|>"))
    assert state.is_gated  # a section start opens only tool grammars
    state.accept(tok.special_tokens["</think>"])
    assert not state.is_gated
    tools = tools_state(c)
    parsed = generate_and_parse(tok, c, tools, tok.encode("calling<|tool_calls_section_begin|>"), tools=TOOLS,
                                tool_choice="required")
    assert parsed.reasoning == "calling" and parsed.tool_calls and parsed.tool_calls[0].id.startswith("functions.f:")


def test_thinking_off_or_prompt_in_response_is_open_at_once(k3, k2):
    for tok, c in (k3, k2):
        assert not c.new_state(StructuredOutputs(json=SCHEMA), thinking=False).is_gated
        assert not c.new_state(StructuredOutputs(json=SCHEMA), thinking=True, prompt_in_think=False).is_gated
