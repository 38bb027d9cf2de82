"""A client that drives ext_proc conversations the way Envoy does (for tests and load).

BUFFERED mode: request headers, then the whole body, then the response
headers and body, each message answered before the next is sent. The
*added latency* of a request is the time Envoy waits on the processor before
it can forward the request upstream: the headers and body round trips.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc


def http_headers(pairs: dict[str, str], end_of_stream: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
        ),
        end_of_stream=end_of_stream,
    )


def chat_body(text: str, max_tokens: int | None = 100, stream: bool = False) -> bytes:
    body: dict = {"model": "m", "messages": [{"role": "user", "content": text}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def usage_body(prompt_tokens: int, completion_tokens: int) -> bytes:
    return json.dumps(
        {
            "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
        }
    ).encode()


def sse_chunks(prompt_tokens: int, completion_tokens: int, pieces: int = 3) -> list[bytes]:
    """A streamed chat response: ``pieces`` delta events, a usage event, [DONE]."""
    events = [{"choices": [{"delta": {"content": f"tok{i}"}}]} for i in range(pieces)] + [
        {
            "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
        }
    ]
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    raw = text.encode()
    step = max(1, len(raw) // (pieces + 2))  # cut across event boundaries on purpose
    return [raw[i : i + step] for i in range(0, len(raw), step)]


def header_map(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


@dataclass
class Conversation:
    """What the processor answered in one conversation."""

    responses: list[pb.ProcessingResponse] = field(default_factory=list)
    #: Seconds spent waiting on the processor before the request could go upstream.
    added_s: float = 0.0

    @property
    def immediate(self) -> pb.ImmediateResponse | None:
        for r in self.responses:
            if r.HasField("immediate_response"):
                return r.immediate_response
        return None

    @property
    def routing(self) -> pb.ProcessingResponse | None:
        """The answer that carries the routing headers."""
        for r in self.responses:
            kind = r.WhichOneof("response")
            if kind in ("request_headers", "request_body"):
                mutation = getattr(r, kind).response.header_mutation
                if any(
                    h.header.key == "x-gateway-destination-endpoint" for h in mutation.set_headers
                ):
                    return r
        return None

    @property
    def routing_headers(self) -> dict[str, str]:
        r = self.routing
        if r is None:
            return {}
        return header_map(getattr(r, r.WhichOneof("response")).response.header_mutation)


async def buffered(
    stub: pb_grpc.ExternalProcessorStub,
    headers: dict[str, str],
    body: bytes | None,
    response_chunks: list[bytes] | None = None,
    response_headers: dict[str, str] | None = None,
) -> Conversation:
    """One BUFFERED-mode conversation, message by message as Envoy sends them."""
    conv = Conversation()
    call = stub.Process()

    async def exchange(req: pb.ProcessingRequest) -> bool:
        await call.write(req)
        resp = await call.read()
        if resp is grpc.aio.EOF:
            return False
        conv.responses.append(resp)
        return not resp.HasField("immediate_response")

    start = time.perf_counter()
    ok = await exchange(pb.ProcessingRequest(request_headers=http_headers(headers, body is None)))
    if ok and body is not None:
        ok = await exchange(
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
        )
    conv.added_s = time.perf_counter() - start
    if ok and response_chunks is not None:
        rh = response_headers or {":status": "200", "content-type": "application/json"}
        ok = await exchange(pb.ProcessingRequest(response_headers=http_headers(rh)))
        for i, chunk in enumerate(response_chunks):
            last = i == len(response_chunks) - 1
            if not (
                ok
                and await exchange(
                    pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=last))
                )
            ):
                break
    await call.done_writing()
    call.cancel()
    return conv


async def run_load(
    target: str,
    requests: int,
    concurrency: int = 32,
    rate: float | None = None,
    api_key: str = "demo-key",
) -> dict[str, float]:
    """Drives ``requests`` whole conversations against ``target``.

    Closed loop with ``concurrency`` workers, or open loop at ``rate``
    requests/s when given. Returns throughput and added latency p50/p99 (ms).
    """
    body = chat_body("Summarise the following text. " * 40, 200)
    usage = [usage_body(300, 50)]
    latencies: list[float] = []
    errors = 0
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        start = time.perf_counter()
        counter = iter(range(requests))

        async def worker() -> None:
            nonlocal errors
            for i in counter:
                if rate is not None:
                    delay = start + i / rate - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                conv = await buffered(stub, {"x-api-key": api_key}, body, usage)
                if conv.routing is None:
                    errors += 1
                latencies.append(conv.added_s)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "requests": requests,
        "errors": errors,
        "seconds": elapsed,
        "throughput_rps": requests / elapsed,
        "p50_ms": latencies[len(latencies) // 2] * 1e3,
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3,
    }


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(config: str, port: int, metrics_port: int, *extra: str) -> list[str]:
    """The command line that runs ``routecore serve`` with this interpreter."""
    import sys

    return [
        sys.executable,
        "-m",
        "routecore.cli",
        "serve",
        "--config",
        config,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--api-port",
        str(free_port()),
        *extra,
    ]


def load_report(
    config: str, requests: int, concurrency: int = 32, rate: float | None = None
) -> dict[str, dict[str, float]]:
    """Starts ``routecore serve --config config`` in its own process and measures it.

    Three runs of ``requests`` conversations each: closed loop with
    ``concurrency`` workers (throughput), one at a time (added latency with no
    queueing), and, when ``rate`` is given, open loop at ``rate`` requests/s.
    Each run also reports the server process's CPU time per request.
    """
    import subprocess

    port = free_port()
    cmd = serve_command(config, port, free_port(), "--log-level", "warning")
    proc = subprocess.Popen(cmd)
    target = f"127.0.0.1:{port}"

    def cpu_s() -> float:
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    async def measure() -> dict[str, dict[str, float]]:
        async with grpc.aio.insecure_channel(target) as channel:
            await asyncio.wait_for(channel.channel_ready(), 60)
        runs = {"closed_loop": (concurrency, None), "sequential": (1, None)}
        if rate is not None:
            runs[f"paced_{rate:g}_rps"] = (max(concurrency, 64), rate)
        report = {}
        for name, (workers, r) in runs.items():
            before = cpu_s()
            result = await run_load(target, requests, workers, r)
            result["server_cpu_ms_per_request"] = (cpu_s() - before) / requests * 1e3
            report[name] = result
        return report

    try:
        return asyncio.run(measure())
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Load test a routecore ext_proc server.")
    p.add_argument("--config", default="examples/routecore.yaml")
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rate", type=float, default=1000.0)
    a = p.parse_args()
    print(json.dumps(load_report(a.config, a.requests, a.concurrency, a.rate), indent=2))


if __name__ == "__main__":
    main()
