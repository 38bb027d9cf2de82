"""Shared pytest fixtures."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import realstack
from envoy_proxy import Envoy
from server_fixtures import Running, base_config
from setup_errors import pytest_runtest_makereport  # noqa: F401 (a hook: errors at setup)


class RedisServer:
    """A throwaway redis-server on 127.0.0.1, no persistence; ``kill`` and
    ``start`` let a test take it down and bring it back (empty) on one port,
    ``stop`` and ``cont`` freeze and thaw it (SIGSTOP, SIGCONT)."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed: run scripts/setup")
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.kill()
        pytest.fail("redis-server did not start")

    @property
    def pid(self) -> int:
        assert self.proc is not None, "redis-server is not running"
        return self.proc.pid

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Running]]:
    """Starts ``routecore serve`` with ``base_config(**overrides)`` (see
    server_fixtures.py) as often as a test asks; stops every one after it."""
    started: list[Running] = []

    def start(**overrides) -> Running:
        r = Running(tmp_path / f"routecore{len(started)}.yaml", base_config(**overrides))
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


@pytest.fixture
def envoy(tmp_path: Path) -> Iterator[Callable[..., Envoy]]:
    """Starts a real Envoy with a configuration (a dict, e.g.
    ``envoy_proxy.shipped_config(...)``; ``access_log=True`` for its access
    log) as often as a test asks, each ready on its ports; kills every one
    after the test."""
    started: list[Envoy] = []

    def start(config: dict, access_log: bool = False) -> Envoy:
        e = Envoy(config, tmp_path, access_log)
        started.append(e)
        return e

    yield start
    for e in started:
        e.stop()


# -- the real stack (marker realstack): real vLLM engines, Redis, routecore, Envoy --


@pytest.fixture(scope="session")
def _real_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[realstack.Stack]:
    yield from realstack.running(tmp_path_factory.mktemp("realstack"), RedisServer())


@pytest.fixture
def stack(_real_stack: realstack.Stack) -> realstack.Stack:
    """The real stack of tests/realstack.py, started once per session; any
    engine or replica an earlier test killed is running again."""
    _real_stack.revive()
    return _real_stack
