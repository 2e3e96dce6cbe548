"""The K2-style renderer (Kimi Linear): the checkpoint's Jinja template in jinja2's immutable sandbox."""

from __future__ import annotations

import json

import pytest
from tokenizer_files import K2_TABLE, K2_TEMPLATE, write_config, write_kimi_tokenizer

from rocm_k3.formats import K2ChatRenderer, load_chat_renderer
from rocm_k3.tokenizers import load_tokenizer

CHAT = [
    {"role": "user", "content": "What's the weather like in Beijing today?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Beijing"}'}}]},
    {"role": "tool", "name": "get_weather", "tool_call_id": "functions.get_weather:0", "content": '{"weather": "Sunny"}'},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
EXPECTED = (
    '<|im_system|>tool_declare<|im_middle|>[{"function":{"name":"get_weather","parameters":{"type":"object"}},'
    '"type":"function"}]<|im_end|>'
    "<|im_user|>user<|im_middle|>What's the weather like in Beijing today?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n"
    '{"weather": "Sunny"}<|im_end|>'
    "<|im_assistant|>assistant<|im_middle|>")


@pytest.fixture(scope="module")
def kimi_linear_dir(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("kimi_linear")
    write_kimi_tokenizer(root, K2_TABLE, ["user", "assistant", "Beijing"])
    (root / "chat_template.jinja").write_text(K2_TEMPLATE)
    write_config(root, "kimi_linear", 163586)
    return root


@pytest.fixture(scope="module")
def tok(kimi_linear_dir):
    return load_tokenizer(kimi_linear_dir)


@pytest.fixture(scope="module")
def renderer(kimi_linear_dir, tok) -> K2ChatRenderer:
    found = load_chat_renderer(kimi_linear_dir, tok)
    assert isinstance(found, K2ChatRenderer) and found.family == "kimi_k2"
    return found


def test_renders_the_checkpoint_template(renderer: K2ChatRenderer, tok) -> None:
    out = renderer.render(CHAT, tools=TOOLS)
    assert out.text == EXPECTED + "<think>" and out.prompt_in_think
    assert tok.decode(out.token_ids) == out.text
    specials = [t for t in out.token_ids if t >= 163584]
    assert specials[:3] == [163594, 163601, 163586]  # <|im_system|> <|im_middle|> <|im_end|> as single ids
    assert specials[-1] == 163606  # <think>


def test_thinking_variable(renderer: K2ChatRenderer) -> None:
    off = renderer.render(CHAT, tools=TOOLS, thinking=False)
    assert off.text == EXPECTED + "<think></think>" and not off.prompt_in_think
    assert renderer.render(CHAT, tools=TOOLS, thinking=True).text == EXPECTED + "<think>"
    none = renderer.render(CHAT, add_generation_prompt=False)
    assert none.text.endswith('{"weather": "Sunny"}<|im_end|>') and not none.prompt_in_think


def test_messages_are_validated(renderer: K2ChatRenderer) -> None:
    with pytest.raises(ValueError, match=r"messages\[0\]\.role"):
        renderer.render([{"role": "robot", "content": "x"}])


@pytest.mark.parametrize("template,message", [
    ("{{ ''.__class__.__mro__ }}", "unsafe operation.*__class__"),
    ("{{ messages.__class__.__subclasses__() }}", "unsafe operation"),
    ("{{ cycler.__init__.__globals__ }}", "unsafe operation"),
    ("{% set x = messages.append(1) %}", "unsafe operation"),
    ("{{ raise_exception('a system message is required') }}", "a system message is required"),
    ("{{ messages[0]['content'] + 1 }}", "rendering the chat template failed"),
])
def test_sandbox_errors_are_clear(tok, template: str, message: str) -> None:
    renderer = K2ChatRenderer(tok, template, source="test template")
    with pytest.raises(ValueError, match=f"test template: .*{message}"):
        renderer.render([{"role": "user", "content": "x"}])


def test_bad_template_syntax(tok) -> None:
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        K2ChatRenderer(tok, "{% for %}")


def test_tojson_keeps_non_ascii(tok) -> None:
    renderer = K2ChatRenderer(tok, "{{ tools | tojson }}|{{ tools | tojson(indent=1) }}")
    text = renderer.render([{"role": "user", "content": "x"}], tools=[{"name": "météo"}],
                           add_generation_prompt=False).text
    assert text == '[{"name": "météo"}]|[\n {\n  "name": "météo"\n }\n]'


def test_template_from_tokenizer_config(tmp_path, tok) -> None:
    root = tmp_path / "ckpt"
    write_kimi_tokenizer(root, K2_TABLE, extra_config={"chat_template": "{{ messages[0]['content'] }}!"})
    renderer = load_chat_renderer(root, load_tokenizer(root))
    assert isinstance(renderer, K2ChatRenderer)
    assert renderer.render([{"role": "user", "content": "hey"}]).text == "hey!"
    config = root / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    config.write_text(json.dumps(data))
    assert load_chat_renderer(root, tok).render([{"role": "user", "content": "x"}]).text == "D"
    data["chat_template"] = [{"name": "tool_use", "template": "T"}]
    config.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="named 'default'"):
        load_chat_renderer(root, tok)
    data["chat_template"] = 7
    config.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="chat_template: expected a string"):
        load_chat_renderer(root, tok)


def test_developer_role_renders_as_system(renderer: K2ChatRenderer) -> None:
    """The checkpoint template sees OpenAI's ``developer`` message as ``system`` (templates know no developer)."""
    as_dev = renderer.render([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    as_sys = renderer.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert as_dev == as_sys and "Be brief." in as_dev.text


def test_continue_final_message(renderer: K2ChatRenderer) -> None:
    """The template's text cut after the final message's content (vLLM's way)."""
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, wor"}]
    whole = renderer.render(chat, add_generation_prompt=False)
    cont = renderer.render(chat, add_generation_prompt=False, continue_final_message=True)
    assert cont.text.endswith("Hello, wor") and whole.text.startswith(cont.text) and len(cont.text) < len(whole.text)
    with pytest.raises(ValueError, match="continue_final_message: cannot be combined"):
        renderer.render(chat, continue_final_message=True)
    with pytest.raises(ValueError, match="needs text content"):
        renderer.render(chat[:1] + [{"role": "assistant", "content": ""}], add_generation_prompt=False,
                        continue_final_message=True)
