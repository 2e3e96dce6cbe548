"""The ``reference`` backend: the pure-PyTorch ground truth of every op, on any device.

Each op family module exposes ``REFERENCE_IMPLS: dict[op_name, fn]``; this backend registers them all.
"""

from __future__ import annotations

import importlib

from rocm_k3.ops import registry
from rocm_k3.ops.devices import DeviceInfo

FAMILY_MODULES = (
    "rocm_k3.ops.quant",
    "rocm_k3.ops.norm",
    "rocm_k3.ops.moe",
    "rocm_k3.ops.kda",
    "rocm_k3.ops.attn_res",
    "rocm_k3.ops.mla",
    "rocm_k3.ops.vision_attention",
    "rocm_k3.ops.comm",
)


def register() -> None:
    for name in FAMILY_MODULES:
        module = importlib.import_module(name)
        for op, fn in module.REFERENCE_IMPLS.items():
            registry.register(op, "reference", fn)


def available(dev: DeviceInfo) -> tuple[bool, str]:
    return True, "pure PyTorch, runs on any device"
