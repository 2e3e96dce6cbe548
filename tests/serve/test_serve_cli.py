"""``rocm-k3 serve`` as a user starts it: a subprocess on a free port, answering /health and a completion through
the openai client, stopped with Ctrl-C (exit status 0); every engine flag is on the command line."""

from __future__ import annotations

import os
import subprocess
import sys

import openai
import pytest

from rocm_k3.cli import build_parser
from rocm_k3.entrypoints.errors import EXTRA_OF_MODULE
from tests.server_fixtures import ROOT, serve_subprocess


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


# A meta-path finder that makes the given top-level modules unimportable, as on `pip install rocm-k3` without the
# server extra; loaded by Python at startup as sitecustomize (first on PYTHONPATH).
_BLOCKER = '''import importlib.abc, sys
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _NotInstalled())
'''


def _serve_extra_modules() -> set[str]:
    """The top-level modules that pyproject's ``serve`` extra installs."""
    import importlib.metadata
    import re
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    wanted = {re.split(r"[=<>!~\[ ;]", req)[0].lower().replace("_", "-") for req in extra}
    modules = {module for module, dists in importlib.metadata.packages_distributions().items()
               if any(d.lower().replace("_", "-") in wanted for d in dists) and not module.startswith("_")}
    assert len(modules) >= len(wanted), (wanted, modules)  # each distribution is installed here (the test venv)
    return modules


def test_every_serve_extra_module_names_the_extra() -> None:
    assert _serve_extra_modules() <= set(EXTRA_OF_MODULE)
    assert {EXTRA_OF_MODULE[m] for m in _serve_extra_modules()} == {"serve"}


def test_without_the_server_extra_one_line_names_the_install(tmp_path) -> None:
    """``pip install rocm-k3`` (no ``[serve]``), then ``rocm-k3 serve`` (or ``pd-proxy``): one line on stderr
    naming ``pip install 'rocm-k3[serve]'``, exit status 2, no traceback; ``--help`` and ``generate`` still work."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(_BLOCKER.format(blocked=sorted(_serve_extra_modules())))
    env = {**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rocm_k3.cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    blocked = subprocess.run([sys.executable, "-c", "import fastapi"], env=env, capture_output=True, text=True)
    assert "No module named 'fastapi'" in blocked.stderr, blocked  # the blocker works
    for command in (["serve", "--port", "0"], ["pd-proxy", "--prefill", "http://127.0.0.1:1", "--decode",
                                                "http://127.0.0.1:2"]):
        proc = cli(*command)
        assert proc.returncode == 2, proc
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "pip install 'rocm-k3[serve]'" in lines[0], proc.stderr
        assert lines[0].startswith(f"rocm-k3 {command[0]}: error: ") and proc.stdout == ""
        helped = cli(command[0], "--help")
        assert helped.returncode == 0 and "usage: rocm-k3" in helped.stdout, helped
    generated = cli("generate", "--max-tokens", "2", "Hello")
    assert generated.returncode == 0 and "output: " in generated.stdout, generated
