"""The package's layers point down: no module imports a package of a higher layer (../shared/DESIGN.md).

Every ``import`` / ``from ... import`` in ``rocm_k3/`` is read with :mod:`ast` (function-level imports too), mapped to
its top-level package and checked against ``LAYERS``, lowest first. A package may import its own layer and any lower
one; an upward edge fails the test and names the file, the line and both layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rocm_k3"

# Lowest first. Entries of one tuple share a layer (they may import each other).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("settings", "checkpoint_errors", "checks"),
    ("checkpoint_io",),
    ("quant",),
    ("tokenizers",),
    ("formats",),          # chat renderers + output parsers: text only
    ("structured",),       # grammars over the formats' markup
    ("sampling_params",),
    ("cache",),            # integers only
    ("distributed",),
    ("kv_transfer",),      # PD disaggregation: connector interface + transports (worker and engine use it)
    ("ops",),
    ("triton_kernels", "flydsl_kernels"),
    ("model",),
    ("worker", "spec_decode"),  # spec_decode: worker-side acceptance over the step contract, integer planning
    ("executor",),
    ("args",),
    ("engine",),
    ("training",),
    ("entrypoints", "integrations"),
    ("cli",),
)
RANK = {name: i for i, group in enumerate(LAYERS) for name in group}


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "rocm_k3" or len(parts) < 2:
        return None
    return parts[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "rocm_k3":  # from rocm_k3 import settings
                found += [(node.lineno, f"rocm_k3.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def _upward_edges() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) == 1 and rel.name == "__init__.py":
            continue  # the package root re-exports the public API (LLM, SamplingParams)
        source = rel.parts[0].removesuffix(".py")
        for lineno, module in _imports(path):
            target = _package_of(module)
            if target is None or target == source or target not in RANK:
                continue
            if RANK[target] > RANK[source]:
                bad.append(f"rocm_k3/{rel}:{lineno} ({source}) imports {module} ({target}, a higher layer)")
    return bad


def test_every_package_has_a_layer() -> None:
    names = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists() or p.is_dir() and any(p.glob("*.py")))
             or (p.suffix == ".py" and p.name != "__init__.py")}
    missing = sorted(names - set(RANK))
    assert not missing, f"packages with no layer in LAYERS: {missing}"


def test_no_import_points_up() -> None:
    bad = _upward_edges()
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_checker_sees_an_upward_edge(tmp_path, monkeypatch) -> None:
    fake = tmp_path / "rocm_k3"
    (fake / "cache").mkdir(parents=True)
    (fake / "cache" / "bad.py").write_text("def f():\n    from rocm_k3.worker import kv_pools\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert _upward_edges() == ["rocm_k3/cache/bad.py:2 (cache) imports rocm_k3.worker (worker, a higher layer)"]


@pytest.mark.parametrize("module", ["rocm_k3.cache.block_pool", "rocm_k3.formats.parsers.stream"])
def test_package_of(module: str) -> None:
    assert _package_of(module) in RANK
