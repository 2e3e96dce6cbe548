"""README's serving snippets run as written against the embedded model: its ``rocm-k3 serve`` line for the embedded
tiny K3 is started as a subprocess (on a free port instead of 8000: the only rewrite, applied to the snippets'
``localhost:8000`` too), then README's ``curl`` block and its ``openai`` Python block run unchanged (same served
name, API key, tool example) in subprocesses and must succeed."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from rocm_k3.args import ServerArgs
from tests.server_fixtures import ROOT, serve_subprocess

README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", README, flags=re.S | re.M)  # [(language, code)]


def _block(language: str, marker: str) -> str:
    found = [code for lang, code in BLOCKS if lang == language and marker in code]
    assert len(found) == 1, f"README: expected one {language} block with {marker!r}, found {len(found)}"
    return found[0]


def _embedded_serve_flags() -> list[str]:
    """The flags of README's ``rocm-k3 serve`` line that runs the embedded model (no ``--model``)."""
    lines = [line.split("#")[0].strip() for line in _block("bash", "rocm-k3 serve").splitlines()]
    embedded = [line for line in lines if line.startswith("rocm-k3 serve") and "--model" not in line
                and not line.endswith("\\")]
    assert len(embedded) == 1, lines
    words = shlex.split(embedded[0])
    assert "--port" not in words and "--host" not in words  # the defaults the snippets talk to
    return words[2:]


def _localized(code: str, port: int) -> str:
    assert "localhost:8000" in code, code
    return code.replace("localhost:8000", f"127.0.0.1:{port}")


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    defaults = ServerArgs()
    assert (defaults.host, defaults.port) == ("127.0.0.1", 8000)  # README: "on 127.0.0.1:8000"
    with serve_subprocess(tmp_path_factory.mktemp("readme"), *_embedded_serve_flags()) as (port, _proc):
        yield port


def test_readme_curl_snippet(port) -> None:
    code = _localized(_block("bash", "curl "), port)
    done = subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant", body
    assert body["model"] in code  # README's served name


def test_readme_openai_snippet(port, tmp_path) -> None:
    code = _localized(_block("python", "from openai import OpenAI"), port)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=env)
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    # the tool example: a parsed call to get_weather (JSON arguments with a city), then the reasoning text; the
    # streamed answer follows (sampled: its text is not checked, the loop over the chunks ran without an error)
    assert first.startswith("[ChatCompletionMessageFunctionToolCall(") and "name='get_weather'" in first, done.stdout
    assert re.search(r"arguments=(['\"])\{\\?\"city\\?\": ", first), done.stdout  # repr quotes vary
