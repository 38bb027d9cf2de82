"""``routecore serve``: one grpc.aio server with the ext_proc processor, the
RouteCore service and ``grpc.health.v1``, Prometheus metrics on their own
port, SIGHUP reload and graceful shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from routecore._core import Calibrator
from routecore.config import ConfigError, load_config
from routecore.server.engine import EngineHolder
from routecore.server.extproc import ExternalProcessor
from routecore.server.gen import routecore_pb2_grpc
from routecore.server.logs import log
from routecore.server.metrics import Metrics
from routecore.server.service import RouteCoreService

#: The services the health service reports on ("" is the server as a whole).
SERVICES = (
    "",
    "envoy.service.ext_proc.v3.ExternalProcessor",
    "routecore.v1.RouteCore",
)


def check_port_free(host: str, port: int) -> None:
    """Raises OSError when ``host:port`` cannot be listened on (gRPC would log
    its own multi-line error first)."""
    family, kind, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from e


class Server:
    """A routecore server for one configuration file.

    ``port`` / ``metrics_port`` override the file's (0 picks a free port;
    ``metrics_port=None`` with ``serve_metrics=False`` runs without metrics).
    """

    def __init__(
        self,
        config_path: str | Path,
        port: int | None = None,
        metrics_port: int | None = None,
        serve_metrics: bool = True,
    ) -> None:
        self.config_path = Path(config_path)
        self.config = load_config(self.config_path)
        s = self.config.server
        self.port = s.port if port is None else port
        self.metrics_port = s.metrics_port if metrics_port is None else metrics_port
        self.serve_metrics = serve_metrics
        self.metrics = Metrics()
        self.state_file = Path(s.state_file) if s.state_file else None
        calibrator = None
        if self.state_file is not None and self.state_file.exists():
            try:  # a bad snapshot is a ValueError (Calibrator.from_bytes)
                calibrator = Calibrator.from_bytes(self.state_file.read_bytes())
            except (ValueError, OSError) as e:
                log(logging.ERROR, "state-file-invalid", path=str(self.state_file), error=str(e))
                raise ConfigError(f"server.state_file {self.state_file}: {e}") from e
        try:
            self.holder = EngineHolder(self.config, self.metrics, calibrator)
        except (TypeError, ValueError, KeyError) as e:
            raise ConfigError(f"{self.config_path}: {e}") from e
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._metrics_server = None
        self._reaper: asyncio.Task | None = None
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        limit = self.config.limits.max_message_bytes
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),  # a busy port is an error, not a shared one
            ]
        )
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(self.holder), self._server
        )
        routecore_pb2_grpc.add_RouteCoreServicer_to_server(
            RouteCoreService(self.holder), self._server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        address = f"{self.config.server.host}:{self.port}"
        if self.port:
            check_port_free(self.config.server.host, self.port)
        try:
            self.port = self._server.add_insecure_port(address)
        except RuntimeError as e:  # grpc: "Failed to bind to address ..."
            raise OSError(f"cannot listen on {address} (in use?)") from e
        if self.port == 0:
            raise OSError(f"cannot listen on {address} (in use?)")
        await self._server.start()
        for name in SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.serve_metrics:
            self._metrics_server, _ = self.metrics.serve(self.metrics_port, self.config.server.host)
            self.metrics_port = self._metrics_server.server_port
        self._reaper = asyncio.create_task(self._reap_forever())
        log(
            logging.INFO,
            "started",
            port=self.port,
            metrics_port=self.metrics_port,
            pools=[p.name for p in self.config.pools],
            tenants=len(self.config.tenants),
        )

    async def _reap_forever(self) -> None:
        """Releases requests whose response never came back and settles what
        failed admission calls left behind, a few times per timeout."""
        period = min(1.0, self.config.limits.request_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                n = self.holder.reap(time.monotonic())
                await self.holder.reconcile()
            except Exception:
                log(logging.ERROR, "reap-failed", exc_info=True)
                continue
            if n:
                log(logging.WARNING, "requests-timed-out", count=n)

    def reload(self) -> bool:
        """Re-reads the configuration file; on any error (a bad file, a backend
        that cannot be built from it) the running configuration is kept and a
        ``reload-failed`` event is logged.

        The listening ports and the message size limit stay as started.
        """
        try:
            config = load_config(self.config_path)
            self.holder.reload(config)
        except Exception as e:  # a signal handler: nothing may escape
            log(logging.ERROR, "reload-failed", error=f"{type(e).__name__}: {e}")
            return False
        self.config = config
        log(
            logging.INFO,
            "reloaded",
            pools=[p.name for p in config.pools],
            tenants=len(config.tenants),
        )
        return True

    async def stop(self, grace: float | None = None) -> None:
        """Stops taking new streams and gives open ones ``grace`` seconds to finish."""
        grace = self.config.server.grace_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.to_thread(self.holder.close)
        if self.state_file is not None:
            tmp = self.state_file.with_name(self.state_file.name + ".tmp")
            tmp.write_bytes(self.holder.engine.router.calibrator.to_bytes())
            tmp.replace(self.state_file)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        log(logging.INFO, "stopped")

    async def serve_forever(self) -> None:
        """Runs until SIGTERM or SIGINT; SIGHUP reloads the configuration."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        await self.start()
        await self._stopping.wait()
        await self.stop()
