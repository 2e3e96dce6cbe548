"""``make demo`` runs ``rocm-k3 demo``, which prints the embedded model's three parts: a chat turn in K3's XTML
format, that turn's reasoning and answer, and a tool call parsed into JSON (a subprocess, as a user runs it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_make_demo_runs_rocm_k3_demo() -> None:
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), flags=re.M)
    assert recipe and recipe.group(1).strip().endswith("rocm-k3 demo"), recipe


def test_demo_prints_xtml_turn_reasoning_answer_and_parsed_tool_call(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "rocm_k3.cli", "demo", "--dtype", "float32"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    parts = re.split(r"^={100}\n(\d)\. .*\n={100}\n", done.stdout, flags=re.M)
    assert parts[1::2] == ["1", "2", "3"], done.stdout
    turn, parsed, tool = parts[2::2]
    # 1: the rendered prompt and the completion in XTML: user message, think channel, response, end of message
    assert '<|open|>message role="user"<|sep|>What is 12 + 7?' in turn, turn
    assert "<|close|>think<|sep|>" in turn and "<|open|>response<|sep|>" in turn and "<|end_of_msg|>" in turn
    # 2: the parsed reasoning and answer, markers removed
    reasoning = re.search(r"^reasoning: '(.+)'$", parsed, flags=re.M)
    answer = re.search(r"^answer: +'(.+)' +\[finish_reason=stop\]$", parsed, flags=re.M)
    assert reasoning and answer and "<|" not in reasoning.group(1) + answer.group(1), parsed
    assert reasoning.group(1) in turn and answer.group(1) in turn  # parsed out of the turn shown above
    # 3: the call as the model wrote it, and parsed into OpenAI tool_calls JSON
    assert '<|open|>call tool="get_weather"' in tool, tool
    calls = json.loads(tool.split("tool_calls:", 1)[1])
    assert len(calls) >= 1 and calls[0]["type"] == "function" and calls[0]["function"]["name"] == "get_weather"
    assert isinstance(calls[0]["function"]["arguments"], dict)
