"""A script that builds a parallel LLM without the ``if __name__ == "__main__":`` guard gets one error naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "user_script.py"
    script.write_text(body)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path, check=False)


def test_unguarded_parallel_llm_names_the_guard(tmp_path: Path) -> None:
    result = _run_script(tmp_path, "import rocm_k3\nllm = rocm_k3.LLM(tensor_parallel_size=2)\n")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError:") and 'if __name__ == "__main__":' in last and "user_script.py:2" in last
    assert "bootstrapping phase" not in result.stderr  # refused before any rank was spawned


def test_unguarded_call_through_a_function_names_the_guard(tmp_path: Path) -> None:
    body = "import rocm_k3\n\ndef main():\n    return rocm_k3.LLM(tensor_parallel_size=2)\n\nmain()\n"
    result = _run_script(tmp_path, body)
    assert result.returncode != 0 and "user_script.py:6" in result.stderr.strip().splitlines()[-1]
