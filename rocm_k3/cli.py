"""The ``rocm-k3`` command line. Each subcommand lives in ``rocm_k3/entrypoints/<name>.py`` with
``add_arguments(parser)`` and ``run(args) -> int``; they are imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "ops": ("rocm_k3.entrypoints.ops_cmd", "show which backend each op resolves to on this machine, and why"),
    "generate": ("rocm_k3.entrypoints.generate_cmd", "generate text (default model: the embedded tiny K3)"),
    "make-tiny": ("rocm_k3.entrypoints.make_tiny_cmd", "write the small seeded K3-architecture checkpoint to DIR"),
    "train-tiny": ("rocm_k3.entrypoints.train_tiny_cmd",
                   "train the embedded tiny K3 on the CPU and write its checkpoint to DIR (developer command)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rocm-k3", description="AMD-first inference stack for Kimi K3")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
