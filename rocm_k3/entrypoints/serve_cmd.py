"""``rocm-k3 serve``: an OpenAI-compatible server (``/v1/completions``, ``/v1/chat/completions``, ...) for a
checkpoint (default: the embedded tiny K3 model). Every engine flag of ``EngineArgs`` is accepted, the parallel
ones too: on a multi-node run node 0 serves and ``--node-rank N`` (N > 0) runs that node's ranks headless."""

from __future__ import annotations

import argparse
import logging
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rocm_k3.args import EngineArgs, ServerArgs

    ServerArgs.add_cli_args(parser)
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    from rocm_k3.args import EngineArgs, ServerArgs

    try:
        engine_args, server_args = EngineArgs.from_cli(args), ServerArgs.from_cli(args)
    except (ValueError, TypeError) as exc:
        print(f"rocm-k3 serve: error: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("rocm_k3").setLevel(server_args.resolved_log_level.upper())  # --log-level, else the env's
    if engine_args.node_rank > 0:
        from rocm_k3.engine.assembly import run_headless_node

        return run_headless_node(engine_args)
    from rocm_k3.entrypoints.openai.api_server import serve

    try:
        return serve(engine_args, server_args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"rocm-k3 serve: error: {exc}", file=sys.stderr)
        return 2
