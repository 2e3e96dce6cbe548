"""The chat request side shared by LLM.chat and the server (rocm_k3.engine.chat): tool_choice rules, the one
constraint a request gets, thinking options, the parse of the output; LLM.chat end to end on the tiny K3 model;
the same preparation for a Kimi Linear (K2 markers) checkpoint, its grammar driven to a parsable tool call."""

from __future__ import annotations

import json

import jsonschema
import pytest
from grammar_drive import generate
from tokenizer_files import K2_TABLE, K2_TEMPLATE, write_config, write_kimi_tokenizer

import rocm_k3
from rocm_k3.engine.chat import ChatRequest, ModelFrontend, chat_finish_reason
from rocm_k3.formats.parsers.registry import checkpoint_family
from rocm_k3.model.tiny import ensure_embedded_model
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.structured import StructuredCompiler
from rocm_k3.tokenizers import load_tokenizer
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)

USER = [{"role": "user", "content": "hi"}]
ARGS = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "count", "parameters": ARGS}},
         {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def k3():
    path = ensure_embedded_model()
    return ModelFrontend(path, load_tokenizer(path), checkpoint_family(path))


@pytest.mark.parametrize("request_kw, auto, match", [
    ({"tools": TOOLS}, False, "enable-auto-tool-choice"),
    ({"tool_choice": "required"}, True, "needs a non-empty tools list"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, True, "not in tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, True, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, True,
     "cannot be combined"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, True, "cannot be combined"),
    ({"structured_outputs": {"regexp": "a"}}, True, "unknown keys"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, True, "exactly one"),
    ({"structured_outputs": {"json": {"type": "nope"}}}, True, "json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, True, "schema"),
    ({"response_format": {"type": "xml"}}, True, "response_format.type"),
    ({"parallel_tool_calls": "no", "tools": TOOLS}, True, "parallel_tool_calls"),
    ({"reasoning_effort": "extreme"}, True, "reasoning_effort"),
    ({"thinking_token_budget": -1}, True, "thinking_token_budget"),
    ({"messages": [{"role": "user"}]}, True, r"messages\[0\].content"),
])
def test_bad_chat_requests_are_named(k3, request_kw, auto, match) -> None:
    kw = dict(request_kw)
    messages = kw.pop("messages", USER)
    with pytest.raises(ValueError, match=match):
        k3.prepare_chat(ChatRequest(messages, **kw), enable_auto_tool_choice=auto)


def test_constraints_and_thinking(k3) -> None:
    plain = k3.prepare_chat(ChatRequest(USER))
    assert plain.constraint is None and plain.prompt_in_think and plain.thinking
    off = k3.prepare_chat(ChatRequest(USER, reasoning_effort="none", thinking_token_budget=5))
    assert not off.prompt_in_think and not off.thinking
    assert off.sampling(SamplingParams()).thinking_token_budget is None  # nothing to budget outside think
    required = k3.prepare_chat(ChatRequest(USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    tools = required.constraint.tools
    assert tools.mode == "required" and not tools.parallel and not tools.allow_text
    params = required.sampling(SamplingParams(max_tokens=3))
    assert params.structured_outputs is required.constraint and params.prompt_in_think
    assert not params.skip_special_tokens
    assert k3.prepare_chat(ChatRequest(USER, tools=TOOLS, tool_choice="none")).constraint is None
    assert k3.prepare_chat(ChatRequest(USER, tools=TOOLS)).tool_choice == "auto"
    schema = k3.prepare_chat(ChatRequest(USER, response_format={"type": "json_schema",
                                                                "json_schema": {"schema": ARGS}}))
    assert schema.constraint.json == ARGS and "response_format=json_schema" in schema.prompt_text
    assert chat_finish_reason("stop", True) == "tool_calls" and chat_finish_reason("length", True) == "length"


def test_parse_keeps_one_call_without_parallel_calls(k3) -> None:
    call = '<|open|>call tool="count" index="{i}"<|sep|><|open|>argument key="n" type="number"<|sep|>{i}' \
           '<|close|>argument<|sep|><|close|>call<|sep|>'
    text = ("x<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
            + call.format(i=1) + call.format(i=2) + "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>")
    both = k3.prepare_chat(ChatRequest(USER, tools=TOOLS, tool_choice="required")).parse(text)
    one = k3.prepare_chat(ChatRequest(USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)).parse(text)
    assert [json.loads(c.arguments_json) for c in both.tool_calls] == [{"n": 1}, {"n": 2}]
    assert [json.loads(c.arguments_json) for c in one.tool_calls] == [{"n": 1}] and both.reasoning == "x"


def test_llm_chat_end_to_end() -> None:
    llm = rocm_k3.LLM(dtype="float32", max_model_len=2048)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=200)
    out = llm.chat(USER, params, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "count"}},
                   thinking_token_budget=2)[0]
    assert out.finish_reason == "tool_calls" and [c.name for c in out.tool_calls] == ["count"]
    jsonschema.validate(json.loads(out.tool_calls[0].arguments_json), ARGS)
    assert out.reasoning_content == llm.tokenizer.decode(out.output.token_ids[:2]) or out.reasoning_content is None
    two = llm.chat([USER, USER + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]],
                   SamplingParams(temperature=0, max_tokens=4), chat_template_kwargs={"thinking": False})
    assert len(two) == 2 and all(o.reasoning_content is None and o.finish_reason == "length" for o in two)
    with pytest.raises(ValueError, match="regex"):
        llm.chat(USER, params, structured_outputs={"regex": "("})


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("kimi_linear_chat")
    write_kimi_tokenizer(root, K2_TABLE, ["user", "assistant", "count", "functions"])
    (root / "chat_template.jinja").write_text(K2_TEMPLATE)
    write_config(root, "kimi_linear", 163586)
    return root


def test_kimi_linear_chat_grammar_gives_a_parsable_call(kimi_linear) -> None:
    tok = load_tokenizer(kimi_linear)
    frontend = ModelFrontend(kimi_linear, tok, checkpoint_family(kimi_linear))
    assert frontend.family == "kimi_k2"
    prepared = frontend.prepare_chat(ChatRequest(USER, tools=TOOLS, tool_choice="required",
                                                 parallel_tool_calls=False))
    assert prepared.prompt_text.startswith("<|im_system|>tool_declare") and prepared.prompt_in_think
    compiler = StructuredCompiler(tok, "kimi_k2")
    state = compiler.new_state(prepared.constraint, thinking=True, prompt_in_think=True)
    think = tok.encode("hmm</think>", allow_special=True)
    markers = {tok.special_tokens[t] for t in ("</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                                                "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                                                "<|tool_call_end|>")}
    specials = set(range(tok.vocab_size - 256, tok.vocab_size)) - markers - set(tok.eos_token_ids)
    banned = frozenset(range(0x80, 0x100)) | frozenset(specials)  # lone high bytes, specials that are no marker
    ids = generate(state, compiler.vocab_size, seed=1, prefix=think, banned=banned)
    parsed = prepared.parse(tok.decode(ids))
    assert parsed.reasoning == "hmm" and len(parsed.tool_calls) == 1
    call = parsed.tool_calls[0]
    assert call.name in ("count", "other") and call.id.startswith(f"functions.{call.name}:")
    if call.name == "count":
        jsonschema.validate(json.loads(call.arguments_json), ARGS)
