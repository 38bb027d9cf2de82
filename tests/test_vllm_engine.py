"""vllm_engine.start_all: an engine that exits because a port it binds was
taken while it loaded starts again on fresh ports; any other exit is an error
at once. A stand-in plays vLLM (a small HTTP server in Python that binds its
port and answers /health): no vLLM runs here (about 3 s)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from vllm_engine import TRIES, VllmEngine, start_all

SERVE = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""

#: vLLM's way to fail on a taken port: the engine core's ZeroMQ error, then a
#: long traceback of the API server, so the error is far from the log's end.
BURIED = (
    """
import socket, sys
probe = socket.socket()
try:
    probe.bind(("127.0.0.1", int(sys.argv[1])))
except OSError as e:
    print(e)
    print("\\n".join(f"the API server's traceback, line {i}" for i in range(100)))
    sys.exit(1)
probe.close()
"""
    + SERVE
)


class StandIn(VllmEngine):
    """Runs ``script`` (argv[1]: the port) instead of vLLM; its ports are
    taken from ``ports`` while it has some (then free ones)."""

    def __init__(self, workdir: Path, script: str = SERVE, ports: list[int] | None = None):
        self.script = script
        self.ports = list(ports or [])
        super().__init__(workdir / "model", workdir)

    def new_ports(self) -> None:
        super().new_ports()
        if self.ports:
            self.port = self.ports.pop(0)
            self.log = self.workdir / f"vllm-{self.port}.log"

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script, str(self.port)]


def listening() -> socket.socket:
    """A socket listening on a free loopback port (a port another process took)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_an_engine_whose_port_was_taken_starts_again_on_fresh_ports(tmp_path):
    with listening() as taken:
        port = taken.getsockname()[1]
        engine = StandIn(tmp_path, ports=[port])
        assert engine.port == port
        try:
            start_all([engine])
            assert engine.port != port and engine.healthy()
            first = (tmp_path / f"vllm-{port}.log").read_text()
            assert "Address already in use" in first
        finally:
            engine.stop()


def test_a_taken_port_far_above_the_logs_end_starts_again(tmp_path):
    with listening() as taken:
        port = taken.getsockname()[1]
        engine = StandIn(tmp_path, script=BURIED, ports=[port])
        try:
            start_all([engine])
            assert engine.port != port and engine.healthy()
        finally:
            engine.stop()


def test_a_port_taken_at_every_start_fails_after_the_last(tmp_path):
    held = [listening() for _ in range(TRIES)]
    try:
        engine = StandIn(tmp_path, ports=[s.getsockname()[1] for s in held])
        with pytest.raises(RuntimeError, match=f"start {TRIES} of {TRIES}"):
            start_all([engine])
    finally:
        for s in held:
            s.close()


def test_any_other_exit_fails_at_once(tmp_path):
    engine = StandIn(tmp_path, script="import sys; sys.exit('no model here')")
    port = engine.port
    with pytest.raises(RuntimeError, match=f"start 1 of {TRIES}") as e:
        start_all([engine])
    assert "no model here" in str(e.value) and engine.port == port
