"""Every script in benchmarks/ imports on a machine without a GPU (no work at import time), and each one's
``--help`` parses: a benchmark that fails at import is only found on a device call otherwise (session 23 found
bench_kda's module-level settings naming a removed dict, and prefix_cache_cpu.py importing a removed engine module)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_imports_and_parses_help(name: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{name}.py --help: {done.stderr[-2000:]}"
    assert "usage:" in done.stdout, done.stdout[-500:]
