"""Install rocm-k3 with pyproject.toml's extras into an image, every version pinned by docker/constraints.txt.

    python3 docker/install_extras.py serve,rocm [--no-deps-for xgrammar]

torch and Triton stay the base image's builds: their installed versions are appended to the constraints. Packages
named by --no-deps-for are installed without their dependencies (xgrammar asks for the CUDA ``triton`` package, which
would replace the ROCm build that the base image ships as ``pytorch-triton-rocm``); their other dependencies come from
the extras.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "docker" / "constraints.txt"
BASE_PACKAGES = ("torch", "triton", "pytorch-triton-rocm")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("extras", help="comma-separated extras of pyproject.toml, e.g. serve,rocm")
    parser.add_argument("--no-deps-for", default="", help="comma-separated packages installed without dependencies")
    args = parser.parse_args()
    extras = [e for e in args.extras.split(",") if e]
    no_deps = {_name(n) for n in args.no_deps_for.split(",") if n}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    unknown = [e for e in extras if e not in optional]
    if unknown:
        sys.exit(f"install_extras: no extra {unknown} in pyproject.toml (has {sorted(optional)})")
    wanted = [r for e in extras for r in optional[e]]
    pins = [f"{p}=={metadata.version(p)}" for p in BASE_PACKAGES if _installed(p)]
    constraints = Path("/tmp/rocm_k3_constraints.txt")
    constraints.write_text(CONSTRAINTS.read_text() + "\n".join(pins) + "\n")
    pip = [sys.executable, "-m", "pip", "install", "--constraint", str(constraints)]
    rest = [r for r in wanted if _name(r) not in no_deps]
    subprocess.run([*pip, str(ROOT), *rest], check=True)
    held = [r for r in wanted if _name(r) in no_deps]
    if held:
        subprocess.run([*pip, "--no-deps", *held], check=True)


def _installed(package: str) -> bool:
    try:
        metadata.version(package)
    except metadata.PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    main()
