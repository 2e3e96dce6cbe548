"""``rocm-k3 serve`` as a user starts it: a subprocess on a free port, answering /health and a completion through
the openai client, stopped with Ctrl-C (exit status 0); every engine flag is on the command line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai

from rocm_k3.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


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
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rocm_k3.cli", "serve", "--port", "0", "--dtype", "float32",
                                 "--max-model-len", "512", "--served-model-name", "tiny"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        port = None
        deadline = time.monotonic() + 120
        while port is None:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", log.read_text())
            port = int(match.group(1)) if match else None
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
        assert done.usage.completion_tokens == 3 or done.choices[0].finish_reason == "stop"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, log.read_text()
