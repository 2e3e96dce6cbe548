"""The K3 XTML renderer against prompts written by hand from SERVING_SPEC 2.1 / 2.2, rule by rule."""

from __future__ import annotations

import pytest
from tokenizer_files import write_config, write_k3_tokenizer

from rocm_k3.formats import K3ChatRenderer, thinking_options
from rocm_k3.tokenizers import embedded_byte_tokenizer, load_tokenizer

OPEN, CLOSE, SEP, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
EFFORT_NOTE = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
               "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
               "Now the system is invoked with `thinking_effort={}`.")

WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
WEATHER_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "The user wants Paris weather; call the tool.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18, "sky": "clear"}'},
]
# SERVING_SPEC 2.2, the lines joined (real output has no newline between messages).
WEATHER_DECLARE = (
    '<|open|>message role="system" type="tool-declare"<|sep|># Tools\n'
    "Here are the available tools, described in JSONSchema.\n\n"
    "```json\n"
    '[{"function":{"description":"Get weather for a city","name":"get_weather","parameters":{"properties":'
    '{"city":{"type":"string"}},"required":["city"],"type":"object"}},"type":"function"}]\n'
    "```<|close|>message<|sep|><|end_of_msg|>")
WEATHER_PROMPT = (
    WEATHER_DECLARE
    + '<|open|>message role="system" type="thinking-effort"<|sep|>' + EFFORT_NOTE.format("max")
    + "<|close|>message<|sep|><|end_of_msg|>"
    '<|open|>message role="system"<|sep|>You are a helpful assistant.<|close|>message<|sep|><|end_of_msg|>'
    "<|open|>message role=\"user\"<|sep|>What's the weather in Paris?<|close|>message<|sep|><|end_of_msg|>"
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>The user wants Paris weather; call the tool.'
    "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
    '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris'
    "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
    '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>{"temp_c": 18, "sky": "clear"}'
    "<|close|>message<|sep|><|end_of_msg|>"
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')


def msg(role: str, body: str, attrs: str = "") -> str:
    return f'{OPEN}message role="{role}"{attrs}{SEP}{body}{CLOSE}message{SEP}{EOM}'


def note(kind: str, body: str) -> str:
    return msg("system", body, f' type="{kind}"')


@pytest.fixture(scope="module")
def byte_renderer() -> K3ChatRenderer:
    return K3ChatRenderer(embedded_byte_tokenizer())


@pytest.fixture(scope="module")
def k3_tok(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("k3_chat")
    ranks = write_k3_tokenizer(root, ["ab", "cd", "abcd", "Hello"])
    write_config(root, "kimi_k3", 163586)
    return load_tokenizer(root), ranks


def render_text(renderer: K3ChatRenderer, messages, **kwargs) -> str:
    return renderer.render(messages, **kwargs).text


def test_spec_example(byte_renderer: K3ChatRenderer) -> None:
    out = byte_renderer.render(WEATHER_CHAT, tools=WEATHER_TOOLS)
    assert out.text == WEATHER_PROMPT
    assert out.prompt_in_think
    assert byte_renderer.tokenizer.decode(out.token_ids) == out.text


def test_thinking_off(byte_renderer: K3ChatRenderer) -> None:
    """No effort note, no think channel in history, the prompt ends inside the response channel."""
    out = byte_renderer.render(WEATHER_CHAT, tools=WEATHER_TOOLS, thinking=False)
    assistant = ('<|open|>message role="assistant"<|sep|><|open|>response<|sep|><|close|>response<|sep|>'
                 '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
                 '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
                 "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>")
    assert out.text == (
        WEATHER_DECLARE + msg("system", "You are a helpful assistant.") + msg("user", "What's the weather in Paris?")
        + assistant + msg("tool", '{"temp_c": 18, "sky": "clear"}', ' tool="get_weather" index="1"')
        + '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    assert not out.prompt_in_think


@pytest.mark.parametrize("effort", ["low", "high", "max"])
def test_thinking_effort(byte_renderer: K3ChatRenderer, effort: str) -> None:
    text = render_text(byte_renderer, [{"role": "user", "content": "hi"}], thinking_effort=effort)
    assert text == (note("thinking-effort", EFFORT_NOTE.format(effort)) + msg("user", "hi")
                    + f'{OPEN}message role="assistant"{SEP}{OPEN}think{SEP}')


@pytest.mark.parametrize("effort", ["medium", "none", "MAX", 3])
def test_unsupported_effort(byte_renderer: K3ChatRenderer, effort) -> None:
    with pytest.raises(ValueError, match="thinking_effort"):
        byte_renderer.render([{"role": "user", "content": "hi"}], thinking_effort=effort)


def test_history_think_always_present_in_thinking_mode(byte_renderer: K3ChatRenderer) -> None:
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d", "reasoning_content": "r"}]
    text = render_text(byte_renderer, chat, add_generation_prompt=False)
    empty = f"{OPEN}think{SEP}{CLOSE}think{SEP}{OPEN}response{SEP}b{CLOSE}response{SEP}"
    full = f"{OPEN}think{SEP}r{CLOSE}think{SEP}{OPEN}response{SEP}d{CLOSE}response{SEP}"
    assert text == (note("thinking-effort", EFFORT_NOTE.format("max")) + msg("user", "a") + msg("assistant", empty)
                    + msg("user", "c") + msg("assistant", full))
    off = render_text(byte_renderer, chat, thinking=False, add_generation_prompt=False)
    assert "think" not in off and off.endswith(msg("assistant", f"{OPEN}response{SEP}d{CLOSE}response{SEP}"))


def test_tool_declaration_deep_sorted_compact_non_ascii(byte_renderer: K3ChatRenderer) -> None:
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {
        "type": "object", "required": ["z", "a"],
        "properties": {"z": {"type": "string", "enum": ["b", "a"]}, "a": {"items": [{"y": 1, "x": 2}]}}}}}]
    text = render_text(byte_renderer, [{"role": "user", "content": "q"}], tools=tools, thinking=False)
    declared = ('[{"function":{"name":"météo","parameters":{"properties":{"a":{"items":[{"x":2,"y":1}]},'
                '"z":{"enum":["b","a"],"type":"string"}},"required":["z","a"],"type":"object"}},'
                '"type":"function"}]')
    assert text.startswith(note("tool-declare", "# Tools\nHere are the available tools, described in JSONSchema."
                                "\n\n```json\n" + declared + "\n```"))


