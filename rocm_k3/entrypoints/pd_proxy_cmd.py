"""``rocm-k3 pd-proxy --prefill URL [URL...] --decode URL [URL...]``: serve the prefill/decode proxy."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances' base URLs")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances' base URLs")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")
    parser.add_argument("--health-interval", type=float, default=5.0,
                        help="seconds between GET /health checks of every instance")
    parser.add_argument("--health-timeout", type=float, default=2.0, help="seconds a health check waits")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from rocm_k3.entrypoints.pd_proxy import ProxyConfig, build_proxy_app

    config = ProxyConfig(tuple(args.prefill), tuple(args.decode), args.timeout, args.health_interval,
                         args.health_timeout)
    app = build_proxy_app(config)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        app.state.pools.stop()
    return 0
