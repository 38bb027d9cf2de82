"""A routecore server running in a background event loop, for the server tests."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import yaml

from routecore.admission import InMemoryAdmission
from routecore.server.app import Server

SHORT = ["127.0.0.1:8001", "127.0.0.1:8002"]
LONG = ["127.0.0.1:8011"]


def base_config(**overrides) -> dict:
    """Two pools (short 8K, long 64K) and two tenants (one expired)."""
    config = {
        "server": {"host": "127.0.0.1", "failure_mode": "closed", "grace_s": 1},
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

    def __init__(self, path: Path, config: dict) -> None:
        path.write_text(yaml.safe_dump(config))
        self.path = path
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def make() -> Server:
            server = Server(path, port=0, metrics_port=0)
            await server.start()
            return server

        try:
            self.server: Server = self.call(make())
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            raise
        self.target = f"127.0.0.1:{self.server.port}"

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def run(self, fn, *args):
        """Runs ``fn(*args)`` on the server's loop thread (where the engine lives)."""

        async def wrapper():
            return fn(*args)

        return self.call(wrapper())

    @property
    def engine(self):
        return self.server.holder.engine

    def stop(self) -> None:
        self.call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def in_flight(r: Running) -> dict[str, int]:
    """Everything a request holds while in flight, summed over the live engines:
    leases, the router's in-flight counts, the endpoint choosers' loads (and
    their core routers' running counts), the in-memory admission pools'
    in-flight counts and the in-flight gauge. Waits for completions handed to the thread pool."""
    for engine in r.server.holder.engines:
        engine.drain(10)

    def read() -> dict[str, int]:
        out: dict[str, int] = {}

        def add(key: str, value: int) -> None:
            out[key] = out.get(key, 0) + int(value)

        for engine in r.server.holder.engines:
            add("leases", len(engine.leases))
            for pool in engine.config.pools:
                add(f"router:{pool.name}", engine.router.in_flight(pool.name))
            for name, chooser in engine.choosers.items():
                add(f"chooser:{name}", sum(chooser.load.values()))
                running = getattr(getattr(chooser, "router", None), "running", None)
                if running is not None:
                    add(f"chooser-running:{name}", sum(running))
            # A Redis backend's counts are read from Redis by the tests that use one.
            if isinstance(engine.admission, InMemoryAdmission) and engine.owns_admission:
                for pool in engine.config.admission.spec.get("pools", []):
                    add(f"admission:{pool['name']}", engine.admission.pool_in_flight(pool["name"]))
        gauge = r.server.metrics.in_flight.collect()[0].samples
        add("gauge", sum(sample.value for sample in gauge))
        return out

    return r.run(read)


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