def test_dynamic_tool_declaration(byte_renderer: K3ChatRenderer) -> None:
    tools = [{"function": {"name": "f"}, "type": "function"}]
    text = render_text(byte_renderer, [{"role": "system", "tools": tools}, {"role": "user", "content": "q"}],
                       thinking=False, add_generation_prompt=False)
    body = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
            "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
            '```json\n[{"function":{"name":"f"},"type":"function"}]\n```')
    assert text == note("tool-declare", body) + msg("user", "q")


def _calls(*pairs: tuple[str, str]) -> list[dict]:
    return [{"id": cid, "type": "function", "function": {"name": name, "arguments": "{}"}} for cid, name in pairs]


def _tool_messages(text: str) -> list[str]:
    return [part.split(SEP)[0] for part in text.split(f'{OPEN}message role="tool"')[1:]]


def test_tool_results_reordered_by_call_id(byte_renderer: K3ChatRenderer) -> None:
    chat = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": _calls(("a", "f"), ("b", "g"), ("c", "h"))},
            {"role": "tool", "tool_call_id": "c", "name": "stale", "content": "C"},
            {"role": "tool", "tool_call_id": "a", "content": "A"},
            {"role": "tool", "tool_call_id": "b", "content": "B"}]
    text = render_text(byte_renderer, chat, thinking=False)
    assert text.endswith(msg("tool", "A", ' tool="f" index="1"') + msg("tool", "B", ' tool="g" index="2"')
                         + msg("tool", "C", ' tool="h" index="3"')  # the matched call's name wins over "stale"
                         + f'{OPEN}message role="assistant"{SEP}{OPEN}response{SEP}')


