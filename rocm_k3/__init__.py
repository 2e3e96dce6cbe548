"""rocm-k3: an AMD-first inference stack for Kimi K3.

Python API: ``rocm_k3.LLM(path).generate(prompts, rocm_k3.SamplingParams(...))``. Submodules load lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {"LLM": "rocm_k3.engine.llm", "SamplingParams": "rocm_k3.sampling_params",
            "StructuredOutputs": "rocm_k3.structured.spec"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rocm_k3' has no attribute {name!r}")
