"""Collect the docstrings of the Python standard library that ships with this interpreter (run as a script).

:func:`rocm_k3.training.prose.stdlib_docstrings` runs this file in a child interpreter (``python -I -S``: no site
packages, no environment variables), so importing a few hundred modules cannot touch the parent process. It
imports every public module in ``sys.stdlib_module_names`` and the public submodules of its packages (skipping
tests, GUI/demo modules, codecs and modules with import side effects), and prints a JSON list of
``[source, docstring]`` pairs in a fixed order: each module's ``__doc__``, then ``inspect.getdoc`` of the classes
and functions it defines, and of the methods those classes define; then the topic texts of ``pydoc_data``
(the language documentation that pydoc shows). Only the standard library is read; nothing is written.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import pkgutil
import sys
import warnings

# modules that do something on import (open a browser, print, start a GUI) or whose text is not prose
SKIP = frozenset({"antigravity", "this", "__hello__", "__phello__", "idlelib", "turtledemo", "turtle", "tkinter",
                  "ensurepip", "test", "lib2to3", "pydoc_data", "encodings", "venv", "pip"})


def _skipped(name: str) -> bool:
    parts = name.split(".")
    return (parts[0] in SKIP or any(p.startswith("_") for p in parts)
            or any(p in ("test", "tests", "idle_test", "__main__") for p in parts))


def _import(name: str):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a module that cannot load here (platform, optional C library)
            return None


def module_names() -> list[str]:
    """Public stdlib modules and the public submodules of stdlib packages, sorted."""
    names = set()
    for top in sorted(sys.stdlib_module_names):
        if _skipped(top):
            continue
        module = _import(top)
        if module is None:
            continue
        names.add(top)
        for info in pkgutil.walk_packages(getattr(module, "__path__", []) or [], prefix=top + ".",
                                          onerror=lambda _name: None):
            if not _skipped(info.name):
                names.add(info.name)
    return sorted(names)


def _doc(obj: object) -> str | None:
    try:
        return inspect.getdoc(obj)
    except Exception:  # noqa: BLE001
        return None


def docstrings() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for name in module_names():
        module = _import(name)
        if module is None:
            continue
        if isinstance(module.__doc__, str):
            out.append((name, inspect.cleandoc(module.__doc__)))
        for attr, value in sorted(vars(module).items()):
            if not (inspect.isclass(value) or inspect.isroutine(value)) or getattr(value, "__module__", None) != name:
                continue
            doc = _doc(value)
            if doc:
                out.append((f"{name}.{attr}", doc))
            if inspect.isclass(value):
                for member, item in sorted(vars(value).items()):
                    if inspect.isroutine(item) or isinstance(item, (property, classmethod, staticmethod)):
                        member_doc = _doc(item)
                        if member_doc and member_doc != doc:
                            out.append((f"{name}.{attr}.{member}", member_doc))
    topics = _import("pydoc_data.topics")
    if topics is not None:
        out.extend((f"pydoc_data.topics.{key}", text) for key, text in sorted(topics.topics.items()))
    return out


if __name__ == "__main__":
    json.dump(docstrings(), sys.stdout)