def test_tool_run_with_unknown_id_stays_as_sent(byte_renderer: K3ChatRenderer) -> None:
    chat = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": _calls(("a", "f"), ("b", "g"))},
            {"role": "tool", "tool_call_id": "b", "name": "g", "content": "B"},
            {"role": "tool", "tool_call_id": "zzz", "content": "?"}]
    text = render_text(byte_renderer, chat, thinking=False, add_generation_prompt=False)
    # as sent; the unnamed second result takes the name of the call at its position (the second, "g")
    assert text.endswith(msg("tool", "B", ' tool="g" index="1"') + msg("tool", "?", ' tool="g" index="2"'))
    assert _tool_messages(text) == [' tool="g" index="1"', ' tool="g" index="2"']


def test_tool_index_restarts_after_each_assistant_turn(byte_renderer: K3ChatRenderer) -> None:
    chat = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": _calls(("a", "f"))},
            {"role": "tool", "tool_call_id": "a", "content": "1"},
            {"role": "assistant", "content": "", "tool_calls": _calls(("b", "g"))},
            {"role": "tool", "content": "2"}]  # no id, no name: the call at its position
    text = render_text(byte_renderer, chat, thinking=False)
    assert _tool_messages(text) == [' tool="f" index="1"', ' tool="g" index="1"']
    with pytest.raises(ValueError, match=r"messages\[1\]\.name: a tool message needs"):
        byte_renderer.render([{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}])


def test_argument_types_and_json_block(byte_renderer: K3ChatRenderer) -> None:
    args = {"s": "x y", "n": 1.5, "i": 2, "b": True, "z": None, "o": {"k": [1, 2]}, "a": [1, "é"]}
    chat = [{"role": "assistant", "content": "ok", "tool_calls": [
        {"id": "1", "function": {"name": "f", "arguments": args}},
        {"id": "2", "function": {"name": "g", "arguments": "not json {"}},
        {"id": "3", "function": {"name": "h", "arguments": ""}}]}]
    text = render_text(byte_renderer, chat, thinking=False, add_generation_prompt=False)

    def arg(key: str, kind: str, value: str) -> str:
        return f'{OPEN}argument key="{key}" type="{kind}"{SEP}{value}{CLOSE}argument{SEP}'
    calls = (f'{OPEN}call tool="f" index="1"{SEP}' + arg("s", "string", "x y") + arg("n", "number", "1.5")
             + arg("i", "number", "2") + arg("b", "boolean", "true") + arg("z", "null", "null")
             + arg("o", "object", '{"k": [1, 2]}') + arg("a", "array", '[1, "é"]') + f"{CLOSE}call{SEP}"
             + f'{OPEN}call tool="g" index="2"{SEP}{OPEN}json type="object"{SEP}not json {{{CLOSE}json{SEP}'
             + f"{CLOSE}call{SEP}" + f'{OPEN}call tool="h" index="3"{SEP}{CLOSE}call{SEP}')
    assert text == msg("assistant", f"{OPEN}response{SEP}ok{CLOSE}response{SEP}{OPEN}tools{SEP}{calls}"
                                    f"{CLOSE}tools{SEP}")
    as_dict = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": args}}]}]
    as_string = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": (
        '{"s": "x y", "n": 1.5, "i": 2, "b": true, "z": null, "o": {"k": [1, 2]}, "a": [1, "é"]}')}}]}]
    assert render_text(byte_renderer, as_string) == render_text(byte_renderer, as_dict)  # a JSON string: same


@pytest.mark.parametrize("choice,body", [
    ("required", "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."),
    ("none", "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message."),
])
def test_tool_choice_notes(byte_renderer: K3ChatRenderer, choice: str, body: str) -> None:
    text = render_text(byte_renderer, [{"role": "user", "content": "q"}], tools=WEATHER_TOOLS, tool_choice=choice,
                       thinking=False)
    assert text == (WEATHER_DECLARE + msg("user", "q") + note("tool-choice", body)
                    + f'{OPEN}message role="assistant"{SEP}{OPEN}response{SEP}')


def test_no_note_for_auto_or_a_named_tool(byte_renderer: K3ChatRenderer) -> None:
    base = render_text(byte_renderer, [{"role": "user", "content": "q"}], tools=WEATHER_TOOLS)
    for choice in ("auto", None, {"type": "function", "function": {"name": "get_weather"}}):
        assert render_text(byte_renderer, [{"role": "user", "content": "q"}], tools=WEATHER_TOOLS,
                           tool_choice=choice) == base
    with pytest.raises(ValueError, match="tool_choice"):
        byte_renderer.render([{"role": "user", "content": "q"}], tool_choice="sometimes")


