"""Parser cases for both families (text, request options, expected result) and the chunked-streaming check.

Every case is checked whole and streamed in chunks of 1, 3, 7 and whole (``check_case``), and streamed in
random splits by the hypothesis test in ``test_parsers_stream.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rocm_k3.formats.parsers import ParsedOutput, StreamParser, ToolCall, merge_deltas, parse_output

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}},
]
CHUNK_SIZES = (1, 3, 7, None)  # None = the whole text in one feed


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    family: str
    text: str
    expected: ParsedOutput
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


def out(reasoning: str | None = None, content: str | None = None, calls: list[ToolCall] | None = None) -> ParsedOutput:
    return ParsedOutput(reasoning, content, calls or [])


def call(index: int, name: str, arguments_json: str, id: str | None = None) -> ToolCall:
    return ToolCall(id=id if id is not None else f"call_{index}", name=name, arguments_json=arguments_json,
                    index=index)


def stream(family: str, text: str, size: int | None, **options: Any) -> tuple[ParsedOutput, list]:
    """Feed ``text`` in chunks of ``size`` (None = whole); returns the merged result and the deltas."""
    parser = StreamParser(family, **options)
    step = size or max(len(text), 1)
    deltas = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)]
    deltas.append(parser.finish())
    return merge_deltas(deltas), deltas


def stream_split(family: str, text: str, cuts: list[int], **options: Any) -> ParsedOutput:
    parser = StreamParser(family, **options)
    bounds = [0, *sorted(set(cuts)), len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    deltas.append(parser.finish())
    return merge_deltas(deltas)


def check_case(case: Case) -> None:
    whole = parse_output(case.family, case.text, **case.options)
    assert whole == case.expected, f"{case.name}: parse_output gave {whole}"
    for size in CHUNK_SIZES:
        merged, _ = stream(case.family, case.text, size, **case.options)
        assert merged == case.expected, f"{case.name}: chunks of {size} gave {merged}"


# ---- Kimi K3 (XTML) ---------------------------------------------------------------------------------------------

def k3_call(name: str, args: str, index: int = 1) -> str:
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>{args}<|close|>call<|sep|>'


def k3_arg(key: str, type_: str, value: str) -> str:
    return f'<|open|>argument key="{key}" type="{type_}"<|sep|>{value}<|close|>argument<|sep|>'


def k3_tools(*calls: str) -> str:
    return "<|open|>tools<|sep|>" + "".join(calls) + "<|close|>tools<|sep|>"


THINK_END = "<|close|>think<|sep|>"
RESP = "<|open|>response<|sep|>{}<|close|>response<|sep|>"
MSG_END = "<|close|>message<|sep|><|end_of_msg|>"
PARIS = k3_call("get_weather", k3_arg("city", "string", "Paris"))
WITH_TOOLS = {"tools": TOOLS}


def broken_weather_call(name: str, body: str, kept: str) -> Case:
    """A K3 get_weather call with a malformed ``body``: no call, its text ``kept`` (markers removed) as content."""
    return Case(f"{name}_kept_as_content", "kimi_k3", "t" + THINK_END + k3_tools(k3_call("get_weather", body))
                + MSG_END, out("t", 'tool="get_weather" index="1" ' + kept), WITH_TOOLS)

K3_CASES = [
    Case("spec_example_tool_turn", "kimi_k3",
         "The user wants Paris weather; call the tool." + THINK_END + RESP.format("") + k3_tools(PARIS) + MSG_END,
         out("The user wants Paris weather; call the tool.", None, [call(0, "get_weather", '{"city": "Paris"}')]),
         WITH_TOOLS),
    Case("spec_example_answer_turn", "kimi_k3",
         "It is sunny." + THINK_END + RESP.format("It is 18 °C and clear in Paris.") + MSG_END,
         out("It is sunny.", "It is 18 °C and clear in Paris."), WITH_TOOLS),
    Case("no_tools_plain_answer", "kimi_k3", "hmm" + THINK_END + RESP.format("Hello!") + MSG_END, out("hmm", "Hello!")),
    # vLLM #53246: think never closed; the response-open inside think ends it
    Case("53246_response_open_in_think", "kimi_k3",
         "Let me check." + RESP.format("Checking now.") + k3_tools(PARIS) + MSG_END,
         out("Let me check.", "Checking now.", [call(0, "get_weather", '{"city": "Paris"}')]), WITH_TOOLS),
    # ... the reported shape: response text inline, an orphan response-close, then a valid tools block
    Case("53246_orphan_response_close_in_think", "kimi_k3",
         "I should call get_weather. Calling it now.<|close|>response<|sep|>" + k3_tools(PARIS) + MSG_END,
         out("I should call get_weather. Calling it now.", None, [call(0, "get_weather", '{"city": "Paris"}')]),
         WITH_TOOLS),
    Case("53246_tools_open_in_think", "kimi_k3", "Need the tool." + k3_tools(PARIS) + MSG_END,
         out("Need the tool.", None, [call(0, "get_weather", '{"city": "Paris"}')]), WITH_TOOLS),
    Case("bare_call_open_in_think", "kimi_k3", "Calling." + PARIS + MSG_END,
         out("Calling.", None, [call(0, "get_weather", '{"city": "Paris"}')]), WITH_TOOLS),
    Case("53246_orphan_response_close_no_tools", "kimi_k3", "Thinking.<|close|>response<|sep|>" + MSG_END,
         out("Thinking.")),
    Case("cut_off_inside_think_is_reasoning", "kimi_k3", "I am still thinking about the", out("I am still thinking about the")),
    Case("cut_off_in_think_marker_dropped", "kimi_k3", "almost done<|close|>thi", out("almost done")),
    Case("cut_off_after_lone_special", "kimi_k3", "done" + THINK_END + "<|open|>response<|sep|>Par<|close|>",
         out("done", "Par")),
    Case("skipped_think_channel", "kimi_k3", RESP.format("Direct answer.") + MSG_END, out(None, "Direct answer."),
         {"prompt_in_think": False}),
    Case("skipped_think_no_markers_is_content", "kimi_k3", "plain text", out(None, "plain text"),
         {"prompt_in_think": False}),
    Case("model_opens_think_itself", "kimi_k3",
         "<|open|>think<|sep|>hmm" + THINK_END + RESP.format("Hi") + MSG_END, out("hmm", "Hi"),
         {"prompt_in_think": False}),
    Case("newest_think_marker_wins", "kimi_k3", "a" + THINK_END + "b<|open|>think<|sep|>c", out("ac", "b")),
    Case("thinking_off_response_prompt", "kimi_k3", "Hello<|close|>response<|sep|>" + MSG_END, out(None, "Hello"),
         {"thinking": False}),
    Case("thinking_off_strips_think_markers", "kimi_k3", "<|open|>think<|sep|>x" + THINK_END + "y",
         out(None, "xy"), {"thinking": False}),
    # vllm-ascend #13204: raw JSON right after think-close, no response wrapper (or only a close)
    Case("13204_raw_json_after_think", "kimi_k3", 'r' + THINK_END + '{"reply": "hi"}' + MSG_END,
         out("r", '{"reply": "hi"}')),
    Case("13204_raw_json_then_orphan_response_close", "kimi_k3",
         'r' + THINK_END + '{"a": 1}<|close|>response<|sep|>' + MSG_END, out("r", '{"a": 1}')),
    # vLLM #51412: end-of-turn markers never reach the content; text after the turn is not this message
    Case("51412_end_markers_never_in_content", "kimi_k3",
         "x" + THINK_END + RESP.format("Done.") + MSG_END + "<|open|>message role=\"user\"<|sep|>more",
         out("x", "Done.")),
    Case("end_of_msg_alone", "kimi_k3", "x" + THINK_END + "<|open|>response<|sep|>ok<|end_of_msg|>", out("x", "ok")),
    Case("tokenizer_eos_ends_turn", "kimi_k3", "x" + THINK_END + "yes[EOS]", out("x", "yes")),
    Case("message_close_inside_think_ends_turn", "kimi_k3", "still thinking" + MSG_END + "junk",
         out("still thinking")),
    Case("typed_arguments", "kimi_k3",
         "t" + THINK_END + RESP.format("") + k3_tools(k3_call("search", "".join([
             k3_arg("query", "string", "42"), k3_arg("limit", "number", "5"), k3_arg("exact", "boolean", "true"),
             k3_arg("none", "null", "null"), k3_arg("filt", "object", '{"a": [1, 2]}'),
             k3_arg("ids", "array", "[1, 2]"), k3_arg("bad", "number", "five"), k3_arg("nan", "number", "NaN"),
             k3_arg("untyped", "", "7"), k3_arg("text", "string", "line1\nline2 Zürich <b>")]))) + MSG_END,
         out("t", None, [call(0, "search", '{"query": "42", "limit": 5, "exact": true, "none": null, '
                                            '"filt": {"a": [1, 2]}, "ids": [1, 2], "bad": "five", "nan": "NaN", '
                                            '"untyped": 7, "text": "line1\\nline2 Zürich <b>"}')]), WITH_TOOLS),
    Case("attribute_unescape", "kimi_k3",
         "t" + THINK_END + k3_tools(k3_call("get_weather", k3_arg("say &quot;hi&quot; &amp;quot;", "string", "v")))
         + MSG_END,
         out("t", None, [call(0, "get_weather", '{"say \\"hi\\" &quot;": "v"}')]), WITH_TOOLS),
    Case("call_without_name_kept_as_content", "kimi_k3",
         "t" + THINK_END + "<|open|>tools<|sep|><|open|>call index=\"1\"<|sep|>" + k3_arg("city", "string", "X")
         + "<|close|>call<|sep|>" + k3_call("get_weather", k3_arg("city", "string", "Y"), 2) + "<|close|>tools<|sep|>"
         + MSG_END,
         out("t", 'index="1" argument key="city" type="string" X argument', [call(0, "get_weather", '{"city": "Y"}')]),
         WITH_TOOLS),
    Case("json_raw_arguments_block", "kimi_k3",
         "t" + THINK_END + k3_tools(
             k3_call("get_weather", '<|open|>json type="object"<|sep|>{"city": "Paris"}<|close|>json<|sep|>'),
             k3_call("search", '<|open|>json type="object"<|sep|>not json at all<|close|>json<|sep|>', 2)) + MSG_END,
         out("t", 'tool="search" index="2" json type="object" not json at all json',
             [call(0, "get_weather", '{"city": "Paris"}')]), WITH_TOOLS),
    Case("parallel_calls_with_request_prefix", "kimi_k3",
         "t" + THINK_END + RESP.format("Two lookups.") + k3_tools(
             PARIS, k3_call("get_weather", k3_arg("city", "string", "Rome"), 2)) + MSG_END,
         out("t", "Two lookups.", [call(0, "get_weather", '{"city": "Paris"}', "call_r7_0"),
                                   call(1, "get_weather", '{"city": "Rome"}', "call_r7_1")]),
         {"tools": TOOLS, "call_id_prefix": "call_r7_"}),
    Case("zero_argument_call", "kimi_k3", "t" + THINK_END + k3_tools(k3_call("search", "")) + MSG_END,
         out("t", None, [call(0, "search", "{}")]), WITH_TOOLS),
    # tool_choice "none" (and no tools): as vLLM, tools are not parsed; the markup stays in the content
    Case("tool_choice_none_keeps_markup", "kimi_k3",
         "t" + THINK_END + RESP.format("ok") + k3_tools(PARIS) + MSG_END,
         out("t", "ok" + k3_tools(PARIS)), {"tools": TOOLS, "tool_choice": "none"}),
    Case("no_tools_keeps_markup", "kimi_k3", "t" + THINK_END + RESP.format("ok") + k3_tools(PARIS) + MSG_END,
         out("t", "ok" + k3_tools(PARIS))),
    Case("tool_choice_none_tools_open_in_think", "kimi_k3", "t" + k3_tools(PARIS) + MSG_END,
         out("t", k3_tools(PARIS)), {"tools": TOOLS, "tool_choice": "none"}),
    Case("whitespace_only_content_is_none", "kimi_k3",
         "t" + THINK_END + RESP.format("\n \n") + k3_tools(PARIS) + MSG_END,
         out("t", None, [call(0, "get_weather", '{"city": "Paris"}')]), WITH_TOOLS),
    Case("leading_whitespace_kept_with_text", "kimi_k3", "t" + THINK_END + "\n\n" + RESP.format("\nHi") + MSG_END,
         out("t", "\n\n\nHi")),
    Case("truncated_call_kept_as_content", "kimi_k3",
         "t" + THINK_END + RESP.format("") + "<|open|>tools<|sep|>" + PARIS
         + '<|open|>call tool="get_weather" index="2"<|sep|><|open|>argument key="city" type="string"<|sep|>Ro',
         out("t", 'tool="get_weather" index="2" argument key="city" type="string" Ro',
             [call(0, "get_weather", '{"city": "Paris"}')]), WITH_TOOLS),
    Case("unclosed_call_before_tools_close_kept_as_content", "kimi_k3",
         "t" + THINK_END + '<|open|>tools<|sep|><|open|>call tool="search" index="1"<|sep|>'
         + k3_arg("query", "string", "q") + "<|close|>tools<|sep|>" + MSG_END,
         out("t", 'tool="search" index="1" argument key="query" type="string" q argument'), WITH_TOOLS),
    Case("undeclared_function_kept_as_content", "kimi_k3",
         "t" + THINK_END + k3_tools(k3_call("get_time", k3_arg("city", "string", "Oslo"), 0), PARIS) + MSG_END,
         out("t", 'tool="get_time" index="0" argument key="city" type="string" Oslo argument',
             [call(0, "get_weather", '{"city": "Paris"}')]), WITH_TOOLS),
    Case("call_without_tools_open", "kimi_k3", "t" + THINK_END + RESP.format("a") + PARIS + MSG_END,
         out("t", "a", [call(0, "get_weather", '{"city": "Paris"}')]), WITH_TOOLS),
    Case("text_after_tools_is_content", "kimi_k3", "t" + THINK_END + k3_tools(PARIS) + "P.S." + MSG_END,
         out("t", "P.S.", [call(0, "get_weather", '{"city": "Paris"}')]), WITH_TOOLS),
    Case("non_marker_angle_text_kept", "kimi_k3",
         "t" + THINK_END + RESP.format("a < b, <|x|> and <|open|>other<|sep|> stay; ends <") ,
         out("t", "a < b, <|x|> and <|open|>other<|sep|> stay; ends <")),
    Case("spelled_partial_at_end_kept", "kimi_k3", "t" + THINK_END + "<|open|>response<|sep|>see <|clo",
         out("t", "see <|clo")),
    Case("stray_wrappers_dropped", "kimi_k3",
         "t" + THINK_END + "<|open|>response<|sep|><|open|>response<|sep|>A" + THINK_END + "B" + MSG_END,
         out("t", "AB")),
    Case("empty_reasoning_is_none", "kimi_k3", THINK_END + RESP.format("x") + MSG_END, out(None, "x")),
    Case("malformed_call_header_kept_as_content", "kimi_k3",
         "t" + THINK_END + k3_tools('<|open|>callx tool="a"<|sep|><|close|>call<|sep|>', PARIS) + MSG_END,
         out("t", 'x tool="a"', [call(0, "get_weather", '{"city": "Paris"}')]), WITH_TOOLS),
    # malformed calls (shapes the sampled embedded model wrote): never a call, the text kept as content
    *(broken_weather_call(name, body, kept) for name, body, kept in [
        ("marker_inside_argument_value", k3_arg("city", "string", "vario<|close|>alue"),
         'argument key="city" type="string" vario alue argument'),
        ("unclosed_argument_block", '<|open|>argument key="city" type="string"<|sep|>Nepenenamgument<|sep|>',
         'argument key="city" type="string" Nepenenamgument'),
        ("text_between_blocks", "so " + k3_arg("city", "string", "Oslo"),
         'so argument key="city" type="string" Oslo argument'),
        ("argument_without_key", '<|open|>argument type="string"<|sep|>Oslo<|close|>argument<|sep|>',
         'argument type="string" Oslo argument'),
        ("marker_inside_attribute", k3_arg("ci<|sep|>ty", "string", "Oslo"),
         'argument key="ci ty" type="string" Oslo argument'),
        ("json_block_beside_arguments",
         k3_arg("city", "string", "Oslo") + '<|open|>json<|sep|>{"city": "Rome"}<|close|>json<|sep|>',
         'argument key="city" type="string" Oslo argument json {"city": "Rome"} json'),
        ("json_block_not_an_object", '<|open|>json<|sep|>["Oslo"]<|close|>json<|sep|>', 'json ["Oslo"] json'),
    ]),
    Case("broken_call_after_streamed_call_keeps_index", "kimi_k3",
         "t" + THINK_END + k3_tools(k3_call("search", k3_arg("query", "string", "q") + "junk"),
                                    k3_call("get_weather", k3_arg("city", "string", "Oslo"), 2)) + MSG_END,
         out("t", 'tool="search" index="1" argument key="query" type="string" q argument junk',
             [call(1, "get_weather", '{"city": "Oslo"}')]), WITH_TOOLS),
    Case("text_in_tools_section_kept_as_content", "kimi_k3",
         "t" + THINK_END + "<|open|>tools<|sep|>\n" + PARIS + "\nsee <|open|>argument<|sep|>x\n" + PARIS
         + "<|close|>tools<|sep|>" + MSG_END,
         out("t", "see argument x", [call(0, "get_weather", '{"city": "Paris"}'),
                                     call(1, "get_weather", '{"city": "Paris"}')]), WITH_TOOLS),
    Case("named_tool_choice_parses", "kimi_k3", "t" + THINK_END + k3_tools(PARIS) + MSG_END,
         out("t", None, [call(0, "get_weather", '{"city": "Paris"}')]),
         {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
]


# ---- Kimi K2 / Kimi Linear (single-token markers) ---------------------------------------------------------------

SEC_B, SEC_E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
IM_END = "<|im_end|>"


def k2_call(header: str, args: str) -> str:
    return f"<|tool_call_begin|>{header}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


BEIJING = k2_call("functions.get_weather:0", '{"city": "Beijing"}')

K2_CASES = [
    Case("k2_think_markers_inside_arguments_are_text", "kimi_k2",
         "t</think>" + SEC_B + k2_call("functions.search:0", '{"query": "what do <think> and </think> mean"}')
         + SEC_E + IM_END,
         out("t", None, [call(0, "search", '{"query": "what do <think> and </think> mean"}', "functions.search:0")]),
         WITH_TOOLS),
    Case("k2_nan_arguments_are_not_json", "kimi_k2",
         "t</think>" + SEC_B + k2_call("functions.search:0", '{"query": "a", "limit": NaN}') + SEC_E + IM_END,
         out("t", 'functions.search:0 {"query": "a", "limit": NaN}'), WITH_TOOLS),
    Case("k2_reasoning_and_content", "kimi_k2", "Let me think</think>The answer is 4." + IM_END,
         out("Let me think", "The answer is 4.")),
    Case("k2_tool_call_id_kept", "kimi_k2", "need weather</think>" + SEC_B + BEIJING + SEC_E + IM_END,
         out("need weather", None, [call(0, "get_weather", '{"city": "Beijing"}', "functions.get_weather:0")]),
         WITH_TOOLS),
    Case("k2_section_in_think_ends_reasoning", "kimi_k2", "thinking" + SEC_B + BEIJING + SEC_E + IM_END,
         out("thinking", None, [call(0, "get_weather", '{"city": "Beijing"}', "functions.get_weather:0")]),
         WITH_TOOLS),
    Case("k2_bare_call_in_think", "kimi_k2", "thinking" + BEIJING + IM_END,
         out("thinking", None, [call(0, "get_weather", '{"city": "Beijing"}', "functions.get_weather:0")]),
         WITH_TOOLS),
    Case("k2_cut_off_in_think", "kimi_k2", "still thinking", out("still thinking")),
    Case("k2_thinking_off", "kimi_k2", "Hi there" + IM_END, out(None, "Hi there"), {"thinking": False}),
    Case("k2_thinking_off_strips_think", "kimi_k2", "<think></think>Hi", out(None, "Hi"), {"thinking": False}),
    Case("k2_model_opens_think", "kimi_k2", "<think>a</think>b", out("a", "b"), {"prompt_in_think": False}),
    Case("k2_no_think_markers_not_in_think", "kimi_k2", "just content", out(None, "just content"),
         {"prompt_in_think": False}),
    Case("k2_empty_arguments", "kimi_k2", "r</think>" + SEC_B + k2_call("functions.search:0", " ") + SEC_E,
         out("r", None, [call(0, "search", "{}", "functions.search:0")]), WITH_TOOLS),
    Case("k2_non_canonical_header", "kimi_k2", "r</think>" + SEC_B + k2_call("get_weather", "{}") + SEC_E,
         out("r", None, [call(0, "get_weather", "{}")]), WITH_TOOLS),
    Case("k2_empty_header_kept_as_content", "kimi_k2",
         "r</think>" + SEC_B + k2_call("", "{}") + k2_call("functions.search:1", '{"query": "x"}') + SEC_E,
         out("r", "{}", [call(0, "search", '{"query": "x"}', "functions.search:1")]), WITH_TOOLS),
    Case("k2_undeclared_function_kept_as_content", "kimi_k2",
         "r</think>" + SEC_B + k2_call("functions.get_time:0", '{"city": "Oslo"}') + SEC_E + IM_END,
         out("r", 'functions.get_time:0 {"city": "Oslo"}'), WITH_TOOLS),
    Case("k2_multiple_calls", "kimi_k2",
         "r</think>Sure." + SEC_B + BEIJING + k2_call("functions.get_weather:1", '{"city": "Tokyo"}') + SEC_E + IM_END,
         out("r", "Sure.", [call(0, "get_weather", '{"city": "Beijing"}', "functions.get_weather:0"),
                            call(1, "get_weather", '{"city": "Tokyo"}', "functions.get_weather:1")]), WITH_TOOLS),
    Case("k2_tool_choice_none_keeps_markup", "kimi_k2", "r</think>" + SEC_B + BEIJING + SEC_E + IM_END,
         out("r", SEC_B + BEIJING + SEC_E), {"tools": TOOLS, "tool_choice": "none"}),
    Case("k2_tool_choice_none_section_in_think", "kimi_k2", "r" + SEC_B + BEIJING + SEC_E,
         out("r", SEC_B + BEIJING + SEC_E), {"tools": TOOLS, "tool_choice": "none"}),
    Case("k2_im_end_never_leaks", "kimi_k2", "r</think>Bye." + IM_END + "<|im_user|>user<|im_middle|>next",
         out("r", "Bye.")),
    Case("k2_tokenizer_eos_ends_turn", "kimi_k2", "r</think>fine[EOS]more", out("r", "fine")),
    Case("k2_truncated_call_kept_as_content", "kimi_k2",
         "r</think>" + SEC_B + BEIJING + "<|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>{\"qu",
         out("r", 'functions.search:1 {"qu', [call(0, "get_weather", '{"city": "Beijing"}', "functions.get_weather:0")]),
         WITH_TOOLS),
    Case("k2_whitespace_content_before_tools", "kimi_k2", "r</think>\n\n" + SEC_B + BEIJING + SEC_E,
         out("r", None, [call(0, "get_weather", '{"city": "Beijing"}', "functions.get_weather:0")]), WITH_TOOLS),
    Case("k2_empty_im_end_after_think", "kimi_k2", "r</think>" + IM_END, out("r")),
    Case("k2_spelled_partial_kept", "kimi_k2", "r</think>a <|tool_call", out("r", "a <|tool_call"), WITH_TOOLS),
    Case("k2_partial_think_close_kept", "kimi_k2", "r</thi", out("r</thi")),
    Case("k2_arguments_not_json_kept_as_content", "kimi_k2",
         "r</think>" + SEC_B + k2_call("functions.get_weather:0", '{"city": Beijing') + SEC_E + IM_END,
         out("r", 'functions.get_weather:0 {"city": Beijing'), WITH_TOOLS),
    Case("k2_no_argument_marker_kept_as_content", "kimi_k2",
         "r</think>" + SEC_B + "<|tool_call_begin|>functions.get_weather:0<|tool_call_end|>" + SEC_E + IM_END,
         out("r", "functions.get_weather:0"), WITH_TOOLS),
    # nothing lost: text inside the section outside a call is content (whitespace between calls is dropped)
    Case("k2_text_between_calls_kept", "kimi_k2", "r</think>" + SEC_B + " \n" + BEIJING + "junk" + SEC_E + "after",
         out("r", "junkafter", [call(0, "get_weather", '{"city": "Beijing"}', "functions.get_weather:0")]), WITH_TOOLS),
]

ALL_CASES = K3_CASES + K2_CASES
