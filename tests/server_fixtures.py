"""A routecore server running in a background event loop, for the server tests."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import redis
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from routecore.server.app import Server
from routecore.server.envoy_client import Conversation, buffered

SHORT = ["127.0.0.1:8001", "127.0.0.1:8002"]
LONG = ["127.0.0.1:8011"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(
    config: str, port: int, metrics_port: int, *extra: str, api_port: int | None = None
) -> list[str]:
    """The command line that runs ``routecore serve`` with this interpreter
    (the RouteCore API on ``api_port``, None: a free port)."""
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
        str(free_port() if api_port is None else api_port),
        *extra,
    ]


EXAMPLE = Path(__file__).resolve().parent.parent / "examples/routecore.yaml"


def example_without_engines(directory: Path) -> Path:
    """examples/routecore.yaml with scraping off (nothing listens at its
    endpoints), flow control's detector the one that needs no scrape (as
    ``routecore init-config --no-scrape`` writes it)."""
    config = yaml.safe_load(EXAMPLE.read_text())
    config["scrape"] = {"enabled": False}
    config["flow_control"]["saturation"]["detector"] = "concurrency"
    path = directory / "example.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def base_config(**overrides) -> dict:
    """Two pools (short 8K, long 64K) and two tenants (one expired). Nothing
    listens at the endpoints: they are not scraped (tests of the engines'
    state start mock engines, see mock_engine.py)."""
    config = {
        "server": {"host": "127.0.0.1", "failure_mode": "closed", "grace_s": 1},
        "scrape": {"enabled": False},
        "limits": {"max_body_bytes": 200_000, "request_timeout_s": 30},
        "pools": [
            {"name": "short", "max_context": 8192, "endpoints": list(SHORT)},
            {"name": "long", "max_context": 65536, "endpoints": list(LONG)},
        ],
        "tenants": [
            {"name": "demo", "api_keys": ["demo-key"]},
            {"name": "old", "api_keys": ["expired-key"], "expires_at": 1000},
        ],
    }
    for section, values in overrides.items():
        if isinstance(values, dict):
            config.setdefault(section, {}).update(values)
        else:
            config[section] = values
    return config


class Running:
    """A :class:`Server` on 127.0.0.1 (free ports) in its own loop thread."""

    def __init__(self, path: Path, config: dict, port: int = 0) -> None:
        """Serves ``config`` written to ``path``, ext_proc on ``port`` (0: a free one)."""
        path.write_text(yaml.safe_dump(config))
        self.path = path
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def make() -> Server:
            server = Server(path, port=port, metrics_port=0, api_port=0)
            await server.start()
            return server

        try:
            self.server: Server = self.call(make())
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            raise
        self.target = f"127.0.0.1:{self.server.port}"
        #: The RouteCore API (its own port).
        self.api_target = f"127.0.0.1:{self.server.api_port}"

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def run(self, fn, *args):
        """Runs ``fn(*args)`` on the server's loop thread (where the engine lives)."""

        async def wrapper():
            return fn(*args)

        return self.call(wrapper())

    @property
    def engine(self):
        return self.server.engine

    def metric(self, name: str, *labels: str) -> float:
        """A data plane metric by name (without ``routecore_``) and label values."""
        value = self.server.plane.metric(name, *labels)
        assert value is not None, f"unknown metric {name}"
        return value

    def stop(self) -> None:
        self.call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


class Spawned:
    """``routecore serve`` in its own process on free ports."""

    def __init__(
        self,
        path: Path,
        config: dict | None = None,
        *extra: str,
        ports: tuple[int, int, int] | None = None,
    ) -> None:
        """Serves ``config`` written to ``path`` (None: the file as it is),
        ``extra`` added to the command line, on ``ports`` (ext_proc, metrics,
        RouteCore API; None: free ports)."""
        if config is not None:
            path.write_text(yaml.safe_dump(config))
        self.path = path
        self.text = ""
        self.port, self.metrics_port, self.api_port = ports or (
            free_port(),
            free_port(),
            free_port(),
        )
        # Its log in a file: a pipe nobody reads would stall the server when full.
        fd, name = tempfile.mkstemp(suffix=".log")
        os.close(fd)
        self.log = Path(name)
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                serve_command(
                    str(path), self.port, self.metrics_port, *extra, api_port=self.api_port
                ),
                stderr=log,
            )
        self.target = f"127.0.0.1:{self.port}"
        #: The RouteCore API.
        self.api_target = f"127.0.0.1:{self.api_port}"

        async def ready():
            async with grpc.aio.insecure_channel(self.target) as channel:
                await asyncio.wait_for(channel.channel_ready(), 60)

        try:
            asyncio.run(ready())
        except BaseException:
            self.stop()
            raise

    def metric(self, name: str, **labels: str) -> float:
        """A metric from the metrics port, summed over the series carrying ``labels``."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
            text = r.read().decode()
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") and all(w in line for w in wanted)
        )

    def wait_gauge_zero(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while (n := self.metric("routecore_in_flight")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert n == 0, f"{n} requests still in flight"

    def stop(self) -> str:
        """Kills the server if it still runs; its log."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        if self.log.exists():  # read once, then removed
            self.text = self.log.read_text()
            self.log.unlink()
        return self.text


