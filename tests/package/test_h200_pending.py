"""scripts/h200_pending.sh on the CPU: its dry run names every part's command and timeout, the time kept for later
parts shrinks or skips a part, an unknown part is refused, and the slice part reuses a written checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "h200_pending.sh"
PARTS = ["slice", "spec_b1", "spec_b8", "spec_b32", "e2e", "kda", "cuda_tier"]


def _run(tmp_path: Path, *parts: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "OUT": str(tmp_path / "out"), "CK": str(tmp_path / "ck"), "PY": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), *parts], cwd=tmp_path, env=full, capture_output=True, text=True,
                          timeout=120)


def test_dry_run_names_every_part_with_its_command(tmp_path):
    done = _run(tmp_path, DRY="1")
    assert done.returncode == 0, done.stderr
    timeouts = dict(re.findall(r"^== (\w+) \(timeout (\d+) s", done.stdout, re.M))
    assert list(timeouts) == PARTS
    caps = {p: int(t) for p, t in timeouts.items()}
    assert 500 < caps.pop("cuda_tier") <= 570  # what is left of BUDGET (570) after the setup's imports
    assert caps == {"slice": 120, "spec_b1": 130, "spec_b8": 100, "spec_b32": 130, "e2e": 200, "kda": 150}
    out = tmp_path / "out"
    for p in PARTS:
        assert (out / f"{p}.txt").read_text().startswith(f"== {p} (timeout")
    assert "--batches 32 --max-tokens 32" in (out / "spec_b32.txt").read_text()
    assert "bench_kda.py --prefill-only" in (out / "kda.txt").read_text()
    assert "--continue-on-collection-errors" in (out / "cuda_tier.txt").read_text()


def test_time_kept_for_later_parts_shrinks_or_skips_a_part(tmp_path):
    done = _run(tmp_path, "slice", "spec_b1", "e2e", "kda", DRY="1", BUDGET="400")
    assert done.returncode == 0, done.stderr
    caps = {p: int(t) for p, t in re.findall(r"^== (\w+) \(timeout (\d+) s", done.stdout, re.M)}
    assert 50 <= caps["slice"] <= 100  # 400 s less the setup's seconds, 300 kept for the later parts
    assert 120 <= caps["spec_b1"] <= 130 and caps["e2e"] == 200 and caps["kda"] == 150
    alone = _run(tmp_path, "spec_b32", DRY="1", CAP_spec_b32="500", KEEP_spec_b32="0")
    assert 450 <= int(re.search(r"^== spec_b32 \(timeout (\d+) s", alone.stdout, re.M)[1]) <= 500
    skipped = _run(tmp_path, "slice", DRY="1", BUDGET="310")
    assert re.search(r"^== slice skipped: \d+ s left, 300 s kept for the later parts", skipped.stdout, re.M)


def test_unknown_part_is_refused(tmp_path):
    done = _run(tmp_path, "spec_b2", DRY="1")
    assert done.returncode == 2 and "unknown part spec_b2" in done.stderr


def test_slice_part_reuses_a_written_checkpoint(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text("{}")
    done = _run(tmp_path, "slice", PYTHONPATH=str(ROOT))
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "out" / "slice.txt").read_text()
    assert f"reusing {tmp_path / 'ck'}" in text and "== slice: rc 0" in text
