"""``routecore client``: check a running routecore ext_proc server with one
conversation, or drive it from Rust and measure it (``--load``)."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from routecore._extras import require
from routecore.commands._args import (
    add_json,
    float_in,
    int_in,
    port,
    positive_float,
    positive_int,
    token_count,
)

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
    "Talk to a running routecore server as Envoy does. Without --load: one ext_proc "
    "conversation (request headers, the chat body, and with --usage a response carrying "
    "usage), each answer printed as Envoy acts on it (status, the headers set such as "
    "x-gateway-destination-endpoint, dynamic metadata, or the HTTP refusal); exit status 0 "
    "when routed, 1 when refused. With --load: many conversations from the Rust load "
    "client; reports throughput, added latency p50/p99 and, with --server-pid, the "
    "server's CPU time and context switches per conversation."
)
#: The prompt of the single conversation when --prompt and --body are not given.
DEFAULT_PROMPT = "Explain continuous batching in two sentences."


def _target(text: str) -> str:
    host, sep, number = text.rpartition(":")
    if not (sep and host):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    port(number)
    return text


def _usage(text: str) -> tuple[int, int]:
    prompt, sep, completion = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return token_count(prompt), token_count(completion)
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise argparse.ArgumentTypeError(
            f"expected PROMPT_TOKENS:COMPLETION_TOKENS, got {text!r}"
        ) from e


def _header(text: str) -> tuple[str, str]:
    key, sep, value = text.partition(":")
    if not (sep and key.strip()):
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, got {text!r}")
    return key.strip().lower(), value.strip()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, type=_target, help="HOST:PORT of the ext_proc server")
    p.add_argument("--api-key", default="demo-key", help="x-api-key sent ('' for none; demo-key)")
    add_json(p, "the result as one JSON object")
    one = p.add_argument_group("one conversation (without --load)")
    one.add_argument(
        "--prompt",
        default=DEFAULT_PROMPT,
        help="the user message of the chat request sent (default: a one-line question)",
    )
    one.add_argument(
        "--body",
        metavar="FILE",
        help="send this file as the request body (an OpenAI request) instead of --prompt",
    )
    one.add_argument(
        "--max-tokens",
        type=token_count,
        default=128,
        help="max_tokens of the chat request built from --prompt (default 128)",
    )
    one.add_argument(
        "--header",
        type=_header,
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="an extra request header (repeat)",
    )
    one.add_argument(
        "--usage",
        type=_usage,
        metavar="PROMPT_TOKENS:COMPLETION_TOKENS",
        help="also send the response phase, a JSON body with this usage (the server "
        "learns from it; default: the request phase only, released when the stream closes)",
    )
    load = p.add_argument_group("load (--load)")
    load.add_argument(
        "--load",
        action="store_true",
        help="run a load test from the Rust client instead of one conversation",
    )
    load.add_argument(
        "--rate",
        type=positive_float,
        help="conversations started per second, paced (default: closed loop)",
    )
    load.add_argument(
        "--concurrency",
        type=streams,
        default=8,
        help="streams in flight at once (default 8)",
    )
    load.add_argument(
        "--requests",
        type=positive_int,
        default=200,
        help="conversations to run (default 200)",
    )
    load.add_argument(
        "--duration",
        type=positive_float,
        metavar="SECONDS",
        help="stop starting conversations after this many seconds (default: no limit)",
    )
    load.add_argument(
        "--body-bytes",
        type=body_size,
        default=1024,
        help="size of each request body, a chat request padded to it (default 1024)",
    )
    load.add_argument(
        "--server-pid",
        type=pid,
        help="the server's process id: report its CPU time and context switches per conversation",
    )
    load.add_argument(
        "--threads",
        type=int_in(1, 256),
        default=1,
        help="client threads (default 1)",
    )
    load.add_argument(
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
        help="give up connecting or waiting for an answer after this long; under --load a "
        "step past it counts as DEADLINE_EXCEEDED (default 10)",
    )
    one.add_argument(
        "--wait",
        type=delay_s,
        default=0.0,
        metavar="SECONDS",
        help="keep trying a target that refuses the connection (a server still starting) for "
        "up to this long (default 0: a refused connection is an error at once; a server that "
        "accepts and stalls is given --timeout)",
    )


def run(args: argparse.Namespace) -> int:
    return run_load(args) if args.load else run_one(args)


#: Channel options of the single conversation: a refused connection is
#: retried every 0.2 s to 1 s (gRPC's default backoff grows to 2 minutes).
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]


async def connect(channel: Any, target: str, timeout_s: float, wait_s: float) -> None:
    """Waits until ``channel`` is ready. A connection that fails (refused:
    nothing listens there) is an ``OSError`` at once, or once ``wait_s`` has
    passed; one that neither fails nor completes (a server that stalls) is an
    ``OSError`` after ``timeout_s`` (or ``wait_s``, the longer)."""
    import grpc

    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + max(timeout_s, wait_s)
    state = channel.get_state(try_to_connect=True)
    while state != grpc.ChannelConnectivity.READY:
        now = loop.time()
        if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE and now - start >= wait_s:
            raise OSError(
                f"cannot connect to {target}: connection refused or unreachable "
                "(is routecore serve running there?)"
            )
        try:
            await asyncio.wait_for(channel.wait_for_state_change(state), deadline - now)
        except asyncio.TimeoutError:
            waited = max(timeout_s, wait_s)
            raise OSError(f"cannot connect to {target} within {waited:g} s") from None
        state = channel.get_state(try_to_connect=True)


def converse(args: argparse.Namespace) -> dict[str, Any]:
    """One conversation against ``args.target``, as Envoy would hold it."""
    require("server", "grpc", "envoy")
    import grpc

    from routecore.server.envoy_client import buffered, chat_body, usage_body

    if args.body is not None:
        with open(args.body, "rb") as f:
            body = f.read()
    else:
        body = chat_body(args.prompt, args.max_tokens)
    headers = dict(args.header)
    if args.api_key:
        headers["x-api-key"] = args.api_key
    response = None if args.usage is None else [usage_body(*args.usage)]

    async def talk() -> dict[str, Any]:
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

        async with grpc.aio.insecure_channel(args.target, options=RECONNECT) as channel:
            await connect(channel, args.target, args.timeout, args.wait)
            stub = pb_grpc.ExternalProcessorStub(channel)
            try:
                conv = await asyncio.wait_for(buffered(stub, headers, body, response), args.timeout)
            except grpc.aio.AioRpcError as e:
                raise OSError(f"{args.target} answered {e.code().name}: {e.details()}") from None
            except asyncio.TimeoutError:
                raise OSError(f"no answer from {args.target} within {args.timeout:g} s") from None
        immediate = conv.immediate
        routing = conv.routing_headers
        endpoints = conv.endpoints
        return {
            "target": args.target,
            "routed": bool(routing),
            "http_status": immediate.status.code if immediate is not None else None,
            "endpoint": endpoints[0] if endpoints else None,
            "fallbacks": endpoints[1:],
            "pool": routing.get("x-routecore-pool"),
            "added_ms": conv.added_s * 1e3,
            "answers": conv.envoy_view(),
        }

    return asyncio.run(talk())


def format_conversation(result: dict[str, Any]) -> str:
    """The answers one by one, then the outcome in one line."""
    lines = []
    for a in result["answers"]:
        if a["phase"] == "immediate_response":
            lines.append(f"{a['phase']}: HTTP {a['http_status']}")
            lines += [f"  header {k}: {v}" for k, v in a["headers"].items()]
            if a["body"]:
                lines.append(f"  body: {a['body']}")
        else:
            extra = " clear_route_cache" if a.get("clear_route_cache") else ""
            lines.append(f"{a['phase']}: {a['status']}{extra}")
            lines += [f"  set {k}: {v}" for k, v in a["set_headers"].items()]
            lines += [f"  remove {k}" for k in a.get("remove_headers", [])]
            if "body_replaced_bytes" in a:
                lines.append(f"  body replaced: {a['body_replaced_bytes']} bytes")
        if "dynamic_metadata" in a:
            lines.append(f"  dynamic metadata: {json.dumps(a['dynamic_metadata'])}")
    if result["routed"]:
        fallbacks = ", ".join(result["fallbacks"]) or "none"
        outcome = f"routed to {result['endpoint']} (pool {result['pool']}; fallbacks {fallbacks})"
    elif result["http_status"] is not None:
        outcome = f"refused: HTTP {result['http_status']}"
    else:
        outcome = "not routed"
    lines.append(f"{outcome}; added latency {result['added_ms']:.2f} ms")
    return "\n".join(lines)


def run_one(args: argparse.Namespace) -> int:
    result = converse(args)
    print(json.dumps(result) if args.json else format_conversation(result))
    return 0 if result["routed"] else 1


def run_load(args: argparse.Namespace) -> int:
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