def admission(concurrency: int = 3, tokens_per_s: float = 1e6, **extra) -> dict:
    """One quota and the demo tenant's entitlement, ``concurrency`` slots and
    ``tokens_per_s`` each."""
    return {
        "quotas": [
            {
                "name": "gpu",
                "tokens_per_s": tokens_per_s,
                "kv_bytes": 10**12,
                "concurrency": concurrency,
            }
        ],
        "entitlements": [entitlement("demo", concurrency, tokens_per_s)],
        **extra,
    }


def entitlement(tenant: str, concurrency: int, tokens_per_s: float) -> dict:
    """``tenant``'s guaranteed entitlement ``{tenant}-std`` on the quota "gpu"."""
    return {
        "name": f"{tenant}-std",
        "tenant": tenant,
        "quota": "gpu",
        "service_class": "guaranteed",
        "slo_target_ms": 1000.0,
        "tokens_per_s": tokens_per_s,
        "kv_bytes": 10**12,
        "concurrency": concurrency,
    }


def tenants() -> list[dict]:
    """The base tenants, the demo tenant bound to ``admission()``'s entitlement."""
    t = base_config()["tenants"]
    t[0]["entitlement"] = "demo-std"
    return t


def in_flight(r: Running) -> dict[str, int]:
    """Everything a request holds while in flight, summed over the live engines
    of the data plane: leases, the router's in-flight counts, the endpoint
    choosers' loads, the in-memory admission tickets and the in-flight gauge."""
    state = r.server.plane.in_flight()
    out = {"leases": state["leases"], "admission": state["admission"]}
    for pool, n in state["router"].items():
        out[f"router:{pool}"] = n
    for pool, loads in state["chooser"].items():
        out[f"chooser:{pool}"] = sum(loads.values())
    text = r.server.plane.metrics_text()
    out["gauge"] = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("routecore_in_flight{")
    )
    return out


def wait_settled(r: Running, timeout: float = 5.0) -> dict[str, int]:
    """Polls :func:`in_flight` until every count is zero (streams end on the
    server a little after the client sees their end); fails with the counts."""
    deadline = time.monotonic() + timeout
    while True:
        counts = in_flight(r)
        if not any(counts.values()):
            return counts
        if time.monotonic() > deadline:
            raise AssertionError(f"still in flight: {counts}")
        time.sleep(0.02)


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Polls ``cond`` every 10 ms until it holds; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def redis_admission(url: str, failure_mode: str, concurrency: int = 3) -> dict:
    """``admission(concurrency)`` in Redis at ``url``, 0.5 s socket timeout."""
    return admission(
        concurrency,
        backend="redis",
        redis={"url": url, "failure_mode": failure_mode, "socket_timeout_s": 0.5},
    )


def redis_in_flight(url: str) -> int:
    """Reservations in flight in Redis, summed over the quotas."""
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        return sum(int(client.hget(k, "in_flight") or 0) for k in client.keys("*:quota"))
    finally:
        client.close()


def redis_unread_bytes(port: int) -> int:
    """Bytes clients sent to the redis-server listening on ``port`` that it has
    not read yet (the receive queues of its connections, /proc/net/tcp): above
    zero while a stopped server holds a command."""
    total = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if int(local.rsplit(":", 1)[1], 16) == port and state == "01":  # established
                total += int(queues.split(":")[1], 16)
    return total


async def until(predicate, timeout: float, what: str) -> None:
    """Polls ``predicate`` every 10 ms without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def wait_redis_settled(url: str, timeout: float = 5.0) -> None:
    """Polls :func:`redis_in_flight` until it is zero; fails with the count."""
    deadline = time.monotonic() + timeout
    while (n := redis_in_flight(url)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert n == 0, f"{n} reservations left in Redis"


def converse(target: str, *args, **kwargs) -> Conversation:
    """One buffered conversation (``envoy_client.buffered``) with the server at ``target``."""

    async def go():
        async with grpc.aio.insecure_channel(target) as channel:
            return await buffered(pb_grpc.ExternalProcessorStub(channel), *args, **kwargs)

    return asyncio.run(go())


def stream_all(target: str, messages: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    """Sends every message, then reads every answer (for the streamed body modes)."""
    with grpc.insecure_channel(target) as channel:
        return list(pb_grpc.ExternalProcessorStub(channel).Process(iter(messages)))
