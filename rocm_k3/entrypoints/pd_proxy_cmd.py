"""``rocm-k3 pd-proxy --prefill URL [URL...] --decode URL [URL...]``: serve the prefill/decode proxy."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances' base URLs")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances' base URLs")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from rocm_k3.entrypoints.pd_proxy import ProxyConfig, build_proxy_app

    config = ProxyConfig(tuple(args.prefill), tuple(args.decode), args.timeout)
    uvicorn.run(build_proxy_app(config), host=args.host, port=args.port, log_level="warning")
    return 0
