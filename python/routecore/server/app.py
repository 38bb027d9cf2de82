"""``routecore serve``: the control plane around the Rust data plane.

Envoy's ext_proc, ``grpc.health.v1`` and the Prometheus metrics are served by
:class:`routecore.DataPlane` (Rust, its own tokio runtime). This module reads
and validates the configuration, starts the data plane, serves the RouteCore
API (grpcio, on its own port, over the same Rust state), owns the signals
(SIGHUP: validate, then swap the configuration atomically; SIGTERM: drain
until the last open stream ends, within the grace period) and the state
file, and writes the control plane's log events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from routecore._core import Calibrator, DataPlane
from routecore.config import ConfigError, load_config
from routecore.server.engine import Engine
from routecore.server.gen import routecore_pb2_grpc
from routecore.server.logs import log, logger
from routecore.server.service import RouteCoreService

#: The services the RouteCore API port's health service reports on.
API_SERVICES = ("", "routecore.v1.RouteCore")


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    """Sets ``future``'s result unless its waiter was cancelled meanwhile."""
    if not future.done():
        future.set_result(value)


def check_port_free(host: str, port: int) -> None:
    """Raises OSError when ``host:port`` cannot be listened on (gRPC would log
    its own multi-line error first)."""
    family, kind, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
        except OSError as e:
            raise OSError(e.strerror) from e


class Server:
    """A routecore server for one configuration file.

    ``port`` / ``api_port`` / ``metrics_port`` override the file's (0 picks a
    free port; ``serve_metrics=False`` runs without metrics).
    """

    def __init__(
        self,
        config_path: str | Path,
        port: int | None = None,
        metrics_port: int | None = None,
        serve_metrics: bool = True,
        api_port: int | None = None,
    ) -> None:
        self.config_path = Path(config_path)
        self.config = load_config(self.config_path)
        s = self.config.server
        self.port = s.port if port is None else port
        self.api_port = s.api_port if api_port is None else api_port
        self.metrics_port = s.metrics_port if metrics_port is None else metrics_port
        self.serve_metrics = serve_metrics
        self.state_file = Path(s.state_file) if s.state_file else None
        self.calibrator_state: bytes | None = None
        if self.state_file is not None and self.state_file.exists():
            try:  # a bad snapshot is a ValueError (Calibrator.from_bytes)
                state = self.state_file.read_bytes()
                Calibrator.from_bytes(state)
            except (ValueError, OSError) as e:
                log(logging.ERROR, "state-file-invalid", path=str(self.state_file), error=str(e))
                raise ConfigError(f"server.state_file {self.state_file}: {e}") from e
            self.calibrator_state = state
        self.plane: DataPlane | None = None
        self.health = health.aio.HealthServicer()
        self._api: grpc.aio.Server | None = None
        self._stopping = asyncio.Event()
        self._ready: asyncio.Task[None] | None = None

    @property
    def engine(self) -> Engine:
        """A view of the data plane's routing state."""
        assert self.plane is not None, "the server is not started"
        return Engine(self.plane, [p.name for p in self.config.pools])

    async def start(self) -> None:
        s = self.config.server
        try:
            self.plane = DataPlane.start(
                self.config.spec_json(),
                s.host,
                self.port,
                self.metrics_port if self.serve_metrics else None,
                s.worker_threads,
                self.calibrator_state,
                logger.getEffectiveLevel(),
                tokenizers=self.config.tokenizers(),
                unix_socket=s.unix_socket or None,
                unix_socket_mode=int(s.unix_socket_mode, 8),
            )
        except ValueError as e:
            raise OSError(str(e)) from e
        self.port = self.plane.port
        self.metrics_port = self.plane.metrics_port
        limit = self.config.limits.max_message_bytes
        self._api = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ]
        )
        routecore_pb2_grpc.add_RouteCoreServicer_to_server(
            RouteCoreService(self.plane, s.key_header), self._api
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._api)
        address = f"{s.host}:{self.api_port}"
        try:
            if self.api_port:
                check_port_free(s.host, self.api_port)
            self.api_port = self._api.add_insecure_port(address)
        except (OSError, RuntimeError) as e:  # grpc: "Failed to bind to address ..."
            self.plane.drain(0)
            raise OSError(f"cannot listen on {address}: {e}") from e
        await self._api.start()
        for name in API_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._ready = asyncio.create_task(self._serving_when_ready(self.plane))
        log(
            logging.INFO,
            "started",
            port=self.port,
            api_port=self.api_port,
            metrics_port=self.metrics_port,
            unix_socket=s.unix_socket or None,
            pools=[p.name for p in self.config.pools],
            tenants=len(self.config.tenants),
        )

    async def _serving_when_ready(self, plane: DataPlane) -> None:
        """Reports the API SERVING once the data plane is ready (its endpoints'
        state synced, its admission backend warm), as Envoy is told on its port:
        woken by the data plane when it is (or when a drain comes first)."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[bool] = loop.create_future()

        def wait() -> None:
            ok = plane.wait_ready()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, ready, ok)

        # A daemon thread of its own: a data plane never drained holds up no exit.
        threading.Thread(target=wait, name="routecore-ready", daemon=True).start()
        if not await ready:
            return
        for name in API_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def reload(self) -> bool:
        """Re-reads the configuration file; on error the running one is kept.

        The listening ports, the message size limit and the worker threads
        stay as started.
        """
        try:
            config = load_config(self.config_path)
            assert self.plane is not None
            self.plane.reload(config.spec_json(), tokenizers=config.tokenizers())
        except (ConfigError, OSError, ValueError) as e:
            log(logging.ERROR, "reload-failed", error=str(e))
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
        """Stops taking new streams and gives open ones ``grace`` seconds to finish
        (None: ``server.grace_s``; that left out, until the last one ends, at most
        ``limits.request_timeout_s``)."""
        if grace is None:
            grace = self.config.server.grace_s
        if grace is None:
            grace = self.config.limits.request_timeout_s
        if self._ready is not None:
            self._ready.cancel()
        await self.health.enter_graceful_shutdown()
        plane = self.plane
        stops = [self._api.stop(grace)] if self._api is not None else []
        if plane is not None:
            stops.append(asyncio.to_thread(plane.drain, grace))
        await asyncio.gather(*stops)
        if plane is not None and self.state_file is not None:
            tmp = self.state_file.with_name(self.state_file.name + ".tmp")
            tmp.write_bytes(plane.calibrator.to_bytes())
            tmp.replace(self.state_file)
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