RAW_JSON = ("Your response must be raw JSON data without markdown code blocks (```json) or any additional "
            "formatting.")


def test_response_format_notes(byte_renderer: K3ChatRenderer) -> None:
    chat = [{"role": "user", "content": "q"}]
    text = render_text(byte_renderer, chat, response_format={"type": "json_object"}, tool_choice="required",
                       thinking=False, add_generation_prompt=False)
    assert text == (msg("user", "q") + note("tool-choice", "The system is invoked with `tool_choice=required`.\n"
                                            "You MUST call tools in the next message.")
                    + note("response-format", f"The system is invoked with `response_format=json_object`.\n{RAW_JSON}"))
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    text = render_text(byte_renderer, chat, thinking=False, add_generation_prompt=False, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert text == msg("user", "q") + note("response-format", (
        f"The system is invoked with `response_format=json_schema`.\n{RAW_JSON}\n"
        "The JSON data must match the following schema:\n```json\n"
        '{"properties":{"a":{"type":"string"},"b":{"type":"integer"}},"type":"object"}\n```'))
    assert render_text(byte_renderer, chat, response_format={"type": "text"}) == render_text(byte_renderer, chat)
    with pytest.raises(ValueError, match=r"response_format.json_schema.schema"):
        byte_renderer.render(chat, response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(ValueError, match="response_format.type"):
        byte_renderer.render(chat, response_format={"type": "yaml"})


def test_names_and_escaping(byte_renderer: K3ChatRenderer) -> None:
    """Attribute values escape & first, then "; bodies are never escaped."""
    chat = [{"role": "system", "name": "ops", "content": "s"},
            {"role": "user", "name": 'a&"b &quot;', "content": 'body & "quotes" <x>'},
            {"role": "assistant", "name": "kimi", "content": "r",
             "tool_calls": [{"id": "1", "function": {"name": 'to"ol', "arguments": {'k"&': 'v&"'}}}]}]
    text = render_text(byte_renderer, chat, thinking=False, add_generation_prompt=False)
    calls = (f'{OPEN}tools{SEP}{OPEN}call tool="to&quot;ol" index="1"{SEP}'
             f'{OPEN}argument key="k&quot;&amp;" type="string"{SEP}v&"{CLOSE}argument{SEP}{CLOSE}call{SEP}'
             f"{CLOSE}tools{SEP}")
    assert text == (msg("system", "s", ' name="ops"')
                    + msg("user", 'body & "quotes" <x>', ' name="a&amp;&quot;b &amp;quot;"')
                    + msg("assistant", f"{OPEN}response{SEP}r{CLOSE}response{SEP}" + calls, ' name="kimi"'))


def test_images_are_reported_positions_typed_placeholders_stay_text(byte_renderer: K3ChatRenderer) -> None:
    """An image part adds no ids: its index is reported (the text shows the placeholder); a typed placeholder is
    ordinary text with no entry."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    chat = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, image, {"type": "text", "text": "ok?"}]},
            {"role": "user", "content": [image, image, {"type": "text", "text": "typed <|kimi_image_placeholder|>"}]}]
    out = byte_renderer.render(chat, thinking=False, add_generation_prompt=False)
    assert out.text == (msg("user", "Look:<|kimi_image_placeholder|>ok?")
                        + msg("user", "<|kimi_image_placeholder|><|kimi_image_placeholder|>typed "
                              "<|kimi_image_placeholder|>"))
    enc = byte_renderer.tokenizer.encode
    first = enc(msg("user", "Look:ok?"), allow_special=True)
    second = enc(msg("user", "typed <|kimi_image_placeholder|>"), allow_special=True)
    assert out.token_ids == first + second  # the typed placeholder's bytes are there, the image parts add nothing
    open_len = len(enc('<|open|>message role="user"<|sep|>', allow_special=True))
    assert out.image_positions == (open_len + len(b"Look:"), len(first) + open_len, len(first) + open_len)
    plain = byte_renderer.render([{"role": "user", "content": "no image"}])
    assert plain.image_positions == ()


def test_generation_prompt(byte_renderer: K3ChatRenderer) -> None:
    chat = [{"role": "user", "content": "q"}]
    on = byte_renderer.render(chat)
    assert on.text.endswith(f'{OPEN}message role="assistant"{SEP}{OPEN}think{SEP}') and on.prompt_in_think
    off = byte_renderer.render(chat, thinking=False)
    assert off.text == msg("user", "q") + f'{OPEN}message role="assistant"{SEP}{OPEN}response{SEP}'
    none = byte_renderer.render(chat, add_generation_prompt=False)
    assert none.text.endswith(msg("user", "q")) and not none.prompt_in_think
    assert not on.text.startswith("[BOS]") and not any(t == 256 for t in on.token_ids)  # no BOS


def test_user_specials_are_plain_text_control_segments_special(k3_tok) -> None:
    tok, _ = k3_tok
    renderer = K3ChatRenderer(tok)
    chat = [{"role": "user", "content": "hi <|open|>message<|sep|> <|end_of_msg|> [EOS]"}]
    out = renderer.render(chat, thinking=False)
    specials = [t for t in out.token_ids if t >= 163584]
    # the structure: user message (open, sep, close, sep, eom), then the prompt (open, sep, open, sep)
    assert specials == [163587, 163589, 163588, 163589, 163586, 163587, 163589, 163587, 163589]
    assert tok.decode(out.token_ids) == out.text
    assert all(0 <= t < tok.vocab_size for t in out.token_ids)
    assert out.token_ids[-3:] == [163587, *tok.encode("response"), 163589][-3:]


def test_segments_never_merge(k3_tok) -> None:
    """BPE never merges across segments: text parts "ab" + "cd" stay two tokens although "abcd" is one."""
    tok, ranks = k3_tok
    renderer = K3ChatRenderer(tok)
    assert tok.encode("abcd") == [ranks[b"abcd"]]
    out = renderer.render([{"role": "user", "content": [{"type": "text", "text": "ab"},
                                                        {"type": "text", "text": "cd"}]}], thinking=False)
    body = out.token_ids[out.token_ids.index(163589) + 1:out.token_ids.index(163588)]
    assert body == [ranks[b"ab"], ranks[b"cd"]]
    one = renderer.render([{"role": "user", "content": "abcd"}], thinking=False)
    assert one.token_ids[one.token_ids.index(163589) + 1] == ranks[b"abcd"]
    # an attribute: " role", '="', value, '"' are four segments, each its own tokens
    header = out.token_ids[:out.token_ids.index(163589)]
    assert header == [163587, ranks[b"message"], ranks[b" role"], ranks[b'="'], ranks[b"user"], ranks[b'"']]


@pytest.mark.parametrize("messages,field", [
    ([], "messages: expected at least one"),
    ("hi", "messages: expected a list"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\]\.role"),
    ([{"content": "a"}], r"messages\[0\]\.role"),
    ([{"role": "user"}], r"messages\[0\]\.content: required"),
    ([{"role": "tool", "content": None}], r"messages\[0\]\.content: required"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content: expected a string or a list"),
    ([{"role": "user", "content": [{"type": "audio"}]}], r"messages\[0\]\.content\[0\]\.type"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\]\.content\[0\]\.text"),
    ([{"role": "user", "content": "a", "name": 3}], r"messages\[0\]\.name"),
    ([{"role": "assistant", "tool_calls": "f()"}], r"messages\[0\]\.tool_calls: expected a list"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     r"messages\[0\]\.tool_calls\[0\]\.function\.name"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
     r"messages\[0\]\.tool_calls\[0\]\.function\.arguments"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}],
     r"messages\[0\]\.tool_calls\[0\]\.function\.arguments: expected a JSON object"),
    ([{"role": "user", "content": "a", "tool_calls": []}], r"messages\[0\]\.tool_calls: only assistant"),
    ([{"role": "assistant", "content": "a", "reasoning_content": 1}], r"messages\[0\]\.reasoning_content"),
])
def test_invalid_messages_are_named(byte_renderer: K3ChatRenderer, messages, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        byte_renderer.render(messages)


def test_invalid_request_fields(byte_renderer: K3ChatRenderer) -> None:
    chat = [{"role": "user", "content": "q"}]
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        byte_renderer.render(chat, tools=["get_weather"])
    with pytest.raises(ValueError, match="thinking: expected true or false"):
        byte_renderer.render(chat, thinking="yes")
    with pytest.raises(ValueError, match="tools: not JSON-serialisable"):
        byte_renderer.render(chat, tools=[{"function": {"name": "f", "x": float("nan")}}])


def test_thinking_options() -> None:
    assert thinking_options(None, None) == (None, None)
    assert thinking_options({"enable_thinking": False}, None) == (False, None)
    assert thinking_options({"thinking": True, "enable_thinking": False}, None) == (True, None)
    assert thinking_options(None, "none") == (False, None)
    assert thinking_options(None, "low") == (None, "low")
    assert thinking_options({"thinking": True}, "none") == (True, None)  # explicit wins
    assert thinking_options({"thinking_effort": "high"}, "low") == (None, "high")
    assert thinking_options(None, "medium") == (None, "high")  # OpenAI's efforts map to K3's nearest
    assert thinking_options(None, "minimal") == (None, "low")
    for bad in ("extreme", "MAX"):
        with pytest.raises(ValueError, match="reasoning_effort"):
            thinking_options(None, bad)
    with pytest.raises(ValueError, match="chat_template_kwargs.thinking_effort"):
        thinking_options({"thinking_effort": "medium"}, None)
    with pytest.raises(ValueError, match="chat_template_kwargs.thinking"):
        thinking_options({"thinking": "no"}, None)
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        thinking_options(["thinking"], None)


def test_renderer_needs_the_control_specials(tmp_path) -> None:
    from tokenizer_files import K2_TABLE, write_kimi_tokenizer
    write_kimi_tokenizer(tmp_path, K2_TABLE)
    with pytest.raises(ValueError, match="needs the special tokens"):
        K3ChatRenderer(load_tokenizer(tmp_path))


def test_developer_role_renders_as_system(byte_renderer: K3ChatRenderer) -> None:
    """OpenAI's ``developer`` role is K3's ``system`` message: the same ids, name kept."""
    for extra in ({}, {"name": "ops"}):
        as_dev = byte_renderer.render([{"role": "developer", "content": "Be brief.", **extra},
                                       {"role": "user", "content": "Hi"}])
        as_sys = byte_renderer.render([{"role": "system", "content": "Be brief.", **extra},
                                       {"role": "user", "content": "Hi"}])
        assert as_dev == as_sys
    assert msg("system", "Be brief.") in as_dev.text.replace(' name="ops"', "")


def test_continue_final_message(byte_renderer: K3ChatRenderer) -> None:
    """vLLM's continue_final_message: the final assistant message stays open in the channel it writes (think
    while it has no answer, else response), after the request notes; the generation prompt is excluded."""
    chat = [{"role": "user", "content": "Hi"}]
    user = msg("user", "Hi")
    started = byte_renderer.render(chat + [{"role": "assistant", "content": "Hel"}], add_generation_prompt=False,
                                   continue_final_message=True, thinking=False,
                                   response_format={"type": "json_object"})
    assert started.text.endswith(f'{OPEN}message role="assistant"{SEP}{OPEN}response{SEP}Hel')
    assert user + note("response-format", started.text.split('type="response-format"' + SEP)[1].split(CLOSE)[0]) \
        in started.text and not started.prompt_in_think
    thinking = byte_renderer.render(chat + [{"role": "assistant", "content": "", "reasoning_content": "Hmm, "}],
                                    add_generation_prompt=False, continue_final_message=True)
    assert thinking.text.endswith(f'{OPEN}message role="assistant"{SEP}{OPEN}think{SEP}Hmm, ') and thinking.prompt_in_think
    assert byte_renderer.render(chat, add_generation_prompt=False, continue_final_message=True).text.endswith(
        f'{OPEN}message role="user"{SEP}Hi')
    with pytest.raises(ValueError, match="continue_final_message: cannot be combined with add_generation_prompt"):
        byte_renderer.render(chat, continue_final_message=True)
    with pytest.raises(ValueError, match="final message .* is a tool result"):
        byte_renderer.render(chat + [{"role": "tool", "name": "f", "content": "1"}], add_generation_prompt=False,
                             continue_final_message=True)
