"""``routecore client --load``: drive a routecore ext_proc server from Rust and measure it."""

from __future__ import annotations

import argparse
import json

from routecore.commands._args import float_in, int_in, port, positive_float, positive_int

#: Streams at once (MAX_STREAMS of rust/serve/loadgen.rs).
streams = int_in(1, 100_000)
#: A request body up to 64 MiB (MAX_BODY_BYTES).
body_size = int_in(1, 1 << 26)
#: A response delay and a step timeout, at most an hour (MAX_WAIT_S).
delay_s = float_in(0.0, 3600.0)
timeout_s = float_in(0.0, 3600.0, lo_open=True)
#: A process id (Linux: below 2^22).
pid = int_in(1, (1 << 32) - 1)

NAME = "client"
HELP = (
    "Drive Envoy ext_proc conversations against a routecore server (request headers, "
    "body, response headers, a response body with usage) from the Rust load client and "
    "report throughput, added latency p50/p99 and, with --server-pid, the server's CPU "
    "time and context switches per conversation."
)


def _target(text: str) -> str:
    host, sep, number = text.rpartition(":")
    if not (sep and host):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    port(number)
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--load",
        action="store_true",
        required=True,
        help="run a load test (the only mode; single conversations: routecore.server.envoy_client)",
    )
    p.add_argument("--target", required=True, type=_target, help="HOST:PORT of the ext_proc server")
    p.add_argument(
        "--rate",
        type=positive_float,
        help="conversations started per second, paced (default: closed loop)",
    )
    p.add_argument(
        "--concurrency",
        type=streams,
        default=8,
        help="streams in flight at once (default 8)",
    )
    p.add_argument(
        "--requests",
        type=positive_int,
        default=200,
        help="conversations to run (default 200)",
    )
    p.add_argument(
        "--duration",
        type=positive_float,
        metavar="SECONDS",
        help="stop starting conversations after this many seconds (default: no limit)",
    )
    p.add_argument(
        "--body-bytes",
        type=body_size,
        default=1024,
        help="size of each request body, a chat request padded to it (default 1024)",
    )
    p.add_argument("--api-key", default="demo-key", help="x-api-key sent (default demo-key)")
    p.add_argument(
        "--server-pid",
        type=pid,
        help="the server's process id: report its CPU time and context switches per conversation",
    )
    p.add_argument(
        "--threads",
        type=int_in(1, 256),
        default=1,
        help="client threads (default 1)",
    )
    p.add_argument(
        "--response-delay",
        type=delay_s,
        default=0.0,
        metavar="SECONDS",
        help="time each routed conversation waits before its response, the upstream's (default 0)",
    )
    p.add_argument(
        "--timeout",
        type=timeout_s,
        default=10.0,
        metavar="SECONDS",
        help="bound on each step of a conversation; past it: DEADLINE_EXCEEDED (default 10)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run(args: argparse.Namespace) -> int:
    from routecore._core import load

    report = load(
        args.target,
        requests=args.requests,
        concurrency=args.concurrency,
        rate=args.rate,
        duration_s=args.duration,
        body_bytes=args.body_bytes,
        api_key=args.api_key,
        server_pid=args.server_pid,
        threads=args.threads,
        response_delay_s=args.response_delay,
        timeout_s=args.timeout,
    )
    if args.json:
        print(json.dumps(report))
        return 0 if report["errors"] == 0 else 1
    print(
        f"{report['requests']} conversations in {report['seconds']:.2f} s: "
        f"{report['throughput_per_s']:.0f}/s; refused {report['refused']}, "
        f"errors {report['errors']}"
    )
    print(
        "streams ended: "
        + ", ".join(f"{code} {n}" for code, n in report["statuses"].items())
        + "".join(f"; refused {status}: {n}" for status, n in report["refusals"].items())
    )
    print(
        f"added latency p50 {report['p50_ms']:.3f} ms, p99 {report['p99_ms']:.3f} ms, "
        f"mean {report['mean_ms']:.3f} ms"
    )
    for key, label, unit in (
        ("server_cpu_ms", "server CPU per conversation", "ms"),
        ("server_context_switches", "server context switches per conversation", ""),
        ("client_cpu_ms", "client CPU per conversation", "ms"),
    ):
        if report[key] is not None:
            print(f"{label}: {report[key]:.4f} {unit}".rstrip())
    return 0 if report["errors"] == 0 else 1
