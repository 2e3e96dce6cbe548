"""``rocm-k3 ops``: for this machine, which backend each op resolves to and why the others were passed over."""

from __future__ import annotations

import argparse

from rocm_k3.ops import registry
from rocm_k3.ops.devices import device_info
from rocm_k3.settings import get_settings, override


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="torch device to resolve for (default: first GPU, else cpu)")
    parser.add_argument("--backend", default=None, help="pretend ROCM_K3_BACKEND is set to this")


def run(args: argparse.Namespace) -> int:
    dev = device_info(args.device)
    backend = args.backend or get_settings().backend
    with override(backend=backend):
        registry.backend_available("reference", dev)  # loads the op list
        print(f"device: {dev.describe()} [{dev.kind}]   backend setting: {backend}")
        width = max(len(op) for op in registry.declared_ops())
        failures = 0
        for op in registry.declared_ops():
            chosen, lines = registry.explain(op, dev)
            failures += chosen is None
            print(f"{op:<{width}}  -> {chosen or 'NONE'}")
            for line in lines:
                print(f"{'':<{width}}       {line}")
    return 1 if failures else 0
