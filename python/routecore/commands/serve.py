"""``routecore serve``: the gRPC server (Envoy ext_proc, RouteCore API, health, metrics)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from routecore._extras import require
from routecore.commands._args import port

NAME = "serve"
HELP = (
    "Run the routecore gRPC server: the Envoy external processor, the RouteCore API "
    "and grpc.health.v1, with Prometheus metrics on their own port. SIGHUP reloads "
    "the configuration; SIGTERM stops gracefully. Needs the 'server' extra."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML configuration (see examples/)")
    p.add_argument("--port", type=port, help="gRPC port (default: server.port of the file)")
    p.add_argument("--metrics-port", type=port, help="metrics port (default: server.metrics_port)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    require("server", "grpc", "yaml", "prometheus_client", "envoy")
    from routecore.server import logs
    from routecore.server.app import Server

    logs.setup(getattr(logging, args.log_level.upper()))

    async def main() -> None:
        server = Server(args.config, port=args.port, metrics_port=args.metrics_port)
        await server.serve_forever()

    asyncio.run(main())
    return 0
