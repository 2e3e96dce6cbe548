"""The ``rocm-k3`` command line. Each subcommand lives in ``rocm_k3/entrypoints/<name>.py`` with
``add_arguments(parser)`` and ``run(args) -> int``; they are imported only when used.

An error is printed as one line naming the problem and a fix (:mod:`rocm_k3.entrypoints.errors`) with exit status
2; ``--debug`` (before or after the subcommand) or ``ROCM_K3_LOG_LEVEL=debug`` show the traceback instead. The
``rocm_k3`` logger is set to ``ROCM_K3_LOG_LEVEL`` (default WARNING; INFO shows backend fallbacks).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from rocm_k3.settings import get_settings

_DEBUG_HELP = "show the full traceback of an error (also: ROCM_K3_LOG_LEVEL=debug)"

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "ops": ("rocm_k3.entrypoints.ops_cmd", "show which backend each op resolves to on this machine, and why"),
    "generate": ("rocm_k3.entrypoints.generate_cmd", "generate text (default model: the embedded tiny K3)"),
    "serve": ("rocm_k3.entrypoints.serve_cmd", "serve an OpenAI-compatible API (default model: the embedded tiny K3)"),
    "pd-proxy": ("rocm_k3.entrypoints.pd_proxy_cmd",
                 "route each request's prefill and decode to separate `serve` instances (OpenAI-compatible)"),
    "expert-placement": ("rocm_k3.entrypoints.expert_placement_cmd",
                         "write an expert placement (redundant experts, balanced ranks) from recorded expert loads"),
    "make-tiny": ("rocm_k3.entrypoints.make_tiny_cmd", "write the small seeded K3-architecture checkpoint to DIR"),
    "train-tiny": ("rocm_k3.entrypoints.train_tiny_cmd",
                   "train the embedded tiny K3 on the CPU and write its checkpoint to DIR (developer command)"),
    "train-tiny-drafter": ("rocm_k3.entrypoints.train_tiny_drafter_cmd",
                           "train the embedded tiny K3's speculative drafter on the CPU and write it to DIR "
                           "(developer command)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rocm-k3", description="AMD-first inference stack for Kimi K3")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[common])
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    from rocm_k3.entrypoints.errors import EXIT_ERROR, EXIT_INTERRUPTED, describe

    args = build_parser().parse_args(argv)
    prog = f"rocm-k3 {args.command}"
    try:
        level = get_settings().log_level
    except ValueError as exc:  # a bad ROCM_K3_* variable: nothing else can run
        if args.debug:
            raise
        print(f"{prog}: error: {describe(exc)}", file=sys.stderr)
        return EXIT_ERROR
    debug = args.debug or level == "DEBUG"
    logging.basicConfig(format="rocm-k3: %(levelname)s: %(name)s: %(message)s")
    logging.getLogger("rocm_k3").setLevel(level)
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if debug:
            raise
        print(f"{prog}: error: {describe(exc)}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
