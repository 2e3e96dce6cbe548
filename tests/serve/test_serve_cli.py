"""``rocm-k3 serve`` as a user starts it: a subprocess on a free port, answering /health and a completion through
the openai client, stopped with Ctrl-C (exit status 0); every engine flag is on the command line."""

from __future__ import annotations

import openai

from rocm_k3.cli import build_parser
from tests.server_fixtures import serve_subprocess


def test_serve_flags() -> None:
    parser = build_parser()
    ns = parser.parse_args(["serve", "--port", "0", "--api-key", "k", "--served-model-name", "a", "b",
                            "--max-model-len", "512", "--tool-call-parser", "kimi_k3", "--enable-auto-tool-choice",
                            "--no-enable-prefix-caching", "--max-num-seqs", "4"])
    assert ns.served_model_name == ["a", "b"] and ns.max_model_len == 512 and ns.enable_auto_tool_choice
    assert ns.enable_prefix_caching is False and ns.tool_call_parser == "kimi_k3" and ns.max_num_seqs == 4
    help_text = parser._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--max-model-len", "--gpu-memory-utilization",
                 "--reasoning-parser", "--enable-auto-tool-choice", "--block-size", "--dtype", "--model"):
        assert flag in help_text, flag


def test_serve_subprocess_answers_and_stops_on_ctrl_c(tmp_path) -> None:
    with serve_subprocess(tmp_path, "--dtype", "float32", "--max-model-len", "512",
                          "--served-model-name", "tiny") as (port, _proc):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
        assert done.usage.completion_tokens == 3 or done.choices[0].finish_reason == "stop"


def test_vllm_spellings_of_the_chat_flags(tmp_path) -> None:
    """--chat-template FILE, --enable-auto-tool-choice, --tool-call-parser and --reasoning-parser as vLLM users type
    them reach ServerArgs / EngineArgs."""
    from rocm_k3.args import EngineArgs, ServerArgs

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    ns = build_parser().parse_args(["serve", "--chat-template", str(template), "--enable-auto-tool-choice",
                                    "--tool-call-parser", "kimi_k2", "--reasoning-parser", "kimi_k2"])
    server, engine = ServerArgs.from_cli(ns), EngineArgs.from_cli(ns)
    assert server.chat_template == str(template) and server.enable_auto_tool_choice
    assert engine.tool_call_parser == engine.reasoning_parser == "kimi_k2"
